"""A collection at scale: the packed jagged input (``KeyedJagged``) against the dict call bit
for bit on CPU (outputs and gradients, eager and under ``jit``; on a GPU to rounding where
XLA's scatter-adds sum: dense tables, the 2-core table), unpooled rows against each table's
``to_dense``, and a program whose size does not grow with the tables: construction
compiles, op counts, and no constant of the batch's size in the lowered or compiled call."""

import re
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest

flax = pytest.importorskip("flax")
from flax import nnx  # noqa: E402

from flowtt_jax import KeyedJagged  # noqa: E402
from flowtt_jax.collection import TableConfig  # noqa: E402
from flowtt_jax.nnx import TTEmbeddingCollection  # noqa: E402
from tests.test_collection_stacked import DIM, _assert_same, _stack, _tables  # noqa: E402
from tests.test_input_pipeline import _dev  # noqa: E402

#: The collection's calls as one program each: eager, a call runs op by op and every new batch
#: shape compiles each op anew (seconds a call); the eager calls are checked in
#: ``test_jagged_equals_dict_call_bitwise``. Set-up arrays go to the device by ``_dev``.
_call = nnx.jit(lambda m, x: m(x))
_unpooled = nnx.jit(lambda m, x: m(x, pooled=False))


@nnx.jit
def _pooled_and_padded(m, x: KeyedJagged):
    """A batch's pooled values and its unpooled rows ``to_padded(rows, 6)``: one program (for
    one side of a comparison, never both sides in one)."""
    return m(x), x.to_padded(m(x, pooled=False), 6)


def _rows(col) -> dict[str, int]:
    return {f: cfg.num_embeddings for cfg in col.tables for f in cfg.feature_keys}


def _batch(col, batch: int, seed: int, *, weighted: bool = False, max_len: int = 6):
    """``(dict features, KeyedJagged)`` of the same bags: CSR features of random lengths
    (empty bags included), ids at each table's last row, an out-of-range id."""
    rng = np.random.default_rng(seed)
    rows = _rows(col)
    feats, ids, lengths, weights = {}, [], [], []
    for f in col.feature_names:
        n_f = rng.integers(0, max_len + 1, batch)
        n_f[rng.random(batch) < 0.2] = 0
        v = rng.integers(0, rows[f], int(n_f.sum())).astype(np.int32)
        if v.size:
            v[0] = rows[f] - 1
        if v.size > 2:
            v[-1] = rows[f] + 3  # out of range: a zero row under oob="zero"
        w = rng.uniform(0.5, 1.5, v.size).astype(np.float32)
        offsets = np.concatenate([[0], np.cumsum(n_f)]).astype(np.int32)
        feats[f] = {"ids": _dev(v, np.int32), "offsets": _dev(offsets, np.int32)}
        if weighted:
            feats[f]["weights"] = _dev(w, np.float32)
        ids.append(v)
        lengths.append(n_f)
        weights.append(w)
    kjt = KeyedJagged(
        ids=_dev(np.concatenate(ids), np.int32),
        lengths=_dev(np.stack(lengths), np.int32),
        weights=_dev(np.concatenate(weights), np.float32) if weighted else None,
        keys=col.feature_names,
    )
    return feats, kjt


