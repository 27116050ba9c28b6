"""The plan op flowtt_plan (ffi.plan) equals the jnp plan (make_plan) bit for bit.

Runs on the CPU, and on the GPU (marked ``gpu``; skipped without a GPU backend and
the _flowtt_cuda extension). The raw target's outputs are aliased to buffers filled with -7 (trailing
operands, ignored by the handler), so an element the op does not write fails.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flowtt_jax.kernels import ffi
from flowtt_jax.kernels.plan import Plan, make_plan
from tests.helpers import ID_KINDS, cuda_device, custom_call_targets, make_ids, poisoned_call

pytestmark = pytest.mark.skipif(not ffi.available(), reason="compiled extension not built")

CPU = jax.devices("cpu")[0]
GPU = cuda_device()
device_param = pytest.mark.parametrize(
    "device",
    [
        pytest.param(CPU, id="cpu"),
        pytest.param(
            GPU,
            id="gpu",
            marks=[
                pytest.mark.gpu,
                pytest.mark.skipif(GPU is None, reason="needs a GPU backend and the _flowtt_cuda extension"),
            ],
        ),
    ],
)
NUM_ROWS = 13 * 11 * 7


def poisoned_plan(ids, last_extent: int, num_rows: int, forward_only: bool = False) -> Plan:
    """flowtt_plan called directly under jit, each output aliased to a -7 buffer
    (``forward_only``: perm and run_offsets [0])."""
    n = ids.shape[0]
    sizes = (0, n, n, 0, n + 1, 2) if forward_only else (n, n, n, n + 1, n + 1, 2)
    outs = [jax.ShapeDtypeStruct((m,), jnp.int32) for m in sizes]
    return Plan(
        *poisoned_call(
            "flowtt_plan", outs, ids, last_extent=np.int64(last_extent), num_rows=np.int64(num_rows)
        )
    )


def oracle(ids, last_extent: int) -> Plan:
    """The jnp plan, on the CPU."""
    with jax.default_device(CPU):
        return jax.jit(make_plan, static_argnums=1)(jnp.asarray(ids), last_extent)


LAST_EXTENTS = (1, 13, 77, NUM_ROWS + 5)
_plans = jax.jit(lambda ids, extents: [make_plan(i, e) for i, e in zip(ids, extents)], static_argnums=1)


@functools.cache
def oracles(kind: str, n: int) -> dict[int, Plan]:
    """``oracle`` of ``make_ids(kind, n, NUM_ROWS, seed=n + e)`` for every last extent e in
    ``LAST_EXTENTS``: one program for the four plans of an n, every kind (a program each
    compiled ~0.2 s, mostly XLA's cost per program)."""
    ids = [make_ids(kind, n, NUM_ROWS, seed=n + e) for e in LAST_EXTENTS]
    with jax.default_device(CPU):
        return dict(zip(LAST_EXTENTS, _plans(ids, LAST_EXTENTS)))


def assert_plans_equal(got: Plan, want: Plan):
    for name, g, w in zip(Plan._fields, got, want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w), err_msg=name)


FORWARD_FIELDS = ("inverse", "unique_ids", "group_offsets", "counts")


def assert_forward_plan_equal(got: Plan, want: Plan):
    """The forward-only plan: perm and run_offsets [0], the other fields ``want``'s."""
    assert got.perm.shape == (0,) and got.run_offsets.shape == (0,)
    for name in FORWARD_FIELDS:
        g, w = np.asarray(getattr(got, name)), np.asarray(getattr(want, name))
        np.testing.assert_array_equal(g, w, err_msg=name)


@device_param
@pytest.mark.parametrize("kind", ID_KINDS)
@pytest.mark.parametrize("n", [1, 2, 257, 4999])
@pytest.mark.parametrize("last_extent", LAST_EXTENTS)
def test_matches_make_plan(device, kind, n, last_extent):
    ids = make_ids(kind, n, NUM_ROWS, seed=n + last_extent)
    with jax.default_device(device):
        got = poisoned_plan(ids, last_extent, NUM_ROWS)
    assert_plans_equal(got, oracles(kind, n)[last_extent])


@device_param
@pytest.mark.parametrize("num_rows, last_extent", [(1, 1), (2, 1), (10**7, 250), (2**31 - 1, 1 << 20)])
def test_table_sizes(device, num_rows, last_extent):
    """Sort key widths from 1 bit (num_rows 1 or 2) to 31 bits; ids include num_rows - 1."""
    for kind in ("uniform", "zipf1.05", "last_row"):
        ids = make_ids(kind, 3001, num_rows, seed=num_rows % 1000)
        with jax.default_device(device):
            got = poisoned_plan(ids, last_extent, num_rows)
        assert_plans_equal(got, oracle(ids, last_extent))


