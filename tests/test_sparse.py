"""Sparse updates of dense tables (``flowtt_jax.sparse``): the touched rows' update equals
the dense update's math (SGD and Adagrad over the whole table: a zero gradient moves
nothing; row-wise Adagrad and lazy Adam on the touched rows, untouched rows unchanged),
several calls in one loss, no ``[N, D]`` gradient in the step, and the config's checks."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from flowtt_jax import sparse as sp
from flowtt_jax.collection import TableConfig
from flowtt_jax.collection.config import SparseUpdate
from flowtt_jax.nnx import SparseTable, TTEmbeddingCollection

ROWS, D = 400, 8


def _tables(rule: SparseUpdate | None):
    return [
        TableConfig("user", ROWS, D, kind="dense", sparse=rule, feature_names=("user", "friend")),
        TableConfig("item", 300, D, rank=4),
        TableConfig("cat", 20, D, kind="dense"),
    ]


def _batches(seed: int, n: int = 3):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        out.append(
            {
                "user": {"ids": rng.integers(0, ROWS, 9), "offsets": np.array([0, 2, 5, 9])},
                "friend": rng.integers(0, 40, (3, 2)),  # overlaps the users' rows
                "item": rng.integers(0, 300, 3),
                "cat": rng.integers(0, 20, 3),
            }
        )
    return out


def _loss(model, feats):
    out = model(feats)
    return sum(jnp.sum(jnp.sin(v) * (i + 1)) for i, v in enumerate(out.values()))


def _two_calls(model, feats):  # two calls of the collection in one loss (two towers)
    a = model({k: feats[k] for k in ("user", "item")})
    b = model({k: feats[k] for k in ("friend", "cat")})
    return jnp.sum(a["user"] * b["friend"]) + jnp.sum(jnp.sin(a["item"])) + jnp.sum(b["cat"] ** 2)


def _pair(rule: SparseUpdate, dense_tx):
    """A sparse model and its dense twin holding the same values (loaded by table name)."""
    sparse = TTEmbeddingCollection(_tables(rule), rngs=nnx.Rngs(0))
    dense = TTEmbeddingCollection(_tables(None), rngs=nnx.Rngs(1))
    dense.load_table_state(sparse.table_state())
    return sparse, dense, nnx.Optimizer(dense, dense_tx, wrt=nnx.Param)


@pytest.mark.parametrize("loss_fn", [_loss, _two_calls])
@pytest.mark.parametrize(
    "rule,dense_tx",
    [
        (SparseUpdate("sgd", 0.3), optax.sgd(0.3)),
        (SparseUpdate("adagrad", 0.2, eps=1e-7), optax.adagrad(0.2, initial_accumulator_value=0.0, eps=1e-7)),
    ],
    ids=["sgd", "adagrad"],
)
def test_sparse_update_equals_the_dense_update(rule, dense_tx, loss_fn):
    sparse, dense, dense_opt = _pair(rule, dense_tx)
    assert isinstance(sparse.params[sparse.layout.param_names(1)[0]], SparseTable)
    other_tx = (
        optax.adagrad(0.2, initial_accumulator_value=0.0, eps=1e-7)
        if rule.rule == "adagrad"
        else optax.sgd(0.3)
    )
    sparse_opt = nnx.Optimizer(sparse, other_tx, wrt=nnx.Param)
    grad_fn = sp.sparse_value_and_grad(loss_fn)

    @nnx.jit
    def sparse_step(m, opt, f):
        loss, grads, rows = grad_fn(m, f)
        (table,) = m.layout.sparse_params()  # no [N, D] gradient of the sparse table; others as usual
        assert table not in grads["params"] and len(grads["params"]) == len(m.params) - 1
        opt.update(m, grads)
        sp.apply_sparse(m, rows)
        return loss

    @nnx.jit
    def dense_step(m, opt, f):
        loss, grads = nnx.value_and_grad(loss_fn)(m, f)
        opt.update(m, grads)
        return loss

    start = np.asarray(sparse.table("user"))
    for feats in _batches(0):
        np.testing.assert_allclose(
            sparse_step(sparse, sparse_opt, feats), dense_step(dense, dense_opt, feats), rtol=1e-6
        )
    for name in ("user", "item", "cat"):
        np.testing.assert_allclose(
            np.asarray(sparse.to_dense(name)), np.asarray(dense.to_dense(name)), rtol=2e-6, atol=2e-6
        )
    touched = np.unique(np.concatenate([np.r_[f["user"]["ids"], f["friend"].ravel()] for f in _batches(0)]))
    moved = np.flatnonzero(np.any(np.asarray(sparse.table("user")) != start, axis=1))
    assert set(moved) <= set(touched) and len(moved) > 0


@pytest.mark.parametrize("rule", ["rowwise_adagrad", "adam"])
def test_rowwise_adagrad_and_lazy_adam_follow_their_math(rule):
    """One step on the touched rows, by numpy: row-wise Adagrad (FBGEMM: the accumulator a
    row's mean squared gradient) and lazy Adam (its first step: the dense Adam's on touched
    rows); untouched rows and their state unchanged."""
    cfg = SparseUpdate(rule, 0.05, eps=1e-8)
    sparse, dense, _ = _pair(cfg, optax.sgd(0.0))
    feats = _batches(3, 1)[0]
    # one program each, not op by op
    _, grads = nnx.jit(nnx.value_and_grad(_loss))(dense, feats)  # the dense gradient, for the math
    g = np.asarray(dense.layout.table_params({k: v[...] for k, v in grads["params"].items()}, "user")[0])
    start = np.asarray(sparse.table("user"))
    grad_fn = nnx.jit(sp.sparse_value_and_grad(_loss))
    _, _, rows = grad_fn(sparse, feats)
    nnx.jit(sp.apply_sparse)(sparse, rows)
    touched = np.flatnonzero(np.any(g != 0, axis=1))
    want = start.copy()
    gt = g[touched]
    if rule == "rowwise_adagrad":
        acc = np.mean(gt * gt, axis=1, keepdims=True)
        want[touched] = start[touched] - 0.05 * gt / np.sqrt(acc + 1e-8)
        state = np.asarray(sparse.sparse_state[sparse.layout.param_names(1)[0]]["accumulator"][...])
        np.testing.assert_allclose(state[touched], acc[:, 0], rtol=1e-5)
        assert not np.delete(state, touched).any()
    else:
        mu, nu = 0.1 * gt, 0.001 * gt * gt
        want[touched] = start[touched] - 0.05 * (mu / 0.1) / (np.sqrt(nu / 0.001) + 1e-8)
    got = np.asarray(sparse.table("user"))
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)


def test_sparse_config_checks():
    with pytest.raises(ValueError, match="rule must be one of"):
        SparseUpdate("momentum")
    with pytest.raises(ValueError, match="learning_rate must be a number >= 0"):
        SparseUpdate("sgd", -1.0)
    with pytest.raises(ValueError, match="table 't': sparse updates are for dense tables"):
        TableConfig("t", 10, 4, sparse=SparseUpdate())
    with pytest.raises(TypeError, match="table 't': sparse must be a SparseUpdate"):
        TableConfig("t", 10, 4, kind="dense", sparse="adagrad")