@pytest.mark.parametrize("weighted", [False, True])
def test_jagged_equals_dict_call_bitwise(weighted):
    """Outputs and gradients (cores, dense tables, weights) of the packed call equal the dict
    call's bit for bit, eager and jitted (traced lengths / offsets); offsets and lengths
    give the same values. The dict call's values: eager in the unweighted case (a slow
    test), else one program whose features are closed over (concrete offsets, the eager
    call's path; op by op it compiles ~300 ops)."""
    col = TTEmbeddingCollection(_tables(), rngs=nnx.Rngs(0))
    feats, kjt = _batch(col, 5, seed=1, weighted=weighted)
    want = nnx.jit(lambda m: _stack(m, m(feats)))(col) if weighted else _stack(col, col(feats))
    assert not np.any(np.isnan(np.asarray(want))) and np.any(np.asarray(want))
    got = col(kjt)  # eager: concrete lengths
    _assert_same(np.asarray(got), np.asarray(want), False)
    offsets = _dev(np.r_[0, np.cumsum(np.asarray(kjt.lengths).reshape(-1))], np.int32)
    by_offsets = KeyedJagged(kjt.ids, offsets=offsets, weights=kjt.weights)
    _assert_same(np.asarray(_call(col, by_offsets)), np.asarray(want), False)

    graph, state = nnx.split(col)

    def loss(state, w, batch, packed):
        m = nnx.merge(graph, state)
        if packed:
            batch = KeyedJagged(batch.ids, lengths=batch.lengths, weights=w if weighted else None)
            return jnp.sum(jnp.sin(m(batch)))
        batch = {f: dict(v) for f, v in batch.items()}
        if weighted:  # w's slices in feature_names order (a dict under jit is in key order)
            names = col.feature_names
            starts = np.cumsum([0] + [int(batch[f]["ids"].shape[0]) for f in names])
            for f, lo, hi in zip(names, starts[:-1], starts[1:]):
                batch[f]["weights"] = w[lo:hi]
        return jnp.sum(jnp.sin(_stack(m, m(batch))))

    w = kjt.weights if weighted else _dev(np.ones(kjt.ids.shape), np.float32)
    grad = jax.jit(jax.grad(loss, argnums=(0, 1)), static_argnums=3)
    g_packed, gw_packed = grad(state, w, kjt, True)
    g_dict, gw_dict = grad(state, w, feats, False)
    for a, b in zip(jax.tree.leaves(g_packed["params"]), jax.tree.leaves(g_dict["params"])):
        assert np.any(np.asarray(a))
        _assert_same(np.asarray(a), np.asarray(b), False)
    _assert_same(np.asarray(gw_packed), np.asarray(gw_dict), False)


def test_jagged_traced_invalid_offsets_clamp_like_the_dict_call():
    """Traced offsets that leave positions outside the bags (first offset > 0, last < n, a
    decrease) are clamped into a valid CSR, positions outside it in no bag: the values of
    the dict call given each feature's slice of the same clamped bags."""
    col = TTEmbeddingCollection(_tables(), rngs=nnx.Rngs(1))
    feats, kjt = _batch(col, 4, seed=2)
    offsets = np.concatenate([[0], np.cumsum(np.asarray(kjt.lengths).reshape(-1))]).astype(np.int32)
    bad = offsets.copy()
    bad[0] = 2  # positions 0, 1 in no bag
    bad[-1] = offsets[-1] - 1  # the last position in no bag
    bad[9] = bad[8] - 1  # a decrease: the running maximum
    got = jax.jit(lambda o: col(KeyedJagged(kjt.ids, offsets=o)))(_dev(bad, np.int32))
    fixed = np.maximum.accumulate(np.clip(bad, 0, offsets[-1]))
    ids = np.asarray(kjt.ids)
    keep = np.zeros(ids.shape, bool)
    keep[fixed[0] : fixed[-1]] = True
    want = {}
    batch = 4
    for i, f in enumerate(col.feature_names):
        lo, hi = fixed[i * batch], fixed[(i + 1) * batch]
        want[f] = {
            "ids": _dev(ids[lo:hi], np.int32),
            "offsets": _dev(fixed[i * batch : (i + 1) * batch + 1] - lo, np.int32),
        }
    _assert_same(np.asarray(got), np.asarray(_stack(col, _call(col, want))), False)


