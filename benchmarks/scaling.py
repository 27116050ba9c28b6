"""The ``scaling`` stage: weak scaling of the sharded collection on the GPUs of one host
(``flowtt_jax.sharding``), ``python -m benchmarks --stage scaling``.

Two workloads, each at fixed per-GPU batches, on 1 GPU and on N (default: every GPU):

- ``dlrm``: a DLRM training step, the model of ``examples/dlrm.py`` (bottom MLP,
  ``TTEmbeddingCollection`` of the 26 Criteo Kaggle tables at full cardinality -- TT rank
  16, dim 16, dense under 2000 rows --, dot interaction, top MLP) with BCE and Adam, through
  ``make_train_step``: data parallel (``shard_collection(..., placement=None)``) and
  table-wise (LPT placement from a batch); batches from ``workloads.dlrm_batch``.
- ``meta``: the Meta-like collection of ``benchmarks.workloads`` (dim 32, rank 32, one shape
  group), forward + backward (core gradients) of the packed table-batched op:
  ``GroupDataParallel`` and ``GroupTableWise``.

One GPU runs the plain single-device program (no ``shard_map``): the baseline. Each
N-GPU program is also run on the 1-GPU batch and its results (DLRM: losses of 3 steps
from the same start; meta: loss and core gradients) compared with the 1-GPU ones.
Recorded per run (``results``): wall time per step (median over repeats of K queued steps,
``benchmarks.timing``), examples/s, weak-scaling efficiency (``efficiency``: throughput on
N / (N x throughput on 1)), compile time, XLA memory analysis and each GPU's peak allocator
bytes (the process's peak so far), and, from a ``jax.profiler`` trace, each GPU's busy
time and the share of it in NCCL kernels (``timing.device_profiles``). The JSON
(``<out-dir>/scaling/bench_scaling_<gpu>_<time>.json``, where ``benchmarks.scaling_report``
reads it for the measurements page's ``scaling`` block) is rewritten after every run, so a cut-short
call keeps what was done; the plot (the JSON's path, ``.png``) comes last.

On the 2-GPU machine (one 10-minute call, the build included):

    FLOWTT_CUDA=ON FLOWTT_CUDA_ARCHITECTURES=90 python3 -m pip install --no-build-isolation \\
        --no-deps -q -e . && NCCL_NVLS_ENABLE=0 python3 -m benchmarks --stage scaling \\
        --out-dir $OUT

The stage's time budget (``--time-budget``, default 420 s) stops starting runs once spent;
``--meta-cases 788x4096`` picks the collections (tables x per-GPU batch), ``--dlrm-batches``,
``--gpus`` and ``--strategies`` the rest. Meta-788 at 32,768 bags per GPU (351M ids per GPU)
does not fit one H200 with this op: its rows and their gradient alone are nnz x D x 4 B x 2
= 90 GB; the default runs the 240-table prefix at that batch. ``--quick``: tiny sizes, for
a CPU (with ``XLA_FLAGS=--xla_force_host_platform_device_count=2``, 2 devices).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import multiprocessing
import os
import statistics
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from . import plots, records, scaling_report, timing
from .workloads import MetaLikeCollection, Workload, dlrm_batch

STRATEGIES = ("data", "table")
#: The JSON's ``method``: how the numbers are measured.
METHOD = (
    "step_s: wall time per step, median of 3 repeats of K queued steps after 2 warm-up "
    "steps (inputs already on the GPUs); examples_per_s = global batch / step_s; profile: per GPU, "
    "union of stream events per step (busy) and of NCCL kernels (collective) in a trace of 5 steps; "
    "peak_bytes: the allocator's peak so far in the process (monotone over runs)"
)


def step_time(run: Callable[[], Any], repeats: int = 3, target_s: float = 0.3) -> dict:
    """Wall seconds per call: 2 warm-up calls, then the median over ``repeats`` of K queued
    calls and one block (K so that a repeat takes about ``target_s``)."""
    first = timing.blocking_ms(run, (), warm=2) / 1e3
    k = int(min(20, max(2, target_s / max(first, 1e-4))))
    times = [t / 1e3 for t in timing.queued_times(run, (), k, repeats)]
    return {"step_s": statistics.median(times), "steps_per_repeat": k, "repeats_s": times}


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def efficiency(results: list[dict]) -> list[dict]:
    """Weak-scaling efficiency of each N-GPU run against the 1-GPU run of its case."""
    case = scaling_report.case_of
    single = {case(r): r for r in results if r.get("strategy") == "single"}
    rows = []
    for r in results:
        base = single.get(case(r))
        if (
            r.get("strategy") == "single"
            or base is None
            or "examples_per_s" not in r
            or "examples_per_s" not in base
        ):
            continue
        eff = r["examples_per_s"] / (r["num_gpus"] * base["examples_per_s"])
        rows.append(
            {k: r[k] for k in ("workload", "per_gpu_batch", "strategy", "num_gpus")} | {"efficiency": eff}
        )
    return rows


# ----------------------------------------------------------------------------- workloads
@dataclasses.dataclass
class Prepared:
    """A run ready to time: ``step()`` runs one step; ``check`` (N GPUs) its results on
    the 1-GPU batch, to compare with the 1-GPU run's ``reference``."""

    step: Callable[[], Any]
    compiled: Any
    compile_s: float
    reference: Any = None
    check: Any = None
    placement: dict | None = None


