"""The CUDA path (impl="ffi" on a GPU) against the reference, forward and backward.

Marked ``gpu``; skipped unless a GPU backend and the compiled ``_flowtt_cuda``
extension exist. The reference runs in float64 on the CPU (no TF32 anywhere); the
CUDA results are fp32 on the GPU. Every case draws fresh random cores, ids, offsets
and weights from the ``seeds`` fixture (its start is printed; ``FLOWTT_TEST_SEED``
repeats a run). Outputs of the raw targets are poisoned (aliased to NaN buffers); rows
and d_rows past num_unique are unspecified (the kernels leave them unwritten), so only
their [:num_unique] part is checked.
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flowtt_jax as ftt
from flowtt_jax.kernels import ffi
from flowtt_jax.kernels.plan import make_plan
from flowtt_jax.tt import reference
from tests.helpers import (
    assert_same,
    bag_fwd_shape_errors,
    bag_ids_of,
    check_bag_fwd,
    check_pool_batch_major,
    check_rows_past_num_unique_unread,
    cuda_device,
    custom_call_targets,
    hot_prefix_ids,
    make_ids,
    poisoned_call,
    random_offsets,
    rel_err,
    target_pool_bwd,
    target_pool_fwd,
    target_rows_bwd,
    target_rows_fwd,
)

GPU = cuda_device()
CPU = jax.devices("cpu")[0]
if os.environ.get("FLOWTT_TEST_CUDA_ON_CPU") == "1":  # dev aid: run this file's logic on the CPU kernels
    GPU = CPU
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(GPU is None, reason="needs a GPU backend and the _flowtt_cuda extension"),
]

TOL = 1e-5
KINDS = ("uniform", "zipf1.05", "zipf1.2", "all_equal", "last_row", "single")
# (D, r) pairs covering D in {16,32,64,128} and r in {8,16,32,64}
SHAPES = ((16, 8), (32, 16), (64, 32), (128, 64), (32, 64), (128, 8), (16, 32), (64, 16))

_poisoned = functools.partial(poisoned_call, device=GPU)


def _case(seeds, kind, dim, rank, n=3000, num_bags=300, num_embeddings=20000, row_shape=None):
    """Fresh random cores, ids, CSR offsets, weights and a cotangent, each from the next
    seed of ``seeds`` (the ``seeds`` fixture)."""
    spec = ftt.TTSpec.create(num_embeddings, dim, rank, **({"row_shape": row_shape} if row_shape else {}))
    cores = ftt.init_cores(jax.random.key(next(seeds)), spec, std=1.0)
    if kind == "single":
        n, num_bags = 1, 1
        ids = np.array([np.random.default_rng(next(seeds)).integers(0, num_embeddings)], np.int32)
        offsets = np.array([0, 1], np.int32)
    else:
        ids = make_ids(kind, n, num_embeddings, seed=next(seeds))
        offsets = random_offsets(num_bags, n, seed=next(seeds))
    rng = np.random.default_rng(next(seeds))
    weights = rng.uniform(0.5, 1.5, n).astype(np.float32)
    cot = rng.standard_normal((num_bags, dim)).astype(np.float32)
    return spec, [np.asarray(c) for c in cores], ids, offsets, weights, cot


def _loss_fn(impl, mode, ids, offsets):
    def loss(cores, weights, cot):
        out = ftt.tt_embedding_bag(tuple(cores), ids, offsets=offsets, weights=weights, mode=mode, impl=impl)
        return jnp.sum(out * cot), out

    return jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)


def _run_gpu(mode, cores, ids, offsets, weights, cot):
    put = lambda x: jax.device_put(x, GPU)
    f = jax.jit(lambda c, w, i, o, ct: _loss_fn("ffi", mode, i, o)(c, w, ct))
    (loss, out), (gc, gw) = f([put(c) for c in cores], put(weights), put(ids), put(offsets), put(cot))
    return np.asarray(out), [np.asarray(g) for g in gc], np.asarray(gw), f


def _run_ref(mode, cores, ids, offsets, weights, cot):
    with jax.enable_x64(True), jax.default_device(CPU):
        c64 = [jnp.asarray(c, jnp.float64) for c in cores]
        f = _loss_fn("reference", mode, jnp.asarray(ids), jnp.asarray(offsets))
        (loss, out), (gc, gw) = f(c64, jnp.asarray(weights, jnp.float64), jnp.asarray(cot, jnp.float64))
        return np.asarray(out), [np.asarray(g) for g in gc], np.asarray(gw)


def _dweights_err(gw, rgw, cores, ids, offsets, cot) -> float:
    """Error of d_weights[p] = s_b <dout[b], row(ids[p])> (b = bag of p, s_b <= 1 the mode's
    scale): relative to the values, or, where those dot products cancel (one id can give ~0),
    relative to the norm over p of |dout[b]| |row(ids[p])|, the dot products' condition."""
    with jax.enable_x64(True), jax.default_device(CPU):
        rows = np.asarray(
            ftt.tt_lookup(
                tuple(jnp.asarray(c, jnp.float64) for c in cores), jnp.asarray(ids), impl="reference"
            )
        )
    bag = np.clip(np.searchsorted(offsets, np.arange(len(ids)), side="right") - 1, 0, len(offsets) - 2)
    scale = np.linalg.norm(np.asarray(cot, np.float64)[bag], axis=1) * np.linalg.norm(rows, axis=1)
    diff = np.linalg.norm(np.asarray(gw, np.float64) - rgw)
    return min(rel_err(gw, rgw), diff / max(float(np.linalg.norm(scale)), 1e-300))


