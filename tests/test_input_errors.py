"""Hostile inputs get errors that name what the user wrote, or a documented policy: empty
batches (B = 0) give empty results, weights must be real, traced ``KeyedJagged`` lengths are
checked under ``oob="error"``, ranks and static sizes name their argument, and the sample
batch measures take every documented input form (``KeyedJagged`` included)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import flowtt_jax as ftt
from flowtt_jax.collection import TableConfig
from flowtt_jax.nnx import TTEmbeddingCollection

TABLES = [TableConfig("a", 1000, 8, rank=4), TableConfig("b", 50, 8, kind="dense")]


@pytest.fixture(scope="module")
def coll():
    return TTEmbeddingCollection(TABLES, oob="error", rngs=nnx.Rngs(0))


def _kjt(coll, ids, **kw):
    return ftt.KeyedJagged(ids=jnp.asarray(ids), keys=coll.feature_names, **kw)


def test_empty_batches_give_empty_results(coll):
    """B = 0 in every form (with and without ids in the flat array): empty outputs."""
    none = jnp.zeros((0,), jnp.int32)
    assert coll(_kjt(coll, none, lengths=jnp.zeros((2, 0), jnp.int32))).shape == (0, 2, 8)
    assert coll(_kjt(coll, [1, 2, 3], lengths=jnp.zeros((2, 0), jnp.int32))).shape == (0, 2, 8)
    assert coll(_kjt(coll, none, offsets=jnp.zeros((1,), jnp.int32))).shape == (0, 2, 8)
    assert coll.lookup(_kjt(coll, none, lengths=jnp.zeros((2, 0), jnp.int32))).shape == (0, 8)
    out = coll({"a": none, "b": jnp.zeros((0, 3), jnp.int32)})
    assert {k: v.shape for k, v in out.items()} == {"a": (0, 8), "b": (0, 8)}
    assert coll(jnp.zeros((0, 2), jnp.int32)).shape == (0, 2, 8)


@pytest.mark.parametrize("bad", [jnp.array([1 + 1j, 2]), jnp.array([True, False])], ids=["complex", "bool"])
def test_weights_must_be_real(coll, bad):
    lengths = jnp.array([[1], [1]])
    with pytest.raises(TypeError, match="KeyedJagged weights must be real numbers"):
        coll(_kjt(coll, [1, 2], lengths=lengths, weights=bad))
    with pytest.raises(TypeError, match="stacked weights must be real"):
        coll(jnp.array([[1, 2]]), bad.reshape(1, 2))
    rng = np.random.default_rng(0)  # cores drawn by numpy: no random program per core shape
    cores = [rng.standard_normal(c).astype(np.float32) for c in ftt.TTSpec.create(100, 8, 4).core_shapes]
    with pytest.raises(TypeError, match="weights must be real"):
        ftt.tt_embedding_bag(
            cores,
            jnp.array([1, 2]),
            offsets=[0, 2],
            weights=bad,
        )


def test_int_weights_are_converted(coll):
    """Documented policy: integer weights are converted to float."""
    lengths = jnp.array([[1], [1]])
    got = coll(_kjt(coll, [1, 2], lengths=lengths, weights=jnp.array([2, 3])))
    want = coll(_kjt(coll, [1, 2], lengths=lengths, weights=jnp.array([2.0, 3.0])))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_traced_lengths_are_checked_under_oob_error(coll):
    step = ftt.checked(lambda m, lengths: m(_kjt(m, [1, 2, 3], lengths=lengths)))
    assert step(coll, jnp.array([[2], [1]])).shape == (1, 2, 8)
    for bad in ([[2], [-1]], [[2], [5]]):
        with pytest.raises(ValueError, match="KeyedJagged lengths must be >= 0 and sum to at most len"):
            step(coll, jnp.array(bad))


@pytest.mark.parametrize("rank", [2.5, "8", True, (4, 2.0)])
def test_rank_names_itself(rank):
    with pytest.raises(TypeError, match="rank must be an int or a sequence"):
        ftt.TTSpec.create(1000, 8, rank=rank)


@pytest.mark.parametrize("bad", [True, 0, -2, 2.5])
def test_collection_static_sizes_name_themselves(bad):
    with pytest.raises(ValueError, match="ids_per_pass must be an int >= 1"):
        TTEmbeddingCollection(TABLES, ids_per_pass=bad, rngs=nnx.Rngs(0))


def test_measures_take_every_input_form():
    """``BatchStats.measure`` and ``measure_unique_ids`` on dict forms (CSR dicts, masks,
    segment ids, tuples, padded) and on a ``KeyedJagged``: the ids the bags look up."""
    batch = {
        "a": {"ids": np.array([1, 2, 3, 9]), "offsets": np.array([0, 1, 3])},  # 9: in no bag
        "b": {"ids": np.array([[1, 2], [3, 4]]), "mask": np.array([[True, False], [True, True]])},
    }
    stats = ftt.BatchStats.measure([batch], TABLES)
    assert (stats.batch_size, dict(stats.ids), dict(stats.unique)) == (2, {"a": 3, "b": 3}, {"a": 3, "b": 3})
    seg = {"a": {"ids": np.array([5, 5, 6]), "segment_ids": np.array([0, 1, 7]), "num_bags": 2}}
    assert dict(ftt.BatchStats.measure([seg], TABLES).unique) == {"a": 1}
    kjt = ftt.KeyedJagged(ids=np.array([4, 4, 7, 1, 2]), lengths=np.array([[2, 1], [1, 1]]), keys=("a", "b"))
    stats = ftt.BatchStats.measure([kjt], TABLES)
    assert (dict(stats.ids), dict(stats.unique)) == ({"a": 3, "b": 2}, {"a": 2, "b": 2})
    assert ftt.measure_unique_ids([kjt, batch], {"a": "a", "b": "b"}, margin=1.0) == {"a": 64, "b": 64}
    with pytest.raises(ValueError, match="KeyedJagged sample batch needs keys"):
        ftt.BatchStats.measure([ftt.KeyedJagged(ids=np.array([1]), lengths=np.array([[1], [0]]))], TABLES)
    with pytest.raises(ValueError, match="feature 'a': a dict input needs 'ids'"):
        ftt.BatchStats.measure([{"a": {"offsets": np.array([0])}}], TABLES)


@pytest.mark.parametrize("on_device", [False, True])
@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_from_dense_refuses_non_finite_tables(bad, on_device):
    """A NaN gave NaN cores with a reported error of 0.0, an inf never returned (the SVD):
    both refused, naming the table in the collection's ``from_dense``."""
    table = np.random.default_rng(0).standard_normal((100, 8)).astype(np.float32)
    table[37, 3] = bad
    with pytest.raises(ValueError, match="non-finite"):
        ftt.from_dense(table, ftt.TTSpec.create(100, 8, 4), on_device=on_device)
    # parameters as shapes (no init program): the table is refused before they are read
    coll = nnx.eval_shape(
        lambda: TTEmbeddingCollection([TableConfig("user", 100, 8, rank=4)], rngs=nnx.Rngs(0))
    )
    with pytest.raises(ValueError, match="table 'user': from_dense: the table has non-finite"):
        coll.from_dense("user", table, on_device=on_device)


