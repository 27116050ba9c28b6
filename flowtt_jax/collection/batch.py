"""The one input pipeline of a collection call: every input form becomes, per pack, the
prepared bags one pooling call takes (Flax-free; ``collection.layout`` calls it, then
``collection.pool.pool_packed`` pools what it gives).

Forms: a feature dict (per feature: ids ``[B]`` (one id each), padded ``[B, L]`` with an
optional ``mask``, CSR ``ids [n]`` + ``offsets [B+1]``, or ``segment_ids`` + ``num_bags``;
optional ``weights``; concrete or traced offsets), a ``KeyedJagged``, stacked ids ``[B, F]``
/ ``[B, F, L]`` (+ weights), and the unpooled lookup's dict or ``KeyedJagged``.

Each call runs the stages once, in order:

1. **validate**: the form's shapes and dtypes, missing features (``KeyError`` naming the
   feature and its table), CSR offsets (concrete: checked; traced: ``checkify``-checked
   under ``oob="error"``, else clamped), with errors that name the feature or argument;
2. **normalise**: the form as a feature-major CSR over one flat ids array
   (``jagged.PackedCSR``: one concatenation of the ids, one of the offsets, whatever the
   number of features), or canonical bags per feature for the ``mask`` / ``segment_ids``
   forms and mixed batch sizes (``bag.canonical_bags``);
3. **oob**: each position's table and the ``oob`` policy against it (one
   ``flowtt_tb_bags`` kernel for ``"clip"`` / ``"zero"`` on the kernel path,
   ``oob.apply_table_oob`` otherwise), dropped positions parked;
4. **pack**: a ``PackBatch``: the pack's bags (ids int32 in range of their tables,
   effective weights with each feature's pooling mode folded in, a valid CSR), each
   position's table, whether the user gave weights. Unpooled, each id is its own bag.

No array of the batch's size is built from host values, so XLA has nothing of that size
to constant-fold.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from flowtt_jax.collection.config import TableConfig
from flowtt_jax.collection.packs import FeatureSlot, TablePack
from flowtt_jax.inputs.bag import CanonicalBags, apply_bags_oob, canonical_bags, packed_bags
from flowtt_jax.inputs.csr import (
    as_weights,
    bag_of_positions,
    check_csr,
    check_sizes,
    clamp_csr,
    scale_by_modes,
)
from flowtt_jax.inputs.jagged import KeyedJagged, PackedCSR, compact, concat_weights
from flowtt_jax.inputs.oob import apply_oob, apply_table_oob, as_ids, saturate_int32

__all__ = [
    "PackBatch",
    "bag_kwargs",
    "check_stacked",
    "dict_batches",
    "form_sizes",
    "jagged_batches",
    "jagged_csr",
    "lookup_batches",
    "pack_features",
    "prepare_feature",
    "stacked_batches",
]


class PackBatch(NamedTuple):
    """One pooling call's input: features ``slots`` of pack ``pack`` (each ``batch`` bags,
    feature-major), their bags prepared (``bags``: int32 ids in range of their tables, dropped
    positions parked and weighted 0; pooled, each feature's mode folded into the weights;
    unpooled, each position its own bag), ``tables [n]`` int32 each position's table in the
    pack, ``weighted``: whether the user gave weights (their gradient is asked for),
    ``out_of_range``: int32 ``[len(pack.tables)]`` ids in these bags out of range of their
    table, before the ``oob`` policy (``count_out_of_range``)."""

    pack: int
    slots: tuple[FeatureSlot, ...]
    bags: CanonicalBags
    tables: jax.Array
    weighted: bool
    batch: int
    out_of_range: jax.Array


# ----------------------------------------------------------------------------- validate


def _feature_input(features: Mapping[str, Any], slot: FeatureSlot, pack: TablePack) -> tuple[Any, dict]:
    """``(ids, form kwargs)`` of a feature's input (``bag_kwargs``); ``KeyError`` naming
    the feature and its table if missing."""
    if slot.feature not in features:
        raise KeyError(f"missing input for feature {slot.feature!r} (table {pack.tables[slot.table].name!r})")
    return bag_kwargs(features[slot.feature])


def _lookup_input(value: Any, name: str, oob: str) -> tuple[jax.Array, jax.Array | None]:
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


def check_stacked(
    feature_names: Sequence[str], tables: Sequence[TableConfig], ids: Any, weights: Any, oob: str
) -> tuple[jax.Array, jax.Array | None]:
    """Stacked ids (and weights) as ``[B, F, L]`` after their checks (``ValueError`` /
    ``TypeError`` naming the argument)."""
    ids = as_ids(ids, oob)
    num = len(feature_names)
    if ids.ndim not in (2, 3) or ids.shape[1] != num:
        raise ValueError(
            f"stacked ids must be [B, F] or [B, F, L] with F = {num} features "
            f"(columns in feature_names order), got shape {ids.shape}"
        )
    dims = sorted({cfg.features for cfg in tables})
    if len(dims) > 1:
        raise ValueError(f"a stacked output needs one dim for every table, got dims {dims}")
    if weights is not None:
        weights = as_weights(weights, "stacked weights")
        if weights.shape != ids.shape:
            raise ValueError(f"weights shape {weights.shape} != ids shape {ids.shape}")
        weights = weights if weights.ndim == 3 else weights[..., None]
    return (ids if ids.ndim == 3 else ids[..., None]), weights


def bag_kwargs(value: Any) -> tuple[jax.Array, dict]:
    """``(ids, kwargs)`` of a collection feature input, ``tt_embedding_bag``'s (the dict's
    form, parsed; ``ValueError`` for an unknown key).

    A 1-D array is one id per example (bags of one id: padded ``[B, 1]``).
    """
    if isinstance(value, Mapping):
        kw = dict(value)
        ids = _host_or_jax(kw.pop("ids"))
        unknown = set(kw) - {"offsets", "segment_ids", "num_bags", "mask", "weights"}
        if unknown:
            raise ValueError(f"unknown feature input keys {sorted(unknown)}")
        if ids.ndim == 1 and "offsets" not in kw and "segment_ids" not in kw:
            ids = ids[:, None]
            for k in ("mask", "weights"):
                if kw.get(k) is not None:
                    kw[k] = jnp.asarray(kw[k])[:, None]
        return ids, kw
    ids = _host_or_jax(value)
    if ids.ndim == 1:
        ids = ids[:, None]
    return ids, {}


def _host_or_jax(ids: Any) -> Any:
    """JAX arrays as they are, anything else as numpy: not ``jnp.asarray``, which would wrap
    host int64 ids past int32 (without x64) before ``oob.as_ids`` can see them."""
    return ids if isinstance(ids, jax.Array) else np.asarray(ids)


# ---------------------------------------------------------------------------- normalise


def pack_features(
    inputs: Sequence[tuple[jax.Array, dict]], names: Sequence[str], oob: str
) -> PackedCSR | None:
    """Features' inputs (``bag_kwargs`` of each, in order) as one ``PackedCSR``, or None
    where a feature's form needs its own preparation (``mask``, ``segment_ids``) or the batch
    sizes differ. Padded ``[B, L]`` and CSR features take a fixed number of ops whatever
    their count: one concatenation of the ids (and weights), one of the CSR offsets; traced
    offsets (which may leave positions outside their bags) add one ``compact`` gather.
    ``names`` name the features in errors."""
    forms, batches = [], set()
    for ids, kw in inputs:
        if any(kw.get(k) is not None for k in ("mask", "segment_ids", "num_bags")):
            return None
        if kw.get("offsets") is not None:
            offsets = kw["offsets"]
            if np.ndim(ids) != 1 or np.ndim(offsets) != 1 or np.shape(offsets)[0] < 1:
                return None  # canonical_bags gives the error
            if not jnp.issubdtype(jnp.result_type(offsets), jnp.integer):
                return None
            batches.add(np.shape(offsets)[0] - 1)
            forms.append("csr")
        else:
            if np.ndim(ids) != 2:
                return None
            batches.add(np.shape(ids)[0])
            forms.append("padded")
        w = kw.get("weights")
        if w is not None and np.shape(w) != np.shape(ids):
            return None  # canonical_bags gives the error
    if len(batches) != 1:
        return None
    batch = batches.pop()
    sizes = [int(np.size(ids)) for ids, _ in inputs]
    n = sum(sizes)
    check_sizes(n, len(inputs) * batch)
    starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    ids = jnp.concatenate([saturate_int32(as_ids(i, oob)).reshape(-1) for i, _ in inputs])
    ids, weights = _one_buffer(ids, concat_weights([kw.get("weights") for _, kw in inputs], sizes))
    csr = [j for j, f in enumerate(forms) if f == "csr"]
    padded = [j for j, f in enumerate(forms) if f == "padded"]
    traced = False
    parts_len, parts_start = [], []
    if csr:
        raw = [inputs[j][1]["offsets"] for j in csr]
        for j, o in zip(csr, raw):
            check_csr(o, sizes[j], oob == "error", names[j])  # traced: checkify (oob="error") and clamped
        traced = any(isinstance(o, jax.core.Tracer) for o in raw)
        off = jnp.concatenate([saturate_int32(jnp.asarray(o)) for o in raw]).reshape(len(raw), batch + 1)
        if traced:  # canonical_bags' clamp, per feature
            off = clamp_csr(off, jnp.asarray([sizes[j] for j in csr], jnp.int32)[:, None])
        parts_len.append(off[:, 1:] - off[:, :-1])
        parts_start.append(off[:, :-1] + jnp.asarray(starts[csr], jnp.int32)[:, None])
    if padded:  # bag b of a [B, L] feature starts at start + L * b: from an iota, not a host constant
        length = jnp.asarray([np.shape(inputs[j][0])[1] for j in padded], jnp.int32)[:, None]
        parts_len.append(jnp.broadcast_to(length, (len(padded), batch)))
        parts_start.append(
            jnp.asarray(starts[padded], jnp.int32)[:, None] + length * jax.lax.iota(jnp.int32, batch)
        )
    order = csr + padded
    back = None if order == sorted(order) else np.argsort(order)  # to the features' order

    def in_order(parts: list) -> jax.Array:
        x = jnp.concatenate(parts) if len(parts) > 1 else parts[0]
        return (x if back is None else x[back]).reshape(-1)

    bag_starts = in_order(parts_start)  # [F*B]: where each bag starts in the concatenated ids
    if not traced:  # valid CSRs: the bags start where they are, no gather (and no scan)
        return PackedCSR(ids, jnp.concatenate([bag_starts, jnp.full((1,), n, jnp.int32)]), weights, batch)
    ids, weights, offsets, _ = compact(ids, weights, bag_starts, in_order(parts_len))
    return PackedCSR(ids, offsets, weights, batch)


def _one_buffer(ids: jax.Array, weights: jax.Array | None) -> tuple[jax.Array, jax.Array | None]:
    """The features' concatenated ``ids`` (and ``weights``) as buffers of their own: an
    optimisation barrier keeps XLA from fusing a concatenation of F operands into its
    consumers, whose fused loop then selects among F operands per element (the compile grows
    with F: 20 s at 788 features on a CPU, 0.4 s as a buffer of its own)."""
    barrier = jax.lax.optimization_barrier  # one each: a joint one would give the ids a tangent
    return barrier(ids), (None if weights is None else barrier(weights))


def jagged_csr(
    batch: KeyedJagged, feature_names: Sequence[str], order: Sequence[int], oob: str
) -> tuple[PackedCSR, Any, Any]:
    """``(PackedCSR, back, src)``: ``batch``'s bags (validated by ``KeyedJagged.csr``) with each
    pack's features consecutive (``order``: the features' indices in the packs' order);
    ``back`` (None when already so) puts ``[B, F_packs, D]`` outputs back in ``feature_names``
    order, ``src`` (or None) is each position's input position."""
    if not isinstance(batch, KeyedJagged):
        raise TypeError(f"expected a KeyedJagged batch, got {type(batch).__name__}")
    keys = tuple(feature_names) if batch.keys is None else batch.keys
    csr = batch.csr(feature_names, oob)  # validated, in the batch's own key order
    n, num = csr.ids.shape[0], len(feature_names)
    column = {k: i for i, k in enumerate(keys)}
    source = [column[feature_names[i]] for i in order]  # the packs' features in the batch
    back = None if tuple(order) == tuple(range(num)) else np.argsort(order)
    if source == list(range(num)):
        return csr, back, None
    offsets = clamp_csr(csr.offsets, n)
    starts = offsets[:-1].reshape(num, csr.batch)[np.asarray(source)].reshape(-1)
    lengths = jnp.diff(offsets).reshape(num, csr.batch)[np.asarray(source)].reshape(-1)
    ids, weights, new_offsets, src = compact(csr.ids, csr.weights, starts, lengths)
    return PackedCSR(ids, new_offsets, weights, csr.batch), back, src


