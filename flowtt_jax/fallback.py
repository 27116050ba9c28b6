"""One warning per process and reason when ``impl="auto"`` runs the pure-JAX reference.

The reference is correct but much slower than the kernels (27x on CPU for a Meta-like
table), so a user who expected the kernels should hear why they did not run: the
extension is not built, the cores' dtype or core count, a shape past the CUDA kernels'
limits. Filter ``ReferenceFallbackWarning`` to silence it (``impl="reference"`` never warns).
"""

from __future__ import annotations

import warnings

__all__ = ["ReferenceFallbackWarning", "warn_reference"]

_SEEN: set[str] = set()


class ReferenceFallbackWarning(UserWarning):
    """``impl="auto"`` ran the pure-JAX reference instead of the compiled kernels."""


def warn_reference(reason: str, what: str) -> None:
    """Warns once per process and ``reason`` that ``what`` (e.g. ``"tt_embedding_bag"``) runs
    the reference."""
    if reason in _SEEN:
        return
    _SEEN.add(reason)
    warnings.warn(
        f"{what}: impl='auto' runs the pure-JAX reference (much slower than the kernels): {reason}. "
        "Pass impl='reference' to choose it, or filter flowtt_jax.fallback.ReferenceFallbackWarning.",
        ReferenceFallbackWarning,
        stacklevel=3,
    )
