"""Bag inputs in three forms, brought to one canonical CSR form.

Forms accepted by ``tt_embedding_bag``:
- ``offsets``: ids [n] with offsets [B+1] (CSR: bag b is ids[offsets[b]:offsets[b+1]],
  non-decreasing, offsets[0] = 0, offsets[B] = n). Concrete offsets that break this
  raise ``ValueError``. Traced offsets (under ``jit``) cannot be checked on the host:
  by default they are clamped into ``[0, n]`` and made non-decreasing (a running
  maximum), and positions outside ``[offsets[0], offsets[B])`` belong to no bag; with
  ``check_offsets`` (the ops pass ``oob == "error"``) a ``checkify.check`` reports them
  instead (wrap the jitted function in ``checkify.checkify``).
- ``segment_ids`` + ``num_bags`` (a static int >= 0): ids [n] with a bag index per id
  (any order); ids whose segment is outside ``[0, num_bags)`` are dropped.
- padded: ids [B, L] with an optional bool ``mask`` [B, L] (masked-out ids are dropped).

Canonical form: ids [n] in bag order, offsets [B+1] valid CSR, bag_ids [n], and an
effective per-id weight [n] that folds in the user weights, dropped ids and the
mode's 1/len or 1/sqrt(len) scale, so kernels compute plain weighted sums.

``prepare_bags`` is what every bag op (``tt_embedding_bag``, the dense bag of
``flowtt_jax.collection`` and so the layers over them) runs first: the canonical form,
then the out-of-range policy (``flowtt_jax.inputs.oob``) on its ids and weights. ``packed_bags``
gives the same for a packed feature-major CSR batch of several tables' features, in one
``flowtt_tb_bags`` call on the kernel path (also ``tt_embedding_bag``'s CSR form there).
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from flowtt_jax.inputs.csr import (
    MODES,
    as_weights,
    bag_of_positions,
    check_csr,
    check_sizes,
    clamp_csr,
)
from flowtt_jax.inputs.oob import apply_oob, apply_table_oob, as_ids, park_dropped, saturate_int32
from flowtt_jax.kernels import ffi

__all__ = [
    "CanonicalBags",
    "apply_bags_oob",
    "canonical_bags",
    "packed_bags",
    "prepare_bags",
]


class CanonicalBags(NamedTuple):
    ids: jax.Array  # [n] int, bag order
    weights: jax.Array  # [n] f32 effective weights (0 for dropped ids)
    offsets: jax.Array  # [B+1] int32, valid CSR over [0, n]
    bag_ids: jax.Array  # [n] int32 in [0, B)
    keep: jax.Array | None = None  # [n] bool, False where dropped (masked, in no bag); None: none
    bag_length: int | None = None  # padded form: bag b is positions [b*L, (b+1)*L); static L


def canonical_bags(
    ids: jax.Array,
    *,
    offsets: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
    num_bags: int | None = None,
    mask: jax.Array | None = None,
    weights: jax.Array | None = None,
    mode: str,
    check_offsets: bool = False,
    whole: bool = True,
) -> CanonicalBags:
    """Any of the three bag forms -> ``CanonicalBags`` (ids keep their dtype and values).

    ``check_offsets``: traced ``offsets`` get a ``checkify.check`` instead of the clamp.
    ``whole=False``: ``offsets`` are a slice of a CSR its caller checked (bags of some
    features of a packed batch): no check, positions outside them in no bag.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if offsets is not None and segment_ids is not None:
        raise ValueError("give either offsets or segment_ids, not both")
    ids = jnp.asarray(ids)
    w = None
    if weights is not None:
        w = as_weights(weights)  # keeps float64 under x64
    if w is not None and w.shape != ids.shape:
        raise ValueError(f"weights shape {w.shape} != ids shape {ids.shape}")

    if offsets is not None or segment_ids is not None:
        if ids.ndim != 1:
            raise ValueError(f"with offsets / segment_ids, ids must be 1-D, got shape {ids.shape}")
        if mask is not None:
            raise ValueError("mask is for padded [B, L] ids only")
    n = ids.size
    check_sizes(n, 0)
    keep = None
    padded_length = None  # the padded form's L: bag b is positions [b*L, (b+1)*L)
    if offsets is not None:
        if not isinstance(offsets, jax.Array):
            offsets = np.asarray(offsets)  # checked before jnp.asarray could wrap int64 values
        if offsets.ndim != 1 or offsets.shape[0] < 1:
            raise ValueError(f"offsets must be 1-D of length num_bags + 1, got {offsets.shape}")
        if not jnp.issubdtype(offsets.dtype, jnp.integer):
            raise TypeError(f"offsets must be an integer array, got dtype {offsets.dtype}")
        if whole:
            check_csr(offsets, n, check_offsets)
        offsets = clamp_csr(offsets, n)  # valid CSR whatever the input
        pos = jnp.arange(n, dtype=jnp.int32)
        keep = (pos >= offsets[0]) & (pos < offsets[-1])
    elif segment_ids is not None:
        if num_bags is None:
            raise ValueError("segment_ids needs num_bags (a static int)")
        try:
            num_bags = operator.index(num_bags)
        except TypeError:
            raise TypeError(f"num_bags must be a static int, got {num_bags!r}") from None
        if num_bags < 0:
            raise ValueError(f"num_bags must be >= 0, got {num_bags}")
        # any int dtype, no wrap-around: out-of-range segments stay out of range
        segment_ids = saturate_int32(as_ids(segment_ids, "zero", "segment_ids"))
        if segment_ids.shape != ids.shape:
            raise ValueError(f"segment_ids shape {segment_ids.shape} != ids shape {ids.shape}")
        seg = jnp.where((segment_ids >= 0) & (segment_ids < num_bags), segment_ids, num_bags)
        w_in = jnp.ones((n,), jnp.float32) if w is None else w
        seg, ids, w = jax.lax.sort((seg, ids, w_in), num_keys=1, is_stable=True)
        offsets = jnp.searchsorted(
            seg, jnp.arange(num_bags + 1, dtype=jnp.int32), side="left", method="scan_unrolled"
        )
        offsets = offsets.astype(jnp.int32)
        keep = seg < num_bags
    else:
        if ids.ndim != 2:
            raise ValueError(
                f"without offsets or segment_ids, ids must be padded [B, L], got shape {ids.shape}"
            )
        b, length = ids.shape
        if mask is not None:
            mask = jnp.asarray(mask)
            if mask.shape != ids.shape:
                raise ValueError(f"mask shape {mask.shape} != ids shape {ids.shape}")
            keep = mask.reshape(-1).astype(bool)
        ids = ids.reshape(-1)
        w = None if w is None else w.reshape(-1)
        offsets = jnp.arange(b + 1, dtype=jnp.int32) * length
        padded_length = length

    num = offsets.shape[0] - 1
    check_sizes(n, num)
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