# ------------------------------------------------------------------------ oob and pack


def _empty(num_bags: int) -> CanonicalBags:
    zeros = jnp.zeros((0,), jnp.int32)
    return CanonicalBags(zeros, jnp.zeros((0,), jnp.float32), jnp.zeros((num_bags + 1,), jnp.int32), zeros)


def _zeros(pack: TablePack) -> jax.Array:
    return jnp.zeros((len(pack.tables),), jnp.int32)


def _num_rows(pack: TablePack) -> np.ndarray:
    return np.asarray([t.num_embeddings for t in pack.tables], np.int32)


def count_out_of_range(
    raw: jax.Array,
    offsets: jax.Array,
    keep: jax.Array | None,
    slots: Sequence[FeatureSlot],
    pack: TablePack,
    batch: int,
    oob: str,
) -> jax.Array:
    """int32 ``[len(pack.tables)]``: ids of the bags of ``slots`` (feature-major ``offsets``
    over ``raw [n]``, ``batch`` bags a feature; ``keep``: False where a position is dropped,
    e.g. masked) out of range of their feature's table, before the policy; zeros under
    ``oob="error"`` (it raises instead). Each position's feature from the features' bounds
    (a scatter of F marks and a cumulative sum), the counts from a cumulative sum and a
    gather of the bounds: no scatter over the ids. The collections' default counters."""
    num_tables = len(pack.tables)
    n = raw.shape[0]
    if oob == "error" or n == 0 or not slots or batch == 0:
        return jnp.zeros((num_tables,), jnp.int32)
    bounds = jnp.clip(offsets[::batch], 0, n)  # [F + 1]: where each feature's bags start and end
    feature = jnp.cumsum(jnp.zeros((n + 1,), jnp.int32).at[bounds[1:-1]].add(1)[:n], dtype=jnp.int32)
    slot_tables = np.asarray([s.table for s in slots], np.int32)
    limit = jnp.asarray(_num_rows(pack)[slot_tables])[feature]
    raw = saturate_int32(raw)
    bad = (raw < 0) | (raw >= limit)
    if keep is not None:
        bad = bad & keep
    running = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(bad, dtype=jnp.int32)])
    per_feature = running[bounds[1:]] - running[bounds[:-1]]
    return jax.ops.segment_sum(per_feature, jnp.asarray(slot_tables), num_segments=num_tables)