def test_jagged_checks_name_the_problem():
    col = TTEmbeddingCollection(_tables(), rngs=nnx.Rngs(0))
    feats, kjt = _batch(col, 3, seed=3)
    with pytest.raises(ValueError, match="missing \\['c'\\]"):
        col(KeyedJagged(kjt.ids, lengths=kjt.lengths, keys=col.feature_names[:-1] + ("zz",)))
    with pytest.raises(ValueError, match="repeated \\['a'\\]"):
        col(KeyedJagged(kjt.ids, lengths=kjt.lengths, keys=("a",) + col.feature_names[:-1]))
    with pytest.raises(ValueError, match="sum to at most len\\(ids\\)"):
        col(KeyedJagged(_dev(np.asarray(kjt.ids)[1:], np.int32), lengths=kjt.lengths))
    tail = _dev(np.r_[np.asarray(kjt.ids), np.full(5, -3)], np.int32)
    padded = _call(col, KeyedJagged(tail, lengths=kjt.lengths))
    _assert_same(np.asarray(padded), np.asarray(_call(col, kjt)), False)  # a padded tail: in no bag
    with pytest.raises(ValueError, match="F = 7 features"):
        col(KeyedJagged(kjt.ids, lengths=_dev(np.asarray(kjt.lengths)[1:], np.int32)))
    with pytest.raises(ValueError, match="exactly one of"):
        col(KeyedJagged(kjt.ids))
    bad = np.concatenate([[1], np.cumsum(np.asarray(kjt.lengths).reshape(-1))]).astype(np.int32)
    with pytest.raises(ValueError, match="offsets\\[0\\] == 0"):
        col(KeyedJagged(kjt.ids, offsets=bad))


