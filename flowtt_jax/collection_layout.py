"""A collection's tables as packs: the static layout, packed parameters and one
batched call per pack (Flax-free; ``nnx.py`` and ``linen.py`` hold the parameters).

- TT tables with 3 cores, the same column shape and the same ranks form a *shape
  group*: their cores are packed per core index (``GroupLayout``) and every feature
  reading them is pooled by one ``pooled_group`` call (one plan, one launch per stage).
- Dense tables of the same dim are packed into one ``[sum N, D]`` table: one gather and
  one segment sum for all their features.
- TT tables with another number of cores keep their own cores and the single-table op.

Parameters are a flat ``{name: array}`` dict: ``tt{g}_core{k}`` (group g's packed core
k), ``dense{g}`` (dense pack g), ``{table}_core{k}`` (a single TT table). Compile time
grows with the number of packs, not of tables.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from . import ffi, reference
from .bag import CanonicalBags, apply_bags_oob, bag_of_positions, canonical_bags, check_sizes, scale_by_modes
from .batched import choose_impl, pooled_group
from .batched_plan import GroupLayout
from .collection import TableConfig, bag_kwargs, check_tables
from .cores import resolve_init, to_dense
from .oob import apply_oob, apply_table_oob, as_ids, saturate_int32
from .ops import tt_embedding_bag

__all__ = ["CollectionLayout", "FeatureSlot", "TablePack"]


@dataclasses.dataclass(frozen=True)
class FeatureSlot:
    """A feature read by a pack: its name, its table's index in the pack, its pooling mode."""

    feature: str
    table: int
    mode: str


@dataclasses.dataclass(frozen=True)
class TablePack:
    """Tables stored together. ``kind``: ``"tt"`` (a shape group, ``layout`` set),
    ``"dense"`` (one ``[sum N, D]`` table) or ``"single"`` (one TT table of any core count)."""

    kind: str
    tables: tuple[TableConfig, ...]
    features: tuple[FeatureSlot, ...]
    layout: GroupLayout | None = None

    @property
    def row_offsets(self) -> tuple[int, ...]:
        """Dense packs: ``T + 1`` offsets of the tables' rows in the packed table."""
        return tuple(
            int(x) for x in np.concatenate([[0], np.cumsum([t.num_embeddings for t in self.tables])])
        )


def _group_key(cfg: TableConfig) -> tuple:
    spec = cfg.spec()
    if spec.num_cores != 3:
        return ("single", cfg.name)
    return ("tt", spec.col_shape, spec.ranks)


