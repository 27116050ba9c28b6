"""The one input pipeline of a collection call: every input form becomes, per pack, the
prepared bags one pooling call takes (Flax-free; ``collection.layout`` calls it, then
``collection.pool`` pools what it gives).

Forms: a feature dict (per feature: ids ``[B]`` (one id each), padded ``[B, L]`` with an
optional ``mask``, CSR ``ids [n]`` + ``offsets [B+1]``, or ``segment_ids`` + ``num_bags``;
optional ``weights``; concrete or traced offsets), a ``KeyedJagged``, stacked ids ``[B, F]``
/ ``[B, F, L]`` (+ weights), and the unpooled lookup's dict or ``KeyedJagged``.

Each form runs the stages of ``flowtt_jax.inputs`` once, in order, each check and clamp in
one module:

1. ``inputs.validate``: the form's shapes and dtypes, missing features (``KeyError`` naming
   the feature and its table), CSR offsets (concrete: checked; traced: ``checkify``-checked
   under ``oob="error"``), errors that name the feature or argument (a ``KeyedJagged``:
   ``KeyedJagged.csr``, by the same checks);
2. ``inputs.normalise``: one feature-major CSR over one flat int32 ids array (one
   concatenation of the ids, one of the offsets, whatever the number of features; traced
   offsets clamped), or canonical bags per feature for the ``mask`` / ``segment_ids`` forms
   and mixed batch sizes;
3. ``inputs.oob``: each position's table and the ``oob`` policy against it (one
   ``flowtt_tb_bags`` kernel for ``"clip"`` / ``"zero"`` on the kernel path), dropped
   positions parked, the out-of-range counters;
4. ``inputs.pack``: each feature's pooling mode folded into the weights, or unpooled each
   id its own bag; here a ``PackBatch`` (the pack's bags, each position's table, whether
   the user gave weights, the counters).

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

from flowtt_jax.collection.packs import FeatureSlot, TablePack
from flowtt_jax.inputs.jagged import KeyedJagged
from flowtt_jax.inputs.normalise import (
    CanonicalBags,
    PackedCSR,
    canonical_bags,
    csr_bags,
    flat_csr,
    pack_forms,
    reorder,
    saturate_int32,
    stacked_bags,
)
from flowtt_jax.inputs.oob import apply_bags_oob, apply_oob, table_oob
from flowtt_jax.inputs.pack import scale_by_modes, unpooled
from flowtt_jax.inputs.validate import feature_inputs, lookup_input

__all__ = [
    "PackBatch",
    "dict_batches",
    "form_sizes",
    "jagged_batches",
    "jagged_csr",
    "lookup_batches",
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
    table, before the ``oob`` policy (``oob.count_out_of_range``)."""

    pack: int
    slots: tuple[FeatureSlot, ...]
    bags: CanonicalBags
    tables: jax.Array
    weighted: bool
    batch: int
    out_of_range: jax.Array


def _finish(
    p: int,
    pack: TablePack,
    bags: CanonicalBags,
    offsets: jax.Array | None,
    batch: int,
    oob: str,
    kernel: bool,
    *,
    weights: jax.Array | None = None,
    weighted: bool,
    scaled: bool = False,
    pooled: bool = True,
    bounds: jax.Array | None = None,
) -> PackBatch:
    """Stages 3-4 of normalised feature-major ``bags`` of ``pack.features`` (``batch`` bags a
    feature; ``offsets``, ``weights``: their packed CSR and user weights where the
    ``flowtt_tb_bags`` kernel may take them, ``kernel``): the ``oob`` policy against each
    position's table (``oob.table_oob``), then the modes (``pooled``, unless ``scaled``
    already) or each id its own bag (unpooled); ``bounds``: ``normalise.PackedCSR``'s (its
    positions in no bag dropped, its bags' lengths for the modes). A packed CSR of no ids, or pooled without
    bags: empty bags (canonical bags go through: ``oob="error"`` checks ids in no bag)."""
    n = bags.ids.shape[0]
    num_bags = len(pack.features) * batch
    if offsets is not None and (n == 0 or (pooled and num_bags == 0)):
        zeros = jnp.zeros((0,), jnp.int32)
        empty = CanonicalBags(
            zeros, jnp.zeros((0,), jnp.float32), jnp.zeros((num_bags + 1 if pooled else 1,), jnp.int32), zeros
        )
        counts = jnp.zeros((len(pack.tables),), jnp.int32)
        return PackBatch(p, pack.features, empty, zeros, weighted, batch, counts)
    bags, tables, counts = table_oob(
        bags,
        offsets,
        np.asarray([s.table for s in pack.features], np.int32),
        np.asarray([t.num_embeddings for t in pack.tables], np.int32),
        batch,
        oob,
        kernel=kernel,
        weights=weights,
        bounds=bounds,
        table_names=tuple(t.name for t in pack.tables),
        feature_names=tuple(s.feature for s in pack.features),
    )
    if not pooled:
        bags = unpooled(bags)
    elif not scaled:
        modes = [s.mode for s in pack.features]
        lengths = None if bounds is None else jnp.diff(bounds, axis=1).reshape(-1)
        w = scale_by_modes(bags.weights, bags.offsets, bags.bag_ids, modes, batch, lengths)
        bags = bags._replace(weights=w)
    return PackBatch(p, pack.features, bags, tables, weighted, batch, counts)


