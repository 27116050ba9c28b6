"""flowtt_jax.nnx layers: equal to the ops they wrap, differentiable, checkpointable."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import flowtt_jax as ftt
from flowtt_jax.collection import TableConfig, dense_embedding_bag
from flowtt_jax.collection.layout import CollectionLayout
from flowtt_jax.nnx import EmbedBag, TTEmbed, TTEmbedBag, TTEmbeddingCollection
from tests.helpers import SLOW_REFERENCE, close, host_collection

N, D, R = 1000, 16, 6
IMPLS = [SLOW_REFERENCE, "auto"]

#: One jitted call of a module shared by the tests (one program per module and input, not
#: one per op): the eager path is test_nnx_jit_matches_eager's.
_call = nnx.jit(lambda m, x: m(x))


def rand_ids(seed, shape, n=N, oob=False):
    """int32 ids drawn on the host (set-up, no device op)."""
    ids = np.random.default_rng(seed).integers(0, n, shape).astype(np.int32)
    if oob:
        ids[..., 0], ids[..., -1] = n + 3, -2
    return ids


@pytest.mark.parametrize("impl", IMPLS)
def test_ttembed_equals_lookup(impl):
    m = TTEmbed(N, D, rank=R, impl=impl, rngs=nnx.Rngs(0))
    assert m.spec.core_shapes == tuple(c.shape for c in m.cores)
    assert all(np.abs(np.asarray(c)).max() > 0 for c in m.cores)
    xs = [rand_ids(len(shape), shape, oob=True) for shape in [(7,), (3, 5), (2, 3, 4)]]
    ids = rand_ids(9, (4, 6))
    oob = np.array([N, -1], np.int32)

    @nnx.jit  # one program for every call
    def run(m):
        ops = [(m(x), ftt.tt_lookup(m.cores, x, num_embeddings=N, impl=impl)) for x in xs]
        return ops, m(ids), m.to_dense()[ids], m(oob)

    ops, out_ids, dense_ids, out_oob = run(m)
    for x, (out, want) in zip(xs, ops):
        assert out.shape == x.shape + (D,) and out.dtype == jnp.float32
        close(out, want)
    close(out_ids, dense_ids)
    # out-of-range ids give zero rows under the default oob="zero"
    assert np.abs(np.asarray(out_oob)).max() == 0.0


def test_ttembed_params_and_init():
    m = TTEmbed(N, D, rank=R, rngs=nnx.Rngs(0))
    params = nnx.state(m, nnx.Param)
    assert set(params.keys()) == {"core_0", "core_1", "core_2"}
    assert m.core_1[...].shape == m.spec.core_shapes[1]
    # default init: materialised rows with std ~ 1/sqrt(D), like nnx.Embed
    std = float(np.std(np.asarray(m.to_dense())))
    assert 0.5 / np.sqrt(D) < std < 2.0 / np.sqrt(D)
    m2 = TTEmbed(N, D, rank=R, embedding_init=0.01, rngs=nnx.Rngs(0))
    assert float(np.std(np.asarray(m2.to_dense()))) < 0.03
    fixed = ftt.init_cores(jax.random.key(5), m.spec)
    m3 = TTEmbed(N, D, rank=R, embedding_init=lambda key, spec, dtype: fixed, rngs=nnx.Rngs(0))
    for a, b in zip(m3.cores, fixed):
        close(a, b, 0)
    with pytest.raises(ValueError):
        TTEmbed(N, D, rank=R + 1, embedding_init=lambda key, spec, dtype: fixed, rngs=nnx.Rngs(0))
    # the spec only: built abstractly (no init program)
    m4 = nnx.eval_shape(
        lambda: TTEmbed(N, D, rank=4, row_shape=(10, 10, 10), col_shape=(4, 2, 2), rngs=nnx.Rngs(1))
    )
    assert m4.spec.row_shape == (10, 10, 10) and m4.spec.col_shape == (4, 2, 2)


def test_attend_and_to_dense():
    m = TTEmbed(N, D, rank=R, rngs=nnx.Rngs(1))
    q = np.random.default_rng(2).standard_normal((3, 2, D)).astype(np.float32)
    out, table, dense = nnx.jit(lambda m: (m.attend(q), m.to_dense(), ftt.to_dense(m.cores, N)))(m)
    assert out.shape == (3, 2, N)
    close(out, q @ np.asarray(dense, np.float64).T, 1e-4)
    close(table, dense)


def test_from_dense_tt_svd():
    n, d = 60, 8
    table = np.random.default_rng(3).standard_normal((n, d)).astype(np.float32)
    full = TTEmbed.from_dense(table, rank=64)  # ranks capped at full rank: exact
    ids = np.array([0, 5, 59, 17], np.int32)
    low = TTEmbed.from_dense(table, rank=2, rngs=nnx.Rngs(0))
    assert low.spec.ranks[1] <= 2
    bag = TTEmbedBag.from_dense(table, rank=64, mode="mean")
    full_dense, full_ids, low_dense, pooled = nnx.jit(
        lambda full, low, bag: (full.to_dense(), full(ids), low.to_dense(), bag(ids[None]))
    )(full, low, bag)
    close(full_dense, table, 1e-4)
    close(full_ids, table[ids], 1e-4)
    err_low = float(np.linalg.norm(np.asarray(low_dense, np.float64) - table))
    assert 0 < err_low < float(np.linalg.norm(table.astype(np.float64)))
    close(pooled, table[ids].mean(0, keepdims=True), 1e-4)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("mode", ["sum", "mean", "sqrtn"])
def test_ttembedbag_equals_op(impl, mode):
    m = TTEmbedBag(N, D, rank=R, mode=mode, impl=impl, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(1)
    ids = rand_ids(10, (20,), oob=True)
    offsets = np.array([0, 3, 3, 10, 20], np.int32)
    w = rng.uniform(size=20).astype(np.float32)
    seg = rng.integers(0, 5, 20).astype(np.int32)
    padded = rand_ids(11, (4, 6))
    mask = np.arange(6)[None, :] < np.array([[1], [6], [0], [3]])
    kw = dict(num_embeddings=N, mode=mode, impl=impl)

    @nnx.jit  # one program for every call
    def run(m):
        op = lambda x, **bags: ftt.tt_embedding_bag(m.cores, x, **bags, **kw)  # noqa: E731
        return (
            (
                (m(ids, offsets=offsets), op(ids, offsets=offsets)),
                (m(ids, offsets=offsets, weights=w), op(ids, offsets=offsets, weights=w)),
                (m(ids, segment_ids=seg, num_bags=5), op(ids, segment_ids=seg, num_bags=5)),
                (m(padded, mask=mask), op(padded, mask=mask)),
            ),
            m(padded, mask=mask, mode="sum"),
            m.to_dense(),
        )

    pairs, out_sum, table = run(m)
    for got, want in pairs:
        close(got, want)
    # against the materialised table
    out = pairs[-1][0]
    rows = np.where(mask[..., None], np.asarray(table, np.float64)[padded], 0).sum(1)
    n = mask.sum(1, keepdims=True)
    scale = {"sum": 1.0, "mean": 1.0 / np.maximum(n, 1), "sqrtn": 1.0 / np.sqrt(np.maximum(n, 1))}[mode]
    close(out, rows * scale, 1e-5)
    # per-call mode override
    close(out_sum, rows, 1e-5)


@pytest.mark.parametrize("impl", IMPLS)
def test_gradients_reach_cores_and_equal_op_grads(impl):
    m = TTEmbedBag(N, D, rank=R, impl=impl, rngs=nnx.Rngs(0))
    ids = rand_ids(4, (8, 5))
    target = np.random.default_rng(5).standard_normal((8, D)).astype(np.float32)
    probe = target[:, None, :].sum(1)

    def loss_layer(model):
        return jnp.sum((model(ids) - target) ** 2)

    @nnx.jit  # one program: the layer's and the op's gradients
    def run(m):
        ref = jax.grad(
            lambda cores: jnp.sum(
                (ftt.tt_embedding_bag(cores, ids, num_embeddings=N, impl=impl) - target) ** 2
            )
        )(m.cores)
        # per-id weights are differentiable through the layer
        gw = jax.grad(lambda w: jnp.sum(m(ids, weights=w) * probe))(jnp.ones(ids.shape))
        return nnx.grad(loss_layer)(m), ref, loss_layer(m), gw, m.to_dense()

    grads, ref, loss_eval, gw, table = run(m)
    for k in range(3):
        g = grads[f"core_{k}"][...]
        assert g.shape == m.cores[k].shape
        assert np.abs(np.asarray(g)).max() > 0
        close(g, ref[k], 1e-4)
    # value_and_grad under nnx.jit
    loss, g2 = nnx.jit(nnx.value_and_grad(loss_layer))(m)
    close(loss, loss_eval, 1e-4)
    close(g2["core_1"][...], ref[1], 1e-4)
    assert gw.shape == ids.shape and np.abs(np.asarray(gw)).max() > 0
    # d/dw_k of sum(probe[b] . sum_k w_k row(ids_k)) = probe[b] . row(ids_k)
    rows = np.asarray(table, np.float64)[ids]  # [B, L, D]
    close(gw, np.einsum("bld,bd->bl", rows, probe), 1e-4)


def test_nnx_jit_matches_eager():
    m = TTEmbed(N, D, rank=R, rngs=nnx.Rngs(0))
    ids = rand_ids(7, (5, 3))
    close(_call(m, ids), m(ids))


def test_optax_loop_reduces_loss():
    n = 64
    target_model = TTEmbed(n, 8, rank=3, rngs=nnx.Rngs(42))
    target = target_model.to_dense()
    m = TTEmbed(n, 8, rank=4, rngs=nnx.Rngs(0))
    opt = nnx.Optimizer(m, optax.adam(3e-2), wrt=nnx.Param)
    ids = np.arange(n, dtype=np.int32)

    @nnx.jit
    def step(model, opt):
        def loss_fn(model):
            return jnp.mean((model(ids) - target) ** 2)

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        opt.update(model, grads)
        return loss

    losses = [float(step(m, opt)) for _ in range(150)]
    assert losses[-1] < 0.1 * losses[0], (losses[0], losses[-1])


def test_checkpoint_roundtrip(tmp_path):
    ocp = pytest.importorskip("orbax.checkpoint")
    tables = [TableConfig("big", N, D, rank=R), TableConfig("small", 10, D, kind="dense")]
    m = host_collection(tables, 3)
    # train one step so the state is not the values drawn
    opt = nnx.Optimizer(m, optax.sgd(0.1), wrt=nnx.Param)
    x = {"big": np.array([[1, 2], [3, 999]], np.int32), "small": np.array([4, 9], np.int32)}

    @nnx.jit
    def step(m, opt):
        opt.update(m, nnx.grad(lambda mod: sum(jnp.sum(v**2) for v in mod(x).values()))(m))

    step(m, opt)
    state = nnx.state(m)
    ckpt = ocp.StandardCheckpointer()
    ckpt.save(tmp_path / "ckpt", state)
    ckpt.wait_until_finished()

    fresh = host_collection(tables, 99)
    before, want = _call(fresh, x), _call(m, x)
    assert np.abs(np.asarray(before["big"]) - np.asarray(want["big"])).max() > 0
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: fresh))
    restored = ckpt.restore(tmp_path / "ckpt", abstract)
    nnx.update(fresh, restored)
    after = _call(fresh, x)
    for k in x:
        np.testing.assert_array_equal(np.asarray(after[k]), np.asarray(want[k]))


def test_collection_refuses_colliding_parameter_names():
    """A 2-core table named like shape group 0's parameters ("tt0_<digest>") is refused."""
    group = TableConfig("a", 1000, 8, rank=4, row_shape=(10, 10, 10), col_shape=(2, 2, 2))
    two_core = TableConfig("tt0", 100, 8, rank=4, row_shape=(10, 10), col_shape=(2, 4))
    digest = CollectionLayout((group,)).param_names(0)[0].split("_")[1]
    two_core = dataclasses.replace(two_core, name=f"tt0_{digest}")
    with pytest.raises(
        ValueError, match=rf"parameter 'tt0_{digest}_core0' would hold both table\(s\) 'a' and"
    ):
        TTEmbeddingCollection([group, two_core], rngs=nnx.Rngs(0))
    # shapes only: built abstractly (no init program)
    renamed = [group, dataclasses.replace(two_core, name="small")]
    cores = jax.eval_shape(
        lambda: {n: TTEmbeddingCollection(renamed, rngs=nnx.Rngs(0)).cores(n) for n in ("a", "small")}
    )
    assert [c.shape for c in cores["small"]] == [(10, 1, 2, 4), (10, 4, 4, 1)]
    assert [c.shape for c in cores["a"]] == [(10, 1, 2, 4), (10, 4, 2, 4), (10, 4, 2, 1)]


