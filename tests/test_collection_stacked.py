"""A collection called with stacked ids ``[B, F]`` / ``[B, F, L]`` (``apply_stacked``): the
values of the feature-dict call bit for bit (on a GPU, to rounding where XLA's scatter-adds
sum), no per-feature glue, the checks, and both
sharding strategies on 4 virtual CPU devices (in a subprocess, as ``test_sharding``)."""

import re
from collections import Counter
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.test_sharding import _cpu_env, _run_workers

flax = pytest.importorskip("flax")
from flax import nnx  # noqa: E402

from flowtt_jax.collection import TableConfig  # noqa: E402
from flowtt_jax.nnx import TTEmbeddingCollection  # noqa: E402
from tests.test_input_pipeline import DIM  # noqa: E402
from tests.test_input_pipeline import tables as _tables  # noqa: E402


def _as_dict(col, ids, weights=None) -> dict:
    return {
        f: {"ids": ids[:, i]} if weights is None else {"ids": ids[:, i], "weights": weights[:, i]}
        for i, f in enumerate(col.feature_names)
    }


def _stack(col, out: dict) -> jax.Array:
    return jnp.stack([out[f] for f in col.feature_names], axis=1)


#: The collection's calls as one program each: eager, a call runs op by op and every new input
#: shape compiles each op anew (seconds a call). Host int64 ids are closed over, not passed
#: (a jit argument past int32 would wrap). Gradients take these programs' VJPs (bitwise equal
#: stacked and dict on CPU; one jit over loss and gradient fuses the two calls' weight
#: gradients differently).
_call = nnx.jit(lambda m, x: m(x))
_call_w = nnx.jit(lambda m, x, w: m(x, w))
_dict_call = nnx.jit(lambda m, x, w=None: _stack(m, m(_as_dict(m, x, w))))  # stacked ids as a dict
#: The forwards without and with weights, one program a side (stacked, dict) of the comparison.
_stacked_forwards = nnx.jit(lambda m, x, w: (m(x), m(x, w)))
_dict_forwards = nnx.jit(lambda m, x, w: (_stack(m, m(_as_dict(m, x))), _stack(m, m(_as_dict(m, x, w)))))


def _assert_same(a, b, exact: Sequence[int] | bool = True) -> None:
    """Bit for bit on CPU. On a GPU only ``exact`` (columns of axis 1, or all/none) is: XLA's
    scatter-adds (a dense table's pooling and gradient, a 2-core table's, the reference
    path's) sum in an unspecified order (atomics), so the rest agrees to rounding."""
    a, b = np.asarray(a), np.asarray(b)
    if jax.default_backend() == "cpu" or exact is True:
        np.testing.assert_array_equal(a, b)
        return
    if exact:
        np.testing.assert_array_equal(a[:, list(exact)], b[:, list(exact)])
    np.testing.assert_allclose(a, b, rtol=2e-6, atol=2e-6 * max(1.0, float(np.abs(b).max(initial=0))))


def _kernel_features(col, impl: str) -> list[int]:
    """Columns the table-batched kernels pool (the TT pack's features): bit for bit on every
    backend."""
    if impl == "reference":
        return []
    tt = {s.feature for p in col.layout.packs if p.kind == "tt" for s in p.features}
    return [i for i, f in enumerate(col.feature_names) if f in tt]


