"""The fuzz corpus on the GPU under compute-sanitizer, and under CUDA_LAUNCH_BLOCKING=1.

    python -m scripts.fuzz_sanitize [--out DIR] [--cases N] [--seeds A-B,C]
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
(``FLOWTT_FUZZ_SEEDS``). Every child shares one JAX persistent compilation cache (a
temporary folder): the plain run compiles, the blocking and sanitizer runs load its
executables. compute-sanitizer used to die (rc -11) now and then during XLA compiles; a
chunk whose process dies of SIGSEGV is run again (``--retries``; the crashed attempt's log
is kept as ``<run>_<chunk>.attempt<k>.log`` and ``summary.json`` lists the reruns).
``--cases N`` takes seeds 0..N-1 (default: the whole corpus), ``--seeds`` a selection of
them. One sanitizer process at a time: four side by side on one H200 segfaulted before
any result.

Writes ``DIR/<run>_<chunk>.log``, ``.npz`` and ``DIR/summary.json`` (default DIR:
``$OUT/fuzz_sanitize``, else ``./fuzz_sanitize_out``); exits 1 on any error, mismatch or
oracle failure, 2 without a GPU (``FLOWTT_FUZZ_ON_CPU=1 ... --tools blocking``: a dry run
of the plain and blocking steps on the CPU kernels). Needs the CUDA build (``FLOWTT_CUDA=ON
pip install --no-build-isolation --no-deps -e .``). The whole corpus under every tool took
about 6 minutes on an H200 (racecheck the slowest); ``--seeds`` and ``--tools`` split it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
TOOLS = ("memcheck", "racecheck", "initcheck", "synccheck")  # compute-sanitizer's


def _worker(out_path: Path, num_cases: int) -> int:
    import jax

    from flowtt_jax.inputs.oob import prepare_bags
    from flowtt_jax.kernels import ffi
    from tests.test_fuzz_corpus import compare, corpus, kernel_refusal, make_cores, oracle, run

    jax.config.update("jax_default_matmul_precision", "highest")
    if jax.default_backend() != "gpu" and os.environ.get("FLOWTT_FUZZ_ON_CPU") != "1":
        print("no GPU backend (FLOWTT_FUZZ_ON_CPU=1: a dry run on the CPU kernels)", file=sys.stderr)
        return 2
    arrays, report = {}, {}
    only = {int(x) for x in os.environ.get("FLOWTT_FUZZ_SEEDS", "").split(",") if x}
    for case in corpus(num_cases or None):
        if only and case.seed not in only:
            continue
        cores = make_cores(case)
        reason = kernel_refusal(case, cores)
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
    """'0-3,9' -> {0, 1, 2, 3, 9} (an argparse type)."""
    out: set[int] = set()
    for part in filter(None, text.split(",")):
        lo, dash, hi = part.partition("-")
        if not (lo.isdigit() and (hi.isdigit() if dash else not hi)) or (dash and int(hi) < int(lo)):
            raise argparse.ArgumentTypeError(f"bad seed range {part!r} (A, or A-B with A <= B)")
        out.update(range(int(lo), int(hi or lo) + 1))
    if not out:
        raise argparse.ArgumentTypeError("no seeds")
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
    ap.add_argument("--retries", type=int, default=2, help="reruns of a chunk killed by SIGSEGV")
    ap.add_argument("--seeds", type=_parse_seeds, default=None, help="only these corpus seeds, e.g. '0-9,64'")
    ap.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return _worker(args.worker, args.cases)
    runs = []  # (name, extra environment, command prefix)
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
    args.out.mkdir(parents=True, exist_ok=True)
    # one compilation cache for every child: the sanitized runs load, not compile
    with tempfile.TemporaryDirectory(prefix="flowtt_fuzz_jax_cache_") as cache:
        return _run(args, runs, cache)


def _run(args: argparse.Namespace, runs: list, cache: str) -> int:
    out = args.out
    # every run without XLA's autotuning: its trial kernels would be instrumented under the
    # sanitizers, and a different pick between runs could change bits
    xla_flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_gpu_autotune_level=0".strip()
    env = {
        **os.environ,
        "XLA_PYTHON_CLIENT_PREALLOCATE": "false",
        "PYTHONUNBUFFERED": "1",
        "XLA_FLAGS": xla_flags,
        "JAX_COMPILATION_CACHE_DIR": cache,
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "-1",  # every executable
    }
    if args.seeds is not None:
        env["FLOWTT_FUZZ_SEEDS"] = ",".join(map(str, sorted(args.seeds)))
    me = [sys.executable, "-m", "scripts.fuzz_sanitize", "--cases", str(args.cases), "--worker"]  # cwd ROOT
    summary, status = {"runs": {}}, 0

    def save() -> None:
        (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")

    rc = _child(me + [str(out / "plain.npz")], env, out / "plain.log", args.timeout)
    if rc != 0:
        summary["runs"]["plain"] = {"rc": rc}
        save()
        print(f"plain run failed (rc {rc}), see {out / 'plain.log'}")
        return 2 if rc == 2 else 1
    report = json.loads((out / "plain.json").read_text())
    failures = {k: v["oracle_failures"] for k, v in report.items() if v.get("oracle_failures")}
    seeds = sorted((k for k, v in report.items() if "skipped" not in v), key=int)
    summary["cases"], summary["seeds"] = len(report), [int(k) for k in seeds]
    summary["runs"]["plain"] = {
        "cases_run": len(seeds),
        "cases_skipped": len(report) - len(seeds),  # refused by the kernels' shape limits
        "oracle_failures": failures,
    }
    save()
    skipped = len(report) - len(seeds)
    print(f"plain: {len(seeds)} cases on the kernels, {skipped} skipped, oracle failures: {failures or 0}")
    status |= bool(failures)
    if not seeds:
        print("no case of the selection runs on the kernels")
        return 1

    chunks = [seeds[i : i + args.chunk] for i in range(0, len(seeds), args.chunk)]
    for name, extra_env, prefix in runs:
        t0 = time.perf_counter()
        result = {"rc": 0, "chunks": len(chunks), "differ_from_plain": [], "signal_reruns": []}
        errors: list[int] = []
        for i, chunk in enumerate(chunks):
            log, npz = out / f"{name}_{i}.log", out / f"{name}_{i}.npz"
            chunk_env = {**env, **extra_env, "FLOWTT_FUZZ_SEEDS": ",".join(chunk)}
            for attempt in range(args.retries + 1):
                rc = _child(prefix + me + [str(npz)], chunk_env, log, args.timeout)
                if rc not in (-11, 139):  # SIGSEGV (139: through a shell): the sanitizer's own
                    break
                log.rename(log.with_suffix(f".attempt{attempt}.log"))  # kept as evidence
                print(f"{name} chunk {i}: rc {rc}, attempt {attempt + 1} of {args.retries + 1}")
                result["signal_reruns"].append({"chunk": i, "rc": rc})
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
        result["ok"] = ok  # a chunk rerun after a sanitizer crash counts when its rerun passed
        status |= not ok
        summary["runs"][name] = result
        save()
        print(f"{name}: {'OK' if ok else 'FAIL'} {result}")
    print(f"summary: {out / 'summary.json'}")
    return status


if __name__ == "__main__":
    sys.exit(main())
