"""Two-tower training steps/s by ``plan_tables`` budget (issue 52's measurement): the
tables of ``examples/two_tower.py`` at 5 M users and 2 M items (dim 32), planned from a
sample batch at 4 MiB .. 1 GiB three ways: bytes only (``step_slack=None``, the planner
before it knew time), the default (``step_slack=0.1``), and the default with sparse
updates for dense tables (``dense_update=SparseUpdate("rowwise_adagrad")``); each plan
trained with Adam (+ the sparse rule) at batch 256 on this machine, steps/s after
compilation. ``python -m scripts.plan_step_time OUT.json`` (from the repository root)."""

from __future__ import annotations

import datetime
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import flowtt_jax as ftt
from benchmarks import records
from examples import two_tower as tt
from flowtt_jax.collection import TableConfig
from flowtt_jax.collection.config import SparseUpdate

USERS, ITEMS, DIM, B, STEPS = 5_000_000, 2_000_000, 32, 256, 6
BUDGETS_MIB = (4, 16, 64, 1024)


def _base() -> list[TableConfig]:
    return [
        TableConfig("user", USERS, DIM),
        TableConfig("country", 50, 8),
        TableConfig("items", ITEMS, DIM, feature_names=("item", "hist"), mode="mean"),
    ]


def _steps_per_s(tables, world: tt.Synth) -> tuple[float, float]:
    model = tt.TwoTower(tables, DIM, nnx.Rngs(0))
    opt = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
    step = tt.make_train_step()

    rng = np.random.default_rng(0)
    raws = [world.batch(rng, B) for _ in range(2)]
    batches = [(tt._user_batch(r), jnp.asarray(r["item"])) for r in raws]
    t0 = time.perf_counter()
    jax.block_until_ready(step(model, opt, *batches[0]))
    compile_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for i in range(STEPS):
        loss = step(model, opt, *batches[i % 2])
    jax.block_until_ready(loss)
    return STEPS / (time.perf_counter() - t0), compile_s


def main(out: str) -> None:
    world = tt.Synth(USERS, ITEMS, seed=0, pool=256)
    sample = world.batch(np.random.default_rng(9), B)
    stats = ftt.BatchStats.measure([sample], _base())
    ways = {
        "bytes only (step_slack=None)": dict(step_slack=None),
        "default (step_slack=0.1)": {},
        "default + dense_update": dict(dense_update=SparseUpdate("rowwise_adagrad", 0.05)),
    }
    rows = []
    for mib in BUDGETS_MIB:
        for way, kw in ways.items():
            plan = ftt.plan_tables(_base(), mib << 20, stats=stats, optimizer=optax.adam(1e-3), **kw)
            kinds = {
                t.name: (t.kind if t.kind == "dense" else f"tt{t.rank}") + ("+sparse" if t.sparse else "")
                for t in plan.tables
            }
            rate, compile_s = _steps_per_s(plan.tables, world)
            row = {
                "budget_mib": mib,
                "way": way,
                "tables": kinds,
                "steps_per_s": round(rate, 2),
                "compile_s": round(compile_s, 1),
                "modelled_step": plan.step_cost,
                "bytes": plan.total,
            }
            print(json.dumps(row), flush=True)
            rows.append(row)
    commit = records.commit()[:7]
    with open(out, "w") as f:
        json.dump(
            {
                "what": "two-tower steps/s by plan_tables budget",
                "device": str(jax.devices()[0]),
                "date": datetime.date.today().isoformat(),
                "commit": commit,
                "batch": B,
                "users": USERS,
                "items": ITEMS,
                "dim": DIM,
                "rows": rows,
            },
            f,
            indent=1,
        )


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "plan_step_time.json")
