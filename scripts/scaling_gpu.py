"""Weak scaling of the sharded collection on the GPUs of one host (``flowtt_jax.sharding``).

Two workloads, each at fixed per-GPU batches, on 1 GPU and on N (default: every GPU):

- ``dlrm``: a DLRM training step (bottom MLP, ``TTEmbeddingCollection`` of the 26 Criteo
  Kaggle tables at full cardinality -- TT rank 16, dim 16, dense under 2000 rows --, dot
  interaction, top MLP, BCE, Adam), through ``make_train_step``: data parallel
  (``shard_collection(..., placement=None)``) and table-wise (LPT placement from a batch).
- ``meta``: the Meta-like collection of ``benchmarks.workloads`` (dim 32, rank 32, one shape
  group), forward + backward (core gradients) of the packed table-batched op:
  ``GroupDataParallel`` and ``GroupTableWise``.

One GPU runs the plain single-device program (no ``shard_map``): the baseline. Each
N-GPU program is also run on the 1-GPU batch and its results (DLRM: losses of 3 steps
from the same start; meta: loss and core gradients) compared with the 1-GPU ones.
Recorded per run: wall time per step (median over repeats of K queued steps), examples/s,
weak-scaling efficiency (throughput on N / (N x throughput on 1)), compile time, XLA
memory analysis and each GPU's peak allocator bytes (the process's peak so far), and,
from a ``jax.profiler`` trace, each GPU's busy time and the share of it in NCCL kernels.
JSON after every run (a cut-short call keeps what was done); a plot at the end.

On the 2-GPU machine (one 10-minute call, the build included):

    FLOWTT_CUDA=ON FLOWTT_CUDA_ARCHITECTURES=90 python3 -m pip install --no-build-isolation \\
        --no-deps -q -e . && NCCL_NVLS_ENABLE=0 PYTHONPATH=. python3 scripts/scaling_gpu.py \\
        --out $OUT/scaling

``--budget-s`` (default 420) stops starting runs once spent; ``--meta-cases 788x4096``
picks the collections (tables x per-GPU batch). Meta-788 at 32,768 bags per GPU (351M ids
per GPU) does not fit one H200 with this op: its rows and their gradient alone are
nnz x D x 4 B x 2 = 90 GB; the default runs the 240-table prefix at that batch.
"""

from __future__ import annotations

