"""A training step's time against a dense table's row count, with the table a plain
``nnx.Param`` (its ``[N, D]`` gradient and optax update every step) and with sparse updates
(``TableConfig(sparse=SparseUpdate("rowwise_adagrad"))``: the touched rows only;
docs/sparse.md). A two-tower-like collection: a user table of N rows (dense, dim 32), a
TT item table of 2 M rows read by the item id and a 20-id history, a small dense country
table; batch 512, Adagrad-family updates; steps/s after compilation on this machine.
``python -m scripts.sparse_step OUT.json`` (from the repository root)."""

from __future__ import annotations

import datetime
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from benchmarks import records, timing
from flowtt_jax import sparse as sp
from flowtt_jax.collection import TableConfig
from flowtt_jax.collection.config import SparseUpdate
from flowtt_jax.nnx import TTEmbeddingCollection

B, D, HIST, STEPS = 512, 32, 20, 20


def _tables(rows: int, sparse: bool) -> list[TableConfig]:
    rule = SparseUpdate("rowwise_adagrad", 0.05) if sparse else None
    return [
        TableConfig("user", rows, D, kind="dense", sparse=rule),
        TableConfig("item", 2_000_000, D, rank=16, feature_names=("item", "hist"), mode="mean"),
        TableConfig("country", 200, D, kind="dense"),
    ]


def _batch(rng: np.random.Generator, rows: int) -> dict:
    return {
        "user": jnp.asarray(rng.integers(0, rows, B)),
        "item": jnp.asarray(rng.integers(0, 2_000_000, B)),
        "hist": jnp.asarray(rng.integers(0, 2_000_000, (B, HIST))),
        "country": jnp.asarray(rng.integers(0, 200, B)),
    }


def _loss(model, feats):
    out = model(feats)
    user = out["user"] + out["country"]
    item = out["item"] + out["hist"]
    logits = user @ item.T  # in-batch softmax
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, jnp.arange(B)))


def measure(rows: int, sparse: bool) -> dict:
    model = TTEmbeddingCollection(_tables(rows, sparse), rngs=nnx.Rngs(0))
    opt = nnx.Optimizer(model, optax.adagrad(0.05), wrt=nnx.Param)
    grad_fn = sp.sparse_value_and_grad(_loss)

    @nnx.jit(donate_argnums=(0, 1))  # the tables updated in place (a sparse table's rows)
    def step(m, o, f):
        if sparse:
            loss, grads, rows_g = grad_fn(m, f)
            o.update(m, grads)
            sp.apply_sparse(m, rows_g)
        else:
            loss, grads = nnx.value_and_grad(_loss)(m, f)
            o.update(m, grads)
        return loss

    rng = np.random.default_rng(0)
    batches = [_batch(rng, rows) for _ in range(4)]
    times, loss = timing.step_times(step, [(model, opt, b) for b in batches], STEPS)
    return {"rows": rows, "sparse": sparse, **times, "loss": float(loss)}


def main(out: str) -> None:
    results = []
    for rows in (100_000, 1_000_000, 5_000_000):
        for sparse in (False, True):
            r = measure(rows, sparse)
            print(json.dumps(r), flush=True)
            results.append(r)
    commit = records.commit()[:7]
    record = {
        "what": "two-tower step vs a dense table's rows, plain vs sparse updates",
        "device": str(jax.devices()[0]),
        "date": datetime.date.today().isoformat(),
        "commit": commit,
        "batch": B,
        "dim": D,
        "history": HIST,
        "results": results,
    }
    with open(out, "w") as f:
        json.dump(record, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "sparse_step.json")
