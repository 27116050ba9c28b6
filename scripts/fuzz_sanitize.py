"""The fuzz corpus on the GPU under compute-sanitizer, and under CUDA_LAUNCH_BLOCKING=1.

    python scripts/fuzz_sanitize.py [--out DIR] [--cases N]
        [--tools blocking,memcheck,racecheck,initcheck,synccheck]

Runs the cases of ``tests/test_fuzz_corpus.py`` whose single-table or table-batched
kernels the GPU takes (``impl="ffi"``: forward, no-gradient forward, the fused forward in
chunks of 64 rows, gradients of cores and weights), in child processes:

1. ``plain``: as is; every result checked against the float64 oracle;
2. ``blocking`` (in ``--tools``): with ``CUDA_LAUNCH_BLOCKING=1``; results must equal
   plain's bit for bit;
3. one run per compute-sanitizer tool T in ``--tools``: ``compute-sanitizer --tool T
   --target-processes all`` with ``--kernel-name kns=flowtt`` (the flowtt kernels and the
   CUB sorts and scans they call, wrapped in namespace flowtt), except initcheck, which
   instruments every kernel (it tracks the writes of instrumented kernels only: filtered,
   every input an XLA kernel wrote reads as uninitialised); initcheck and synccheck with
   ``--check-api-memory-access no`` (XLA's copies of whole output buffers read their
   documented-unspecified tails). Its ``ERROR SUMMARY`` (racecheck: ``RACECHECK SUMMARY``)
   must say 0 errors and its results must equal plain's bit for bit. XLA's autotuning is
   off in every run.

The blocking and sanitizer runs go in chunks of ``--chunk`` cases, one child process each
(``FLOWTT_FUZZ_SEEDS``): compute-sanitizer itself dies (rc -11) now and then during an
XLA compile after a few dozen modules, and a chunk loses only its own cases; a chunk whose
process died of a signal is run again (``--retries``). Every child shares one JAX
persistent compilation cache (a temporary folder): the plain run compiles, the blocking and
sanitizer runs load its executables and compile nothing. ``--seeds A-B,C`` limits those
runs to part of the corpus (the plain run always takes all of it). One sanitizer process
at a time: four side by side on one H200 segfaulted before any result.

Writes ``DIR/<run>_<chunk>.log``, ``.npz`` and ``DIR/summary.json`` (default DIR:
``$OUT/fuzz_sanitize``, else ``./fuzz_sanitize_out``); exits 1 on any error, mismatch or
oracle failure, 2 without a GPU (``FLOWTT_FUZZ_ON_CPU=1 ... --tools blocking``: a dry run
of the plain and blocking steps on the CPU kernels). Needs the CUDA build (``FLOWTT_CUDA=ON
pip install --no-build-isolation --no-deps -e .``). racecheck is the slow one: ``--cases``
and ``--tools`` split the work across calls.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
TOOLS = ("memcheck", "racecheck", "initcheck", "synccheck")  # compute-sanitizer's


def _worker(out_path: Path, num_cases: int) -> int:
    sys.path.insert(0, str(ROOT))
    import jax

    from flowtt_jax import ffi
    from flowtt_jax.bag import prepare_bags
    from flowtt_jax.batched import kernels_unsupported_reason
    from flowtt_jax.batched_plan import GroupLayout
    from tests.test_fuzz_corpus import compare, corpus, make_cores, oracle, run

    jax.config.update("jax_default_matmul_precision", "highest")
    if jax.default_backend() != "gpu" and os.environ.get("FLOWTT_FUZZ_ON_CPU") != "1":
        print("no GPU backend (FLOWTT_FUZZ_ON_CPU=1: a dry run on the CPU kernels)", file=sys.stderr)
        return 2
    arrays, report = {}, {}
    only = {int(x) for x in os.environ.get("FLOWTT_FUZZ_SEEDS", "").split(",") if x}
    for case in corpus(num_cases) if num_cases else corpus():
        if only and case.seed not in only:
            continue
        cores = make_cores(case)
        if case.kind == "group":
            reason = kernels_unsupported_reason(GroupLayout(case.specs))
        else:
            reason = ffi.cuda_unsupported_reason(cores[0])
        if reason:
            report[case.seed] = {"case": case.describe(), "skipped": reason}
            continue
        t0 = time.perf_counter()
        got = run(case, "ffi", cores)
        bad = compare(got, oracle(case, cores))
        if case.kind == "bag" and case.ids.size and len(case.offsets) > 1:  # the fused forward in chunks
            spec = case.specs[0]
            bags = prepare_bags(
                case.ids,
                num_embeddings=spec.num_embeddings,
                oob=case.oob,
                offsets=case.offsets,
                segment_ids=None,
                num_bags=None,
                mask=None,
                weights=case.weights,
                mode=case.mode,
            )
            plan = ffi.plan(bags.ids, spec.row_shape[-1], spec.num_embeddings)
            chunked = np.asarray(ffi.bag_fwd(tuple(cores[0]), plan, bags.weights, bags.offsets, 64))
            got["out_chunks64"] = chunked
            if not np.allclose(
                chunked, got["out"], rtol=1e-5, atol=1e-5 * max(1.0, np.abs(got["out"]).max())
            ):
                bad.append("out_chunks64")
        report[case.seed] = {"case": case.describe(), "oracle_failures": bad, "s": time.perf_counter() - t0}
        for name, x in got.items():
            arrays[f"{case.seed}/{name}"] = x
        print(f"case {case.seed}: {case.describe()} {'OK' if not bad else bad}", flush=True)
    np.savez(out_path, **arrays)
    out_path.with_suffix(".json").write_text(json.dumps(report, indent=1))
    return 0


def _child(args: list[str], env: dict, log: Path, timeout: int) -> int:
    with open(log, "w") as f:
        try:
            return subprocess.run(
                args, env=env, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, timeout=timeout
            ).returncode
        except subprocess.TimeoutExpired:
            f.write(f"\nTIMEOUT after {timeout} s\n")
            return 124


def _parse_seeds(text: str) -> set[int]:
    """'0-3,9' -> {0, 1, 2, 3, 9}."""
    out: set[int] = set()
    for part in filter(None, text.split(",")):
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


def _same_bits(a: Path, b: Path, seeds: list[str]) -> list[str]:
    """The arrays of cases `seeds` that differ between a and b (or are missing in one)."""
    x, y = np.load(a), np.load(b)
    names = sorted(k for k in set(x.files) | set(y.files) if k.split("/")[0] in seeds)
    return [k for k in names if k not in x.files or k not in y.files or x[k].tobytes() != y[k].tobytes()]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--out", type=Path, default=Path(os.environ.get("OUT", "fuzz_sanitize_out")) / "fuzz_sanitize"
    )
    ap.add_argument("--cases", type=int, default=0, help="corpus cases (seeds 0..N-1; 0: all)")
    ap.add_argument(
        "--tools",
        default=",".join(("blocking",) + TOOLS),
        help="comma-separated runs after plain: blocking and compute-sanitizer tools",
    )
    ap.add_argument("--timeout", type=int, default=3000, help="seconds per child run")
    ap.add_argument(
        "--chunk", type=int, default=8, help="cases per child process of each tool and blocking run"
    )
    ap.add_argument("--retries", type=int, default=2, help="reruns of a chunk killed by a signal")
    ap.add_argument("--seeds", default="", help="the runs after plain on these seeds only: 'A-B,C'")
    ap.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return _worker(args.worker, args.cases)

    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    # every run without XLA's autotuning: its trial kernels would be instrumented under the
    # sanitizers, and a different pick between runs could change bits
    xla_flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_gpu_autotune_level=0".strip()
    env = {
        **os.environ,
        "XLA_PYTHON_CLIENT_PREALLOCATE": "false",
        "PYTHONUNBUFFERED": "1",
        "XLA_FLAGS": xla_flags,
        # one compilation cache for every child: the sanitized runs load, not compile
        "JAX_COMPILATION_CACHE_DIR": tempfile.mkdtemp(prefix="flowtt_fuzz_jax_cache_"),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "-1",
    }
    me = [sys.executable, str(Path(__file__).resolve()), "--cases", str(args.cases), "--worker"]
    summary, status = {"cases": args.cases, "runs": {}}, 0

    rc = _child(me + [str(out / "plain.npz")], env, out / "plain.log", args.timeout)
    if rc != 0:
        print(f"plain run failed (rc {rc}), see {out / 'plain.log'}")
        return 2 if rc == 2 else 1
    report = json.loads((out / "plain.json").read_text())
    failures = {k: v["oracle_failures"] for k, v in report.items() if v.get("oracle_failures")}
    ran = sum("skipped" not in v for v in report.values())
    summary["runs"]["plain"] = {
        "cases_run": ran,
        "cases_skipped": len(report) - ran,
        "oracle_failures": failures,
    }
    print(f"plain: {ran} cases on the kernels, {len(report) - ran} skipped, oracle failures: {failures or 0}")
    status |= bool(failures)

    runs = []
    for tool in filter(None, args.tools.split(",")):
        if tool == "blocking":
            runs.append((tool, {"CUDA_LAUNCH_BLOCKING": "1"}, []))
        elif tool in TOOLS:
            sanitizer = ["compute-sanitizer", "--tool", tool, "--target-processes", "all"]
            if tool in ("initcheck", "synccheck"):  # the kernels' own accesses, not XLA's
                sanitizer += ["--check-api-memory-access", "no"]  # whole-buffer copies
            if tool != "initcheck":  # initcheck tracks writes by instrumented kernels only
                sanitizer += ["--kernel-name", "kns=flowtt"]
            runs.append((tool, {}, sanitizer))
        else:
            ap.error(f"unknown run {tool!r}")
    seeds = sorted((k for k, v in report.items() if "skipped" not in v), key=int)
    if args.seeds:
        wanted = _parse_seeds(args.seeds)
        seeds = [k for k in seeds if int(k) in wanted]
    summary["seeds"] = [int(k) for k in seeds]
    chunks = [seeds[i : i + args.chunk] for i in range(0, len(seeds), args.chunk)] or [[]]
    for name, extra_env, prefix in runs:
        t0 = time.perf_counter()
        result = {"rc": 0, "chunks": len(chunks), "differ_from_plain": []}
        errors: list[int] = []
        for i, chunk in enumerate(chunks):
            log, npz = out / f"{name}_{i}.log", out / f"{name}_{i}.npz"
            chunk_env = {**env, **extra_env, "FLOWTT_FUZZ_SEEDS": ",".join(chunk) or "-1"}
            for attempt in range(args.retries + 1):
                rc = _child(prefix + me + [str(npz)], chunk_env, log, args.timeout)
                if rc >= 0 and rc != 139:  # not killed by a signal (139: a shell's SIGSEGV)
                    break
                print(f"{name} chunk {i}: rc {rc}, attempt {attempt + 1} of {args.retries + 1}")
                result.setdefault("signal_reruns", []).append({"chunk": i, "rc": rc})
            text = log.read_text(errors="replace")
            # memcheck, initcheck, synccheck: "ERROR SUMMARY: N errors"; racecheck: "RACECHECK
            # SUMMARY: H hazards displayed (E errors, W warnings)"
            errors += [int(m) for m in re.findall(r"ERROR SUMMARY: (\d+) error", text)]
            errors += [
                int(m) for m in re.findall(r"RACECHECK SUMMARY: \d+ hazards? displayed \((\d+) error", text)
            ]
            result["rc"] = result["rc"] or rc
            differ = _same_bits(out / "plain.npz", npz, chunk) if rc == 0 else [f"(chunk {i}: no results)"]
            result["differ_from_plain"] += differ
        result["seconds"] = round(time.perf_counter() - t0, 1)
        if prefix:  # one summary line per chunk, else the count is unknown
            result["sanitizer_errors"] = sum(errors) if len(errors) == len(chunks) else None
        ok = result["rc"] == 0 and not result["differ_from_plain"]
        ok = ok and (not prefix or result["sanitizer_errors"] == 0)
        result["ok"] = ok
        status |= not ok
        summary["runs"][name] = result
        print(f"{name}: {'OK' if ok else 'FAIL'} {result}")
        (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")  # after each run
    shutil.rmtree(env["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
    print(f"summary: {out / 'summary.json'}")
    return status


if __name__ == "__main__":
    sys.exit(main())
