"""Public ops: FFI path against the pure-JAX reference and hand-computed bags."""

import functools
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify
from jax.test_util import check_grads

import flowtt_jax as ftt
from flowtt_jax.kernels import ffi
from flowtt_jax.ops.pooled import bag_chunk_rows
from tests.helpers import (
    ID_KINDS,
    SLOW_REFERENCE,
    assert_no_host_callback,
    custom_call_targets,
    make_cores,
    make_ids,
    random_offsets,
    rel_err,
)

SPECS = {
    "d16r8": ftt.TTSpec.create(1000, 16, 8),
    "d32r16": ftt.TTSpec.create(5000, 32, 16, row_shape=(10, 20, 25)),
    "odd": ftt.TTSpec.create(97, 12, (3, 5), row_shape=(3, 5, 7), col_shape=(2, 3, 2)),
}


@functools.partial(jax.jit, static_argnums=1)
def _dense_f64(cores, n):
    return ftt.to_dense([c.astype(jnp.float64) for c in cores], n)


def dense_of(cores, n):
    """The table in float64, one program per shape."""
    with jax.enable_x64(True):
        return np.asarray(_dense_f64(cores, n))


def _bag_loss(cores, weights, ids, offsets, impl):
    out = ftt.tt_embedding_bag(cores, ids, offsets=offsets, weights=weights, mode="mean", impl=impl)
    probe = jnp.cos(jnp.arange(out.size, dtype=out.dtype).reshape(out.shape))
    return jnp.sum(out * probe)


@functools.partial(jax.jit, static_argnames="mode")
def _bag_f64(c64, ids, offsets, weights, mode):
    return ftt.tt_embedding_bag(c64, ids, offsets=offsets, weights=weights, mode=mode, impl="reference")


def bag_f64(cores, ids, offsets, weights=None, mode="sum"):
    """The reference in float64 (cores and weights upcast), one program per shape."""
    with jax.enable_x64(True):
        c64 = [jnp.asarray(c, jnp.float64) for c in cores]
        w64 = None if weights is None else jnp.asarray(weights, jnp.float64)
        return np.asarray(_bag_f64(c64, jnp.asarray(ids), jnp.asarray(offsets), w64, mode))


#: the float64 reference's gradients of ``_bag_loss`` (cores, weights), one program per shape
_ref_bag_grad = jax.jit(
    lambda c, w, ids, offsets: jax.grad(_bag_loss, argnums=(0, 1))(c, w, ids, offsets, "reference")
)
#: ``_bag_loss``'s gradients (cores, weights) by ``impl``, one program per shape
_bag_grad = jax.jit(jax.grad(_bag_loss, argnums=(0, 1)), static_argnums=4)
_mean_bag_ffi = jax.jit(
    lambda c, i, o, w: ftt.tt_embedding_bag(c, i, offsets=o, weights=w, mode="mean", impl="ffi")
)
_lookup = jax.jit(ftt.tt_lookup, static_argnames="impl")


def hand_bags(table, ids, bag_of, num_bags, weights, mode, keep=None):
    """Numpy loop over ids: the definition of sum / mean / sqrtn pooling."""
    out = np.zeros((num_bags, table.shape[1]))
    lengths = np.zeros(num_bags)
    for k, (i, b) in enumerate(zip(ids, bag_of)):
        if b < 0 or b >= num_bags or (keep is not None and not keep[k]):
            continue
        out[b] += (1.0 if weights is None else weights[k]) * table[i]
        lengths[b] += 1
    if mode == "mean":
        out /= np.maximum(lengths, 1)[:, None]
    elif mode == "sqrtn":
        out /= np.sqrt(np.maximum(lengths, 1))[:, None]
    return out


@pytest.mark.parametrize("impl", ["ffi", SLOW_REFERENCE])
@pytest.mark.parametrize("shape", [(), (1,), (37,), (4, 9), (2, 3, 5)])
def test_lookup_equals_dense_rows(impl, shape):
    spec = SPECS["d16r8"]
    cores = make_cores(spec, seed=len(shape))
    ids = make_ids("uniform", int(np.prod(shape)), spec.num_embeddings, seed=3).reshape(shape)
    rows = _lookup(cores, ids, impl=impl)
    assert rows.shape == shape + (16,)
    assert rel_err(rows, dense_of(cores, spec.num_embeddings)[ids]) < 1e-5


