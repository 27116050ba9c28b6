"""``plan_tables``: the plan fits its budget as ``estimate_memory`` counts it, emits no shape
the kernels refuse, is deterministic, errors with the bytes the smallest plan needs, keeps
small tables dense, spends rank where the traffic is, and builds a working collection; the
skew model it uses; the synthetic data's per-feature knobs (defaults: the same data)."""

from __future__ import annotations

import hashlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import flowtt_jax as ftt
from flowtt_jax import planner
from flowtt_jax.collection import TableConfig
from flowtt_jax.collection.config import SparseUpdate
from flowtt_jax.kernels import ffi
from flowtt_jax.memory import BatchStats, estimate_memory
from flowtt_jax.ops.pooled import kernels_unsupported_reason

CARDS = {"big": 300_000, "mid": 40_000, "flat": 40_000, "small": 1_000, "tiny": 3}


def _zipf_ids(rng: np.random.Generator, rows: int, a: float, shape) -> np.ndarray:
    p = np.arange(1, rows + 1, dtype=np.float64) ** -a
    return rng.choice(rows, size=shape, p=p / p.sum()).astype(np.int32)


@pytest.fixture(scope="module")
def sample():
    """One batch of 512 examples: ``flat`` read uniformly, the rest Zipf(1.2); stats of it."""
    rng = np.random.default_rng(0)
    batch = {n: _zipf_ids(rng, r, 0.0 if n == "flat" else 1.2, (512,)) for n, r in CARDS.items()}
    tables = [TableConfig(n, r, 16) for n, r in CARDS.items()]
    return batch, BatchStats.measure([batch], tables)


# ----------------------------------------------------------------------------- skew model
@pytest.mark.parametrize("a", [0.6, 1.2, 1.6])
def test_fit_zipf_recovers_the_exponent(a):
    rng = np.random.default_rng(1)
    ids = _zipf_ids(rng, 50_000, a, 4096)
    fitted = planner.fit_zipf(50_000, ids.size, int(np.unique(ids).size))
    assert abs(fitted - a) < 0.1, fitted


def test_zipf_coverage():
    assert planner.zipf_coverage(1000, 0.0, 250) == pytest.approx(0.25)
    assert planner.zipf_coverage(10**7, 1.2, 10**7) == 1.0
    cov = [planner.zipf_coverage(10**7, 1.2, k) for k in (10, 1000, 10**5)]
    assert 0 < cov[0] < cov[1] < cov[2] < 1
    # the tail integral meets the exact sum: 10^4 rows summed exactly agree within 1e-4
    exact = np.arange(1, 10_001, dtype=np.float64) ** -1.2
    assert planner.zipf_coverage(10_000, 1.2, 5000) == pytest.approx(
        exact[:5000].sum() / exact.sum(), abs=1e-4
    )
    assert planner.fit_zipf(1000, 500, 500) == 0.0  # every id unique: no skew to see


# ----------------------------------------------------------------------------- the plan
@pytest.mark.parametrize("budget_mib", [1.5, 4, 40])
def test_plan_fits_the_budget_as_estimated(sample, budget_mib):
    _, stats = sample
    adam = optax.adam(1e-3)
    budget = int(budget_mib * 2**20)
    plan = ftt.plan_tables(CARDS, budget, dim=16, stats=stats, optimizer=adam)
    est = estimate_memory(plan.tables, stats, optimizer=adam)
    assert est == plan.estimate and est.total <= budget
    assert est.optimizer_state > 0 and est.activation_bytes > 0
    assert [t.name for t in plan.tables] == list(CARDS)
    for t, c in zip(plan.tables, plan.choices):
        assert (t.name, t.kind) == (c.name, c.kind)
        alone = estimate_memory(
            [t], stats.__class__(stats.batch_size, {t.name: stats.ids[t.name]}), optimizer=adam
        )
        assert c.parameter_bytes == alone.parameters and c.optimizer_bytes == alone.optimizer_state
    assert sum(c.parameter_bytes for c in plan.choices) == est.parameters
    text = str(plan)
    assert all(name in text for name in CARDS) and "total" in text


def test_budget_without_stats_counts_parameters_only():
    plan = ftt.plan_tables([200_000, 50_000], 200_000, dim=32, training=False)
    assert plan.estimate.total == plan.estimate.parameters <= 200_000
    assert [t.name for t in plan.tables] == ["t0", "t1"]
    # uniform access, no sample: the smaller table holds more of its rows per byte
    assert plan.choices[1].coverage > plan.choices[0].coverage


def test_more_budget_more_bytes_until_everything_is_dense(sample):
    _, stats = sample
    totals = [
        ftt.plan_tables(
            CARDS, b << 20, dim=16, traffic=stats, training=False, step_slack=None
        ).parameter_bytes
        for b in (1, 4, 16)
    ]
    assert totals == sorted(totals) and totals[0] < totals[-1]
    everything = ftt.plan_tables(CARDS, 2**30, dim=16, traffic=stats, training=False, step_slack=None)
    assert all(t.kind == "dense" for t in everything.tables)


