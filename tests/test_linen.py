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
from tests.helpers import close, host_collection

N, D, R = 1000, 16, 6


def ids_of(seed, shape, n=N):
    """int32 ids drawn on the host (set-up, no device op), one out of range."""
    ids = np.random.default_rng(seed).integers(0, n, shape).astype(np.int32)
    ids[..., 0] = n + 1
    return ids


@pytest.mark.parametrize("impl", ["reference", "auto"])
def test_ttembed_equals_lookup(impl):
    m = fl.TTEmbed(N, D, rank=R, impl=impl)
    ids = ids_of(0, (3, 4))
    params = jax.jit(m.init)(jax.random.key(1), ids)["params"]  # one program, not op by op
    spec = ftt.TTSpec.create(N, D, R)
    assert {k: v.shape for k, v in params.items()} == {f"core_{k}": s for k, s in enumerate(spec.core_shapes)}
    q = np.random.default_rng(2).standard_normal((5, D)).astype(np.float32)

    @jax.jit  # one program for every call
    def run(params):
        cores = tuple(params[f"core_{k}"] for k in range(3))
        v = {"params": params}
        layer = m.apply(v, ids), m.apply(v, method="to_dense"), m.apply(v, q, method="attend")
        return layer, ftt.tt_lookup(cores, ids, num_embeddings=N, impl=impl), ftt.to_dense(cores, N)

    (out, table, attended), want, dense = run(params)
    assert out.shape == (3, 4, D)
    close(out, want)
    close(table, dense)
    close(attended, q @ np.asarray(dense, np.float64).T, 1e-4)
    # rows have the nnx.Embed-like default std
    std = float(np.std(np.asarray(dense)))
    assert 0.5 / np.sqrt(D) < std < 2.0 / np.sqrt(D)


@pytest.mark.parametrize("mode", ["sum", "mean", "sqrtn"])
def test_ttembedbag_equals_op(mode):
    m = fl.TTEmbedBag(N, D, rank=R, mode=mode)
    ids = ids_of(0, (12,))
    offsets = np.array([0, 4, 4, 12], np.int32)
    w = np.random.default_rng(3).uniform(size=12).astype(np.float32)
    params = jax.jit(m.init)(jax.random.key(1), ids, offsets=offsets)["params"]  # one program
    padded = ids_of(5, (3, 5))
    mask = np.arange(5)[None] < np.array([[2], [5], [0]])

    @jax.jit  # one program for every call
    def run(params):
        cores = tuple(params[f"core_{k}"] for k in range(3))
        op = lambda x, **bags: ftt.tt_embedding_bag(cores, x, **bags, mode=mode, num_embeddings=N)  # noqa: E731
        return (
            (
                m.apply({"params": params}, ids, offsets=offsets, weights=w),
                op(ids, offsets=offsets, weights=w),
            ),
            (m.apply({"params": params}, padded, mask=mask), op(padded, mask=mask)),
        )

    for got, want in run(params):
        close(got, want)


#: One jitted call of an nnx module (one program per module and input, not one per op).
_call = nnx.jit(lambda m, x: m(x))


def _nnx_with_cores(cls, cores, **kw):
    return cls(N, D, rank=R, embedding_init=lambda key, spec, dtype: cores, rngs=nnx.Rngs(0), **kw)