@pytest.mark.parametrize("budget", [float("nan"), float("inf"), None, "1GB"])
def test_plan_tables_validates_its_budget(budget):
    with pytest.raises(ValueError, match="budget_bytes must be a finite number of bytes"):
        ftt.plan_tables([TableConfig("t", 10_000, 8)], budget)


def test_load_table_takes_a_dense_array_and_names_the_shapes():
    coll = TTEmbeddingCollection(
        [TableConfig("user", 100, 8, rank=4), TableConfig("country", 20, 8, kind="dense")], rngs=nnx.Rngs(0)
    )
    table = np.arange(160, dtype=np.float32).reshape(20, 8)
    coll.load_table("country", table)  # the array itself, as docs/layers.md says
    np.testing.assert_array_equal(np.asarray(coll.table("country")), table)
    coll.load_table("country", (table + 1,))
    np.testing.assert_array_equal(np.asarray(coll.table("country")), table + 1)
    with pytest.raises(
        ValueError, match=r"table 'country' \(dense\) takes its \[N, D\] array of shapes \[\(20, 8\)\]"
    ):
        coll.load_table("country", table[:10])
    with pytest.raises(ValueError, match="table 'user' \\(tt\\) takes a tuple of its 3 cores"):
        coll.load_table("user", table)


def test_load_table_state_refuses_non_finite_tables():
    """A checkpoint holding NaN or inf is refused naming the table (nothing loaded), unless
    ``allow_nonfinite``."""
    tables = [TableConfig("user", 100, 8, rank=4), TableConfig("country", 20, 8, kind="dense")]
    src = TTEmbeddingCollection(tables, rngs=nnx.Rngs(0))
    dst = TTEmbeddingCollection(tables, rngs=nnx.Rngs(1))
    state = src.table_state()
    state["country"] = (state["country"][0].at[3, 1].set(jnp.inf),)
    before = np.asarray(dst.to_dense("user"))
    with pytest.raises(ValueError, match=r"tables \['country'\] hold NaN or inf values"):
        dst.load_table_state(state)
    np.testing.assert_array_equal(np.asarray(dst.to_dense("user")), before)  # nothing loaded
    dst.load_table_state(state, allow_nonfinite=True)
    assert np.isinf(np.asarray(dst.table("country"))[3, 1])
    np.testing.assert_array_equal(np.asarray(dst.to_dense("user")), np.asarray(src.to_dense("user")))