@pytest.mark.parametrize("impl", ["ffi", SLOW_REFERENCE])
@pytest.mark.parametrize("mode", ["sum", "mean", "sqrtn"])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("form", ["offsets", "segment_ids", "padded", "padded_mask"])
def test_bags_equal_hand_computed(impl, mode, weighted, form):
    spec = SPECS["odd"]
    cores = make_cores(spec, seed=11)
    table = dense_of(cores, spec.num_embeddings)
    rng = np.random.default_rng(zlib.crc32(f"{mode}-{weighted}-{form}".encode()))
    num_bags, n = 9, 60
    keep = None
    if form.startswith("padded"):
        length = 7
        ids = rng.integers(0, spec.num_embeddings, (num_bags, length)).astype(np.int32)
        bag_of = np.repeat(np.arange(num_bags), length)
        mask = rng.random((num_bags, length)) < 0.6 if form == "padded_mask" else None
        if mask is not None:
            mask[2] = False  # one fully masked (empty) bag
            keep = mask.reshape(-1)
        kw = dict(mask=mask)
        flat = ids.reshape(-1)
    elif form == "offsets":
        ids = flat = rng.integers(0, spec.num_embeddings, n).astype(np.int32)
        offsets = random_offsets(num_bags, n, seed=5)
        bag_of = np.searchsorted(offsets, np.arange(n), side="right") - 1
        kw = dict(offsets=offsets)
    else:
        ids = flat = rng.integers(0, spec.num_embeddings, n).astype(np.int32)
        bag_of = rng.integers(-1, num_bags + 1, n)  # unsorted, some outside [0, B): dropped
        bag_of[bag_of == 4] = 5  # bag 4 empty
        kw = dict(segment_ids=bag_of, num_bags=num_bags)
    weights = rng.standard_normal(ids.shape).astype(np.float32) if weighted else None
    out = ftt.tt_embedding_bag(cores, ids, weights=weights, mode=mode, impl=impl, **kw)
    expected = hand_bags(
        table, flat, bag_of, num_bags, None if weights is None else weights.reshape(-1), mode, keep
    )
    assert out.shape == (num_bags, spec.embedding_dim)
    assert rel_err(out, expected) < 1e-5


@pytest.mark.parametrize("spec_name", sorted(SPECS))
@pytest.mark.parametrize("kind", ID_KINDS + ("single",))
def test_ffi_matches_reference_forward_and_grads(spec_name, kind):
    spec = SPECS[spec_name]
    n = 1 if kind == "single" else 400
    ids = make_ids("uniform" if kind == "single" else kind, n, spec.num_embeddings, seed=7)
    offsets = np.array([0, 1], np.int32) if n == 1 else random_offsets(50, n, seed=8)
    cores = make_cores(spec, seed=9)
    weights = np.random.default_rng(10).standard_normal(n).astype(np.float32)

    out = _mean_bag_ffi(cores, ids, offsets, weights)
    ref = bag_f64(cores, ids, offsets=offsets, weights=weights, mode="mean")
    assert rel_err(out, ref) < 1e-5

    g_ffi = _bag_grad(cores, weights, ids, offsets, "ffi")
    with jax.enable_x64(True):
        c64 = tuple(jnp.asarray(c, jnp.float64) for c in cores)
        g_ref = _ref_bag_grad(c64, jnp.asarray(weights, jnp.float64), jnp.asarray(ids), jnp.asarray(offsets))
    for a, b in zip(jax.tree.leaves(g_ffi), jax.tree.leaves(g_ref)):
        assert a.shape == b.shape
        assert rel_err(a, b) < 1e-5


