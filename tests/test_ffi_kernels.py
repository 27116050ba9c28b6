"""The FFI targets themselves, on outputs poisoned with NaN (an unwritten element fails).

Each target ignores trailing operands; here every output is aliased to a NaN-filled
trailing operand, so the buffer the kernel writes starts as NaN. Rows and d_rows past
num_unique are unspecified: only their [:num_unique] part is checked.
"""

import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flowtt_jax as ftt
from flowtt_jax.kernels import ffi
from flowtt_jax.kernels.plan import make_plan
from flowtt_jax.tt import reference
from tests.helpers import (
    ID_KINDS,
    bag_fwd_shape_errors,
    bag_ids_of,
    check_bag_fwd,
    check_pool_batch_major,
    check_rows_past_num_unique_unread,
    f32,
    hot_prefix_ids,
    make_cores,
    make_ids,
    poisoned_call,
    random_offsets,
    rel_err,
    target_pool_bwd,
    target_pool_fwd,
    target_rows_bwd,
    target_rows_fwd,
)

pytestmark = pytest.mark.skipif(not ffi.available(), reason="compiled extension not built")

SPEC = ftt.TTSpec.create(2000, 24, (6, 10), row_shape=(10, 10, 20), col_shape=(2, 3, 4))
# p3 = 500: prefix groups of hundreds of unique ids, cut by bag_fwd's chunks of 64 / 128.
BAG_SPEC = ftt.TTSpec.create(10000, 24, (6, 10), row_shape=(4, 5, 500), col_shape=(2, 3, 4))

# One compiled program per shape, shared by the tests and the id kinds (compiles dominate).
_plan = jax.jit(make_plan, static_argnums=1)
_dense = jax.jit(ftt.to_dense, static_argnums=1)
_segment_sum = jax.jit(jax.ops.segment_sum, static_argnums=2)


@jax.jit
def _rows_vjp(cores, unique_ids, d_rows, num_unique):
    """The float64 reference's core gradients of sum(d_rows * rows(unique_ids)) over the
    first num_unique (the rest: id 0, d_rows 0; one program for every num_unique)."""
    live = jnp.arange(unique_ids.shape[0]) < num_unique
    c64 = [c.astype(jnp.float64) for c in cores]
    _, vjp = jax.vjp(lambda c: reference.tt_rows(c, jnp.where(live, unique_ids, 0)), c64)
    return vjp(jnp.where(live[:, None], d_rows.astype(jnp.float64), 0.0))[0]


