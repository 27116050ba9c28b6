"""Unique-row capacities (``flowtt_jax.capacity``): the pooling ops' window of uniques, the
table-batched op in capacity passes (fewer, as many and more uniques than the capacity:
the reference's outputs and gradients, the overflow reported, passes deterministic), and
where capacities come from (``TableConfig.max_unique_ids``, ``measure_unique_ids``, the
default)."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flowtt_jax as ftt
from flowtt_jax import capacity
from flowtt_jax.kernels.group_plan import GroupLayout, make_group_plan, window_plan
from flowtt_jax.ops.pooled import kernels_unsupported_reason
from tests.helpers import bag_ids_of, f32, poisoned_call, target_pool_bwd, target_pool_fwd

jax.config.update("jax_default_matmul_precision", "highest")

SPECS = (
    ftt.TTSpec.create(1000, 8, 4, row_shape=(10, 10, 10), col_shape=(2, 2, 2)),
    ftt.TTSpec.create(37, 8, 4, row_shape=(2, 4, 5), col_shape=(2, 2, 2)),
    ftt.TTSpec.create(5000, 8, 4, row_shape=(5, 4, 250), col_shape=(2, 2, 2)),
)
LAYOUT = GroupLayout(SPECS)
FEATURE_TABLES = (0, 2, 1, 0)
KERNELS = kernels_unsupported_reason(layout=LAYOUT) is None
needs_kernels = pytest.mark.skipif(not KERNELS, reason="no table-batched kernels in this build")


@jax.jit
def _packed_of_key(key):
    keys = jax.random.split(key, LAYOUT.num_tables)
    return LAYOUT.pack([ftt.init_cores(k, s, std=1.0) for k, s in zip(keys, LAYOUT.specs)])


def _packed(seed: int):
    return _packed_of_key(jax.random.key(seed))  # one program for every seed


# one program per shape (and window) for the oracles' plans
_make_plan = jax.jit(ftt.make_plan, static_argnums=1)
_group_plan = jax.jit(make_group_plan, static_argnums=0)
_window_plan = jax.jit(window_plan, static_argnums=(1, 2))


def _batch(seed: int, batch: int = 6, unique: bool = False):
    """ids [n], offsets [F*B+1], weights [n]; ``unique``: every (table, id) once (each
    feature draws distinct ids, features of one table disjoint ones)."""
    rng = np.random.default_rng(seed)
    lengths = rng.choice([0, 1, 3, 7], size=len(FEATURE_TABLES) * batch)
    ids, start = [], {}
    for f, t in enumerate(FEATURE_TABLES):
        count = int(lengths[f * batch : (f + 1) * batch].sum())
        n_rows = SPECS[t].num_embeddings
        if unique:
            first = start.get(t, 0)
            draw = (first + rng.permutation(n_rows - first)[:count]) % n_rows
            start[t] = first + count
        else:
            draw = rng.integers(0, n_rows, count)
            draw[rng.random(count) < 0.3] = n_rows - 1  # the last row, many times
        ids.append(draw)
    ids = np.concatenate(ids).astype(np.int32)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    return ids, offsets, rng.standard_normal(ids.shape[0]).astype(np.float32)


def _num_unique(ids, offsets, batch: int = 6) -> int:
    tables = np.repeat(np.repeat(FEATURE_TABLES, batch), np.diff(offsets))
    return len(set(zip(tables.tolist(), ids.tolist())))


def _op(packed, ids, offsets, weights, cap, impl="ffi", per_pass=None, **kw):
    return ftt.tt_embedding_bag_group(
        packed,
        LAYOUT,
        ids,
        offsets,
        FEATURE_TABLES,
        weights=weights,
        impl=impl,
        unique_capacity=cap,
        ids_per_pass=per_pass,
        **kw,
    )


# ---- the pooling ops' window (the targets, outputs poisoned) ----


def _window_case(seed: int):
    rng = np.random.default_rng(seed)
    n, dim, num_bags = 60, 8, 9
    ids = rng.integers(0, 25, n).astype(np.int32)
    plan = _make_plan(ids, 5)
    offsets = np.sort(rng.integers(0, n + 1, num_bags + 1)).astype(np.int32)
    offsets[0], offsets[-1] = 0, n
    weights = rng.standard_normal(n).astype(np.float32)
    rows = rng.standard_normal((n, dim)).astype(np.float32)  # the rows of every unique
    return plan, offsets, weights, rows, int(plan.counts[0])


@pytest.mark.parametrize("lo, m", [(0, 7), (5, 7), (14, 30), (40, 8)])
def test_pool_fwd_window_adds_its_uniques_onto_prev(lo, m):
    """Rows [m, D] of uniques [lo, lo + m) capped at num_unique, added onto prev: the sum
    over the positions of those uniques, in float64 within rounding; a window past the
    uniques gives prev."""
    plan, offsets, weights, rows, num_unique = _window_case(lo + m)
    inverse = np.asarray(plan.inverse)
    prev = np.random.default_rng(1).standard_normal((len(offsets) - 1, rows.shape[1])).astype(np.float32)
    window = np.zeros((m, rows.shape[1]), np.float32)
    hi = min(lo + m, num_unique)
    window[: max(hi - lo, 0)] = rows[lo:hi]
    got = target_pool_fwd(poisoned_call, window, plan, weights, offsets, lo=lo, counts=plan.counts, prev=prev)
    want = prev.astype(np.float64)
    for b in range(len(offsets) - 1):
        for k in range(offsets[b], offsets[b + 1]):
            if lo <= inverse[k] < hi:
                want[b] += weights[k] * rows[inverse[k]].astype(np.float64)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("lo, m", [(0, 7), (5, 7), (14, 30), (40, 8)])
def test_pool_bwd_window_gives_its_uniques_gradient(lo, m):
    """d_rows [m, D] of uniques [lo, lo + m): the sums over their runs; d_weights of the
    other positions 0."""
    plan, offsets, weights, rows, num_unique = _window_case(lo + m + 100)
    n, dim = weights.shape[0], rows.shape[1]
    dout = np.random.default_rng(2).standard_normal((len(offsets) - 1, dim)).astype(np.float32)
    bag_ids = bag_ids_of(offsets, n)
    hi = min(lo + m, num_unique)
    window = np.zeros((m, dim), np.float32)
    window[: max(hi - lo, 0)] = rows[lo:hi]
    d_rows, d_w = target_pool_bwd(poisoned_call, dout, window, weights, plan, bag_ids, lo=lo, m=m)
    inverse = np.asarray(plan.inverse)
    want_rows = np.zeros((max(hi - lo, 0), dim))
    want_w = np.zeros(n)
    for k in range(n):
        u = inverse[k]
        if lo <= u < hi:
            want_rows[u - lo] += weights[k] * dout[bag_ids[k]]
            want_w[k] = dout[bag_ids[k]] @ rows[u]
    np.testing.assert_allclose(np.asarray(d_rows)[: hi - lo], want_rows, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(d_w), want_w, rtol=1e-5, atol=1e-5)


def test_pool_window_errors_name_the_window():
    plan, offsets, weights, rows, _ = _window_case(0)
    with pytest.raises(Exception, match="lo"):
        jax.block_until_ready(target_pool_fwd(poisoned_call, rows, plan, weights, offsets, lo=-1))
    with pytest.raises(Exception, match="prev must be"):
        bad_prev = np.zeros((3, rows.shape[1]), np.float32)
        jax.block_until_ready(target_pool_fwd(poisoned_call, rows, plan, weights, offsets, prev=bad_prev))
    with pytest.raises(Exception, match=r"rows must be \[5, 8\]"):  # rows and d_rows: one window
        outs = [f32((5, rows.shape[1])), f32((weights.shape[0],))]
        args = (plan.inverse, bag_ids_of(offsets, weights.shape[0]), plan.perm, plan.run_offsets, plan.counts)
        dout = np.zeros((len(offsets) - 1, rows.shape[1]), np.float32)
        jax.block_until_ready(
            poisoned_call("flowtt_bag_pool_bwd", outs, dout, rows, weights, *args, lo=np.int64(0))
        )


@pytest.mark.parametrize("lo, size", [(0, 1), (0, 40), (7, 13), (30, 64), (61, 5), (500, 9)])
def test_window_op_is_the_reference_window(lo, size):
    """flowtt_tb_window (outputs poisoned) equals window_plan bit for bit: windows at 0, cut
    inside prefix groups, at the last unique and past every unique."""
    ids, offsets, _ = _batch(lo + size)
    tables = np.repeat(np.repeat(FEATURE_TABLES, 6), np.diff(offsets)).astype(np.int32)
    plan = _group_plan(LAYOUT, ids, tables)
    want = _window_plan(plan, lo, size)
    outs = [jax.ShapeDtypeStruct((size + 1,), jnp.int32)]
    outs += [jax.ShapeDtypeStruct((size,), jnp.int32)] * 3 + [jax.ShapeDtypeStruct((2,), jnp.int32)]
    args = (plan.group_offsets, plan.u_i3, plan.g_i1, plan.g_i2, plan.counts)
    got = poisoned_call("flowtt_tb_window", outs, *args, lo=np.int64(lo))
    names = ("group_offsets", "u_i3", "g_i1", "g_i2", "counts")
    for name, a in zip(names, got):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(getattr(want, name)), err_msg=name)
    assert int(want.counts[0]) == max(0, min(size, int(plan.counts[0]) - lo))


def test_window_op_errors_name_the_window():
    ids, offsets, _ = _batch(1)
    tables = np.repeat(np.repeat(FEATURE_TABLES, 6), np.diff(offsets)).astype(np.int32)
    plan = _group_plan(LAYOUT, ids, tables)
    args = (plan.group_offsets, plan.u_i3, plan.g_i1, plan.g_i2, plan.counts)
    outs = [jax.ShapeDtypeStruct((5,), jnp.int32)] * 4 + [jax.ShapeDtypeStruct((2,), jnp.int32)]
    with pytest.raises(Exception, match="flowtt_tb_window: the window must be"):
        jax.block_until_ready(poisoned_call("flowtt_tb_window", outs, *args, lo=np.int64(0)))
    outs[0] = jax.ShapeDtypeStruct((6,), jnp.int32)
    with pytest.raises(Exception, match="need 0 <= lo"):
        jax.block_until_ready(poisoned_call("flowtt_tb_window", outs, *args, lo=np.int64(-1)))


# ---- the op in capacity passes ----


@needs_kernels
@pytest.mark.parametrize("unique", [False, True], ids=["skewed", "all-unique"])
@pytest.mark.parametrize("weighted", [False, True])
def test_capacity_passes_give_the_reference(unique, weighted):
    """Capacities below, at and above the batch's unique rows (and 1): outputs and
    gradients (cores, weights) of the reference; every capacity below the uniques is
    reported."""
    packed = _packed(3)
    ids, offsets, weights = _batch(4, unique=unique)
    num_unique = _num_unique(ids, offsets)
    w = jnp.asarray(weights) if weighted else None

    def loss(p, w, cap, impl):
        out = _op(p, ids, offsets, w, cap, impl)
        return jnp.sum(jnp.sin(out) * jnp.arange(out.size).reshape(out.shape) / out.size), out

    grad = jax.jit(jax.grad(loss, argnums=(0, 1), has_aux=True), static_argnums=(2, 3))
    (g_ref, w_ref), out_ref = grad(packed, w, None, "reference")
    n = ids.shape[0]
    caps = (n, num_unique, num_unique - 1, num_unique // 3 + 1, -(-n // capacity.MAX_PASSES))
    # every capacity's gradients and overflow flag in one program (a program each: ~10)
    every = jax.jit(
        lambda p, w: [
            (grad(p, w, cap, "ffi"), _op(p, ids, offsets, w, cap, return_overflow=True)[1]) for cap in caps
        ]
    )
    for cap, (((g, gw), out), overflow) in zip(caps, every(packed, w)):
        np.testing.assert_allclose(np.asarray(out), np.asarray(out_ref), rtol=1e-4, atol=1e-4)
        for a, b in zip(g, g_ref):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-4)
        if weighted:
            np.testing.assert_allclose(np.asarray(gw), np.asarray(w_ref), rtol=1e-4, atol=1e-4)
        # the overflow is a device flag of the call (no host callback in the program)
        assert bool(overflow) == (cap < num_unique), (cap, num_unique)
        assert "callback" not in grad.lower(packed, w, cap, "ffi").as_text()


@needs_kernels
def test_passes_are_deterministic_and_one_pass_within_rounding():
    """Two runs in passes are bitwise equal; one pass (no capacity) equal within rounding."""
    packed = _packed(5)
    ids, offsets, weights = _batch(6, unique=True)
    cap = _num_unique(ids, offsets) // 4 + 1

    def grads(cap):
        f = lambda p: jnp.sum(_op(p, ids, offsets, jnp.asarray(weights), cap) ** 2)  # noqa: E731
        return jax.jit(jax.grad(f))(packed)

    a, b, one = grads(cap), grads(cap), grads(None)
    for x, y, z in zip(a, b, one):
        assert np.asarray(x).tobytes() == np.asarray(y).tobytes()
        np.testing.assert_allclose(np.asarray(x), np.asarray(z), rtol=1e-5, atol=1e-5)


@needs_kernels
@pytest.mark.parametrize("weighted", [False, True])
def test_ids_per_pass_gives_the_reference_and_is_deterministic(weighted):
    """ids_per_pass below n (a bag cut between passes, the last pass overlapping the one
    before), with and without a capacity per pass: the reference's outputs and gradients
    (cores, weights); two runs bitwise equal."""
    packed = _packed(7)
    ids, offsets, weights = _batch(8, batch=9)
    w = jnp.asarray(weights) if weighted else None
    n = ids.shape[0]

    def loss(p, w, per, cap, impl):
        out = ftt.tt_embedding_bag_group(
            p,
            LAYOUT,
            ids,
            offsets,
            FEATURE_TABLES,
            weights=w,
            impl=impl,
            ids_per_pass=per,
            unique_capacity=cap,
        )
        return jnp.sum(jnp.sin(out)), out

    grad = jax.jit(jax.grad(loss, argnums=(0, 1), has_aux=True), static_argnums=(2, 3, 4))
    (g_ref, w_ref), out_ref = grad(packed, w, None, None, "reference")
    for per, cap in ((n, None), (n // 3 + 1, None), (17, None), (n // 2 + 1, 9)):
        (g, gw), out = grad(packed, w, per, cap, "ffi")
        np.testing.assert_allclose(np.asarray(out), np.asarray(out_ref), rtol=1e-4, atol=1e-4)
        for a, b in zip(g, g_ref):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-4)
        if weighted:
            np.testing.assert_allclose(np.asarray(gw), np.asarray(w_ref), rtol=1e-4, atol=1e-4)
    (g1, _), _ = grad(packed, w, 17, None, "ffi")
    (g2, _), _ = grad(packed, w, 17, None, "ffi")
    assert all(np.asarray(a).tobytes() == np.asarray(b).tobytes() for a, b in zip(g1, g2))


@needs_kernels
def test_ids_per_pass_bounds_the_step_memory():
    """XLA's temporaries of a step in 4 passes are under 2/3 of one pass's (CPU; at D = 8
    the per-id inputs kept for the backward are a large part of both)."""
    packed = _packed(9)
    ids, offsets, weights = _batch(10, batch=200)
    n = ids.shape[0]

    def temp(per):
        f = jax.grad(lambda p: jnp.sum(_op(p, ids, offsets, None, None, per_pass=per) ** 2))
        return jax.jit(f).lower(packed).compile().memory_analysis().temp_size_in_bytes

    assert temp(n // 4 + 1) < 0.67 * temp(None)


def test_capacity_passes_and_errors():
    assert capacity.capacity_passes(100, None) == (100, 1)
    assert capacity.capacity_passes(100, 500) == (100, 1)
    assert capacity.capacity_passes(100, 30) == (30, 4)
    with pytest.raises(ValueError, match="unique_capacity must be >= 1"):
        capacity.capacity_passes(100, 0)
    with pytest.raises(ValueError, match="at most 64.*use at least 157"):
        capacity.capacity_passes(10_000, 10)


# ---- where capacities come from ----


def test_measure_unique_ids_counts_each_tables_features_together():
    batches = [
        {"a": (np.array([1, 2, 2, 3]), np.array([0, 4])), "b": np.array([3, 9]), "c": np.array([5])},
        {"a": np.array([1, 1]), "b": np.array([7, 8, 9]), "c": np.arange(200)},
    ]
    caps = capacity.measure_unique_ids(batches, {"a": "x", "b": "x", "c": "y", "d": "z"}, margin=1.0)
    assert caps == {"x": 64, "y": 256, "z": 64}  # x: {1,2,3,9} / {1,7,8,9}; y: 200 -> 256
    big = capacity.measure_unique_ids([{"c": np.arange(1000)}], {"c": "y"}, margin=1.5)
    assert big == {"y": 1536}
    with pytest.raises(KeyError, match=r"measure_unique_ids: features \['q'\]"):
        capacity.measure_unique_ids([{"q": np.arange(3)}], {"c": "y"})
    with pytest.raises(ValueError, match="margin"):
        capacity.measure_unique_ids([], {}, margin=0.5)


def test_table_config_capacity_makes_the_group_capacity():
    from flowtt_jax.collection import TableConfig
    from flowtt_jax.collection.packs import pack_tables

    def tables(caps):
        return [
            TableConfig("u", 1000, 8, rank=4, max_unique_ids=caps[0]),
            TableConfig("v", 50, 8, rank=4, max_unique_ids=caps[1]),
        ]

    (pack,) = pack_tables(tables((100, 80)))
    assert pack.unique_capacity == 150  # v's capacity is at most its 50 rows
    (pack,) = pack_tables(tables((100, None)))
    assert pack.unique_capacity is None  # the default: one row per id
    with pytest.raises(ValueError, match="table 'w': max_unique_ids must be >= 1"):
        TableConfig("w", 10, 8, max_unique_ids=0)
    with pytest.raises(TypeError, match="table 'w': max_unique_ids"):
        TableConfig("w", 10, 8, max_unique_ids=2.5)


@needs_kernels
def test_collection_with_capacities_matches_without():
    """A TTEmbeddingCollection whose tables carry measured capacities (one far too small:
    passes) gives the same bags and gradients as without."""
    from flax import nnx

    from flowtt_jax.collection import TableConfig
    from flowtt_jax.collection.layout import CollectionLayout
    from flowtt_jax.nnx import TTEmbeddingCollection

    rng = np.random.default_rng(0)
    feats = {"a": rng.integers(0, 1000, (16, 5)), "b": rng.integers(0, 500, (16, 3))}
    caps = capacity.measure_unique_ids([feats], {"a": "ta", "b": "tb"}, margin=1.0)

    def make(with_caps: bool):
        cfgs = [
            TableConfig(
                "ta", 1000, 8, rank=4, feature_names=("a",), max_unique_ids=caps["ta"] if with_caps else None
            ),
            TableConfig("tb", 500, 8, rank=4, feature_names=("b",), max_unique_ids=7 if with_caps else None),
        ]
        return TTEmbeddingCollection(cfgs, rngs=nnx.Rngs(0))

    plain, capped = make(False), make(True)
    nnx.update(capped, nnx.state(plain))
    # counted on the device, once per call and pack, where the uniques pass the capacity
    step = nnx.jit(lambda m, x: m(x))
    step(capped, feats), step(capped, feats), step(plain, feats)
    over = int(np.unique(feats["a"]).size + np.unique(feats["b"]).size > caps["ta"] + 7)
    assert list(capped.overflows().values()) == [2 * over] and list(plain.overflows().values()) == [0]
    assert "tt0_" in next(iter(capped.overflows())) and "ta, tb" in next(iter(capped.overflows()))
    tight = TTEmbeddingCollection(
        [dataclasses.replace(c, max_unique_ids=7) for c in capped.tables], rngs=nnx.Rngs(0)
    )
    step(tight, feats)
    assert list(tight.overflows().values()) == [1]
    capped.layout = CollectionLayout(capped.layout.tables, ids_per_pass=20)  # and in passes

    def loss(model):
        out = model(feats)
        return sum(jnp.sum(v**2) for v in out.values())

    value_and_grad = nnx.jit(nnx.value_and_grad(loss))
    (got_loss, got), (want_loss, want) = value_and_grad(capped), value_and_grad(plain)
    np.testing.assert_allclose(float(got_loss), float(want_loss), rtol=1e-5)
    for (path, a), (_, b) in zip(jax.tree.leaves_with_path(got), jax.tree.leaves_with_path(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5, err_msg=str(path))


@needs_kernels
def test_linen_counts_overflows_in_its_stats_collection():
    """linen: init makes ``stats/overflow_counts`` (zeros); with ``mutable=["stats"]`` each
    call adds its packs' overflows; an immutable call without the stats is fine."""
    from flowtt_jax.collection import TableConfig
    from flowtt_jax.linen import TTEmbeddingCollection

    rng = np.random.default_rng(1)
    feats = {"a": rng.integers(0, 1000, (16, 5)), "b": rng.integers(0, 500, (16, 3))}
    cfgs = [
        TableConfig("ta", 1000, 8, rank=4, feature_names=("a",), max_unique_ids=7),
        TableConfig("tb", 500, 8, rank=4, feature_names=("b",), max_unique_ids=7),
    ]
    model = TTEmbeddingCollection(cfgs)
    variables = jax.jit(model.init)(jax.random.key(0), feats)  # the counter made, the init call not counted
    np.testing.assert_array_equal(np.asarray(variables["stats"]["overflow_counts"]), [0])
    apply = jax.jit(functools.partial(model.apply, mutable=["stats"]))
    _, stats = apply(variables, feats)
    _, stats = apply({**variables, **stats}, feats)
    np.testing.assert_array_equal(np.asarray(stats["stats"]["overflow_counts"]), [2])
    plain = jax.jit(model.apply)({"params": variables["params"]}, feats)  # immutable, no stats: same bags
    assert set(plain) == {"a", "b"}