def _mesh(n: int):
    return jax.make_mesh((n,), ("data",), devices=jax.devices()[:n])


def _put(arrays, mesh, spec):
    return jax.device_put(arrays, jax.sharding.NamedSharding(mesh, spec))


class Dlrm:
    """The DLRM step of ``examples/dlrm.py``'s model (``flowtt_jax.sharding.make_train_step``
    on N GPUs)."""

    name = "dlrm"

    def __init__(self, dim: int = 16, rank: int = 16):
        import optax
        from flax import nnx

        from examples.criteo_synth import CRITEO_KAGGLE_CARDINALITIES
        from examples.dlrm import DLRM
        from flowtt_jax.collection import make_table_configs

        self.cards = tuple(int(c) for c in CRITEO_KAGGLE_CARDINALITIES)
        self.tables = make_table_configs(
            {f"C{i + 1}": n for i, n in enumerate(self.cards)}, dim, rank=rank, dense_threshold=2000
        )
        self.template = nnx.split(DLRM(self.tables, dim=dim, rngs=nnx.Rngs(0)))
        self.tx = optax.adam(1e-3)

    @staticmethod
    def loss(model, dense, sparse, labels):
        from examples.dlrm import bce

        return bce(model(dense, sparse), labels)

    def batches(self, per_gpu: int, n: int) -> dict:
        return {
            "timed": dlrm_batch(self.cards, per_gpu * n, seed=n),
            "check": dlrm_batch(self.cards, per_gpu, 1),
        }

    def _fresh(self):
        from flax import nnx

        graphdef, state = self.template
        model = nnx.merge(graphdef, jax.tree.map(jnp.copy, state))
        return model, nnx.Optimizer(model, self.tx, wrt=nnx.Param)

    def prepare(self, strategy: str, n: int, batches: dict) -> Prepared:
        from flax import nnx

        from flowtt_jax import sharding as sh

        if strategy == "single":
            model, optimizer = self._fresh()
            graphdef, state = nnx.split((model, optimizer))

            @functools.partial(jax.jit, donate_argnums=0)
            def step(state, *batch):
                model, optimizer = nnx.merge(graphdef, state)
                loss, grads = nnx.value_and_grad(self.loss)(model, *batch)
                optimizer.update(model, grads)
                return nnx.state((model, optimizer)), loss

            def place(batch):
                return jax.device_put(batch, jax.devices()[0])

        else:
            mesh = _mesh(n)
            placement = None
            if strategy == "table":
                sample = {t.name: batches["timed"][1][:, i] for i, t in enumerate(self.tables)}
                costs = sh.table_costs(nnx.merge(*self.template).embeddings.layout, sample)
                placement = sh.place_tables(costs, n)

            def build():
                model, _ = self._fresh()
                sh.shard_collection(model.embeddings, mesh, placement=placement)
                optimizer = nnx.Optimizer(model, self.tx, wrt=nnx.Param)
                graphdef, state = nnx.split((model, optimizer))
                return graphdef, sh.place_state(state, mesh)

            graphdef, state = build()
            step = sh.make_train_step(graphdef, self.loss, mesh)

            def place(batch):
                return sh.shard_batch(batch, mesh)

        timed = place(batches["timed"])
        t0 = time.perf_counter()
        compiled = step.lower(state, *timed).compile()
        compile_s = time.perf_counter() - t0
        holder = {"state": state}

        def run():
            holder["state"], loss = compiled(holder["state"], *timed)
            return loss

        def trajectory(step, state, batch) -> list[float]:
            losses = []
            for _ in range(3):
                state, loss = step(state, *batch)
                losses.append(float(loss))
            return losses

        prepared = Prepared(run, compiled, compile_s)
        if strategy == "single":  # the 1-GPU batch is the timed one: the same program
            prepared.reference = trajectory(compiled, nnx.split(self._fresh())[1], timed)
        else:
            prepared.check = trajectory(step, build()[1], place(batches["check"]))
            if placement is not None:
                prepared.placement = {"devices": placement.devices, "imbalance": placement.imbalance}
        return prepared

    @staticmethod
    def compare(reference, check) -> dict:
        err = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(check, reference))
        return {"losses": check, "reference_losses": reference, "max_rel_err": err, "ok": err < 1e-4}


