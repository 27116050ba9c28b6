"""``checked``: the library's run-time checks (``oob="error"``) raised from jitted code.

Under ``jit`` (and ``nnx.jit``) ids and offsets are traced, so ``oob="error"`` cannot raise
while tracing; it adds a ``jax.experimental.checkify`` check instead, and a jitted function
holding one must be functionalised by ``checkify.checkify`` or jax refuses it ("checkify.check
which was not functionalized"). ``checked(fn)`` does that and raises the first failed check
on the host::

    step = ftt.checked(lambda model, batch: model(batch))   # jitted; ValueError on a bad id
    out = step(collection, features)
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
from jax.experimental import checkify

__all__ = ["checked"]


def checked(fn: Callable[..., Any], *, jit: bool = True, **jit_kwargs: Any) -> Callable[..., Any]:
    """``fn`` whose ``checkify`` checks (``oob="error"``: ids out of range of their table,
    traced offsets that are not a CSR) raise ``checkify.JaxRuntimeError`` (a ``ValueError``)
    after the call. ``jit``: compile ``fn`` with ``jax.jit(**jit_kwargs)`` (arguments may be
    arrays, pytrees and nnx modules; in-place module updates are not written back, so use it
    for forward calls, or take gradients inside ``fn``)."""
    functional = checkify.checkify(fn, errors=checkify.user_checks)
    if jit:
        functional = jax.jit(functional, **jit_kwargs)

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        error, out = functional(*args, **kwargs)
        error.throw()
        return out

    return run
