"""Table-wise model parallelism of a collection: each TT table lives on one device.

Placement (``sharding.placement``): a static ``TableWisePlacement`` from the batch's own
statistics, by greedy longest-processing-time.

Storage: the tables of a shape group placed on device d are packed as a group of their
own (slots in decreasing size); the group's packed core k is stored stacked
``[S, R_k, r_{k-1}, q_k, r_k]`` (``R_k`` the largest device's rows, padded) and sharded
over the axis, so a device holds only its own tables' cores (and optimizer state).
Dense tables and tables of other core counts stay replicated (data parallel).

Step (inside ``shard_map``, per shape group): each device prepares its bags of every
feature of the group as the collection does (``collection.batch.prepare_feature``), puts
device e's features' ids, weights and per-bag counts in row e (``[S, C]``, ``[S, R]``:
the largest destination's total, padded), and the owner router ``SplitGroup.pool_routed``
(``sharding.group``'s too) sends them by ``all_to_all``, pools all an owner got in one
``ops.pooled`` call over its tables (one plan and one launch per stage) and returns the
pooled ``[S, R, D]``; each device reads its features' bags from row e = owner.

Gradients follow by transposition (``all_to_all`` back, the owner's fixed-order TT
backward); no parameter gradient is all-reduced.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec

from flowtt_jax.collection.batch import prepare_feature
from flowtt_jax.collection.layout import CollectionLayout
from flowtt_jax.sharding.base import ShardedLayout
from flowtt_jax.sharding.placement import PER_ID_COST, TableCost, TableWisePlacement, sample_ids, table_cost
from flowtt_jax.sharding.split import DeviceGroupLayout, SplitGroup

__all__ = ["DeviceGroupLayout", "SplitGroup", "TableWiseLayout"]


@dataclasses.dataclass(frozen=True)
class _PlacedPack:
    """A collection's shape group placed table-wise, and per device the (feature index in
    the pack, slot) pairs it pools (``SplitGroup.routes``)."""

    split: SplitGroup
    routes: tuple[tuple[tuple[int, int], ...], ...]


@dataclasses.dataclass(frozen=True)
class TableWiseLayout(ShardedLayout, CollectionLayout):
    """A ``CollectionLayout`` whose TT tables are placed table-wise over mesh axis ``axis``
    (see the module docstring); dense packs and tables of other core counts are replicated.

    Parameters (``shard_params`` from the usual packed ones): a shape group's core k is
    ``[S, R_k, r_{k-1}, q_k, r_k]`` sharded by ``param_specs`` (``P(axis)``); the rest as in
    ``CollectionLayout``. ``apply`` takes the batch of a data-parallel step (every feature
    split along dim 0, per-shard forms for offsets / segment ids: ``sharding.base``).
    """

    placement: TableWisePlacement

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.placement.num_devices != self.mesh.shape[self.axis]:
            raise ValueError(
                f"placement for {self.placement.num_devices} devices, mesh axis {self.axis!r} has "
                f"{self.mesh.shape[self.axis]}"
            )
        missing = [
            c.name
            for p in self.packs
            if p.kind == "tt"
            for c in p.tables
            if c.name not in self.placement.tables
        ]
        if missing:
            raise ValueError(f"the placement has no device for TT tables {missing}")

    @functools.cached_property
    def placed(self) -> dict[int, _PlacedPack]:
        """Pack index -> its table-wise placement, for every TT shape group."""
        out = {}
        n = self.placement.num_devices
        for p, pack in enumerate(self.packs):
            if pack.kind != "tt":
                continue
            devices = [self.placement.device(c.name) for c in pack.tables]
            split = SplitGroup.create(pack.layout, devices, n, self.axis)
            out[p] = _PlacedPack(split, split.routes([f.table for f in pack.features]))
        return out

    @functools.cached_property
    def _replicated(self) -> tuple[CollectionLayout | None, dict[str, str]]:
        """The replicated tables as a layout of their own, and its param names -> ours."""
        packs = [pk for p, pk in enumerate(self.packs) if p not in self.placed]
        if not packs:
            return None, {}
        sub = CollectionLayout(
            tuple(c for pk in packs for c in pk.tables),
            ids_per_pass=self.ids_per_pass,
            memory_budget=self.memory_budget,
            unique_windows=self.unique_windows,
        )
        names = {}
        for q, pk in enumerate(sub.packs):
            p = next(p for p, mine in enumerate(self.packs) if mine.tables == pk.tables)
            names.update(zip(sub.param_names(q), self.param_names(p)))
        return sub, names

    def param_specs(self) -> dict[str, PartitionSpec]:
        """``PartitionSpec`` of every parameter: ``P(axis)`` for placed groups, else ``P()``."""
        return {
            n: PartitionSpec(self.axis) if p in self.placed else PartitionSpec()
            for p in range(len(self.packs))
            for n in self.param_names(p)
        }

    def shard_params(self, params: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
        """Table-wise parameters from ``CollectionLayout`` ones (same names)."""
        return self._convert_placed(params, SplitGroup.stack)

    def gather_params(self, params: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
        """``CollectionLayout`` parameters from table-wise ones (the inverse of ``shard_params``)."""
        return self._convert_placed(params, SplitGroup.unstack)

    def _convert_placed(
        self, params: Mapping[str, jax.Array], convert: Callable[[SplitGroup, tuple], tuple]
    ) -> dict[str, jax.Array]:
        """``params`` with every placed group's cores replaced by ``convert(its split, cores)``."""
        out = dict(params)
        for p, placed in self.placed.items():
            names = self.param_names(p)
            out.update(zip(names, convert(placed.split, tuple(params[n] for n in names))))
        return out

    def table_params(self, params: Mapping[str, jax.Array], name: str) -> tuple[jax.Array, ...]:
        p, t = self.locate(name)
        if p not in self.placed:
            return super().table_params(params, name)
        return self.placed[p].split.table_cores(tuple(params[n] for n in self.param_names(p)), t)

    def with_table(self, params: Mapping[str, jax.Array], name: str, values: Sequence[jax.Array]) -> dict:
        p, t = self.locate(name)
        if p not in self.placed:
            return super().with_table(params, name, values)
        old = self.table_params(params, name)
        if tuple(tuple(v.shape) for v in values) != tuple(tuple(o.shape) for o in old):
            raise ValueError(
                f"table {name!r}: shapes {[v.shape for v in values]} != {[o.shape for o in old]}"
            )
        split = self.placed[p].split
        d, j = split.where(t)
        offs = split.group.device_offsets(d)
        out = dict(params)
        for k, n in enumerate(self.param_names(p)):
            # the stacked cores' own sharding (a mesh with explicit axes wants it said)
            where = jax.typeof(params[n]).sharding
            update = params[n].at[d, offs[k][j] : offs[k][j + 1]]
            out[n] = update.set(values[k].astype(params[n].dtype), out_sharding=where)
        return out

    def local_apply(
        self, params: Mapping[str, jax.Array], features: Mapping[str, Any], *, oob: str, impl: str, dtype: Any
    ) -> dict[str, jax.Array]:
        """This device's bags from table-wise ``params`` (``shard_params``): the replicated
        tables' as ``CollectionLayout`` pools them, the placed groups' by ``all_to_all``."""
        sub, names = self._replicated
        out = {}
        if sub is not None:
            sub_params = {s: params[n] for s, n in names.items()}
            out.update(sub.apply(sub_params, features, oob=oob, impl=impl, dtype=dtype))
        for p, placed in self.placed.items():
            out.update(self._pool_placed(p, placed, params, features, oob, impl, dtype))
        return out

    def _pool_placed(
        self, p, placed: _PlacedPack, params, features, oob, impl, dtype
    ) -> dict[str, jax.Array]:
        """One shape group: each feature's bags prepared as the collection does, sent to its
        table's owner, pooled there and returned (``SplitGroup.pool_routed``)."""
        pack = self.packs[p]
        cores = tuple(params[name][0] for name in self.param_names(p))  # this device's [R_k, ...]
        prepared = [prepare_feature(features, slot, pack, oob) for slot in pack.features]
        bags, sizes = [b for b, _ in prepared], [b.offsets.shape[0] - 1 for b, _ in prepared]
        # row e: the ids, weights and per-bag counts of device e's features; every position
        # in some bag (ids before offsets[0] / past offsets[-1], weight 0, join the first / last)
        rows = [[bags[f] for f, _ in route if sizes[f]] for route in placed.routes]
        parts = (
            lambda b: b.ids,
            lambda b: b.weights.astype(jnp.float32),
            lambda b: jnp.diff(b.offsets.at[0].set(0).at[-1].set(b.ids.shape[0])),
        )
        sent = [
            [jnp.concatenate([part(b) for b in row] or [jnp.zeros((0,), jnp.int32)]) for row in rows]
            for part in parts
        ]
        cap = max(1, max(x.shape[0] for x in sent[0]))
        nbags = max(1, max(x.shape[0] for x in sent[2]))
        sent = [
            jnp.stack([jnp.pad(x.astype(dt), (0, size - x.shape[0])) for x in xs])
            for xs, size, dt in zip(sent, (cap, cap, nbags), (jnp.int32, jnp.float32, jnp.int32))
        ]
        weighted = any(w for _, w in prepared)
        back = placed.split.pool_routed(
            cores, placed.routes, sizes, *sent, weighted=weighted, impl=impl, dtype=dtype
        )
        # one split of all rows (per-feature slices would each transpose to the whole
        # buffer: F^2 adds in the backward); row e's features, then its padding
        names, cuts = [], []
        for route in placed.routes:
            row = [sizes[f] for f, _ in route]
            names += [pack.features[f].feature for f, _ in route] + [None]
            cuts += row + [nbags - sum(row)]
        pieces = jnp.split(back.reshape(-1, back.shape[-1]), np.cumsum(cuts)[:-1])
        return {name: piece for name, piece in zip(names, pieces) if name is not None}


