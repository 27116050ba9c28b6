"""Stage 2 of the input pipeline, **normalise**: checked forms (``inputs.validate``) as one
canonical CSR over one flat int32 ids array (``jax.numpy`` only).

- ``CanonicalBags``: ids ``[n]`` int32 in bag order, offsets ``[B+1]`` a valid CSR, each
  position's bag, its weight (0 where dropped: masked, in no bag), ``keep``;
- one bag form (``canonical_bags``: CSR, segment ids, padded with a mask; the mode folded in
  from the kept positions' count when asked) or a CSR over flat ids (``csr_bags``);
- a pack's features (``pack_forms``): padded and CSR features of one batch size as one
  ``PackedCSR`` (one concatenation of the ids, one of the offsets, whatever the number of
  features; traced offsets, which may leave positions outside their bags: their bounds
  kept), the other forms as canonical bags per feature then packed
  per batch size;
- a ``KeyedJagged``'s features reordered into the packs' order (``reorder``), stacked ids'
  columns (``stacked_bags``), an unpooled lookup's ids (``flat_csr``).

Traced CSR offsets are made valid here whatever their values (clamped into ``[0, n]``,
non-decreasing: ``clamp_csr``); positions outside ``[offsets[0], offsets[B])`` are in no bag.
No array of the batch's size is built from host values (XLA would constant-fold it)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from flowtt_jax.inputs.validate import BagForm

__all__ = [
    "CanonicalBags",
    "FormGroup",
    "PackedCSR",
    "bag_of_positions",
    "canonical_bags",
    "clamp_csr",
    "compact",
    "concat_weights",
    "csr_bags",
    "flat_csr",
    "offsets_of",
    "pack_forms",
    "reorder",
    "saturate_int32",
    "stacked_bags",
]

_I32 = np.iinfo(np.int32)


class CanonicalBags(NamedTuple):
    ids: jax.Array  # [n] int, bag order
    weights: jax.Array  # [n] f32 effective weights (0 for dropped ids)
    offsets: jax.Array  # [B+1] int32, valid CSR over [0, n]
    bag_ids: jax.Array  # [n] int32 in [0, B)
    keep: jax.Array | None = None  # [n] bool, False where dropped (masked, in no bag); None: none
    bag_length: int | None = None  # padded form: bag b is positions [b*L, (b+1)*L); static L


class PackedCSR(NamedTuple):
    """Bags of F features over one flat array: ``ids [n]``, feature-major ``offsets [F*B + 1]``
    (concrete: a valid CSR over ``[0, n]``; traced: clamped by ``csr_bags``, positions
    outside ``[offsets[0], offsets[-1])`` in no bag), optional ``weights [n]`` and ``batch`` B;
    ``bounds`` (traced offsets; else None): int32 ``[F, B + 1]`` each feature's bags' bounds in
    ``ids``; a feature's last bag in ``offsets`` runs on to the next feature's first: its
    positions from ``bounds[f, B]`` on are in no bag."""

    ids: jax.Array
    offsets: jax.Array
    weights: jax.Array | None
    batch: int
    bounds: jax.Array | None = None


class FormGroup(NamedTuple):
    """A pack's features of one batch size as one feature-major batch: ``features`` (indices
    into the forms given), ``bags`` (``[F*B]`` bags, int32 ids), ``offsets`` and ``weights``:
    the packed CSR and user weights the ``flowtt_tb_bags`` kernel may take (None: canonical
    bags, the jax.numpy path), ``scaled``: the pooling modes already folded into the weights,
    ``weighted``: whether the user gave weights; ``bounds``: ``PackedCSR``'s."""

    features: tuple[int, ...]
    bags: CanonicalBags
    offsets: jax.Array | None
    weights: jax.Array | None
    batch: int
    scaled: bool
    weighted: bool
    bounds: jax.Array | None = None


