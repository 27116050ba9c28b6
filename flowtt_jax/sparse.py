"""Sparse updates for dense tables (FBGEMM's fused row-wise optimizers, TorchRec's sparse
ones), in a Flax NNX training step.

A dense table with ``TableConfig(..., kind="dense", sparse=SparseUpdate(rule, ...))`` is
stored as a ``SparseTable`` variable, not an ``nnx.Param``: ``nnx.grad`` and optax never
build or update its ``[N, D]`` gradient. ``sparse_value_and_grad(loss_fn)`` is
``nnx.value_and_grad``'s twin that also returns the sparse tables' gradients as (touched
rows, row gradients); ``apply_sparse(model, sparse)`` updates those rows only, on the
device, with the table's rule (SGD, Adagrad, row-wise Adagrad, lazy Adam)::

    step_grad = ftt.sparse.sparse_value_and_grad(loss_fn)

    @nnx.jit(donate_argnums=(0, 1))  # donated: the sparse rows are written in place
    def train_step(model, opt, batch):
        loss, grads, sparse = step_grad(model, batch)
        opt.update(model, grads)                    # optax for everything else
        ftt.sparse.apply_sparse(model, sparse)      # touched rows of the sparse tables
        return loss

A step's cost then grows with the ids a batch holds, not with a sparse table's rows
(``docs/sparse.md``). The gradient is traced twice (the first, abstract trace finds the
tapes' shapes; ``collection.sparse_rows``); a sharded collection is not supported.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from flowtt_jax.collection.sparse_rows import sparse_tapes, sparse_update
from flowtt_jax.nnx import TTEmbeddingCollection

__all__ = ["SparseGrads", "apply_sparse", "sparse_value_and_grad"]


class SparseGrads(NamedTuple):
    """The sparse tables' gradients of a step: ``{parameter name: [rows of each call]}``
    (int32 ``[n]`` row indices) and ``{parameter name: [their gradients]}`` (``[n, D]``)."""

    rows: dict[str, list[jax.Array]]
    grads: dict[str, list[jax.Array]]


def _sparse_collections(model: Any) -> list[TTEmbeddingCollection]:
    """The collections of ``model`` (itself, or its submodules) holding sparse tables; a
    ``ValueError`` if two share a parameter name (their gradients could not be told apart)."""
    found = [model] if isinstance(model, TTEmbeddingCollection) else []
    if not found and isinstance(model, nnx.Module):
        found = [m for _, m in nnx.iter_modules(model) if isinstance(m, TTEmbeddingCollection)]
    found = [c for c in found if c.layout.sparse_params()]
    names = [n for c in found for n in c.layout.sparse_params()]
    if len(set(names)) != len(names):
        raise ValueError(
            f"two collections share sparse table parameter names {sorted(names)}: "
            "give their tables other names"
        )
    return found


def sparse_value_and_grad(
    loss_fn: Callable[..., Any], *, has_aux: bool = False
) -> Callable[..., tuple[Any, nnx.State, SparseGrads]]:
    """``(model, *args) -> (loss, grads, sparse)``: ``nnx.value_and_grad(loss_fn)``'s ``loss``
    (``(loss, aux)`` with ``has_aux``) and ``grads`` (of the ``nnx.Param``s), and the sparse
    tables' ``SparseGrads`` for ``apply_sparse``."""

    def run(model: Any, *args: Any) -> tuple[Any, nnx.State, SparseGrads]:
        names = [n for c in _sparse_collections(model) for n in c.layout.sparse_params()]
        with sparse_tapes(names) as probe:  # the tapes' shapes, from an abstract trace
            nnx.eval_shape(lambda m: loss_fn(m, *args), model)
        tapes = {n: [jnp.zeros(shape, dtype) for shape, dtype in calls] for n, calls in probe.shapes.items()}

        def with_tapes(m: Any, fed: dict) -> Any:
            with sparse_tapes(names, fed) as traced:
                out = loss_fn(m, *args)
            loss, aux = out if has_aux else (out, None)
            return loss, (aux, traced.rows)

        grad_fn = nnx.value_and_grad(with_tapes, argnums=(0, 1), has_aux=True)
        (loss, (aux, rows)), (grads, tape_grads) = grad_fn(model, tapes)
        return ((loss, aux) if has_aux else loss), grads, SparseGrads(rows, tape_grads)

    return run


def apply_sparse(model: Any, sparse: SparseGrads) -> None:
    """Updates, in place, the rows each sparse table of ``model``'s collections was given
    this step (``sparse_value_and_grad``), with the table's ``SparseUpdate`` rule and state."""
    for coll in _sparse_collections(model):
        for name, cfg in coll.layout.sparse_params().items():
            if name not in sparse.rows:  # not gathered this step
                continue
            idx = jnp.concatenate(sparse.rows[name])
            grads = jnp.concatenate(sparse.grads[name])
            slots = coll.sparse_state[name]
            table, state = sparse_update(
                cfg, coll.params[name][...], {k: v[...] for k, v in slots.items()}, idx, grads
            )
            coll.params[name][...] = table
            for k, v in state.items():
                slots[k][...] = v