@pytest.mark.parametrize("kind", ID_KINDS)
def test_all_targets_write_every_output(kind):
    n, num_bags = 600, 70
    cores = make_cores(SPEC, seed=1)
    ids = make_ids(kind, n, SPEC.num_embeddings, seed=2)
    offsets = random_offsets(num_bags, n, seed=3)
    bag_ids = bag_ids_of(offsets, n)
    weights = np.random.default_rng(4).standard_normal(n).astype(np.float32)
    plan = _plan(ids, SPEC.row_shape[-1])
    nu = int(plan.counts[0])
    table = np.asarray(_dense(cores, SPEC.num_embeddings), np.float64)

    rows = np.asarray(target_rows_fwd(poisoned_call, cores, plan))
    assert rel_err(rows[:nu], table[np.asarray(plan.unique_ids)[:nu]]) < 1e-5

    out = target_pool_fwd(poisoned_call, rows, plan, weights, offsets)
    check_pool_batch_major(poisoned_call, rows, plan, weights, offsets, batch=10)
    expected = _segment_sum(np.asarray(weights, np.float64)[:, None] * table[ids], bag_ids, num_bags)
    assert rel_err(out, expected) < 1e-5

    dout = np.random.default_rng(5).standard_normal((num_bags, 24)).astype(np.float32)
    d_rows, d_w = (np.asarray(x) for x in target_pool_bwd(poisoned_call, dout, rows, weights, plan, bag_ids))
    per_id = weights[:, None] * np.asarray(dout, np.float64)[bag_ids]
    exp_rows = np.asarray(_segment_sum(per_id, plan.inverse, n))
    assert rel_err(d_rows[:nu], exp_rows[:nu]) < 1e-5
    exp_w = np.sum(np.asarray(dout, np.float64)[bag_ids] * table[ids], axis=1)
    assert rel_err(d_w, exp_w) < 1e-5
    # a [0] d_weights result skips the weight gradient; d_rows is unchanged, bit for bit
    d_rows_only, d_w0 = target_pool_bwd(
        poisoned_call, dout, rows, weights, plan, bag_ids, with_d_weights=False
    )
    assert d_w0.shape == (0,)
    np.testing.assert_array_equal(np.asarray(d_rows_only)[:nu], d_rows[:nu])
    # without it the rows are never read: an empty [0, D] placeholder gives the same d_rows
    d_rows_empty, _ = target_pool_bwd(
        poisoned_call, dout, rows[:0], weights, plan, bag_ids, with_d_weights=False
    )
    np.testing.assert_array_equal(np.asarray(d_rows_empty)[:nu], d_rows[:nu])
    with pytest.raises(Exception, match="rows must be"):  # the weight gradient needs them
        jax.block_until_ready(target_pool_bwd(poisoned_call, dout, rows[:0], weights, plan, bag_ids))

    grads = target_rows_bwd(poisoned_call, cores, d_rows, plan)
    with jax.enable_x64(True):
        exp_grads = _rows_vjp(cores, plan.unique_ids, d_rows, nu)
    for g, e in zip(grads, exp_grads):
        assert rel_err(g, e) < 1e-5


@pytest.mark.parametrize("kind", ["zipf1.05", "zipf1.2", "all_equal", "last_row"])
def test_consumers_never_read_rows_past_num_unique(kind):
    n, num_bags = 600, 70
    cores = make_cores(SPEC, seed=6)
    plan = _plan(make_ids(kind, n, SPEC.num_embeddings, seed=7), SPEC.row_shape[-1])
    rng = np.random.default_rng(8)
    weights = rng.standard_normal(n).astype(np.float32)
    dout = rng.standard_normal((num_bags, 24)).astype(np.float32)
    check_rows_past_num_unique_unread(
        poisoned_call, cores, plan, weights, random_offsets(num_bags, n, seed=9), dout
    )


def bag_case(kind: str, seed: int):
    """ids [n], CSR offsets [B+1] (some bags empty), weights [n] for BAG_SPEC."""
    rng = np.random.default_rng(seed)
    if kind == "single":
        return (
            rng.integers(0, BAG_SPEC.num_embeddings, 1).astype(np.int32),
            np.array([0, 1], np.int32),
            np.array([0.75], np.float32),
        )
    n, num_bags = 900, 80
    if kind == "hot_prefix":
        ids = hot_prefix_ids(BAG_SPEC.row_shape, n, seed)
    else:
        ids = make_ids(kind, n, BAG_SPEC.num_embeddings, seed)
    return ids, random_offsets(num_bags, n, seed + 1), rng.standard_normal(n).astype(np.float32)


@pytest.mark.parametrize("kind", ID_KINDS + ("single", "hot_prefix"))
def test_bag_fwd_equals_rows_then_pool(kind):
    """Bitwise equal to pool_fwd(rows_fwd) in one chunk, close to it and to the float64
    reference in chunks of 64 / 128 rows (cutting prefix groups)."""
    ids, offsets, weights = bag_case(kind, seed=10)
    cores = make_cores(BAG_SPEC, seed=11)
    plan = _plan(ids, BAG_SPEC.row_shape[-1])
    if kind == "hot_prefix":  # a group of more than two chunks of unique ids
        num_groups = int(plan.counts[1])
        assert np.diff(np.asarray(plan.group_offsets)[: num_groups + 1]).max() > 2 * 128
    check_bag_fwd(poisoned_call, cores, plan, ids, weights, offsets)


