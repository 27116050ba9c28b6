"""Device-time breakdown of the fused ops on a GPU (profiler trace per kernel).

Usage (on the GPU machine): python scripts/profile_breakdown.py S1[,D128_r64_B4096,...]
Prints, for weighted and unweighted bags, forward and forward+backward, the JSON of
benchmarks/bench_single_table.device_profile (busy ms, per-part and per-kernel ms),
then the pure-JAX plan (make_plan) alone for comparison.
"""
import sys, json
sys.path.insert(0, "benchmarks")
import jax, jax.numpy as jnp
import bench_single_table as b
import flowtt_jax as ftt
from flowtt_jax.plan import make_plan
for name in sys.argv[1].split(","):
    N, row_shape, D, col_shape, rank, bags, dist = b.CONFIGS[name]
    spec = ftt.TTSpec.create(N, D, rank, row_shape=row_shape, col_shape=col_shape)
    cores = tuple(ftt.init_cores(jax.random.key(1), spec))
    ids, offsets, bag_ids, w = map(jnp.asarray, b.make_workload(N, bags, dist))
    cot = jax.random.normal(jax.random.key(2), (bags, D), jnp.float32)
    for weighted in (True, False):
        def fwd(c, i, o, ww):
            return ftt.tt_embedding_bag(c, i, offsets=o, weights=ww if weighted else None, impl="ffi")
        def fb(c, i, o, ww):
            out, vjp = jax.vjp(lambda cc: fwd(cc, i, o, ww), c)
            return out, vjp(cot)
        args = (cores, ids, offsets, w)
        for lab, f in (("fwd", fwd), ("fwd_bwd", fb)):
            r = b.device_profile(jax.jit(f), args, iters=20, top=40)
            print(name, "weighted" if weighted else "unweighted", lab, json.dumps(r, indent=1), flush=True)
    r = b.device_profile(jax.jit(make_plan, static_argnums=1), (ids, row_shape[-1]), iters=20, top=40)
    print(name, "plan", json.dumps(r, indent=1))
