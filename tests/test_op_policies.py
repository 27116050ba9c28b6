"""The ops' documented input and AD policies, one test (or a few) per policy: ids of every integer
dtype, host int64 ids without x64, zero bags, non-finite rows at dropped positions,
traced offsets, forward-mode / second-order AD, jax.export in a fresh process, argument
errors, float16 cores. Sizes (nnz, B x D, the largest table) are in
``test_op_sizes.py``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

import flowtt_jax as ftt
from flowtt_jax import tt_embedding_bag_group
from flowtt_jax.kernels import ffi
from flowtt_jax.kernels.group_plan import GroupLayout
from flowtt_jax.ops import embedding_bag
from flowtt_jax.ops.pooled import choose_impl
from tests.helpers import make_cores, poisoned_call, target_pool_fwd

IMPLS = ["ffi", "reference"]
INT_DTYPES = [np.int8, np.uint8, np.int16, np.uint16, np.int32, np.uint32, np.int64, np.uint64]
SPEC = ftt.TTSpec.create(100_000, 8, 4, row_shape=(40, 50, 50))
SMALL = ftt.TTSpec.create(1000, 8, 4, row_shape=(10, 10, 10))
REPO = Path(__file__).resolve().parents[1]


def _np(x) -> np.ndarray:
    return np.asarray(x)


# ---- 1. narrow integer ids ----


@pytest.mark.parametrize("impl", IMPLS)
def test_ids_of_every_integer_dtype_give_the_int32_rows(impl):
    cores = make_cores(SPEC, seed=1)
    small = np.array([5, 100, 0, 127], np.int32)  # fits every dtype
    for oob in ("zero", "clip", "error"):
        want = _np(ftt.tt_lookup(cores, small, oob=oob, impl=impl))
        want_bag = _np(ftt.tt_embedding_bag(cores, small, offsets=[0, 2, 4], oob=oob, impl=impl))
        for dt in INT_DTYPES:
            got = ftt.tt_lookup(cores, small.astype(dt), oob=oob, impl=impl)
            assert _np(got).tobytes() == want.tobytes(), (dt, oob)
            if oob != "zero" and dt not in (np.int8, np.uint16):
                continue  # the bag op: every dtype under one policy, two dtypes under all
            ids = jnp.asarray(small.astype(dt))
            got = ftt.tt_embedding_bag(cores, ids, offsets=[0, 2, 4], oob=oob, impl=impl)
            assert _np(got).tobytes() == want_bag.tobytes(), (dt, oob)
    # ids past a narrow dtype's reach of N still compare against N, not a wrapped N
    big = np.array([SPEC.num_embeddings - 1, 2**32 - 1], np.uint32)
    rows = _np(ftt.tt_lookup(cores, big, oob="clip", impl=impl))
    assert rows[0].tobytes() == rows[1].tobytes()  # uint32 max clips to the last row
    assert not _np(ftt.tt_lookup(cores, big, oob="zero", impl=impl))[1].any()
    with pytest.raises(ValueError, match="out of range"):
        ftt.tt_lookup(cores, big, oob="error", impl=impl)


def test_nnx_embed_takes_int16_and_uint8_ids():
    nnx = pytest.importorskip("flax.nnx")
    layer = ftt.nnx.TTEmbed(100_000, 8, rank=4, rngs=nnx.Rngs(0))
    ids = np.array([[5, 100], [0, 99]], np.int32)
    want = _np(layer(ids))
    assert _np(layer(ids.astype(np.int16))).tobytes() == want.tobytes()
    assert _np(layer(ids.astype(np.uint8))).tobytes() == want.tobytes()
    bag = ftt.nnx.TTEmbedBag(100_000, 8, rank=4, rngs=nnx.Rngs(0))
    assert _np(bag(ids.astype(np.int8))).tobytes() == _np(bag(ids)).tobytes()


# ---- 2. int64 ids without x64 ----


@pytest.mark.parametrize("impl", IMPLS)
def test_host_int64_ids_past_int32_are_out_of_range_not_wrapped(impl):
    assert not jax.config.jax_enable_x64
    cores = make_cores(SPEC, seed=2)
    ids = np.array([2**32 + 5, 5, -(2**40)])
    with pytest.raises(ValueError, match=r"do not fit in int32.*4294967301"):
        ftt.tt_lookup(cores, ids, oob="error", impl=impl)
    with pytest.raises(ValueError, match="do not fit in int32"):
        ftt.tt_embedding_bag(cores, [[2**33, 1]], oob="error", impl=impl)  # Python ints
    rows = _np(ftt.tt_lookup(cores, ids, oob="zero", impl=impl))
    five = _np(ftt.tt_lookup(cores, np.array([5]), impl=impl))[0]
    assert not rows[0].any() and not rows[2].any() and rows[1].tobytes() == five.tobytes()
    rows = _np(ftt.tt_lookup(cores, ids, oob="clip", impl=impl))
    last, first = _np(ftt.tt_lookup(cores, np.array([SPEC.num_embeddings - 1, 0]), impl=impl))
    assert rows[0].tobytes() == last.tobytes() and rows[2].tobytes() == first.tobytes()
    # segment ids and offsets are read without wrap-around too
    out = ftt.tt_embedding_bag(cores, [1, 2], segment_ids=np.array([0, 2**32]), num_bags=1, impl=impl)
    assert _np(out).tobytes() == _np(ftt.tt_lookup(cores, np.array([1]), impl=impl)).tobytes()
    with pytest.raises(ValueError, match="offsets"):
        ftt.tt_embedding_bag(cores, [1, 2], offsets=np.array([0, 2**32 + 2]), impl=impl)


def test_int64_ids_under_x64_follow_the_policy():
    cores = make_cores(SPEC, seed=3)  # float32 either way: drawn by the programs made without x64
    with jax.enable_x64(True):
        ids = jnp.asarray(np.array([2**32 + 5, 5], np.int64))
        assert ids.dtype == jnp.int64
        with pytest.raises(ValueError, match="out of range"):
            ftt.tt_lookup(cores, ids, oob="error")
        assert not _np(ftt.tt_lookup(cores, ids))[0].any()


# ---- 3. zero bags ----


@pytest.mark.parametrize("impl", IMPLS)
def test_gradient_through_zero_bags_is_zero(impl):
    cores = make_cores(SMALL, seed=4)
    ids, w = jnp.arange(3), jnp.ones(3)

    def loss(c, w, offsets):  # mean: no bag lengths to gather either (found by test_fuzz.py)
        return jnp.sum(ftt.tt_embedding_bag(c, ids, offsets=offsets, weights=w, mode="mean", impl=impl) ** 2)

    g_cores, g_w = jax.jit(jax.grad(loss, argnums=(0, 1)))(cores, w, jnp.array([0]))
    assert all(not _np(g).any() and g.shape == c.shape for g, c in zip(g_cores, cores))
    assert g_w.shape == (3,) and not _np(g_w).any()
    for kw in ({"segment_ids": jnp.zeros(3, int), "num_bags": 0}, {}):
        x = ids if kw else jnp.zeros((0, 3), jnp.int32)  # padded [0, L]
        bags = lambda c, x=x, kw=kw: ftt.tt_embedding_bag(c, x, impl=impl, **kw)
        out, g = jax.jit(lambda c, bags=bags: (bags(c), jax.grad(lambda c: jnp.sum(bags(c)))(c)))(cores)
        assert out.shape == (0, 8)
        assert all(not _np(d).any() for d in g)


# ---- 4. zero means zero: dropped positions never read their rows ----


def _poisoned_cores(seed):
    """Cores whose row 0 (and every row with i3 == 0) is inf."""
    cores = list(make_cores(SMALL, seed=seed))
    cores[2] = cores[2].at[0].set(jnp.inf)
    return tuple(cores)


@pytest.mark.parametrize("impl", IMPLS)
def test_dropped_positions_stay_zero_when_row_0_is_not_finite(impl):
    cores = _poisoned_cores(5)
    clean = jnp.array([5, 7, 13], jnp.int32)  # no i3 == 0
    want = ftt.tt_lookup(cores, clean, impl=impl)
    got = ftt.tt_lookup(cores, jnp.array([5, -1, 7, 5000, 13]), impl=impl)  # oob="zero"
    assert np.isfinite(_np(got)).all() and not _np(got)[[1, 3]].any()
    assert _np(got)[[0, 2, 4]].tobytes() == _np(want).tobytes()

    pad = jnp.array([[5, 0, 7], [13, 0, -3]])  # id 0 masked, -3 out of range
    mask = jnp.array([[True, False, True], [True, False, True]])
    weights = jnp.array([[1.0, 2.0, 0.5], [0.0, 1.0, 1.0]])  # a user weight of 0 on a finite row
    for jit in (False, True):
        fn = lambda c, w: ftt.tt_embedding_bag(c, pad, mask=mask, weights=w, mode="mean", impl=impl)
        fn = jax.jit(fn) if jit else fn
        out = _np(fn(cores, weights))
        assert np.isfinite(out).all()
        assert np.allclose(out[0], (_np(want[0]) + 0.5 * _np(want[1])) / 2, atol=1e-6)
        assert not out[1].any()  # 0 * row 13 + a dropped id: exactly 0
        g_cores, g_w = jax.grad(lambda c, w, fn=fn: jnp.sum(fn(c, w) * 3.0), argnums=(0, 1))(cores, weights)
        assert all(np.isfinite(_np(g)).all() for g in g_cores)
        g_w = _np(g_w)
        assert g_w[0, 1] == 0 and g_w[1, 1] == 0 and g_w[1, 2] == 0  # masked, masked, dropped
        # a zero user weight still has the row as its gradient (d(w * row)/dw)
        assert np.allclose(g_w[1, 0], 3.0 * _np(want[2]).sum() / 2, rtol=1e-6)
    # traced offsets starting past 0: the positions before them belong to no bag
    f = jax.jit(lambda c, o: ftt.tt_embedding_bag(c, jnp.array([0, 5, 7]), offsets=o, impl=impl))
    out = _np(f(cores, jnp.array([1, 2, 3])))
    assert np.allclose(out, _np(want[:2]), atol=1e-6)


def test_pool_kernels_skip_zero_weights_on_raw_targets():
    """flowtt_bag_pool_fwd and flowtt_bag_fwd (one chunk and several) never read a row
    whose weight is 0; pool_bwd's d_weights there is still dot(dout, row)."""
    if not ffi.available():
        pytest.skip("no extension")
    cores = make_cores(SMALL, seed=6)
    ids = jnp.asarray(np.arange(0, 1000, 7, dtype=np.int32)[:100])
    plan = ffi.plan(ids, 10, 1000)
    n = ids.shape[0]
    rows = np.array(ffi.rows_fwd(cores, plan))
    nan_rows = rows.copy()
    dead = np.asarray(plan.inverse)[::3]
    nan_rows[dead] = np.nan
    weights = np.ones(n, np.float32)
    weights[::3] = 0.0
    offsets = np.array([0, 10, 10, 55, 100], np.int32)
    out = target_pool_fwd(poisoned_call, nan_rows, plan, weights, offsets)
    want = target_pool_fwd(poisoned_call, rows, plan, weights, offsets)
    assert np.isfinite(_np(out)).all() and _np(out).tobytes() == _np(want).tobytes()
    for chunk in (64, 1 << 20):  # bag_fwd: several chunks, one chunk
        bag = ffi.bag_fwd(cores, plan, jnp.asarray(weights), jnp.asarray(offsets), chunk)
        assert np.allclose(_np(bag), _np(want), atol=1e-6)
    dout = np.random.default_rng(6).standard_normal((4, 8)).astype(np.float32)
    bag_ids = np.clip(np.searchsorted(offsets, np.arange(n), side="right") - 1, 0, 3).astype(np.int32)
    _, d_w = ffi.pool_bwd(
        jnp.asarray(dout), jnp.asarray(rows), jnp.asarray(weights), jnp.asarray(bag_ids), plan
    )
    expect = np.einsum("kd,kd->k", dout[bag_ids], rows[np.asarray(plan.inverse)])
    assert np.allclose(_np(d_w), expect, atol=1e-5)