def test_unpooled_rows_are_each_tables_rows():
    """``lookup`` (jagged and dict) gives each id's row of its own table's ``to_dense``
    (float64 oracle), zero rows for out-of-range ids, the weights' scale, and the same
    rows as a one-id-per-bag pooled call; its gradient equals the pooled call's."""
    col = TTEmbeddingCollection(_tables(), rngs=nnx.Rngs(2))
    feats, kjt = _batch(col, 4, seed=4, weighted=True)
    dense = {cfg.name: np.asarray(col.to_dense(cfg.name), np.float64) for cfg in col.tables}
    table_of = {f: cfg.name for cfg in col.tables for f in cfg.feature_keys}
    rows = _rows(col)
    want = []
    for f in col.feature_names:
        v = np.asarray(feats[f]["ids"])
        r = np.zeros((v.size, DIM))
        ok = v < rows[f]
        r[ok] = dense[table_of[f]][v[ok]]
        want.append(r * np.asarray(feats[f]["weights"], np.float64)[:, None])
    want = np.concatenate(want)
    got = col.lookup(kjt)
    assert got.shape == (kjt.ids.shape[0], DIM)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6)
    per = col.lookup({f: feats[f] for f in col.feature_names})
    np.testing.assert_array_equal(
        np.concatenate([np.asarray(per[f]) for f in col.feature_names]), np.asarray(got)
    )
    two_d = col.lookup({"c": jnp.asarray([[0, 76], [5, 76]]), "a": jnp.asarray([999])})
    assert two_d["c"].shape == (2, 2, DIM) and set(two_d) == {"a", "c"}
    np.testing.assert_allclose(np.asarray(two_d["c"][1, 1]), dense["c"][76], rtol=1e-5, atol=1e-6)

    sums = TTEmbeddingCollection([TableConfig("t", 500, DIM, rank=4)], rngs=nnx.Rngs(3))
    ids = jnp.asarray(np.random.default_rng(5).integers(0, 500, 64).astype(np.int32).tolist() + [499])
    one = KeyedJagged(ids, offsets=jnp.arange(ids.shape[0] + 1, dtype=jnp.int32))
    np.testing.assert_array_equal(np.asarray(sums.lookup(one)), np.asarray(sums(one)[:, 0]))
    g_rows = nnx.grad(lambda m: jnp.sum(jnp.cos(m.lookup(one))))(sums)
    g_pool = nnx.grad(lambda m: jnp.sum(jnp.cos(m(one)[:, 0])))(sums)
    for a, b in zip(jax.tree.leaves(nnx.state(g_rows)), jax.tree.leaves(nnx.state(g_pool))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _meta_like_tables(num: int, seed: int = 0) -> list[TableConfig]:
    """One shape group (rows from 10^5: no rank capped), every pooling mode."""
    rng = np.random.default_rng(seed)
    rows = np.exp(rng.uniform(np.log(1e5), np.log(4e7), num)).astype(np.int64)
    modes = ("sum", "mean", "sqrtn")
    return [TableConfig(f"t{i}", int(n), 32, rank=32, mode=modes[i % 3]) for i, n in enumerate(rows)]


def _count_compiles(fn) -> int:
    events = []

    def listen(name, *args, **kwargs):
        if name == "/jax/core/compile/backend_compile_duration":
            events.append(name)

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        fn()
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    return len(events)


@pytest.mark.slow
def test_construction_compiles_do_not_grow_with_tables():
    """16 and 256 Meta-like tables: the same number of compiles to construct (one program
    per collection, not a draw per table), and each table's rows keep the std of its
    distribution (1/sqrt(D)); ``nnx.eval_shape`` still builds abstractly."""
    counts = {}
    TTEmbeddingCollection(_meta_like_tables(4, seed=4), rngs=nnx.Rngs(4))  # the eager ops' own compiles
    for num in (16, 256):
        tables = _meta_like_tables(num, seed=num)
        counts[num] = _count_compiles(lambda t=tables, k=num: TTEmbeddingCollection(t, rngs=nnx.Rngs(k)))
    assert counts[16] == counts[256] and counts[256] <= 3, counts
    col = TTEmbeddingCollection(_meta_like_tables(16), rngs=nnx.Rngs(0))
    stds = [float(np.std(np.asarray(col.to_dense(c.name)[:20000]))) for c in col.tables[:4]]
    np.testing.assert_allclose(stds, 1 / np.sqrt(32), rtol=0.15)
    abstract = nnx.eval_shape(lambda: TTEmbeddingCollection(_meta_like_tables(16), rngs=nnx.Rngs(0)))
    shapes = {k: v.shape for k, v in nnx.state(abstract).flat_state()}
    assert shapes == {k: v.shape for k, v in nnx.state(col).flat_state()}


def test_init_std_per_table_in_one_pack():
    """Tables of one pack with their own ``init_std`` keep it (row by row scale)."""
    tables = [
        TableConfig("x", 4000, 16, rank=8, init_std=0.01),
        TableConfig("y", 4000, 16, rank=8, init_std=1.0),
        TableConfig("dx", 3000, 16, kind="dense", init_std=0.02),
        TableConfig("dy", 3000, 16, kind="dense", init_std=2.0),
    ]
    col = TTEmbeddingCollection(tables, rngs=nnx.Rngs(0))
    assert len(col.layout.packs) == 2
    dense = nnx.jit(lambda m: [m.to_dense(t.name) for t in tables])(col)  # one program
    got = [float(np.std(np.asarray(d))) for d in dense]
    np.testing.assert_allclose(got, [0.01, 1.0, 0.02, 2.0], rtol=0.2)


def _op_counts(text: str) -> Counter:
    return Counter(re.findall(r"= (?:\"?)(stablehlo\.[a-z_]+|func\.call|call)", text))


def _program(num: int, batch: int, packed: bool, kind: str = "csr"):
    """The lowered training step of a Meta-like collection (abstract: not initialised) over
    abstract inputs."""
    col = nnx.eval_shape(lambda: TTEmbeddingCollection(_meta_like_tables(num), rngs=nnx.Rngs(0)))
    graph, state = nnx.split(col)
    n_f = 3 * batch
    names = col.feature_names
    if packed:
        args = KeyedJagged(
            jax.ShapeDtypeStruct((num * n_f,), jnp.int32),
            lengths=jax.ShapeDtypeStruct((num, batch), jnp.int32),
        )
    elif kind == "csr":
        args = {
            f: {
                "ids": jax.ShapeDtypeStruct((n_f,), jnp.int32),
                "offsets": jax.ShapeDtypeStruct((batch + 1,), jnp.int32),
            }
            for f in names
        }
    else:
        args = {f: jax.ShapeDtypeStruct((batch, 3), jnp.int32) for f in names}

    def step(state, batch_in):
        if not packed:  # the forward: a loss over a dict's outputs is per-feature ops of its own
            return nnx.merge(graph, state)(batch_in)
        return jax.grad(lambda st: jnp.sum(nnx.merge(graph, st)(batch_in)))(state)

    return jax.jit(step).lower(state, args)


@pytest.mark.parametrize("packed,kind", [(True, "csr"), (False, "csr"), (False, "padded")])
def test_call_program_does_not_grow_with_tables(packed, kind):
    """The same ops (by kind and count) for 16 and 64 tables: the packed call's training
    step, and the dict call's forward but for its output (a slice per feature of the
    dict it returns): nothing per feature between the input and the pooling."""
    a = _op_counts(_program(16, 32, packed, kind).as_text())
    b = _op_counts(_program(64, 32, packed, kind).as_text())
    if not packed:
        assert b.pop("stablehlo.slice") - a.pop("stablehlo.slice") == 64 - 16
        # one concatenation of the features' ids, one of their offsets: jax lowers each as
        # ceil(F / 16) ops and one more to join them
        assert b.pop("stablehlo.concatenate") - a.pop("stablehlo.concatenate") <= 2 * (64 // 16)
        if kind == "padded":  # a [B, L] feature's ids are reshaped to [B*L] (a bitcast)
            assert b.pop("stablehlo.reshape") - a.pop("stablehlo.reshape") == 64 - 16
    assert a == b, {k: (a[k], b[k]) for k in set(a) | set(b) if a[k] != b[k]}


def _largest_constant_bytes(text: str) -> int:
    """Bytes of the largest dense constant in StableHLO or HLO text."""
    sizes = [0]
    for m in re.finditer(r"stablehlo\.constant dense.*?: tensor<([0-9x]+)x([a-z0-9]+)>", text):
        dims, dtype = m.group(1), m.group(2)
        sizes.append(
            int(np.prod([int(d) for d in dims.split("x")])) * max(1, int(re.sub(r"\D", "", dtype) or 8) // 8)
        )
    for m in re.finditer(r"= ([a-z]+)(\d+)\[([0-9,]*)\][^ ]* constant\(", text):
        dims = [int(d) for d in m.group(3).split(",") if d]
        sizes.append(int(np.prod(dims)) * max(1, int(m.group(2)) // 8))
    return max(sizes)


@pytest.mark.slow
def test_no_batch_sized_constants():
    """100 Meta-like tables at batch 4,096 (the packed and the dict call, forward and
    backward): no constant above 64 KB in the lowered module, nor in the compiled one (XLA
    folded none of the batch's size)."""
    for packed, kind in ((True, "csr"), (False, "csr"), (False, "padded")):
        lowered = _program(100, 4096, packed, kind)
        assert _largest_constant_bytes(lowered.as_text()) <= 64 << 10, (packed, kind)
        if kind == "csr":
            assert _largest_constant_bytes(lowered.compile().as_text()) <= 64 << 10, (packed, kind)


def test_largest_constant_parser_sees_constants():
    """The check above can fail: a module holding a 1 MB constant is measured as such."""
    big = np.random.default_rng(0).integers(0, 1000, 1 << 18).astype(np.int32)  # not an iota
    lowered = jax.jit(lambda x: x + jnp.asarray(big)).lower(jnp.zeros(big.shape, jnp.int32))
    assert _largest_constant_bytes(lowered.as_text()) == big.nbytes
    assert _largest_constant_bytes(lowered.compile().as_text()) >= big.nbytes


def test_sharded_collection_refuses_a_jagged_batch():
    """A KeyedJagged's flat ids do not split by example: a sharded collection refuses it
    (and the unpooled lookup) loudly instead of running unsharded."""
    from flowtt_jax import sharding

    col = TTEmbeddingCollection(_tables(), rngs=nnx.Rngs(0))
    _, kjt = _batch(col, 2, seed=6)
    mesh = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1])
    dp = sharding.collection_data_parallel(col.layout, mesh)
    params = {k: p[...] for k, p in col.params.items()}
    with pytest.raises(NotImplementedError, match="not a KeyedJagged"):
        dp.call(params, kjt)
    with pytest.raises(NotImplementedError, match="no unpooled lookup"):
        dp.call(params, kjt, pooled=False)


def test_linen_twin_takes_a_jagged_batch():
    """The linen collection given the nnx one's parameters: the same pooled and unpooled
    values for a KeyedJagged."""
    from flowtt_jax import linen

    col = TTEmbeddingCollection(_tables(), rngs=nnx.Rngs(0))
    _, kjt = _batch(col, 3, seed=7, weighted=True)
    lcol = linen.TTEmbeddingCollection(_tables())
    assert set(jax.eval_shape(lcol.init, jax.random.key(0), kjt)["params"]) == set(col.params)
    params = {"params": {k: p[...] for k, p in col.params.items()}}
    # a program a side: pooled and unpooled together
    pooled, rows = jax.jit(lambda v, x: (lcol.apply(v, x), lcol.apply(v, x, pooled=False)))(params, kjt)
    want, want_rows = nnx.jit(lambda m, x: (m(x), m.lookup(x)))(col, kjt)
    _assert_same(np.asarray(pooled), np.asarray(want), False)
    np.testing.assert_array_equal(np.asarray(rows), np.asarray(want_rows))


def test_unknown_feature_keys_raise():
    """A misspelt feature in a dict call (pooled or unpooled) is a KeyError naming it, not
    silently ignored."""
    col = TTEmbeddingCollection(_tables(), rngs=nnx.Rngs(0))
    feats, _ = _batch(col, 2, seed=8)
    with pytest.raises(KeyError, match="'zz'"):
        col({**feats, "zz": feats["a"]})
    with pytest.raises(KeyError, match="'a_typo'"):
        col.lookup({"a_typo": jnp.asarray([1, 2])})
    assert set(_call(col, feats)) == set(col.feature_names)


def test_oob_error_under_jit_through_checked():
    """``oob="error"`` under ``jit``: ``ftt.checked`` raises for an id past its table (dict and
    KeyedJagged calls, and the plain op) and returns the values for valid ids."""
    import flowtt_jax as ftt

    col = TTEmbeddingCollection(_tables(), oob="error", rngs=nnx.Rngs(0))
    feats, kjt = _batch(col, 3, seed=9)
    step = ftt.checked(lambda m, x: m(x))
    rows = _rows(col)
    ok = {
        f: {"ids": _dev(np.clip(np.asarray(x["ids"]), 0, rows[f] - 1), np.int32), "offsets": x["offsets"]}
        for f, x in feats.items()
    }
    # The values: the same parameters' plain jitted call (oob="zero"; the same for valid ids).
    # Not bit for bit: the checked call is another XLA program (checkify's ops beside it,
    # other fusions), and on the GPU XLA may contract the modes' scaling into a multiply-add
    # in one and not the other: 2.5e-7 apart measured on an H200 (6 of 168 elements). The
    # kernels themselves are bitwise reproducible (test_golden).
    zero = nnx.clone(col)
    zero.oob = "zero"
    np.testing.assert_allclose(
        np.asarray(_stack(col, step(col, ok))), np.asarray(_stack(col, _call(zero, ok))), rtol=2e-6, atol=1e-6
    )
    c_ids = np.asarray(ok["c"]["ids"]).copy()
    c_ids[0] = 77
    bad = dict(ok, c={"ids": _dev(c_ids, np.int32), "offsets": ok["c"]["offsets"]})
    with pytest.raises(ValueError, match="found 77 in table #2 \\(of 77 rows\\).*#2 'c'"):
        step(col, bad)
    with pytest.raises(ValueError, match="id 77 of table 'c' \\(77 rows\\)"):
        col(bad)  # eager: the table's name
    with pytest.raises(ValueError, match="out of range"):
        step(col, kjt)  # _batch put an id past each table's end
    draw = np.random.default_rng(0).standard_normal  # any values: no init program
    cores = tuple(_dev(draw(s), np.float32) for s in ftt.TTSpec.create(100, 8, 4).core_shapes)
    lookup = ftt.checked(lambda c, i: ftt.tt_lookup(c, i, oob="error"))
    assert lookup(cores, _dev([0, 99], np.int32)).shape == (2, 8)
    with pytest.raises(ValueError, match="out of range"):
        lookup(cores, _dev([0, 100], np.int32))


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(name=3), "name must be a str, got 3"),
        (dict(rank=3.5), "table 't': rank must be an int, got 3.5"),
        (dict(rank=(4, 2.0)), "table 't': rank must be an int, got 2.0"),
        (dict(feature_names="item"), "table 't': feature_names must be a sequence of str.*\\('item',\\)"),
        (dict(num_embeddings=10.0), "table 't': num_embeddings must be an int"),
        (dict(col_shape=8), "table 't': col_shape must be a tuple of ints"),
        (dict(init_std=-1.0), "table 't': init_std must be a positive number"),
    ],
)
def test_table_config_errors_name_the_table_and_argument(kwargs, match):
    """A config's type errors say which table and which argument, not a Python internal."""
    base = dict(name="t", num_embeddings=100, features=8)
    with pytest.raises((TypeError, ValueError), match=match):
        TableConfig(**{**base, **kwargs})
    assert TableConfig("t", np.int64(100), 8, rank=(np.int32(4), 3)).rank == (4, 3)