def test_deterministic(sample):
    _, stats = sample
    plans = [
        ftt.plan_tables(CARDS, 3 << 20, dim=16, stats=stats, optimizer=optax.adagrad(0.1)) for _ in range(2)
    ]
    assert plans[0] == plans[1] and str(plans[0]) == str(plans[1])


def test_no_plan_fits_names_the_bytes_needed(sample):
    _, stats = sample
    with pytest.raises(ValueError, match="no plan fits 1,000 bytes") as err:
        ftt.plan_tables(CARDS, 1000, dim=16, stats=stats)
    msg = str(err.value)
    needed = int(re.search(r"needs ([\d,]+) bytes", msg).group(1).replace(",", ""))
    assert "largest tables alone: " in msg and "big (" in msg
    assert ftt.plan_tables(CARDS, needed, dim=16, stats=stats).total <= needed  # exactly enough
    with pytest.raises(ValueError, match=f"needs {needed:,} bytes"):
        ftt.plan_tables(CARDS, needed - 1, dim=16, stats=stats)


def test_small_tables_dense(sample):
    _, stats = sample
    plan = {
        c.name: c
        for c in ftt.plan_tables(CARDS, 600_000, dim=16, stats=stats, step_slack=None, cache=False).choices
    }
    assert plan["tiny"].kind == "dense" and "tiny" in plan["tiny"].note
    assert plan["small"].kind == "dense" and "dense_below" in plan["small"].note
    assert plan["big"].kind == "tt"
    # without the small-table rule the 1,000-row table competes on hits per byte: TT here
    tight = ftt.plan_tables(CARDS, 600_000, dim=16, stats=stats, dense_below=0, step_slack=None, cache=False)
    assert {c.name: c.kind for c in tight.choices}["small"] == "tt"
    # and with it, a budget too small for the dense table leaves it TT, saying so
    small = {
        c.name: c for c in ftt.plan_tables(CARDS, 520_000, dim=16, stats=stats, step_slack=None).choices
    }["small"]
    assert small.kind == "tt" and "dense did not fit" in small.note


def test_rank_follows_traffic():
    """Two tables alike but for their ids per batch (1 and 4 per example, one skew): the
    busier one's rank is at least the other's at every budget, and higher at some."""
    rng = np.random.default_rng(2)
    tables = [TableConfig("quiet", 200_000, 16), TableConfig("busy", 200_000, 16)]
    batch = {"quiet": _zipf_ids(rng, 200_000, 1.1, (1024,)), "busy": _zipf_ids(rng, 200_000, 1.1, (1024, 4))}
    stats = BatchStats.measure([batch], tables)
    ahead = False
    for budget in (60_000, 120_000, 250_000, 500_000, 1_000_000):
        ranks = {
            c.name: c.rank
            for c in ftt.plan_tables(
                tables, budget, traffic=stats, training=False, step_slack=None, cache=False
            ).choices
        }
        assert ranks["busy"] >= ranks["quiet"], (budget, ranks)
        ahead |= ranks["busy"] > ranks["quiet"]
    assert ahead


def test_rank_goes_to_the_flatter_table(sample):
    """Same rows, same ids: a skewed table's few hot rows hold most of its lookups, so past
    them its rank buys less than the uniformly read table's."""
    _, stats = sample
    plan = ftt.plan_tables(
        CARDS, 600_000, dim=16, traffic=stats, training=False, step_slack=None, cache=False
    )
    choices = {c.name: c for c in plan.choices}
    assert choices["flat"].zipf_a + 0.5 < 1.0 < choices["mid"].zipf_a
    assert choices["flat"].rank > choices["mid"].rank
    assert choices["flat"].coverage < choices["mid"].coverage


def test_emits_no_shape_the_kernels_refuse(sample, monkeypatch):
    _, stats = sample
    plan = ftt.plan_tables(CARDS, 8 << 20, dim=16, stats=stats, step_slack=None)
    for t in plan.tables:
        if t.kind == "tt":
            shapes = t.spec().core_shapes
            assert kernels_unsupported_reason([jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes]) is None
            assert ffi.cuda_unsupported_reason(shapes) is None
            assert ffi.cuda_unsupported_reason(shapes, True) is None
    assert max(max(np.atleast_1d(t.rank)) for t in plan.tables if t.kind == "tt") > 16
    if not ffi.available():
        assert any("not built" in n for n in plan.notes)
        return
    # a platform whose kernels take r2 <= 16 only: no emitted rank above 16, and the plan says so
    refuse = lambda cores: "r2 > 16" if cores[0].shape[3] > 16 else None
    monkeypatch.setattr(planner, "kernels_unsupported_reason", refuse)
    limited = ftt.plan_tables(CARDS, 8 << 20, dim=16, stats=stats, step_slack=None)
    assert all(t.rank <= 16 for t in limited.tables if t.kind == "tt")
    assert "rank 32 dropped: r2 > 16" in {c.name: c for c in limited.choices}["big"].note
    monkeypatch.setattr(planner, "kernels_unsupported_reason", lambda cores: "no TT here")
    assert all(
        t.kind == "dense" for t in ftt.plan_tables(CARDS, 2**30, dim=16, stats=stats, step_slack=None).tables
    )