@dataclasses.dataclass(frozen=True)
class CollectionLayout:
    """Static packing of a collection's ``TableConfig``s (hashable)."""

    tables: tuple[TableConfig, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "tables", check_tables(self.tables))

    @functools.cached_property
    def packs(self) -> tuple[TablePack, ...]:
        """TT shape groups (in order of first table), then dense packs by dim, then singles."""
        keys: dict[tuple, list[TableConfig]] = {}
        for cfg in self.tables:
            key = ("dense", cfg.features) if cfg.kind == "dense" else _group_key(cfg)
            keys.setdefault(key, []).append(cfg)
        order = {"tt": 0, "dense": 1, "single": 2}
        packs = []
        for key, cfgs in sorted(keys.items(), key=lambda kv: order[kv[0][0]]):
            slots = tuple(FeatureSlot(f, t, cfg.mode) for t, cfg in enumerate(cfgs) for f in cfg.feature_keys)
            layout = GroupLayout(tuple(c.spec() for c in cfgs)) if key[0] == "tt" else None
            packs.append(TablePack(key[0], tuple(cfgs), slots, layout))
        return tuple(packs)

    def param_names(self, p: int) -> tuple[str, ...]:
        """Parameter names of pack ``p``."""
        pack = self.packs[p]
        if pack.kind == "tt":
            return tuple(f"tt{p}_core{k}" for k in range(3))
        if pack.kind == "dense":
            return (f"dense{p}",)
        return tuple(f"{pack.tables[0].name}_core{k}" for k in range(pack.tables[0].spec().num_cores))

    def locate(self, name: str) -> tuple[int, int]:
        """``(pack index, table index in the pack)`` of table ``name``."""
        for p, pack in enumerate(self.packs):
            for t, cfg in enumerate(pack.tables):
                if cfg.name == name:
                    return p, t
        raise KeyError(f"no table named {name!r}; tables: {[c.name for c in self.tables]}")

    def init(self, key: jax.Array, param_dtype: Any = jnp.float32) -> dict[str, jax.Array]:
        """Fresh parameters: each table drawn as a lone table would be (TT rows of std
        ``cfg.std``; dense ``normal(cfg.std)``) with ``fold_in(key, table index)``."""
        index = {cfg.name: i for i, cfg in enumerate(self.tables)}
        params = {}
        for p, pack in enumerate(self.packs):
            keys = [jax.random.fold_in(key, index[c.name]) for c in pack.tables]
            names = self.param_names(p)
            if pack.kind == "dense":
                parts = [
                    c.std * jax.random.normal(k, (c.num_embeddings, c.features))
                    for c, k in zip(pack.tables, keys)
                ]
                params[names[0]] = jnp.concatenate(parts).astype(param_dtype)
                continue
            cores = [resolve_init(c.std)(k, c.spec(), param_dtype) for c, k in zip(pack.tables, keys)]
            packed = pack.layout.pack(cores) if pack.kind == "tt" else cores[0]
            params.update({n: jnp.asarray(c, param_dtype) for n, c in zip(names, packed)})
        return params

    def table_params(self, params: Mapping[str, jax.Array], name: str) -> tuple[jax.Array, ...]:
        """Table ``name``'s own parameters: its TT cores ``[p_k, r_{k-1}, q_k, r_k]``, or
        ``(table [N, D],)`` for a dense table (static slices of the packs)."""
        p, t = self.locate(name)
        pack, arrays = self.packs[p], tuple(params[n] for n in self.param_names(p))
        if pack.kind == "tt":
            return pack.layout.table_cores(arrays, t)
        if pack.kind == "dense":
            lo, hi = pack.row_offsets[t], pack.row_offsets[t + 1]
            return (arrays[0][lo:hi],)
        return arrays

    def with_table(self, params: Mapping[str, jax.Array], name: str, values: Sequence[jax.Array]) -> dict:
        """``params`` with table ``name``'s parameters replaced by ``values`` (same shapes
        as ``table_params``), e.g. the TT-SVD of a dense table."""
        p, t = self.locate(name)
        pack, names = self.packs[p], self.param_names(p)
        old = self.table_params(params, name)
        if tuple(tuple(v.shape) for v in values) != tuple(tuple(o.shape) for o in old):
            raise ValueError(
                f"table {name!r}: shapes {[v.shape for v in values]} != {[o.shape for o in old]}"
            )
        out = dict(params)
        if pack.kind == "tt":
            offs = pack.layout.core_offsets
            for k, (n, v) in enumerate(zip(names, values)):
                out[n] = params[n].at[offs[k][t] : offs[k][t + 1]].set(v.astype(params[n].dtype))
        elif pack.kind == "dense":
            lo, hi = pack.row_offsets[t], pack.row_offsets[t + 1]
            out[names[0]] = params[names[0]].at[lo:hi].set(values[0].astype(params[names[0]].dtype))
        else:
            out.update({n: v.astype(params[n].dtype) for n, v in zip(names, values)})
        return out

    def to_dense(self, params: Mapping[str, jax.Array], name: str) -> jax.Array:
        """Table ``name`` materialised ``[N, D]`` (float32 accumulation, the params' dtype)."""
        p, t = self.locate(name)
        values = self.table_params(params, name)
        if self.packs[p].kind == "dense":
            return values[0]
        cfg = self.packs[p].tables[t]
        return to_dense(tuple(c.astype(jnp.float32) for c in values), cfg.num_embeddings).astype(
            values[0].dtype
        )

    def table_bytes(self, params: Mapping[str, jax.Array]) -> dict[str, int]:
        """Bytes of parameters stored per table."""
        return {
            cfg.name: sum(int(x.size) * x.dtype.itemsize for x in self.table_params(params, cfg.name))
            for cfg in self.tables
        }

    def apply(
        self,
        params: Mapping[str, jax.Array],
        features: Mapping[str, Any],
        *,
        oob: str = "zero",
        impl: str = "auto",
        dtype: Any | None = None,
    ) -> dict[str, jax.Array]:
        """``{feature: [B, D]}`` for every feature the tables read (see
        ``flowtt_jax.collection`` for the input forms); ``KeyError`` for a missing one."""
        params = _cast_to_batch(params, features)
        out = {}
        for p, pack in enumerate(self.packs):
            arrays = tuple(params[n] for n in self.param_names(p))
            out_dtype = arrays[0].dtype if dtype is None else dtype
            if pack.kind == "single":
                for slot in pack.features:
                    ids, kw = _feature(features, slot, pack)
                    out[slot.feature] = _pool_single(pack, arrays, slot, ids, kw, oob, impl, out_dtype)
                continue
            prepared = {s.feature: canonical_feature(features, s, pack, oob) for s in pack.features}
            for slots in _by_batch(pack.features, prepared):
                # split, not slices: a slice's transpose pads to the whole [F*B, D] (F^2 work)
                pooled = jnp.split(_pool(pack, arrays, slots, prepared, oob, impl), len(slots))
                for slot, part in zip(slots, pooled):
                    out[slot.feature] = part.astype(out_dtype)
        return out

    def call(
        self,
        params: Mapping[str, jax.Array],
        features: Mapping[str, Any] | jax.Array,
        weights: jax.Array | None = None,
        **kw: Any,
    ) -> dict[str, jax.Array] | jax.Array:
        """The layers' call: ``apply`` for a feature dict, ``apply_stacked`` for stacked ids
        (``weights`` only with those); ``kw``: ``oob``, ``impl``, ``dtype``."""
        if isinstance(features, Mapping):
            if weights is not None:
                raise ValueError("weights is for stacked ids; a feature dict carries its own weights")
            return self.apply(params, features, **kw)
        return self.apply_stacked(params, features, weights, **kw)

    @functools.cached_property
    def feature_names(self) -> tuple[str, ...]:
        """Every feature the tables read, in table order: the columns of a stacked input and
        the rows of a stacked output (``apply_stacked``)."""
        return tuple(f for cfg in self.tables for f in cfg.feature_keys)

    def apply_stacked(
        self,
        params: Mapping[str, jax.Array],
        ids: jax.Array,
        weights: jax.Array | None = None,
        *,
        oob: str = "zero",
        impl: str = "auto",
        dtype: Any | None = None,
    ) -> jax.Array:
        """``[B, F, D]`` pooled bags of a stacked batch, the values of ``apply``.

        ``ids``: int ``[B, F]`` (one id per example and feature, e.g. a Criteo batch) or
        ``[B, F, L]`` (padded bags of L ids), column f being feature ``feature_names[f]``;
        ``weights``: optional float of the same shape. Every table must have the same dim
        D. Each pack of TT shape group or dense tables takes its columns at once (one gather
        of the ids, no per-feature slices) and the output is the packs' bags concatenated,
        so the program has no per-feature split or stack (nor their transposes in the
        backward); a table of another core count is still pooled feature by feature.
        """
        ids, weights = self._check_stacked(ids, weights, oob)
        params = _cast_to_batch(params, (ids, weights))
        column = {f: i for i, f in enumerate(self.feature_names)}
        parts, order = [], []
        for p, pack in enumerate(self.packs):
            arrays = tuple(params[n] for n in self.param_names(p))
            out_dtype = arrays[0].dtype if dtype is None else dtype
            cols = [column[s.feature] for s in pack.features]
            sub = _columns(ids, cols)  # [F_p, B, L]
            w = None if weights is None else _columns(weights, cols)
            if pack.kind == "single":
                out = jnp.stack(
                    [
                        _pool_single(
                            pack,
                            arrays,
                            slot,
                            sub[j],
                            {"weights": None if w is None else w[j]},
                            oob,
                            impl,
                            out_dtype,
                        )
                        for j, slot in enumerate(pack.features)
                    ]
                )
            else:
                packed, tables = _stacked_bags(pack, sub, w, oob)
                pooled = _pool_packed(pack, arrays, packed, tables, weights is not None, impl)
                out = pooled.reshape(sub.shape[0], sub.shape[1], pooled.shape[-1]).astype(out_dtype)
            parts.append(out)
            order += cols
        out = jnp.concatenate(parts) if len(parts) > 1 else parts[0]  # [F, B, D], packs' order
        if order != sorted(order):
            out = out.at[np.argsort(order)].get(unique_indices=True)
        return jnp.transpose(out, (1, 0, 2))

    def _check_stacked(self, ids, weights, oob: str) -> tuple[jax.Array, jax.Array | None]:
        """Stacked ids and weights as ``[B, F, L]`` after their checks."""
        ids = as_ids(ids, oob)
        num = len(self.feature_names)
        if ids.ndim not in (2, 3) or ids.shape[1] != num:
            raise ValueError(
                f"stacked ids must be [B, F] or [B, F, L] with F = {num} features "
                f"(columns in feature_names order), got shape {ids.shape}"
            )
        dims = sorted({cfg.features for cfg in self.tables})
        if len(dims) > 1:
            raise ValueError(f"a stacked output needs one dim for every table, got dims {dims}")
        if weights is not None:
            weights = jnp.asarray(weights)
            if weights.shape != ids.shape:
                raise ValueError(f"weights shape {weights.shape} != ids shape {ids.shape}")
            weights = weights.astype(jnp.promote_types(weights.dtype, jnp.float32))
            weights = weights if weights.ndim == 3 else weights[..., None]
        return (ids if ids.ndim == 3 else ids[..., None]), weights


