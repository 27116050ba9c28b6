"""What a collection's step holds in device memory, before committing to it:
``estimate_memory(tables, BatchStats)`` gives parameters, optimizer state (for an optax
transform), the step's activations at their peak (named buffers) and the kernels' largest
run-time scratch.

The activations follow the op's buffers (``docs/memory.md``). For a pack of tables (a TT
shape group, a dense pack) read by ``n`` ids in ``b`` bags of dim ``D``, the kernels taking
``m = min(ids_per_pass, n)`` ids at a time and holding ``C = min(capacity, m)`` unique rows
(``TableConfig.max_unique_ids``; none: ``m``):

- per-id inputs (prepared ids, tables, live flags, weights, bag ids): ``20 n``;
- the plan of a pass: ``28 m`` (``20 m`` for a one-table group: no per-group arrays);
- a pass's rows ``4 C D`` (or their gradient); a dense pack's gathered rows ``4 n D``;
- the pooled output ``4 b D`` (its gradient in its place in the backward).

Inference peaks in the largest pack's forward (its plan and rows; in passes, its per-id
inputs too) beside every output. A training step holds every pack's per-id inputs and plan
into the backward, the largest pack's row gradients and the parameters' gradients. Checked
against XLA's analysis of TT collections (``tests/test_memory.py``); a dense pack's buffers
are counted coarsely (XLA interleaves the packs' buffers: with dense tables the estimate can
be a third off).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from flowtt_jax.budget import (
    AUTO_FRACTION,
    CANDIDATES,
    ID_BYTES,
    PREPARED_BYTES,
    CallBytes,
    device_memory_bytes,
    op_bytes,
    pass_size,
    resolve_budget,
)
from flowtt_jax.capacity import batch_counts
from flowtt_jax.collection.config import TableConfig
from flowtt_jax.collection.packs import TablePack, pack_tables

__all__ = [
    "AUTO_FRACTION",
    "BatchStats",
    "CANDIDATES",
    "MemoryEstimate",
    "MemoryPlan",
    "choose_memory_plan",
    "device_memory_bytes",
    "estimate_memory",
    "resolve_budget",
]


@dataclasses.dataclass(frozen=True)
class BatchStats:
    """One batch's sizes: ``batch_size`` bags per feature; ``ids``: ids per feature;
    ``unique``: unique ids per table (the most any sample batch had)."""

    batch_size: int
    ids: Mapping[str, int]
    unique: Mapping[str, int] = dataclasses.field(default_factory=dict)

    @classmethod
    def measure(cls, batches: Iterable[Any], tables: Sequence[TableConfig]) -> BatchStats:
        """The most ids per feature and unique ids per table over sample ``batches``: feature
        dicts in any input form the collections take, or ``KeyedJagged`` batches with keys
        (``capacity.batch_counts``)."""
        table_of = {f: t.name for t in tables for f in t.feature_keys}
        batch_size, ids, unique = batch_counts(batches, table_of, "BatchStats.measure")
        return cls(batch_size, ids, unique)


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    """Bytes of one step: ``parameters``, ``optimizer_state``, ``activations`` (named
    buffers live at the step's peak) and ``scratch`` (the kernels' largest run-time scratch,
    allocated inside one call)."""

    parameters: int
    optimizer_state: int
    activations: Mapping[str, int]
    scratch: int
    ids_per_pass: int | None = None  # the TT kernels' ids per pass it assumes (None: all)
    unique_windows: int | None = None  # the shape groups' windows of unique rows (None: 1)

    @property
    def activation_bytes(self) -> int:
        return sum(self.activations.values())

    @property
    def total(self) -> int:
        return self.parameters + self.optimizer_state + self.activation_bytes + self.scratch

    def __str__(self) -> str:
        rows = [("parameters", self.parameters), ("optimizer state", self.optimizer_state)]
        rows += [(f"activations: {k}", v) for k, v in self.activations.items()]
        rows += [("kernel scratch", self.scratch), ("total", self.total)]
        width = max(len(k) for k, _ in rows)
        lines = [f"{k:<{width}}  {v / 2**20:10.1f} MiB" for k, v in rows]
        if self.ids_per_pass is not None:
            lines.append(f"(the TT kernels take {self.ids_per_pass} ids per pass)")
        if self.unique_windows is not None:
            lines.append(f"(the shape groups hold their unique rows in {self.unique_windows} windows)")
        return "\n".join(lines)


def _pack_ids(pack: TablePack, stats: BatchStats) -> int:
    return sum(stats.ids.get(s.feature, 0) for s in pack.features)


def _pack_bytes(pack: TablePack, stats: BatchStats) -> CallBytes:
    n = _pack_ids(pack, stats)
    bags = stats.batch_size * len(pack.features)
    dim = pack.tables[0].features
    if pack.kind == "dense":  # gathered rows [n, D] and their gradient
        inputs, rows = (2 * ID_BYTES + PREPARED_BYTES) * n, 4 * n * dim
        return (
            CallBytes(inputs, inputs + rows, 4 * bags * dim, rows)
            if n
            else CallBytes(0, 0, 4 * bags * dim, 0)
        )
    if pack.kind == "single" and n:  # not 3 cores: the reference, which gathers every id's cores
        spec = pack.tables[0].spec()
        gathered = sum(int(np.prod(shape[1:])) for shape in spec.core_shapes)  # r q r floats a core
        per_id = 4 * (gathered + dim)  # the gathered slices and the contracted row
        inputs = (2 * ID_BYTES + PREPARED_BYTES) * n
        return CallBytes(inputs + per_id * n, inputs + per_id * n, 4 * bags * dim, per_id * n)
    one_table = pack.kind == "single" or len(pack.tables) == 1
    b = op_bytes(n, bags, dim, one_table, pack.ids_per_pass, pack.capacity_for(n))
    if not pack.cache_rows or not n:
        return b
    routed = (8 + 4 * dim) * n  # hit and slot per id, the cached rows gathered (their gradient)
    return CallBytes(b.kept + routed, b.own + routed, b.out, b.rows + 4 * n * dim)


def _scratch(pack: TablePack, stats: BatchStats) -> int:
    """The plan's sort of a pass's ``m`` keys and values (double buffers): ``16 m``."""
    if pack.kind == "dense":
        return 0
    n = _pack_ids(pack, stats)
    return 16 * min(n, pack.ids_per_pass or n)


def estimate_memory(
    tables: Sequence[TableConfig],
    stats: BatchStats,
    *,
    optimizer: Any = None,
    training: bool = True,
    param_dtype: Any = np.float32,
    ids_per_pass: int | None = None,
    memory_budget: int | str | None = None,
    unique_windows: int | None = None,
) -> MemoryEstimate:
    """The step's memory for ``tables`` (as ``TTEmbeddingCollection`` packs them) on batches
    of ``stats``: a training step (forward and backward) or, ``training=False``, inference.

    ``optimizer``: an optax ``GradientTransformation`` whose state is sized on the
    parameters (``jax.eval_shape`` of its ``init``); None: no state. Features of ``stats``
    no table reads raise ``KeyError``; features it lacks count as empty. ``ids_per_pass``,
    ``unique_windows``, ``memory_budget``: as ``TTEmbeddingCollection``'s (a budget: the passes its automatic
    policy chooses, ``choose_memory_plan``; the estimate's ``ids_per_pass`` says which).
    """
    packs = pack_tables(tables, ids_per_pass, unique_windows)
    if ids_per_pass is None and unique_windows is None and memory_budget is not None:
        return choose_memory_plan(
            packs, stats, memory_budget, training=training, param_dtype=param_dtype, optimizer=optimizer
        ).estimate
    return _estimate(packs, stats, optimizer, training, param_dtype)


def _estimate(
    packs: Sequence[TablePack], stats: BatchStats, optimizer: Any, training: bool, param_dtype: Any
):
    known = {s.feature for p in packs for s in p.features}
    unknown = sorted(set(stats.ids) - known)
    if unknown:
        raise KeyError(f"estimate_memory: features {unknown} are read by no table")
    shapes = [jax.ShapeDtypeStruct(shape, param_dtype) for p in packs for shape in p.array_shapes]
    shapes += [  # hot-row cache blocks (trained); their ids are 4 bytes a row
        jax.ShapeDtypeStruct((p.cache_rows, p.tables[0].features), param_dtype) for p in packs if p.cache_rows
    ]
    parameters = sum(x.size * x.dtype.itemsize for x in shapes) + sum(4 * p.cache_rows for p in packs)
    state = 0
    if optimizer is not None:
        state = sum(
            x.size * x.dtype.itemsize for x in jax.tree.leaves(jax.eval_shape(optimizer.init, shapes))
        )
    per_pass = next((p.ids_per_pass for p in packs if p.kind != "dense"), None)
    windows = next((p.unique_windows for p in packs if p.kind == "tt" and p.unique_windows), None)
    sizes = [_pack_bytes(p, stats) for p in packs]
    if not sizes:
        return MemoryEstimate(parameters, state, {}, 0, per_pass, windows)
    biggest = max(sizes, key=lambda s: s.own)
    activations = {"pooled outputs (their gradients in the backward)": sum(s.out for s in sizes)}
    if training:
        activations["per-id inputs and plans kept for the backward"] = sum(s.kept for s in sizes)
        activations["the largest pack's row gradients"] = max(s.rows for s in sizes)
        activations["parameter gradients"] = parameters
    else:
        activations["the largest pack's forward (plan, rows)"] = biggest.own
    scratch = max(_scratch(p, stats) for p in packs)
    return MemoryEstimate(parameters, state, activations, scratch, per_pass, windows)


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """The automatic memory policy's choice for one batch shape: the TT kernels take
    ``ids_per_pass`` ids at a time (None: all at once) in ``passes`` passes, each shape group
    holding its unique rows in ``windows`` windows; ``estimate`` is ``estimate_memory``'s
    for that choice; ``fits``: its total is within ``budget`` bytes (None: no budget). Never
    fitting, the policy takes the leanest candidate (64 passes) and says so."""

    ids_per_pass: int | None
    passes: int
    budget: int | None
    estimate: MemoryEstimate
    fits: bool
    #: XLA's bytes of the chosen step (its memory analysis: arguments, temporaries and
    #: outputs, plus the estimate's kernel scratch), where the policy checked it by XLA
    xla_bytes: int | None = None
    windows: int = 1

    @property
    def candidate(self) -> tuple[int, int]:
        """``(passes, windows)``: its place in ``CANDIDATES``."""
        return self.passes, self.windows

    def __str__(self) -> str:
        budget = "no budget" if self.budget is None else f"budget {self.budget / 2**20:.1f} MiB"
        if self.ids_per_pass is not None:
            how = f"{self.passes} passes of {self.ids_per_pass} ids"
        elif self.windows > 1:
            how = f"one plan, unique rows in {self.windows} windows"
        else:
            how = "all ids at once"
        verdict = "fits" if self.fits else "does NOT fit"
        xla = "" if self.xla_bytes is None else f", XLA's analysis {self.xla_bytes / 2**20:.1f} MiB"
        head = f"{how}: estimate {self.estimate.total / 2**20:.1f} MiB{xla}, {verdict} ({budget})"
        return f"{head}\n{self.estimate}"


def apply_candidate(packs: Sequence[TablePack], most_ids: int, passes: int, windows: int) -> tuple:
    """``packs`` with a candidate's ``ids_per_pass`` (``most_ids`` over ``passes``) and
    ``unique_windows`` on their TT packs (dense packs unchanged)."""
    per_pass = pass_size(most_ids, passes)
    return tuple(
        p
        if p.kind == "dense"
        else dataclasses.replace(
            p, ids_per_pass=per_pass, unique_windows=windows if windows > 1 and p.kind == "tt" else None
        )
        for p in packs
    )


def choose_memory_plan(
    packs: Sequence[TablePack],
    stats: BatchStats,
    memory_budget: int | str | None = "auto",
    *,
    training: bool = True,
    param_dtype: Any = np.float32,
    optimizer: Any = None,
    candidate: tuple[int, int] | None = None,
) -> MemoryPlan:
    """The first of ``CANDIDATES`` (fastest first: one pass; windows of the uniques; passes
    over the ids) whose step fits the budget by ``estimate_memory`` (a training step unless
    ``training=False``: at trace time the forward does not know whether a backward follows,
    so the collections plan for one).

    ``packs``: a collection's (``pack_tables``); where they have an ``ids_per_pass`` or
    ``unique_windows``, that is the plan; else it is chosen, the same for every TT pack
    (passes of the largest pack's ids, rounded up to 256; windows of each group's own ids).
    A capacity (``max_unique_ids``) is kept as configured (the smaller holds). ``candidate``:
    that ``(passes, windows)``, not the first that fits. A collection's call checks a choice
    near its budget by XLA's analysis (``collection.xla_fit``).
    """
    budget = resolve_budget(memory_budget)
    most = max((_pack_ids(p, stats) for p in packs if p.kind != "dense"), default=0)
    tt = [p for p in packs if p.kind != "dense"]
    given_pass = next((p.ids_per_pass for p in tt if p.ids_per_pass), None)
    given_windows = next((p.unique_windows for p in tt if p.unique_windows), None)
    if given_pass is not None or given_windows is not None:  # the user's, whatever the budget
        est = _estimate(packs, stats, optimizer, training, param_dtype)
        fits = budget is None or est.total <= budget
        passes = -(-most // given_pass) if given_pass else 1
        return MemoryPlan(given_pass, passes, budget, est, fits, windows=given_windows or 1)
    best = None
    for passes, windows in CANDIDATES if candidate is None else (candidate,):
        per_pass = pass_size(most, passes)
        if candidate is None and per_pass is not None and per_pass >= most:
            continue
        est = _estimate(
            apply_candidate(packs, most, passes, windows), stats, optimizer, training, param_dtype
        )
        best = MemoryPlan(
            per_pass, passes, budget, est, budget is None or est.total <= budget, windows=windows
        )
        if best.fits:
            return best
    return best
