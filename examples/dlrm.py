"""DLRM on synthetic Criteo-format data with TT-compressed embedding tables.

    python examples/dlrm.py              # TT tables (default settings, a few minutes on 2 CPU cores)
    python examples/dlrm.py --dense      # the same model with dense tables
    python examples/dlrm.py --compare    # TT then dense on the same data; prints both AUCs
    python examples/dlrm.py --mesh data=2 --sharding table   # 2 devices, TT tables placed table-wise
    python examples/dlrm.py --data /criteo/train.txt          # Criteo TSV files (.gz, directories, globs)
    python examples/dlrm.py --preset meta --compare --curve-every 25 --out run.json --plot run.png

Model (the DLRM of Naumov et al., scaled down for a CPU): bottom MLP over the 13
dense features -> D; one embedding per sparse feature (26 features, Criteo Kaggle
cardinalities) from ``flowtt_jax.nnx.TTEmbeddingCollection`` -- tables with fewer than
``--dense-threshold`` rows are plain dense, the rest TT (rank ``--rank``); pairwise dot
interaction of the 27 vectors; top MLP -> logit; binary cross-entropy; optax Adam
(or Adagrad). Data: ``criteo_synth.py`` (hidden-teacher labels, Zipf ids; see there),
made on the device by a jitted program, one batch per step; or, with ``--data PATH...``
(TSV files, .gz, directories or globs), Criteo TSV files parsed on the host and prefetched
onto the device by a thread (``criteo_tsv.py``: the format, the id mapping, the held-out
split -- ``--eval-data``, else the stream's last ``--eval-batches`` batches -- and the
processes' shares).

``--curve-every N`` scores one fixed held-out set (the same examples in the TT and dense runs)
every N steps, between steps, into a learning curve ``[(examples seen, AUC, log loss)]``;
``--out`` writes the runs (curves, bytes, times, device, commit) as JSON and ``--plot`` draws
the curves (``curves.py``). Per-table-type optimizer: ``--tt-optimizer`` / ``--tt-lr`` for the
TT cores (their tables labelled ``"tt"``, ``optax.multi_transform``), ``--tt-init-std`` their
rows' std at init; the preset's defaults (``PRESETS``) fill the flags left unset.

The training loop only dispatches: batch ``i`` is generated on device and fed to a
jitted, state-donating train step; the host waits for the device only at log points
(``--log-every``). After training and evaluation the run prints where a step's time
goes: data generation, the forward, and forward+backward+update, each timed alone over
``--profile-steps`` back-to-back calls, next to the training loop's own time per step.

``--max-rows`` caps every table's rows by hashing ids (``id mod cap``), applied
identically to the TT and dense runs so they train on the same data. The default
(1,000,000) keeps the dense baseline (about 356 MB of fp32 tables, plus Adam state)
trainable in a few minutes on 2 CPU cores; ``--max-rows 0`` uses the full Criteo
cardinalities (33.8M rows: 2.16 GB dense at D=16; TT is unaffected).

Runs on the default JAX backend: CPU, or the GPU when one is present. ``--mesh data=N``
trains data parallel over N devices (``data=all``: every device of every process) with
the collection data parallel (``--sharding data``) or its TT tables placed table-wise
(``--sharding table``), through ``flowtt_jax.sharding``; ``--distributed`` first calls
``jax.distributed.initialize()`` (one process per host; ``--coordinator``,
``--num-processes``, ``--process-id`` where the cluster does not say them).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import itertools
import math
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec

from flowtt_jax import KeyedJagged
from flowtt_jax import sharding as ftt_sharding
from flowtt_jax.collection import TableConfig, make_table_configs
from flowtt_jax.kernels import ffi
from flowtt_jax.nnx import TTEmbeddingCollection

if __package__:  # imported as examples.dlrm
    from .criteo_synth import NUM_DENSE, SynthConfig, SynthCriteo
    from .criteo_tsv import CriteoTSV, add_data_arguments
    from .curves import HeldOut, plot, roc_auc, run_document, write_json  # noqa: F401 (roc_auc: re-exported)
    from .meta_synth import MetaSynthConfig, SynthMeta
else:  # run as a script: python examples/dlrm.py (its folder is sys.path[0])
    from criteo_synth import NUM_DENSE, SynthConfig, SynthCriteo
    from criteo_tsv import CriteoTSV, add_data_arguments
    from curves import HeldOut, plot, roc_auc, run_document, write_json  # noqa: F401
    from meta_synth import MetaSynthConfig, SynthMeta

try:
    from tqdm.auto import tqdm
except ImportError:  # pragma: no cover
    tqdm = None


# ----------------------------------------------------------------------------- model
class MLP(nnx.Module):
    def __init__(self, sizes: Sequence[int], *, final_activation: bool, rngs: nnx.Rngs):
        self.layers = nnx.List([nnx.Linear(a, b, rngs=rngs) for a, b in zip(sizes[:-1], sizes[1:])])
        self.final_activation = final_activation

    def __call__(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1 or self.final_activation:
                x = jax.nn.relu(x)
        return x


class DLRM(nnx.Module):
    """Bottom MLP, embedding collection, dot interaction, top MLP."""

    def __init__(
        self,
        tables: Sequence[TableConfig],
        *,
        dim: int,
        bottom: Sequence[int] = (64,),
        top: Sequence[int] = (128, 64),
        impl: str = "auto",
        interaction: str = "dot",
        rngs: nnx.Rngs,
    ):
        self.names = tuple(t.name for t in tables)
        self.interaction = interaction
        self.bottom = MLP((NUM_DENSE, *bottom, dim), final_activation=True, rngs=rngs)
        self.embeddings = TTEmbeddingCollection(tables, impl=impl, rngs=rngs)
        assert self.embeddings.feature_names == self.names  # the columns of `sparse`
        f = len(tables) + 1
        self.num_interactions = f * (f - 1) // 2 if interaction == "dot" else (f - 1) * dim
        self.top = MLP((dim + self.num_interactions, *top, 1), final_activation=False, rngs=rngs)

    def __call__(self, dense: jax.Array, sparse: jax.Array | KeyedJagged) -> jax.Array:
        x = self.bottom(dense)  # [B, D]
        # stacked [B, 26] ids or a KeyedJagged -> [B, F, D], no per-feature op in the program
        embs = self.embeddings(sparse)
        if self.interaction == "cat":  # hundreds of features: their vectors side by side
            return self.top(jnp.concatenate([x, embs.reshape(embs.shape[0], -1)], axis=1))[:, 0]
        t = jnp.concatenate([x[:, None], embs], axis=1)  # [B, F, D]
        z = jnp.einsum("bid,bjd->bij", t, t)
        li, lj = np.tril_indices(t.shape[1], k=-1)
        inter = z[:, li, lj]  # [B, F(F-1)/2]
        return self.top(jnp.concatenate([x, inter], axis=1))[:, 0]


def embedding_bytes(model: DLRM) -> int:
    state = nnx.state(model.embeddings, nnx.Param)
    return int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state)))


# ----------------------------------------------------------------------------- training
@dataclasses.dataclass
class StepTimes:
    """Seconds per step after compile: each part timed alone (``timed``: wall time of
    back-to-back calls over their count, blocking once at the end, so device time when
    the device is the bottleneck) and the training loop's own average step."""

    data: float  # generating one batch on device (reading one: --data)
    forward: float  # the model's forward alone
    train_step: float  # forward + backward + optimizer update on a fixed batch
    loop: float  # the training loop: data + train step + dispatch + log syncs

    def report(self, batch_size: int) -> str:
        ms = lambda t: f"{t * 1e3:.3f} ms"
        parts = self.data + self.train_step
        # the loop dispatches asynchronously: the next batch's generation may overlap the step
        rest = self.loop - parts
        rest = f"dispatch, host syncs and gaps {ms(rest)}" if rest >= 0 else f"{ms(-rest)} of overlap"
        return (
            f"data generation {ms(self.data)} + forward+backward+update {ms(self.train_step)} "
            f"(forward alone {ms(self.forward)}) = {ms(parts)}; whole training step {ms(self.loop)} "
            f"({batch_size / self.loop:,.0f} examples/s; {rest})"
        )


