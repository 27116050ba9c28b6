"""Input-aware placement of a collection's TT tables on the devices of a mesh axis.

``table_costs`` estimates each TT table's work per step from a sample batch: its ids,
unique ids and unique (i1, i2) prefixes -- the quantities FlowTT's work is made of --
rather than its size alone (OPER's point: with skewed, table-dependent access, placement
that sees the input balances the step; a big table read by few, hot ids is cheap).
``group_costs`` does the same for one shape group's packed batch. ``place_tables`` assigns
the tables by greedy longest-processing-time over those estimates (heaviest first, each
to the least loaded device), on the host, once: the result is a static
``TableWisePlacement`` for ``TableWiseLayout`` (collections) or ``GroupTableWise``
(packed shape groups).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from flowtt_jax.kernels.group_plan import GroupLayout
from flowtt_jax.tt.spec import TTSpec

__all__ = [
    "PER_ID_COST",
    "TableCost",
    "TableWisePlacement",
    "group_costs",
    "place_tables",
    "table_cost",
    "sample_ids",
]

#: Work per id beyond the arithmetic (plan sort, gathers, pooling traffic: about 40 bytes),
#: in float32 FLOPs at an H200's FLOP-per-byte balance (about 12).
PER_ID_COST = 512.0


@dataclasses.dataclass(frozen=True)
class TableCost:
    """One TT table's estimated work per step: ids, unique ids, unique (i1, i2) prefixes
    in the sample, and ``cost``, forward + backward FLOPs plus ``PER_ID_COST`` per id."""

    name: str
    nnz: int
    unique: int
    prefixes: int
    cost: float


def sample_ids(value: Any, num_rows: int) -> np.ndarray:
    """The in-range ids a feature input pools (host numpy), any input form, global or per shard."""
    if not isinstance(value, Mapping):
        ids = np.asarray(value).reshape(-1)
    else:
        ids = np.asarray(value["ids"])
        offsets, seg = value.get("offsets"), value.get("segment_ids")
        if offsets is not None:
            offsets = np.asarray(offsets)
            rows = ids.reshape(-1, ids.shape[-1]) if offsets.ndim == 2 else ids.reshape(1, -1)
            offs = offsets.reshape(rows.shape[0], -1)
            ids = np.concatenate([r[o[0] : o[-1]] for r, o in zip(rows, offs)])
        elif seg is not None:
            seg = np.asarray(seg)
            local = value["num_bags"] // (seg.shape[0] if seg.ndim == 2 else 1)
            ids = ids[(seg >= 0) & (seg < local)]
        elif value.get("mask") is not None:
            ids = ids[np.asarray(value["mask"], bool)]
        ids = ids.reshape(-1)
    return ids[(ids >= 0) & (ids < num_rows)]


def table_cost(name: str, spec: TTSpec, ids: np.ndarray, *, per_id: float = PER_ID_COST) -> TableCost:
    """The ``TableCost`` of a TT table from the in-range ids [n] a step sends it (host):
    nnz ids, u unique ids, g unique prefixes ``id // p3``, and
    ``cost = 3 (2 g q1 q2 r1 r2 + 2 u D r2) + 2 nnz D + per_id nnz`` (FlowTT forward and
    backward: a prefix product per prefix, a last-core product per unique id; pooling)."""
    uniq = np.unique(ids)
    prefixes = int(np.unique(uniq // spec.row_shape[-1]).size)
    (q1, q2, _), (_, r1, r2, _) = spec.col_shape, spec.ranks
    flops = 3 * (2.0 * prefixes * q1 * q2 * r1 * r2 + 2.0 * uniq.size * spec.embedding_dim * r2)
    cost = flops + 2.0 * ids.size * spec.embedding_dim + per_id * ids.size
    return TableCost(name, int(ids.size), int(uniq.size), prefixes, cost)


def group_costs(
    layout: GroupLayout,
    ids: np.ndarray,
    offsets: np.ndarray,
    feature_tables: Sequence[int],
    *,
    per_id: float = PER_ID_COST,
) -> tuple[TableCost, ...]:
    """``table_cost`` of every table of a shape group (named ``"0" .. "T-1"``) from a sample
    in the packed form of ``tt_embedding_bag_group``: ids [n], feature-major CSR offsets
    ``[F*B + 1]`` (global, or per shard ``[S, F*b + 1]`` with ids ``[S, C]``)."""
    ids, offsets = np.asarray(ids), np.asarray(offsets)
    rows, offs = ids.reshape(-1, ids.shape[-1]), offsets.reshape(-1, offsets.shape[-1])
    num = len(feature_tables)
    parts: list[list[np.ndarray]] = [[] for _ in layout.specs]
    for r, o in zip(rows, offs):
        bounds = o[:: (o.size - 1) // num]
        for f, t in enumerate(feature_tables):
            x = r[bounds[f] : bounds[f + 1]]
            parts[t].append(x[(x >= 0) & (x < layout.specs[t].num_embeddings)])
    empty = np.zeros(0, ids.dtype)
    return tuple(
        table_cost(str(t), spec, np.concatenate(p) if p else empty, per_id=per_id)
        for t, (spec, p) in enumerate(zip(layout.specs, parts))
    )


@dataclasses.dataclass(frozen=True)
class TableWisePlacement:
    """Which device of a mesh axis holds each TT table (static, hashable).

    Attributes:
      num_devices: S, the axis size.
      tables: names of the placed tables (every TT table of a shape group).
      devices: device index of each, in ``[0, S)``.
      costs: the estimates the placement was made from (``TableCost`` per table).
    """

    num_devices: int
    tables: tuple[str, ...]
    devices: tuple[int, ...]
    costs: tuple[TableCost, ...] = ()

    def __post_init__(self) -> None:
        _check_num_devices(self.num_devices)
        if len(self.tables) != len(self.devices) or len(set(self.tables)) != len(self.tables):
            raise ValueError(
                f"one device per table, each table once: tables {self.tables}, devices {self.devices}"
            )
        for name, d in zip(self.tables, self.devices):
            if not 0 <= d < self.num_devices:
                raise ValueError(
                    f"table {name!r} is placed on device {d}: the axis has {self.num_devices} devices"
                )

    def device(self, name: str) -> int:
        return self.devices[self.tables.index(name)]

    @property
    def loads(self) -> tuple[float, ...]:
        """Estimated cost per device."""
        loads = [0.0] * self.num_devices
        for c in self.costs:
            loads[self.device(c.name)] += c.cost
        return tuple(loads)

    @property
    def imbalance(self) -> float:
        """Largest device load over the mean load (1.0 = perfect balance)."""
        loads = self.loads
        return max(loads) * len(loads) / max(sum(loads), 1e-30)


def _check_num_devices(num_devices: int) -> None:
    if isinstance(num_devices, bool) or not isinstance(num_devices, (int, np.integer)) or num_devices < 1:
        raise ValueError(f"num_devices must be an int >= 1, got {num_devices!r}")


def place_tables(costs: Sequence[TableCost], num_devices: int) -> TableWisePlacement:
    """Greedy longest-processing-time placement over ``num_devices``: tables by decreasing
    cost, each to the device with the least load so far (ties: lowest index).

    ``costs``: ``table_costs(layout, sample)`` (a collection) or ``group_costs(...)`` (one
    packed shape group), or estimates of one's own."""
    costs = tuple(costs)
    _check_num_devices(num_devices)
    loads = [0.0] * num_devices
    device = {}
    for c in sorted(costs, key=lambda c: -c.cost):
        d = min(range(num_devices), key=lambda i: (loads[i], i))
        device[c.name] = d
        loads[d] += c.cost
    names = tuple(c.name for c in costs)
    return TableWisePlacement(num_devices, names, tuple(device[n] for n in names), costs)
