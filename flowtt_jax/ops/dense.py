"""The dense-table twins of the TT ops: ``tt_embedding_bag`` / ``tt_lookup`` semantics
(bag forms, modes, out-of-range policy, float32 accumulation) over a plain ``[N, D]`` table."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from flowtt_jax.inputs.oob import apply_oob, prepare_bags
from flowtt_jax.inputs.validate import as_ids
from flowtt_jax.tt import reference

__all__ = ["dense_embedding_bag", "dense_lookup"]


def dense_embedding_bag(
    table: jax.Array,
    ids: jax.Array,
    *,
    offsets: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
    num_bags: int | None = None,
    mask: jax.Array | None = None,
    weights: jax.Array | None = None,
    mode: str = "sum",
    oob: str = "zero",
    dtype: jnp.dtype | None = None,
) -> jax.Array:
    """``tt_embedding_bag``'s semantics over a dense ``[N, D]`` table (fp32 accumulation).

    Output in ``dtype`` (default: the table's dtype).
    """
    form = dict(offsets=offsets, segment_ids=segment_ids, num_bags=num_bags, mask=mask, weights=weights)
    bags = prepare_bags(ids, num_embeddings=table.shape[0], oob=oob, mode=mode, **form)
    num = bags.offsets.shape[0] - 1
    rows = jnp.take(table, bags.ids, axis=0)
    rows = rows.astype(jnp.promote_types(rows.dtype, jnp.float32))
    out = reference.pool(rows, bags.weights, bags.bag_ids, num)  # a weight of 0 adds nothing
    return out.astype(table.dtype if dtype is None else dtype)


def dense_lookup(table: jax.Array, ids: jax.Array, *, oob: str = "zero") -> jax.Array:
    """Rows of a dense table with the library's out-of-range policy: ``[..., D]``."""
    ids = as_ids(ids, oob)
    flat, valid = apply_oob(ids.reshape(-1), table.shape[0], oob)
    rows = jnp.take(table, flat, axis=0)
    if valid is not None:
        rows = jnp.where(valid[:, None], rows, jnp.zeros((), rows.dtype))
    return rows.reshape(*ids.shape, table.shape[1])