@dataclasses.dataclass
class RunResult:
    name: str
    auc: float
    bayes_auc: float
    final_loss: float
    eval_loss: float
    train_seconds: float
    examples_per_second: float
    embedding_bytes: int
    dense_equivalent_bytes: int
    full_dense_bytes: int
    steps: int
    batch_size: int
    step_times: StepTimes
    curve: list[tuple[int, float, float]]  # (examples seen, held-out AUC, log loss)

    @property
    def memory_ratio(self) -> float:
        return self.dense_equivalent_bytes / self.embedding_bytes


def timed(fn: Callable[[], Any], n: int) -> float:
    """Seconds per call of ``fn`` over ``n`` back-to-back calls (after one warm-up call)."""
    jax.block_until_ready(fn())
    t = time.perf_counter()
    for _ in range(n):
        out = fn()
    jax.block_until_ready(out)
    return (time.perf_counter() - t) / max(n, 1)


def build_optimizer(name: str, lr: float) -> optax.GradientTransformation:
    if name == "adam":
        return optax.adam(lr)
    if name == "adagrad":
        return optax.adagrad(lr, initial_accumulator_value=1e-8)
    raise ValueError(f"unknown optimizer {name!r}")


def bce(logits, labels):
    return optax.sigmoid_binary_cross_entropy(logits, labels).mean()