def _check(mode, cores, ids, offsets, weights, cot, bitwise=True):
    out, gc, gw, f = _run_gpu(mode, cores, ids, offsets, weights, cot)
    rout, rgc, rgw = _run_ref(mode, cores, ids, offsets, weights, cot)
    assert rel_err(out, rout) <= TOL, ("forward", rel_err(out, rout))
    for k, (g, r) in enumerate(zip(gc, rgc)):
        assert rel_err(g, r) <= TOL, (f"dcore{k}", rel_err(g, r))
    dw_err = _dweights_err(gw, rgw, cores, ids, offsets, cot)
    assert dw_err <= TOL, ("dweights", dw_err)
    if bitwise:
        out2, gc2, gw2, _ = _run_gpu(mode, cores, ids, offsets, weights, cot)
        assert np.array_equal(out, out2)
        for g, g2 in zip(gc, gc2):
            assert np.array_equal(g, g2), "core gradient not bitwise reproducible"
        assert np.array_equal(gw, gw2)


@pytest.mark.parametrize("dim,rank", SHAPES)
@pytest.mark.parametrize("kind", KINDS)
def test_bag_matches_reference(kind, dim, rank, seeds):
    spec, cores, ids, offsets, weights, cot = _case(seeds, kind, dim, rank)
    _check("sum", cores, ids, offsets, weights, cot)


@pytest.mark.parametrize("dim", (4, 8, 6, 9))
def test_small_and_odd_dims(dim, seeds):
    """Pooling teams of 1 and 2 lanes (D = 4, 8) and rows of D % 4 != 0 (the scalar path)."""
    spec, cores, ids, offsets, weights, cot = _case(seeds, "zipf1.05", dim, 8)
    _check("sum", cores, ids, offsets, weights, cot)


@pytest.mark.parametrize("mode", ["mean", "sqrtn"])
def test_modes(mode, seeds):
    spec, cores, ids, offsets, weights, cot = _case(seeds, "zipf1.05", 32, 32)
    _check(mode, cores, ids, offsets, weights, cot, bitwise=False)


@pytest.mark.parametrize("dim,rank", [(32, 32), (128, 64)])
def test_hot_prefix_groups(dim, rank, seeds):
    """Groups with hundreds of unique ids (split into chunks, P shared via checkpoint)."""
    spec, cores, ids, offsets, weights, cot = _case(
        seeds, "uniform", dim, rank, n=6000, num_bags=400, num_embeddings=100000, row_shape=(10, 10, 1000)
    )
    ids = np.random.default_rng(next(seeds)).integers(0, 3000, ids.shape[0]).astype(np.int32)
    _check("sum", cores, ids, offsets, weights, cot)


