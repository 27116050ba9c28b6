"""Hot-row caches of TT tables (``TableConfig.cache_rows``, ``collection.cache``): routing,
values and gradients against a float64 oracle that materialises each table and overwrites
its cached rows, ids moving in and out, every input form, checkpoints by table name, the
linen twin, and the errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import Mesh
from jax.test_util import check_grads

from flowtt_jax import KeyedJagged
from flowtt_jax import linen as fl
from flowtt_jax import sharding as ftt_sharding
from flowtt_jax.collection import TableConfig
from flowtt_jax.collection.cache import EMPTY, hot_ids
from flowtt_jax.collection.layout import CollectionLayout
from flowtt_jax.nnx import TTEmbeddingCollection
from flowtt_jax.tt.cores import to_dense
from tests.helpers import host_collection

TABLES = (
    TableConfig("a", 1000, 16, rank=8, cache_rows=12, mode="mean"),
    TableConfig("b", 500, 16, rank=8, cache_rows=5, feature_names=("b1", "b2")),
    TableConfig("c", 300, 16, rank=8),  # same shape group, no cache
    TableConfig("d", 4096, 16, rank=4, num_cores=4, cache_rows=7, mode="sqrtn"),  # a single pack
    TableConfig("e", 50, 16, kind="dense"),
)


def _features(rng: np.random.Generator, batch: int = 9) -> dict:
    """CSR bags with weights (empty bags included), ids at each table's last row, and a hot
    id repeated; every table's ids. Bags of 2-5 ids elsewhere: at least 16 ids a feature,
    10 or more drawn from the whole table, so some miss every cache (a draw of 7 distinct
    ids or fewer could all be cached and leave the cores without a gradient)."""
    feats = {}
    for cfg in TABLES:
        for f in cfg.feature_keys:
            lens = rng.integers(2, 6, batch)
            lens[1] = 0
            n = int(lens.sum())
            ids = rng.integers(0, cfg.num_embeddings, n)
            ids[: n // 3] = rng.integers(0, 8, n // 3)  # skew: the first rows often
            ids[-1] = cfg.num_embeddings - 1
            offsets = np.concatenate([[0], np.cumsum(lens)])
            feats[f] = {"ids": ids, "offsets": offsets, "weights": rng.uniform(0.5, 2.0, n)}
    return feats


def _oracle(layout: CollectionLayout, params: dict, feats: dict) -> dict:
    """float64 ``{feature: [B, D]}``: each table materialised from its cores, its cached rows
    overwritten by its cache, then gathered, weighted and pooled by its mode."""
    out = {}
    for cfg in layout.tables:
        p, _ = layout.locate(cfg.name)
        own = layout.table_params(params, cfg.name)
        if cfg.kind == "dense":
            table = own[0].astype(jnp.float64)
        else:
            table = to_dense(tuple(c.astype(jnp.float64) for c in own), cfg.num_embeddings)
            cache = layout.table_cache(params, cfg.name)
            if cache is not None:
                table = table.at[cache[1]].set(cache[0].astype(jnp.float64), mode="drop")
        for f in cfg.feature_keys:
            v = feats[f]
            offsets = np.asarray(v["offsets"])
            w = jnp.asarray(v["weights"], jnp.float64)
            bags = np.repeat(np.arange(offsets.size - 1), np.diff(offsets))
            count = jax.ops.segment_sum(jnp.ones_like(w), bags, offsets.size - 1)
            scale = {"mean": 1 / jnp.maximum(count, 1), "sqrtn": 1 / jnp.sqrt(jnp.maximum(count, 1))}
            pooled = jax.ops.segment_sum(table[np.asarray(v["ids"])] * w[:, None], bags, offsets.size - 1)
            out[f] = pooled * (jnp.asarray(scale[cfg.mode]).reshape(-1, 1) if cfg.mode != "sum" else 1.0)
    return out


def _refreshed(layout: CollectionLayout, key: jax.Array, feats: dict) -> dict:
    """``layout``'s parameters drawn from ``key``, each cached table holding its feature's most
    frequent ids, one of them the table's last row, and its cached rows moved off their TT
    values (one program with the draw, not op by op)."""
    owners = {f: cfg.name for cfg in layout.tables for f in cfg.feature_keys}
    chosen = {}
    for name, ids in hot_ids([{f: v["ids"] for f, v in feats.items()}], layout.tables, owners).items():
        cfg = layout.tables[[t.name for t in layout.tables].index(name)]
        chosen[name] = np.unique(np.concatenate([ids[: cfg.cache_rows - 1], [cfg.num_embeddings - 1]]))

    def refresh(params: dict) -> dict:
        for name, ids in chosen.items():
            params = layout.with_hot_ids(params, name, ids)
            rows, hot = layout.table_cache(params, name)
            params = layout.with_cache(params, name, rows + 0.25 * jnp.sign(rows + 1e-3), hot)
        return params

    return jax.jit(lambda key: refresh(layout.init(key)))(key)


def test_cached_tables_equal_the_float64_oracle(seeds, x64):
    """Forward of a dict call (mean / sum / sqrtn, weights, empty bags, last rows, hot ids
    repeated, a cached table of 4 cores, an uncached one in the same shape group, a dense
    one) and the gradients of every core, cache block and the dense table, against the
    oracle, for impl "auto" and "reference" (one oracle for both); the hot ids are not
    trained (integer: no gradient)."""
    rng = np.random.default_rng(next(seeds))
    layout = CollectionLayout(TABLES, memory_budget=None)
    params = _refreshed(layout, jax.random.key(next(seeds)), feats := _features(rng))
    hits = 0
    for cfg in layout.tables:
        cache = layout.table_cache(params, cfg.name)
        if cache is not None:
            hits += sum(int(np.isin(feats[f]["ids"], np.asarray(cache[1])).sum()) for f in cfg.feature_keys)
    assert hits > 10  # the calls route real hits
    trained = {k: v for k, v in params.items() if k not in layout.hot_names()}
    shapes = jax.eval_shape(lambda p: _oracle(layout, p, feats), params)
    cot = {f: jnp.asarray(rng.standard_normal(shapes[f].shape)) for f in shapes}

    def loss(fn):  # the loss and the values of fn
        def value(t):
            out = fn({**params, **t})
            return sum(jnp.sum(out[f] * cot[f]) for f in cot), out

        return value

    # One program for the oracle's values and gradients (its values: the gradient's forward),
    # one for both impls' forwards (each on its own, not the gradient's) and gradients.
    g_ref, want = jax.jit(jax.grad(loss(lambda p: _oracle(layout, p, feats)), has_aux=True))(trained)

    @jax.jit
    def forwards_and_grads(p, t):
        out = {}
        for impl in ("auto", "reference"):
            apply = lambda p, impl=impl: layout.apply(p, feats, impl=impl)  # noqa: E731
            out[impl] = apply(p), jax.grad(loss(apply), has_aux=True)(t)[0]
        return out

    for impl, (got, g) in forwards_and_grads(params, trained).items():
        for f in want:
            np.testing.assert_allclose(
                np.asarray(got[f], np.float64),
                np.asarray(want[f]),
                rtol=2e-5,
                atol=2e-6,
                err_msg=f"{impl} {f}",
            )
            assert np.any(np.asarray(got[f]))
        assert set(g) == set(g_ref) and any(k.endswith("_cache") for k in g)
        for k in g:
            scale = float(np.abs(np.asarray(g_ref[k])).max())
            assert scale > 0, k
            np.testing.assert_allclose(
                np.asarray(g[k], np.float64), np.asarray(g_ref[k]), atol=3e-5 * scale, err_msg=f"{impl} {k}"
            )


def test_check_grads_through_the_cache(seeds, x64):
    """``check_grads`` (reverse mode, float64, reference) of the pooled bags in the cache
    block, the cores and the weights, with hits and misses in the same bags."""
    rng = np.random.default_rng(next(seeds))
    cfgs = (TableConfig("a", 200, 4, rank=3, cache_rows=6),)
    layout = CollectionLayout(cfgs, memory_budget=None)
    params = jax.jit(lambda key: layout.with_hot_ids(layout.init(key, jnp.float64), "a", [0, 3, 5, 199]))(
        jax.random.key(1)
    )  # one program with the draw
    ids = np.array([0, 3, 7, 199, 150, 5, 5, 42])
    offsets = np.array([0, 3, 3, 8])

    def f(cache, core1, w):
        p = {**params, layout.cache_names(0)[0]: cache, layout.param_names(0)[1]: core1}
        return layout.apply(p, {"a": {"ids": ids, "offsets": offsets, "weights": w}}, impl="reference")["a"]

    args = (
        params[layout.cache_names(0)[0]],
        params[layout.param_names(0)[1]],
        jnp.asarray(rng.uniform(0.5, 2, 8)),
    )
    check_grads(jax.jit(f), args, order=1, modes=["rev"])


def test_ids_move_in_and_out(seeds):
    """``with_hot_ids``: a kept id keeps its trained row, a new one starts at its TT row, a
    dropped one reads its TT row again; jitted with traced ids it is the same program."""
    layout = CollectionLayout((TableConfig("a", 1000, 8, rank=4, cache_rows=4),), memory_budget=None)
    params = layout.init(jax.random.key(next(seeds)))
    to_dense = jax.jit(layout.to_dense, static_argnums=1)  # one program, not op by op
    tt_rows = np.asarray(jax.jit(lambda p: layout.to_dense(layout.with_hot_ids(p, "a", []), "a"))(params))

    @jax.jit  # one program, not op by op
    def cache_and_train(params):
        params = layout.with_hot_ids(params, "a", [10, 20, 30])
        rows, hot = layout.table_cache(params, "a")
        return rows, hot, layout.with_cache(params, "a", rows + 1.0, hot)  # trained away from TT

    rows, hot, params = cache_and_train(params)
    assert list(np.asarray(hot)) == [10, 20, 30, EMPTY]
    np.testing.assert_allclose(np.asarray(rows[:3]), tt_rows[[10, 20, 30]], rtol=1e-5, atol=1e-6)
    moved = jax.jit(layout.with_hot_ids, static_argnums=1)(params, "a", jnp.asarray([30, 5, 10, 999]))
    rows2, hot2 = layout.table_cache(moved, "a")
    assert list(np.asarray(hot2)) == [5, 10, 30, 999]
    np.testing.assert_allclose(
        np.asarray(rows2),
        np.stack([tt_rows[5], tt_rows[10] + 1, tt_rows[30] + 1, tt_rows[999]]),
        rtol=1e-5,
        atol=1e-5,
    )
    dense = np.asarray(to_dense(moved, "a"))
    np.testing.assert_allclose(dense[20], tt_rows[20], rtol=1e-5, atol=1e-6)  # 20 left: its TT row
    out = jax.jit(lambda p: layout.apply(p, {"a": np.array([[20, 10, 999]])})["a"])(moved)
    np.testing.assert_allclose(
        np.asarray(out)[0], tt_rows[20] + tt_rows[10] + 1 + tt_rows[999], rtol=1e-5, atol=1e-5
    )
    with pytest.raises(ValueError, match="table 'a': 5 hot ids for a cache of 4 rows"):
        layout.with_hot_ids(params, "a", [1, 2, 3, 4, 5])
    with pytest.raises(ValueError, match=r"table 'a': hot ids must be in \[0, 1000\)"):
        layout.with_hot_ids(params, "a", [1, 1000])


def test_every_input_form_routes_the_cache(seeds):
    """A ``KeyedJagged``, stacked ids and the unpooled lookup give the dict call's values."""
    rng = np.random.default_rng(next(seeds))
    cfgs = (
        TableConfig("a", 700, 8, rank=4, cache_rows=9),
        TableConfig("b", 400, 8, rank=4, cache_rows=3),
        TableConfig("c", 90, 8, kind="dense"),
    )
    layout = CollectionLayout(cfgs, memory_budget=None)
    params = jax.jit(  # one program with the draw, not op by op
        lambda key: layout.with_hot_ids(layout.with_hot_ids(layout.init(key), "a", [0, 1, 2, 699]), "b", [5])
    )(jax.random.key(next(seeds)))
    ids = np.stack([rng.integers(0, 4, 6), rng.integers(0, 8, 6), rng.integers(0, 90, 6)], 1)
    ids[0] = [699, 5, 89]
    feats = {f: ids[:, i] for i, f in enumerate("abc")}
    kj = KeyedJagged.from_features({f: v[:, None] for f, v in feats.items()})
    ref, stacked, jagged, rows, dense = jax.jit(
        lambda p: (
            layout.apply(p, feats),
            layout.apply_stacked(p, ids),
            layout.apply_jagged(p, kj),
            layout.lookup(p, feats),
            {f: layout.to_dense(p, f) for f in feats},
        )
    )(params)
    for i, f in enumerate("abc"):
        np.testing.assert_allclose(np.asarray(stacked[:, i]), np.asarray(ref[f]), rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(np.asarray(jagged[:, i]), np.asarray(ref[f]), rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(np.asarray(rows[f]), np.asarray(ref[f]), rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(np.asarray(ref[f]), np.asarray(dense[f])[feats[f]], rtol=1e-5, atol=1e-6)


def test_checkpoint_by_table_name_carries_the_cache():
    """``table_state`` holds a cached table's cores, rows and ids; it loads into a collection
    of the tables in another order; a state without the cache, or with another cache size,
    is refused naming the table; a positional state of another cache size is refused too."""
    a = TTEmbeddingCollection(TABLES[:3], rngs=nnx.Rngs(0))
    a.refresh_cache(hot_ids={"a": [3, 4, 999], "b": [7]})
    state = a.table_state()
    assert [tuple(x.shape) for x in state["a"][-2:]] == [(12, 16), (12,)]
    b = host_collection(TABLES[:3][::-1], 1)  # every table loaded from the state
    b.load_table_state(state)
    feats = {
        "a": np.array([3, 999, 5]),
        "b1": np.array([7, 7, 8]),
        "b2": np.array([1, 2, 7]),
        "c": np.array([0, 1, 299]),
    }
    call = nnx.jit(lambda m: m(feats))
    got = call(b)
    for f, v in call(a).items():
        np.testing.assert_array_equal(np.asarray(got[f]), np.asarray(v))
    assert b.refresh_cache(hot_ids={"b": [7]})["b"][0] == 7
    with pytest.raises(ValueError, match=r"table 'a': shapes .* != the collection's"):
        b.load_table_state({**state, "a": state["a"][:3]})
    other = host_collection((TableConfig("a", 1000, 16, rank=8, cache_rows=3, mode="mean"),) + TABLES[1:3], 0)
    with pytest.raises(ValueError, match="table 'a'"):
        other.load_table_state(state)
    with pytest.raises(ValueError, match="do not fit this collection"):
        other.layout.check_params(a._values())


def test_planted_hot_ids_are_found_and_trained():
    """``refresh_cache`` from sample batches caches each table's most frequent ids; an nnx
    train step (optax Adam over ``nnx.Param``) trains the cache rows and leaves the ids."""
    rng = np.random.default_rng(0)
    cfgs = (TableConfig("a", 5000, 8, rank=4, cache_rows=4), TableConfig("b", 300, 8, rank=4))
    coll = TTEmbeddingCollection(cfgs, rngs=nnx.Rngs(0))
    ids = rng.integers(0, 5000, (64, 3))
    ids[:, 0] = rng.choice([17, 4242, 999, 3], 64, p=[0.4, 0.3, 0.2, 0.1])
    batch = {"a": ids, "b": rng.integers(0, 300, (64, 2))}
    assert list(coll.refresh_cache([batch])["a"]) == [3, 17, 999, 4242]
    before = {k: np.asarray(v[...]) for k, v in coll.params.items()}
    opt = nnx.Optimizer(coll, optax.adam(1e-2), wrt=nnx.Param)

    @nnx.jit
    def step(coll, opt, batch):
        grads = nnx.grad(lambda m: sum(jnp.sum(v**2) for v in m(batch).values()))(coll)
        opt.update(coll, grads)

    step(coll, opt, batch)
    name = coll.layout.cache_names(0)
    assert not np.allclose(np.asarray(coll.params[name[0]][...]), before[name[0]])
    np.testing.assert_array_equal(np.asarray(coll.params[name[1]][...]), before[name[1]])


def test_linen_twin_equals_nnx():
    """The linen collection holds the cache block in ``params`` and the ids in ``tt_cache``
    and gives the nnx collection's values for the same variables."""
    coll = TTEmbeddingCollection(TABLES[:3], rngs=nnx.Rngs(0))
    coll.refresh_cache(hot_ids={"a": [1, 2], "b": [0, 499]})
    feats = {
        "a": np.array([1, 2, 3]),
        "b1": np.array([499, 0, 4]),
        "b2": np.array([0, 0, 0]),
        "c": np.array([5, 6, 7]),
    }
    module = fl.TTEmbeddingCollection(tables=TABLES[:3])
    variables = jax.eval_shape(module.init, jax.random.key(0), feats)  # its collections' names only
    values = coll._values()
    hot = set(coll.layout.hot_names())
    assert set(variables["tt_cache"]) == hot
    variables = {
        "params": {k: v for k, v in values.items() if k not in hot},
        "tt_cache": {k: values[k] for k in hot},
    }
    got = jax.jit(module.apply)(variables, feats)
    for f, v in nnx.jit(lambda m: m(feats))(coll).items():
        np.testing.assert_array_equal(np.asarray(got[f]), np.asarray(v))


def test_cache_config_errors():
    with pytest.raises(ValueError, match="table 'x': cache_rows is for TT tables"):
        TableConfig("x", 10, 4, kind="dense", cache_rows=2)
    with pytest.raises(ValueError, match=r"table 'x': cache_rows must be in \[0, num_embeddings=10\]"):
        TableConfig("x", 10, 4, cache_rows=11)
    with pytest.raises(ValueError, match="cache_rows must be in"):
        TableConfig("x", 10, 4, cache_rows=-1)
    with pytest.raises(TypeError, match="table 'x': cache_rows must be an int"):
        TableConfig("x", 10, 4, cache_rows=2.5)
    # refusals only: built abstractly (no init program)
    coll = nnx.eval_shape(
        lambda: TTEmbeddingCollection((TableConfig("x", 100, 4, rank=2),), rngs=nnx.Rngs(0))
    )
    with pytest.raises(ValueError, match="table 'x' has no hot-row cache"):
        coll.refresh_cache(hot_ids={"x": [1]})
    with pytest.raises(ValueError, match="sample batches or hot_ids"):
        coll.refresh_cache()
    mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
    layout = CollectionLayout((TableConfig("x", 100, 4, rank=2, cache_rows=3),))
    with pytest.raises(ValueError, match=r"tables \['x'\] have hot-row caches"):
        ftt_sharding.collection_data_parallel(layout, mesh)