def synthetic_stream(batch: Callable, stream: int, batch_size: int) -> Iterator[tuple]:
    """Batches 0, 1, 2, ... of a synthetic data set's ``stream``: ``batch(i, batch_size, stream=)``."""
    return (batch(i, batch_size, stream=stream) for i in itertools.count())


@dataclasses.dataclass
class Run:
    """A run's program and state: ``train_step(state, dense, sparse, labels) -> (state,
    loss)`` (the state donated), ``predict(state, dense, sparse) -> logits``, ``batches(stream,
    batch_size)`` (an iterator of device batches ``(dense, sparse, labels, teacher logits or
    None)``; stream 0 trains, 1 is held out), ``batch(index, batch_size, stream=)`` (the
    synthetic data's batch program; None with --data), the state as a flat list of arrays."""

    name: str
    batches: Callable[[int, int], Iterator[tuple]]
    batch: Callable | None
    train_step: Callable
    predict: Callable
    state: list
    emb_bytes: int
    dense_eq: int
    full_dense: int
    mesh: Any = None


def build_run(args: argparse.Namespace, dense_tables: bool, log=print) -> Run:
    """The model, optimizer, data and jitted steps of ``args`` (TT or dense tables)."""
    if args.data is not None:  # Criteo TSV files, parsed on the host (criteo_tsv.py)
        data = CriteoTSV.from_args(args, log)
        cards = {f"C{i + 1}": n for i, n in enumerate(data.cardinalities)}
    elif args.preset == "meta":
        config = MetaSynthConfig(
            args.tables, max_rows=args.max_rows or None, zipf_a=args.zipf_a, seed=args.data_seed
        )
        data = SynthMeta(config)
        cards = dict(zip(data.names, data.cardinalities))
    else:
        data = SynthCriteo(
            SynthConfig(max_rows=args.max_rows or None, zipf_a=args.zipf_a, seed=args.data_seed)
        )
        cards = {f"C{i + 1}": n for i, n in enumerate(data.cardinalities)}
    tables = make_table_configs(
        cards,
        args.dim,
        rank=args.rank,
        dense_threshold=args.dense_threshold,
        mode=args.pooling,
        all_dense=dense_tables,
    )
    # TT cores: their own optimizer label ("tt": --tt-optimizer, --tt-lr) and row std
    tables = [
        dataclasses.replace(t, optimizer="tt", init_std=args.tt_init_std) if t.kind == "tt" else t
        for t in tables
    ]
    name = "dense" if dense_tables else "tt"
    model = DLRM(
        tables,
        dim=args.dim,
        bottom=args.bottom,
        top=args.top,
        impl=args.impl,
        interaction=args.interaction,
        rngs=nnx.Rngs(args.seed),
    )
    emb_bytes = embedding_bytes(model)  # before sharding (table-wise cores are stacked, padded)
    mesh = make_mesh(args.mesh)
    batch = None if args.data is not None else data.batch
    batches = data.batches if batch is None else functools.partial(synthetic_stream, batch)
    if mesh is not None:
        if args.batch_size % mesh.size:
            raise ValueError(f"--batch-size {args.batch_size} does not split over {mesh.size} devices")
        placement = None
        if args.sharding == "table":  # input-aware: costs from a batch of the step's size
            if batch is None:
                sample = next(iter(data.loader(0, args.batch_size)))["sparse"]
            else:
                sample = np.asarray(data.batch(0, args.batch_size, stream=0)[1])
            costs = ftt_sharding.table_costs(
                model.embeddings.layout, {t.name: sample[:, i] for i, t in enumerate(tables)}
            )
            placement = ftt_sharding.place_tables(costs, mesh.size)
        ftt_sharding.shard_collection(model.embeddings, mesh, placement=placement)
        sharding = NamedSharding(mesh, PartitionSpec("data"))
        if batch is None:  # each process reads its rows of a batch (criteo_tsv.py)
            batches = functools.partial(data.batches, sharding=sharding)
        else:
            batch = data.batch_fn(sharding)
            batches = functools.partial(synthetic_stream, batch)
        log(
            f"[{name}] mesh {dict(mesh.shape)} over {jax.process_count()} process(es), collection "
            f"{args.sharding} parallel"
            + (f" (placement imbalance {placement.imbalance:.3f})" if placement is not None else "")
        )
    tx = build_optimizer(args.optimizer, args.lr)
    if (args.tt_optimizer, args.tt_lr) != (args.optimizer, args.lr):  # the TT cores' own
        tt_tx = build_optimizer(args.tt_optimizer, args.tt_lr)
        tx = optax.multi_transform({"default": tx, "tt": tt_tx}, model.embeddings.param_labels())
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

    dense_eq = sum(n * args.dim * 4 for n in data.cardinalities)
    full_dense = sum(n * args.dim * 4 for n in data.raw_cardinalities)
    n_tt = sum(t.kind == "tt" for t in tables)
    log(
        f"[{name}] backend={jax.default_backend()} impl={args.impl} (compiled kernels "
        f"{'available' if ffi.available() else 'not built: reference'}) tables: {n_tt} TT (rank "
        f"{args.rank}) + {len(tables) - n_tt} dense, dim {args.dim}, "
        f"max_rows={args.max_rows or 'none (full Criteo cardinalities)'}"
    )
    log(
        f"[{name}] embedding parameter memory: {emb_bytes:,} bytes "
        f"(dense equivalent of these tables: {dense_eq:,} bytes, ratio "
        f"{dense_eq / emb_bytes:,.1f}x; full-cardinality dense: {full_dense:,} bytes)"
    )

    # Functional steps over the split state, passed as a flat list of arrays: plain
    # jax.jit then flattens it in C++ (an nnx.State is flattened in Python, ~1 us a leaf,
    # and costs more to donate). The state is donated, so updates happen in place (the
    # dense baseline's tables and Adam moments are GBs at full cardinality). Batches are
    # made on device by their own jitted program (the same one in the TT and dense runs,
    # so the data are bitwise identical; --data: both runs read the same files); nothing in
    # the loop waits for the device except the loss at log points.
    graphdef, state = nnx.split((model, optimizer))
    if mesh is not None:
        state = ftt_sharding.place_state(state, mesh)
    state, treedef = jax.tree.flatten(state)
    del model, optimizer

    def merge(leaves):
        return nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))

    def loss_of(model, dense, sparse, labels):
        return bce(model(dense, sparse), labels)

    def forward(model, dense, sparse):
        return model(dense, sparse)

    if mesh is None:
        value_and_grad = nnx.value_and_grad(loss_of)
    else:  # the whole model per device; TT cores placed as the collection's strategy says
        value_and_grad = ftt_sharding.sharded_value_and_grad(loss_of, mesh)
        forward = ftt_sharding.sharded_call(forward, mesh)

    @functools.partial(jax.jit, donate_argnums=0)
    def train_step(leaves, dense, sparse, labels):
        model, optimizer = merge(leaves)
        loss, grads = value_and_grad(model, dense, sparse, labels)
        optimizer.update(model, grads)
        new, new_treedef = jax.tree.flatten(nnx.state((model, optimizer)))
        assert new_treedef == treedef, "the train step changed the state's structure"
        return new, loss

    @jax.jit
    def predict(leaves, dense, sparse):
        return forward(merge(leaves)[0], dense, sparse)

    return Run(name, batches, batch, train_step, predict, state, emb_bytes, dense_eq, full_dense, mesh)


