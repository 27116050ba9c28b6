"""A collection pack's bags prepared and pooled in one call (Flax-free; used by
``collection.layout``).

Every input form ends in one of two packed forms per pack:

- a ``jagged.PackedCSR`` (a ``KeyedJagged`` batch, or a feature dict whose features are
  padded or CSR, packed by ``jagged.pack_features``): ``pool_csr`` prepares its bags in
  one pass (``bag.packed_bags``: each position's bag and table, the ``oob`` policy) and
  pools them; ``rows_csr`` gives each id's row instead (each id its own bag);
- canonical bags per feature (``mask`` / ``segment_ids`` forms, mixed batch sizes),
  concatenated by ``_packed_canonical``.

Then one pooling call per pack: ``ops.pooled`` (a TT shape group's table-batched
op), the single-table op (a TT table of another core count), or one gather and segment
sum (dense tables). No array of the batch's size is built from host values, so XLA has
nothing of that size to constant-fold.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from flowtt_jax.collection.packs import FeatureSlot, TablePack
from flowtt_jax.inputs.bag import CanonicalBags, apply_bags_oob, bag_kwargs, canonical_bags, packed_bags
from flowtt_jax.inputs.csr import as_weights, bag_of_positions, check_sizes, scale_by_modes
from flowtt_jax.inputs.jagged import PackedCSR
from flowtt_jax.inputs.oob import apply_oob, apply_table_oob, as_ids, saturate_int32
from flowtt_jax.ops.pooled import choose_impl, pooled, to_batch_major
from flowtt_jax.tt import reference

__all__ = [
    "canonical_feature",
    "dict_sizes",
    "ids_of",
    "overflow_flags",
    "feature_input",
    "lookup_input",
    "pool_canonical",
    "pool_csr",
    "pool_packed",
    "prepare_feature",
    "rows_csr",
    "stacked_bags",
]


#: The innermost ``overflow_flags`` list of the call being traced (None: none open).
_FLAGS: contextvars.ContextVar[list | None] = contextvars.ContextVar("flowtt_overflow_flags", default=None)


@contextlib.contextmanager
def overflow_flags() -> Iterator[list[tuple[str, jax.Array]]]:
    """Collects ``(first table's name, overflowed bool[])`` of every TT pooling call made
    inside (``pool_packed``), for a caller in the same trace to count on the device; a call
    opens its own (a nested one, e.g. inside a ``shard_map``, keeps its flags)."""
    flags: list[tuple[str, jax.Array]] = []
    token = _FLAGS.set(flags)
    try:
        yield flags
    finally:
        _FLAGS.reset(token)


def feature_input(features: Mapping[str, Any], slot: FeatureSlot, pack: TablePack) -> tuple[jax.Array, dict]:
    """``(ids, kwargs)`` of the feature's input (``collection.bag_kwargs``); ``KeyError`` if missing."""
    if slot.feature not in features:
        raise KeyError(f"missing input for feature {slot.feature!r} (table {pack.tables[slot.table].name!r})")
    return bag_kwargs(features[slot.feature])


def _csr_bags(
    pack: TablePack, arrays, csr: PackedCSR, span: tuple[int, int], oob: str, impl: str, whole: bool
):
    """The bags of features ``span`` (indices into ``pack.features``) of ``csr``: ``(CanonicalBags,
    tables)`` after the ``oob`` policy against each position's table (``bag.packed_bags``)."""
    lo, hi = span
    batch = csr.batch
    offsets = csr.offsets if whole else csr.offsets[lo * batch : hi * batch + 1]
    slot_tables = tuple(s.table for s in pack.features)
    num_rows = jnp.asarray([t.num_embeddings for t in pack.tables], jnp.int32)
    kernel = _impl(pack, arrays, impl) == "ffi"
    names = tuple(t.name for t in pack.tables)
    return packed_bags(
        csr.ids,
        offsets,
        csr.weights,
        slot_tables,
        num_rows,
        oob,
        kernel=kernel,
        whole=whole,
        table_names=names,
        feature_names=tuple(s.feature for s in pack.features),
    )


def pool_csr(
    pack: TablePack,
    arrays,
    csr: PackedCSR,
    span: tuple[int, int],
    oob: str,
    impl: str,
    *,
    batch_major: bool = False,
    whole: bool = True,
) -> jax.Array:
    """``[F_p*B, D]`` float32 pooled bags of the pack's features, which are features
    ``span = (lo, hi)`` of ``csr`` (``whole``: all of them, ``csr.offsets`` as they are);
    feature-major rows, or batch-major (``b*F_p + f``) with ``batch_major``."""
    num_bags = (span[1] - span[0]) * csr.batch
    if csr.ids.shape[0] == 0 or num_bags == 0:
        return jnp.zeros((num_bags, _dim(pack, arrays)), _acc_dtype(arrays))
    bags, tables = _csr_bags(pack, arrays, csr, span, oob, impl, whole)
    w = scale_by_modes(bags.weights, bags.offsets, bags.bag_ids, [s.mode for s in pack.features], csr.batch)
    weighted = csr.weights is not None
    return pool_packed(
        pack, arrays, bags._replace(weights=w), tables, weighted, impl, csr.batch if batch_major else 0
    )


def rows_csr(
    pack: TablePack, arrays, csr: PackedCSR, span: tuple[int, int], oob: str, impl: str, *, whole: bool = True
):
    """``[n, D]`` float32: each position's row times its weight for the positions in the
    bags of features ``span`` of ``csr`` (the pack's features), 0 elsewhere; each id is its
    own bag of the pooling call, so the plan and kernels are the pooled call's."""
    n = csr.ids.shape[0]
    if n == 0:
        return jnp.zeros((0, _dim(pack, arrays)), _acc_dtype(arrays))
    bags, tables = _csr_bags(pack, arrays, csr, span, oob, impl, whole)
    pos = jax.lax.iota(jnp.int32, n)
    each = bags._replace(offsets=jax.lax.iota(jnp.int32, n + 1), bag_ids=pos, bag_length=1)
    return pool_packed(pack, arrays, each, tables, csr.weights is not None, impl)


def lookup_input(value: Any, name: str, oob: str) -> tuple[jax.Array, jax.Array | None]:
    """``(ids, weights | None)`` of a feature of an unpooled lookup: ids of any shape, or
    ``{"ids": ..., "weights": ..., "offsets": ...}`` (weights of the ids' shape; CSR offsets
    are allowed and not needed: the rows come back in the ids' own layout)."""
    weights = None
    if isinstance(value, Mapping):
        unknown = set(value) - {"ids", "weights", "offsets"}
        if unknown or "ids" not in value:
            raise ValueError(
                f"feature {name!r}: an unpooled lookup takes ids, or a dict with 'ids' and optional "
                f"'weights' and 'offsets'; got keys {sorted(value)}"
            )
        weights = value.get("weights")
        value = value["ids"]
    ids = as_ids(value if isinstance(value, jax.Array) else np.asarray(value), oob)
    if weights is not None:
        weights = as_weights(weights, f"feature {name!r}: weights")
        if weights.shape != ids.shape:
            raise ValueError(f"feature {name!r}: weights shape {weights.shape} != ids shape {ids.shape}")
    return ids, weights


def canonical_feature(
    features: Mapping[str, Any], slot: FeatureSlot, pack: TablePack, oob: str
) -> tuple[CanonicalBags, bool]:
    """The feature's canonical bags (its mode folded into the weights; ids as given, the
    ``oob`` policy not yet applied) and whether it has user weights; ``KeyError`` if
    ``features`` lacks it."""
    ids, kw = feature_input(features, slot, pack)
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


def pool_canonical(pack: TablePack, arrays, features: Mapping[str, Any], oob: str, impl: str):
    """``[(slots, [F*B, D] float32)]``: the pack's features by canonical bags, one pooling
    call per batch size (the forms ``jagged.pack_features`` does not take)."""
    prepared = {s.feature: canonical_feature(features, s, pack, oob) for s in pack.features}
    groups: dict[int, list[FeatureSlot]] = {}
    for s in pack.features:
        groups.setdefault(prepared[s.feature][0].offsets.shape[0] - 1, []).append(s)
    out = []
    for slots in groups.values():
        bags = [prepared[s.feature][0] for s in slots]
        packed, tables = _packed_canonical(pack, slots, bags, oob)  # oob="error" checks even without bags
        weighted = any(prepared[s.feature][1] for s in slots)
        out.append((tuple(slots), pool_packed(pack, arrays, packed, tables, weighted, impl)))
    return out


def _packed_canonical(pack: TablePack, slots, bags: Sequence[CanonicalBags], oob: str):
    """The features' canonical bags (same batch B) as one feature-major CSR over their
    concatenated ids, the ``oob`` policy applied once for all of them: ``(CanonicalBags
    [F*B bags], tables [n] int32)``. Bag (f, b) starts where the feature's bag b starts;
    the positions of a feature outside its bags (weight 0, dropped) fall in a neighbouring
    bag."""
    batch = bags[0].offsets.shape[0] - 1
    sizes = [b.ids.shape[0] for b in bags]
    n = sum(sizes)
    check_sizes(n, len(bags) * batch)  # one call: int32 positions and bags
    starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int32)
    iota = jax.lax.iota(jnp.int32, batch)  # padded bags from an iota, not a host constant
    parts = [
        b.offsets[:-1] + s if b.bag_length is None else iota * b.bag_length + s for b, s in zip(bags, starts)
    ]
    offsets = jnp.concatenate([jnp.asarray(p, jnp.int32) for p in parts] + [jnp.full((1,), n, jnp.int32)])
    keep = None
    if any(b.keep is not None for b in bags):
        keep = jnp.concatenate(
            [jnp.ones((m,), bool) if b.keep is None else b.keep for b, m in zip(bags, sizes)]
        )
    bag_ids = jnp.clip(bag_of_positions(offsets, n), 0, max(len(bags) * batch - 1, 0))
    packed = CanonicalBags(
        ids=jnp.concatenate([saturate_int32(b.ids) for b in bags]),
        weights=jnp.concatenate([b.weights for b in bags]),
        offsets=offsets,
        bag_ids=bag_ids,
        keep=keep,
    )
    # each position's table: its bag's feature's (a dropped position's may be a neighbour's)
    tables = jnp.asarray([s.table for s in slots], jnp.int32)[bag_ids // max(batch, 1)]
    return _pack_oob(pack, packed, tables, oob)


def _pack_oob(pack: TablePack, packed: CanonicalBags, tables: jax.Array, oob: str):
    """``packed`` (positions of tables [n] of ``pack``) after the ``oob`` policy against
    each position's own table: ``(CanonicalBags, tables)``; dropped positions add no rows."""
    num_rows = np.asarray([t.num_embeddings for t in pack.tables], np.int32)
    flat, valid = apply_table_oob(packed.ids, tables, num_rows, oob, tuple(t.name for t in pack.tables))
    return apply_bags_oob(packed, flat, valid, tables)


def _dim(pack: TablePack, arrays) -> int:
    return arrays[0].shape[-1] if pack.kind == "dense" else pack.tables[0].features


def _acc_dtype(arrays):
    return jnp.promote_types(arrays[0].dtype, jnp.float32)


def _impl(pack: TablePack, arrays, impl: str) -> str:
    """``"ffi"`` or ``"reference"`` for the pack (``"reference"`` for a dense pack)."""
    if pack.kind == "dense":
        return "reference"
    return choose_impl(impl, arrays, None if pack.kind == "single" else pack.layout)


def pool_packed(
    pack: TablePack, arrays, packed: CanonicalBags, tables, weighted: bool, impl: str, batch: int = 0
):
    """``[num_bags, D]`` float32 (float64 params stay float64): the bags of ``packed``
    (in range of their ``tables``) pooled in one call; ``batch`` as ``ops.pooled``'s
    (0: row j is bag j; else batch-major rows of feature-major bags)."""
    num_bags = packed.offsets.shape[0] - 1
    if packed.ids.shape[0] == 0 or num_bags == 0:
        return jnp.zeros((num_bags, _dim(pack, arrays)), _acc_dtype(arrays))
    which = _impl(pack, arrays, impl)
    if pack.kind == "dense":
        row_base = jnp.asarray(pack.row_offsets[:-1], jnp.int32)[tables]
        rows = jnp.take(arrays[0], row_base + packed.ids, axis=0)
        rows = rows.astype(jnp.promote_types(rows.dtype, jnp.float32))
        # a weight of 0 adds nothing
        return to_batch_major(reference.pool(rows, packed.weights, packed.bag_ids, num_bags), batch)
    single = pack.kind == "single"
    out, overflowed = pooled(
        arrays,
        packed.ids,
        packed.offsets,
        packed.bag_ids,
        packed.weights,
        weighted=weighted,
        impl=which,
        layout=None if single else pack.layout,
        tables=None if single else tables,
        batch=batch,
        unique_capacity=pack.capacity_for(packed.ids.shape[0]),
        ids_per_pass=pack.ids_per_pass,
        return_overflow=True,
    )
    flags = _FLAGS.get()
    if flags is not None:
        flags.append((pack.tables[0].name, overflowed))
    return out


def stacked_bags(pack: TablePack, ids: jax.Array, weights: jax.Array | None, oob: str):
    """A pack's stacked columns ``ids [F, B, L]`` (and weights) as one feature-major CSR of
    ``F*B`` padded bags, each feature's mode folded into the weights, then the ``oob``
    policy: ``(CanonicalBags, tables [n] int32)``."""
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


def ids_of(value: Any) -> Any:
    """A feature input's ids (an array, or a dict's ``"ids"``): its size is the feature's ids."""
    return value["ids"] if isinstance(value, Mapping) else value


def dict_sizes(packs: Sequence[TablePack], features: Mapping[str, Any]) -> tuple[list[int], int]:
    """``(ids per pack, the most bags of a feature)`` of a feature dict, from static shapes."""
    sizes, batch = [], 0
    for pack in packs:
        total = 0
        for s in pack.features:
            if s.feature not in features:
                continue
            value = features[s.feature]
            ids = ids_of(value)
            total += int(np.size(ids))
            kw = value if isinstance(value, Mapping) else {}
            if kw.get("offsets") is not None:
                bags = np.shape(kw["offsets"])[0] - 1
            elif isinstance(kw.get("num_bags"), (int, np.integer)):
                bags = int(kw["num_bags"])
            else:
                bags = np.shape(ids)[0] if np.ndim(ids) else 1
            batch = max(batch, bags)
        sizes.append(total)
    return sizes, batch