def _pool_single(
    pack: TablePack, arrays, slot: FeatureSlot, ids, kw: dict, oob: str, impl: str, dtype
) -> jax.Array:
    """One feature of a ``"single"`` pack (a TT table of any core count) by the single-table
    op: ``[B, D]`` in ``dtype``; ``kw``: its bag form and weights."""
    return tt_embedding_bag(
        arrays,
        ids,
        **kw,
        mode=slot.mode,
        num_embeddings=pack.tables[0].num_embeddings,
        oob=oob,
        impl=impl,
        dtype=dtype,
    )


def _cast_to_batch(params: Mapping[str, jax.Array], batch: Any) -> dict[str, jax.Array]:
    """``params`` typed varying over the mesh axes the batch's arrays vary over (inside a
    ``shard_map`` with ``check_vma``): one cast, so one gradient sum, per parameter however
    many calls read it (``flowtt_jax.ffi``); unchanged elsewhere."""
    arrays = [x for x in jax.tree.leaves(batch) if isinstance(x, jax.Array)]
    return ffi.to_varying(dict(params), ffi.varying_axes(arrays))


def _feature(features: Mapping[str, Any], slot: FeatureSlot, pack: TablePack) -> tuple[jax.Array, dict]:
    if slot.feature not in features:
        raise KeyError(f"missing input for feature {slot.feature!r} (table {pack.tables[slot.table].name!r})")
    return bag_kwargs(features[slot.feature])


