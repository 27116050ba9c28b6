"""Sparse updates of dense tables, Flax-free: the rows a call gathers from a sparse table
(``TableConfig.sparse``) taken with an additive zero *tape* whose gradient is the rows'
gradient, and the update of those rows only (``flowtt_jax.sparse`` drives both).

Inside ``sparse_tapes(names, feed)`` a dense pack whose parameter is in ``names`` gathers
``stop_gradient(table)[idx] + tape``: the table gets no ``[N, D]`` cotangent, the tape's
cotangent is each position's row gradient ``[n, D]``. ``feed=None`` records the tapes'
shapes only (a first, abstract trace). ``sparse_update`` sums the positions' gradients per
unique row (one sort) and applies the rule to those rows: O(n D) work and memory per step,
not O(N D).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator, Mapping, Sequence

import jax
import jax.numpy as jnp

from flowtt_jax.collection.config import SparseUpdate

__all__ = ["Tapes", "gather_rows", "init_sparse_state", "sparse_tapes", "sparse_update"]

_TAPES: contextvars.ContextVar[Tapes | None] = contextvars.ContextVar("flowtt_sparse_tapes", default=None)


@dataclasses.dataclass
class Tapes:
    """One sparse trace: ``names`` the sparse tables' parameter names; ``feed`` the tapes to
    add, per name in call order (None: record shapes only); ``shapes`` and ``rows`` (each
    call's ``[n]`` int32 row indices) recorded per name in call order."""

    names: frozenset[str]
    feed: Mapping[str, Sequence[jax.Array]] | None
    shapes: dict[str, list[tuple[tuple[int, int], jnp.dtype]]] = dataclasses.field(default_factory=dict)
    rows: dict[str, list[jax.Array]] = dataclasses.field(default_factory=dict)


@contextlib.contextmanager
def sparse_tapes(
    names: Sequence[str], feed: Mapping[str, Sequence[jax.Array]] | None = None
) -> Iterator[Tapes]:
    """Calls traced inside gather the sparse tables ``names`` through tapes (``gather_rows``)."""
    tapes = Tapes(frozenset(names), feed)
    token = _TAPES.set(tapes)
    try:
        yield tapes
    finally:
        _TAPES.reset(token)


def gather_rows(name: str, table: jax.Array, idx: jax.Array) -> jax.Array:
    """``table[idx]`` (``[n, D]``); inside ``sparse_tapes`` naming ``name``, plus the next
    fed tape, the table itself out of the gradient."""
    tapes = _TAPES.get()
    if tapes is None or name not in tapes.names:
        return jnp.take(table, idx, axis=0)
    rows = jnp.take(jax.lax.stop_gradient(table), idx, axis=0)
    calls = tapes.shapes.setdefault(name, [])
    calls.append(((int(idx.shape[0]), int(table.shape[-1])), table.dtype))
    tapes.rows.setdefault(name, []).append(idx.astype(jnp.int32))
    if tapes.feed is None:
        return rows
    fed = tapes.feed[name]
    if len(calls) > len(fed):
        raise ValueError(f"sparse table {name!r} gathered more often than in the first trace")
    return rows + fed[len(calls) - 1].astype(rows.dtype)


def init_sparse_state(rule: str, shape: tuple[int, int]) -> dict[str, jax.Array]:
    """The rule's per-row state of an ``[N, D]`` table (float32 zeros)."""
    n, d = shape
    if rule == "sgd":
        return {}
    if rule == "adagrad":
        return {"accumulator": jnp.zeros((n, d), jnp.float32)}
    if rule == "rowwise_adagrad":
        return {"accumulator": jnp.zeros((n,), jnp.float32)}
    return {
        "mu": jnp.zeros((n, d), jnp.float32),
        "nu": jnp.zeros((n, d), jnp.float32),
        "count": jnp.zeros((n,), jnp.float32),
    }


def sparse_update(
    cfg: SparseUpdate, table: jax.Array, state: Mapping[str, jax.Array], idx: jax.Array, grads: jax.Array
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """``(table, state)`` after one step of ``cfg.rule`` on the rows ``idx [n]`` touched, whose
    positions' gradients are ``grads [n, D]`` (summed per row first). Untouched rows and their
    state are left as they are (for ``"sgd"`` and ``"adagrad"`` exactly what the dense update
    gives them: a zero gradient moves nothing)."""
    n = idx.shape[0]
    num_rows = table.shape[0]
    if n == 0:
        return table, dict(state)
    rows, inverse = jnp.unique(idx, size=n, fill_value=num_rows, return_inverse=True)
    g = jax.ops.segment_sum(grads.astype(jnp.float32), inverse.reshape(-1), num_segments=n)  # [n, D]
    at = jnp.minimum(rows, num_rows - 1)  # the fill (num_rows) reads a row, writes none
    old = table[at].astype(jnp.float32)
    lr, eps = cfg.learning_rate, cfg.eps
    new_state = dict(state)

    def put(x: jax.Array, value: jax.Array) -> jax.Array:
        return x.at[rows].set(value.astype(x.dtype), mode="drop")

    if cfg.rule == "sgd":
        step = g
    elif cfg.rule == "adagrad":  # optax.adagrad, initial accumulator 0
        acc = state["accumulator"][at] + g * g
        new_state["accumulator"] = put(state["accumulator"], acc)
        step = jnp.where(acc > 0, g * jax.lax.rsqrt(acc + eps), 0.0)
    elif cfg.rule == "rowwise_adagrad":  # FBGEMM: one accumulator a row, the mean square
        acc = state["accumulator"][at] + jnp.mean(g * g, axis=-1)
        new_state["accumulator"] = put(state["accumulator"], acc)
        step = jnp.where(acc[:, None] > 0, g * jax.lax.rsqrt(acc[:, None] + eps), 0.0)
    else:  # lazy Adam: each row's moments and step count move when it is touched
        count = state["count"][at] + 1.0
        mu = cfg.b1 * state["mu"][at] + (1 - cfg.b1) * g
        nu = cfg.b2 * state["nu"][at] + (1 - cfg.b2) * g * g
        new_state.update(count=put(state["count"], count), mu=put(state["mu"], mu), nu=put(state["nu"], nu))
        mu_hat = mu / (1 - cfg.b1 ** count[:, None])
        nu_hat = nu / (1 - cfg.b2 ** count[:, None])
        step = mu_hat / (jnp.sqrt(nu_hat) + eps)
    return put(table, old - lr * step), new_state