def _csr_batch(
    p: int,
    pack: TablePack,
    csr: PackedCSR,
    span: tuple[int, int],
    oob: str,
    kernel: bool,
    *,
    pooled: bool,
    whole: bool = True,
) -> PackBatch:
    """The bags of the pack's features, features ``span = (lo, hi)`` of ``csr`` (``whole``: all
    of them, ``csr.offsets`` as they are): each position's bag and table, the ``oob`` policy
    (``bag.packed_bags``), then the modes (pooled) or each id its own bag (unpooled)."""
    lo, hi = span
    batch, n = csr.batch, csr.ids.shape[0]
    weighted = csr.weights is not None
    num_bags = (hi - lo) * batch
    if n == 0 or (pooled and num_bags == 0):
        empty = _empty(num_bags if pooled else 0)
        return PackBatch(p, pack.features, empty, empty.ids, weighted, batch, _zeros(pack))
    offsets = csr.offsets if whole else csr.offsets[lo * batch : hi * batch + 1]
    bags, tables = packed_bags(
        csr.ids,
        offsets,
        csr.weights,
        tuple(s.table for s in pack.features),
        jnp.asarray(_num_rows(pack)),
        oob,
        kernel=kernel,
        whole=whole,
        table_names=tuple(t.name for t in pack.tables),
        feature_names=tuple(s.feature for s in pack.features),
    )
    bad = count_out_of_range(csr.ids, bags.offsets, None, pack.features, pack, batch, oob)
    if pooled:
        w = scale_by_modes(bags.weights, bags.offsets, bags.bag_ids, [s.mode for s in pack.features], batch)
        bags = bags._replace(weights=w)
    else:  # each position its own bag: the pooling call's plan and kernels give each id's row
        pos = jax.lax.iota(jnp.int32, n)
        bags = bags._replace(offsets=jax.lax.iota(jnp.int32, n + 1), bag_ids=pos, bag_length=1)
    return PackBatch(p, pack.features, bags, tables, weighted, batch, bad)