def train_and_eval(args: argparse.Namespace, dense_tables: bool, log=print) -> RunResult:
    run = build_run(args, dense_tables, log)
    name, train_step, predict, state = run.name, run.train_step, run.predict, run.state
    emb_bytes, dense_eq, full_dense, mesh = run.emb_bytes, run.dense_eq, run.full_dense, run.mesh
    fetch = (
        np.asarray if mesh is None else lambda a: np.asarray(multihost_utils.process_allgather(a, tiled=True))
    )
    # One fixed held-out set (stream 1: the same examples in the TT and dense runs), scored
    # every --curve-every steps between steps (its time kept out of the training times) and
    # at the end: the learning curve [(examples seen, AUC, log loss)].
    with contextlib.closing(run.batches(1, args.batch_size)) as stream:
        held = HeldOut.take(stream, args.eval_batches, fetch)
    curve, eval_seconds = [], 0.0

    def score(step: int) -> tuple[int, float, float]:
        nonlocal eval_seconds
        t = time.perf_counter()
        curve.append((step * args.batch_size, *held.evaluate(lambda d, s: predict(state, d, s), fetch)))
        eval_seconds += time.perf_counter() - t
        return curve[-1]

    if args.curve_every:
        score(0)  # the untrained model
    eval_seconds = 0.0

    # train_seconds counts everything but evaluations (compile included); examples/s is
    # measured after the first (compiling) step
    bar = None
    if tqdm is not None and not args.no_progress:
        bar = tqdm(total=args.steps, desc=f"train[{name}]", unit="step", dynamic_ncols=True)
    t0 = time.perf_counter()
    t_first = None
    losses = []
    train_batches = run.batches(0, args.batch_size)
    for step, (d, s, y, _) in zip(range(args.steps), train_batches):
        state, loss = train_step(state, d, s, y)
        losses.append(loss)
        if step == 0:
            float(loss)
            t_first = time.perf_counter()
        if (step + 1) % args.log_every == 0 or step + 1 == args.steps:
            loss_val = float(np.mean(jax.device_get(losses[-args.log_every :])))  # no new compile
            elapsed = time.perf_counter() - t_first - eval_seconds
            eps = step * args.batch_size / elapsed if step > 0 else float("nan")
            if bar is not None:
                bar.set_postfix_str(f"loss {loss_val:.4f}, {eps:,.0f} examples/s")
            else:
                log(f"[{name}] step {step + 1}/{args.steps} loss {loss_val:.4f} ({eps:,.0f} examples/s)")
        if args.curve_every and (step + 1) % args.curve_every == 0 and step + 1 < args.steps:
            _, auc, eval_loss = score(step + 1)
            if bar is None:
                log(f"[{name}] step {step + 1}: held-out AUC {auc:.4f}, log loss {eval_loss:.4f}")
        if bar is not None:
            bar.update(1)
    jax.block_until_ready(state)
    t_end = time.perf_counter() - eval_seconds
    train_batches.close()
    if bar is not None:
        bar.close()
    train_seconds = t_end - t0
    tail = max(1, args.steps // 10)
    loss_val = float(np.mean(jax.device_get(losses[-tail:])))
    loop = (t_end - t_first) / (args.steps - 1) if args.steps > 1 else float("nan")
    steady = args.batch_size / loop

    _, auc, eval_loss = score(args.steps)
    teacher = run.batch is not None
    log(
        f"[{name}] trained {args.steps} steps x {args.batch_size} in {train_seconds:.1f} s "
        f"({steady:,.0f} examples/s after compile; held-out scoring {eval_seconds:.1f} s apart); "
        f"train loss (mean of last {tail} steps) {loss_val:.4f}"
    )
    log(
        f"[{name}] held-out: AUC {auc:.4f}, log loss {eval_loss:.4f} on {held.size:,} examples"
        + (f" (Bayes AUC of the planted teacher: {held.bayes_auc:.4f})" if teacher else "")
    )

    # Where a step's time goes, each part alone (after the evaluation: the extra steps
    # train the model further on one batch, which nothing uses any more).
    # The data part: the next batches of a fresh training stream (synthetic: the same
    # program as batch 0; --data: reading, parsing and copying, the prefetch thread ahead).
    with contextlib.closing(run.batches(0, args.batch_size)) as stream:
        d, s, y, _ = next(stream)

        def one_step():
            nonlocal state
            state, loss = train_step(state, d, s, y)
            return loss

        n = args.profile_steps
        times = StepTimes(
            data=timed(lambda: next(stream), n),
            forward=timed(lambda: predict(state, d, s), n),
            train_step=timed(one_step, n),
            loop=loop,
        )
    log(f"[{name}] step time after compile: {times.report(args.batch_size)}")
    return RunResult(
        name,
        auc,
        held.bayes_auc,
        loss_val,
        eval_loss,
        train_seconds,
        steady,
        emb_bytes,
        dense_eq,
        full_dense,
        args.steps,
        args.batch_size,
        times,
        curve,
    )


# ----------------------------------------------------------------------------- cli
# Each preset's defaults of the flags left unset (docs/layers.md). Meta: mean pooling (the
# planted teacher averages each bag) beat sum by 0.014 AUC at 100k examples; a TT-only
# learning rate (3e-2), Adagrad for the cores, a smaller or larger row std did not help.
PRESETS = {
    "criteo": dict(interaction="dot", optimizer="adam", lr=1e-2, pooling="sum"),
    "meta": dict(interaction="cat", optimizer="adam", lr=1e-2, pooling="mean"),
}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--dense", action="store_true", help="train with dense tables only")
    mode.add_argument("--compare", action="store_true", help="train TT, then dense, on the same data")
    p.add_argument(
        "--preset",
        choices=("criteo", "meta"),
        default="criteo",
        help="criteo: 26 one-hot Criteo features (stacked ids); meta: --tables Meta-like variable-"
        "length multi-hot features (examples/meta_synth.py), fed as one KeyedJagged batch",
    )
    p.add_argument("--tables", type=int, default=240, help="--preset meta: features (one table each)")
    p.add_argument(
        "--interaction",
        choices=("dot", "cat"),
        default=None,
        help="pairwise dot products of the feature vectors (DLRM; default for criteo) or their "
        "concatenation (default for meta: hundreds of features)",
    )
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=4096)
    p.add_argument("--eval-batches", type=int, default=16, help="held-out batches for AUC")
    p.add_argument("--dim", type=int, default=16, help="embedding dim (DLRM Kaggle config: 16)")
    p.add_argument("--rank", type=int, default=16, help="TT rank")
    p.add_argument(
        "--dense-threshold", type=int, default=2000, help="tables with fewer rows are dense in the TT model"
    )
    p.add_argument(
        "--max-rows",
        type=int,
        default=1_000_000,
        help="cap table rows by hashing ids mod cap (both runs); 0 = full cardinalities",
    )
    add_data_arguments(p)  # --data, --eval-data, ... (examples/criteo_tsv.py)
    p.add_argument("--optimizer", choices=("adam", "adagrad"), default=None, help="default: the preset's")
    p.add_argument("--lr", type=float, default=None, help="default: the preset's (PRESETS)")
    p.add_argument(
        "--tt-optimizer", choices=("adam", "adagrad"), default=None, help="TT cores' (--optimizer)"
    )
    p.add_argument("--tt-lr", type=float, default=None, help="TT cores' learning rate (--lr)")
    p.add_argument("--tt-init-std", type=float, default=None, help="TT rows' std at init (1/sqrt(dim))")
    p.add_argument(
        "--pooling", choices=("sum", "mean", "sqrtn"), default=None, help="bag pooling (the preset's)"
    )
    p.add_argument(
        "--curve-every", type=int, default=0, help="score the held-out set every N steps (learning curve)"
    )
    p.add_argument("--out", default=None, help="write the runs (curves included) to this JSON file")
    p.add_argument("--plot", default=None, help="plot the held-out AUC / log loss curves to this PNG")
    p.add_argument("--bottom", type=int, nargs="*", default=[64], help="bottom MLP hidden sizes")
    p.add_argument("--top", type=int, nargs="*", default=[128, 64], help="top MLP hidden sizes")
    p.add_argument("--zipf-a", type=float, default=1.2, help="id popularity exponent")
    p.add_argument("--impl", default="auto", choices=("auto", "ffi", "reference"))
    p.add_argument("--seed", type=int, default=0, help="model init seed")
    p.add_argument("--data-seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=10, help="log (and wait for the device) every N steps")
    p.add_argument(
        "--profile-steps", type=int, default=10, help="calls per part when timing where a step's time goes"
    )
    p.add_argument("--no-progress", action="store_true", help="plain log lines instead of tqdm")
    p.add_argument(
        "--mesh",
        default=None,
        help="data=N: data parallel over N devices (data=all: every device of every process)",
    )
    p.add_argument(
        "--sharding",
        choices=("data", "table"),
        default="data",
        help="with --mesh: the embedding collection data parallel (replicated cores) or table-wise",
    )
    p.add_argument(
        "--distributed",
        action="store_true",
        help="call jax.distributed.initialize() first (one process per host; cluster env or the flags below)",
    )
    p.add_argument("--coordinator", default=None, help="with --distributed: host:port of process 0")
    p.add_argument("--num-processes", type=int, default=None)
    p.add_argument("--process-id", type=int, default=None)
    p.add_argument(
        "--check",
        action="store_true",
        help="with --compare: exit 1 unless |dense AUC - TT AUC| <= --max-auc-gap, "
        "the embedding memory ratio >= --min-memory-ratio and both runs' losses are finite",
    )
    p.add_argument("--max-auc-gap", type=float, default=0.01)
    p.add_argument("--min-memory-ratio", type=float, default=100.0)
    args = p.parse_args(argv)
    if args.check and not args.compare:
        p.error("--check needs --compare")
    for key, value in PRESETS[args.preset].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.tt_optimizer = args.tt_optimizer or args.optimizer
    args.tt_lr = args.lr if args.tt_lr is None else args.tt_lr
    if args.data is not None and args.preset != "criteo":
        p.error("--data trains the criteo preset (26 one-hot features)")
    if args.preset == "meta" and args.mesh is not None:
        p.error("--preset meta runs on one device: a sharded collection takes feature dicts or stacked ids")
    if args.mesh is not None and not (
        args.mesh.startswith("data=") and args.mesh[5:].replace("all", "0").isdigit()
    ):
        p.error(f"--mesh: data=N or data=all, got {args.mesh!r}")
    return args


def make_mesh(spec: str | None) -> jax.sharding.Mesh | None:
    """The 1-axis ``data`` mesh of ``--mesh data=N`` (the first N devices; all for ``all``)."""
    if spec is None:
        return None
    n = spec.split("=", 1)[1]
    n = jax.device_count() if n == "all" else int(n)
    return jax.make_mesh((n,), ("data",), devices=jax.devices()[:n])


def main(argv: Sequence[str] | None = None) -> dict[str, RunResult]:
    args = parse_args(argv)
    if args.distributed:
        jax.distributed.initialize(args.coordinator, args.num_processes, args.process_id)
    what = "Criteo-format" if args.preset == "criteo" else f"Meta-like ({args.tables} multi-hot features)"
    what = f"Criteo TSV data ({' '.join(args.data)})" if args.data else f"synthetic {what} data"
    print(
        f"DLRM on {what}: {args.steps} steps x batch {args.batch_size}, "
        f"{args.optimizer} lr {args.lr} (TT cores: {args.tt_optimizer} lr {args.tt_lr}, row std "
        f"{args.tt_init_std or 1 / math.sqrt(args.dim):.3g}), {args.pooling} pooling, backend "
        f"{jax.default_backend()} ({jax.devices()[0].device_kind})"
    )
    if args.max_rows:
        print(
            f"note: table rows capped at {args.max_rows:,} by hashing ids (id mod cap) in every "
            f"run, so TT and dense train on the same data (--max-rows 0: full cardinalities)"
        )
    results = {}
    if args.compare:
        results["tt"] = train_and_eval(args, dense_tables=False)
        results["dense"] = train_and_eval(args, dense_tables=True)
        tt, de = results["tt"], results["dense"]
        print("\n=== TT vs dense (same data, same steps) ===")
        print(
            f"TT    AUC {tt.auc:.4f}  embedding bytes {tt.embedding_bytes:>14,}  "
            f"train {tt.train_seconds:7.1f} s"
        )
        print(
            f"dense AUC {de.auc:.4f}  embedding bytes {de.embedding_bytes:>14,}  "
            f"train {de.train_seconds:7.1f} s"
        )
        print(f"AUC difference (dense - TT): {de.auc - tt.auc:+.4f}")
        print(f"embedding memory ratio (dense / TT): {de.embedding_bytes / tt.embedding_bytes:,.1f}x")
        print(f"vs full-cardinality dense tables: {tt.full_dense_bytes / tt.embedding_bytes:,.1f}x")
        tt_eps, de_eps = tt.examples_per_second, de.examples_per_second
        print(
            f"examples/s after compile: TT {tt_eps:,.0f}, dense {de_eps:,.0f} "
            f"(TT / dense {tt_eps / de_eps:.2f})"
        )
        gap, ratio = abs(de.auc - tt.auc), de.embedding_bytes / tt.embedding_bytes
        finite = all(math.isfinite(x) for r in (tt, de) for x in (r.final_loss, r.eval_loss))
        ok = finite and gap <= args.max_auc_gap and ratio >= args.min_memory_ratio
        print(
            f"target (|AUC gap| <= {args.max_auc_gap}, memory ratio >= {args.min_memory_ratio:g}x, "
            f"finite losses): {'met' if ok else 'MISSED'}"
        )
        if args.check and not ok:
            raise SystemExit(1)
    else:
        r = train_and_eval(args, dense_tables=args.dense)
        results[r.name] = r
        if not args.dense:
            print("(--dense trains the same model with dense tables; --compare runs both on the same data)")
    if args.out or args.plot:
        doc = run_document(vars(args), results)
        if args.out:
            print(f"runs written to {write_json(args.out, doc)}")
        if args.plot and (path := plot(doc, args.plot)):
            print(f"learning curves plotted to {path}")
    return results


if __name__ == "__main__":
    main()