# The forward-only plan takes the table's bitmap where it has at most 2 words (64 rows)
# per id (cuda/contract/plan_bitmap.h), else the sort: (n, num_rows) on both sides of that
# rule, last_extent below, at and above a word's 32 bits, and one past num_rows.
FORWARD_CASES = [
    (1, 1, 1),  # bitmap: 1 word for 1 id
    (1, 64, 7),  # bitmap, its one id the table's last row (63)
    (1, 65, 7),  # sort: 3 words for 1 id
    (3, 10**7, 250),  # sort
    (5001, 13 * 11 * 7, 1),  # bitmap, a group per id
    (5001, 13 * 11 * 7, 3),  # bitmap, up to 11 groups a word
    (5001, 13 * 11 * 7, 32),  # bitmap, groups on word boundaries
    (5001, 13 * 11 * 7, 33),
    (5001, 13 * 11 * 7, 77),
    (5001, 13 * 11 * 7, 13 * 11 * 7 + 5),  # bitmap, one group
    (3001, 64 * 3001, 250),  # bitmap at the rule's limit
    (3001, 64 * 3001 + 1, 250),  # sort just past it
    (40_000, 10**7 // 4, 250),  # bitmap, many words without a set bit
]


def test_forward_cases_take_both_paths():
    """FORWARD_CASES run the bitmap and the sort, as their comments say; the rule's edges."""
    bitmap = [ffi.plan_bitmap_applies(n, rows) for n, rows, _ in FORWARD_CASES]
    assert bitmap == [True, True, False, False] + [True] * 7 + [False, True]
    assert ffi.plan_bitmap_applies(1, 64) and not ffi.plan_bitmap_applies(1, 65)
    assert not ffi.plan_bitmap_applies(0, 1)


@device_param
@pytest.mark.parametrize("kind", ID_KINDS)
@pytest.mark.parametrize("n, num_rows, last_extent", FORWARD_CASES)
def test_forward_only_matches_make_plan(device, kind, n, num_rows, last_extent):
    ids = make_ids(kind, n, num_rows, seed=n + num_rows % 1000 + last_extent)
    if n == 1 and num_rows == 64:
        ids = np.array([63], np.int32)
    with jax.default_device(device):
        got = poisoned_plan(ids, last_extent, num_rows, forward_only=True)
    assert_forward_plan_equal(got, oracle(ids, last_extent))


@device_param
@pytest.mark.parametrize("num_rows", [NUM_ROWS, 10**7])
def test_forward_only_clamps_and_vmaps(device, num_rows):
    """Out-of-range ids clamped on both paths (num_rows: bitmap / sort); jit and vmap of
    ffi.plan(forward_only=True)."""
    ids = np.array([5, -3, 1001, 7, 2**31 - 1, 0, -(2**31), 1000] * 50, np.int32)
    batch = np.stack([ids, ids[::-1], np.roll(ids, 3)])
    with jax.default_device(device):
        fn = jax.jit(jax.vmap(lambda x: ffi.plan(x, 10, num_rows, forward_only=True)))
        got = fn(jnp.asarray(batch))
    for b in range(3):
        assert_forward_plan_equal(Plan(*(f[b] for f in got)), oracle(np.clip(batch[b], 0, num_rows - 1), 10))


@device_param
def test_forward_only_no_ids(device):
    with jax.default_device(device):
        plan = ffi.plan(jnp.zeros((0,), jnp.int32), 10, NUM_ROWS, forward_only=True)
    assert plan.perm.shape == plan.run_offsets.shape == (0,)
    np.testing.assert_array_equal(plan.group_offsets, [0])
    np.testing.assert_array_equal(plan.counts, [0, 0])


@device_param
def test_out_of_range_ids_are_clamped(device):
    ids = np.array([5, -3, 1001, 7, 2**31 - 1, 0, -(2**31), 1000], np.int32)
    with jax.default_device(device):
        got = ffi.plan(jnp.asarray(ids), 10, NUM_ROWS)
    assert_plans_equal(got, oracle(np.clip(ids, 0, NUM_ROWS - 1), 10))


@device_param
def test_jit_and_vmap(device):
    batch = np.stack([make_ids("zipf1.2", 301, NUM_ROWS, seed=s) for s in range(3)])
    with jax.default_device(device):
        fn = jax.jit(ffi.plan, static_argnums=(1, 2))
        assert custom_call_targets(fn.lower(jnp.asarray(batch[0]), 11, NUM_ROWS).compile().as_text()) >= {
            "flowtt_plan"
        }
        assert_plans_equal(fn(jnp.asarray(batch[0]), 11, NUM_ROWS), oracle(batch[0], 11))
        batched = jax.jit(jax.vmap(lambda x: ffi.plan(x, 11, NUM_ROWS)))(jnp.asarray(batch))
    for b in range(3):
        assert_plans_equal(Plan(*(f[b] for f in batched)), oracle(batch[b], 11))


@device_param
def test_no_ids(device):
    with jax.default_device(device):
        plan = ffi.plan(jnp.zeros((0,), jnp.int32), 10, NUM_ROWS)
    assert all(f.shape == (0,) for f in plan[:3])
    for f in plan[3:]:
        np.testing.assert_array_equal(f, 0)


@pytest.mark.parametrize("last_extent, num_rows", [(0, 10), (10, 0), (2**31, 10), (10, 2**31)])
def test_rejects_bad_attributes(last_extent, num_rows):
    with pytest.raises(Exception, match="last_extent < 2"):
        jax.block_until_ready(ffi.plan(jnp.arange(4, dtype=jnp.int32), last_extent, num_rows))