class Meta:
    """Forward + backward of the packed Meta-like collection ``coll`` (``GroupDataParallel``
    / ``GroupTableWise``), its batches drawn by ``map`` (e.g. a process pool's)."""

    def __init__(self, coll: MetaLikeCollection, map: Callable = map):
        from flowtt_jax import GroupLayout

        self.coll, self.map = coll, map
        self.name = f"meta{coll.num_tables}"
        self.layout = GroupLayout(self.coll.specs)
        key = jax.random.key(0)
        # rows of about unit variance: std^6 * r1 * r2 = 1
        std = (self.coll.specs[0].ranks[1] * self.coll.specs[0].ranks[2]) ** (-1 / 6)
        self.packed = tuple(
            jax.device_put(std * jax.random.normal(jax.random.fold_in(key, k), s), jax.devices()[0])
            for k, s in enumerate(self.layout.packed_shapes())
        )

    def batches(self, per_gpu: int, n: int) -> dict:
        timed = self.coll.draw(per_gpu * n, map=self.map, wide_offsets=True)
        check = timed if n == 1 else self.coll.draw(per_gpu, map=self.map, wide_offsets=True)
        return {"timed": timed, "check": check}

    def _loss(self, out):
        return jnp.sum(out * out) / out.shape[1]

    def prepare(self, strategy: str, n: int, batches: dict) -> Prepared:
        from flowtt_jax import sharding as sh
        from flowtt_jax import tt_embedding_bag_group

        feature_tables = tuple(range(self.coll.num_tables))
        if strategy == "single":

            def grad_fn(params, ids, offsets, _capacity):
                out = tt_embedding_bag_group(params, self.layout, ids, offsets, feature_tables)
                return self._loss(out)

            fn = jax.jit(jax.value_and_grad(grad_fn), static_argnums=3)
            w = batches["timed"]
            dev = jax.devices()[0]
            args = (self.packed, jax.device_put(w.ids, dev), jax.device_put(w.offsets, dev), None)
            prepared = self._compile(fn, args)
            prepared.reference = jax.device_get(prepared.step())
            return prepared
        mesh = _mesh(n)
        if strategy == "data":
            obj = sh.GroupDataParallel(self.layout, feature_tables, mesh)
            params = _put(self.packed, mesh, jax.sharding.PartitionSpec())
            unstack = lambda g: g
        else:
            w = batches["timed"]
            costs = sh.group_costs(self.layout, w.ids, w.offsets, feature_tables)
            obj = sh.GroupTableWise(self.layout, feature_tables, sh.place_tables(costs, n), mesh)
            stacked = jax.jit(obj.shard_params)(self.packed)
            params = _put(stacked, mesh, jax.sharding.PartitionSpec("data"))
            unstack = jax.jit(obj.gather_params)

        def grad_fn(params, ids, offsets, capacity):
            kw = {} if strategy == "data" else {"capacity": capacity}
            return self._loss(obj.apply(params, ids, offsets, **kw))

        fn = jax.jit(jax.value_and_grad(grad_fn), static_argnums=3)

        def shard(w: Workload):
            """Per-shard arrays on the mesh and (table-wise) the exact all_to_all capacity."""
            split = sh.shard_packed(w.ids, w.offsets, self.coll.num_tables, n)
            capacity = obj.needed_capacity(split["offsets"]) if strategy == "table" else None
            return (*sh.shard_batch((split["ids"], split["offsets"]), mesh), capacity)

        timed = shard(batches["timed"])
        prepared = self._compile(fn, (params, *timed))
        loss, grads = fn(params, *shard(batches["check"]))
        prepared.check = jax.device_get((loss, unstack(grads)))
        if strategy == "table":
            prepared.placement = {
                "devices": obj.placement.devices,
                "imbalance": obj.placement.imbalance,
                "capacity": timed[-1],
                "shard_capacity": timed[0].shape[1],
            }
        return prepared

    @staticmethod
    def _compile(fn, args) -> Prepared:
        """``fn`` compiled for ``args`` (the last: static)."""
        t0 = time.perf_counter()
        compiled = fn.lower(*args).compile()
        compile_s = time.perf_counter() - t0
        return Prepared(lambda: compiled(*args[:-1]), compiled, compile_s)

    @staticmethod
    def compare(reference, check) -> dict:
        (l1, g1), (l2, g2) = reference, check
        errs = [rel_err(a, b) for a, b in zip(g2, g1)]
        loss_err = abs(float(l2) - float(l1)) / max(abs(float(l1)), 1e-30)
        return {"loss_rel_err": loss_err, "grad_rel_err": errs, "ok": loss_err < 1e-4 and max(errs) < 1e-4}


