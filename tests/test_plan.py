import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flowtt_jax.kernels.plan import make_plan
from tests.helpers import ID_KINDS, assert_no_host_callback, make_ids


@pytest.mark.parametrize("kind", ID_KINDS)
@pytest.mark.parametrize("n", [1, 2, 257, 5000])
def test_plan_matches_numpy_grouping(kind, n):
    p3 = 13
    ids = make_ids(kind, n, 13 * 11 * 7, seed=n)
    plan = jax.device_get(jax.jit(make_plan, static_argnums=1)(jnp.asarray(ids), p3))
    uniq, inverse, counts = np.unique(ids, return_inverse=True, return_counts=True)
    nu = len(uniq)
    assert plan.counts[0] == nu
    np.testing.assert_array_equal(plan.unique_ids[:nu], uniq)
    np.testing.assert_array_equal(plan.unique_ids[nu:], 0)
    np.testing.assert_array_equal(plan.inverse, inverse)
    np.testing.assert_array_equal(plan.perm, np.argsort(ids, kind="stable"))
    np.testing.assert_array_equal(np.diff(plan.run_offsets[: nu + 1]), counts)
    np.testing.assert_array_equal(plan.run_offsets[nu:], n)
    prefixes, first = np.unique(uniq // p3, return_index=True)
    ng = len(prefixes)
    assert plan.counts[1] == ng
    np.testing.assert_array_equal(plan.group_offsets[:ng], first)
    np.testing.assert_array_equal(plan.group_offsets[ng:], nu)
    for g in range(ng):
        members = plan.unique_ids[plan.group_offsets[g] : plan.group_offsets[g + 1]]
        assert np.all(members // p3 == prefixes[g])


def test_plan_is_static_shaped_and_callback_free():
    ids = jnp.zeros((1000,), jnp.int32)
    lowered = jax.jit(make_plan, static_argnums=1).lower(ids, 10)
    assert_no_host_callback(lowered.compile().as_text())
    shapes = jax.eval_shape(make_plan, ids, 10)
    assert shapes.unique_ids.shape == (1000,) and shapes.group_offsets.shape == (1001,)
    assert all(s.dtype == jnp.int32 for s in shapes)


def test_plan_vmaps():
    ids = np.stack([make_ids("zipf1.2", 300, 1000, seed=s) for s in range(3)])
    # one program each (op by op, the vmapped plan compiled ~60 ops)
    batched = jax.jit(jax.vmap(lambda x: make_plan(x, 10)))(ids)
    plan = jax.jit(make_plan, static_argnums=1)
    for b in range(3):
        single = plan(ids[b], 10)
        for f_b, f_s in zip(batched, single):
            np.testing.assert_array_equal(f_b[b], f_s)