def test_plan_builds_a_collection(sample):
    batch, stats = sample
    plan = ftt.plan_tables(CARDS, 2 << 20, dim=16, stats=stats, optimizer=optax.adam(1e-3))
    assert {t.kind for t in plan.tables} == {"tt", "dense"}
    coll = nnx.eval_shape(lambda: ftt.nnx.TTEmbeddingCollection(plan.tables, rngs=nnx.Rngs(0)))
    params = nnx.state(coll, (nnx.Param, ftt.nnx.HotIds))  # hot-row caches: their rows and ids
    assert sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params)) == plan.parameter_bytes
    coll = ftt.nnx.TTEmbeddingCollection(plan.tables, rngs=nnx.Rngs(0))
    out = nnx.jit(lambda m, x: m(x))(coll, {k: jnp.asarray(v) for k, v in batch.items()})
    assert {k: v.shape for k, v in out.items()} == {k: (512, 16) for k in CARDS}
    assert all(np.isfinite(np.asarray(v)).all() for v in out.values())


def test_table_configs_in_keep_their_fields():
    tables = [
        TableConfig("u", 100_000, 8, mode="mean", feature_names=("a", "b"), max_unique_ids=640),
        TableConfig("v", 50, 8),
    ]
    plan = ftt.plan_tables(tables, 10**6, training=False)
    u = plan.tables[0]
    assert (u.mode, u.feature_names, u.max_unique_ids, u.features) == ("mean", ("a", "b"), 640, 8)
    with pytest.raises(ValueError, match="another dim"):
        ftt.plan_tables(tables, 10**6, dim=16)
    with pytest.raises(TypeError, match="dim="):
        ftt.plan_tables([100, 200], 10**6)


# ----------------------------------------------------------------------------- the data
def _digest(batch) -> str:
    h = hashlib.sha256()
    for a in batch:
        h.update(np.ascontiguousarray(np.asarray(a)).tobytes())
    return h.hexdigest()


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="digests recorded on CPU")
def test_synth_defaults_are_the_same_data():
    """sha256 of batches recorded from ``criteo_synth.py`` before ``feature_zipf_a`` and
    ``feature_signal`` existed (commit 1d6c60b)."""
    from examples.criteo_synth import SynthConfig, SynthCriteo

    assert _digest(SynthCriteo(SynthConfig()).batch(3, 256, 0)) == (
        "dd35b0b8b20a6867543507452eb17128e997811ac5c521fd57da402248cc101f"
    )
    other = SynthCriteo(SynthConfig(max_rows=1000, zipf_a=1.05, seed=3))
    assert (
        _digest(other.batch(7, 256, 1)) == "e8f938fd883934e00017c240bf30200ad3081868632a4a8afbc35955be55baa5"
    )


def test_synth_per_feature_skew_and_signal():
    from examples.criteo_synth import SynthConfig, SynthCriteo

    cards = (100_000,) * 4
    skewed = SynthCriteo(SynthConfig(cards, feature_zipf_a=(0.5, 1.05, 1.3, 2.0)))
    ids = np.asarray(skewed.batch(0, 2048)[1])
    unique = [np.unique(ids[:, f]).size for f in range(4)]
    assert unique == sorted(unique, reverse=True) and unique[0] > 4 * unique[-1]
    base = SynthCriteo(SynthConfig(cards)).batch(0, 512)
    ones = SynthCriteo(SynthConfig(cards, feature_signal=(1.0,) * 4)).batch(0, 512)
    assert _digest(ones) == _digest(base)  # weight 1 is the default teacher
    silent = SynthCriteo(SynthConfig(cards, feature_signal=(0.0,) * 4, dense_scale=0.0)).batch(0, 512)
    np.testing.assert_allclose(np.asarray(silent[3]), -1.5)  # no signal left: the bias alone
    with pytest.raises(ValueError, match="one value per feature"):
        SynthConfig(cards, feature_signal=(1.0,))