def saturate_int32(ids: jax.Array) -> jax.Array:
    """int32 ids that keep out-of-range ids out of range: exact for ids of 32 bits or less
    (uint32 above 2^31 - 1 saturates), wider ids saturate to the int32 bounds."""
    dtype = np.dtype(ids.dtype)
    if dtype.itemsize < 4 or dtype == np.int32:
        return ids.astype(jnp.int32)
    hi = ids.dtype.type(_I32.max)
    if jnp.issubdtype(dtype, jnp.signedinteger):
        ids = jnp.maximum(ids, ids.dtype.type(_I32.min))
    return jnp.minimum(ids, hi).astype(jnp.int32)


def clamp_csr(offsets: jax.Array, n: jax.Array | int) -> jax.Array:
    """int32 offsets made a valid CSR whatever their values: clamped into ``[0, n]`` and made
    non-decreasing (a running maximum along the last axis; ``n`` broadcasts, e.g. one limit
    per row of stacked offsets)."""
    return jax.lax.cummax(jnp.clip(saturate_int32(jnp.asarray(offsets)), 0, n), axis=offsets.ndim - 1)


def bag_of_positions(offsets: jax.Array, n: int) -> jax.Array:
    """``[n]`` int32: for each position p, ``#{k : offsets[k] <= p} - 1`` (the bag of p for
    non-decreasing ``offsets``, as ``searchsorted(offsets, p, side="right") - 1``).

    A scatter-add of the offsets and one cumulative sum, O(n + len(offsets)): on the GPU
    ~10x less than a binary search of every position (13.4 M positions, 1 M bags).
    """
    marks = jnp.zeros((n + 1,), jnp.int32).at[jnp.clip(offsets, 0, n)].add(1)
    return jnp.cumsum(marks[:n], dtype=jnp.int32) - 1


def offsets_of(lengths: jax.Array) -> jax.Array:
    """CSR offsets ``[k + 1]`` int32 of ``k`` bag lengths."""
    return jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(lengths, dtype=jnp.int32)])


def concat_weights(weights: Sequence[jax.Array | None], sizes: Sequence[int]) -> jax.Array | None:
    """Per-feature weights (None: all 1) as one float ``[sum sizes]`` array (float32 at least);
    None when no feature has weights."""
    if all(w is None for w in weights):
        return None
    parts = [
        jnp.ones((m,), jnp.float32) if w is None else jnp.asarray(w).reshape(-1)
        for w, m in zip(weights, sizes)
    ]
    out = jnp.concatenate(parts)
    return out.astype(jnp.promote_types(out.dtype, jnp.float32))


def one_buffer(ids: jax.Array, weights: jax.Array | None) -> tuple[jax.Array, jax.Array | None]:
    """The features' concatenated ``ids`` (and ``weights``) as buffers of their own: an
    optimisation barrier keeps XLA from fusing a concatenation of F operands into its
    consumers, whose fused loop then selects among F operands per element (the compile grows
    with F: 20 s at 788 features on a CPU, 0.4 s as a buffer of its own)."""
    barrier = jax.lax.optimization_barrier  # one each: a joint one would give the ids a tangent
    return barrier(ids), (None if weights is None else barrier(weights))


def compact(ids: jax.Array, weights: jax.Array | None, starts: jax.Array, lengths: jax.Array):
    """Bags given by ``starts`` and ``lengths`` (int32, one per bag, positions of ``ids``) as
    one valid CSR: ``(ids [n], weights [n] | None, offsets [num_bags + 1], src [n])``, bag k
    being ``ids[starts[k] : starts[k] + lengths[k]]`` moved to ``offsets[k]`` by one gather
    (position j holds ``ids[src[j]]``). Positions past ``offsets[-1]`` (when the bags hold
    fewer than n ids) are in no bag."""
    n = ids.shape[0]
    offsets = offsets_of(lengths)
    if n == 0:
        return ids, weights, offsets, jnp.zeros((0,), jnp.int32)
    bag = jnp.clip(bag_of_positions(offsets, n), 0, max(lengths.shape[0] - 1, 0))
    pos = jax.lax.iota(jnp.int32, n)
    src = jnp.where(pos < offsets[-1], starts[bag] + pos - offsets[bag], pos)
    src = jnp.clip(src, 0, n - 1)
    return ids[src], None if weights is None else weights[src], offsets, src