@pytest.mark.parametrize("length", [None, 3])
@pytest.mark.parametrize("impl", ["auto", "reference"])
def test_stacked_equals_the_feature_dict(length, impl):
    col = TTEmbeddingCollection(_tables(), impl=impl, rngs=nnx.Rngs(0))
    assert col.feature_names == ("a", "d", "b1", "b2", "two", "d2", "c")
    assert [p.kind for p in col.layout.packs] == ["tt", "dense", "single"]
    rng = np.random.default_rng(0)
    shape = (6, len(col.feature_names)) + (() if length is None else (length,))
    ids = rng.integers(-2, 60, shape)  # some out of range (oob="zero"), some at row 49 / 39 ...
    ids[rng.random(shape) < 0.2] = 39  # the last row of d2
    weights = rng.standard_normal(shape).astype(np.float32)

    kernels = _kernel_features(col, impl)
    plain, weighted = _stacked_forwards(col, ids, weights)
    plain_want, weighted_want = _dict_forwards(col, ids, weights)
    _assert_same(plain, plain_want, kernels)
    _assert_same(weighted, weighted_want, kernels)

    def loss(c, w, stacked):
        y = _call_w(c, ids, w) if stacked else _dict_call(c, ids, w)
        return jnp.sum(jnp.sin(y) * np.arange(1, y.shape[1] + 1)[:, None]), y

    grad = nnx.grad(loss, argnums=(0, 1), has_aux=True)  # the weighted outputs: its forward's
    (g, gw), out = grad(col, jax.device_put(weights), True)
    (g_ref, gw_ref), want = grad(col, jax.device_put(weights), False)
    assert out.shape == (6, len(col.feature_names), DIM)
    _assert_same(out, want, kernels)
    paths = jax.tree_util.tree_flatten_with_path(nnx.state(g))[0]
    for (path, a), b in zip(paths, jax.tree.leaves(nnx.state(g_ref))):
        # the TT pack's cores (params tt<k>_core<i>) come from the kernels when impl="auto"
        _assert_same(a, b, impl != "reference" and jax.tree_util.keystr(path).startswith("['params']['tt"))
    _assert_same(gw, gw_ref, kernels)


def test_zero_batch_empty_bags_and_host_int64_ids():
    """B = 0, L = 0, and host int64 ids past int32: the stacked and the dict call agree
    (an id of 2^40 is out of range, not wrapped to a row, in both)."""
    col = TTEmbeddingCollection(_tables(), rngs=nnx.Rngs(0))
    num = len(col.feature_names)
    for shape in ((0, num), (0, num, 2), (3, num, 0)):
        ids = np.zeros(shape, np.int32)
        out = _call(col, ids)
        assert out.shape == (shape[0], num, DIM), shape
        np.testing.assert_array_equal(np.asarray(out), np.asarray(_dict_call(col, ids)))
    ids = np.random.default_rng(3).integers(0, 40, (4, num)).astype(np.int64)
    ids[1, 0] = 2**40 + 5  # would wrap to row 5 in jnp.asarray (no x64)
    # host ids closed over: numpy in the trace as in an eager call (op by op: ~300 compiles)
    out = np.asarray(nnx.jit(lambda m: m(ids))(col))
    np.testing.assert_array_equal(out, np.asarray(nnx.jit(lambda m: _stack(m, m(_as_dict(m, ids))))(col)))
    assert not np.any(out[1, 0]) and np.any(out[0, 0])
    strict = TTEmbeddingCollection(_tables(), oob="error", rngs=nnx.Rngs(0))
    for call in (lambda: strict(ids), lambda: strict(_as_dict(strict, ids))):
        with pytest.raises(ValueError, match="out of range|do not fit"):
            call()


def test_linen_takes_stacked_ids():
    from flowtt_jax import linen
    from flowtt_jax.collection.layout import CollectionLayout

    layer = linen.TTEmbeddingCollection(_tables())
    names = CollectionLayout(tuple(_tables())).feature_names
    ids = np.random.default_rng(1).integers(0, 40, (5, len(names)))
    # init traced (not compiled) on stacked ids; the values: the nnx twin's parameters
    col = TTEmbeddingCollection(_tables(), rngs=nnx.Rngs(0))
    assert set(jax.eval_shape(layer.init, jax.random.key(0), ids)["params"]) == set(col.params)
    variables = {"params": {k: p[...] for k, p in col.params.items()}}
    apply = jax.jit(layer.apply)  # a program each, not op by op
    out = apply(variables, ids)
    want = apply(variables, {f: ids[:, i] for i, f in enumerate(names)})
    np.testing.assert_array_equal(np.asarray(out), np.asarray(jnp.stack([want[f] for f in names], 1)))