# ----------------------------------------------------------------------------- the stage
class Runner(records.Run):
    """Every case (workload, per-GPU batch) on 1 GPU, then on each larger GPU count with
    each strategy; ``collection(tables)`` is the Meta-like collection of ``tables`` tables."""

    def __init__(
        self,
        a: argparse.Namespace,
        path: Path,
        doc: dict,
        collection: Callable[[int], MetaLikeCollection],
    ):
        super().__init__(a, path, doc)
        self.collection = collection
        self.devices = jax.devices()
        self.gpus = a.gpus or tuple(sorted({1, len(self.devices)}))
        env_keys = ("NCCL_NVLS_ENABLE", "XLA_PYTHON_CLIENT_PREALLOCATE", "XLA_FLAGS")
        doc.update(
            {
                "num_devices": len(self.devices),
                "env": {k: os.environ.get(k) for k in env_keys},
                "args": {
                    "gpus": self.gpus,
                    "dlrm_batches": a.dlrm_batches,
                    "meta_cases": [f"{t}x{b}" for t, b in a.meta_cases],
                    "strategies": a.strategies,
                    "workers": a.workers,
                },
                "method": METHOD,
                "status": "running",
                "results": [],
                "efficiency": [],
                "plots": {},
            }
        )
        self.log(f"{doc['device']} x{len(self.devices)}, GPU counts {self.gpus}, jax {jax.__version__}")

    def write(self) -> None:
        self.doc["efficiency"] = efficiency(self.doc["results"])
        super().write()

    def add(self, row: dict) -> None:
        self.doc["results"].append(row)
        self.write()

    def run(self) -> None:
        cases = [(None, b) for b in self.a.dlrm_batches] + list(self.a.meta_cases)
        # spawned, not forked: jax's threads are running
        spawn = multiprocessing.get_context("spawn")
        with spawn.Pool(self.a.workers) if self.a.meta_cases else contextlib.nullcontext() as pool:
            built: dict[Any, Any] = {}
            for spec, per_gpu in cases:
                try:
                    if spec not in built:
                        built[spec] = Dlrm() if spec is None else Meta(self.collection(spec), pool.map)
                except Exception:  # noqa: BLE001  (recorded; the other cases still run)
                    self.add({"workload": str(spec), "error": traceback.format_exc()[-3000:]})
                    continue
                self.case(built[spec], per_gpu)

    def case(self, wl: Dlrm | Meta, per_gpu: int) -> None:
        """The runs of one case: 1 GPU (the reference), then N GPUs per strategy."""
        batches: dict[int, dict] = {}
        reference = None
        for n in self.gpus:
            for strategy in ("single",) if n == 1 else self.a.strategies:
                row = {"workload": wl.name, "per_gpu_batch": per_gpu, "num_gpus": n, "strategy": strategy}
                if self.remaining() <= 0:
                    elapsed = time.monotonic() - self.t0
                    row["skipped"] = f"time budget spent ({elapsed:.0f} s of {self.a.time_budget:.0f})"
                else:
                    try:
                        if n not in batches:
                            t0 = time.perf_counter()
                            batches[n] = wl.batches(per_gpu, n)
                            row["data_s"] = time.perf_counter() - t0
                        prepared = wl.prepare(strategy, n, batches[n])
                        self.measure(row, prepared, per_gpu * n, n)
                        if prepared.reference is not None:
                            reference = prepared.reference
                        if prepared.check is not None and reference is not None:
                            row["check"] = wl.compare(reference, prepared.check)
                        del prepared
                    except Exception:  # noqa: BLE001  (recorded, e.g. out of memory; the next runs go on)
                        row["error"] = traceback.format_exc()[-3000:]
                self.add(row)
                summary = {k: row[k] for k in ("step_s", "examples_per_s") if k in row}
                status = "error" if "error" in row else row.get("check", {}).get("ok", "-")
                self.log(f"{wl.name:8s} B/GPU {per_gpu:6d} x{n} {strategy:6s} {summary} check {status}")

    def measure(self, row: dict, prepared: Prepared, global_batch: int, n: int) -> None:
        row["compile_s"] = prepared.compile_s
        row["memory_analysis"] = timing.memory_analysis(prepared.compiled)
        row.update(step_time(prepared.step))
        row["global_batch"] = global_batch
        row["examples_per_s"] = global_batch / row["step_s"]
        row["profile"] = timing.device_profiles(prepared.step, ())
        row["peak_bytes"] = [
            (timing.memory_stats(d) or {}).get("peak_bytes_in_use") for d in self.devices[:n]
        ]
        if prepared.placement is not None:
            row["placement"] = prepared.placement

    def finish(self, code: int) -> int:
        """The plot, the table of the run; exit code 1 when a run failed."""
        results = self.doc["results"]
        self.doc["plots"] = {"scaling": plots.draw_scaling(results, self.path.with_suffix(".png"))}
        self.write()
        cases = {scaling_report.case_of(r): None for r in results}
        rows = [(self.doc, c, [r for r in results if scaling_report.case_of(r) == c]) for c in cases]
        print("\n" + "\n".join(scaling_report.table(rows)))
        errors = sum("error" in r for r in results)
        print(f"wrote {self.path} ({self.doc['status']}, {len(results)} runs, {errors} errors)", flush=True)
        return code or int(errors > 0)