def csr_bags(ids: jax.Array, offsets: jax.Array, weights: jax.Array | None) -> CanonicalBags:
    """CSR bags over flat ``ids [n]`` of any integer dtype (checked offsets, or traced ones:
    clamped, positions outside ``[offsets[0], offsets[-1])`` in no bag) as ``CanonicalBags``
    of int32 ids (``saturate_int32``), weights as given."""
    ids = saturate_int32(ids)
    n = ids.shape[0]
    offsets = clamp_csr(offsets, n)  # valid CSR whatever the input
    pos = jnp.arange(n, dtype=jnp.int32)
    keep = (pos >= offsets[0]) & (pos < offsets[-1])
    return _bags(ids, weights, offsets, keep, None, "sum")


def canonical_bags(form: BagForm, mode: str = "sum") -> CanonicalBags:
    """A checked bag form -> ``CanonicalBags`` (ids keep their dtype and values); ``mode``
    other than ``"sum"``: each weight times its bag's scale, from the bag's kept positions."""
    ids, w = form.ids, form.weights
    n = ids.size
    keep = None
    padded_length = None  # the padded form's L: bag b is positions [b*L, (b+1)*L)
    if form.form == "csr":
        offsets = clamp_csr(form.offsets, n)  # valid CSR whatever the input
        pos = jnp.arange(n, dtype=jnp.int32)
        keep = (pos >= offsets[0]) & (pos < offsets[-1])
    elif form.form == "segments":
        num_bags = form.batch
        segment_ids = saturate_int32(form.segment_ids)  # out-of-range segments stay out of range
        seg = jnp.where((segment_ids >= 0) & (segment_ids < num_bags), segment_ids, num_bags)
        w_in = jnp.ones((n,), jnp.float32) if w is None else w
        seg, ids, w = jax.lax.sort((seg, ids, w_in), num_keys=1, is_stable=True)
        offsets = jnp.searchsorted(
            seg, jnp.arange(num_bags + 1, dtype=jnp.int32), side="left", method="scan_unrolled"
        )
        offsets = offsets.astype(jnp.int32)
        keep = seg < num_bags
    else:
        b, length = ids.shape
        if form.mask is not None:
            keep = form.mask.reshape(-1).astype(bool)
        ids = ids.reshape(-1)
        w = None if w is None else w.reshape(-1)
        offsets = jnp.arange(b + 1, dtype=jnp.int32) * length
        padded_length = length
    return _bags(ids, w, offsets, keep, padded_length, mode)


def _bags(ids, w, offsets, keep, padded_length, mode: str) -> CanonicalBags:
    """Each position's bag and effective weight (``canonical_bags``' common part)."""
    n = ids.shape[0]
    num = offsets.shape[0] - 1
    if padded_length:  # no scatter, no scan: position p is in bag p // L
        bag_ids = jnp.arange(n, dtype=jnp.int32) // padded_length
    else:
        bag_ids = jnp.clip(bag_of_positions(offsets, n), 0, max(num - 1, 0)).astype(jnp.int32)
    eff = jnp.ones((n,), jnp.float32) if w is None else w
    if keep is not None:
        eff = jnp.where(keep, eff, 0.0)
    if mode == "mean" and num > 0 and padded_length and keep is None:
        # every bag is L long: one scale for all (sqrtn takes the general path: XLA folds a
        # constant rsqrt to a value 1 ulp from the run-time one)
        eff = eff * (1.0 / jnp.asarray(padded_length, eff.dtype))
    elif mode != "sum" and num > 0:  # no bags: nothing to scale (and no scale to gather)
        if keep is None:
            lengths = jnp.diff(offsets)
        else:
            lengths = jax.ops.segment_sum(keep.astype(jnp.int32), bag_ids, num_segments=num)
        lengths = jnp.maximum(lengths, 1).astype(eff.dtype)
        scale = 1.0 / lengths if mode == "mean" else jax.lax.rsqrt(lengths)
        eff = eff * scale[bag_ids]
    return CanonicalBags(ids, eff, offsets, bag_ids, keep, padded_length)


