"""One shape group's packed batch (``tt_embedding_bag_group``) over a mesh axis.

The packed form (design 3b: one flat ids array, feature-major offsets ``[F*B + 1]``, a
static feature -> table map) keeps a step's program the same size whatever the number
of features, where per-feature inputs grow it with F. Split over S devices, every
feature's bags ``[s*B/S, (s+1)*B/S)`` go to device s: ``shard_packed`` makes the per-shard
form on the host -- ids ``[S, C]`` and *local* feature-major offsets ``[S, F*B/S + 1]``
(rebased to the shard's ids; ids past ``offsets[s, -1]`` are padding).

- ``GroupDataParallel``: replicated packed cores; each device runs ``tt_embedding_bag_group``
  on its shard; the cores' gradient is all-reduced.
- ``GroupTableWise``: each table on one device (``SplitGroup``, stacked cores sharded
  ``P(axis)``). Per device: its bags prepared as the op does (modes, out-of-range ids),
  every position in a bag scattered to row e = its table's owner of ids and weights
  ``[S, K]`` (K positions per owner, by default the shard's whole capacity C, as one
  device may send one owner everything; ``needed_capacity`` gives the exact K of a batch;
  a device with more for an owner gets NaN for its bags there), with each bag's count;
  then the owner router ``SplitGroup.pool_routed``, the collection's too. Vectorised: no
  per-feature code.

Both return ``[F, B, D]`` split along B (dim 1).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify
from jax.sharding import Mesh, PartitionSpec

from flowtt_jax.inputs.normalise import csr_bags, saturate_int32
from flowtt_jax.inputs.oob import apply_table_oob
from flowtt_jax.inputs.pack import scale_by_modes
from flowtt_jax.inputs.validate import OOB_POLICIES, as_ids, host_ids
from flowtt_jax.kernels.group_plan import GroupLayout
from flowtt_jax.ops.embedding_bag import feature_modes, tt_embedding_bag_group
from flowtt_jax.sharding.base import per_device
from flowtt_jax.sharding.placement import TableWisePlacement
from flowtt_jax.sharding.split import SplitGroup

__all__ = ["shard_packed", "GroupDataParallel", "GroupTableWise"]


def shard_packed(
    ids: np.ndarray,
    offsets: np.ndarray,
    num_features: int,
    num_shards: int,
    *,
    weights: np.ndarray | None = None,
    capacity: int | None = None,
) -> dict[str, np.ndarray]:
    """A packed batch (ids [n], feature-major CSR ``offsets [F*B + 1]``) -> per shard (host):
    ``{"ids": [S, C], "offsets": [S, F*B/S + 1], "weights": [S, C]}`` (weights when given).

    Shard s holds bags ``[s*B/S, (s+1)*B/S)`` of every feature, feature-major, its offsets
    rebased to its own ids. ``capacity``: C (default: the largest shard's ids, at least 1;
    fix it to keep shapes -- and compiled steps -- from batch to batch and across
    processes); ``ValueError`` if a shard has more ids.
    """
    ids, offsets = host_ids(ids), np.asarray(offsets, np.int64)  # host_ids: as in shard_bags
    if (offsets.size - 1) % num_features:
        raise ValueError(f"offsets [{offsets.size}] is not [F*B + 1] for F = {num_features}")
    batch = (offsets.size - 1) // num_features
    if not isinstance(num_shards, (int, np.integer)) or num_shards < 1:
        raise ValueError(f"num_shards must be an int >= 1, got {num_shards!r}")
    if batch % num_shards:
        raise ValueError(f"{batch} bags per feature do not split into {num_shards} equal shards")
    per = batch // num_shards
    starts, ends = offsets[:-1].reshape(num_features, batch), offsets[1:].reshape(num_features, batch)
    shards = []
    for s in range(num_shards):
        lo, hi = starts[:, s * per], ends[:, (s + 1) * per - 1] if per else starts[:, s * per]
        index = np.concatenate([np.arange(a, b) for a, b in zip(lo, hi)])
        lengths = (ends - starts)[:, s * per : (s + 1) * per].reshape(-1)
        shards.append((index, np.concatenate([[0], np.cumsum(lengths)])))
    need = max(index.size for index, _ in shards)
    cap = max(1, need) if capacity is None else int(capacity)
    if need > cap:
        raise ValueError(f"a shard has {need} ids, more than capacity {cap}")
    out = {
        "ids": np.zeros((num_shards, cap), ids.dtype),
        "offsets": np.stack([o for _, o in shards]).astype(np.int32),
    }
    if weights is not None:
        out["weights"] = np.zeros((num_shards, cap), np.asarray(weights).dtype)
    for s, (index, _) in enumerate(shards):
        out["ids"][s, : index.size] = ids[index]
        if weights is not None:
            out["weights"][s, : index.size] = np.asarray(weights)[index]
    return out


@dataclasses.dataclass(frozen=True)
class GroupDataParallel:
    """``tt_embedding_bag_group`` data parallel over mesh axis ``axis`` (static, hashable)."""

    layout: GroupLayout
    feature_tables: tuple[int, ...]
    mesh: Mesh
    axis: str = "data"

    def apply(
        self,
        packed: Sequence[jax.Array],
        ids: jax.Array,
        offsets: jax.Array,
        *,
        weights: jax.Array | None = None,
        mode: str | Sequence[str] = "sum",
        oob: str = "zero",
        impl: str = "auto",
        dtype: Any | None = None,
    ) -> jax.Array:
        """``[F, B, D]`` from replicated ``packed`` cores and per-shard ``ids [S, C]``,
        ``offsets [S, F*B/S + 1]``, ``weights [S, C]`` (``shard_packed``). ``oob="error"``
        checks the ids in the shards' bags before the ``shard_map`` (a ``ValueError`` for
        concrete ids, a ``checkify`` check for traced ones; the padding past a shard's ids is
        not checked), then clips."""
        check = oob == "error"
        if check and not any(isinstance(x, jax.core.Tracer) for x in (ids, offsets)):
            self._check_ids(ids, offsets)  # concrete: raises before any work
        oob = "clip" if check else oob  # ids in range: clip leaves them as they are

        def local(packed, ids, offsets, weights):
            w = None if weights is None else weights[0]
            kw = dict(weights=w, mode=mode, oob=oob, impl=impl, dtype=dtype)
            return tt_embedding_bag_group(packed, self.layout, ids[0], offsets[0], self.feature_tables, **kw)

        out = per_device(
            self.mesh,
            self.axis,
            local,
            PartitionSpec(),
            PartitionSpec(None, self.axis),
            tuple(packed),
            ids,
            offsets,
            weights,
        )
        if check and any(isinstance(x, jax.core.Tracer) for x in (ids, offsets)):
            # traced: the checkify check after the shard_map (checkify cannot carry an error
            # raised before it into a shard_map over several devices)
            self._check_ids(ids, offsets)
        return out

    def _check_ids(self, ids: jax.Array, offsets: jax.Array) -> None:
        """``oob="error"`` of the per-shard batch: each shard's positions before its last
        offset against the rows of their feature's table: ``ValueError`` for concrete ids,
        a ``checkify`` check for traced ones (elementwise only: no gather of sharded
        indices, which an explicit mesh refuses outside its context)."""
        concrete = not any(isinstance(x, jax.core.Tracer) for x in (ids, offsets))
        xp = np if concrete else jnp
        ids = saturate_int32(as_ids(np.asarray(ids) if concrete else ids, "error"))
        offsets = xp.asarray(offsets)
        per_feature = (offsets.shape[1] - 1) // len(self.feature_tables)
        slot = xp.arange(ids.shape[1])[None, :]
        limit = xp.zeros(ids.shape, np.int32)  # the rows of each slot's table; 0 past the bags
        for f, t in enumerate(self.feature_tables):
            in_feature = (slot >= offsets[:, f * per_feature : f * per_feature + 1]) & (
                slot < offsets[:, (f + 1) * per_feature : (f + 1) * per_feature + 1]
            )
            limit = xp.where(in_feature, self.layout.specs[t].num_embeddings, limit)
        in_bag = slot < offsets[:, -1:]
        valid = ~in_bag | ((ids >= 0) & (ids < limit))
        where = "GroupDataParallel: an id out of range of its table"
        if concrete:
            bad = np.argwhere(~valid)
            if bad.size:
                s, i = bad[0]
                raise ValueError(f"{where}: id {ids[s, i]} at shard {s}, position {i} ({limit[s, i]} rows)")
            return
        checkify.check(  # reductions only (no gather of a sharded array)
            jnp.all(valid),
            where + ": found {bad} (the largest offender) at position {pos} of the shards' ids (flattened)",
            bad=jnp.max(jnp.where(valid, jnp.iinfo(jnp.int32).min, ids)),
            pos=jnp.argmin(valid.reshape(-1)),
        )


@dataclasses.dataclass(frozen=True)
class GroupTableWise:
    """A shape group's tables placed over mesh axis ``axis`` by ``placement`` (tables named
    ``"0" .. "T-1"``, as ``group_costs`` names them); cores stacked (``shard_params``)."""

    layout: GroupLayout
    feature_tables: tuple[int, ...]
    placement: TableWisePlacement
    mesh: Mesh
    axis: str = "data"

    @functools.cached_property
    def split(self) -> SplitGroup:
        devices = [self.placement.device(str(t)) for t in range(self.layout.num_tables)]
        return SplitGroup.create(self.layout, devices, self.placement.num_devices, self.axis)

    def shard_params(self, packed: Sequence[jax.Array]) -> tuple[jax.Array, ...]:
        """Stacked cores ``[S, R_k, ...]`` from the group's packed ones (place them ``P(axis)``)."""
        return self.split.stack(packed)

    def gather_params(self, stacked: Sequence[jax.Array]) -> tuple[jax.Array, ...]:
        """The group's packed cores from stacked ones."""
        return self.split.unstack(stacked)

    @functools.cached_property
    def _routes(self) -> tuple[tuple, np.ndarray, np.ndarray]:
        """(``SplitGroup.routes``, owner of each feature [F], its rank among its owner's)."""
        routes = self.split.routes(self.feature_tables)
        owner, rank = np.zeros((2, len(self.feature_tables)), np.int32)
        for e, route in enumerate(routes):
            for k, (f, _) in enumerate(route):
                owner[f], rank[f] = e, k
        return routes, owner, rank

    def needed_capacity(self, offsets: np.ndarray) -> int:
        """The most positions any shard sends one owner, from per-shard ``offsets
        [S, F*B/S + 1]`` (host): the smallest ``capacity`` of ``apply`` for that batch."""
        offsets = np.asarray(offsets).reshape(-1, np.shape(offsets)[-1])
        per = (offsets.shape[1] - 1) // len(self.feature_tables)
        owner = self._routes[1]
        sizes = offsets[:, per::per] - offsets[:, :-1:per]  # [S, F] ids per feature
        return int(max(sizes[:, owner == e].sum(axis=1).max() for e in range(self.placement.num_devices)))

    def apply(
        self,
        stacked: Sequence[jax.Array],
        ids: jax.Array,
        offsets: jax.Array,
        *,
        weights: jax.Array | None = None,
        mode: str | Sequence[str] = "sum",
        oob: str = "zero",
        impl: str = "auto",
        dtype: Any | None = None,
        capacity: int | None = None,
    ) -> jax.Array:
        """``[F, B, D]`` from stacked cores and per-shard ``ids [S, C]``, ``offsets
        [S, F*B/S + 1]``, ``weights [S, C]`` (``shard_packed``); same numbers as
        ``tt_embedding_bag_group`` on the whole batch.

        ``capacity`` (static): positions a device may send one owner (default C: never
        exceeded). A smaller one shrinks the buffers and the owners' work (they process
        S x capacity positions): take ``needed_capacity`` of a sample with a margin. A
        device with more for an owner gets NaN for the bags it pooled there (a NaN loss,
        never silently wrong numbers).
        """
        modes = feature_modes(mode, len(self.feature_tables))
        if oob not in OOB_POLICIES:
            raise ValueError(f"oob must be one of {OOB_POLICIES}, got {oob!r}")
        kw = dict(modes=modes, oob=oob, impl=impl, dtype=dtype, capacity=capacity)
        local = functools.partial(self._local, **kw)
        spec = PartitionSpec(self.axis)
        return per_device(
            self.mesh,
            self.axis,
            local,
            spec,
            PartitionSpec(None, self.axis),
            tuple(stacked),
            ids,
            offsets,
            weights,
        )

    def _local(self, stacked, ids, offsets, weights, *, modes, oob, impl, dtype, capacity) -> jax.Array:
        n, num = self.placement.num_devices, len(self.feature_tables)
        routes, owner, rank = self._routes
        kmax = int(rank.max()) + 1
        ids, offsets = ids[0], offsets[0]
        per = (offsets.shape[0] - 1) // num
        rows = ids.shape[0] if capacity is None else int(capacity)
        # this device's bags as tt_embedding_bag_group prepares them (packed_bags) less the
        # parking: a dropped position keeps its own table, whose owner pools its bag
        local_weights = None if weights is None else weights[0]
        bags = csr_bags(ids, offsets, local_weights)
        feature = bags.bag_ids // per
        tables = jnp.asarray(self.feature_tables, jnp.int32)[feature]
        local_ids, valid = apply_table_oob(bags.ids, tables, self.layout.table_arrays()["num_rows"], oob)
        w = bags.weights.astype(jnp.float32)
        if valid is not None:  # oob="zero"
            w = jnp.where(valid, w, 0.0)
        w = scale_by_modes(w, bags.offsets, bags.bag_ids, modes, per)
        # every position in a bag to its table's owner (row), in position order; feature f's
        # bags are block rank[f] of row owner[f]
        pos = jnp.arange(ids.shape[0], dtype=jnp.int32)
        inside = (pos >= bags.offsets[0]) & (pos < bags.offsets[-1])
        dest = jnp.where(inside, jnp.asarray(owner)[feature], n)  # n: not sent
        ranks = [jnp.cumsum(dest == e, dtype=jnp.int32) for e in range(n)]
        order = sum(jnp.where(dest == e, r - 1, 0) for e, r in enumerate(ranks))

        def send(values, dtype):  # positions past ``rows`` (overflow) or to n: dropped
            buf = jnp.zeros((n, rows), dtype)
            return buf.at[dest, order].set(values.astype(dtype), mode="drop", unique_indices=True)

        lengths = jnp.diff(bags.offsets).reshape(num, per)
        counts = jnp.zeros((n, kmax, per), jnp.int32).at[owner, rank].set(lengths).reshape(n, kmax * per)
        cores, kw = tuple(c[0] for c in stacked), dict(weighted=weights is not None, impl=impl, dtype=dtype)
        sent = (send(local_ids, jnp.int32), send(w, jnp.float32), counts)
        back = self.split.pool_routed(cores, routes, [per] * num, *sent, **kw)
        out = back.reshape(n, kmax, per, self.layout.dim)[owner, rank]
        if capacity is None:
            return out
        overflow = jnp.stack([r[-1] > rows for r in ranks])  # this device sent an owner too much
        return jnp.where(overflow[jnp.asarray(owner)][:, None, None], jnp.nan, out)
