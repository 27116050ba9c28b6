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
    after the call. ``jit``: compile ``fn`` with ``jax.jit(**jit_kwargs)``.

    Arguments may be arrays, pytrees and Flax NNX modules (e.g. a model and its optimizer):
    modules are split into their graph and state before the trace and merged inside it, so
    ``fn`` may use ``nnx.grad`` / ``nnx.value_and_grad`` and update them in place (an
    optimizer step, the collections' counters), which is written back after the call; with
    modules the function is always traced by ``jit`` (``jit=False`` keeps the outer call
    eager) and ``jit_kwargs`` are not taken (they would name positions of the split call)."""
    plain = checkify.checkify(fn, errors=checkify.user_checks)
    if jit:
        plain = jax.jit(plain, **jit_kwargs)
    split_call = _SplitCall(fn, jit)

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        if _has_graph_nodes((args, kwargs)):
            if jit_kwargs:
                raise ValueError(
                    f"ftt.checked: jit options {sorted(jit_kwargs)} with Flax NNX module arguments are not "
                    "supported (the call is traced over the modules' split state); pass none"
                )
            return split_call(args, kwargs)
        error, out = plain(*args, **kwargs)
        error.throw()
        return out

    return run


def _has_graph_nodes(tree: Any) -> bool:
    """Whether ``tree`` holds a Flax NNX graph node (a module, a variable); False without Flax."""
    try:
        import flax.nnx  # noqa: F401
    except ImportError:
        return False
    return any(_is_node(x) for x in jax.tree.leaves(tree, is_leaf=_is_node))


class _SplitCall:
    """``fn(*args, **kwargs)`` under ``checkify`` (and ``jit``) with the NNX graph nodes among
    its arguments split into graph and state (the graph, the arguments' tree and the nodes'
    places are static: one compiled program per structure); the other leaves pass as they
    are, and only the nodes take the updates back."""

    def __init__(self, fn: Callable[..., Any], jit: bool) -> None:
        def pure(static: Any, state: Any, others: list) -> Any:
            from flax import nnx

            graphdef, treedef, is_node = static
            nodes = iter(nnx.merge(graphdef, state))
            rest = iter(others)
            args, kwargs = jax.tree.unflatten(treedef, [next(nodes) if n else next(rest) for n in is_node])
            out = fn(*args, **kwargs)
            return out, nnx.state(
                tuple(x for x, n in zip(jax.tree.leaves((args, kwargs), is_leaf=_is_node), is_node) if n)
            )

        # checkify of a jitted function: jit traces ``pure`` (NNX transforms inside, e.g.
        # nnx.grad, refuse checkify's own trace: "graph node from different trace level") and
        # checkify carries the checks out of its jaxpr
        functional = checkify.checkify(jax.jit(pure, static_argnums=0), errors=checkify.user_checks)
        self._call = jax.jit(functional, static_argnums=0) if jit else functional

    def __call__(self, args: tuple, kwargs: dict) -> Any:
        from flax import nnx

        leaves, treedef = jax.tree.flatten((args, kwargs), is_leaf=_is_node)
        is_node = tuple(_is_node(x) for x in leaves)
        nodes = tuple(x for x, n in zip(leaves, is_node) if n)
        graphdef, state = nnx.split(nodes)
        others = [x for x, n in zip(leaves, is_node) if not n]
        error, (out, new_state) = self._call((graphdef, treedef, is_node), state, others)
        error.throw()
        nnx.update(nodes, new_state)  # in-place updates (optimizer steps, counters)
        return out


def _is_node(x: Any) -> bool:
    from flax import nnx

    return nnx.graph.is_graph_node(x)
