"""A shape group's tables split over the devices of a mesh axis (table-wise): each device's
slots, their padded cores stacked ``[num_devices, ...]``, the static layout of a
device's slot (``DeviceGroupLayout``) that the table-batched op pools, and the one owner
router of the table-wise layouts (``SplitGroup.pool_routed``: ``sharding.group``'s packed
batch, ``sharding.tablewise``'s collection)."""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from flowtt_jax.kernels.group_plan import GroupLayout
from flowtt_jax.ops.pooled import choose_impl, pooled
from flowtt_jax.tt.spec import TTSpec

__all__ = ["DeviceGroupLayout", "SplitGroup"]


@dataclasses.dataclass(frozen=True)
class DeviceGroupLayout:
    """A shape group's tables split over the devices of ``axis``: a ``GroupLayout`` whose
    per-table metadata (``table_arrays``) is the calling device's (``axis_index``), for
    ``ops.pooled`` inside ``shard_map``. Slot j of device d is ``device_specs[d][j]``;
    key ranges (``row_base``) are the largest table in each slot, so one static key space
    serves every device."""

    device_specs: tuple[tuple[TTSpec, ...], ...]
    axis: str

    @property
    def _first(self) -> TTSpec:
        return next(s for specs in self.device_specs for s in specs)

    @property
    def num_tables(self) -> int:
        return max(len(s) for s in self.device_specs)

    @property
    def dim(self) -> int:
        return self._first.embedding_dim

    def device_offsets(self, d: int) -> tuple[tuple[int, ...], ...]:
        """Per core k: the slots' row offsets in device d's packed core k."""
        specs = self.device_specs[d]
        return tuple(
            tuple(int(x) for x in np.cumsum([0] + [s.row_shape[k] for s in specs])) for k in range(3)
        )

    @functools.cached_property
    def row_base(self) -> tuple[int, ...]:
        sizes = [
            max((math.prod(s[j].row_shape) for s in self.device_specs if j < len(s)), default=1)
            for j in range(self.num_tables)
        ]
        return tuple(int(x) for x in np.cumsum([0] + sizes, dtype=np.int64))

    def packed_shapes(self) -> tuple[tuple[int, ...], ...]:
        """Local packed core shapes ``[R_k, r_{k-1}, q_k, r_k]`` (R_k: the largest device's rows)."""
        s0 = self._first
        rows = [
            max(max(self.device_offsets(d)[k][-1] for d in range(len(self.device_specs))), 1)
            for k in range(3)
        ]
        return tuple((rows[k], s0.ranks[k], s0.col_shape[k], s0.ranks[k + 1]) for k in range(3))

    @functools.cached_property
    def _tables(self) -> dict[str, np.ndarray]:
        n, slots = len(self.device_specs), self.num_tables
        meta = {k: np.zeros((n, slots), np.int32) for k in ("num_rows", "p2", "p3", "o1", "o2", "o3")}
        meta["num_rows"][:] = meta["p2"][:] = meta["p3"][:] = 1
        for d, specs in enumerate(self.device_specs):
            offs = self.device_offsets(d)
            for j, s in enumerate(specs):
                meta["num_rows"][d, j], meta["p2"][d, j], meta["p3"][d, j] = (
                    s.num_embeddings,
                    s.row_shape[1],
                    s.row_shape[2],
                )
                meta["o1"][d, j], meta["o2"][d, j], meta["o3"][d, j] = offs[0][j], offs[1][j], offs[2][j]
        return meta

    def table_arrays(self) -> dict[str, jax.Array]:
        """This device's per-slot int32 metadata [T] (call inside ``shard_map`` over ``axis``)."""
        d = jax.lax.axis_index(self.axis)
        return {k: jnp.asarray(v)[d] for k, v in self._tables.items()}


def _unsplit(x: jax.Array) -> jax.Array:
    """``x`` replicated if its type says it is split (meshes with explicit axes), where
    indexing the split dimension needs it; else ``x``."""
    sharding = jax.typeof(x).sharding
    if any(sharding.spec):
        return jax.sharding.reshard(x, NamedSharding(sharding.mesh, PartitionSpec()))
    return x