def test_more_budget_never_buys_a_much_slower_step():
    """The planner knows time: on a two-tower-like set (a 2 M-row table read by two
    features), plans over budgets from 4 MiB to 1 GiB keep the modelled step within
    ``STEP_SLACK`` of the fastest smaller budget's (the 2 M-row table stays TT, saying why);
    with ``step_slack=None`` the 1 GiB plan makes it dense and its modelled step is many
    times slower; with ``dense_update`` (sparse updates) it may be dense at no such cost."""
    rng = np.random.default_rng(4)
    tables = [
        TableConfig("user", 500_000, 32),
        TableConfig("item", 2_000_000, 32, feature_names=("item", "hist")),
        TableConfig("country", 200, 32),
    ]
    batch = {
        "user": _zipf_ids(rng, 500_000, 1.05, (512,)),
        "item": _zipf_ids(rng, 2_000_000, 1.05, (512,)),
        "hist": _zipf_ids(rng, 2_000_000, 1.05, (512, 20)),
        "country": rng.integers(0, 200, 512),
    }
    stats = BatchStats.measure([batch], tables)
    steps, fastest = [], None
    for mib in (4, 16, 64, 256, 1024):
        plan = ftt.plan_tables(tables, mib << 20, stats=stats, optimizer=optax.adam(1e-3))
        fastest = plan.step_cost if fastest is None else min(fastest, plan.step_cost)
        assert plan.step_cost <= (1 + ftt.planner.STEP_SLACK) * fastest, (mib, plan.step_cost, fastest)
        steps.append(plan.step_cost)
    big = {c.name: c for c in plan.choices}["item"]
    assert big.kind == "tt" and "slow the step" in big.note
    bytes_only = ftt.plan_tables(tables, 1 << 30, stats=stats, optimizer=optax.adam(1e-3), step_slack=None)
    assert {t.name: t.kind for t in bytes_only.tables}["item"] == "dense"
    assert bytes_only.step_cost > 10 * min(steps)
    sparse = ftt.plan_tables(
        tables, 1 << 30, stats=stats, optimizer=optax.adam(1e-3), dense_update=SparseUpdate("rowwise_adagrad")
    )
    dense_sparse = [t for t in sparse.tables if t.kind == "dense"]
    assert dense_sparse and all(t.sparse == SparseUpdate("rowwise_adagrad") for t in dense_sparse)
    assert sparse.step_cost <= (1 + ftt.planner.STEP_SLACK) * min(steps)


def test_tables_are_checked_up_front():
    """Duplicate table names and a feature read by two tables are refused by the planner,
    naming them, not later by the collection."""
    with pytest.raises(ValueError, match=r"plan_tables: duplicate table names in \['a', 'a'\]"):
        ftt.plan_tables([TableConfig("a", 100, 8), TableConfig("a", 200, 8)], 10**6)
    with pytest.raises(ValueError, match="plan_tables: a feature reads more than one table"):
        ftt.plan_tables([TableConfig("a", 100, 8), TableConfig("b", 200, 8, feature_names=("a",))], 10**6)


def test_cache_goes_to_the_skewed_table():
    """Same rows, same ids: the Zipf(1.2) table's hottest rows hold most of its lookups, so
    its cache comes before the uniformly read table's (which gets none at a small budget);
    the report says what the cache holds; ``cache=False`` and a plan without a traffic
    sample hold none; the plan builds a collection of its bytes."""
    rng = np.random.default_rng(0)
    tables = [TableConfig("skewed", 400_000, 16), TableConfig("flat", 400_000, 16)]
    batch = {"skewed": _zipf_ids(rng, 400_000, 1.2, (2048,)), "flat": rng.integers(0, 400_000, (2048,))}
    stats = BatchStats.measure([batch], tables)
    plan = ftt.plan_tables(tables, 300_000, traffic=stats, training=False, step_slack=None)
    choice = {c.name: c for c in plan.choices}
    assert choice["skewed"].cache_rows > 0 and choice["flat"].cache_rows == 0, plan
    assert "hottest rows hold" in choice["skewed"].note and choice["skewed"].coverage > 0.8
    assert [t.cache_rows for t in plan.tables] == [choice["skewed"].cache_rows, 0]
    for budget in (1_000_000, 3_000_000):
        c = {c.name: c for c in ftt.plan_tables(tables, budget, traffic=stats, training=False).choices}
        assert c["skewed"].cache_rows >= c["flat"].cache_rows
    off = ftt.plan_tables(tables, 300_000, traffic=stats, training=False, step_slack=None, cache=False)
    assert all(t.cache_rows == 0 for t in off.tables)
    assert all(t.cache_rows == 0 for t in ftt.plan_tables(tables, 300_000, training=False).tables)
    coll = nnx.eval_shape(lambda: ftt.nnx.TTEmbeddingCollection(plan.tables, rngs=nnx.Rngs(0)))
    params = nnx.state(coll, (nnx.Param, ftt.nnx.HotIds))
    assert sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params)) == plan.parameter_bytes
