"""Stage 4 of the input pipeline, **pack**: the bags' effective weights for the pooling
(each bag's mode folded in, ``scale_by_modes``) or, unpooled, each id its own bag
(``unpooled``). ``collection.batch`` wraps the result with its pack's features as a
``PackBatch``; the ops pool it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp

from flowtt_jax.inputs.validate import MODES

__all__ = ["scale_by_modes", "unpooled"]


def scale_by_modes(
    weights: jax.Array,
    offsets: jax.Array,
    bag_ids: jax.Array,
    modes: Sequence[str],
    batch: int,
    lengths: jax.Array | None = None,
) -> jax.Array:
    """Per-position ``weights`` times their bag's pooling scale: ``1/len`` (``"mean"``) or
    ``1/sqrt(len)`` (``"sqrtn"``), bag b of the feature-major CSR ``offsets`` (of ``lengths``
    ids, when given: ``diff(offsets)`` otherwise) pooled by ``modes[b // batch]``; ``weights``
    as they are when every mode is ``"sum"``."""
    if all(m == "sum" for m in modes):
        return weights
    lengths = jnp.maximum(jnp.diff(offsets) if lengths is None else lengths, 1).astype(weights.dtype)
    if len(set(modes)) == 1:  # one mode: no [num_bags] constant of modes in the program
        scale = 1.0 / lengths if modes[0] == "mean" else jax.lax.rsqrt(lengths)
        return weights * scale[bag_ids]
    # each bag's mode from an iota (a host [F*B] array would be a constant XLA may fold)
    bags = jax.lax.iota(jnp.int32, lengths.shape[0]) // max(batch, 1)
    per_bag = jnp.asarray([MODES.index(m) for m in modes], jnp.int32)[jnp.minimum(bags, len(modes) - 1)]
    scale = jnp.where(per_bag == 1, 1.0 / lengths, jnp.where(per_bag == 2, jax.lax.rsqrt(lengths), 1.0))
    return weights * scale[bag_ids]


def unpooled(bags: NamedTuple) -> NamedTuple:
    """``bags`` (``normalise.CanonicalBags`` after the policy) with each position its own bag:
    the pooling call's plan and kernels then give each id's row."""
    n = bags.ids.shape[0]
    pos = jax.lax.iota(jnp.int32, n)
    return bags._replace(offsets=jax.lax.iota(jnp.int32, n + 1), bag_ids=pos, bag_length=1)