@pytest.mark.parametrize("dim,rank", [(32, 32), (128, 64)])
def test_dg2_columns_with_empty_tiles(dim, rank, seeds):
    """dG2[i2] is built across the i1 blocks of 32 (tiles) in order: columns whose first
    tiles have no groups, columns with a gap between tiles and empty columns (p1 = 100: four
    tiles per column)."""
    p1, p2, p3 = 100, 20, 50
    spec, cores, ids, offsets, weights, cot = _case(
        seeds, "uniform", dim, rank, n=4000, num_bags=300, num_embeddings=p1 * p2 * p3, row_shape=(p1, p2, p3)
    )
    rng = np.random.default_rng(next(seeds))
    i2 = rng.integers(0, p2 - 4, ids.shape[0])  # columns p2-4.. stay empty
    late = rng.integers(70, p1, ids.shape[0])  # the last two tiles only
    gap = rng.choice(np.array([3, 99]), ids.shape[0])  # the first and the last tile
    i1 = np.where(i2 % 2 == 0, late, gap)
    ids = ((i1 * p2 + i2) * p3 + rng.integers(0, p3, ids.shape[0])).astype(np.int32)
    _check("sum", cores, ids, offsets, weights, cot)


def test_tt_lookup_matches_reference(seeds):
    spec, cores, ids, offsets, weights, cot = _case(seeds, "zipf1.2", 64, 16)
    ids2 = ids.reshape(-1, 3)
    put = lambda x: jax.device_put(x, GPU)
    got = jax.jit(lambda c, i: ftt.tt_lookup(tuple(c), i, impl="ffi"))([put(c) for c in cores], put(ids2))
    with jax.enable_x64(True), jax.default_device(CPU):
        ref = ftt.tt_lookup(
            tuple(jnp.asarray(c, jnp.float64) for c in cores), jnp.asarray(ids2), impl="reference"
        )
    assert got.shape == ref.shape
    assert rel_err(got, ref) <= TOL


@pytest.mark.parametrize("kind", ["uniform", "zipf1.05", "all_equal"])
@pytest.mark.parametrize("dim,rank", [(32, 32), (128, 64)])
def test_raw_targets_write_every_element(kind, dim, rank, seeds):
    assert "CUDA" in ffi._register() or GPU is CPU
    spec, cores, ids, offsets, weights, cot = _case(seeds, kind, dim, rank)
    plan = make_plan(jax.device_put(jnp.asarray(ids), GPU), spec.row_shape[-1])
    nu = int(plan.counts[0])
    rows = target_rows_fwd(_poisoned, cores, plan)
    assert np.all(np.isfinite(rows[:nu]))
    out = target_pool_fwd(_poisoned, rows, plan, weights, offsets)
    assert np.all(np.isfinite(out))
    check_pool_batch_major(_poisoned, rows, plan, weights, offsets, batch=0)
    d_rows, d_w = target_pool_bwd(_poisoned, cot, rows, weights, plan, bag_ids_of(offsets, ids.shape[0]))
    assert np.all(np.isfinite(d_rows[:nu])) and np.all(np.isfinite(d_w))
    grads = target_rows_bwd(_poisoned, cores, d_rows, plan)
    for g in grads:
        assert np.all(np.isfinite(g))
    # and the values: rows against the float64 reference
    with jax.enable_x64(True), jax.default_device(CPU):
        ref = reference.tt_rows(
            [jnp.asarray(c, jnp.float64) for c in cores], jnp.asarray(np.asarray(plan.unique_ids)[:nu])
        )
    assert rel_err(rows[:nu], ref) <= TOL