def prepare_bags(ids: jax.Array, *, num_embeddings: int, oob: str, **form: Any) -> CanonicalBags:
    """``canonical_bags(ids, **form)`` (``form``: its bag form keywords, ``weights`` and
    ``mode``), then the ``oob`` policy for a table of ``num_embeddings`` rows
    (``apply_bags_oob``). ``oob="error"`` also checks traced offsets."""
    bags = canonical_bags(as_ids(ids, oob), **form, check_offsets=oob == "error")
    return apply_bags_oob(bags, *apply_oob(bags.ids, num_embeddings, oob))


def apply_bags_oob(
    bags: CanonicalBags, ids: jax.Array, valid: jax.Array | None, *others: jax.Array
) -> CanonicalBags | tuple:
    """``bags`` after the ``oob`` policy gave ``(ids, valid)`` for their ids (``apply_oob``,
    or ``apply_table_oob`` for positions of several tables).

    Returns ``CanonicalBags`` whose ids are those int32 ids and whose weights are 0 for the
    ids ``oob="zero"`` drops (they still count towards a bag's length for ``mean`` /
    ``sqrtn``); ``keep`` is False at every dropped position (masked, in no bag, out of
    range under ``"zero"``), whose id is parked on a kept one (``park_dropped``; ``others``,
    e.g. the positions' tables, move with it and come back after the bags).
    """
    w = bags.weights if valid is None else jnp.where(valid, bags.weights, 0.0)
    live = bags.keep if valid is None else (valid if bags.keep is None else valid & bags.keep)
    parked = park_dropped(ids, live, *others)
    if not others:
        return bags._replace(ids=parked, weights=w, keep=live)
    return (bags._replace(ids=parked[0], weights=w, keep=live), *parked[1:])


def packed_bags(
    ids: jax.Array,
    offsets: jax.Array,
    weights: jax.Array | None,
    feature_tables: Sequence[int],
    num_rows: jax.Array,
    oob: str,
    *,
    kernel: bool,
    whole: bool = True,
    table_names: tuple[str, ...] | None = None,
    feature_names: tuple[str, ...] | None = None,
) -> tuple[CanonicalBags, jax.Array]:
    """A packed feature-major batch (ids [n], n >= 1, offsets [F*B + 1], optional weights)
    as ``(CanonicalBags, tables [n] int32)``: each position's bag and its feature's table,
    the ``oob`` policy against that table's ``num_rows``, weights 0 and ids parked where a
    position is dropped (``apply_bags_oob``). ``kernel``: one ``flowtt_tb_bags`` call for
    ``"clip"`` / ``"zero"`` (the valid CSR too; ``"error"`` takes the jax.numpy path, for its
    checks), the same values as the jax.numpy path, its oracle. ``whole=False``: ``offsets``
    are a slice of a checked CSR over ``ids`` (``canonical_bags``); ``table_names`` and
    ``feature_names`` name the table, feature and example in ``"error"``'s messages, which
    checks the positions in these bags only (not another pack's, nor a padded tail)."""
    batch = (np.shape(offsets)[0] - 1) // len(feature_tables)
    check = oob == "error"
    bags = canonical_bags(ids, offsets=offsets, weights=weights, mode="sum", check_offsets=check, whole=whole)
    if kernel and oob != "error":
        raw = saturate_int32(jnp.asarray(offsets))  # concrete ones passed canonical_bags' check
        flat, tables, live, bag_ids, csr = ffi.tb_bags(
            saturate_int32(bags.ids), raw, feature_tables, num_rows, batch, oob == "clip"
        )
        # live positions are kept ones: the user weights where live (canonical_bags' own
        # weights would keep XLA's running maximum of the offsets alive)
        w = live
        if weights is not None:
            w = jnp.where(live != 0, jnp.asarray(weights).astype(bags.weights.dtype), 0.0)
        return bags._replace(ids=flat, weights=w, offsets=csr, bag_ids=bag_ids, keep=live != 0), tables
    tables = jnp.asarray(feature_tables, jnp.int32)[bags.bag_ids // batch]
    where = None if feature_names is None else (bags.bag_ids, batch, tuple(feature_names))
    flat, valid = apply_table_oob(bags.ids, tables, num_rows, oob, table_names, live=bags.keep, where=where)
    return apply_bags_oob(bags, flat, valid, tables)  # dropped positions add no rows
