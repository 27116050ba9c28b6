"""The group plan op flowtt_tb_plan (ffi.tb_plan) equals the jnp group plan
(make_group_plan) bit for bit.

Runs on the CPU, and on the GPU (marked ``gpu``). The raw target's outputs are aliased to
buffers filled with -7 (trailing operands, ignored by the handler), so an element the op
does not write fails. Layouts cover prefix keys of up to 31 bits, of 32 bits (uint32 keys
on the GPU) and past 32 bits (uint64 keys), tables of one row and skewed ids at each
table's last row.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flowtt_jax as ftt
from flowtt_jax.kernels import ffi
from flowtt_jax.kernels.group_plan import GroupLayout, GroupPlan, make_group_plan
from tests.helpers import poisoned_call
from tests.test_plan_ffi import CPU, device_param

pytestmark = pytest.mark.skipif(not ffi.available(), reason="compiled extension not built")


def spec(n, row_shape):
    return ftt.TTSpec.create(n, 16, 4, row_shape=row_shape, col_shape=(2, 2, 4))


SMALL = (spec(1000, (10, 10, 10)), spec(37, (2, 4, 5)), spec(5000, (5, 4, 250)), spec(1, (2, 1, 2)))
BIG = ftt.TTSpec.create(1_500_000_000, 16, 4, col_shape=(2, 2, 4))
LAYOUTS = {
    "small": SMALL,
    "one_table": (spec(7919, (7, 31, 37)),),
    "keys_32_bits": (BIG, SMALL[1], BIG),  # S * prefixes in (2^31, 2^32]
    # prefix keys past 32 bits, row keys within: row keys
    "row_keys": (BIG, SMALL[1], spec(1_000_000_000, (1000, 100_000, 10)), SMALL[2], SMALL[3]),
    "keys_past_32_bits": (BIG, SMALL[1], BIG, BIG, SMALL[2]),
    "wide_p3": (spec(184_000, (2, 2, 46_000)), spec(46_000_000, (46_000, 1000, 1)), SMALL[2]),
}


def key_form(layout: GroupLayout) -> tuple[bool, int]:
    """(row keys, key bits) of the layout's plan."""
    _, _, row_keys, num_keys = layout.tb_plan_meta()
    return row_keys, (num_keys - 1).bit_length()


def draw(layout: GroupLayout, n: int, seed: int):
    """ids, tables [n] int32: Zipf-skewed ids, a third at each table's last row."""
    rng = np.random.default_rng(seed)
    tables = rng.integers(0, layout.num_tables, n).astype(np.int32)
    rows = np.asarray([s.num_embeddings for s in layout.specs])[tables]
    ids = np.minimum(rng.zipf(1.3, n) - 1, rows - 1)
    spread = rng.random(n) < 0.4  # scattered over the table too
    ids = np.where(spread, rng.integers(0, 2**31 - 1, n) % rows, ids)
    ids = np.where(rng.random(n) < 0.3, rows - 1, ids)
    return ids.astype(np.int32), tables


def poisoned_tb_plan(layout: GroupLayout, ids, tables) -> GroupPlan:
    meta, extent, row_keys, num_keys = layout.tb_plan_meta()
    n = ids.shape[0]
    outs = [jax.ShapeDtypeStruct((m,), jnp.int32) for m in (n, n, n + 1, n + 1, n, n, n, 2)]
    return GroupPlan(
        *poisoned_call(
            "flowtt_tb_plan",
            outs,
            jnp.asarray(ids),
            jnp.asarray(tables),
            jnp.asarray(meta),
            extent=np.int64(extent),
            row_keys=bool(row_keys),
            num_keys=np.int64(num_keys),
        )
    )


def oracle(layout: GroupLayout, ids, tables) -> GroupPlan:
    with jax.default_device(CPU):
        return jax.jit(make_group_plan, static_argnums=0)(layout, jnp.asarray(ids), jnp.asarray(tables))


NS = (1, 2, 257, 6007)


@functools.cache
def oracles(name: str) -> dict[int, GroupPlan]:
    """``oracle`` of ``draw(layout, n, seed=n)`` for every n in ``NS``: one program for the four
    plans of a layout (a program each compiled ~0.25 s, mostly XLA's cost per program)."""
    layout = GroupLayout(LAYOUTS[name])
    draws = [draw(layout, n, seed=n) for n in NS]
    with jax.default_device(CPU):
        plans = jax.jit(lambda d: [make_group_plan(layout, *map(jnp.asarray, it)) for it in d])(draws)
    return dict(zip(NS, plans))