def _canonical_feature(
    features: Mapping[str, Any], slot: FeatureSlot, pack: TablePack, oob: str
) -> tuple[CanonicalBags, bool]:
    """The feature's canonical bags (its mode folded into the weights; ids as given, the
    ``oob`` policy not yet applied) and whether it has user weights."""
    ids, kw = _feature_input(features, slot, pack)
    bags = canonical_bags(as_ids(ids, oob), mode=slot.mode, check_offsets=oob == "error", **kw)
    return bags, kw.get("weights") is not None


def prepare_feature(
    features: Mapping[str, Any], slot: FeatureSlot, pack: TablePack, oob: str
) -> tuple[CanonicalBags, bool]:
    """One feature's canonical bags with the ``oob`` policy applied against its table (ids
    int32 in range), and whether it has user weights (the table-wise sharded layout's
    per-feature form)."""
    bags, weighted = _canonical_feature(features, slot, pack, oob)
    num_rows = pack.tables[slot.table].num_embeddings
    return apply_bags_oob(bags, *apply_oob(bags.ids, num_rows, oob)), weighted


def _canonical_batches(p: int, pack: TablePack, features: Mapping[str, Any], oob: str) -> list[PackBatch]:
    """The pack's features by canonical bags (the forms ``pack_features`` does not take), one
    batch per batch size."""
    prepared = {s.feature: _canonical_feature(features, s, pack, oob) for s in pack.features}
    groups: dict[int, list[FeatureSlot]] = {}
    for s in pack.features:
        groups.setdefault(prepared[s.feature][0].offsets.shape[0] - 1, []).append(s)
    out = []
    for batch, slots in groups.items():
        bags = [prepared[s.feature][0] for s in slots]
        packed, tables, bad = _packed_canonical(
            pack, slots, bags, oob
        )  # oob="error" checks even without bags
        weighted = any(prepared[s.feature][1] for s in slots)
        out.append(PackBatch(p, tuple(slots), packed, tables, weighted, batch, bad))
    return out


