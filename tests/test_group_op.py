"""The table-batched op against a per-table loop of the single-table reference.

Every check draws fresh random cores and ids (fixed seeds) for a group of tables of
different sizes and row shapes; two features share a table, one feature is empty,
bags are empty at random, ids hit each table's last row.
"""

from __future__ import annotations

import math
import re
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flowtt_jax as ftt
from flowtt_jax import tt_embedding_bag_group
from flowtt_jax.kernels import ffi
from flowtt_jax.kernels.group_plan import GroupLayout, make_group_plan, plan_rows
from flowtt_jax.ops.pooled import kernels_unsupported_reason, takes_single_table_kernels
from tests.helpers import SLOW_REFERENCE

jax.config.update("jax_default_matmul_precision", "highest")

SPECS = (
    ftt.TTSpec.create(1000, 16, 4, row_shape=(10, 10, 10), col_shape=(2, 2, 4)),
    ftt.TTSpec.create(37, 16, 4, row_shape=(2, 4, 5), col_shape=(2, 2, 4)),
    ftt.TTSpec.create(5000, 16, 4, row_shape=(5, 4, 250), col_shape=(2, 2, 4)),
    ftt.TTSpec.create(3, 16, 4, row_shape=(2, 1, 2), col_shape=(2, 2, 4)),
)
LAYOUT = GroupLayout(SPECS)
# features -> tables: table 0 read by features 0 and 3, feature 4 (table 1) is empty
FEATURE_TABLES = (0, 2, 1, 0, 1, 3)
IMPLS = [SLOW_REFERENCE] + ([] if kernels_unsupported_reason(layout=LAYOUT) else ["ffi"])


def make_packed(seed: int, layout: GroupLayout = LAYOUT):
    """Packed Gaussian cores scaled as ``init_cores(std=1.0)`` scales them (rows of std 1),
    drawn by numpy: no random program compiled per core shape."""
    rng = np.random.default_rng(seed)
    core_std = [math.prod(s.ranks) ** (-1.0 / (2 * s.num_cores)) for s in layout.specs]
    return layout.pack(
        [
            [(std * rng.standard_normal(c)).astype(np.float32) for c in s.core_shapes]
            for std, s in zip(core_std, layout.specs)
        ]
    )


def make_batch(seed: int, batch: int = 7, feature_tables=FEATURE_TABLES, specs=SPECS, empty=(4,)):
    """ids [n], offsets [F*B+1], weights [n] (numpy), and per-feature (ids, offsets)."""
    rng = np.random.default_rng(seed)
    ids, lengths = [], []
    for f, t in enumerate(feature_tables):
        n_rows = specs[t].num_embeddings
        for _ in range(batch):
            length = 0 if f in empty else int(rng.choice([0, 1, 2, 5, 13]))
            draw = rng.integers(0, n_rows, length)
            draw[rng.random(length) < 0.3] = n_rows - 1  # last row, duplicates
            ids.append(draw)
            lengths.append(length)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    ids = np.concatenate(ids).astype(np.int32)
    weights = rng.standard_normal(ids.shape[0]).astype(np.float32)
    return ids, offsets, weights


def per_table_loop(
    packed, ids, offsets, weights, modes, feature_tables=FEATURE_TABLES, layout=LAYOUT, oob="zero"
):
    """[F, B, D]: one reference ``tt_embedding_bag`` per feature."""
    num_features = len(feature_tables)
    batch = (len(offsets) - 1) // num_features
    outs = []
    for f, t in enumerate(feature_tables):
        lo, hi = offsets[f * batch], offsets[(f + 1) * batch]
        feature_offsets = offsets[f * batch : (f + 1) * batch + 1] - lo
        outs.append(
            ftt.tt_embedding_bag(
                layout.table_cores(packed, t),
                ids[lo:hi],
                offsets=feature_offsets,
                weights=None if weights is None else weights[lo:hi],
                mode=modes[f],
                num_embeddings=layout.specs[t].num_embeddings,
                oob=oob,
                impl="reference",
            )
        )
    return jnp.stack(outs)


def jitted_loop(ids, offsets, modes, oob="zero"):
    """``per_table_loop`` of these bags as one program of ``(packed, weights)`` (one compile,
    not one per reference op)."""
    return jax.jit(lambda c, w: per_table_loop(c, ids, offsets, w, modes, oob=oob))