def pack_forms(forms: Sequence[BagForm], modes: Sequence[str]) -> list[FormGroup]:
    """A pack's features' checked forms (pooled by ``modes``) as one ``FormGroup`` (padded and
    CSR features of one batch size: ``pack_features``) or one per batch size (canonical bags
    per feature, the modes folded in, then packed: ``packed_canonical``)."""
    csr = pack_features(forms)
    if csr is not None:
        bags = csr_bags(csr.ids, csr.offsets, csr.weights)
        group = (bags, csr.offsets, csr.weights, csr.batch, False, csr.weights is not None, csr.bounds)
        return [FormGroup(tuple(range(len(forms))), *group)]
    groups: dict[int, list[int]] = {}
    for j, f in enumerate(forms):
        groups.setdefault(f.batch, []).append(j)
    out = []
    for batch, members in groups.items():
        bags = packed_canonical([canonical_bags(forms[j], modes[j]) for j in members])
        weighted = any(forms[j].weights is not None for j in members)
        out.append(FormGroup(tuple(members), bags, None, None, batch, True, weighted))
    return out


def pack_features(forms: Sequence[BagForm]) -> PackedCSR | None:
    """Padded (unmasked) and CSR forms of one batch size as one ``PackedCSR``, or None when a
    form needs its own preparation (``mask``, ``segment_ids``) or the batch sizes differ.
    A fixed number of ops whatever their count: one concatenation of the ids (and weights),
    one of the CSR offsets. Traced offsets (clamped into each feature's ids) may leave a
    feature's positions outside its bags: the bags stay where they are, their ``bounds`` kept
    (``oob.table_oob`` tells those positions by their bag: no work over the ids here)."""
    if any(f.form == "segments" or f.mask is not None for f in forms) or len({f.batch for f in forms}) != 1:
        return None
    batch = forms[0].batch
    sizes = [int(f.ids.size) for f in forms]
    n = sum(sizes)
    starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    ids = jnp.concatenate([saturate_int32(f.ids).reshape(-1) for f in forms])
    ids, weights = one_buffer(ids, concat_weights([f.weights for f in forms], sizes))
    csr = [j for j, f in enumerate(forms) if f.form == "csr"]
    padded = [j for j, f in enumerate(forms) if f.form == "padded"]
    traced = False
    parts = []  # [F_form, B + 1]: where each bag starts in the concatenated ids, and where it ends
    if csr:
        raw = [forms[j].offsets for j in csr]
        traced = any(isinstance(o, jax.core.Tracer) for o in raw)
        off = jnp.concatenate([saturate_int32(jnp.asarray(o)) for o in raw]).reshape(len(raw), batch + 1)
        if traced:  # canonical_bags' clamp, per feature
            off = clamp_csr(off, jnp.asarray([sizes[j] for j in csr], jnp.int32)[:, None])
        parts.append(off + jnp.asarray(starts[csr], jnp.int32)[:, None])
    if padded:  # bag b of a [B, L] feature starts at start + L * b: from an iota, not a host constant
        length = jnp.asarray([forms[j].ids.shape[1] for j in padded], jnp.int32)[:, None]
        parts.append(
            jnp.asarray(starts[padded], jnp.int32)[:, None] + length * jax.lax.iota(jnp.int32, batch + 1)
        )
    order = csr + padded
    bounds = jnp.concatenate(parts) if len(parts) > 1 else parts[0]
    if order != sorted(order):  # to the features' order
        bounds = bounds[np.argsort(order)]
    # the bags start where they are; a feature's last ends where the next feature's first starts
    offsets = jnp.concatenate([bounds[:, :-1].reshape(-1), jnp.full((1,), n, jnp.int32)])
    return PackedCSR(ids, offsets, weights, batch, bounds if traced else None)