def test_nnx_and_linen_agree():
    cores = jax.jit(ftt.init_cores, static_argnums=1)(jax.random.key(7), ftt.TTSpec.create(N, D, R))
    params = {f"core_{k}": c for k, c in enumerate(cores)}
    ids = ids_of(8, (4, 3))
    # each layer jitted on its own: one program each, compared bit for bit
    lin = jax.jit(lambda m, p, x: m.apply({"params": p}, x), static_argnums=0)
    # TTEmbed
    ln = fl.TTEmbed(N, D, rank=R)
    nx = _nnx_with_cores(fn.TTEmbed, cores)
    np.testing.assert_array_equal(np.asarray(lin(ln, params, ids)), np.asarray(_call(nx, ids)))
    # the nnx state has the same names and values as the linen params
    nnx_params = {k: v[...] for k, v in nnx.state(nx, nnx.Param).items()}
    assert set(nnx_params) == set(params)
    # TTEmbedBag
    lb = fl.TTEmbedBag(N, D, rank=R, mode="mean")
    nb = _nnx_with_cores(fn.TTEmbedBag, cores, mode="mean")
    np.testing.assert_array_equal(np.asarray(lin(lb, params, ids)), np.asarray(_call(nb, ids)))
    # gradients agree too
    g_l = jax.jit(jax.grad(lambda p: jnp.sum(lb.apply({"params": p}, ids) ** 2)))(params)
    g_n = nnx.jit(nnx.grad(lambda m: jnp.sum(m(ids) ** 2)))(nb)
    for k in range(3):
        assert np.abs(np.asarray(g_l[f"core_{k}"])).max() > 0
        close(g_l[f"core_{k}"], g_n[f"core_{k}"][...], 1e-5)
    # collections: copy the nnx tables into linen params
    tables = [TableConfig("x", N, D, rank=R, mode="sum"), TableConfig("y", 9, D, kind="dense", mode="mean")]
    ncol = host_collection(tables, 1)
    lcol = fl.TTEmbeddingCollection(tables)
    feats = {"x": ids, "y": np.array([[1, 2], [3, 4], [5, 6], [7, 8]], np.int32)}
    lparams = jax.eval_shape(lcol.init, jax.random.key(0), feats)["params"]  # names only
    assert set(lparams) == set(ncol.layout.param_shapes()) and len(lparams) == 4
    assert sorted(k[:3] for k in lparams) == ["den", "tt0", "tt0", "tt0"]
    copied = {k: v[...] for k, v in ncol.params.items()}
    lo, no = jax.jit(lambda p: lcol.apply({"params": p}, feats))(copied), _call(ncol, feats)
    for k in feats:
        np.testing.assert_array_equal(np.asarray(lo[k]), np.asarray(no[k]))


def test_params_from_dense():
    table = np.random.default_rng(0).standard_normal((50, 8)).astype(np.float32)
    params = fl.TTEmbed.params_from_dense(table, rank=64)
    m = fl.TTEmbed(50, 8, rank=64)
    ids = np.array([0, 7, 49], np.int32)
    # and from_dense through embedding_init in a linen init
    m2 = fl.TTEmbed(
        50, 8, rank=64, embedding_init=lambda key, spec, dtype: ftt.from_dense(table, spec, dtype)
    )
    p2 = m2.init(jax.random.key(0), ids)
    out, out2 = jax.jit(lambda p, p2: (m.apply({"params": p}, ids), m2.apply(p2, ids)))(params, p2)
    close(out, table[ids], 1e-4)
    close(out2, table[ids], 1e-4)


def test_optax_loop_reduces_loss():
    n = 64
    target = ftt.to_dense(ftt.init_cores(jax.random.key(42), ftt.TTSpec.create(n, 8, 3)), n)
    m = fl.TTEmbed(n, 8, rank=4)
    ids = np.arange(n, dtype=np.int32)
    params = jax.jit(m.init)(jax.random.key(0), ids)["params"]  # one program, not op by op
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
    ids = ids_of(0, (3, 4))
    init = jax.jit(m.init)  # one program for both draws, not op by op
    params = init(jax.random.key(1), ids)["params"]
    ckpt = ocp.StandardCheckpointer()
    ckpt.save(tmp_path / "p", params)
    ckpt.wait_until_finished()
    fresh = init(jax.random.key(2), ids)["params"]
    assert float(jnp.abs(fresh["core_0"] - params["core_0"]).max()) > 0
    restored = ckpt.restore(tmp_path / "p", jax.tree.map(ocp.utils.to_shape_dtype_struct, fresh))
    apply = jax.jit(m.apply)  # one program for both
    np.testing.assert_array_equal(
        np.asarray(apply({"params": restored}, ids)), np.asarray(apply({"params": params}, ids))
    )


def test_bf16():
    ids = ids_of(0, (6,))
    m32 = fl.TTEmbed(N, D, rank=R)
    p = jax.jit(m32.init)(jax.random.key(1), ids)  # one program, not op by op
    m16 = fl.TTEmbed(N, D, rank=R, dtype=jnp.bfloat16)
    mp = fl.TTEmbedBag(N, D, rank=R, param_dtype=jnp.bfloat16)
    pp = jax.jit(mp.init)(jax.random.key(1), ids[None])
    assert all(v.dtype == jnp.bfloat16 for v in jax.tree.leaves(pp))
    out, want, pooled = jax.jit(  # one program for every call
        lambda p, pp: (m16.apply(p, ids), m32.apply(p, ids).astype(jnp.bfloat16), mp.apply(pp, ids[None]))
    )(p, pp)
    assert out.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(out), np.asarray(want))
    assert pooled.dtype == jnp.bfloat16


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
