"""What a user of TTEmbeddingCollection holds and waits for, with and without unique-row
capacities, windows of the uniques, passes, and the default policy at a budget
(docs/memory.md): a Meta-like collection of 24 tables (dim 32, rank 16) at batch 2048 on
this machine: construction, compile, step time and XLA's temporaries + outputs per id,
forward and forward + backward (the gradient of a loss of the bags).
``python -m scripts.layer_memory OUT.json`` (from the repository root)."""

import datetime
import json
import subprocess
import sys
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import flowtt_jax as ftt
from benchmarks.workloads import MetaLikeCollection
from flowtt_jax.collection import TableConfig
from flowtt_jax.nnx import TTEmbeddingCollection

warnings.simplefilter("ignore")
T, B = 24, 2048
coll_def = MetaLikeCollection.create(T, 0, rows_range=(1e4, 4e6), rank=16)
w = coll_def.draw(B)
feats = {}
bounds = w.feature_bounds
for f in range(len(w.feature_table)):
    ids = w.ids[bounds[f] : bounds[f + 1]]
    offs = w.offsets[f * B : (f + 1) * B + 1] - w.offsets[f * B]
    feats[f"f{f}"] = {"ids": jnp.asarray(ids), "offsets": jnp.asarray(offs)}
n = int(w.ids.shape[0])
ftab = {f"f{f}": f"t{t}" for f, t in enumerate(w.feature_table)}
caps = ftt.measure_unique_ids(
    [{k: (np.asarray(v["ids"]), np.asarray(v["offsets"])) for k, v in feats.items()}], ftab, margin=1.1
)


def tables(with_caps):
    return [
        TableConfig(
            f"t{t}",
            int(s.num_embeddings),
            32,
            rank=16,
            feature_names=tuple(f"f{f}" for f, tt in enumerate(w.feature_table) if tt == t),
            max_unique_ids=caps[f"t{t}"] if with_caps else None,
        )
        for t, s in enumerate(w.specs)
    ]


out = {
    "device": str(jax.devices()[0]),
    "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    "commit": subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip(),
    "tables": T,
    "batch": B,
    "ids": n,
    "dim": 32,
    "rank": 16,
    "cases": [],
}
one_pass = ftt.estimate_memory(tables(False), ftt.BatchStats.measure([feats], tables(False))).total
out["one_pass_estimate_bytes"] = one_pass
for name, with_caps, kw in (
    ("per-id", False, dict(memory_budget=None)),
    ("capacity x1.1", True, dict(memory_budget=None)),
    ("4 windows", False, dict(unique_windows=4)),
    ("4 passes", False, dict(ids_per_pass=-(-n // 4))),
    ("4 passes + capacity", True, dict(ids_per_pass=-(-n // 4))),
    ("default, budget 60% of one pass", False, dict(memory_budget=int(0.6 * one_pass))),
):
    t0 = time.perf_counter()
    c = TTEmbeddingCollection(tables(with_caps), rngs=nnx.Rngs(0), **kw)
    construct = time.perf_counter() - t0
    g, st = nnx.split(c)
    loss = lambda s, x, g=g: sum(jnp.sum(v**2) for v in nnx.merge(g, s)(x).values())  # noqa: E731
    rec = {"name": name, "construct_s": round(construct, 3)}
    if "memory_budget" in kw and kw["memory_budget"] is not None:
        plan = c.layout.memory_plan(feats)  # the call's choice (checked by XLA near the budget)
        rec["chosen"] = str(plan).splitlines()[0]
    for mode, fn in (("fwd", lambda s, x, g=g: nnx.merge(g, s)(x)), ("fwd_bwd", jax.grad(loss))):
        t0 = time.perf_counter()
        comp = jax.jit(fn).lower(st, feats).compile()
        rec[f"{mode}_compile_s"] = round(time.perf_counter() - t0, 2)
        m = comp.memory_analysis()
        rec[f"{mode}_bytes_per_id"] = round((m.temp_size_in_bytes + m.output_size_in_bytes) / n, 1)
        jax.block_until_ready(comp(st, feats))
        t0 = time.perf_counter()
        for _ in range(3):
            r = comp(st, feats)
        jax.block_until_ready(r)
        rec[f"{mode}_ms"] = round((time.perf_counter() - t0) / 3 * 1e3, 1)
    out["cases"].append(rec)
    print(rec, flush=True)
json.dump(out, open(sys.argv[1], "w"), indent=1)