def _packed_canonical(pack: TablePack, slots, bags: Sequence[CanonicalBags], oob: str):
    """The features' canonical bags (same batch B) as one feature-major CSR over their
    concatenated ids, the ``oob`` policy applied once for all of them: ``(CanonicalBags
    [F*B bags], tables [n] int32, out_of_range [T] int32)``. Bag (f, b) starts where the
    feature's bag b starts; the positions of a feature outside its bags (weight 0, dropped)
    fall in a neighbouring bag."""
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
    bad = count_out_of_range(packed.ids, offsets, keep, slots, pack, batch, oob)
    return (*_pack_oob(pack, packed, tables, oob), bad)


def _pack_oob(pack: TablePack, packed: CanonicalBags, tables: jax.Array, oob: str):
    """``packed`` (positions of tables [n] of ``pack``) after the ``oob`` policy against
    each position's own table: ``(CanonicalBags, tables)``; dropped positions add no rows."""
    names = tuple(t.name for t in pack.tables)
    flat, valid = apply_table_oob(packed.ids, tables, _num_rows(pack), oob, names)
    return apply_bags_oob(packed, flat, valid, tables)


# ------------------------------------------------------------------------ the forms


def dict_batches(
    packs: Sequence[TablePack], features: Mapping[str, Any], oob: str, kernels: Sequence[bool]
) -> list[PackBatch]:
    """A pooled feature dict's batches, for the features it gives (a subset of the
    collection's: their outputs only): per pack one (its padded and CSR features of one
    batch size, ``pack_features``) or one per batch size (canonical bags); ``kernels[p]``:
    pack p's bags are prepared by the ``flowtt_tb_bags`` kernel where the form allows."""
    out = []
    for p, pack in enumerate(packs):
        slots = tuple(s for s in pack.features if s.feature in features)  # a subset: its outputs only
        if not slots:
            continue
        sub = pack if len(slots) == len(pack.features) else dataclasses.replace(pack, features=slots)
        inputs = [_feature_input(features, s, sub) for s in slots]
        csr = pack_features(inputs, [s.feature for s in slots], oob)
        if csr is not None:  # one packed CSR: no per-feature op before the pooling
            out.append(_csr_batch(p, sub, csr, (0, len(slots)), oob, kernels[p], pooled=True))
        else:
            out += _canonical_batches(p, sub, features, oob)
    return out