import os

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast off (the machine's rule)

import argparse
import dataclasses
import datetime
import functools
import glob
import json
import multiprocessing
import statistics
import subprocess
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.workloads import HASH, MetaLikeCollection, Workload, bounded_zipf

REPO = Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------------------- data
def _draw_tables(coll: MetaLikeCollection, batch: int, tables: range) -> list[tuple[np.ndarray, np.ndarray]]:
    """Tables ``tables`` of ``coll.draw(batch)``, drawn the same way (per-table seeds)."""
    out = []
    for t in tables:
        rng = np.random.default_rng([coll.seed, t, 1, batch])
        n_t = np.ones(batch, np.int64) if coll.one_hot[t] else rng.poisson(coll.pooling_mean[t], batch)
        ranks = bounded_zipf(rng, coll.alpha[t], int(coll.rows[t]), int(n_t.sum()))
        ids = (ranks.astype(np.uint64) * np.uint64(HASH)) % np.uint64(coll.rows[t])
        out.append((ids.astype(np.int32), n_t))
    return out


def meta_draw(coll: MetaLikeCollection, batch: int, pool) -> Workload:
    """``coll.draw(batch)`` with the tables drawn by the processes of ``pool``."""
    chunks = [range(t, min(t + 8, coll.num_tables)) for t in range(0, coll.num_tables, 8)]
    parts = [p for chunk in pool.map(functools.partial(_draw_tables, coll, batch), chunks) for p in chunk]
    offsets = np.concatenate([[0], np.cumsum(np.concatenate([n for _, n in parts]))]).astype(np.int64)
    return Workload(
        name=f"meta{coll.num_tables}_B{batch}",
        batch=batch,
        ids=np.concatenate([i for i, _ in parts]),
        offsets=offsets.astype(np.int32 if offsets[-1] < 2**31 else np.int64),
        feature_table=tuple(range(coll.num_tables)),
        specs=coll.specs,
        params={**coll.params, "batch": batch},
    )


def dlrm_batch(cards: tuple[int, ...], batch: int, seed: int) -> tuple[np.ndarray, ...]:
    """Dense [B, 13] normal, sparse [B, 26] Zipf(1.2) ids scattered over each table, labels [B]."""
    rng = np.random.default_rng(seed)
    dense = rng.standard_normal((batch, 13)).astype(np.float32)
    ranks = np.minimum(rng.zipf(1.2, (batch, len(cards))) - 1, 2**40)
    sparse = ((ranks.astype(np.uint64) * np.uint64(HASH)) % np.asarray(cards, np.uint64)).astype(np.int32)
    labels = (rng.random(batch) < 0.25).astype(np.float32)
    return dense, sparse, labels


# ----------------------------------------------------------------------------- measuring
def _commit() -> str:
    if os.environ.get("FLOWTT_COMMIT"):
        return os.environ["FLOWTT_COMMIT"]
    try:
        return subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=REPO, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def step_time(run: Callable[[], Any], repeats: int = 3, target_s: float = 0.3) -> dict:
    """Wall seconds per call: 2 warm-up calls, then the median over ``repeats`` of K queued
    calls and one block (K so that a repeat takes about ``target_s``)."""
    jax.block_until_ready(run())
    t0 = time.perf_counter()
    jax.block_until_ready(run())
    first = time.perf_counter() - t0
    k = int(min(20, max(2, target_s / max(first, 1e-4))))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = None
        for _ in range(k):
            out = run()
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / k)
    return {"step_s": statistics.median(times), "steps_per_repeat": k, "repeats_s": times}


def _union(intervals: list[tuple[int, int]]) -> float:
    total, end = 0.0, -1
    for s, e in sorted(intervals):
        if s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total


def profile(run: Callable[[], Any], steps: int = 5) -> dict | None:
    """Per GPU from a trace of ``steps`` queued calls: busy ms per step (union of its
    streams' events), NCCL kernels' ms per step (union) and their share of busy time."""
    from jax.profiler import ProfileData

    with tempfile.TemporaryDirectory() as d:
        jax.profiler.start_trace(d)
        try:
            out = None
            for _ in range(steps):
                out = run()
            jax.block_until_ready(out)
        finally:
            jax.profiler.stop_trace()
        paths = sorted(glob.glob(os.path.join(d, "**", "*.xplane.pb"), recursive=True))
        if not paths:
            return None
        data = ProfileData.from_file(paths[-1])
    gpus = {}
    for plane in data.planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        busy, nccl = [], []
        for line in plane.lines:
            if not line.name.startswith("Stream"):
                continue
            for ev in line.events:
                span = (ev.start_ns, ev.start_ns + ev.duration_ns)
                busy.append(span)
                if "nccl" in ev.name.lower():
                    nccl.append(span)
        if busy:
            b, c = _union(busy) / steps * 1e-6, _union(nccl) / steps * 1e-6
            gpus[plane.name] = {"busy_ms": b, "collective_ms": c, "collective_share": c / b}
    return gpus or None


def peak_bytes(devices) -> list[int | None]:
    return [(d.memory_stats() or {}).get("peak_bytes_in_use") for d in devices]


def memory_analysis(compiled) -> dict:
    ma = compiled.memory_analysis()
    if ma is None:
        return {}
    keys = ("argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes", "alias_size_in_bytes")
    return {k: int(getattr(ma, k, 0)) for k in keys}


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


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