def assert_plans_equal(got: GroupPlan, want: GroupPlan):
    for name, g, w in zip(GroupPlan._fields, got, want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w), err_msg=name)


def test_layouts_cover_the_key_forms():
    forms = {name: key_form(GroupLayout(s)) for name, s in LAYOUTS.items()}
    assert forms["small"][1] <= 31 and forms["keys_32_bits"] == (False, 32)
    assert forms["row_keys"] == (True, 32) and not forms["keys_past_32_bits"][0]
    assert forms["keys_past_32_bits"][1] > 32


@device_param
@pytest.mark.parametrize("name", sorted(LAYOUTS))
@pytest.mark.parametrize("n", NS)
def test_matches_make_group_plan(device, name, n):
    layout = GroupLayout(LAYOUTS[name])
    ids, tables = draw(layout, n, seed=n)
    with jax.default_device(device):
        got = poisoned_tb_plan(layout, ids, tables)
    assert_plans_equal(got, oracles(name)[n])


@device_param
def test_out_of_range_operands_are_clamped(device):
    layout = GroupLayout(SMALL)
    ids = np.array([5, -3, 1001, 7, 2**31 - 1, 0, -(2**31), 999, 4], np.int32)
    tables = np.array([0, 1, 0, 9, -1, 3, 2, 0, 2**31 - 1], np.int32)
    t = np.clip(tables, 0, layout.num_tables - 1)
    rows = np.asarray([s.num_embeddings for s in SMALL])[t]
    with jax.default_device(device):
        got = ffi.tb_plan(jnp.asarray(ids), jnp.asarray(tables), *layout.tb_plan_meta())
    assert_plans_equal(got, oracle(layout, np.clip(ids, 0, rows - 1), t))


@device_param
def test_jit_and_vmap(device):
    layout = GroupLayout(LAYOUTS["keys_past_32_bits"])
    batch = [draw(layout, 301, seed=s) for s in range(3)]
    ids = jnp.asarray(np.stack([b[0] for b in batch]))
    tables = jnp.asarray(np.stack([b[1] for b in batch]))
    meta = layout.tb_plan_meta()
    with jax.default_device(device):
        plans = jax.jit(jax.vmap(lambda i, t: ffi.tb_plan(i, t, *meta)))(ids, tables)
    for b in range(3):
        assert_plans_equal(GroupPlan(*(f[b] for f in plans)), oracle(layout, *batch[b]))


@device_param
def test_no_ids(device):
    layout = GroupLayout(SMALL)
    empty = jnp.zeros((0,), jnp.int32)
    with jax.default_device(device):
        plan = ffi.tb_plan(empty, empty, *layout.tb_plan_meta())
    assert all(f.shape == (0,) for f in (plan.perm, plan.inverse, plan.u_i3, plan.g_i1, plan.g_i2))
    for f in (plan.run_offsets, plan.group_offsets, plan.counts):
        np.testing.assert_array_equal(f, 0)


@pytest.mark.parametrize(
    "meta_shape, extent, row_keys, num_keys, match",
    [
        ((7, 4), 10, False, 100, "meta must be"),
        ((8, 0), 10, False, 100, "meta must be"),
        ((8, 4), 0, False, 100, "extent"),
        ((8, 4), 10, False, 0, "num_keys"),
        ((8, 4), 10, True, 2**32 + 1, "row keys"),
    ],
)
def test_rejects_bad_operands(meta_shape, extent, row_keys, num_keys, match):
    ids = jnp.arange(4, dtype=jnp.int32)
    meta = np.zeros(meta_shape, np.int32)
    with pytest.raises(Exception, match=match):
        jax.block_until_ready(ffi.tb_plan(ids, ids, meta, extent, row_keys, num_keys))


def test_layout_meta_rejects_too_many_prefixes():
    huge = ftt.TTSpec.create(2**30, 16, 4, row_shape=(2**16, 2**14, 1), col_shape=(2, 2, 4))
    with pytest.raises(ValueError, match="prefixes"):
        GroupLayout((huge, huge)).tb_plan_meta()
