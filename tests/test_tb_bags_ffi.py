"""The bags op flowtt_tb_bags (ffi.tb_bags) equals the jax.numpy preparation of a packed
batch (``oob.packed_bags(kernel=False)``: canonical bags, the per-table ``oob`` policy,
dropped positions parked) bit for bit.

Runs on the CPU, and on the GPU (marked ``gpu``). The raw target's outputs are aliased to
buffers filled with -7 / NaN (trailing operands, ignored by the handler), so an element the
op does not write fails. Batches span several of the kernel's 1024-position blocks, with
empty features and bags, one hot bag, runs of thousands of empty bags, ids out of range on
both sides and at each table's last row, positions outside every bag (traced offsets),
offsets out of order and out of range, and batches with nothing live.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flowtt_jax.inputs.normalise import csr_bags, saturate_int32
from flowtt_jax.inputs.oob import packed_bags, table_oob
from flowtt_jax.kernels import ffi
from tests.helpers import f32, poisoned_call
from tests.test_plan_ffi import device_param

pytestmark = pytest.mark.skipif(not ffi.available(), reason="compiled extension not built")

NUM_ROWS = np.asarray([1000, 37, 5000, 1, 3], np.int32)
FEATURE_TABLES = (0, 2, 1, 0, 3, 4, 2)


def draw(seed: int, batch: int, mean_length: float, empty=(2,), hot: bool = False):
    """ids [n] int32 (a fifth out of range, a fifth at the table's last row), feature-major
    offsets [F*batch + 1] int32 and weights [n] float32."""
    rng = np.random.default_rng(seed)
    lengths = rng.poisson(mean_length, (len(FEATURE_TABLES), batch))
    lengths[list(empty)] = 0
    if hot:
        lengths[1, batch // 2] = 30_000  # one hot bag: thousands of positions in one bag
    ids = []
    for f, t in enumerate(FEATURE_TABLES):
        rows = NUM_ROWS[t]
        m = int(lengths[f].sum())
        x = rng.integers(0, rows, m)
        u = rng.random(m)
        x = np.where(u < 0.2, rows - 1, x)
        x = np.where((u >= 0.2) & (u < 0.3), rows + rng.integers(0, 3, m), x)
        x = np.where((u >= 0.3) & (u < 0.4), -1 - rng.integers(0, 3, m), x)
        ids.append(x)
    ids = np.concatenate(ids).astype(np.int32)
    offsets = np.concatenate([[0], np.cumsum(lengths.reshape(-1))]).astype(np.int32)
    weights = rng.standard_normal(ids.shape[0]).astype(np.float32)
    return ids, offsets, weights


def bags_outs(n: int, num_offsets: int) -> list:
    i32 = [jax.ShapeDtypeStruct((n,), jnp.int32)] * 2
    return i32 + [f32((n,)), i32[0], jax.ShapeDtypeStruct((num_offsets,), jnp.int32)]


NO_ENDS = np.full((len(FEATURE_TABLES),), np.iinfo(np.int32).max, np.int32)


def raw_tb_bags(device, ids, offsets, batch: int, clip: bool, ends=None):
    n = ids.shape[0]
    outs = bags_outs(n, offsets.shape[0])
    return poisoned_call(
        "flowtt_tb_bags",
        outs,
        ids,
        offsets,
        np.asarray(FEATURE_TABLES, np.int32),
        NUM_ROWS,
        NO_ENDS if ends is None else ends,
        device=device,
        batch=np.int64(batch),
        clip=bool(clip),
    )


def with_ends(ids, offsets, weights, ends, oob: str, kernel: bool):
    """``table_oob`` of the packed CSR whose features end at ``ends`` (a dict call's
    ``PackedCSR.bounds[:, -1]``; the bags' starts as in ``offsets``)."""
    f = len(FEATURE_TABLES)
    batch = (offsets.shape[0] - 1) // f
    offsets = saturate_int32(offsets)
    bounds = jnp.concatenate([offsets[:-1].reshape(f, batch), ends[:, None]], axis=1)
    bags = csr_bags(ids, offsets, weights)
    tables = np.asarray(FEATURE_TABLES, np.int32)
    bags, tables, _ = table_oob(
        bags, offsets, tables, NUM_ROWS, batch, oob, kernel=kernel, weights=weights, bounds=bounds
    )
    return bags, tables


def prepared(ids, offsets, weights, oob: str, kernel: bool, ends):
    """``packed_bags`` (``ends`` None), else ``with_ends``."""
    if ends is None:
        return packed_bags(ids, offsets, weights, FEATURE_TABLES, NUM_ROWS, oob, kernel=kernel)
    return with_ends(ids, offsets, weights, jnp.asarray(ends), oob, kernel)


def expected(ids, offsets, weights, oob: str, ends=None):
    """The jax.numpy path on the CPU, offsets traced (clamped, not checked)."""
    with jax.default_device(jax.devices("cpu")[0]):
        return jax.jit(lambda i, o, w: prepared(i, o, w, oob, False, ends))(ids, offsets, weights)


def check(device, ids, offsets, weights, oob: str, ends=None) -> None:
    batch = (len(offsets) - 1) // len(FEATURE_TABLES)
    want, want_tables = expected(ids, offsets, weights, oob, ends)
    got_ids, got_tables, live, bag_ids, csr = raw_tb_bags(device, ids, offsets, batch, oob == "clip", ends)
    assert np.array_equal(np.asarray(csr), np.asarray(want.offsets))  # clamped, non-decreasing
    assert np.array_equal(np.asarray(got_ids), np.asarray(want.ids))
    assert np.array_equal(np.asarray(got_tables), np.asarray(want_tables))
    assert np.array_equal(np.asarray(bag_ids), np.asarray(want.bag_ids))
    assert np.array_equal(np.asarray(live) != 0, np.asarray(want.keep))
    assert set(np.unique(np.asarray(live))) <= {0.0, 1.0}
    # and through packed_bags on the device: the effective weights too
    with jax.default_device(device):
        got, tables = jax.jit(lambda i, o, w: prepared(i, o, w, oob, True, ends))(ids, offsets, weights)
    assert np.asarray(got.weights).tobytes() == np.asarray(want.weights).tobytes()
    assert np.array_equal(np.asarray(got.ids), np.asarray(want.ids))
    assert np.array_equal(np.asarray(got.offsets), np.asarray(want.offsets))
    assert np.array_equal(np.asarray(tables), np.asarray(want_tables))


CASES = {
    "small": dict(seed=1, batch=5, mean_length=3.0),
    "blocks": dict(seed=2, batch=700, mean_length=4.0),  # ~17k positions: several blocks
    "hot_bag": dict(seed=3, batch=300, mean_length=2.0, hot=True),
    "empty_runs": dict(seed=4, batch=3000, mean_length=0.3, empty=(0, 2, 5)),  # runs of empty bags
}


@device_param
@pytest.mark.parametrize("oob", ["zero", "clip"])
@pytest.mark.parametrize("case", list(CASES))
def test_tb_bags_matches_the_jnp_path(device, oob, case):
    ids, offsets, weights = draw(**CASES[case])
    check(device, ids, offsets, weights, oob)


@device_param
@pytest.mark.parametrize("oob", ["zero", "clip"])
def test_positions_outside_every_bag_are_dropped(device, oob):
    """Traced offsets that start after 0 and end before n: the positions outside are in no
    bag (weight 0, parked), bag ids clipped to the first and last bag."""
    ids, offsets, weights = draw(seed=5, batch=400, mean_length=3.0)
    n = ids.shape[0]
    offsets = np.clip(offsets + 37, 0, n - 50).astype(np.int32)
    offsets[0] = 37
    check(device, ids, offsets, weights, oob)


@device_param
@pytest.mark.parametrize("oob", ["zero", "clip"])
def test_offsets_out_of_order_and_range_give_the_clamped_running_maximum(device, oob):
    """Traced offsets that go down, below 0 and past n (over several of the scan's tiles):
    the op's CSR is their clamp into [0, n] made non-decreasing, the bags follow it."""
    ids, offsets, weights = draw(seed=8, batch=2000, mean_length=2.0)
    n = ids.shape[0]
    rng = np.random.default_rng(8)
    bad = offsets.astype(np.int64) + rng.integers(-40, 40, offsets.shape[0])
    bad[rng.random(offsets.shape[0]) < 0.01] = -5
    bad[rng.random(offsets.shape[0]) < 0.01] = n + 9
    bad[:3] = (-3, 7, 2)
    check(device, ids, bad.astype(np.int32), weights, oob)


@device_param
@pytest.mark.parametrize("oob", ["zero", "clip"])
def test_positions_past_their_features_end_are_dropped(device, oob):
    """``ends``: a feature's positions from its end on are in no bag (a dict call's traced
    offsets that stop short of the feature's ids): ends inside the last bag, inside an
    earlier bag, at the feature's first position, before it (negative), past it and none."""
    ids, offsets, weights = draw(seed=9, batch=600, mean_length=3.0)
    b = (len(offsets) - 1) // len(FEATURE_TABLES)
    start, stop = offsets[:-1:b], offsets[b::b]
    rng = np.random.default_rng(9)
    inside = start + (rng.random(start.shape) * (stop - start)).astype(np.int32)
    ends = np.stack([stop - 1, inside, start, np.full_like(start, -4), stop + 5, NO_ENDS], axis=1)
    # a choice per feature, each kind at least once (feature 2 is empty: no end)
    pick = np.asarray([0, 1, 5, 2, 3, 4, 1])
    chosen = ends[np.arange(len(pick)), pick].astype(np.int32)
    dropped = stop - np.clip(chosen.astype(np.int64), start, stop)  # positions past each end
    assert np.all(dropped[pick < 4] > 0) and np.all(dropped[pick >= 4] == 0)
    check(device, ids, offsets, weights, oob, chosen)


@device_param
def test_nothing_live_and_one_id(device):
    """Every id out of range under "zero" (every position parked on position 0's, every
    weight 0), and a batch of one id at a table's last row."""
    ids, offsets, weights = draw(seed=6, batch=50, mean_length=2.0)
    check(device, np.full_like(ids, -5), offsets, weights, "zero")
    one = np.asarray([NUM_ROWS[FEATURE_TABLES[3]] - 1], np.int32)
    offsets = np.zeros((len(FEATURE_TABLES) + 1,), np.int32)
    offsets[4:] = 1  # feature 3's one bag holds it
    for oob in ("zero", "clip"):
        check(device, one, offsets, np.ones((1,), np.float32), oob)


@device_param
def test_bad_arguments_are_named(device):
    ids, offsets, _ = draw(seed=7, batch=4, mean_length=2.0)
    with pytest.raises(Exception, match="offsets \\[F \\* batch \\+ 1\\]"):
        jax.block_until_ready(raw_tb_bags(device, ids, offsets, batch=3, clip=False))
    n = ids.shape[0] // 2 * 2
    outs = bags_outs(n, offsets.shape[0])
    with pytest.raises(Exception, match="must be 1-D"):
        two_d = ids[:n].reshape(2, -1)
        tables = np.asarray(FEATURE_TABLES, np.int32)
        jax.block_until_ready(
            poisoned_call(
                "flowtt_tb_bags",
                outs,
                two_d,
                offsets,
                tables,
                NUM_ROWS,
                device=device,
                batch=np.int64(4),
                clip=False,
            )
        )
