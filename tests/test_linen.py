"""flowtt_jax.linen layers: equal to the ops, agree with the nnx twins, train, checkpoint."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import flowtt_jax as ftt
from flowtt_jax import linen as fl
from flowtt_jax import nnx as fn
from flowtt_jax.collection import TableConfig
from tests.helpers import close

N, D, R = 1000, 16, 6


def ids_of(key, shape, n=N):
    return jax.random.randint(key, shape, 0, n).at[..., 0].set(n + 1)  # one out-of-range id


@pytest.mark.parametrize("impl", ["reference", "auto"])
def test_ttembed_equals_lookup(impl):
    m = fl.TTEmbed(N, D, rank=R, impl=impl)
    ids = ids_of(jax.random.key(0), (3, 4))
    params = m.init(jax.random.key(1), ids)["params"]
    spec = ftt.TTSpec.create(N, D, R)
    assert {k: v.shape for k, v in params.items()} == {f"core_{k}": s for k, s in enumerate(spec.core_shapes)}
    cores = tuple(params[f"core_{k}"] for k in range(3))
    out = m.apply({"params": params}, ids)
    assert out.shape == (3, 4, D)
    close(out, ftt.tt_lookup(cores, ids, num_embeddings=N, impl=impl))
    close(m.apply({"params": params}, method="to_dense"), ftt.to_dense(cores, N))
    q = jax.random.normal(jax.random.key(2), (5, D))
    close(m.apply({"params": params}, q, method="attend"), q @ ftt.to_dense(cores, N).T, 1e-4)
    # rows have the nnx.Embed-like default std
    std = float(jnp.std(ftt.to_dense(cores, N)))
    assert 0.5 / np.sqrt(D) < std < 2.0 / np.sqrt(D)


@pytest.mark.parametrize("mode", ["sum", "mean", "sqrtn"])
def test_ttembedbag_equals_op(mode):
    m = fl.TTEmbedBag(N, D, rank=R, mode=mode)
    ids = ids_of(jax.random.key(0), (12,))
    offsets = jnp.array([0, 4, 4, 12])
    w = jax.random.uniform(jax.random.key(3), (12,))
    params = m.init(jax.random.key(1), ids, offsets=offsets)["params"]
    cores = tuple(params[f"core_{k}"] for k in range(3))
    out = m.apply({"params": params}, ids, offsets=offsets, weights=w)
    close(out, ftt.tt_embedding_bag(cores, ids, offsets=offsets, weights=w, mode=mode, num_embeddings=N))
    padded = ids_of(jax.random.key(5), (3, 5))
    mask = jnp.arange(5)[None] < jnp.array([[2], [5], [0]])
    close(
        m.apply({"params": params}, padded, mask=mask),
        ftt.tt_embedding_bag(cores, padded, mask=mask, mode=mode, num_embeddings=N),
    )


def _nnx_with_cores(cls, cores, **kw):
    return cls(N, D, rank=R, embedding_init=lambda key, spec, dtype: cores, rngs=nnx.Rngs(0), **kw)


def test_nnx_and_linen_agree():
    cores = ftt.init_cores(jax.random.key(7), ftt.TTSpec.create(N, D, R))
    params = {f"core_{k}": c for k, c in enumerate(cores)}
    ids = ids_of(jax.random.key(8), (4, 3))
    # TTEmbed
    ln = fl.TTEmbed(N, D, rank=R)
    nx = _nnx_with_cores(fn.TTEmbed, cores)
    np.testing.assert_array_equal(np.asarray(ln.apply({"params": params}, ids)), np.asarray(nx(ids)))
    # the nnx state has the same names and values as the linen params
    nnx_params = {k: v[...] for k, v in nnx.state(nx, nnx.Param).items()}
    assert set(nnx_params) == set(params)
    # TTEmbedBag
    lb = fl.TTEmbedBag(N, D, rank=R, mode="mean")
    nb = _nnx_with_cores(fn.TTEmbedBag, cores, mode="mean")
    np.testing.assert_array_equal(np.asarray(lb.apply({"params": params}, ids)), np.asarray(nb(ids)))
    # gradients agree too
    g_l = jax.grad(lambda p: jnp.sum(lb.apply({"params": p}, ids) ** 2))(params)
    g_n = nnx.grad(lambda m: jnp.sum(m(ids) ** 2))(nb)
    for k in range(3):
        assert float(jnp.abs(g_l[f"core_{k}"]).max()) > 0
        close(g_l[f"core_{k}"], g_n[f"core_{k}"][...], 1e-5)
    # collections: copy the nnx tables into linen params
    tables = [TableConfig("x", N, D, rank=R, mode="sum"), TableConfig("y", 9, D, kind="dense", mode="mean")]
    ncol = fn.TTEmbeddingCollection(tables, rngs=nnx.Rngs(1))
    lcol = fl.TTEmbeddingCollection(tables)
    feats = {"x": ids, "y": jnp.array([[1, 2], [3, 4], [5, 6], [7, 8]])}
    lparams = lcol.init(jax.random.key(0), feats)["params"]
    assert set(lparams) == set(ncol.layout.param_shapes()) and len(lparams) == 4
    assert sorted(k[:3] for k in lparams) == ["den", "tt0", "tt0", "tt0"]
    copied = {k: v[...] for k, v in ncol.params.items()}
    lo, no = lcol.apply({"params": copied}, feats), ncol(feats)
    for k in feats:
        np.testing.assert_array_equal(np.asarray(lo[k]), np.asarray(no[k]))


def test_params_from_dense():
    table = jax.random.normal(jax.random.key(0), (50, 8))
    params = fl.TTEmbed.params_from_dense(table, rank=64)
    m = fl.TTEmbed(50, 8, rank=64)
    ids = jnp.array([0, 7, 49])
    close(m.apply({"params": params}, ids), table[ids], 1e-4)
    # and from_dense through embedding_init in a linen init
    m2 = fl.TTEmbed(
        50, 8, rank=64, embedding_init=lambda key, spec, dtype: ftt.from_dense(table, spec, dtype)
    )
    p2 = m2.init(jax.random.key(0), ids)
    close(m2.apply(p2, ids), table[ids], 1e-4)


def test_optax_loop_reduces_loss():
    n = 64
    target = ftt.to_dense(ftt.init_cores(jax.random.key(42), ftt.TTSpec.create(n, 8, 3)), n)
    m = fl.TTEmbed(n, 8, rank=4)
    ids = jnp.arange(n)
    params = m.init(jax.random.key(0), ids)["params"]
    tx = optax.adam(3e-2)
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state):
        loss, g = jax.value_and_grad(lambda p: jnp.mean((m.apply({"params": p}, ids) - target) ** 2))(params)
        updates, opt_state = tx.update(g, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    losses = []
    for _ in range(150):
        params, opt_state, loss = step(params, opt_state)
        losses.append(float(loss))
    assert losses[-1] < 0.1 * losses[0], (losses[0], losses[-1])


def test_checkpoint_roundtrip(tmp_path):
    ocp = pytest.importorskip("orbax.checkpoint")
    m = fl.TTEmbedBag(N, D, rank=R)
    ids = ids_of(jax.random.key(0), (3, 4))
    params = m.init(jax.random.key(1), ids)["params"]
    ckpt = ocp.StandardCheckpointer()
    ckpt.save(tmp_path / "p", params)
    ckpt.wait_until_finished()
    fresh = m.init(jax.random.key(2), ids)["params"]
    assert float(jnp.abs(fresh["core_0"] - params["core_0"]).max()) > 0
    restored = ckpt.restore(tmp_path / "p", jax.tree.map(ocp.utils.to_shape_dtype_struct, fresh))
    np.testing.assert_array_equal(
        np.asarray(m.apply({"params": restored}, ids)), np.asarray(m.apply({"params": params}, ids))
    )


def test_bf16():
    ids = ids_of(jax.random.key(0), (6,))
    m32 = fl.TTEmbed(N, D, rank=R)
    p = m32.init(jax.random.key(1), ids)
    m16 = fl.TTEmbed(N, D, rank=R, dtype=jnp.bfloat16)
    out = m16.apply(p, ids)
    assert out.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(out), np.asarray(m32.apply(p, ids).astype(jnp.bfloat16)))
    mp = fl.TTEmbedBag(N, D, rank=R, param_dtype=jnp.bfloat16)
    pp = mp.init(jax.random.key(1), ids[None])
    assert all(v.dtype == jnp.bfloat16 for v in jax.tree.leaves(pp))
    assert mp.apply(pp, ids[None]).dtype == jnp.bfloat16


def test_linen_does_not_import_nnx():
    code = "import sys, flowtt_jax.linen; assert 'flowtt_jax.nnx' not in sys.modules, sorted(sys.modules)"
    proc = subprocess.run(
        [sys.executable, "-c", code],
        env=dict(os.environ, JAX_PLATFORMS="cpu"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