def table_costs(
    layout: CollectionLayout, sample: Mapping[str, Any], *, per_id: float = PER_ID_COST
) -> tuple[TableCost, ...]:
    """``table_cost`` of every TT table in a shape group of ``layout`` from a sample batch
    ``{feature: input}`` (host; any input form a collection takes, global or per shard) of
    the size a step sees (unique counts grow sublinearly with the batch); a table's ids
    are those of all its features."""
    out = []
    for pack in layout.packs:
        if pack.kind != "tt":
            continue
        for t, cfg in enumerate(pack.tables):
            parts = [sample_ids(sample[s.feature], cfg.num_embeddings) for s in pack.features if s.table == t]
            ids = np.concatenate(parts) if parts else np.zeros(0, np.int64)
            out.append(table_cost(cfg.name, cfg.spec(), ids, per_id=per_id))
    return tuple(out)


def collection_table_wise(
    layout: CollectionLayout, mesh: Mesh, placement: TableWisePlacement, axis: str = "data"
) -> TableWiseLayout:
    """``layout`` with its TT tables placed by ``placement`` over ``mesh`` axis ``axis``;
    parameters from ``TableWiseLayout.shard_params``, placed by ``param_specs``.

    Example::

        placement = place_tables(table_costs(layout, sample_features), mesh.shape["data"])
        tw = collection_table_wise(layout, mesh, placement)
        params = tw.shard_params(layout.init(key))
        out = jax.jit(tw.apply)(params, features)
    """
    return TableWiseLayout(
        layout.tables,
        mesh,
        axis,
        placement,
        ids_per_pass=layout.ids_per_pass,
        memory_budget=layout.memory_budget,
        unique_windows=layout.unique_windows,
    )
