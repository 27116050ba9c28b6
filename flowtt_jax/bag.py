"""Bag inputs in three forms, brought to one canonical CSR form.

Forms accepted by ``tt_embedding_bag``:
- ``offsets``: ids [n] with offsets [B+1] (CSR: bag b is ids[offsets[b]:offsets[b+1]],
  non-decreasing, offsets[0] = 0, offsets[B] = n). Positions outside
  ``[offsets[0], offsets[B])`` belong to no bag.
- ``segment_ids`` + ``num_bags``: ids [n] with a bag index per id (any order); ids
  whose segment is outside ``[0, num_bags)`` are dropped.
- padded: ids [B, L] with an optional bool ``mask`` [B, L] (masked-out ids are dropped).

Canonical form: ids [n] in bag order, offsets [B+1] valid CSR, bag_ids [n], and an
effective per-id weight [n] that folds in the user weights, dropped ids and the
mode's 1/len or 1/sqrt(len) scale, so kernels compute plain weighted sums.

``prepare_bags`` is what every bag op (``tt_embedding_bag``, the dense bag of
``flowtt_jax.collection`` and so the layers over them) runs first: the canonical form,
then the out-of-range policy (``flowtt_jax.oob``) on its ids and weights.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from .oob import apply_oob

__all__ = ["MODES", "CanonicalBags", "canonical_bags", "prepare_bags"]

MODES = ("sum", "mean", "sqrtn")


class CanonicalBags(NamedTuple):
    ids: jax.Array  # [n] int, bag order
    weights: jax.Array  # [n] f32 effective weights (0 for dropped ids)
    offsets: jax.Array  # [B+1] int32, valid CSR over [0, n]
    bag_ids: jax.Array  # [n] int32 in [0, B)


def _check_concrete_offsets(offsets: jax.Array, n: int) -> None:
    if isinstance(offsets, jax.core.Tracer):
        return
    o = np.asarray(offsets)
    if o.size and (o[0] != 0 or o[-1] != n or np.any(np.diff(o) < 0)):
        raise ValueError(
            f"offsets must be non-decreasing with offsets[0] == 0 and offsets[-1] == len(ids) "
            f"== {n}; got first {o[:1].tolist()}, last {o[-1:].tolist()}"
        )


def canonical_bags(
    ids: jax.Array,
    *,
    offsets: jax.Array | None,
    segment_ids: jax.Array | None,
    num_bags: int | None,
    mask: jax.Array | None,
    weights: jax.Array | None,
    mode: str,
) -> CanonicalBags:
    """Any of the three bag forms -> ``CanonicalBags`` (ids keep their dtype and values)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if offsets is not None and segment_ids is not None:
        raise ValueError("give either offsets or segment_ids, not both")
    ids = jnp.asarray(ids)
    w = None
    if weights is not None:
        w = jnp.asarray(weights)
        w = w.astype(jnp.promote_types(w.dtype, jnp.float32))  # keeps float64 under x64
    if w is not None and w.shape != ids.shape:
        raise ValueError(f"weights shape {w.shape} != ids shape {ids.shape}")

    if offsets is not None or segment_ids is not None:
        if ids.ndim != 1:
            raise ValueError(f"with offsets / segment_ids, ids must be 1-D, got shape {ids.shape}")
        if mask is not None:
            raise ValueError("mask is for padded [B, L] ids only")
    n = ids.size
    keep = None
    if offsets is not None:
        offsets = jnp.asarray(offsets)
        if offsets.ndim != 1 or offsets.shape[0] < 1:
            raise ValueError(f"offsets must be 1-D of length num_bags + 1, got {offsets.shape}")
        _check_concrete_offsets(offsets, n)
        # Valid CSR whatever the input: clamp to [0, n] and make non-decreasing.
        offsets = jax.lax.cummax(jnp.clip(offsets.astype(jnp.int32), 0, n))
        pos = jnp.arange(n, dtype=jnp.int32)
        keep = (pos >= offsets[0]) & (pos < offsets[-1])
    elif segment_ids is not None:
        if num_bags is None:
            raise ValueError("segment_ids needs num_bags (a static int)")
        segment_ids = jnp.asarray(segment_ids)
        if segment_ids.shape != ids.shape:
            raise ValueError(f"segment_ids shape {segment_ids.shape} != ids shape {ids.shape}")
        seg = jnp.where((segment_ids >= 0) & (segment_ids < num_bags), segment_ids, num_bags)
        seg = seg.astype(jnp.int32)
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

    num = offsets.shape[0] - 1
    pos = jnp.arange(n, dtype=jnp.int32)
    # scan_unrolled: no while loop (on GPU a while loop copies its carry and waits on the host)
    bag = jnp.searchsorted(offsets, pos, side="right", method="scan_unrolled") - 1
    bag_ids = jnp.clip(bag, 0, max(num - 1, 0))
    bag_ids = bag_ids.astype(jnp.int32)
    eff = jnp.ones((n,), jnp.float32) if w is None else w
    if keep is not None:
        eff = jnp.where(keep, eff, 0.0)
    if mode != "sum":
        if keep is None:
            lengths = jnp.diff(offsets)
        else:
            lengths = jax.ops.segment_sum(keep.astype(jnp.int32), bag_ids, num_segments=num)
        lengths = jnp.maximum(lengths, 1).astype(eff.dtype)
        scale = 1.0 / lengths if mode == "mean" else jax.lax.rsqrt(lengths)
        eff = eff * scale[bag_ids]
    return CanonicalBags(ids, eff, offsets, bag_ids)


def prepare_bags(
    ids: jax.Array,
    *,
    num_embeddings: int,
    oob: str,
    offsets: jax.Array | None,
    segment_ids: jax.Array | None,
    num_bags: int | None,
    mask: jax.Array | None,
    weights: jax.Array | None,
    mode: str,
) -> CanonicalBags:
    """``canonical_bags``, then the ``oob`` policy for a table of ``num_embeddings`` rows.

    Returns ``CanonicalBags`` whose ids are int32 in ``[0, num_embeddings)`` and whose
    weights are 0 for the ids ``oob="zero"`` drops (they still count towards a bag's
    length for ``mean`` / ``sqrtn``).
    """
    bags = canonical_bags(
        ids,
        offsets=offsets,
        segment_ids=segment_ids,
        num_bags=num_bags,
        mask=mask,
        weights=weights,
        mode=mode,
    )
    flat, valid = apply_oob(bags.ids, num_embeddings, oob)
    w = bags.weights if valid is None else jnp.where(valid, bags.weights, 0.0)
    return bags._replace(ids=flat, weights=w)