@pytest.mark.parametrize("dim", (6, 34, 128, 260))
def test_pool_bwd_every_row_width(dim, seeds):
    """flowtt_bag_pool_bwd on rows [n, D] of any width against float64, every output written,
    bitwise twice: D = 6 and 128 form d_weights in the pooling's pass 1 (a team's lanes
    cover D; D = 6 leaves two of its 8 lanes without a vector), D = 34 (34 scalar lanes)
    and 260 (65 float4s) in the separate weights kernel."""
    n, num_bags = 3000, 200
    ids = make_ids("zipf1.05", n, 5000, seed=next(seeds))
    offsets = random_offsets(num_bags, n, seed=next(seeds))
    rng = np.random.default_rng(next(seeds))
    weights = rng.uniform(0.5, 1.5, n).astype(np.float32)
    dout = rng.standard_normal((num_bags, dim)).astype(np.float32)
    rows = rng.standard_normal((n, dim)).astype(np.float32)  # row u: unique index u
    bag_ids = bag_ids_of(offsets, n)
    plan = make_plan(jax.device_put(jnp.asarray(ids), GPU), 20)
    nu, inverse = int(plan.counts[0]), np.asarray(plan.inverse)
    d_rows, d_w = target_pool_bwd(_poisoned, dout, rows, weights, plan, bag_ids)
    per_position = np.float64(weights)[:, None] * np.float64(dout)[bag_ids]
    exp_rows = np.zeros((n, dim))
    np.add.at(exp_rows, inverse, per_position)
    assert rel_err(d_rows[:nu], exp_rows[:nu]) <= TOL
    exp_w = np.sum(np.float64(dout)[bag_ids] * np.float64(rows)[inverse], axis=1)
    assert np.all(np.isfinite(d_w)) and rel_err(d_w, exp_w) <= TOL
    d_rows2, d_w2 = target_pool_bwd(_poisoned, dout, rows, weights, plan, bag_ids)
    assert np.asarray(d_w2).tobytes() == np.asarray(d_w).tobytes()
    assert np.asarray(d_rows2)[:nu].tobytes() == np.asarray(d_rows)[:nu].tobytes()


@pytest.mark.parametrize("kind", ["zipf1.05", "zipf1.2", "all_equal", "last_row"])
@pytest.mark.parametrize("dim,rank", [(32, 32), (128, 64)])
def test_consumers_never_read_rows_past_num_unique(kind, dim, rank, seeds):
    spec, cores, ids, offsets, weights, cot = _case(seeds, kind, dim, rank)
    plan = make_plan(jax.device_put(jnp.asarray(ids), GPU), spec.row_shape[-1])
    check_rows_past_num_unique_unread(_poisoned, cores, plan, weights, offsets, cot)


@pytest.mark.parametrize("kind", KINDS + ("hot_prefix",))
@pytest.mark.parametrize("dim,rank", [(32, 32), (128, 64), (16, 8)])
def test_bag_fwd_equals_rows_then_pool(kind, dim, rank, seeds):
    """flowtt_bag_fwd: bitwise pool_fwd(rows_fwd) in one chunk; in chunks of 64 / 128 rows
    (cutting prefix groups, hot_prefix: groups of hundreds of unique ids) within TOL of
    it and of the float64 reference."""
    row_shape = (10, 10, 1000) if kind == "hot_prefix" else None
    spec, cores, ids, offsets, weights, cot = _case(
        seeds,
        "uniform" if kind == "hot_prefix" else kind,
        dim,
        rank,
        num_embeddings=100000 if row_shape else 20000,
        row_shape=row_shape,
    )
    if kind == "hot_prefix":
        ids = hot_prefix_ids(row_shape, ids.shape[0], next(seeds))
    plan = make_plan(jax.device_put(jnp.asarray(ids), GPU), spec.row_shape[-1])
    if kind == "hot_prefix":
        num_groups = int(plan.counts[1])
        assert np.diff(np.asarray(plan.group_offsets)[: num_groups + 1]).max() > 2 * 128
    check_bag_fwd(_poisoned, cores, plan, ids, weights, offsets, tol=TOL)


def test_bag_fwd_positions_outside_every_bag(seeds):
    spec, cores, ids, offsets, weights, cot = _case(seeds, "zipf1.05", 64, 32)
    offsets = np.clip(offsets, 100, ids.shape[0] - 150)
    plan = make_plan(jax.device_put(jnp.asarray(ids), GPU), spec.row_shape[-1])
    check_bag_fwd(_poisoned, cores, plan, ids, weights, offsets, tol=TOL)


