"""Size limits: nnz and bag counts past int32 refused with a clear error, the
largest table ``TTSpec`` accepts looked up at its last row, and (``FLOWTT_LARGE_TESTS=1``,
about 17 GB of memory on the default device) a B x D output past 2^31 elements.
"""

from __future__ import annotations

import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flowtt_jax as ftt
from flowtt_jax.inputs.validate import MAX_NNZ
from flowtt_jax.kernels import ffi
from tests.helpers import make_cores

SMALL = ftt.TTSpec.create(1000, 8, 4, row_shape=(10, 10, 10))


def _sds(n, dtype=jnp.int32):
    return jax.ShapeDtypeStruct((n,), dtype)


@pytest.mark.parametrize("impl", ["ffi", "reference"])
def test_nnz_and_bags_past_int32_are_refused_before_any_call(impl):
    """Traced with abstract shapes only (``jax.eval_shape``): nothing is allocated."""
    cores = make_cores(SMALL, seed=0)
    too_many = MAX_NNZ + 1
    cases = [
        lambda ids: ftt.tt_lookup(cores, ids, impl=impl),
        lambda ids: ftt.tt_embedding_bag(cores, ids, offsets=jnp.array([0, 5]), impl=impl),
        lambda ids: ftt.tt_embedding_bag(cores, ids, segment_ids=ids, num_bags=3, impl=impl),
    ]
    for fn in cases:
        with pytest.raises(ValueError, match=r"at most 2147483646 \(2\^31 - 2\).*split the batch"):
            jax.eval_shape(fn, _sds(too_many))
    with pytest.raises(ValueError, match="2\\^31 - 2"):  # bags past the limit, few ids
        jax.eval_shape(
            lambda o: ftt.tt_embedding_bag(cores, jnp.arange(4), offsets=o, impl=impl), _sds(too_many + 1)
        )
    # at the limit the ops trace (the shapes are right; nothing runs); the CUDA kernels'
    # limit is lower (int32 offsets inside them), named past it
    limit = MAX_NNZ
    if impl == "ffi" and jax.default_backend() == "gpu":
        limit = ffi.CUDA_MAX_NNZ
        with pytest.raises(ValueError, match=r"CUDA kernels take at most 1073741823"):
            jax.eval_shape(lambda ids: ftt.tt_lookup(cores, ids, impl=impl), _sds(limit + 1))
    out = jax.eval_shape(lambda ids: ftt.tt_lookup(cores, ids, impl=impl), _sds(limit))
    assert out.shape == (limit, 8)


def test_cuda_nnz_limit_is_named(monkeypatch):
    monkeypatch.setattr(ffi.jax, "default_backend", lambda: "gpu")
    ffi.check_kernel_nnz(ffi.CUDA_MAX_NNZ)
    with pytest.raises(ValueError, match=r"CUDA kernels take at most 1073741823 \(2\^30 - 1\)"):
        ffi.check_kernel_nnz(ffi.CUDA_MAX_NNZ + 1)


def test_spec_limits():
    ftt.TTSpec(2**31 - 1, 1, (2**31 - 1, 1, 1), (1, 1, 1), (1, 1, 1, 1))  # the largest table
    with pytest.raises(ValueError, match="must be < 2\\^31: ids are int32"):
        ftt.TTSpec(2**31, 1, (2**16, 2**15, 1), (1, 1, 1), (1, 1, 1, 1))
    with pytest.raises(ValueError, match="must be < 2\\^31"):
        ftt.TTSpec.create(2**31, 8)
    # prime: no balanced exact row shape under 2^31; the error names the degenerate one
    with pytest.raises(
        ValueError,
        match=r"2147483647 is prime, so only a degenerate row shape .* row_shape=\(2147483647, 1, 1\)",
    ):
        ftt.TTSpec.create(2**31 - 1, 8)
    assert ftt.TTSpec.create(2**31 - 2, 8, 2).row_shape == (993, 1302, 1661)
    assert math.prod(ftt.TTSpec.create(2**31 - 1000, 8).row_shape) < 2**31