def canonical_feature(
    features: Mapping[str, Any], slot: FeatureSlot, pack: TablePack, oob: str
) -> tuple[CanonicalBags, bool]:
    """The feature's canonical bags (its mode folded into the weights; ids as given, the
    ``oob`` policy not yet applied) and whether it has user weights; ``KeyError`` if
    ``features`` lacks it."""
    ids, kw = _feature(features, slot, pack)
    bags = canonical_bags(as_ids(ids, oob), mode=slot.mode, check_offsets=oob == "error", **kw)
    return bags, kw.get("weights") is not None


def prepare_feature(
    features: Mapping[str, Any], slot: FeatureSlot, pack: TablePack, oob: str
) -> tuple[CanonicalBags, bool]:
    """``canonical_feature`` with the ``oob`` policy applied against its table (ids int32
    in range, as ``prepare_bags`` gives)."""
    bags, weighted = canonical_feature(features, slot, pack, oob)
    num_rows = pack.tables[slot.table].num_embeddings
    return apply_bags_oob(bags, *apply_oob(bags.ids, num_rows, oob)), weighted


def _by_batch(slots: Sequence[FeatureSlot], prepared) -> list[tuple[FeatureSlot, ...]]:
    """The pack's features split by batch size (one packed call each), in order."""
    groups: dict[int, list[FeatureSlot]] = {}
    for s in slots:
        groups.setdefault(prepared[s.feature][0].offsets.shape[0] - 1, []).append(s)
    return [tuple(v) for v in groups.values()]


def _packed_bags(pack: TablePack, slots, bags: Sequence[CanonicalBags], oob: str):
    """The features' canonical bags (same batch B) as one feature-major CSR over their
    concatenated ids, the ``oob`` policy applied once for all of them: ``(CanonicalBags
    [F*B bags], tables [n] int32)``. A padded feature's offsets are host constants; bag
    (f, b) starts where the feature's bag b starts, and the positions of a feature outside
    its bags (weight 0) fall in a neighbouring bag."""
    batch = bags[0].offsets.shape[0] - 1
    sizes = [b.ids.shape[0] for b in bags]
    check_sizes(sum(sizes), len(bags) * batch)  # one call: int32 positions and bags
    starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int32)
    parts = [
        np.arange(batch, dtype=np.int32) * b.bag_length + s if b.bag_length else b.offsets[:-1] + s
        for b, s in zip(bags, starts[:-1])
    ] + [starts[-1:]]
    if all(isinstance(p, np.ndarray) for p in parts):
        offsets = jnp.asarray(np.concatenate(parts))
    else:
        offsets = jnp.concatenate([jnp.asarray(p, jnp.int32) for p in parts])
    n = int(starts[-1])
    keep = None
    if any(b.keep is not None for b in bags):
        keeps = [jnp.ones((m,), bool) if b.keep is None else b.keep for b, m in zip(bags, sizes)]
        keep = jnp.concatenate(keeps)
    packed = CanonicalBags(
        ids=jnp.concatenate([saturate_int32(b.ids) for b in bags]),
        weights=jnp.concatenate([b.weights for b in bags]),
        offsets=offsets,
        bag_ids=jnp.clip(bag_of_positions(offsets, n), 0, len(bags) * batch - 1),
        keep=keep,
    )
    # each position's table from its feature's range of positions (no [n] host constant)
    feature = bag_of_positions(jnp.asarray(starts), n) if n else jnp.zeros((0,), jnp.int32)
    tables = jnp.asarray([s.table for s in slots], jnp.int32)[jnp.clip(feature, 0, len(slots) - 1)]
    return _pack_oob(pack, packed, tables, oob)