def test_collection_mixes_tt_and_dense():
    tables = [
        TableConfig("a", 500, D, rank=R, mode="sum"),
        TableConfig("b", 7, D, kind="dense", mode="mean"),
        TableConfig("c", 300, D, rank=4, mode="sqrtn", feature_names=("c1", "c2")),
    ]
    col = TTEmbeddingCollection(tables, rngs=nnx.Rngs(0))
    # a and c differ in rank: two shape groups; b is a dense pack
    assert [(p.kind, [t.name for t in p.tables]) for p in col.layout.packs] == [
        ("tt", ["a"]),
        ("tt", ["c"]),
        ("dense", ["b"]),
    ]
    ids_a = rand_ids(20, (4,), 500)  # one id per example
    ids_b = rand_ids(21, (4, 3), 7)  # padded
    ids_c1 = rand_ids(22, (9,), 300)
    offs = jnp.array([0, 2, 2, 5, 9])
    ids_c2 = rand_ids(23, (4, 2), 300)
    mask_c2 = jnp.array([[True, False], [True, True], [False, False], [True, True]])
    x = {
        "a": ids_a,
        "b": ids_b,
        "c1": {"ids": ids_c1, "offsets": offs},
        "c2": {"ids": ids_c2, "mask": mask_c2},
    }
    out = col(x)
    assert set(out) == {"a", "b", "c1", "c2"}
    assert all(v.shape == (4, D) for v in out.values())
    ca, cc = col.cores("a"), col.cores("c")
    close(out["a"], ftt.tt_lookup(ca, ids_a, num_embeddings=500))
    table_b = col.table("b")
    close(out["b"], table_b[ids_b].mean(1))
    close(out["c1"], ftt.tt_embedding_bag(cc, ids_c1, offsets=offs, mode="sqrtn", num_embeddings=300))
    close(out["c2"], ftt.tt_embedding_bag(cc, ids_c2, mask=mask_c2, mode="sqrtn", num_embeddings=300))
    # the dense helper matches the TT op's semantics on the same (materialised) table
    dense_c = ftt.to_dense(cc, 300)
    close(dense_embedding_bag(dense_c, ids_c1, offsets=offs, mode="sqrtn"), out["c1"], 1e-5)
    # memory accounting and gradients to both kinds of table
    nbytes = col.embedding_bytes()
    assert nbytes["b"] == 7 * D * 4 and nbytes["a"] == 4 * tables[0].spec().num_params
    grads = nnx.grad(lambda c: sum(jnp.sum(v) for v in c(x).values()))(col)
    grads = col.layout, {k: v[...] for k, v in grads["params"].items()}
    ga, gb = (grads[0].table_params(grads[1], name) for name in ("a", "b"))
    assert float(jnp.abs(gb[0]).max()) > 0 and float(jnp.abs(ga[2]).max()) > 0
    # gradients of the packed op equal those of the single-table op per table
    ref = jax.grad(lambda c: jnp.sum(ftt.tt_lookup(c, ids_a, num_embeddings=500)))(ca)
    for g, r in zip(ga, ref):
        close(g, r, 1e-5)
    # one table's cores in and out of the packs
    col.load_table("a", [2 * c for c in ca])
    close(col.cores("a")[0], 2 * ca[0])
    close(col.cores("c")[0], cc[0])
    col.from_dense("b", jnp.ones((7, D)))
    close(col(x)["b"], jnp.ones((4, D)))
    with pytest.raises(ValueError, match="dense"):
        col.cores("b")
    sub = col({"a": ids_a})  # a subset of the features: their outputs only
    assert set(sub) == {"a"}
    np.testing.assert_array_equal(np.asarray(sub["a"]), np.asarray(col(x)["a"]))
    with pytest.raises(KeyError, match="unknown feature"):
        col({"a": ids_a, "zz": ids_a})
    with pytest.raises(ValueError):
        TTEmbeddingCollection([TableConfig("a", 5, D), TableConfig("a", 6, D)], rngs=nnx.Rngs(0))