class Dlrm:
    """The DLRM step (``flowtt_jax.sharding.make_train_step``)."""

    name = "dlrm"

    def __init__(self, dim: int = 16, rank: int = 16):
        import optax
        from flax import nnx

        from examples.criteo_synth import CRITEO_KAGGLE_CARDINALITIES
        from flowtt_jax.collection import make_table_configs
        from flowtt_jax.nnx import TTEmbeddingCollection

        self.cards = tuple(int(c) for c in CRITEO_KAGGLE_CARDINALITIES)
        self.tables = make_table_configs(
            {f"C{i + 1}": n for i, n in enumerate(self.cards)}, dim, rank=rank, dense_threshold=2000
        )
        names = tuple(t.name for t in self.tables)

        class Model(nnx.Module):
            def __init__(self, tables, rngs):
                f = len(tables) + 1
                self.bottom = nnx.List([nnx.Linear(13, 64, rngs=rngs), nnx.Linear(64, dim, rngs=rngs)])
                self.emb = TTEmbeddingCollection(tables, rngs=rngs)
                sizes = (dim + f * (f - 1) // 2, 128, 64, 1)
                self.top = nnx.List([nnx.Linear(a, b, rngs=rngs) for a, b in zip(sizes[:-1], sizes[1:])])

            def __call__(self, dense, sparse):
                x = dense
                for layer in self.bottom:
                    x = jax.nn.relu(layer(x))
                embs = self.emb({n: sparse[:, i] for i, n in enumerate(names)})
                t = jnp.stack([x] + [embs[n] for n in names], axis=1)
                li, lj = np.tril_indices(t.shape[1], k=-1)
                z = jnp.einsum("bid,bjd->bij", t, t)[:, li, lj]
                y = jnp.concatenate([x, z], axis=1)
                for i, layer in enumerate(self.top):
                    y = layer(y) if i == len(self.top) - 1 else jax.nn.relu(layer(y))
                return y[:, 0]

        self.template = nnx.split(Model(self.tables, nnx.Rngs(0)))
        self.tx = optax.adam(1e-3)

    @staticmethod
    def loss(model, dense, sparse, labels):
        import optax

        return optax.sigmoid_binary_cross_entropy(model(dense, sparse), labels).mean()

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
                costs = sh.table_costs(nnx.merge(*self.template).emb.layout, sample)
                placement = sh.place_tables(costs, n)

            def build():
                model, _ = self._fresh()
                sh.shard_collection(model.emb, mesh, placement=placement)
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
    """Forward + backward of the packed Meta-like collection (``GroupDataParallel`` /
    ``GroupTableWise``)."""

    def __init__(self, num_tables: int, pool):
        from flowtt_jax.kernels.group_plan import GroupLayout

        self.coll = MetaLikeCollection.create(num_tables)
        self.name = f"meta{num_tables}"
        self.pool = pool
        self.layout = GroupLayout(self.coll.specs)
        key = jax.random.key(0)
        # rows of about unit variance: std^6 * r1 * r2 = 1
        std = (self.coll.specs[0].ranks[1] * self.coll.specs[0].ranks[2]) ** (-1 / 6)
        self.packed = tuple(
            jax.device_put(std * jax.random.normal(jax.random.fold_in(key, k), s), jax.devices()[0])
            for k, s in enumerate(self.layout.packed_shapes())
        )

    def batches(self, per_gpu: int, n: int) -> dict:
        timed = meta_draw(self.coll, per_gpu * n, self.pool)
        check = timed if n == 1 else meta_draw(self.coll, per_gpu, self.pool)
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
            params = sh_put(self.packed, mesh, jax.sharding.PartitionSpec())
            unstack = lambda g: g
        else:
            w = batches["timed"]
            costs = sh.group_costs(self.layout, w.ids, w.offsets, feature_tables)
            obj = sh.GroupTableWise(self.layout, feature_tables, sh.place_tables(costs, n), mesh)
            stacked = jax.jit(obj.shard_params)(self.packed)
            params = sh_put(stacked, mesh, jax.sharding.PartitionSpec("data"))
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


def sh_put(arrays, mesh, spec):
    return jax.device_put(arrays, jax.sharding.NamedSharding(mesh, spec))


# ----------------------------------------------------------------------------- driver
def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="output folder (JSON, plot)")
    p.add_argument("--gpus", type=int, nargs="*", default=None, help="GPU counts (default: 1 and all)")
    p.add_argument("--dlrm-batches", type=int, nargs="*", default=[4096, 32768], help="per-GPU batches")
    p.add_argument(
        "--meta-cases",
        nargs="*",
        default=["788x4096", "240x32768"],
        help="Meta-like collections as TABLESxPER_GPU_BATCH",
    )
    p.add_argument("--strategies", nargs="*", default=["data", "table"], choices=["data", "table"])
    p.add_argument("--budget-s", type=float, default=420.0, help="start no run after this many seconds")
    p.add_argument("--workers", type=int, default=min(32, os.cpu_count() or 1), help="data-drawing processes")
    return p.parse_args(argv)