def dict_batches(
    packs: Sequence[TablePack], features: Mapping[str, Any], oob: str, kernels: Sequence[bool]
) -> list[PackBatch]:
    """A pooled feature dict's batches, for the features it gives (a subset of the
    collection's: their outputs only): per pack, its features checked (``validate``), then
    one batch (its padded and CSR features of one batch size: one packed CSR) or one per
    batch size (canonical bags) (``normalise.pack_forms``), then the policy and the modes
    (``_finish``); ``kernels[p]``: pack p's bags are prepared by the ``flowtt_tb_bags`` kernel
    where the form allows."""
    out = []
    for p, pack in enumerate(packs):
        slots = tuple(s for s in pack.features if s.feature in features)  # a subset: its outputs only
        if not slots:
            continue
        names = [s.feature for s in slots]
        forms = feature_inputs(features, names, [pack.tables[s.table].name for s in slots], oob)
        for g in pack_forms(forms, [s.mode for s in slots]):
            part = tuple(slots[j] for j in g.features)
            sub = pack if part == pack.features else dataclasses.replace(pack, features=part)
            out.append(
                _finish(
                    p,
                    sub,
                    g.bags,
                    g.offsets,
                    g.batch,
                    oob,
                    kernels[p],
                    weights=g.weights,
                    weighted=g.weighted,
                    scaled=g.scaled,
                    bounds=g.bounds,
                )
            )
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
        ids, weights = zip(*(lookup_input(features[s.feature], s.feature, oob) for s in slots))
        csr = flat_csr(ids, weights)
        bags = csr_bags(csr.ids, csr.offsets, csr.weights)
        sub = dataclasses.replace(pack, features=slots)
        batch = _finish(
            p,
            sub,
            bags,
            csr.offsets,
            1,
            oob,
            kernels[p],
            weights=csr.weights,
            weighted=csr.weights is not None,
            pooled=False,
        )
        out.append((batch, [tuple(i.shape) for i in ids]))
    return out


def jagged_csr(
    batch: KeyedJagged, feature_names: Sequence[str], order: Sequence[int], oob: str
) -> tuple[PackedCSR, Any, Any]:
    """``(PackedCSR, back, src)``: ``batch``'s bags (validated by ``KeyedJagged.csr``) with each
    pack's features consecutive (``order``: the features' indices in the packs' order;
    ``normalise.reorder``); ``back`` (None when already so) puts ``[B, F_packs, D]`` outputs
    back in ``feature_names`` order, ``src`` (or None) is each position's input position."""
    if not isinstance(batch, KeyedJagged):
        raise TypeError(f"expected a KeyedJagged batch, got {type(batch).__name__}")
    keys = tuple(feature_names) if batch.keys is None else batch.keys
    csr = batch.csr(feature_names, oob)  # validated, in the batch's own key order
    column = {k: i for i, k in enumerate(keys)}
    source = [column[feature_names[i]] for i in order]  # the packs' features in the batch
    back = None if tuple(order) == tuple(range(len(feature_names))) else np.argsort(order)
    if source == list(range(len(feature_names))):
        return csr, back, None
    csr, src = reorder(csr, source)
    return csr, back, src


def jagged_batches(
    packs: Sequence[TablePack], csr: PackedCSR, oob: str, kernels: Sequence[bool], *, pooled: bool
) -> list[PackBatch]:
    """A ``KeyedJagged``'s batches (``jagged_csr``'s ``csr``), one per pack over the flat ids:
    the pack's features' slice of the offsets (positions outside it in no bag)."""
    offsets = saturate_int32(jnp.asarray(csr.offsets))
    out, lo, b = [], 0, csr.batch
    for p, pack in enumerate(packs):
        hi = lo + len(pack.features)
        part = offsets[lo * b : hi * b + 1]
        bags = csr_bags(csr.ids, part, csr.weights)
        weighted = csr.weights is not None
        out.append(
            _finish(
                p, pack, bags, part, b, oob, kernels[p], weights=csr.weights, weighted=weighted, pooled=pooled
            )
        )
        lo = hi
    return out


def stacked_batches(
    packs: Sequence[TablePack],
    feature_names: Sequence[str],
    ids: jax.Array,
    weights: jax.Array | None,
    oob: str,
) -> list[tuple[PackBatch, list[int]]]:
    """Checked stacked ``ids [B, F, L]`` (``validate.check_stacked``) as one batch per pack
    (its columns ``cols``: ``[F_p*B]`` padded bags, feature-major), with the columns."""
    column = {f: i for i, f in enumerate(feature_names)}
    out = []
    for p, pack in enumerate(packs):
        cols = [column[s.feature] for s in pack.features]
        bags = stacked_bags(ids, weights, cols)
        batch = _finish(p, pack, bags, None, ids.shape[0], oob, False, weighted=weights is not None)
        out.append((batch, cols))
    return out


def prepare_feature(
    features: Mapping[str, Any], slot: FeatureSlot, pack: TablePack, oob: str
) -> tuple[CanonicalBags, bool]:
    """One feature's canonical bags (its mode folded in) with the ``oob`` policy applied
    against its table (ids int32 in range), and whether it has user weights (the table-wise
    sharded layout's per-feature form)."""
    table = pack.tables[slot.table]
    (form,) = feature_inputs(features, [slot.feature], [table.name], oob)
    bags = canonical_bags(form, slot.mode)
    return apply_bags_oob(bags, *apply_oob(bags.ids, table.num_embeddings, oob)), form.weights is not None


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