def test_bf16():
    m32 = TTEmbed(N, D, rank=R, rngs=nnx.Rngs(0))
    m16 = TTEmbed(N, D, rank=R, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    mp = TTEmbedBag(N, D, rank=R, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    ids = rand_ids(1, (6,))

    @nnx.jit  # one program for every call
    def run(m16, m32, mp):
        ref = ftt.tt_embedding_bag(
            tuple(c.astype(jnp.float32) for c in mp.cores), ids[None], num_embeddings=N
        )
        g = nnx.grad(lambda mod: jnp.sum(mod(ids[None]).astype(jnp.float32)))(mp)
        return m16(ids), m32(ids).astype(jnp.bfloat16), mp(ids[None]), ref, g

    out, want, pooled, ref, g = run(m16, m32, mp)
    assert out.dtype == jnp.bfloat16 and m16.cores[0].dtype == jnp.float32
    # computed in fp32, cast once at the end
    np.testing.assert_array_equal(np.asarray(out), np.asarray(want))
    # bf16 storage
    assert all(c.dtype == jnp.bfloat16 for c in mp.cores)
    assert pooled.dtype == jnp.bfloat16
    close(pooled, ref, 2e-2)
    assert g["core_0"][...].dtype == jnp.bfloat16


def test_bf16_storage_with_fp32_output_is_not_rounded():
    """param_dtype=bf16, dtype=f32: the f32 result of the bf16 cores, no bf16 rounding."""
    m = TTEmbed(N, D, rank=R, param_dtype=jnp.bfloat16, dtype=jnp.float32, rngs=nnx.Rngs(0))
    bag = TTEmbedBag(N, D, rank=R, param_dtype=jnp.bfloat16, dtype=jnp.float32, rngs=nnx.Rngs(0))
    dense = EmbedBag(N, D, param_dtype=jnp.bfloat16, dtype=jnp.float32, rngs=nnx.Rngs(0))
    ids = rand_ids(2, (40,))
    out, table_m, pooled, table_bag, pooled_dense = nnx.jit(  # one program for every call
        lambda m, bag, dense: (m(ids), m.to_dense(), bag(ids[None]), bag.to_dense(), dense(ids[None]))
    )(m, bag, dense)
    assert out.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(out), np.asarray(table_m)[ids], rtol=1e-5, atol=1e-6)
    out = np.asarray(out)
    assert not np.array_equal(out, out.astype(jnp.bfloat16).astype(np.float32))
    np.testing.assert_allclose(
        np.asarray(pooled[0]), np.asarray(table_bag, np.float64)[ids].sum(0), rtol=1e-5, atol=1e-5
    )
    table = np.asarray(dense.embedding[...], np.float64)
    np.testing.assert_allclose(np.asarray(pooled_dense[0]), table[ids].sum(0), rtol=1e-5, atol=1e-5)


def test_flax_initializer_sets_row_scale():
    m = TTEmbed(20_000, 32, rank=16, embedding_init=nnx.initializers.normal(0.05), rngs=nnx.Rngs(3))
    assert abs(float(np.asarray(m.to_dense()).std()) - 0.05) < 0.005
    with pytest.raises(ValueError, match="initializer returned cores"):
        TTEmbed(100, 8, rank=4, embedding_init=lambda key, spec, dtype: (jnp.ones((2, 2)),), rngs=nnx.Rngs(0))


def _state_tables(order, rank_u=4):
    shapes = dict(row_shape=(10, 10, 10), col_shape=(2, 2, 2))
    cfgs = {
        "u": TableConfig("u", 1000, 8, rank=rank_u, **shapes),
        "v": TableConfig("v", 1000, 8, rank=4, **shapes),
        "d": TableConfig("d", 50, 8, kind="dense"),
        "w": TableConfig("w", 300, 8, rank=2),
    }
    return [cfgs[n] for n in order]


def _state_features():
    rng = np.random.default_rng(5)
    return {
        "u": rng.integers(0, 1000, (6, 3)),
        "v": rng.integers(0, 1000, (6, 2)),
        "d": rng.integers(0, 50, (6,)),
    }


#: Every table of a collection materialised, in one program.
_dense_tables = nnx.jit(lambda m: {cfg.name: m.to_dense(cfg.name) for cfg in m.tables})


def test_checkpoint_by_table_name_survives_reordering_and_new_tables():
    src = host_collection(_state_tables("uvd"), 0)
    state = src.table_state()
    assert set(state) == {"u", "v", "d"} and state["d"][0].shape == (50, 8)
    dst = host_collection(_state_tables("dvuw"), 1)
    before_w = _dense_tables(dst)["w"]
    with pytest.raises(ValueError, match=r"tables missing from the state: \['w'\]"):
        dst.load_table_state(state)
    dst.load_table_state(state, strict=False)
    got_dense, want_dense = _dense_tables(dst), _dense_tables(src)
    for name in "uvd":
        np.testing.assert_array_equal(np.asarray(got_dense[name]), np.asarray(want_dense[name]))
    np.testing.assert_array_equal(np.asarray(got_dense["w"]), np.asarray(before_w))
    feats = _state_features()
    want, got = _call(src, feats), _call(dst, {**feats, "w": feats["d"]})
    for name in feats:
        np.testing.assert_array_equal(np.asarray(got[name]), np.asarray(want[name]))
    with pytest.raises(ValueError, match=r"tables not in this collection: \['zz'\]"):
        dst.load_table_state({**state, "zz": state["u"]}, strict=False)


def test_restores_of_another_layout_are_refused_never_scrambled():
    src = host_collection(_state_tables("uvd"), 0)
    feats = _state_features()
    # the same tables in another order: other parameter names, so a positional restore fails
    reordered = host_collection(_state_tables("vud"), 1)
    assert set(nnx.state(reordered)["params"]) != set(nnx.state(src)["params"])
    with pytest.raises((ValueError, KeyError)):
        nnx.update(reordered, nnx.state(src))
        reordered(feats)
    # table u re-ranked: by name its shapes differ (nothing loaded), by position the call refuses
    reranked = host_collection(_state_tables("uvd", rank_u=3), 2)
    before = np.asarray(reranked.to_dense("v"))
    with pytest.raises(ValueError, match=r"table 'u': shapes \[\(10, 1, 2, 4\)"):
        reranked.load_table_state(src.table_state())
    np.testing.assert_array_equal(np.asarray(reranked.to_dense("v")), before)
    params = {k: p[...] for k, p in src.params.items()}
    with pytest.raises(
        ValueError, match=r"do not fit this collection's tables(.|\n)*_core0 \(tables \['u'\]\): missing"
    ):
        reranked.layout.call(params, feats)


def test_resized_tables_of_unchanged_packed_shapes_are_refused():
    """Tables keep their names and order but change rows (dense 20 + 30 -> 25 + 25) or swap
    TT row shapes, so the packed arrays keep their shapes: the parameter names differ (the
    digest covers rows, dims, TT shapes and ranks), and the README's positional orbax-style
    restore and a call with the old state are refused instead of putting one table's rows
    into the other; ``load_table_state`` refuses by table name, naming it."""

    def dense(a, b):
        return [TableConfig("a", a, 8, kind="dense"), TableConfig("b", b, 8, kind="dense")]

    def tt(sa, sb):
        return [
            TableConfig("x", 120, 8, rank=4, row_shape=sa, col_shape=(2, 2, 2)),
            TableConfig("y", 120, 8, rank=4, row_shape=sb, col_shape=(2, 2, 2)),
        ]

    for old, new in ((dense(20, 30), dense(25, 25)), (tt((4, 5, 6), (6, 5, 4)), tt((6, 5, 4), (4, 5, 6)))):
        src, dst = host_collection(old, 0), host_collection(new, 1)
        shapes = lambda c: sorted(p[...].shape for p in c.params.values())  # noqa: E731
        assert shapes(src) == shapes(dst)  # the packed arrays alone cannot tell them apart
        assert set(src.params) != set(dst.params)
        with pytest.raises((ValueError, KeyError)):
            nnx.update(dst, nnx.state(src))
            dst({old[0].name: np.zeros(2, np.int32), old[1].name: np.zeros(2, np.int32)})
        params = {k: p[...] for k, p in src.params.items()}
        with pytest.raises(ValueError, match="do not fit this collection's tables"):
            dst.layout.call(params, {old[0].name: np.zeros(2, np.int32), old[1].name: np.zeros(2, np.int32)})
        with pytest.raises(ValueError, match=f"table '{old[0].name}'"):
            dst.load_table_state(src.table_state())


def test_a_positional_restore_of_another_dtype_is_refused():
    """A state saved from a bfloat16 collection restored by position into a float32 one (the
    same names and shapes) is refused at the call, naming the tables, not computed with."""
    tables = [TableConfig("a", 100, 8, rank=4), TableConfig("d", 20, 8, kind="dense")]
    src = host_collection(tables, 0, param_dtype=jnp.bfloat16)
    dst = host_collection(tables, 1)
    nnx.update(dst, nnx.state(src))
    with pytest.raises(ValueError, match=r"\(tables \['a'\]\): dtype bfloat16, the collection's float32"):
        dst({"a": np.array([1, 2]), "d": np.array([3, 4])})