def test_layout_packs_and_slices_back():
    tables = [ftt.init_cores(jax.random.key(t), s) for t, s in enumerate(SPECS)]
    packed = LAYOUT.pack(tables)
    assert tuple(c.shape for c in packed) == LAYOUT.packed_shapes()
    for t, cores in enumerate(tables):
        for a, b in zip(LAYOUT.table_cores(packed, t), cores):
            np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="share both"):
        GroupLayout((SPECS[0], ftt.TTSpec.create(100, 16, 8, col_shape=(2, 2, 4))))
    with pytest.raises(ValueError, match="3-core"):
        GroupLayout((ftt.TTSpec.create(100, 16, 4, num_cores=2),))


def _brute_force_plan(layout, ids, tables):
    keys = sorted(set(zip(tables.tolist(), ids.tolist())))
    offs = layout.core_offsets
    u_i3, groups = [], []
    for t, i in keys:
        p2, p3 = layout.specs[t].row_shape[1:]
        u_i3.append(offs[2][t] + i % p3)
        g = (t, i // p3)
        if not groups or groups[-1][0] != g:
            groups.append((g, offs[0][t] + i // (p2 * p3), offs[1][t] + (i // p3) % p2))
    return keys, u_i3, groups


BIG = ftt.TTSpec.create(1_500_000_000, 16, 4, col_shape=(2, 2, 4))
# row_base keys fit int32, prefix keys (S = 46000 times 46M + 4 prefixes) do not
WIDE = (
    ftt.TTSpec.create(184_000, 16, 4, row_shape=(2, 2, 46_000), col_shape=(2, 2, 4)),
    ftt.TTSpec.create(46_000_000, 16, 4, row_shape=(46_000, 1000, 1), col_shape=(2, 2, 4)),
    SPECS[2],
)


@pytest.mark.parametrize(
    "specs,key_bits,prefix_keys",
    [
        (SPECS, 31, True),
        (WIDE, 31, False),
        ((BIG, SPECS[1], BIG), 32, False),
        ((BIG, SPECS[1], BIG, BIG), 33, False),
    ],
    ids=["prefix_keys", "row_base_keys", "uint32_keys", "two_sorts"],
)
def test_plan_matches_brute_force(specs, key_bits, prefix_keys):
    layout = GroupLayout(specs)
    assert max((layout.row_base[-1] - 1).bit_length(), 31) == key_bits
    assert (layout.prefix_keys is not None) == prefix_keys
    rng = np.random.default_rng(0)
    n = 400
    tables = rng.integers(0, len(specs), n).astype(np.int32)
    n_rows = np.asarray([s.num_embeddings for s in specs])[tables]
    ids = (rng.integers(0, 40, n) * (n_rows // 40) + rng.integers(0, 3, n)).astype(np.int32)
    ids = np.minimum(ids, n_rows - 1).astype(np.int32)
    plan = jax.jit(make_group_plan, static_argnums=0)(layout, jnp.asarray(ids), jnp.asarray(tables))
    if ffi.available():  # the plan op (C++ on CPU) as sort_plan: the same plan bit for bit
        with_op = jax.jit(make_group_plan, static_argnums=(0, 3))(
            layout, jnp.asarray(ids), jnp.asarray(tables), ffi.plan
        )
        for a, b in zip(plan, with_op):
            np.testing.assert_array_equal(a, b)
    keys, u_i3, groups = _brute_force_plan(layout, ids, tables)
    nu, ng = (int(x) for x in plan.counts)
    assert (nu, ng) == (len(keys), len(groups))
    np.testing.assert_array_equal(plan.u_i3[:nu], u_i3)
    np.testing.assert_array_equal(plan.g_i1[:ng], [g[1] for g in groups])
    np.testing.assert_array_equal(plan.g_i2[:ng], [g[2] for g in groups])
    inv = np.asarray(plan.inverse)
    for k in range(n):
        assert keys[inv[k]] == (tables[k], ids[k])
    perm, runs = np.asarray(plan.perm), np.asarray(plan.run_offsets)
    for u in range(nu):
        assert np.all(inv[perm[runs[u] : runs[u + 1]]] == u)
        assert np.all(np.diff(perm[runs[u] : runs[u + 1]]) > 0)  # stable
    np.testing.assert_array_equal(runs[nu:], n)
    go = np.asarray(plan.group_offsets)
    assert go[0] == 0 and np.all(go[ng:] == nu)
    assert np.all(np.diff(np.asarray(plan.g_i1[:ng])) >= 0)


def test_plan_rows_are_the_tables_rows():
    packed = make_packed(1)
    ids, offsets, _ = make_batch(2)
    tables = np.repeat(np.asarray(FEATURE_TABLES), 7)[
        np.searchsorted(offsets, np.arange(len(ids)), side="right") - 1
    ]
    plan = jax.jit(make_group_plan, static_argnums=0)(
        LAYOUT, jnp.asarray(ids), jnp.asarray(tables, jnp.int32)
    )
    rows = np.asarray(jax.jit(plan_rows)(packed, plan))
    dense = jax.jit(
        lambda p: [ftt.to_dense(LAYOUT.table_cores(p, t), s.num_embeddings) for t, s in enumerate(SPECS)]
    )(packed)
    dense = [np.asarray(d) for d in dense]
    inv = np.asarray(plan.inverse)
    for k in range(len(ids)):
        np.testing.assert_allclose(rows[inv[k]], dense[tables[k]][ids[k]], rtol=1e-5, atol=1e-6)
    assert np.all(rows[int(plan.counts[0]) :] == 0)


MODES = ("sum", "mean", "sqrtn", "sum", "mean", "sqrtn")


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("weighted", [False, True])
def test_forward_matches_per_table_loop(impl, weighted):
    packed = make_packed(3)
    ids, offsets, weights = make_batch(4)
    w = weights if weighted else None
    out = jax.jit(
        lambda c, i, o, w: tt_embedding_bag_group(
            c, LAYOUT, i, o, FEATURE_TABLES, weights=w, mode=MODES, impl=impl
        )
    )(packed, ids, offsets, w)
    expected = jitted_loop(ids, offsets, MODES)(packed, w)
    assert out.shape == (len(FEATURE_TABLES), 7, 16)
    np.testing.assert_allclose(out, expected, rtol=2e-5, atol=2e-6)
    assert np.all(np.asarray(out[4]) == 0)  # the empty feature


@pytest.mark.parametrize("impl", IMPLS)
def test_gradients_match_per_table_loop(impl):
    packed = make_packed(5)
    ids, offsets, weights = make_batch(6)
    dout = jax.random.normal(jax.random.key(7), (len(FEATURE_TABLES), 7, 16))

    def loss(fn):
        return lambda c, w: jnp.sum(fn(c, w) * dout)

    ours = jax.jit(
        jax.grad(
            loss(
                lambda c, w: tt_embedding_bag_group(
                    c, LAYOUT, ids, offsets, FEATURE_TABLES, weights=w, mode=MODES, impl=impl
                )
            ),
            (0, 1),
        )
    )
    ref = jax.jit(jax.grad(loss(lambda c, w: per_table_loop(c, ids, offsets, w, MODES)), (0, 1)))
    (dc, dw), (dc_ref, dw_ref) = ours(packed, weights), ref(packed, weights)
    for a, b in zip(dc, dc_ref):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(dw, dw_ref, rtol=2e-5, atol=2e-5)
    if impl == "ffi":  # the kernels' fixed summation order (XLA's GPU scatter-add has none)
        again = ours(packed, weights)
        for a, b in zip(jax.tree.leaves(again), jax.tree.leaves((dc, dw))):
            assert np.asarray(a).tobytes() == np.asarray(b).tobytes()


@pytest.mark.parametrize("impl", IMPLS)
def test_batch_major_is_the_transposed_output_and_gradient(impl):
    """``batch_major=True``: ``[B, F, D]``, bit for bit the feature-major output transposed
    (the kernels write that layout; the same sums in the same order), and the gradients of
    a cotangent given batch-major equal those of its transpose, bit for bit (to rounding for
    the reference on a GPU, whose scatter-add has no fixed order)."""
    packed = make_packed(21)
    ids, offsets, weights = make_batch(22)
    batch = (len(offsets) - 1) // len(FEATURE_TABLES)
    dout = jax.random.normal(jax.random.key(23), (batch, len(FEATURE_TABLES), 16))

    def run(batch_major):
        def loss(c, w):
            out = tt_embedding_bag_group(
                c,
                LAYOUT,
                ids,
                offsets,
                FEATURE_TABLES,
                weights=w,
                mode=MODES,
                impl=impl,
                batch_major=batch_major,
            )
            return jnp.sum(out * (dout if batch_major else jnp.swapaxes(dout, 0, 1))), out

        return jax.jit(jax.grad(loss, (0, 1), has_aux=True))(packed, weights)

    (dc_bm, dw_bm), out_bm = run(True)
    (dc, dw), out = run(False)
    assert out_bm.shape == (batch, len(FEATURE_TABLES), 16)
    np.testing.assert_allclose(
        out_bm, jnp.swapaxes(jitted_loop(ids, offsets, MODES)(packed, weights), 0, 1), rtol=2e-5, atol=2e-6
    )
    exact = impl == "ffi" or jax.default_backend() == "cpu"
    for a, b in zip((out_bm, *dc_bm, dw_bm), (jnp.swapaxes(out, 0, 1), *dc, dw)):
        if exact:
            assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
        else:
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("oob", ["zero", "clip"])
def test_out_of_range_ids_follow_the_policy_per_table(impl, oob):
    packed = make_packed(8)
    ids, offsets, weights = make_batch(9)
    rng = np.random.default_rng(10)
    bad = rng.random(len(ids)) < 0.2
    ids = np.where(bad, rng.choice([-3, 7000, 2**30], len(ids)), ids).astype(np.int32)
    out = jax.jit(  # one program, not op by op; the ids stay host constants
        lambda c, w: tt_embedding_bag_group(
            c, LAYOUT, ids, offsets, FEATURE_TABLES, weights=w, mode=MODES, oob=oob, impl=impl
        )
    )(packed, weights)
    expected = jitted_loop(ids, offsets, MODES, oob=oob)(packed, weights)
    np.testing.assert_allclose(out, expected, rtol=2e-5, atol=2e-6)


def test_oob_error_names_the_position():
    packed = make_packed(11)
    ids, offsets, _ = make_batch(12)
    ids[3] = 10**6
    with pytest.raises(ValueError, match="position 3"):
        tt_embedding_bag_group(packed, LAYOUT, ids, offsets, FEATURE_TABLES, oob="error")


@pytest.mark.parametrize("impl", IMPLS)
def test_vmap_over_weights(impl):
    packed = make_packed(13)
    ids, offsets, weights = make_batch(14)
    ws = np.stack([weights, 2 * weights, -weights])
    out = jax.jit(  # one program, not op by op
        jax.vmap(
            lambda w: tt_embedding_bag_group(
                packed, LAYOUT, ids, offsets, FEATURE_TABLES, weights=w, impl=impl
            )
        )
    )(ws)
    loop = jitted_loop(ids, offsets, ("sum",) * 6)
    for k in range(3):
        expected = loop(packed, ws[k])
        np.testing.assert_allclose(out[k], expected, rtol=2e-5, atol=2e-6)


def test_one_id_and_no_ids():
    packed = make_packed(15)

    @jax.jit  # one program, not op by op; the ids stay host constants
    def one_and_none(p):
        one = tt_embedding_bag_group(p, LAYOUT, np.array([36], np.int32), np.array([0, 1], np.int32), (1,))
        empty = tt_embedding_bag_group(
            p, LAYOUT, np.zeros((0,), np.int32), np.zeros((2 * 3 + 1,), np.int32), (0, 2)
        )
        return one, ftt.to_dense(LAYOUT.table_cores(p, 1), 37)[36], empty

    out, expected, empty = one_and_none(packed)
    np.testing.assert_allclose(out[0, 0], expected, rtol=1e-5, atol=1e-6)
    assert empty.shape == (2, 3, 16) and np.all(np.asarray(empty) == 0)


@pytest.mark.skipif("ffi" not in IMPLS, reason="no table-batched kernels in this build")
def test_one_table_group_runs_the_single_table_kernels():
    """T = 1: the group's packed cores are the table's, and the single-table kernels run
    (no table-batched call): outputs and gradients bitwise those of ``tt_embedding_bag``."""
    layout = GroupLayout((SPECS[2],))
    packed = make_packed(21, layout)
    ids, offsets, weights = make_batch(21, feature_tables=(0, 0), specs=layout.specs, empty=())

    def group(p, w):
        return tt_embedding_bag_group(p, layout, ids, offsets, (0, 0), weights=w, impl="ffi")

    def single(p, w):
        out = ftt.tt_embedding_bag(p, ids, offsets=offsets, weights=w, impl="ffi")
        return out.reshape(2, -1, out.shape[-1])

    text = jax.jit(group).lower(packed, weights).as_text()
    assert "flowtt_bag_fwd" in text and "flowtt_tb_rows" not in text
    w = jnp.asarray(weights)
    got, want = jax.jit(group)(packed, w), jax.jit(single)(packed, w)  # a program each, not op by op
    assert np.asarray(got).tobytes() == np.asarray(want).tobytes()
    loss = lambda f: jax.jit(jax.grad(lambda p, w: jnp.sum(jnp.sin(f(p, w))), argnums=(0, 1)))
    got, want = loss(group)(packed, w), loss(single)(packed, w)
    for g, x in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert np.asarray(g).tobytes() == np.asarray(x).tobytes()
    # a device's slot of a table-wise layout is padded to its largest table: never taken
    # as that table's cores
    padded = tuple(np.pad(np.asarray(c), ((0, 1), (0, 0), (0, 0), (0, 0))) for c in packed)
    assert takes_single_table_kernels(layout, packed)
    assert not takes_single_table_kernels(layout, padded)
    assert not takes_single_table_kernels(LAYOUT, make_packed(21))


def test_bad_arguments_are_named():
    packed = make_packed(16)
    ids, offsets, _ = make_batch(17)
    with pytest.raises(ValueError, match="F\\*B \\+ 1"):
        tt_embedding_bag_group(packed, LAYOUT, ids, offsets[:-1], FEATURE_TABLES)
    with pytest.raises(ValueError, match="feature_tables"):
        tt_embedding_bag_group(packed, LAYOUT, ids, offsets, (0, 9, 1, 0, 1, 3))
    with pytest.raises(ValueError, match="packed core shapes"):
        tt_embedding_bag_group(packed[::-1], LAYOUT, ids, offsets, FEATURE_TABLES)
    with pytest.raises(ValueError, match="non-decreasing"):
        tt_embedding_bag_group(packed, LAYOUT, ids, offsets[::-1], FEATURE_TABLES)
    with pytest.raises(ValueError, match="mode"):
        tt_embedding_bag_group(packed, LAYOUT, ids, offsets, FEATURE_TABLES, mode=("sum",))


def test_collection_packs_groups_and_matches_single_ops():
    """A collection of 5 TT tables (one shape group + a 2-core single) and 2 dense tables:
    features of two batch sizes, weights, masks, a shared table."""
    from flax import nnx

    from flowtt_jax.collection import TableConfig
    from flowtt_jax.nnx import TTEmbeddingCollection

    dim = 16
    tables = [
        TableConfig("t0", 1000, dim, rank=4, mode="sum", col_shape=(2, 2, 4)),
        TableConfig("t1", 37, dim, rank=4, mode="mean", col_shape=(2, 2, 4), row_shape=(2, 4, 5)),
        TableConfig("t2", 5000, dim, rank=4, mode="sqrtn", col_shape=(2, 2, 4), feature_names=("f2", "g2")),
        TableConfig("two", 400, dim, rank=4, num_cores=2),
        TableConfig("d0", 9, dim, kind="dense", mode="mean"),
        TableConfig("d1", 11, dim, kind="dense"),
    ]
    col = TTEmbeddingCollection(tables, rngs=nnx.Rngs(0))
    assert [p.kind for p in col.layout.packs] == ["tt", "dense", "single"]
    rng = np.random.default_rng(0)
    x = {
        "t0": rng.integers(0, 1000, (6, 3)),
        "t1": {"ids": rng.integers(0, 37, (6, 2)), "mask": rng.random((6, 2)) < 0.6},
        "f2": {"ids": rng.integers(0, 5000, 11), "offsets": np.array([0, 3, 3, 4, 8, 8, 11])},
        "g2": {"ids": rng.integers(0, 5000, (4, 2)), "weights": rng.standard_normal((4, 2))},
        "two": rng.integers(0, 400, (6,)),
        "d0": rng.integers(0, 9, (6, 4)),
        "d1": np.array([10, 0, 3, 3, 7, 1]),
    }
    out = jax.jit(lambda c, x: c(x))(col, x)
    for cfg in tables:
        for f in cfg.feature_keys:
            ids, kw = ftt.collection.bag_kwargs(x[f])
            if cfg.kind == "dense":
                expected = ftt.collection.dense_embedding_bag(col.table(cfg.name), ids, mode=cfg.mode, **kw)
            else:
                expected = ftt.tt_embedding_bag(
                    col.cores(cfg.name),
                    ids,
                    mode=cfg.mode,
                    num_embeddings=cfg.num_embeddings,
                    impl="reference",
                    **kw,
                )
            np.testing.assert_allclose(out[f], expected, rtol=2e-5, atol=2e-6, err_msg=f)
    # gradients: the packed cores' gradient sliced per table equals the table's own
    grads = nnx.grad(lambda c: sum(jnp.sum(jnp.sin(v)) for v in c(x).values()))(col)
    g = {k: v[...] for k, v in grads["params"].items()}
    for name, feats in (("t2", ("f2", "g2")), ("t1", ("t1",))):
        cfg = next(t for t in tables if t.name == name)

        def loss(c, cfg=cfg, feats=feats):
            total = 0.0
            for f in feats:
                ids, kw = ftt.collection.bag_kwargs(x[f])
                total += jnp.sum(
                    jnp.sin(
                        ftt.tt_embedding_bag(
                            c, ids, mode=cfg.mode, num_embeddings=cfg.num_embeddings, impl="reference", **kw
                        )
                    )
                )
            return total

        ref = jax.grad(loss)(col.cores(name))
        for a, b in zip(col.layout.table_params(g, name), ref):
            np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-5)


@pytest.mark.slow
@pytest.mark.parametrize("impl", IMPLS[1:])
def test_program_size_does_not_grow_with_tables(impl):
    """The forward + backward of 4 and of 64 tables lower to the same FFI calls."""

    def calls(num_tables: int) -> list[str]:
        specs = tuple(ftt.TTSpec.create(100 + 37 * t, 16, 4, col_shape=(2, 2, 4)) for t in range(num_tables))
        layout = GroupLayout(specs)
        packed = make_packed(0, layout)
        feature_tables = tuple(range(num_tables))
        ids = np.zeros(3 * num_tables, np.int32)
        offsets = np.arange(3 * num_tables + 1, dtype=np.int32)

        def loss(c):
            out = tt_embedding_bag_group(c, layout, ids, offsets, feature_tables, impl=impl)
            return jnp.sum(out * out)

        text = jax.jit(jax.grad(loss)).lower(packed).as_text()
        return sorted(re.findall(r"custom_call @(flowtt\w+)", text))

    assert calls(4) == calls(64)
    assert "flowtt_tb_rows_bwd" in calls(4)


def test_collection_glue_does_not_grow_with_features():
    """A collection called with a dict of F features (a TT shape group and dense tables, one
    id per example, sum and mean) prepares its bags once per pack, not per feature: the
    forward's scatters, reductions, comparisons and selects are as many for 16 features
    as for 4. (A padded sqrtn bag still computes its scale per feature: XLA folds a
    constant rsqrt to a value 1 ulp from the run-time one.)"""
    from flax import nnx

    from flowtt_jax.collection import TableConfig
    from flowtt_jax.nnx import TTEmbeddingCollection

    def glue_ops(num_features: int) -> Counter:
        modes = ("sum", "mean")
        tables = [
            TableConfig(
                f"t{i}", 1000 + 97 * i, 8, kind="tt" if i % 2 else "dense", rank=4, mode=modes[i % 4 // 2]
            )
            for i in range(num_features)
        ]
        # parameters as shapes (no init program): only the lowered text is read
        col = nnx.eval_shape(lambda: TTEmbeddingCollection(tables, rngs=nnx.Rngs(0)))
        features = {t.name: np.zeros((64,), np.int32) for t in tables}
        text = jax.jit(lambda m, x: m(x)).lower(col, features).as_text()
        ops = Counter(re.findall(r"(stablehlo\.\w+)", text))
        return Counter({k: ops[f"stablehlo.{k}"] for k in ("scatter", "reduce", "compare", "select")})

    few, many = glue_ops(4), glue_ops(16)
    assert many == few, (few, many)
    assert few["compare"] > 0  # the out-of-range check is there


def test_collection_checks_ids_of_a_feature_without_bags():
    """``oob="error"``: a feature whose ids lie in no bag (``num_bags=0``) still has them
    checked, as ``tt_embedding_bag`` does."""
    from flax import nnx

    from flowtt_jax.collection import TableConfig
    from flowtt_jax.nnx import TTEmbeddingCollection

    tables = [TableConfig("a", 10, 4, kind="dense"), TableConfig("b", 12, 4, kind="dense")]
    col = TTEmbeddingCollection(tables, oob="error", rngs=nnx.Rngs(0))
    feature = {"ids": np.array([99]), "segment_ids": np.array([0]), "num_bags": 0}
    with pytest.raises(ValueError, match="out of range"):
        col({"a": feature, "b": feature})
