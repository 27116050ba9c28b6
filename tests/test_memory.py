"""Forward temporary memory: the fused path holds no per-id gathered cores, and without
a gradient no [n, D] rows either."""

import jax
import jax.numpy as jnp
import pytest

import flowtt_jax as ftt
from benchmarks.memory_cpu import temp_bytes
from flowtt_jax.kernels import ffi

pytestmark = pytest.mark.skipif(not ffi.available(), reason="compiled extension not built")


def test_fused_forward_temp_memory_does_not_grow_with_nnz_r2():
    spec = ftt.TTSpec.create(10**6, 32, 32)
    bag_len = 14
    small, large = (temp_bytes(spec, b, bag_len, "ffi") for b in (512, 4096))
    nnz = 4096 * bag_len
    # Per id: a few dozen int32 plan and bag entries (no rows: flowtt_bag_fwd), never r^2 floats.
    per_id_budget = 32 * 4
    assert large <= nnz * per_id_budget
    assert large < nnz * 32 * 32 * 4 / 16
    # Growth from 512 to 4096 bags is linear in nnz with the same per-id bound.
    assert (large - small) <= (4096 - 512) * bag_len * per_id_budget
    # The XLA reference does materialise gathered cores: the check can tell them apart.
    assert temp_bytes(spec, 4096, bag_len, "reference") > nnz * 32 * 32 * 4


def test_forward_holds_no_rows_array():
    """The no-gradient forward (flowtt_bag_fwd) has no [n, D] float array in its temp
    memory, while rows_fwd + pool_fwd (the training forward) does."""
    spec = ftt.TTSpec.create(10**6, 128, 16)
    num_bags, bag_len = 4096, 14
    nnz = num_bags * bag_len
    rows_bytes = nnz * spec.embedding_dim * 4
    assert temp_bytes(spec, num_bags, bag_len, "ffi") < rows_bytes / 4

    def two_ops(cores, ids, offsets):
        plan = ffi.plan(ids, spec.row_shape[-1], spec.num_embeddings)
        rows = ffi.rows_fwd(cores, plan)
        return ffi.pool_fwd(rows, plan.inverse, jnp.ones(ids.shape, jnp.float32), offsets)

    args = (
        [jax.ShapeDtypeStruct(s, jnp.float32) for s in spec.core_shapes],
        jax.ShapeDtypeStruct((nnz,), jnp.int32),
        jax.ShapeDtypeStruct((num_bags + 1,), jnp.int32),
    )
    assert jax.jit(two_ops).lower(*args).compile().memory_analysis().temp_size_in_bytes >= rows_bytes