def lookup_batches(
    packs: Sequence[TablePack], features: Mapping[str, Any], oob: str, kernels: Sequence[bool]
) -> list[tuple[PackBatch, list[tuple[int, ...]]]]:
    """An unpooled feature dict's batches, one per pack with features in ``features`` (each
    id its own bag), with the ids' shape of each feature (its rows come back in it)."""
    out = []
    for p, pack in enumerate(packs):
        slots = tuple(s for s in pack.features if s.feature in features)
        if not slots:
            continue
        ids, weights = zip(*(_lookup_input(features[s.feature], s.feature, oob) for s in slots))
        sizes = [int(i.size) for i in ids]
        flat = jnp.concatenate([saturate_int32(i).reshape(-1) for i in ids])
        flat, flat_weights = _one_buffer(flat, concat_weights(weights, sizes))
        offsets = jnp.asarray(np.concatenate([[0], np.cumsum(sizes)]), jnp.int32)
        csr = PackedCSR(flat, offsets, flat_weights, 1)
        sub = dataclasses.replace(pack, features=slots)
        batch = _csr_batch(p, sub, csr, (0, len(slots)), oob, kernels[p], pooled=False)
        out.append((batch, [tuple(i.shape) for i in ids]))
    return out


def jagged_batches(
    packs: Sequence[TablePack], csr: PackedCSR, oob: str, kernels: Sequence[bool], *, pooled: bool
) -> list[PackBatch]:
    """A ``KeyedJagged``'s batches (``jagged_csr``'s ``csr``), one per pack over the flat ids."""
    out, lo = [], 0
    for p, pack in enumerate(packs):
        hi = lo + len(pack.features)
        out.append(_csr_batch(p, pack, csr, (lo, hi), oob, kernels[p], pooled=pooled, whole=False))
        lo = hi
    return out