@pytest.mark.parametrize("impl", ["auto", "reference"])  # auto: the kernels where this build has them
def test_batched_op_keeps_dropped_positions_zero(impl):
    specs = (SMALL, ftt.TTSpec.create(50, 8, 4, row_shape=(2, 5, 5), col_shape=SMALL.col_shape))
    layout = GroupLayout(specs)
    poisoned = _poisoned_cores(7)
    packed = layout.pack([poisoned, make_cores(specs[1], seed=8)])
    ids = jnp.array([5, -1, 7, 3, 70, 4], jnp.int16)  # -1 and 70 out of range of their tables
    offsets = jnp.array([0, 2, 3, 5, 6])  # features (table 0, table 1), batch 2
    fn = lambda p: tt_embedding_bag_group(p, layout, ids, offsets, (0, 1), impl=impl)
    out = _np(jax.jit(fn)(packed))
    assert np.isfinite(out).all()
    assert np.allclose(out[0, 0], _np(jax.jit(ftt.tt_lookup)(poisoned, jnp.array([5])))[0], atol=1e-6)
    grads = jax.jit(jax.grad(lambda p: jnp.sum(fn(p))))(packed)
    assert all(np.isfinite(_np(g)).all() for g in grads)


# ---- 5. traced offsets: clamped by default, checkify errors with oob="error" ----