def _pack_oob(pack: TablePack, packed: CanonicalBags, tables: jax.Array, oob: str):
    """``packed`` (positions of tables [n] of ``pack``) after the ``oob`` policy against
    each position's own table: ``(CanonicalBags, tables)``; dropped positions add no rows."""
    num_rows = np.asarray([t.num_embeddings for t in pack.tables], np.int32)
    flat, valid = apply_table_oob(packed.ids, tables, num_rows, oob)
    return apply_bags_oob(packed, flat, valid, tables)


def _pool(pack: TablePack, arrays, slots, prepared, oob: str, impl: str) -> jax.Array:
    """``[F*B, D]`` bags of ``slots`` (same batch B) pooled in one call over
    ``_packed_bags``."""
    bags = [prepared[s.feature][0] for s in slots]
    packed, tables = _packed_bags(pack, slots, bags, oob)  # oob="error" checks even without bags
    weighted = any(prepared[s.feature][1] for s in slots)
    return _pool_packed(pack, arrays, packed, tables, weighted, impl)


def _pool_packed(pack: TablePack, arrays, packed: CanonicalBags, tables, weighted: bool, impl: str):
    """``[num_bags, D]`` float32 (float64 params stay float64): the bags of ``packed``
    (in range of their ``tables``, as ``_pack_oob`` gives) pooled in one call."""
    num_bags = packed.offsets.shape[0] - 1
    dim = arrays[0].shape[-1] if pack.kind == "dense" else pack.layout.dim
    if packed.ids.shape[0] == 0 or num_bags == 0:
        return jnp.zeros((num_bags, dim), jnp.promote_types(arrays[0].dtype, jnp.float32))
    if pack.kind == "dense":
        row_base = jnp.asarray(pack.row_offsets[:-1], jnp.int32)[tables]
        rows = jnp.take(arrays[0], row_base + packed.ids, axis=0)
        rows = rows.astype(jnp.promote_types(rows.dtype, jnp.float32))
        # a weight of 0 adds nothing
        return reference.pool(rows, packed.weights, packed.bag_ids, num_bags)
    which = choose_impl(impl, pack.layout, [a.dtype for a in arrays])
    return pooled_group(
        arrays,
        pack.layout,
        packed.ids,
        tables,
        packed.offsets,
        packed.bag_ids,
        packed.weights,
        weighted=weighted,
        impl=which,
    )


def _columns(x: jax.Array, cols: Sequence[int]) -> jax.Array:
    """Columns ``cols`` of ``x [B, F, L]`` as ``[len(cols), B, L]`` (a slice where they are
    consecutive, else one gather)."""
    lo = cols[0]
    picked = (
        x[:, lo : lo + len(cols)] if list(cols) == list(range(lo, lo + len(cols))) else x[:, np.asarray(cols)]
    )
    return jnp.transpose(picked, (1, 0, 2))


def _stacked_bags(pack: TablePack, ids: jax.Array, weights: jax.Array | None, oob: str):
    """A pack's stacked columns ``ids [F, B, L]`` (and weights) as one feature-major CSR of
    ``F*B`` padded bags, each feature's mode folded into the weights, then the ``oob``
    policy: ``(CanonicalBags, tables [n] int32)``, as ``_packed_bags`` gives."""
    num_features, batch, length = ids.shape
    n = num_features * batch * length
    check_sizes(n, num_features * batch)
    offsets = jnp.arange(num_features * batch + 1, dtype=jnp.int32) * length
    bag_ids = jnp.arange(n, dtype=jnp.int32) // max(length, 1)
    w = jnp.ones((n,), jnp.float32) if weights is None else weights.reshape(-1)
    w = scale_by_modes(w, offsets, bag_ids, [s.mode for s in pack.features], batch)
    packed = CanonicalBags(saturate_int32(ids.reshape(-1)), w, offsets, bag_ids, None, length)
    slot_tables = jnp.asarray([s.table for s in pack.features], jnp.int32)
    return _pack_oob(pack, packed, slot_tables[bag_ids // max(batch, 1)], oob)