def test_stacked_glue_does_not_grow_with_features():
    """Every op of the stacked forward is per pack: a TT shape group and a dense pack
    read by 4 or by 16 features give programs of the same ops."""

    def ops(num_features: int) -> Counter:
        tables = [
            TableConfig(
                f"t{i}",
                1000 + 97 * i,
                8,
                kind="tt" if i % 2 else "dense",
                rank=4,
                mode=("sum", "mean")[i % 4 // 2],
            )
            for i in range(num_features)
        ]
        col = nnx.eval_shape(lambda: TTEmbeddingCollection(tables, rngs=nnx.Rngs(0)))  # no init compile
        text = jax.jit(lambda m, x: m(x)).lower(col, jnp.zeros((64, num_features), jnp.int32)).as_text()
        return Counter(re.findall(r"(stablehlo\.\w+)", text))

    few, many = ops(4), ops(16)
    assert many == few, (few, many)


def test_stacked_inputs_are_checked():
    col = TTEmbeddingCollection(_tables(), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="F = 7 features"):
        col(np.zeros((4, 6), np.int32))
    with pytest.raises(ValueError, match="weights shape"):
        col(np.zeros((4, 7), np.int32), np.ones((4, 6), np.float32))
    with pytest.raises(ValueError, match="weights is for stacked ids"):
        col(_as_dict(col, np.zeros((4, 7), np.int32)), np.ones((4, 7), np.float32))
    with pytest.raises(TypeError, match="integer"):
        col(np.zeros((4, 7), np.float32))
    mixed = TTEmbeddingCollection(
        [TableConfig("x", 10, 8, kind="dense"), TableConfig("y", 10, 4)], rngs=nnx.Rngs(0)
    )
    with pytest.raises(ValueError, match="one dim"):
        mixed(np.zeros((4, 2), np.int32))
    strict = TTEmbeddingCollection(_tables(), oob="error", rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="out of range"):
        strict(np.full((4, 7), 60, np.int32))


def _check_sharded() -> None:
    """4 devices, both strategies: stacked forward and gradients equal one device's."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from flowtt_jax import sharding as sh
    from tests.helpers import rel_err

    mesh = jax.make_mesh((4,), ("data",))
    put = lambda x, s: jax.device_put(x, NamedSharding(mesh, s))
    col = TTEmbeddingCollection(_tables(), rngs=nnx.Rngs(0))  # a 2-core single pack too
    layout, params = col.layout, {k: v[...] for k, v in col.params.items()}
    rng = np.random.default_rng(2)
    ids = rng.integers(0, 40, (16, len(layout.feature_names), 2))
    weights = rng.standard_normal(ids.shape).astype(np.float32)
    loss = lambda apply, p, x, w: jnp.sum(jnp.sin(apply(p, x, w)))
    ref = layout.apply_stacked(params, ids, weights)
    ref_g = jax.grad(lambda p, w: loss(layout.apply_stacked, p, ids, w), argnums=(0, 1))(params, weights)
    placement = sh.place_tables(sh.table_costs(layout, _as_dict(col, ids)), 4)
    tw = sh.collection_table_wise(layout, mesh, placement)
    for name, lay, p in (
        ("data", sh.collection_data_parallel(layout, mesh), put(params, P())),
        ("table", tw, {k: put(v, tw.param_specs()[k]) for k, v in tw.shard_params(params).items()}),
    ):
        ids_in = put(ids, P("data"))
        w = put(weights, P("data"))
        out = jax.jit(lambda p, x, w, a=lay.apply_stacked: a(p, x, w))(p, ids_in, w)
        assert out.sharding.spec[0] == "data" and rel_err(out, ref) < 1e-6, name
        plain = jax.jit(lambda p, x, a=lay.apply_stacked: a(p, x))(p, ids_in)  # no weights
        assert rel_err(plain, layout.apply_stacked(params, ids)) < 1e-6, name
        grad = jax.grad(lambda p, w, a=lay.apply_stacked, x=ids_in: loss(a, p, x, w), argnums=(0, 1))
        g, gw = jax.jit(grad)(p, w)
        if name == "table":
            g = tw.gather_params(g)
        for k in ref_g[0]:
            assert rel_err(g[k], ref_g[0][k]) < 1e-5, (name, k)
        assert rel_err(gw, ref_g[1]) < 1e-5, name
        text = (
            jax.jit(lambda p, x, w, a=lay.apply_stacked: a(p, x, w)).lower(p, ids_in, w).compile().as_text()
        )
        assert "all-gather" not in text, name
    print("stacked sharding OK")


@pytest.mark.slow
def test_stacked_over_four_devices():
    code = "from tests import test_collection_stacked as t; t._check_sharded()"
    [(returncode, out)] = _run_workers([(code, _cpu_env(cpu_devices=4))], timeout=600)
    assert returncode == 0 and "stacked sharding OK" in out, out[-5000:]