def test_bag_fwd_positions_outside_every_bag():
    """bag_offsets not starting at 0 nor ending at n: the positions outside add nothing."""
    ids, offsets, weights = bag_case("hot_prefix", seed=12)
    offsets = np.clip(offsets, 50, len(ids) - 70)
    plan = _plan(ids, BAG_SPEC.row_shape[-1])
    check_bag_fwd(poisoned_call, make_cores(BAG_SPEC, seed=13), plan, ids, weights, offsets)


def test_bag_fwd_rejects_bad_input():
    ids, offsets, weights = bag_case("uniform", seed=14)
    cores = make_cores(BAG_SPEC, seed=15)
    plan = _plan(ids, BAG_SPEC.row_shape[-1])
    cases = bag_fwd_shape_errors(cores, plan, weights, offsets)
    if jax.default_backend() == "cpu":  # the CPU handler checks data too (CUDA: no host sync)
        bad_offsets = offsets.copy()
        bad_offsets[3] = bad_offsets[4] + 1  # out of order
        good = (*cores, plan.unique_ids, plan.group_offsets, plan.counts, plan.inverse, weights)
        cases.append((good + (bad_offsets,), (len(offsets) - 1, 24), 64, "bag offsets"))
    for operands, out_shape, chunk_rows, match in cases:
        call = jax.ffi.ffi_call("flowtt_bag_fwd", f32(out_shape))
        with pytest.raises(Exception, match=match):
            jax.block_until_ready(call(*operands, chunk_rows=np.int64(chunk_rows)))


@pytest.mark.skipif(
    jax.default_backend() != "cpu",
    reason="the CPU handler reports bad ids; CUDA kernels clamp them (no host sync)",
)
def test_kernels_reject_out_of_range_ids():
    cores = make_cores(SPEC, seed=1)
    plan = _plan(np.array([5, 1999], np.int32), SPEC.row_shape[-1])
    bad = np.array(plan.unique_ids)
    bad[1] = SPEC.row_shape[0] * SPEC.row_shape[1] * SPEC.row_shape[2]
    call = jax.ffi.ffi_call("flowtt_tt_rows_fwd", f32((2, 24)))
    with pytest.raises(Exception, match="outside"):
        jax.block_until_ready(call(*cores, bad, plan.group_offsets, plan.counts))


def test_kernels_reject_bad_shapes():
    cores = make_cores(SPEC, seed=1)
    plan = _plan(np.array([5, 7], np.int32), SPEC.row_shape[-1])
    call = jax.ffi.ffi_call("flowtt_tt_rows_fwd", f32((2, 23)))
    with pytest.raises(Exception, match="rows must be"):
        jax.block_until_ready(call(*cores, plan.unique_ids, plan.group_offsets, plan.counts))
    call = jax.ffi.ffi_call("flowtt_tt_rows_fwd", f32((2, 24)))
    with pytest.raises(Exception, match="ranks"):
        jax.block_until_ready(
            call(cores[0], cores[0], cores[2], plan.unique_ids, plan.group_offsets, plan.counts)
        )


@pytest.mark.gpu
@pytest.mark.skipif(importlib.util.find_spec("flowtt_jax._flowtt_cuda") is None, reason="built without CUDA")
def test_cuda_shape_limits_are_reported():
    from flowtt_jax import _flowtt_cuda

    assert _flowtt_cuda.unsupported_reason(200, 200, 250, 2, 4, 4, 32, 32) is None
    assert _flowtt_cuda.unsupported_reason(100, 100, 100, 4, 4, 8, 64, 64) is None
    assert "unsupported core shape" in _flowtt_cuda.unsupported_reason(10, 10, 10, 4, 8, 8, 8, 8)
    assert "r1<=64" in _flowtt_cuda.unsupported_reason(10, 10, 10, 2, 4, 4, 128, 32)