def _row_f64(cores, i) -> np.ndarray:
    """Row i from the definition, in float64 on the host."""
    p = [c.shape[0] for c in cores]
    digits = (i // (p[1] * p[2]), (i // p[2]) % p[1], i % p[2])
    acc = np.asarray(cores[0], np.float64)[digits[0], 0]  # [q1, r1]
    for c, d in zip(cores[1:], digits[1:]):
        acc = np.einsum("xa,aqb->xqb", acc, np.asarray(c, np.float64)[d]).reshape(-1, c.shape[3])
    return acc[:, 0]


def test_largest_automatic_table_at_its_last_row():
    """N = 2^31 - 2 rows (993 x 1302 x 1661): the last rows, the first, and the ids just
    past N, through the lookup, a weighted bag and its gradients, on both paths."""
    spec = ftt.TTSpec.create(2**31 - 2, 8, 2)
    n_rows = spec.num_embeddings
    cores = make_cores(spec, seed=1)
    ids = np.array([n_rows - 1, n_rows - 2, 0, n_rows, 2**31 - 1, n_rows - 1662], np.int64)
    w = jnp.asarray([1.0, -2.0, 0.5, 3.0, 1.0, 1.0])
    grads = {}
    for impl in ("ffi", "reference"):

        @jax.jit  # one program, not op by op; the host int64 ids closed over (host, as eager)
        def run(c, w, impl=impl):
            bags = lambda c, w: ftt.tt_embedding_bag(c, ids, offsets=[0, 2, 6], weights=w, impl=impl)  # noqa: E731
            grads = jax.grad(lambda c, w: jnp.sum(bags(c, w) ** 2), argnums=(0, 1))(c, w)
            return ftt.tt_lookup(c, ids, impl=impl), ftt.tt_lookup(c, ids[3:5], oob="clip", impl=impl), grads

        rows, clip, grads[impl] = run(cores, w)
        rows = np.asarray(rows)
        for k in (0, 1, 2, 5):
            np.testing.assert_allclose(rows[k], _row_f64(cores, int(ids[k])), rtol=1e-5, atol=1e-6)
        assert not rows[3].any() and not rows[4].any()  # past N: oob="zero"
        assert np.allclose(np.asarray(clip), rows[0], atol=1e-6)
    for g, r in zip(jax.tree.leaves(grads["ffi"]), jax.tree.leaves(grads["reference"])):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-5, atol=1e-6)
    last = np.asarray(grads["ffi"][0][2])[(n_rows - 1) % spec.row_shape[2]]
    assert np.abs(last).sum() > 0  # the last row's g3 slice got its gradient


def _available_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            info = dict(line.split(":", 1) for line in f)
        return int(info["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return 0


@pytest.mark.skipif(os.environ.get("FLOWTT_LARGE_TESTS") != "1", reason="FLOWTT_LARGE_TESTS=1 runs it")
def test_outputs_past_2_31_elements():
    """B x D = 2^31 + 64 output elements (8 GiB): bags at both ends of the output, the
    forward (bag_fwd) and the gradient (pool_bwd reads a dout of the same size)."""
    dim, bags = 64, 2**25 + 1
    if jax.default_backend() == "cpu" and _available_bytes() < 20 * 2**30:
        pytest.skip("needs about 20 GiB of free host memory")
    spec = ftt.TTSpec.create(1000, dim, 4, row_shape=(10, 10, 10))
    cores = make_cores(spec, seed=2)
    ids = jnp.array([7, 999, 3], jnp.int32)
    offsets = jnp.concatenate([jnp.array([0, 1], jnp.int32), jnp.full((bags - 1,), 1, jnp.int32)])
    offsets = offsets.at[-1].set(3)  # bag 0: id 7; bags 1..B-2 empty; bag B-1: ids 999, 3
    rows = ftt.tt_lookup(cores, ids)
    out = jax.jit(lambda c: ftt.tt_embedding_bag(c, ids, offsets=offsets))(cores)
    assert out.shape == (bags, dim) and bags * dim > 2**31
    np.testing.assert_allclose(np.asarray(out[0]), np.asarray(rows[0]), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(out[-1]), np.asarray(rows[1] + rows[2]), rtol=1e-6)
    assert not np.asarray(out[1 : 1 << 20]).any()
    del out
    scale = jnp.zeros((bags, 1), jnp.float32).at[-1].set(2.0).at[0].set(1.0)
    grads = jax.jit(jax.grad(lambda c: jnp.sum(ftt.tt_embedding_bag(c, ids, offsets=offsets) * scale)))(cores)
    ref = jax.grad(lambda c: jnp.sum(ftt.tt_lookup(c, ids) * jnp.array([[1.0], [2.0], [2.0]])))(cores)
    for g, r in zip(grads, ref):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-5, atol=1e-6)