def test_bag_fwd_bad_shapes_are_errors(seeds):
    spec, cores, ids, offsets, weights, cot = _case(seeds, "uniform", 32, 16, n=300, num_bags=30)
    plan = make_plan(jax.device_put(jnp.asarray(ids), GPU), spec.row_shape[-1])
    put = lambda x: jax.device_put(x, GPU)
    for operands, out_shape, chunk_rows, match in bag_fwd_shape_errors(
        [put(c) for c in cores], plan, put(weights), put(offsets)
    ):
        call = jax.ffi.ffi_call("flowtt_bag_fwd", jax.ShapeDtypeStruct(out_shape, jnp.float32))
        with pytest.raises(Exception, match=match):
            jax.block_until_ready(call(*[put(x) for x in operands], chunk_rows=np.int64(chunk_rows)))


@pytest.mark.parametrize("kind", ["zipf1.05", "single"])
def test_forward_without_grad_is_one_fused_op(kind, seeds):
    """tt_embedding_bag without a gradient runs flowtt_bag_fwd (no [n, D] rows): equal to the
    training forward's value bit for bit (one chunk here) and to the reference."""
    spec, cores, ids, offsets, weights, cot = _case(seeds, kind, 64, 32)
    put = lambda x: jax.device_put(x, GPU)
    fwd = jax.jit(
        lambda c, w, i, o: ftt.tt_embedding_bag(tuple(c), i, offsets=o, weights=w, mode="sum", impl="ffi")
    )
    args = ([put(c) for c in cores], put(weights), put(ids), put(offsets))
    targets = custom_call_targets(fwd.lower(*args).as_text())
    assert "flowtt_bag_fwd" in targets and "flowtt_tt_rows_fwd" not in targets
    out, _, _, _ = _run_gpu("sum", cores, ids, offsets, weights, cot)
    assert_same(fwd(*args), out)
    rout, _, _ = _run_ref("sum", cores, ids, offsets, weights, cot)
    assert rel_err(out, rout) <= TOL


def test_bad_shape_is_an_error(seeds):
    spec, cores, ids, offsets, weights, cot = _case(seeds, "uniform", 32, 16)
    plan = make_plan(jax.device_put(jnp.asarray(ids), GPU), spec.row_shape[-1])
    call = jax.ffi.ffi_call("flowtt_tt_rows_fwd", jax.ShapeDtypeStruct((ids.shape[0], 31), jnp.float32))
    with pytest.raises(Exception, match="rows must be"):
        jax.block_until_ready(
            call(*[jax.device_put(c, GPU) for c in cores], plan.unique_ids, plan.group_offsets, plan.counts)
        )


def test_out_of_range_ids_never_read_outside(seeds):
    """Kernels clamp ids (no error on GPU: checking would need a host sync)."""
    spec, cores, ids, offsets, weights, cot = _case(seeds, "uniform", 32, 16, n=64, num_bags=8)
    plan = make_plan(jax.device_put(jnp.asarray(ids), GPU), spec.row_shape[-1])
    nu = int(plan.counts[0])
    bad = plan.unique_ids.at[nu - 1].set(2**31 - 1).at[0].set(-5)
    call = jax.ffi.ffi_call("flowtt_tt_rows_fwd", jax.ShapeDtypeStruct((64, 32), jnp.float32))
    # must neither fault nor hang (compute-sanitizer memcheck covers the reads)
    jax.block_until_ready(
        call(*[jax.device_put(c, GPU) for c in cores], bad, plan.group_offsets, plan.counts)
    )


def test_auto_falls_back_for_shapes_the_kernels_do_not_take(seeds):
    """D = 256 (q1*q2 = 32 > 16): impl='auto' uses the reference, impl='ffi' says why."""
    spec = ftt.TTSpec.create(5000, 256, 8)
    cores = jax.device_put(ftt.init_cores(jax.random.key(next(seeds)), spec), GPU)
    ids = jax.device_put(jnp.asarray(make_ids("zipf1.2", 200, 5000, next(seeds))), GPU)
    out = ftt.tt_lookup(cores, ids)
    ref = ftt.tt_lookup(jax.device_put(cores, CPU), jax.device_put(ids, CPU), impl="reference")
    assert rel_err(out, ref) < TOL
    with pytest.raises(ValueError, match="unsupported core shape"):
        ftt.tt_lookup(cores, ids, impl="ffi")