@pytest.mark.parametrize("impl", IMPLS)
def test_traced_bad_offsets_checkify_under_oob_error(impl):
    cores = make_cores(SMALL, seed=9)
    ids = jnp.arange(6)

    def bags(offsets, oob):
        return ftt.tt_embedding_bag(cores, ids, offsets=offsets, oob=oob, impl=impl)

    checked = jax.jit(checkify.checkify(lambda o: bags(o, "error")))
    err, out = checked(jnp.array([0, 2, 6]))
    err.throw()  # valid offsets: no error
    for bad, what in (([0, 4, 2, 6], "decrease after index 1"), ([1, 6], "first 1"), ([0, 7], "last 7")):
        err, _ = checked(jnp.asarray(bad))
        with pytest.raises(checkify.JaxRuntimeError, match=what):
            err.throw()
    # the documented default: clamp into [0, n], running maximum
    clamped = jax.jit(lambda o: bags(o, "zero"))(jnp.array([0, 4, 2, 9]))  # -> [0, 4, 4, 6]
    rows = _np(jax.jit(ftt.to_dense)(cores))[:6].astype(np.float64)
    valid = np.stack([rows[:4].sum(0), np.zeros(rows.shape[1]), rows[4:].sum(0)])  # sums of the bags
    assert np.any(valid) and np.allclose(_np(clamped), valid, rtol=1e-6, atol=1e-7)