def packed_canonical(bags: Sequence[CanonicalBags]) -> CanonicalBags:
    """Features' canonical bags (same batch B) as one feature-major CSR over their
    concatenated int32 ids (``[F*B]`` bags). Bag (f, b) starts where the feature's bag b
    starts; the positions of a feature outside its bags (weight 0, dropped) fall in a
    neighbouring bag."""
    batch = bags[0].offsets.shape[0] - 1
    sizes = [b.ids.shape[0] for b in bags]
    n = sum(sizes)
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
    return CanonicalBags(
        ids=jnp.concatenate([saturate_int32(b.ids) for b in bags]),
        weights=jnp.concatenate([b.weights for b in bags]),
        offsets=offsets,
        bag_ids=bag_ids,
        keep=keep,
    )


def reorder(csr: PackedCSR, source: Sequence[int]) -> tuple[PackedCSR, jax.Array]:
    """``csr``'s features in the order ``source`` (their indices in it) by one ``compact``
    gather: ``(PackedCSR, src [n])``, ``src`` each position's input position."""
    n, num = csr.ids.shape[0], len(source)
    offsets = clamp_csr(csr.offsets, n)
    starts = offsets[:-1].reshape(num, csr.batch)[np.asarray(source)].reshape(-1)
    lengths = jnp.diff(offsets).reshape(num, csr.batch)[np.asarray(source)].reshape(-1)
    ids, weights, new_offsets, src = compact(csr.ids, csr.weights, starts, lengths)
    return PackedCSR(ids, new_offsets, weights, csr.batch), src


def stacked_bags(ids: jax.Array, weights: jax.Array | None, cols: Sequence[int]) -> CanonicalBags:
    """Columns ``cols`` of checked stacked ``ids [B, F, L]`` (and weights) as ``[F_p*B]``
    padded bags, feature-major (a slice where the columns are consecutive, else one gather)."""
    sub = _columns(ids, cols)  # [F_p, B, L]
    num_features, batch, length = sub.shape
    n = num_features * batch * length
    offsets = jnp.arange(num_features * batch + 1, dtype=jnp.int32) * length
    bag_ids = jnp.arange(n, dtype=jnp.int32) // max(length, 1)
    wf = jnp.ones((n,), jnp.float32) if weights is None else _columns(weights, cols).reshape(-1)
    return CanonicalBags(saturate_int32(sub.reshape(-1)), wf, offsets, bag_ids, None, length)


def _columns(x: jax.Array, cols: Sequence[int]) -> jax.Array:
    """Columns ``cols`` of ``x [B, F, L]`` as ``[len(cols), B, L]``."""
    lo = cols[0]
    picked = (
        x[:, lo : lo + len(cols)] if list(cols) == list(range(lo, lo + len(cols))) else x[:, np.asarray(cols)]
    )
    return jnp.transpose(picked, (1, 0, 2))


def flat_csr(ids: Sequence[jax.Array], weights: Sequence[jax.Array | None]) -> PackedCSR:
    """An unpooled lookup's ids (any shapes, one array a feature) and weights as one flat
    ``PackedCSR`` of one bag per feature (``batch`` 1)."""
    sizes = [int(i.size) for i in ids]
    flat = jnp.concatenate([saturate_int32(i).reshape(-1) for i in ids])
    flat, flat_weights = one_buffer(flat, concat_weights(weights, sizes))
    offsets = jnp.asarray(np.concatenate([[0], np.cumsum(sizes)]), jnp.int32)
    return PackedCSR(flat, offsets, flat_weights, 1)
