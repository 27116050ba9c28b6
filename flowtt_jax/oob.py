"""Out-of-range id policy: ``"error" | "clip" | "zero"``.

- ``"error"``: concrete ids raise ``ValueError``; traced ids add a
  ``checkify.check`` (wrap the jitted function in ``checkify.checkify``).
- ``"clip"``: ids are clamped into ``[0, N)``.
- ``"zero"`` (default): an out-of-range id contributes a zero row (its weight is 0);
  it still counts towards a bag's length for ``mean`` / ``sqrtn``.

Whatever the policy, ids handed to kernels are in ``[0, N)``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify

__all__ = ["OOB_POLICIES", "apply_oob"]

OOB_POLICIES = ("error", "clip", "zero")


def apply_oob(ids: jax.Array, num_embeddings: int, policy: str) -> tuple[jax.Array, jax.Array | None]:
    """Returns ``(int32 ids in [0, N), valid)``; ``valid`` is a bool mask for "zero", else None."""
    if policy not in OOB_POLICIES:
        raise ValueError(f"oob must be one of {OOB_POLICIES}, got {policy!r}")
    if not jnp.issubdtype(ids.dtype, jnp.integer):
        raise TypeError(f"ids must be an integer array, got dtype {ids.dtype}")
    valid = (ids >= 0) & (ids < num_embeddings)
    if policy == "error":
        if isinstance(ids, jax.core.Tracer):
            checkify.check(
                jnp.all(valid),
                f"ids out of range [0, {num_embeddings}): found {{bad}}",
                bad=ids.reshape(-1)[jnp.argmin(valid.reshape(-1))] if ids.size else 0,
            )
        else:
            bad = np.asarray(ids)[~np.asarray(valid)]
            if bad.size:
                raise ValueError(
                    f"{bad.size} id(s) out of range [0, {num_embeddings}), e.g. {bad[:5].tolist()}"
                )
    clipped = jnp.clip(ids, 0, num_embeddings - 1).astype(jnp.int32)
    if policy == "zero":
        return jnp.where(valid, clipped, 0), valid
    return clipped, None