def test_traced_offsets_checkify_in_the_batched_op():
    layout = GroupLayout((SMALL,))
    packed = layout.pack([make_cores(SMALL, seed=10)])
    fn = lambda o: tt_embedding_bag_group(packed, layout, jnp.arange(4), o, (0,), oob="error")
    err, _ = jax.jit(checkify.checkify(fn))(jnp.array([0, 3, 1]))
    with pytest.raises(checkify.JaxRuntimeError, match="non-decreasing"):
        err.throw()


# ---- 6. forward mode and second order ----


def test_forward_mode_and_second_order_name_the_reference():
    cores = make_cores(SMALL, seed=11)
    ids, offsets = jnp.array([1, 2, 3, 4]), jnp.array([0, 2, 4])
    f = {
        impl: (lambda c, impl=impl: jnp.sum(ftt.tt_embedding_bag(c, ids, offsets=offsets, impl=impl) ** 2))
        for impl in IMPLS
    }
    lookup = lambda c: jnp.sum(ftt.tt_lookup(c, ids, impl="ffi") ** 2)
    for attempt in (
        lambda: jax.jvp(f["ffi"], (cores,), (cores,)),
        lambda: jax.jacfwd(f["ffi"])(cores),
        lambda: jax.hessian(f["ffi"])(cores),
        lambda: jax.grad(lambda c: jnp.sum(jax.grad(f["ffi"])(c)[0]))(cores),
        lambda: jax.jvp(lookup, (cores,), (cores,)),
    ):
        with pytest.raises(NotImplementedError, match="impl='reference'"):
            attempt()
    # the way out works, and agrees with the kernels' reverse-mode gradient
    _, tangent = jax.jit(lambda c: jax.jvp(f["reference"], (c,), (c,)))(cores)
    grads = jax.jit(jax.grad(f["ffi"]))(cores)
    assert np.isclose(float(tangent), sum(float(jnp.vdot(g, c)) for g, c in zip(grads, cores)), rtol=1e-5)