def test_huge_skew_one_hot_group():
    """Thousands of ids in one prefix group plus a heavy duplicate: FFI equals reference."""
    spec = ftt.TTSpec.create(10**6, 32, 16, row_shape=(100, 100, 100))
    rng = np.random.default_rng(0)
    hot_prefix = 4242 * 100
    ids = np.concatenate(
        [
            hot_prefix + rng.integers(0, 100, 5000),  # one group, all 100 last-core rows
            np.full(3000, spec.num_embeddings - 1),  # last row, heavily duplicated
            rng.integers(0, spec.num_embeddings, 2000),
        ]
    ).astype(np.int32)
    rng.shuffle(ids)
    offsets = random_offsets(700, ids.size, seed=1)
    cores = make_cores(spec, seed=2)
    out = jax.jit(lambda c: ftt.tt_embedding_bag(c, ids, offsets=offsets, impl="ffi"))(cores)
    assert rel_err(out, bag_f64(cores, ids, offsets=offsets)) < 1e-5
    g = jax.jit(jax.grad(lambda c: ftt.tt_embedding_bag(c, ids, offsets=offsets, impl="ffi").sum()))(cores)
    with jax.enable_x64(True):
        c64 = tuple(jnp.asarray(c, jnp.float64) for c in cores)
        g_ref = jax.jit(
            jax.grad(lambda c: ftt.tt_embedding_bag(c, ids, offsets=offsets, impl="reference").sum())
        )(c64)
    for a, b in zip(g, g_ref):
        assert rel_err(a, b) < 1e-5


def test_check_grads_reference(x64):
    spec = SPECS["odd"]
    cores = tuple(jnp.asarray(c, jnp.float64) for c in make_cores(spec, seed=4))
    ids = make_ids("zipf1.2", 40, spec.num_embeddings, seed=4)
    offsets = random_offsets(8, 40, seed=4)
    weights = jnp.asarray(np.random.default_rng(4).standard_normal(40))
    f = lambda c, w: ftt.tt_embedding_bag(c, ids, offsets=offsets, weights=w, mode="sqrtn", impl="reference")
    check_grads(jax.jit(f), (cores, weights), order=2, modes=["fwd", "rev"])


def test_check_grads_ffi():
    spec = SPECS["odd"]
    cores = make_cores(spec, seed=5)
    ids = make_ids("zipf1.05", 40, spec.num_embeddings, seed=5)
    offsets = random_offsets(8, 40, seed=5)
    weights = jnp.asarray(np.random.default_rng(5).standard_normal(40), jnp.float32)
    f = lambda c, w: ftt.tt_embedding_bag(c, ids, offsets=offsets, weights=w, mode="sum", impl="ffi")
    check_grads(jax.jit(f), (cores, weights), order=1, modes=["rev"], atol=2e-2, rtol=2e-2, eps=1e-2)


ROWS_OPS = {"flowtt_tt_rows_fwd", "flowtt_bag_pool_fwd", "flowtt_bag_pool_bwd", "flowtt_tt_rows_bwd"}


def test_default_impl_is_ffi_and_jits_without_host_callbacks():
    """The forward alone is flowtt_plan + flowtt_bag_fwd (no [n, D] rows), after
    flowtt_tb_bags for CSR bags; a gradient goes through the custom_vjp forward (rows_fwd +
    pool_fwd, rows kept) and backward."""
    spec = SPECS["d32r16"]
    cores = make_cores(spec, seed=1)
    ids = jnp.asarray(make_ids("zipf1.05", 300, spec.num_embeddings, seed=1))
    offsets = jnp.asarray(random_offsets(30, 300, seed=1))
    fwd = jax.jit(lambda c, i, o: ftt.tt_embedding_bag(c, i, offsets=o))
    lookup = jax.jit(lambda c, i: ftt.tt_lookup(c, i.reshape(30, 10)))
    bags = {"flowtt_tb_bags"}
    for lowered, prep in ((fwd.lower(cores, ids, offsets), bags), (lookup.lower(cores, ids), set())):
        assert custom_call_targets(lowered.as_text()) == {"flowtt_plan", "flowtt_bag_fwd"} | prep
        assert_no_host_callback(lowered.compile().as_text())
    for f, prep in (
        (lambda c, i, o: ftt.tt_embedding_bag(c, i, offsets=o), bags),
        (lambda c, i, o: ftt.tt_lookup(c, i), set()),
    ):
        # traced right away, within this iteration
        train = jax.jit(jax.value_and_grad(lambda c, i, o: jnp.sum(f(c, i, o) ** 2)))  # noqa: B023
        lowered = train.lower(cores, ids, offsets)
        assert custom_call_targets(lowered.as_text()) == {"flowtt_plan"} | ROWS_OPS | prep
        assert_no_host_callback(lowered.compile().as_text())
    assert rel_err(fwd(cores, ids, offsets), bag_f64(cores, ids, offsets=offsets)) < 1e-5
    assert rel_err(lookup(cores, ids), dense_of(cores, spec.num_embeddings)[ids].reshape(30, 10, 32)) < 1e-5