def test_oob_error_checks_each_packs_own_bags_only():
    """``oob="error"`` with two packs (TT + dense): a ``KeyedJagged`` whose ids are valid for
    their own tables, with a static-capacity tail of ids in no bag, passes eager and under
    ``ftt.checked``; an id past its own table is refused naming its table, feature and
    example."""
    import flowtt_jax as ftt

    tables = [TableConfig("a", 1000, 8, rank=4), TableConfig("b", 50, 8, kind="dense", feature_names=("fb",))]
    col = TTEmbeddingCollection(tables, oob="error", rngs=nnx.Rngs(0))
    lengths = _dev([[2, 1], [1, 1]], np.int32)  # a: 500, 7 | 3; fb: 40 | 49; then a tail in no bag
    ids = np.array([500, 7, 3, 40, 49, 12345, -3, 0], np.int32)
    kjt = KeyedJagged(ids=_dev(ids, np.int32), lengths=lengths, keys=col.feature_names)
    step = ftt.checked(lambda m, x: m(x))
    want = np.asarray(col(kjt))
    np.testing.assert_array_equal(np.asarray(step(col, kjt)), want)
    ids[4] = 50
    bad = KeyedJagged(ids=_dev(ids, np.int32), lengths=lengths, keys=col.feature_names)
    with pytest.raises(ValueError, match="id 50 of table 'b' \\(50 rows\\) at feature 'fb', example 1"):
        col(bad)
    with pytest.raises(ValueError, match="found 50 in table #0 .* feature #0 example 1.*#0 'fb'"):
        step(col, bad)