def test_batched_op_forward_mode_names_the_reference():
    layout = GroupLayout((SMALL,))
    packed = layout.pack([make_cores(SMALL, seed=12)])
    f = lambda p, impl: jnp.sum(
        tt_embedding_bag_group(p, layout, jnp.arange(4), jnp.array([0, 2, 4]), (0,), impl=impl)
    )
    if choose_impl("auto", None, layout) == "ffi":
        with pytest.raises(NotImplementedError, match="impl='reference'"):
            jax.jvp(lambda p: f(p, "ffi"), (packed,), (packed,))
    jax.jit(lambda p: jax.jvp(lambda p: f(p, "reference"), (p,), (p,)))(packed)


# ---- 7. jax.export across processes ----


def test_export_serialize_fresh_process_deserialize_call(tmp_path):
    pytest.importorskip("flatbuffers")  # jax.export's serialization needs it
    cores = make_cores(SMALL, seed=13)
    ids = jnp.array([3, 999, 3, 10, 500], jnp.int32)
    offsets = jnp.array([0, 2, 5], jnp.int32)
    w = jnp.linspace(0.5, 1.5, 5)

    def fn(c, w):
        return jax.value_and_grad(
            lambda c, w: jnp.sum(ftt.tt_embedding_bag(c, ids, offsets=offsets, weights=w) ** 2),
            argnums=(0, 1),
        )(c, w)

    with pytest.raises(ValueError, match="custom call"):
        jax.export.export(jax.jit(fn))(cores, w)  # the targets need the disabled checks
    exported = jax.export.export(jax.jit(fn), disabled_checks=ffi.disabled_safety_checks())(cores, w)
    assert {"flowtt_plan", "flowtt_bag_pool_bwd"} <= set(ffi._target_names())
    (tmp_path / "fn.bin").write_bytes(exported.serialize())
    want = jax.tree.leaves(jax.jit(fn)(cores, w))
    np.savez(tmp_path / "args.npz", *[_np(c) for c in cores], _np(w))
    script = textwrap.dedent(
        f"""
        import sys
        import jax, numpy as np
        import flowtt_jax  # registers the FFI targets
        exp = jax.export.deserialize(open({str(tmp_path / "fn.bin")!r}, "rb").read())
        a = np.load({str(tmp_path / "args.npz")!r})
        c = tuple(a[f"arr_{{k}}"] for k in range(3))
        out = jax.tree.leaves(exp.call(c, a["arr_3"]))
        np.savez({str(tmp_path / "out.npz")!r}, *[np.asarray(x) for x in out])
        """
    )
    # the child on the platform the module was exported for (this process's backend)
    env = {**os.environ, "JAX_PLATFORMS": "cuda" if jax.default_backend() == "gpu" else "cpu"}
    subprocess.run([sys.executable, "-c", script], check=True, env=env, cwd=REPO, timeout=300)
    got = np.load(tmp_path / "out.npz")
    assert len(got.files) == len(want)
    for k, x in enumerate(want):
        assert got[f"arr_{k}"].tobytes() == _np(x).tobytes()


# ---- 8. argument errors ----