def test_no_grad_forward_chunk_budget():
    """flowtt_bag_fwd's chunk_rows: ROWS_CHUNK_BYTES of rows, or ROWS_CHUNK_OUTPUTS outputs
    [B, D] if more (each chunk re-reads and re-writes the output), at least 64; the op
    passes bag_chunk_rows(D, B) to the kernel."""
    assert bag_chunk_rows(32, 32768) == (40 << 20) // 128  # S1: the bytes budget
    assert bag_chunk_rows(128, 65536) == 8 * 65536  # D128 B65536: eight outputs
    assert bag_chunk_rows(2**20, 1) == 64
    spec = SPECS["d32r16"]
    cores = [jax.ShapeDtypeStruct(s, jnp.float32) for s in spec.core_shapes]
    fwd = jax.jit(lambda c, i, o: ftt.tt_embedding_bag(c, i, offsets=o, impl="ffi"))
    for num_bags in (30, 50_000):
        ids = jax.ShapeDtypeStruct((2 * num_bags,), jnp.int32)
        offsets = jax.ShapeDtypeStruct((num_bags + 1,), jnp.int32)
        text = fwd.lower(cores, ids, offsets).as_text()
        assert f"chunk_rows = {bag_chunk_rows(32, num_bags)} : i64" in text


def test_forward_without_grad_equals_training_forward():
    """The primal (flowtt_bag_fwd, one chunk here) and the value under value_and_grad
    (rows_fwd + pool_fwd) are equal bit for bit."""
    spec = SPECS["d32r16"]
    cores = make_cores(spec, seed=3)
    ids = make_ids("zipf1.2", 2000, spec.num_embeddings, seed=3)
    offsets = random_offsets(150, 2000, seed=3)
    weights = np.random.default_rng(3).standard_normal(2000).astype(np.float32)
    bag = lambda c, w: ftt.tt_embedding_bag(c, ids, offsets=offsets, weights=w, impl="ffi")
    out = jax.jit(bag)(cores, weights)

    def loss(c, w):
        out = bag(c, w)
        return jnp.sum(out * out), out

    (_, value), _ = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(cores, weights)
    assert np.all(np.isfinite(out)) and np.asarray(out).tobytes() == np.asarray(value).tobytes()


def test_gradients_bitwise_reproducible():
    spec = SPECS["d32r16"]
    cores = make_cores(spec, seed=2)
    ids = make_ids("zipf1.05", 3000, spec.num_embeddings, seed=2)
    offsets = random_offsets(200, 3000, seed=2)
    weights = np.random.default_rng(2).standard_normal(3000).astype(np.float32)
    first = jax.device_get(_bag_grad(cores, weights, ids, offsets, "ffi"))
    second = jax.device_get(_bag_grad(cores, weights, ids, offsets, "ffi"))
    for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(second)):
        assert a.tobytes() == b.tobytes()


@pytest.mark.parametrize("impl", ["ffi", SLOW_REFERENCE])
def test_vmap_over_ids_and_over_cores(impl):
    spec = SPECS["d16r8"]
    cores = make_cores(spec, seed=3)
    ids = np.stack([make_ids("zipf1.2", 30, spec.num_embeddings, seed=s) for s in range(4)])
    offsets = random_offsets(6, 30, seed=3)
    bag = functools.partial(ftt.tt_embedding_bag, offsets=offsets, impl=impl)
    batched = jax.jit(jax.vmap(bag, in_axes=(None, 0)))(cores, ids)
    for b in range(4):
        assert rel_err(batched[b], bag_f64(cores, ids[b], offsets=offsets)) < 1e-5
    stacked = [jnp.stack([c, 2 * c]) for c in cores]
    both = jax.jit(jax.vmap(lambda c, i: ftt.tt_lookup(c, i, impl=impl)))(stacked, ids[:2])
    assert rel_err(both[1], 8 * dense_of(cores, spec.num_embeddings)[ids[1]]) < 1e-5
    grads = jax.jit(jax.vmap(jax.grad(lambda c, i: bag(c, i).sum()), in_axes=(None, 0)))(cores, ids)
    single = jax.jit(jax.grad(lambda c: bag(c, ids[2]).sum()))(cores)
    for gb, gs in zip(grads, single):
        assert rel_err(gb[2], gs) < 1e-5


