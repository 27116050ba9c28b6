"""Single-table benchmark: dense bag, TT reference, TT reference + dedup, FlowTT kernels.

Usage: python benchmarks/bench_single_table.py --out results.json [--configs S1,D128_B4096,...]

Timing method ("queued"): a jitted function is called K times back to back
(asynchronous dispatch, all calls queued on the device), then one
block_until_ready; time per call = wall / K; the median over R repeats is
reported, after warm-up. This is device time whenever one call's device work is
longer than its host dispatch (~tens of microseconds); the JSON also records
the dispatch floor measured the same way on a trivial jitted function with the
same arguments, so a number near that floor is flagged as dispatch-bound.
Temporary memory is XLA's compile-time memory_analysis().temp_size_in_bytes;
the FFI handlers' scratch (allocated at run time through XLA's scratch
allocator, invisible to memory_analysis) is reported separately from the
kernels' own size function, and ``fwd_temp_total_bytes`` adds the largest
scratch of the forward's FFI calls (plan, fused bag forward) to XLA's figure:
an upper bound on the forward's peak temporary memory.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import glob
import re
import statistics
import subprocess
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

import flowtt_jax as ftt
from flowtt_jax import reference
from flowtt_jax.plan import make_plan

FP32_PEAK = 67e12  # H100/H200 SXM datasheet non-tensor fp32 FLOP/s

CONFIGS = {
    # name: (N, row_shape, D, col_shape, rank, bags, dist, weighted)
    # S1 as issue #3 defines it: plain sum bags, gradients for the cores.
    # "weighted": per-id weights in the bags, gradients for the cores and the weights.
    "S1": (10_000_000, (200, 200, 250), 32, (2, 4, 4), 32, 32768, "zipf1.05", False),
    "S1_weighted": (10_000_000, (200, 200, 250), 32, (2, 4, 4), 32, 32768, "zipf1.05", True),
    "D128_r64_B4096": (10_000_000, (200, 200, 250), 128, (4, 4, 8), 64, 4096, "zipf1.05", False),
    "D128_r64_B65536": (10_000_000, (200, 200, 250), 128, (4, 4, 8), 64, 65536, "zipf1.05", False),
    "D32_r32_B4096": (10_000_000, (200, 200, 250), 32, (2, 4, 4), 32, 4096, "zipf1.05", False),
    "D32_r32_B65536": (10_000_000, (200, 200, 250), 32, (2, 4, 4), 32, 65536, "zipf1.05", False),
    "S1_uniform": (10_000_000, (200, 200, 250), 32, (2, 4, 4), 32, 32768, "uniform", False),
    "S1_zipf1.2": (10_000_000, (200, 200, 250), 32, (2, 4, 4), 32, 32768, "zipf1.2", False),
    "tiny": (100_000, (40, 50, 50), 32, (2, 4, 4), 16, 256, "zipf1.05", True),  # smoke test
}


def make_workload(N, bags, dist, seed=0):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 28, bags)  # uniform in [1, 27]
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    n = int(offsets[-1])
    if dist == "uniform":
        ids = rng.integers(0, N, n)
    else:
        ranks = rng.zipf(float(dist[4:]), n) - 1
        ids = (ranks.astype(np.uint64) * np.uint64(2654435761)) % np.uint64(N)
    ids = ids.astype(np.int32)
    bag_ids = (np.repeat(np.arange(bags), lengths)).astype(np.int32)
    weights = rng.uniform(0.5, 1.5, n).astype(np.float32)
    return ids, offsets, bag_ids, weights


def scaled(rows, weights):
    """rows [n, D] times per-id weights [n], or rows when there are none."""
    return rows if weights is None else rows * weights[:, None]


def queued_time(f, args, K=20, R=15, warm=3):
    for _ in range(warm):
        jax.block_until_ready(f(*args))
    ts = []
    for _ in range(R):
        t0 = time.perf_counter()
        out = None
        for _ in range(K):
            out = f(*args)
        jax.block_until_ready(out)
        ts.append((time.perf_counter() - t0) / K * 1e3)
    return statistics.median(ts)


# Where device time goes: the first pattern that matches a kernel name wins.
CATEGORIES = (
    ("rows backward (dG1/dG2/dG3)", r"rows_bwd|dg[123]_"),
    ("radix sort (plan; + i3 bucketing in the backward)", r"RadixSort"),
    ("plan scan + finalize", r"DeviceScan|finalize_kernel|clamp_kernel"),
    ("rows forward (prefix map + GEMM tile kernel)", r"rows_fwd|build_map"),
    ("pooling fwd/bwd", r"pool_"),
    ("memset / memcpy", r"Memset|Memcpy|memcpy"),
)


def device_profile(f, args, iters=20, top=12):
    """Device-side time per call from a profiler trace of ``iters`` queued calls.

    busy_ms: union of the GPU kernel/memcpy intervals of all streams / iters (device
    busy time, no host dispatch); span_ms: first start to last end / iters;
    kernels: per kernel name, summed duration / iters (the largest ``top``).
    """
    from jax.profiler import ProfileData

    for _ in range(3):
        jax.block_until_ready(f(*args))
    with tempfile.TemporaryDirectory() as d:
        jax.profiler.start_trace(d)
        out = None
        for _ in range(iters):
            out = f(*args)
        jax.block_until_ready(out)
        jax.profiler.stop_trace()
        path = sorted(glob.glob(os.path.join(d, "**", "*.xplane.pb"), recursive=True))[-1]
        data = ProfileData.from_file(path)
    intervals, per_name = [], {}
    for plane in data.planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        for line in plane.lines:
            if not line.name.startswith("Stream"):
                continue
            for ev in line.events:
                intervals.append((ev.start_ns, ev.start_ns + ev.duration_ns))
                per_name[ev.name] = per_name.get(ev.name, 0.0) + ev.duration_ns
    if not intervals:
        return {"error": "no GPU stream events in the trace"}
    intervals.sort()
    busy, cur_s, cur_e = 0.0, *intervals[0]
    for s_, e_ in intervals[1:]:
        if s_ > cur_e:
            busy += cur_e - cur_s
            cur_s, cur_e = s_, e_
        else:
            cur_e = max(cur_e, e_)
    busy += cur_e - cur_s
    span = intervals[-1][1] - intervals[0][0]
    ranked = sorted(per_name.items(), key=lambda kv: -kv[1])[:top]
    cats: dict[str, float] = {}
    for name, ns in per_name.items():
        cat = next((c for c, pat in CATEGORIES if re.search(pat, name)), "XLA fusions (glue)")
        cats[cat] = cats.get(cat, 0.0) + ns / iters * 1e-6
    return {"busy_ms": busy / iters * 1e-6, "span_ms": span / iters * 1e-6,
            "events_per_call": len(intervals) / iters,
            "categories_ms": dict(sorted(cats.items(), key=lambda kv: -kv[1])),
            "kernels_ms": {k[:90]: v / iters * 1e-6 for k, v in ranked}}


def temp_bytes(f, args):
    try:
        ma = jax.jit(f).lower(*args).compile().memory_analysis()
        return int(ma.temp_size_in_bytes)
    except Exception as e:  # noqa: BLE001
        return f"n/a ({type(e).__name__})"


def scratch_bytes(spec, n, D):
    """Run-time FFI scratch of each CUDA op for n ids (bag_fwd at the ops' chunk size)."""
    try:
        from flowtt_jax import _flowtt_cuda
        from flowtt_jax.ops import bag_chunk_rows

        p1, p2, p3 = spec.row_shape
        q1, q2, q3 = spec.col_shape
        r1, r2 = spec.ranks[1], spec.ranks[2]
        return _flowtt_cuda.scratch_bytes(p1, p2, p3, q1, q2, q3, r1, r2, n, bag_chunk_rows(D))
    except Exception as e:  # noqa: BLE001
        return f"n/a ({e})"


def run_config(name, K, R):
    N, row_shape, D, col_shape, rank, bags, dist, weighted = CONFIGS[name]
    spec = ftt.TTSpec.create(N, D, rank, row_shape=row_shape, col_shape=col_shape)
    cores = tuple(ftt.init_cores(jax.random.key(1), spec))
    ids_np, offsets_np, bag_ids_np, w_np = make_workload(N, bags, dist)
    n = ids_np.shape[0]
    ids, offsets, bag_ids, w_all = map(jnp.asarray, (ids_np, offsets_np, bag_ids_np, w_np))
    w = w_all if weighted else None  # what the public calls get (None: plain sum bags)
    cot = jax.random.normal(jax.random.key(2), (bags, D), jnp.float32)
    res = {"config": name, "N": N, "row_shape": row_shape, "D": D, "col_shape": col_shape,
           "rank": rank, "bags": bags, "nnz": n, "ids": dist, "weighted": weighted}

    plan = jax.jit(make_plan, static_argnums=1)(ids, row_shape[-1])
    nu, ng = (int(x) for x in plan.counts)
    res["num_unique"], res["num_groups"] = nu, ng
    M = col_shape[0] * col_shape[1]
    flops_fwd = 2.0 * ng * M * rank * rank + 2.0 * nu * D * rank
    res["fwd_flop_floor"] = flops_fwd
    res["fwd_floor_ms_fp32"] = flops_fwd / FP32_PEAK * 1e3

    # dispatch floor: trivial jitted fn with the same arguments
    triv = jax.jit(lambda c, i, o, ww: i[:1] + 1)
    res["dispatch_floor_ms"] = queued_time(triv, (cores, ids, offsets, w), K, R)

    def tt_impl(impl):
        def fwd(c, i, o, ww):
            return ftt.tt_embedding_bag(c, i, offsets=o, weights=ww, impl=impl)

        def fb(c, i, o, ww):
            out, vjp = jax.vjp(lambda cc, www: fwd(cc, i, o, www), c, ww)
            return out, vjp(cot)
        return fwd, fb

    def dedup_impls():
        def fwd(c, i, o, ww):
            uniq, inv = jnp.unique(i, size=i.shape[0], fill_value=0, return_inverse=True)
            rows = reference.tt_rows(c, uniq)[inv.reshape(-1)]
            return jax.ops.segment_sum(scaled(rows, ww), bag_ids, num_segments=bags)

        def fb(c, i, o, ww):
            out, vjp = jax.vjp(lambda cc, www: fwd(cc, i, o, www), c, ww)
            return out, vjp(cot)
        return fwd, fb

    impls = {"ours": tt_impl("ffi"), "tt_reference": tt_impl("reference"),
             "tt_reference_dedup": dedup_impls()}
    for label, (fwd, fb) in impls.items():
        r = {}
        try:
            args = (cores, ids, offsets, w)
            r["fwd_ms"] = queued_time(jax.jit(fwd), args, K, R)
            r["fwd_bwd_ms"] = queued_time(jax.jit(fb), args, K, R)
            r["fwd_temp_bytes"] = temp_bytes(fwd, args)
            r["fwd_bwd_temp_bytes"] = temp_bytes(fb, args)
            if jax.default_backend() == "gpu":
                r["fwd_device"] = device_profile(jax.jit(fwd), args)
                r["fwd_bwd_device"] = device_profile(jax.jit(fb), args)
            r["fwd_fraction_of_fp32_peak"] = flops_fwd / FP32_PEAK / (r["fwd_ms"] * 1e-3)
        except Exception as e:  # noqa: BLE001
            r["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        res[label] = r
        print(name, label, r, flush=True)

    # where our time goes: plan / rows kernel / pooling (each jitted alone)
    from flowtt_jax import ffi as fffi
    from flowtt_jax.ops import bag_chunk_rows

    try:
        rows = jax.jit(fffi.rows_fwd)(cores, plan)
        res["ours_breakdown_ms"] = {
            "plan": queued_time(jax.jit(fffi.plan, static_argnums=(1, 2)), (ids, row_shape[-1], N), K, R),
            "rows_fwd_kernel": queued_time(jax.jit(fffi.rows_fwd), (cores, plan), K, R),
            "bag_fwd_kernel": queued_time(jax.jit(fffi.bag_fwd, static_argnums=4),
                                          (cores, plan, w_all, offsets, bag_chunk_rows(D)), K, R),
            "pool_fwd_kernel": queued_time(jax.jit(fffi.pool_fwd), (rows, plan.inverse, w_all, offsets), K, R),
            "pool_bwd_kernel": queued_time(jax.jit(functools.partial(fffi.pool_bwd, with_d_weights=weighted)),
                                           (cot, rows, w_all, bag_ids, plan), K, R),
            "rows_bwd_kernel": queued_time(jax.jit(fffi.rows_bwd), (cores, rows, plan), K, R),
        }
        sb = scratch_bytes(spec, n, D)
        res["ours_scratch_bytes"] = sb
        fwd_temp = res["ours"].get("fwd_temp_bytes")
        if isinstance(sb, dict) and isinstance(fwd_temp, int):
            res["ours"]["fwd_temp_total_bytes"] = fwd_temp + max(sb.get("plan", 0), sb["bag_fwd"])
    except Exception as e:  # noqa: BLE001
        res["ours_breakdown_ms"] = f"error: {type(e).__name__}: {str(e)[:300]}"

    # dense EmbeddingBag baseline (uncompressed table)
    try:
        table = jax.random.normal(jax.random.key(3), (N, D), jnp.float32) * 0.01

        def dense_fwd(t, i, ww):
            return jax.ops.segment_sum(scaled(jnp.take(t, i, axis=0), ww), bag_ids, num_segments=bags)

        def dense_fb(t, i, ww):
            out, vjp = jax.vjp(lambda tt: dense_fwd(tt, i, ww), t)
            return out, vjp(cot)
        r = {"fwd_ms": queued_time(jax.jit(dense_fwd), (table, ids, w), K, R),
             "fwd_bwd_ms": queued_time(jax.jit(dense_fb), (table, ids, w), K, R),
             "fwd_device": device_profile(jax.jit(dense_fwd), (table, ids, w)),
             "fwd_bwd_device": device_profile(jax.jit(dense_fb), (table, ids, w)),
             "fwd_temp_bytes": temp_bytes(dense_fwd, (table, ids, w)),
             "table_bytes": N * D * 4}
        del table
    except Exception as e:  # noqa: BLE001
        r = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    res["dense_bag"] = r
    print(name, "dense", r, flush=True)
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results/single_table.json")
    ap.add_argument("--configs", default="S1,S1_weighted,D128_r64_B4096,D128_r64_B65536")
    ap.add_argument("--K", type=int, default=20)
    ap.add_argument("--R", type=int, default=15)
    a = ap.parse_args()
    commit = os.environ.get("FLOWTT_COMMIT")
    if not commit:
        try:
            commit = subprocess.check_output(["git", "rev-parse", "HEAD"], text=True).strip()
        except Exception:  # noqa: BLE001
            commit = "unknown"
    dev = jax.devices()[0]
    out = {"device": f"{dev.platform}:{dev.device_kind}", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
           "git_commit": commit, "jax": jax.__version__,
           "timing": "queued: K calls of a jitted fn then one block; median over R of wall/K (ms); "
                     "*_device: profiler trace of 20 queued calls, GPU busy time per call (ms)",
           "K": a.K, "R": a.R, "results": []}
    for name in a.configs.split(","):
        out["results"].append(run_config(name, a.K, a.R))
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1, default=str)
    print("wrote", a.out)


if __name__ == "__main__":
    main()
