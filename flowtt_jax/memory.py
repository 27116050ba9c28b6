"""What a collection's step holds in device memory, before committing to it:
``estimate_memory(tables, BatchStats)`` gives parameters, optimizer state (for an optax
transform), the step's activations at their peak (named buffers) and the kernels' largest
run-time scratch.

The activations follow the op's buffers (``docs/memory.md``). For a pack of tables (a TT
shape group, a dense pack) read by ``n`` ids in ``b`` bags of dim ``D``, holding
``C = min(capacity, n)`` unique rows at a time (``TableConfig.max_unique_ids``; none: ``n``):

- kept from the forward for the backward: the plan (``28 n``; ``20 n`` for a one-table
  group, whose plan has no per-group arrays), the pooling weights and bag ids (``8 n``);
- forward only: the prepared ids, tables and live flags (``12 n``);
- the pooled output ``4 b D`` (in the backward, its gradient in its place);
- a pass's rows ``4 C D`` (forward) or their gradient (backward); a dense pack's gathered
  rows ``4 n D``.

The peak: every pack's arrays and outputs (XLA prepares every pack's inputs before the
first pooling), plus the largest pack's rows or row gradients; a training step also holds
the parameters' gradients.
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
    kept: int  # from the forward to the backward: plan, weights, bag ids
    prepared: int  # forward only: the prepared ids, tables and live flags
    out: int  # the pooled output (its gradient in the backward)
    rows: int  # a pass's rows (forward) or their gradient (backward)


def _pack_bytes(pack: TablePack, stats: BatchStats) -> _PackBytes:
    n = sum(stats.ids.get(s.feature, 0) for s in pack.features)
    bags = stats.batch_size * len(pack.features)
    dim = pack.tables[0].features
    out = 4 * bags * dim
    if n == 0:
        return _PackBytes(0, 0, out, 0)
    if pack.kind == "dense":  # gathered rows [n, D] and their gradient
        return _PackBytes(2 * ID_BYTES * n, PREPARED_BYTES * n, out, 4 * n * dim)
    capacity = pack.unique_capacity
    rows = 4 * min(n, capacity if capacity is not None else n) * dim
    one_table = pack.kind == "single" or len(pack.tables) == 1
    plan = (SINGLE_PLAN_BYTES if one_table else PLAN_BYTES) * n
    return _PackBytes(2 * ID_BYTES * n + plan, PREPARED_BYTES * n, out, rows)


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
) -> MemoryEstimate:
    """The step's memory for ``tables`` (as ``TTEmbeddingCollection`` packs them) on batches
    of ``stats``: a training step (forward and backward) or, ``training=False``, inference.

    ``optimizer``: an optax ``GradientTransformation`` whose state is sized on the
    parameters (``jax.eval_shape`` of its ``init``); None: no state. Features of ``stats``
    no table reads raise ``KeyError``; features it lacks count as empty.
    """
    packs = pack_tables(tables)
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
    activations = {
        "plans, pooling weights and bag ids": sum(s.kept for s in sizes),
        "prepared ids, tables, live flags": sum(s.prepared for s in sizes),
        "pooled outputs (their gradients in the backward)": sum(s.out for s in sizes),
        "the largest pack's rows (or their gradients)": max(s.rows for s in sizes),
    }
    if training:
        activations["parameter gradients"] = parameters
    return MemoryEstimate(parameters, state, activations, max(_scratch(p, stats) for p in packs))
