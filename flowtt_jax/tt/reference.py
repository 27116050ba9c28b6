"""Pure ``jax.numpy`` reference: the test oracle and the "TT from XLA ops" baseline.

Works for any number of cores. It gathers every id's cores (memory grows with
nnz x r^2): correct and simple, not fast.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

__all__ = ["contract", "tt_digits", "tt_rows", "pool", "weighted_rows"]


def tt_digits(ids: jax.Array, row_shape: Sequence[int]) -> list[jax.Array]:
    """Mixed-radix digits (i_1, ..., i_d) of ids, i_1 most significant."""
    digits = []
    rem = ids
    for p in reversed(row_shape):
        digits.append(rem % p)
        rem = rem // p
    return digits[::-1]


def contract(core_rows: Sequence[jax.Array]) -> jax.Array:
    """Rows [n, D] from each position's core slices: ``core_rows[k]`` is
    ``[n, r_{k-1}, q_k, r_k]`` (``r_0 = r_d = 1``), contracted left to right at full
    precision (``HIGHEST``: a GPU's default float32 matmul runs in TF32, ~5e-4 relative
    error, where the kernels give ~1e-7; the reference is never less accurate than them)."""
    acc = core_rows[0][:, 0]  # [n, q1, r1]
    for g in core_rows[1:]:
        acc = jnp.einsum("nQr,nrqs->nQqs", acc, g, precision=jax.lax.Precision.HIGHEST)
        acc = acc.reshape(acc.shape[0], -1, acc.shape[-1])
    return acc[..., 0]


def tt_rows(cores: Sequence[jax.Array], ids: jax.Array) -> jax.Array:
    """Rows of the TT table for int ids [n] (in range): [n, D] in the cores' dtype."""
    digits = tt_digits(ids, [c.shape[0] for c in cores])
    return contract([core[i] for core, i in zip(cores, digits)])


@jax.custom_jvp
def weighted_rows(rows: jax.Array, weights: jax.Array) -> jax.Array:
    """``rows [n, D] * weights [n, None]``, exactly 0 where a weight is 0 (never
    ``0 * inf = NaN``): the kernels' "a zero weight skips its position".

    Differentiated as the product ``rows * weights``: the tangent in a weight is the row
    even where the weight is 0 (the kernels' d_weights), the tangent in a row is its
    weight (so 0 there).
    """
    return jnp.where((weights != 0)[:, None], rows * weights[:, None], jnp.zeros((), rows.dtype))


@weighted_rows.defjvp
def _weighted_rows_jvp(primals, tangents):
    rows, weights = primals
    d_rows, d_weights = tangents
    return weighted_rows(rows, weights), weighted_rows(d_rows, weights) + rows * d_weights[:, None]


def pool(rows: jax.Array, weights: jax.Array, bag_ids: jax.Array, num_bags: int) -> jax.Array:
    """Weighted sum of rows [n, D] into bags: [num_bags, D]; positions of weight 0 add
    nothing (``weighted_rows``)."""
    return jax.ops.segment_sum(weighted_rows(rows, weights), bag_ids, num_segments=num_bags)