def stacked_batches(
    packs: Sequence[TablePack],
    feature_names: Sequence[str],
    ids: jax.Array,
    weights: jax.Array | None,
    oob: str,
) -> list[tuple[PackBatch, list[int]]]:
    """Checked stacked ``ids [B, F, L]`` (``check_stacked``) as one batch per pack (its
    columns ``cols`` by one gather: ``[F_p*B]`` padded bags, feature-major), with the
    columns."""
    column = {f: i for i, f in enumerate(feature_names)}
    out = []
    for p, pack in enumerate(packs):
        cols = [column[s.feature] for s in pack.features]
        sub = _columns(ids, cols)  # [F_p, B, L]
        w = None if weights is None else _columns(weights, cols)
        num_features, batch, length = sub.shape
        n = num_features * batch * length
        check_sizes(n, num_features * batch)
        offsets = jnp.arange(num_features * batch + 1, dtype=jnp.int32) * length
        bag_ids = jnp.arange(n, dtype=jnp.int32) // max(length, 1)
        wf = jnp.ones((n,), jnp.float32) if w is None else w.reshape(-1)
        wf = scale_by_modes(wf, offsets, bag_ids, [s.mode for s in pack.features], batch)
        packed = CanonicalBags(saturate_int32(sub.reshape(-1)), wf, offsets, bag_ids, None, length)
        slot_tables = jnp.asarray([s.table for s in pack.features], jnp.int32)
        tables = slot_tables[bag_ids // max(batch, 1)]
        bad = count_out_of_range(packed.ids, offsets, None, pack.features, pack, batch, oob)
        packed, tables = _pack_oob(pack, packed, tables, oob)
        out.append((PackBatch(p, pack.features, packed, tables, weights is not None, batch, bad), cols))
    return out


def _columns(x: jax.Array, cols: Sequence[int]) -> jax.Array:
    """Columns ``cols`` of ``x [B, F, L]`` as ``[len(cols), B, L]`` (a slice where they are
    consecutive, else one gather)."""
    lo = cols[0]
    picked = (
        x[:, lo : lo + len(cols)] if list(cols) == list(range(lo, lo + len(cols))) else x[:, np.asarray(cols)]
    )
    return jnp.transpose(picked, (1, 0, 2))


# ------------------------------------------------------------------------ static sizes


def _ids_of(value: Any) -> Any:
    """A feature input's ids (an array, or a dict's ``"ids"``): its size is the feature's ids."""
    return value["ids"] if isinstance(value, Mapping) else value


def form_sizes(
    packs: Sequence[TablePack], feature_names: Sequence[str], features: Any, pooled: bool
) -> tuple[list[int], int]:
    """``(ids per pack, bags per feature)`` of a call's inputs, from static shapes (the memory
    policy's sizes): a ``KeyedJagged``'s every id for each pack (each scans the flat batch), a
    dict's own features' ids, stacked ``[B, F(, L)]`` ids' columns; unpooled, each id is a bag."""
    if isinstance(features, KeyedJagged):
        n = int(np.shape(features.ids)[0])
        num = max(len(feature_names), 1)
        lengths = features.lengths
        batch = np.shape(lengths)[-1] if lengths is not None else (np.shape(features.offsets)[0] - 1) // num
        return [n] * len(packs), (int(batch) if pooled else n)
    if isinstance(features, Mapping):
        sizes, batch = [], 0
        for pack in packs:
            total = 0
            for s in pack.features:
                if s.feature not in features:
                    continue
                value = features[s.feature]
                ids = _ids_of(value)
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
        return sizes, (batch if pooled else max(sizes, default=0))
    shape = np.shape(features)
    per_feature = shape[0] * (shape[2] if len(shape) == 3 else 1)
    return [per_feature * len(pk.features) for pk in packs], shape[0]
