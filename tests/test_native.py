"""The standalone C++ checks, built and run here (no GPU needed):

- ``tests/native/tb_rows_test.cc``: the CPU table-batched rows ops against the float64 oracle,
  invalid plans and shapes refused;
- ``tests/native/tb_rows_emu_test.cc``: the CUDA table-batched kernels' own code run in
  emulation (``tests/native/tb_emu.h``) against the oracle, with the paths a device run
  rarely takes (the dg1 merge fallback, groups past the P cache, both dg2 batch sizes)
  checked bit for bit against the usual ones, and invalid plans run to completion.
- ``tests/native/snake_slots_test.cc``: the backward tile kernel's deal of a batch's dP items
  to threads (``cuda/single/snake_slots.cuh``): a permutation, in rank order, optimal pairs.

Each prints PASS/FAIL lines and exits 1 on any failure. Skipped without a C++ compiler.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CXX = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")

# compiling and running the C++ checks takes minutes: CI runs them (-m slow --slow)
pytestmark = [pytest.mark.slow, pytest.mark.skipif(CXX is None, reason="no C++ compiler")]

CHECKS = {
    "cpu_tb_rows": ["tests/native/tb_rows_test.cc", "ffi/cpu/tb_rows.cc"],
    "cuda_tb_emulation": ["tests/native/tb_rows_emu_test.cc"],
    "cuda_snake_slots": ["tests/native/snake_slots_test.cc"],
}
# The include roots (CMakeLists.txt): the kernels' cuda/, the CPU twins' ffi/ (no XLA header
# is reached from these checks), the test helpers' tests/native/.
INCLUDE_ROOTS = ["cuda", "ffi", "tests/native"]


@pytest.mark.parametrize("name", list(CHECKS))
def test_native_check_passes(name, tmp_path):
    exe = tmp_path / name
    sources = [str(ROOT / s) for s in CHECKS[name]]
    includes = [f"-I{ROOT / d}" for d in INCLUDE_ROOTS]
    cmd = [CXX, "-std=c++17", "-O2", *includes, *sources, "-o", str(exe)]
    build = subprocess.run(cmd, capture_output=True, text=True)
    assert build.returncode == 0, build.stderr[-4000:]
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=900)
    failed = [line for line in run.stdout.splitlines() if line.startswith("FAIL")]
    assert run.returncode == 0 and not failed, "\n".join(failed[:20]) or run.stderr[-4000:]
    assert run.stdout.rstrip().endswith("PASS: 0 failure(s)")
    assert sum(line.startswith("PASS ") for line in run.stdout.splitlines()) >= 10