@pytest.mark.parametrize(
    "call,error,match",
    [
        (lambda c: ftt.tt_lookup({"g1": c[0], "g2": c[1], "g3": c[2]}, [1]), TypeError, "got a dict"),
        (lambda c: ftt.tt_lookup(c[0], [1]), TypeError, r"single array of shape \(10, 1, 2, 4\)"),
        (lambda c: ftt.tt_embedding_bag(c[0], [1], offsets=[0, 1]), TypeError, "single array"),
        (lambda c: ftt.tt_lookup([c[0], "x", c[2]], [1]), TypeError, r"cores\[1\] must be an array"),
        (lambda c: ftt.tt_lookup((c[0],), [1]), ValueError, "at least 2 cores"),
        (lambda c: ftt.to_dense(c[0]), TypeError, "single array"),
        (
            lambda c: ftt.tt_embedding_bag(c, [1, 2], segment_ids=[0, 0], num_bags=-1),
            ValueError,
            "num_bags must be >= 0, got -1",
        ),
        (
            lambda c: ftt.tt_embedding_bag(c, [1, 2], segment_ids=[0, 0], num_bags=2.5),
            TypeError,
            "num_bags must be a static int",
        ),
        (
            lambda c: ftt.tt_embedding_bag(c, [1, 2], offsets=[0.0, 2.0]),
            TypeError,
            "offsets must be an integer",
        ),
        (
            lambda c: ftt.tt_embedding_bag(c, [1, 2], segment_ids=[0.0, 1.0], num_bags=2),
            TypeError,
            "segment_ids",
        ),
    ],
)
def test_bad_arguments_name_the_argument(call, error, match):
    with pytest.raises(error, match=match):
        call(make_cores(SMALL, seed=0))


# ---- 9. float16 ----


def test_float16_cores_take_the_kernels_as_documented():
    cores = make_cores(SMALL, seed=14, dtype=jnp.float16)
    if ffi.available():
        assert choose_impl("auto", cores) == "ffi"
    assert "float16" in embedding_bag.__doc__ and "float16" in ftt.tt_embedding_bag.__doc__
    assert "float16" in (REPO / "docs" / "op_contract.md").read_text()
    ids = jnp.array([1, 2, 999])
    rows = {impl: ftt.tt_lookup(cores, ids, impl=impl, dtype=jnp.float32) for impl in IMPLS}
    assert np.allclose(_np(rows["ffi"]), _np(rows["reference"]), atol=1e-6)


def test_dense_tables_follow_the_same_policies():
    """The dense bag and lookup (and the collection's dense packs): host int64 ids past
    int32 are out of range, not wrapped; a dropped position adds nothing, even next to
    an inf row."""
    from flowtt_jax.collection import dense_embedding_bag, dense_lookup

    table = jnp.arange(12.0).reshape(6, 2).at[0].set(jnp.inf)
    rows = dense_lookup(table, np.array([2**32 + 1, 1], np.int64))
    np.testing.assert_array_equal(rows, [[0.0, 0.0], [2.0, 3.0]])
    bag = dense_embedding_bag(table, jnp.array([[0, 1]]), mask=jnp.array([[False, True]]))
    np.testing.assert_array_equal(bag, [[2.0, 3.0]])


def test_cuda_architecture_mismatch_names_the_gpu_and_the_fix():
    """A GPU the CUDA build has no code for is refused at the kernels' choice, naming both
    architectures (impl="auto" then runs the reference with a warning; "ffi" raises)."""
    assert ffi.arch_mismatch("90", "9.0") is None
    assert ffi.arch_mismatch("80,90-real", "8.0") is None
    assert ffi.arch_mismatch("90", "10.0") is None  # a plain entry embeds PTX, JIT-compiled there
    assert ffi.arch_mismatch("90-virtual", "12.0") is None
    msg = ffi.arch_mismatch("90-real", "8.6")
    assert msg and "sm_90-real" in msg and "sm_86" in msg and "FLOWTT_CUDA_ARCHITECTURES=86" in msg
    assert "sm_80" in ffi.arch_mismatch("90a", "8.0")
    cuda = ffi._import("_flowtt_cuda")
    if cuda is not None and hasattr(cuda, "cuda_architectures"):
        assert ffi.arch_mismatch(cuda.cuda_architectures(), "9.0") is None  # the default build: sm_90
