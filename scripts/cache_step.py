"""A training step with and without hot-row caches (issue 54's target: a step with the
cache at most 1.1x one without). The 26 Criteo Kaggle tables at dim 16 (those under 4,096
rows dense, the rest TT at rank 16), Zipf(1.2) ids, batch ``--batch``, forward + backward +
Adam over the whole collection; the cached runs give every TT table a cache of
``1/fraction`` of its rows, hot ids from 4 sample batches (``refresh_cache``). Steps/s after
compilation on this machine.

    python -m scripts.cache_step OUT.json [--batch 4096] [--fractions 1024 128 16]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from benchmarks import records, timing
from examples.criteo_synth import CRITEO_KAGGLE_CARDINALITIES as CARDS
from flowtt_jax.collection import make_table_configs
from flowtt_jax.nnx import TTEmbeddingCollection

STEPS, DIM, RANK = 20, 16, 16


def _ids(rng: np.random.Generator, rows: int, n: int) -> np.ndarray:
    """``n`` Zipf(1.2) ids of a table of ``rows`` rows (rank by a fixed permutation of the
    first rows, so the hot ids are not 0..k)."""
    ranks = np.minimum(rng.zipf(1.2, n) - 1, rows - 1)
    return ((ranks * 2_654_435_761) % rows).astype(np.int32)


def measure(batch: int, fraction: int | None, batches: list[dict]) -> dict:
    tables = make_table_configs({f"C{i + 1}": n for i, n in enumerate(CARDS)}, DIM, rank=RANK)
    if fraction:
        tables = [
            dataclasses.replace(t, cache_rows=min(t.num_embeddings, max(64, t.num_embeddings // fraction)))
            if t.kind == "tt"
            else t
            for t in tables
        ]
    model = TTEmbeddingCollection(tables, rngs=nnx.Rngs(0))
    if fraction:
        model.refresh_cache(batches)
    opt = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)

    def loss(m, f):
        return sum(jnp.mean(v**2) for v in m(f).values())

    @nnx.jit(donate_argnums=(0, 1))
    def step(m, o, f):
        value, grads = nnx.value_and_grad(loss)(m, f)
        o.update(m, grads)
        return value

    times, _ = timing.step_times(step, [(model, opt, b) for b in batches], STEPS)
    return {"fraction": fraction, "cached_rows": sum(t.cache_rows for t in tables), **times}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out")
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--fractions", type=int, nargs="*", default=[1024, 128, 16])
    a = p.parse_args(argv)
    rng = np.random.default_rng(0)
    batches = [
        {f"C{i + 1}": jnp.asarray(_ids(rng, n, a.batch)) for i, n in enumerate(CARDS)} for _ in range(4)
    ]
    results = []
    for fraction in [None, *a.fractions]:
        r = measure(a.batch, fraction, batches)
        print(json.dumps(r), flush=True)
        results.append(r)
    base = results[0]["step_ms"]
    for r in results:
        r["vs_no_cache"] = round(r["step_ms"] / base, 3)
    record = {
        "what": "Criteo-like collection training step with and without hot-row caches",
        "device": str(jax.devices()[0]),
        "date": datetime.date.today().isoformat(),
        "commit": records.commit()[:7],
        "batch": a.batch,
        "dim": DIM,
        "rank": RANK,
        "results": results,
    }
    with open(a.out, "w") as f:
        json.dump(record, f, indent=1)
    return record


if __name__ == "__main__":
    main()
