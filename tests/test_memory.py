"""Forward temporary memory: the fused path holds no per-id gathered cores."""

import sys
from pathlib import Path

import pytest

import flowtt_jax as ftt
from flowtt_jax import ffi

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from memory_cpu import temp_bytes  # noqa: E402

pytestmark = pytest.mark.skipif(not ffi.available(), reason="compiled extension not built")


def test_fused_forward_temp_memory_does_not_grow_with_nnz_r2():
    spec = ftt.TTSpec.create(10**6, 32, 32)
    bag_len = 14
    small, large = (temp_bytes(spec, b, bag_len, "ffi") for b in (512, 4096))
    nnz = 4096 * bag_len
    # Per id: one unique row (D floats) plus a few int32 plan entries, never r^2 floats.
    per_id_budget = spec.embedding_dim * 4 + 16 * 4
    assert large <= nnz * per_id_budget
    assert large < nnz * 32 * 32 * 4 / 16
    # Growth from 512 to 4096 bags is linear in nnz with the same per-id bound.
    assert (large - small) <= (4096 - 512) * bag_len * per_id_budget
    # The XLA reference does materialise gathered cores: the check can tell them apart.
    assert temp_bytes(spec, 4096, bag_len, "reference") > nnz * 32 * 32 * 4
