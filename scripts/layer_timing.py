"""What a user of ``TTEmbeddingCollection`` waits for at Meta-like scale: construction, and
the compile of the call (dict and packed ``KeyedJagged`` input, forward and forward +
backward), per collection size and batch. Step times are the benchmark suite's
(``ours_layer`` beside ``ours_batched``); this measures what comes before the first step.

    python -m scripts.layer_timing --tables 240,788 --batches 64,4096 [--json out.json]

Each (tables, batch) compiles over abstract inputs (``jax.ShapeDtypeStruct``; no batch is
drawn) with the expected number of ids of the Meta-like collection (``benchmarks.workloads``:
mean pooling 13.6). Construction is timed after ``jax.clear_caches()``, as a process's first.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import time
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

from benchmarks.records import commit
from benchmarks.workloads import MetaLikeCollection
from flowtt_jax import KeyedJagged
from flowtt_jax.collection import TableConfig
from flowtt_jax.nnx import TTEmbeddingCollection


def _timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def measure(tables: int, batch: int, calls: tuple[str, ...]) -> dict:
    meta = MetaLikeCollection.create(tables)
    configs = [TableConfig(f"t{i}", int(n), 32, rank=32) for i, n in enumerate(meta.rows)]
    jax.clear_caches()
    coll, construct_s = _timed(
        lambda: jax.block_until_ready(TTEmbeddingCollection(configs, rngs=nnx.Rngs(0)))
    )
    graph, state = nnx.split(coll)
    per_feature = [max(1, round(batch * m)) for m in meta.pooling_mean]
    nnz = sum(per_feature)
    rec = {
        "tables": tables,
        "batch": batch,
        "nnz": nnz,
        "construct_s": construct_s,
        "packs": len(coll.layout.packs),
    }
    i32 = jnp.int32
    jagged = KeyedJagged(
        jax.ShapeDtypeStruct((nnz,), i32), lengths=jax.ShapeDtypeStruct((tables, batch), i32)
    )
    feats = {
        f"t{i}": {"ids": jax.ShapeDtypeStruct((n,), i32), "offsets": jax.ShapeDtypeStruct((batch + 1,), i32)}
        for i, n in enumerate(per_feature)
    }

    def fwd(st, x):
        out = nnx.merge(graph, st)(x)
        if isinstance(x, KeyedJagged):
            return out
        # TorchRec's [B, sum D]; reshaped to the KeyedJagged call's [B, F, D]
        return jnp.concatenate([out[f] for f in coll.feature_names], -1).reshape(batch, tables, -1)

    def fwd_bwd(st, x):
        return jax.grad(lambda s: jnp.sum(jnp.sin(fwd(s, x))))(st)

    for call in calls:
        inp, step = {
            "packed": (jagged, fwd),
            "dict": (feats, fwd),
            "packed_train": (jagged, fwd_bwd),
            "dict_train": (feats, fwd_bwd),
        }[call]
        jax.clear_caches()
        lowered, lower_s = _timed(lambda s=step, i=inp: jax.jit(s).lower(state, i))
        _, compile_s = _timed(lowered.compile)
        rec[call] = {"lower_s": lower_s, "compile_s": compile_s}
        print(
            f"meta{tables} B{batch} ({nnz:,} ids) {call}: lower {lower_s:.2f} s, compile {compile_s:.2f} s",
            flush=True,
        )
    print(f"meta{tables}: construct {construct_s:.2f} s ({rec['packs']} packs)", flush=True)
    return rec


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    csv = lambda s: tuple(int(x) for x in s.split(","))  # noqa: E731
    ap.add_argument("--tables", type=csv, default=(240, 788))
    ap.add_argument("--batches", type=csv, default=(64, 4096))
    ap.add_argument("--calls", default="packed,dict,packed_train,dict_train")
    ap.add_argument("--json", help="write the records here")
    a = ap.parse_args(argv)
    recs = [measure(t, b, tuple(a.calls.split(","))) for t in a.tables for b in a.batches]
    doc = {
        "device": str(jax.devices()[0].device_kind),
        "backend": jax.default_backend(),
        "cpu_count": os.cpu_count(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": commit(),
        "records": recs,
    }
    if a.json:
        Path(a.json).write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
