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

from flowtt_jax.capacity import batch_counts
from flowtt_jax.collection.config import TableConfig
from flowtt_jax.collection.packs import TablePack, pack_tables

__all__ = ["BatchStats", "MemoryEstimate", "estimate_memory"]

#: Bytes per id: an int32 or float32 per-id array (the weights, the bag ids); the forward's
#: prepared ids, tables and live flags; the plan (a one-table group's: no group arrays).
ID_BYTES, PREPARED_BYTES, PLAN_BYTES, SINGLE_PLAN_BYTES = 4, 12, 28, 20


@dataclasses.dataclass(frozen=True)
class BatchStats:
    """One batch's sizes: ``batch_size`` bags per feature; ``ids``: ids per feature;
    ``unique``: unique ids per table (the most any sample batch had)."""

    batch_size: int
    ids: Mapping[str, int]
    unique: Mapping[str, int] = dataclasses.field(default_factory=dict)

    @classmethod
    def measure(cls, batches: Iterable[Mapping[str, Any]], tables: Sequence[TableConfig]) -> BatchStats:
        """The most ids per feature and unique ids per table over sample ``batches`` (dicts
        ``{feature: ids [B, L]}`` or ``{feature: (ids, offsets)}`` with offsets [B + 1])."""
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
        return "\n".join(f"{k:<{width}}  {v / 2**20:10.1f} MiB" for k, v in rows)


@dataclasses.dataclass(frozen=True)
class _PackBytes:
    kept: int  # what a training step holds into the backward: the per-id inputs and the plan
    own: int  # the pack's forward at its peak: its plan (and per-id inputs in passes) and rows
    out: int  # the pooled output (its gradient in the backward)
    rows: int  # a pass's rows, or their gradient


def _pack_bytes(pack: TablePack, stats: BatchStats) -> _PackBytes:
    n = sum(stats.ids.get(s.feature, 0) for s in pack.features)
    bags = stats.batch_size * len(pack.features)
    dim = pack.tables[0].features
    out = 4 * bags * dim
    if n == 0:
        return _PackBytes(0, 0, out, 0)
    inputs = (2 * ID_BYTES + PREPARED_BYTES) * n  # prepared ids, tables, live; weights, bag ids
    if pack.kind == "dense":  # gathered rows [n, D] and their gradient
        rows = 4 * n * dim
        return _PackBytes(inputs, inputs + rows, out, rows)
    per_pass = min(n, pack.ids_per_pass or n)  # the ids the kernels take at a time
    capacity = pack.unique_capacity
    rows = 4 * min(per_pass, capacity if capacity is not None else per_pass) * dim
    one_table = pack.kind == "single" or len(pack.tables) == 1
    plan = (SINGLE_PLAN_BYTES if one_table else PLAN_BYTES) * per_pass
    if per_pass < n:  # passes: the per-id inputs live through the passes
        return _PackBytes(inputs + plan, inputs + plan + rows, out, rows)
    return _PackBytes(inputs + plan, plan + rows, out, rows)


def _scratch(pack: TablePack, stats: BatchStats) -> int:
    """The plan's sort of ``n`` keys and values (double buffers): ``16 n``."""
    return 16 * sum(stats.ids.get(s.feature, 0) for s in pack.features) if pack.kind != "dense" else 0


def estimate_memory(
    tables: Sequence[TableConfig],
    stats: BatchStats,
    *,
    optimizer: Any = None,
    training: bool = True,
    param_dtype: Any = np.float32,
    ids_per_pass: int | None = None,
) -> MemoryEstimate:
    """The step's memory for ``tables`` (as ``TTEmbeddingCollection`` packs them) on batches
    of ``stats``: a training step (forward and backward) or, ``training=False``, inference.

    ``optimizer``: an optax ``GradientTransformation`` whose state is sized on the
    parameters (``jax.eval_shape`` of its ``init``); None: no state. Features of ``stats``
    no table reads raise ``KeyError``; features it lacks count as empty. ``ids_per_pass``:
    as ``TTEmbeddingCollection``'s.
    """
    packs = pack_tables(tables, ids_per_pass)
    known = {s.feature for p in packs for s in p.features}
    unknown = sorted(set(stats.ids) - known)
    if unknown:
        raise KeyError(f"estimate_memory: features {unknown} are read by no table")
    shapes = [jax.ShapeDtypeStruct(shape, param_dtype) for p in packs for shape in p.array_shapes]
    parameters = sum(x.size * x.dtype.itemsize for x in shapes)
    state = 0
    if optimizer is not None:
        state = sum(
            x.size * x.dtype.itemsize for x in jax.tree.leaves(jax.eval_shape(optimizer.init, shapes))
        )
    sizes = [_pack_bytes(p, stats) for p in packs]
    if not sizes:
        return MemoryEstimate(parameters, state, {}, 0)
    biggest = max(sizes, key=lambda s: s.own)
    activations = {"pooled outputs (their gradients in the backward)": sum(s.out for s in sizes)}
    if training:
        activations["per-id inputs and plans kept for the backward"] = sum(s.kept for s in sizes)
        activations["the largest pack's row gradients"] = max(s.rows for s in sizes)
        activations["parameter gradients"] = parameters
    else:
        activations["the largest pack's forward (plan, rows)"] = biggest.own
    return MemoryEstimate(parameters, state, activations, max(_scratch(p, stats) for p in packs))