def test_keys_in_any_order_a_builder_and_padded_rows():
    """A ``KeyedJagged`` whose keys come in another order than ``feature_names`` (reordered on
    the device) gives the values of the ordered batch, pooled and unpooled; ``from_features``
    builds one from per-feature inputs (one-id, padded, lengths, offsets, weights); ``to_padded``
    turns unpooled rows into ``[B, L, D]`` + mask per feature."""
    col = TTEmbeddingCollection(_tables(), rngs=nnx.Rngs(0))
    feats, kjt = _batch(col, 4, seed=5, weighted=True)
    names = col.feature_names
    perm = [3, 0, 6, 1, 5, 2, 4]
    shuffled = KeyedJagged.from_features(
        {
            names[i]: {
                "ids": feats[names[i]]["ids"],
                "offsets": feats[names[i]]["offsets"],
                "weights": feats[names[i]]["weights"],
            }
            for i in perm
        }
    )
    assert shuffled.keys == tuple(names[i] for i in perm)
    pooled, padded = _pooled_and_padded(col, shuffled)
    pooled_want, padded_want = _pooled_and_padded(col, kjt)
    _assert_same(np.asarray(pooled), np.asarray(pooled_want), False)
    for f in names:
        np.testing.assert_array_equal(np.asarray(padded[f][1]), np.asarray(padded_want[f][1]))
        _assert_same(np.asarray(padded[f][0]), np.asarray(padded_want[f][0]), False)
        lengths = np.diff(np.asarray(feats[f]["offsets"]))
        np.testing.assert_array_equal(np.asarray(padded[f][1]).sum(1), np.minimum(lengths, 6))
    # per bag, the padded rows are the unpooled rows of the dict lookup, in order, zeros after
    f = names[2]
    dict_rows = np.asarray(_unpooled(col, {f: feats[f]["ids"]})[f])
    offsets = np.asarray(feats[f]["offsets"])
    for b in range(4):
        got = np.asarray(padded[f][0])[b]
        bag = (
            dict_rows[offsets[b] : offsets[b + 1]]
            * np.asarray(feats[f]["weights"])[offsets[b] : offsets[b + 1], None]
        )
        _assert_same(got[: len(bag)], bag, False)
        assert not got[len(bag) :].any()
    # one-id and padded features, no weights
    one = {n: np.arange(4) % 40 for n in names}
    one[names[1]] = np.arange(8).reshape(4, 2) % 40
    built = KeyedJagged.from_features(one)
    stacked_dict = _call(col, {n: v for n, v in one.items()})
    _assert_same(np.asarray(_call(col, built)), np.asarray(_stack(col, stacked_dict)), False)
    with pytest.raises(ValueError, match="same batch size"):
        KeyedJagged.from_features({"a": np.arange(3), "c": np.arange(4)})