@pytest.mark.parametrize("impl", ["ffi", "reference"])
def test_empty_inputs(impl):
    spec = SPECS["d16r8"]
    cores = make_cores(spec, seed=6)
    empty = np.zeros((0,), np.int32)
    ids = make_ids("uniform", 5, spec.num_embeddings, seed=6)

    def calls(c):  # one program; the inputs host constants, as in an eager call
        bag = lambda c: ftt.tt_embedding_bag(c, empty, offsets=np.zeros(4, np.int32), impl=impl)
        # All bags empty but ids present (positions outside every bag are ignored).
        outside = ftt.tt_embedding_bag(c, ids, segment_ids=np.full(5, 7), num_bags=3, impl=impl)
        return ftt.tt_lookup(c, empty, impl=impl), bag(c), jax.grad(lambda c: bag(c).sum())(c), outside

    rows, out, g, outside = jax.jit(calls)(cores)
    assert rows.shape == (0, 16)
    np.testing.assert_array_equal(out, np.zeros((3, 16)))
    assert all(np.all(np.asarray(x) == 0) for x in g)
    np.testing.assert_array_equal(outside, np.zeros((3, 16)))


@pytest.mark.parametrize("impl", ["ffi", "reference"])
def test_oob_policies(impl):
    spec = ftt.TTSpec.create(90, 8, 4, row_shape=(4, 5, 5))  # prod 100 > N = 90
    cores = make_cores(spec, seed=8)
    table = dense_of(cores, 90)
    ids = np.array([0, 89, 90, 99, -1, 1000, 5], np.int32)
    with pytest.raises(ValueError, match="out of range"):
        ftt.tt_lookup(cores, ids, num_embeddings=90, oob="error", impl=impl)
    clip = ftt.tt_lookup(cores, ids, num_embeddings=90, oob="clip", impl=impl)
    assert rel_err(clip, table[np.clip(ids, 0, 89)]) < 1e-5
    zero = np.asarray(ftt.tt_lookup(cores, ids, num_embeddings=90, oob="zero", impl=impl))
    valid = (ids >= 0) & (ids < 90)
    np.testing.assert_array_equal(zero[~valid], 0.0)
    assert rel_err(zero[valid], table[ids[valid]]) < 1e-5
    # Inside jit, "error" is a checkify check.
    f = checkify.checkify(
        jax.jit(lambda i: ftt.tt_lookup(cores, i, num_embeddings=90, oob="error", impl=impl))
    )
    err, _ = f(jnp.asarray(ids))
    assert err.get() is not None and "out of range" in err.get()
    err, rows = f(jnp.asarray(ids[valid]))
    assert err.get() is None and rel_err(rows, table[ids[valid]]) < 1e-5


def test_bfloat16_cores_compute_in_float32():
    spec = SPECS["d32r16"]
    cores = make_cores(spec, seed=12, dtype=jnp.bfloat16)
    ids = make_ids("uniform", 200, spec.num_embeddings, seed=12)
    offsets = random_offsets(20, 200, seed=12)
    out = jax.jit(lambda c: ftt.tt_embedding_bag(c, ids, offsets=offsets, impl="ffi"))(cores)
    assert out.dtype == jnp.bfloat16
    exact = bag_f64([np.asarray(c, np.float32) for c in cores], ids, offsets=offsets)
    assert rel_err(np.asarray(out, np.float32), exact) < 1e-2
    g = jax.jit(jax.grad(lambda c: ftt.tt_embedding_bag(c, ids, offsets=offsets).astype(jnp.float32).sum()))(
        cores
    )
    assert all(x.dtype == jnp.bfloat16 for x in g)