def test_per_table_optimizer_labels_drive_multi_transform():
    """``TableConfig.optimizer`` labels: tables of different labels never share an array, and
    ``optax.multi_transform(..., coll.param_labels())`` updates each table by its own label's
    transformation (nnx, and linen's params dict); the model's other leaves take the default."""
    import optax

    from flowtt_jax import linen as ftt_linen

    tables = [
        TableConfig("user", 1000, 8, rank=4, optimizer="frozen"),
        TableConfig("item", 1000, 8, rank=4),  # the same TT shapes: would share a pack unlabelled
        TableConfig("d", 30, 8, kind="dense", optimizer="frozen"),
        TableConfig("d2", 30, 8, kind="dense"),
    ]
    with pytest.raises(TypeError, match="table 'x': optimizer must be a non-empty str"):
        TableConfig("x", 10, 8, optimizer=3)

    class Model(nnx.Module):
        def __init__(self):
            self.emb = TTEmbeddingCollection(tables, rngs=nnx.Rngs(0))
            self.head = nnx.Linear(8, 1, rngs=nnx.Rngs(1))

        def __call__(self, f):
            return self.head(sum(self.emb(f).values()))

    model = Model()
    assert len(model.emb.layout.packs) == 4  # user / item and d / d2 apart
    tx = optax.multi_transform(
        {"frozen": optax.set_to_zero(), "default": optax.sgd(0.1)}, model.emb.param_labels()
    )
    opt = nnx.Optimizer(model, tx, wrt=nnx.Param)
    feats = {"user": np.arange(4), "item": np.arange(4) + 7, "d": np.arange(4), "d2": np.arange(4)}

    def tables_now():  # each table's first array, sliced on the host
        values = jax.tree.map(np.asarray, model.emb._values())
        return {name: model.emb.layout.table_params(values, name)[0] for name in ("user", "item", "d", "d2")}

    before = tables_now()
    head = np.asarray(model.head.kernel[...])

    @nnx.jit  # one program, not op by op
    def train_step(model, opt):
        opt.update(model, nnx.grad(lambda m: jnp.sum(m(feats) ** 2))(model))

    train_step(model, opt)
    after = tables_now()
    for name in ("user", "d"):
        np.testing.assert_array_equal(after[name], before[name])
    for name in ("item", "d2"):
        assert not np.array_equal(after[name], before[name]), name
    assert not np.array_equal(np.asarray(model.head.kernel[...]), head)

    layer = ftt_linen.TTEmbeddingCollection(tables)
    params = jax.jit(layer.init)(jax.random.key(0), feats)["params"]  # one program, not op by op
    labels = layer.param_labels()({"params": params, "other": jnp.zeros(3)})
    by_name = {n: labels["params"][n] for n in params}
    assert labels["other"] == "default"
    assert sorted(set(by_name.values())) == ["default", "frozen"]
    assert sum(v == "frozen" for v in by_name.values()) == 4  # user's 3 cores + d's table


