"""Device-time breakdown of our ops on a GPU: a profiler trace per kernel.

Usage (on the GPU machine):
    python -m scripts.profile_breakdown meta240_B4096[,D32_r32_B32768_zipf1.05,...] [--top 40]

A case is a collection ``meta<T>_B<batch>`` (``ours_batched``: the table-batched op) or a
single table ``D<dim>_r<rank>_B<batch>_<dist>`` (``ours``), drawn exactly as
``python -m benchmarks`` draws it. Prints, for the forward and the forward + backward (core
gradients), the JSON of ``benchmarks.timing.device_profile``: busy ms, ms per part and per
kernel.
"""

from __future__ import annotations

import argparse
import json
import re

import jax
import jax.numpy as jnp

from benchmarks import impls, timing
from benchmarks.__main__ import FULL, QUICK, meta_collection, single_kwargs
from benchmarks.workloads import single_table


def workload(case: str, s: dict):
    if m := re.fullmatch(r"meta(\d+)_B(\d+)", case):
        return meta_collection(s, int(m[1]), 0).draw(int(m[2])), "ours_batched"
    if m := re.fullmatch(r"D(\d+)_r(\d+)_B(\d+)_(\w[\w.]*)", case):
        return single_table(**single_kwargs(s, int(m[1]), int(m[2]), int(m[3]), m[4], 0)), "ours"
    raise SystemExit(f"unknown case {case!r}: meta<T>_B<batch> or D<dim>_r<rank>_B<batch>_<dist>")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("cases", help="comma-separated case names")
    ap.add_argument("--top", type=int, default=40, help="kernels listed per profile")
    ap.add_argument("--quick", action="store_true", help="the benchmark's --quick sizes")
    ap.add_argument(
        "--calls",
        type=int,
        default=0,
        help="no profiler trace: compile and call each step this many times (to run under ncu)",
    )
    a = ap.parse_args()
    for case in a.cases.split(","):
        w, name = workload(case, QUICK if a.quick else FULL)
        impl = impls.REGISTRY[name]
        params = impl.init(w, impls.tt_cores(w))
        fwd = impl.build(w)
        ids, offsets = jax.device_put(w.ids), jax.device_put(w.offsets)
        dim = sum(w.specs[f].embedding_dim for f in w.feature_table)
        cot = jax.random.normal(jax.random.key(2), (w.batch, dim), jnp.float32)

        def fwd_bwd(p, i, o, c, fwd=fwd):
            out, vjp = jax.vjp(lambda pp: fwd(pp, i, o), p)
            return out, vjp(c)[0]

        steps = (("fwd", fwd, (params, ids, offsets)), ("fwd_bwd", fwd_bwd, (params, ids, offsets, cot)))
        for mode, f, args in steps:
            if a.calls:
                step = jax.jit(f)
                for _ in range(a.calls):
                    jax.block_until_ready(step(*args))
                continue
            prof = timing.device_profile(jax.jit(f), args, iters=10, top=a.top)
            print(case, name, mode, json.dumps(prof, indent=1), flush=True)


if __name__ == "__main__":
    main()