def efficiency(results: list[dict]) -> list[dict]:
    """Weak-scaling efficiency of each N-GPU run against the 1-GPU run of its case."""
    single = {(r["workload"], r["per_gpu_batch"]): r for r in results if r.get("strategy") == "single"}
    rows = []
    for r in results:
        base = single.get((r["workload"], r["per_gpu_batch"]))
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


def plot(results: list[dict], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    cases = sorted({(r["workload"], r["per_gpu_batch"]) for r in results if "examples_per_s" in r})
    if not cases:
        return
    fig, axes = plt.subplots(1, len(cases), figsize=(4 * len(cases), 3.4), squeeze=False)
    for ax, (wl, b) in zip(axes[0], cases):
        runs = [
            r for r in results if (r["workload"], r["per_gpu_batch"]) == (wl, b) and "examples_per_s" in r
        ]
        base = next((r for r in runs if r["strategy"] == "single"), None)
        for strategy, marker in (("data", "o"), ("table", "s")):
            pts = sorted((r["num_gpus"], r["examples_per_s"]) for r in runs if r["strategy"] == strategy)
            if base is not None:
                pts = [(1, base["examples_per_s"])] + pts
            if len(pts) > 1:
                ax.plot(*zip(*pts), marker=marker, label=strategy)
        gpus = sorted({r["num_gpus"] for r in runs})
        if base is not None:
            ax.plot(gpus, [g * base["examples_per_s"] for g in gpus], "k:", label="ideal")
        ax.set_xticks(gpus)
        ax.set_title(f"{wl}, {b} per GPU")
        ax.set_xlabel("GPUs")
        ax.set_ylabel("examples / s")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    args = parse_args(argv)
    t_start = time.perf_counter()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    devices = jax.devices()
    gpus = args.gpus or sorted({1, len(devices)})
    stamp = datetime.datetime.now(datetime.timezone.utc)
    kind = devices[0].device_kind.replace(" ", "_")
    path = out_dir / f"scaling_{kind}_{stamp:%Y-%m-%dT%H%M}.json"
    record = {
        "device": f"{devices[0].platform}:{devices[0].device_kind}",
        "num_devices": len(devices),
        "date": stamp.isoformat(),
        "commit": _commit(),
        "jax": jax.__version__,
        "env": {
            k: os.environ.get(k) for k in ("NCCL_NVLS_ENABLE", "XLA_PYTHON_CLIENT_PREALLOCATE", "XLA_FLAGS")
        },
        "args": vars(args),
        "method": "step_s: wall time per step, median of 3 repeats of K queued steps after 2 warm-up "
        "steps (inputs already on the GPUs); examples_per_s = global batch / step_s; profile: per GPU, "
        "union of stream events per step (busy) and of NCCL kernels (collective) in a trace of 5 steps; "
        "peak_bytes: the allocator's peak so far in the process (monotone over runs)",
        "results": [],
    }
    print(f"{record['device']} x{len(devices)}, GPU counts {gpus}, jax {jax.__version__}", flush=True)

    def save() -> None:
        record["efficiency"] = efficiency(record["results"])
        path.write_text(json.dumps(record, indent=1, default=float))

    workloads: list[tuple[Any, int]] = [(None, b) for b in args.dlrm_batches]
    for case in args.meta_cases:
        tables, batch = (int(x) for x in case.split("x"))
        workloads.append((tables, batch))
    built: dict[Any, Any] = {}
    # spawned, not forked: jax's threads are running (the workers import this file)
    pool = multiprocessing.get_context("spawn").Pool(args.workers) if args.meta_cases else None
    for spec, per_gpu in workloads:
        try:
            if spec not in built:
                built[spec] = Dlrm() if spec is None else Meta(spec, pool)
            wl = built[spec]
        except Exception:  # recorded; the other cases still run
            record["results"].append({"workload": str(spec), "error": traceback.format_exc()[-3000:]})
            save()
            continue
        batches = {}
        reference = None
        for n in gpus:
            for strategy in ["single"] if n == 1 else args.strategies:
                row = {"workload": wl.name, "per_gpu_batch": per_gpu, "num_gpus": n, "strategy": strategy}
                elapsed = time.perf_counter() - t_start
                if elapsed > args.budget_s:
                    row["skipped"] = f"time budget spent ({elapsed:.0f} s of {args.budget_s:.0f})"
                    record["results"].append(row)
                    save()
                    continue
                try:
                    if n not in batches:
                        t0 = time.perf_counter()
                        batches[n] = wl.batches(per_gpu, n)
                        row["data_s"] = time.perf_counter() - t0
                    prepared = wl.prepare(strategy, n, batches[n])
                    row["compile_s"] = prepared.compile_s
                    row["memory_analysis"] = memory_analysis(prepared.compiled)
                    row.update(step_time(prepared.step))
                    global_batch = per_gpu * n
                    row["global_batch"] = global_batch
                    row["examples_per_s"] = global_batch / row["step_s"]
                    row["profile"] = profile(prepared.step)
                    row["peak_bytes"] = peak_bytes(devices[:n])
                    if prepared.placement is not None:
                        row["placement"] = prepared.placement
                    if prepared.reference is not None:
                        reference = prepared.reference
                    if prepared.check is not None and reference is not None:
                        row["check"] = wl.compare(reference, prepared.check)
                    del prepared
                except Exception:  # recorded (e.g. out of memory); the next runs go on
                    row["error"] = traceback.format_exc()[-3000:]
                record["results"].append(row)
                save()
                summary = {k: row[k] for k in ("step_s", "examples_per_s") if k in row}
                status = "error" if "error" in row else row.get("check", {}).get("ok", "-")
                print(
                    f"{wl.name:8s} B/GPU {per_gpu:6d} x{n} {strategy:6s} {summary} check {status}", flush=True
                )
        del batches
    if pool is not None:
        pool.close()
    plot(record["results"], path.with_suffix(".png"))
    save()
    print(
        f"\n{'workload':10s} {'B/GPU':>6s} {'GPUs':>4s} {'strategy':8s} {'step ms':>9s} {'ex/s':>12s} "
        f"{'eff':>5s} {'coll%':>6s} check"
    )
    eff = {
        (e["workload"], e["per_gpu_batch"], e["strategy"], e["num_gpus"]): e["efficiency"]
        for e in record["efficiency"]
    }
    for r in record["results"]:
        key = (r["workload"], r.get("per_gpu_batch"), r.get("strategy"), r.get("num_gpus"))
        if "step_s" not in r:
            print(
                f"{r['workload']:10s} {r.get('per_gpu_batch', 0):6d} {r.get('num_gpus', 0):4d} "
                f"{r.get('strategy', ''):8s} {'skipped' if 'skipped' in r else 'ERROR'}"
            )
            continue
        shares = [g["collective_share"] for g in (r.get("profile") or {}).values()]
        share = f"{100 * max(shares):5.1f}%" if shares else "    -"
        e = f"{eff[key]:.2f}" if key in eff else "  -"
        print(
            f"{r['workload']:10s} {r['per_gpu_batch']:6d} {r['num_gpus']:4d} {r['strategy']:8s} "
            f"{1e3 * r['step_s']:9.2f} {r['examples_per_s']:12,.0f} {e:>5s} {share} "
            f"{r.get('check', {}).get('ok', '-')}"
        )
    print(f"JSON: {path}")
    return 0 if all("error" not in r for r in record["results"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