@pytest.mark.parametrize("form", ["csr", "padded_mask", "kjt", "stacked", "lookup"])
def test_out_of_range_ids_are_counted_per_table_by_default(form):
    """Every collection counts, per table and on the device, the ids out of its range (the
    default ``oob="zero"`` keeps its values: the count is all that changes); ids in no bag
    (a KeyedJagged's tail, masked-out ids) are not counted; nnx under ``nnx.jit`` and linen's
    ``stats``."""
    from flowtt_jax import KeyedJagged
    from flowtt_jax import linen as ftt_linen

    tables = [
        TableConfig("a", 100, 8, rank=4),
        TableConfig("b", 50, 8, rank=4, feature_names=("b1", "b2")),
        TableConfig("d", 20, 8, kind="dense"),
    ]
    coll = TTEmbeddingCollection(tables, rngs=nnx.Rngs(0))
    assert coll.out_of_range() == {"a": 0, "b": 0, "d": 0}
    ids = {"a": [3, 100, -1, 99], "b1": [0, 49, 50, 7], "b2": [1, 2, 3, 4], "d": [19, 20, 5, 6]}
    want = {"a": 2, "b": 1, "d": 1}
    if form == "csr":
        feats = {f: {"ids": np.asarray(v), "offsets": np.asarray([0, 2, 4])} for f, v in ids.items()}
    elif form == "padded_mask":
        feats = {
            f: {"ids": np.asarray(v).reshape(2, 2), "mask": np.ones((2, 2), bool)} for f, v in ids.items()
        }
        feats["a"]["mask"] = np.asarray([[True, False], [True, True]])  # the masked 100: not counted
        want = {**want, "a": 1}
    elif form == "kjt":
        flat = np.concatenate([ids[f] for f in coll.feature_names] + [[555, -9]])  # a tail in no bag
        feats = KeyedJagged(flat, lengths=np.full((4, 2), 2))
    elif form == "stacked":
        feats = np.stack([np.asarray(ids[f]).reshape(2, 2) for f in coll.feature_names], axis=1)
    else:
        feats = {f: np.asarray(v).reshape(2, 2) for f, v in ids.items()}
    call = nnx.jit(lambda m, x: m(x, pooled=form != "lookup"))
    out = call(coll, feats)
    assert coll.out_of_range() == want
    call(coll, feats)
    assert coll.out_of_range() == {k: 2 * v for k, v in want.items()}
    reference = TTEmbeddingCollection(tables, rngs=nnx.Rngs(0))
    ref_call = jax.jit(lambda v, x: reference.layout.call(v, x, pooled=form != "lookup"))  # not op by op
    for x, y in zip(jax.tree.leaves(out), jax.tree.leaves(ref_call(reference._values(), feats))):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))  # the values oob="zero" gives
    if form == "csr":  # linen's, each a program, not op by op
        layer = ftt_linen.TTEmbeddingCollection(tables)
        variables = jax.jit(layer.init)(jax.random.key(0), feats)
        np.testing.assert_array_equal(np.asarray(variables["stats"]["out_of_range_counts"]), [0, 0, 0])
        _, stats = jax.jit(lambda v, x: layer.apply(v, x, mutable=["stats"]))(variables, feats)
        np.testing.assert_array_equal(np.asarray(stats["stats"]["out_of_range_counts"]), [2, 1, 1])


@pytest.mark.parametrize("jit", [True, False])
def test_checked_takes_nnx_grad_and_an_optimizer_step(jit):
    """``ftt.checked`` around a training step that uses ``nnx.grad`` and updates the model
    and its optimizer in place: the step runs (checks on), its updates are written back (the
    same parameters as the unchecked ``nnx.jit`` step), and a bad id raises naming the feature."""
    import optax
    from jax.experimental import checkify

    tables = [TableConfig("a", 100, 8, rank=4), TableConfig("d", 20, 8, kind="dense")]

    def make(oob):
        coll = TTEmbeddingCollection(tables, oob=oob, rngs=nnx.Rngs(0))
        return coll, nnx.Optimizer(coll, optax.sgd(0.1), wrt=nnx.Param)

    def step(model, opt, feats):
        loss, grads = nnx.value_and_grad(lambda m: sum(jnp.sum(v**2) for v in m(feats).values()))(model)
        opt.update(model, grads)
        return loss

    feats = {"a": np.array([1, 2, 99]), "d": np.array([0, 19, 5])}
    model, opt = make("error")
    twin, twin_opt = make("zero")  # valid ids: the same step, unchecked
    loss = ftt.checked(step, jit=jit)(model, opt, feats)
    want = nnx.jit(step)(twin, twin_opt, feats)
    np.testing.assert_array_equal(np.asarray(loss), np.asarray(want))
    for name in ("a", "d"):
        np.testing.assert_array_equal(np.asarray(model.to_dense(name)), np.asarray(twin.to_dense(name)))
    assert int(opt.step[...]) == 1
    with pytest.raises(checkify.JaxRuntimeError, match="found 100 in table #0"):
        ftt.checked(step, jit=jit)(model, opt, {**feats, "a": np.array([1, 100, 3])})
    with pytest.raises(ValueError, match="jit options"):
        ftt.checked(step, donate_argnums=0)(model, opt, feats)