@dataclasses.dataclass(frozen=True)
class SplitGroup:
    """A shape group's tables split over the devices of ``axis``: device d holds tables
    ``slots[d]`` (indices in ``layout``, in decreasing size), packed as ``group`` says.

    Its cores are stored stacked, core k ``[S, R_k, r_{k-1}, q_k, r_k]`` (``stack``), to be
    sharded ``P(axis)``: device d's block is its own tables' packed cores, zero-padded."""

    layout: GroupLayout
    slots: tuple[tuple[int, ...], ...]
    axis: str

    @classmethod
    def create(cls, layout: GroupLayout, devices: Sequence[int], num_devices: int, axis: str) -> SplitGroup:
        """``devices[t]``: the device of table t."""
        by_size = lambda t: -math.prod(layout.specs[t].row_shape)
        slots = tuple(
            tuple(sorted((t for t in range(layout.num_tables) if devices[t] == d), key=by_size))
            for d in range(num_devices)
        )
        return cls(layout, slots, axis)

    @functools.cached_property
    def group(self) -> DeviceGroupLayout:
        return DeviceGroupLayout(tuple(tuple(self.layout.specs[t] for t in s) for s in self.slots), self.axis)

    def where(self, t: int) -> tuple[int, int]:
        """(device, slot) of table t."""
        return next((d, s.index(t)) for d, s in enumerate(self.slots) if t in s)

    def routes(self, feature_tables: Sequence[int]) -> tuple[tuple[tuple[int, int], ...], ...]:
        """Per device: ``(feature, slot)`` of every feature whose table it holds, in feature order."""
        return tuple(
            tuple((f, s.index(t)) for f, t in enumerate(feature_tables) if t in s) for s in self.slots
        )

    def pool_routed(
        self, cores, routes, sizes, ids, weights, counts, *, weighted: bool, impl: str, dtype: Any
    ) -> jax.Array:
        """The owner router of the table-wise layouts, inside ``shard_map`` over ``axis``:
        ``[S, R, D]`` in ``dtype`` (default: the cores'), row e this device's bags as device e
        pooled them with its blocks ``cores``.

        Row e of ``ids``, ``weights [S, C]`` and ``counts [S, R]``: the positions this device
        sends device e, bag by bag, then padding (weight 0), and each bag's count (positions
        past C are dropped; a bag cut keeps what arrived). Its bags: those of the features
        of ``routes[e]`` (``routes``: ``routes()``'s form), ``sizes[f]`` each, in order. One
        ``all_to_all`` each of ids, weights and counts; the owner rebuilds one CSR over all
        it got (source-major, a source's padding in its last bag), pools it in one
        ``ops.pooled`` call over its slots and returns it by one more ``all_to_all``.
        """
        n, cap = ids.shape
        nbags = counts.shape[1]
        bag_slots = np.zeros((n, nbags), np.int32)
        for e, route in enumerate(routes):
            row = np.repeat([j for _, j in route], [sizes[f] for f, _ in route])
            bag_slots[e, : row.size] = row
        recv_ids, recv_w, recv_counts = (
            jax.lax.all_to_all(x, self.axis, 0, 0) for x in (ids, weights, counts)
        )
        excl = jnp.minimum(jnp.cumsum(recv_counts, axis=1, dtype=jnp.int32) - recv_counts, cap)
        starts = (jnp.arange(n, dtype=jnp.int32)[:, None] * cap + excl).reshape(-1)
        offsets = jnp.concatenate([starts, jnp.full((1,), n * cap, jnp.int32)])
        marks = jnp.zeros((n * cap + 1,), jnp.int32).at[starts].add(1)
        bag_ids = jnp.cumsum(marks[:-1], dtype=jnp.int32) - 1
        tables = jnp.asarray(bag_slots)[jax.lax.axis_index(self.axis)][bag_ids % max(nbags, 1)]
        out = pooled(
            cores,
            recv_ids.reshape(-1),
            offsets,
            bag_ids,
            recv_w.reshape(-1),
            weighted=weighted,
            impl=choose_impl(impl, cores, self.group),
            layout=self.group,
            tables=tables,
        )
        out = out.reshape(n, nbags, self.group.dim).astype(cores[0].dtype if dtype is None else dtype)
        return jax.lax.all_to_all(out, self.axis, 0, 0)

    def stack(self, packed: Sequence[jax.Array]) -> tuple[jax.Array, ...]:
        """Stacked cores from the group's packed ones (``GroupLayout.pack``'s layout)."""
        shapes, out = self.group.packed_shapes(), []
        for k, core in enumerate(packed):
            blocks = []
            for slots in self.slots:
                parts = [self.layout.table_cores(packed, t)[k] for t in slots]
                rows = jnp.concatenate(parts) if parts else jnp.zeros((0, *shapes[k][1:]), core.dtype)
                blocks.append(jnp.pad(rows, [(0, shapes[k][0] - rows.shape[0])] + [(0, 0)] * 3))
            out.append(jnp.stack(blocks))
        return tuple(out)

    def table_cores(self, stacked: Sequence[jax.Array], t: int) -> tuple[jax.Array, ...]:
        """Table t's cores from stacked ones."""
        d, j = self.where(t)
        offs = self.group.device_offsets(d)
        return tuple(_unsplit(c)[d, offs[k][j] : offs[k][j + 1]] for k, c in enumerate(stacked))

    def unstack(self, stacked: Sequence[jax.Array]) -> tuple[jax.Array, ...]:
        """The group's packed cores from stacked ones (the inverse of ``stack``)."""
        tables = [self.table_cores(stacked, t) for t in range(self.layout.num_tables)]
        return tuple(jnp.concatenate([c[k] for c in tables]) for k in range(3))