def test_jagged_batch_over_tables_of_several_dims_gives_a_dict():
    """Tables of different dims in one ``KeyedJagged``: ``{feature: [B, D_f]}``, the dict call's
    values (TorchRec's ``[B, sum D]`` by one concatenation)."""
    tables = [
        TableConfig("user", 500, 16, rank=4),
        TableConfig("country", 30, 4, kind="dense"),
        TableConfig("item", 800, 16, rank=4, feature_names=("item", "hist")),
    ]
    col = TTEmbeddingCollection(tables, rngs=nnx.Rngs(0))
    feats = {
        "user": np.array([1, 2, 499]),
        "country": np.array([0, 29, 3]),
        "item": np.array([5, 6, 7]),
        "hist": {"ids": np.array([1, 2, 3, 4, 799]), "offsets": np.array([0, 2, 2, 5])},
    }
    kjt = KeyedJagged.from_features(feats)
    got, want = _call(col, kjt), _call(col, feats)
    assert set(got) == set(want) and got["country"].shape == (3, 4) and got["user"].shape == (3, 16)
    for f in want:
        _assert_same(np.asarray(got[f]), np.asarray(want[f]), False)
    flat = jnp.concatenate([got[f] for f in col.feature_names], -1)
    assert flat.shape == (3, 16 + 4 + 16 + 16)