def test_four_cores_fall_back_to_reference():
    spec = ftt.TTSpec.create(3000, 16, 4, num_cores=4)
    cores = make_cores(spec, seed=13)
    ids = make_ids("uniform", 50, 3000, seed=13)
    assert rel_err(jax.jit(ftt.tt_lookup)(cores, ids), dense_of(cores, 3000)[ids]) < 1e-5
    with pytest.raises(ValueError, match="3 cores"):
        ftt.tt_lookup(cores, ids, impl="ffi")


@pytest.mark.parametrize(
    "call,error,match",
    [
        (
            lambda c: ftt.tt_embedding_bag(c, np.arange(5), offsets=np.array([0, 3, 2, 5])),
            ValueError,
            "non-decreasing",
        ),
        (lambda c: ftt.tt_embedding_bag(c, np.arange(5), offsets=np.array([0, 3, 4])), ValueError, "offsets"),
        (
            lambda c: ftt.tt_embedding_bag(c, np.arange(5), offsets=np.array([0, 5]), weights=np.ones(4)),
            ValueError,
            "weights shape",
        ),
        (
            lambda c: ftt.tt_embedding_bag(c, np.arange(5), segment_ids=np.zeros(5, int)),
            ValueError,
            "num_bags",
        ),
        (lambda c: ftt.tt_embedding_bag(c, np.arange(5)), ValueError, "padded"),
        (lambda c: ftt.tt_embedding_bag(c, np.ones((2, 2), np.int32), mode="max"), ValueError, "mode"),
        (lambda c: ftt.tt_lookup(c, np.ones(3, np.float32)), TypeError, "integer"),
        (lambda c: ftt.tt_lookup(c, np.ones(3, np.int32), impl="gpu"), ValueError, "impl"),
        (lambda c: ftt.tt_lookup(c, np.ones(3, np.int32), oob="wrap"), ValueError, "oob"),
    ],
)
def test_bad_input_raises_clearly(call, error, match):
    with pytest.raises(error, match=match):
        call(make_cores(SPECS["d16r8"], seed=0))


@pytest.mark.parametrize("core_dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("impl", ["ffi", SLOW_REFERENCE])
def test_low_precision_cores_accumulate_in_float32(core_dtype, impl):
    spec = SPECS["d32r16"]
    cores = make_cores(spec, seed=14, dtype=core_dtype)
    ids = make_ids("zipf1.05", 300, spec.num_embeddings, seed=14)
    offsets = random_offsets(30, 300, seed=14)
    exact = bag_f64([np.asarray(c, np.float32) for c in cores], ids, offsets=offsets)

    def calls(c):  # one program
        out = ftt.tt_embedding_bag(c, ids, offsets=offsets, impl=impl, dtype=jnp.float32)
        return out, ftt.tt_lookup(c, ids, impl=impl, dtype=jnp.float32), ftt.tt_lookup(c, ids, impl=impl)

    out, rows, default = jax.jit(calls)(cores)
    assert out.dtype == jnp.float32 and rel_err(out, exact) < 1e-5
    assert rows.dtype == jnp.float32
    assert rel_err(rows, dense_of(cores, spec.num_embeddings)[ids]) < 1e-5
    assert default.dtype == core_dtype


def test_auto_fallback_to_reference_warns_once_per_reason(monkeypatch):
    """``impl="auto"`` on the reference says why, once per process and reason; the kernels'
    path and an explicit ``impl="reference"`` say nothing."""
    import warnings

    from flowtt_jax import fallback

    monkeypatch.setattr(fallback, "_SEEN", set())
    two = ftt.init_cores(jax.random.key(0), ftt.TTSpec.create(300, 8, 4, num_cores=2))
    ids = jnp.asarray([0, 5, 299])
    with pytest.warns(fallback.ReferenceFallbackWarning, match="got 2 cores"):
        ftt.tt_lookup(two, ids)
    with warnings.catch_warnings():
        warnings.simplefilter("error", fallback.ReferenceFallbackWarning)
        ftt.tt_lookup(two, ids)  # the same reason: no second warning
        ftt.tt_lookup(two, ids, impl="reference")
        if ffi.available():
            three = ftt.init_cores(jax.random.key(0), ftt.TTSpec.create(300, 8, 4))
            ftt.tt_lookup(three, ids)  # the kernels
