"""Property-based tests (hypothesis): the ops against the float64 oracle of
``tests/test_fuzz_corpus.py`` on drawn tables, ids, bags, weights, dtypes and policies.

Profiles (``FLOWTT_HYPOTHESIS_PROFILE``): ``ci`` (default: a few derandomized examples
per property, the fuzz and policy files together in about 3 minutes on 2 CPU cores)
and ``gpu`` (hundreds of examples, random, for the device run:
``FLOWTT_HYPOTHESIS_PROFILE=gpu python -m pytest tests/test_fuzz.py tests/test_fuzz_corpus.py``).
No example database is written (``database=None``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import flowtt_jax as ftt  # noqa: E402
from tests.test_fuzz_corpus import (  # noqa: E402
    DIMS,
    ID_PATTERNS,
    INT_DTYPES,
    ROWS,
    compare,
    fit_dtype,
    make_case,
    make_cores,
    oracle,
    run,
)

pytestmark = pytest.mark.slow  # long property runs: CI runs them (-m slow --slow)


PROFILE = os.environ.get("FLOWTT_HYPOTHESIS_PROFILE", "ci")
_COMMON = dict(deadline=None, database=None, suppress_health_check=list(HealthCheck))
settings.register_profile("ci", derandomize=True, **_COMMON)
settings.register_profile("gpu", **_COMMON)
settings.load_profile(PROFILE)


def examples(ci: int, gpu: int):
    """``settings(max_examples=...)`` for the active profile."""
    return settings(max_examples=gpu if PROFILE == "gpu" else ci)


def _ids_list(rows: int, n: int):
    """Drawn ids: in range, boundary and just out of range, with repeats."""
    edge = st.sampled_from([-1, 0, rows - 1, rows, max(rows - 2, 0)])
    return st.lists(st.integers(-2, rows + 2) | edge, min_size=n, max_size=n)


@st.composite
def cases(draw, kinds=("bag", "lookup")):
    kind = draw(st.sampled_from(kinds))
    rows = draw(st.sampled_from(ROWS) | st.integers(1, 10**7))
    dim = draw(st.sampled_from(DIMS))
    rank = draw(st.integers(1, 64))
    n = draw(st.sampled_from([0, 1, 2, 31, 32, 33, 64, 257]) | st.integers(0, 300))
    pattern = draw(st.sampled_from(ID_PATTERNS + ("drawn",)))
    case = make_case(
        draw(st.integers(0, 2**20)),
        kind=kind,
        rows=rows,
        dim=dim,
        rank=rank,
        pattern="uniform" if pattern == "drawn" else pattern,
        n=n,
        bags=draw(st.sampled_from([0, 1, 2, 5, n // 3 + 1, n + 3])),
        weights=draw(st.sampled_from(["none", "normal", "zeros", "negative", "all_zero"])),
        dtype=draw(st.sampled_from(INT_DTYPES)),
        mode=draw(st.sampled_from(["sum", "mean", "sqrtn"])),
        oob=draw(st.sampled_from(["zero", "clip"])),
    )
    if pattern == "drawn" and n:
        limit = min(case.specs[0].num_embeddings, *(s.num_embeddings for s in case.specs))
        ids = np.asarray(draw(_ids_list(limit, n)), np.int64)
        case = dataclasses.replace(case, ids=fit_dtype(ids, str(case.ids.dtype)))
    return case


def _check(case, impl):
    cores = make_cores(case)
    bad = compare(run(case, impl, cores), oracle(case, cores))
    assert not bad, (impl, case.describe(), bad)


@examples(ci=5, gpu=300)
@given(case=cases(), impl=st.sampled_from(["auto", "auto", "reference"]))
def test_single_table_ops_match_the_oracle(case, impl):
    """tt_embedding_bag / tt_lookup, forward (training and no-gradient) and gradients
    (cores and weights): the kernels (``auto``) and the reference."""
    _check(case, impl)


@examples(ci=2, gpu=100)
@given(case=cases(kinds=("group",)), impl=st.sampled_from(["auto", "reference"]))
def test_table_batched_op_matches_the_oracle(case, impl):
    """tt_embedding_bag_group over two tables (a feature each and a shared one)."""
    _check(case, impl)


def _dense_rows(cores, ids) -> np.ndarray:
    """Rows of any number of cores, float64, by the definition (mixed radix, chained)."""
    shape = [c.shape[0] for c in cores]
    digits, rem = [], np.asarray(ids, np.int64)
    for p in reversed(shape):
        digits.append(rem % p)
        rem = rem // p
    digits = digits[::-1]
    acc = np.asarray(cores[0], np.float64)[digits[0], 0]  # [n, Q, r]
    for c, i in zip(cores[1:], digits[1:]):
        acc = np.einsum("nQr,nrqs->nQqs", acc, np.asarray(c, np.float64)[i])
        acc = acc.reshape(acc.shape[0], -1, acc.shape[-1])
    return acc[..., 0]


@examples(ci=3, gpu=100)
@given(
    num_cores=st.sampled_from([2, 4]),
    rows=st.integers(1, 20000),
    dim=st.sampled_from([1, 6, 7, 13, 16]),
    rank=st.integers(1, 9),
    seed=st.integers(0, 2**20),
    mode=st.sampled_from(["sum", "mean", "sqrtn"]),
)
def test_reference_with_two_or_four_cores(num_cores, rows, dim, rank, seed, mode):
    spec = ftt.TTSpec.create(rows, dim, rank, num_cores=num_cores)
    cores = ftt.init_cores(jax.random.key(seed), spec, std=1.0)
    rng = np.random.default_rng(seed)
    n = int(rng.integers(0, 50))
    ids = rng.integers(-1, rows + 1, n)
    offsets = np.concatenate([[0], np.sort(rng.integers(0, n + 1, 4)), [n]]).astype(np.int32)
    weights = rng.standard_normal(n).astype(np.float32) * (rng.random(n) < 0.8)
    out = ftt.tt_embedding_bag(cores, ids, offsets=offsets, weights=weights, mode=mode, num_embeddings=rows)
    valid = (ids >= 0) & (ids < rows)
    rows_ = _dense_rows(cores, np.clip(ids, 0, rows - 1)) * (valid * weights)[:, None]
    bag = np.searchsorted(offsets, np.arange(n), side="right") - 1
    lengths = np.maximum(np.diff(offsets), 1)
    scale = {"sum": np.ones(5), "mean": 1 / lengths, "sqrtn": 1 / np.sqrt(lengths)}[mode]
    want = np.zeros((5, spec.embedding_dim))
    np.add.at(want, bag, rows_ * scale[bag][:, None])
    np.testing.assert_allclose(np.asarray(out), want, rtol=1e-4, atol=1e-4 * max(1.0, np.abs(want).max()))


@examples(ci=4, gpu=200)
@given(
    dtype=st.sampled_from(INT_DTYPES),
    values=st.lists(st.integers(-(2**40), 2**40) | st.integers(-3, 1003), min_size=1, max_size=20),
    oob=st.sampled_from(["zero", "clip", "error"]),
)
def test_every_integer_dtype_follows_the_policy(dtype, values, oob):
    """Host ids of every dtype (values wrapped into it by numpy first, as a user's cast
    would): the rows of the ids' true values under the policy, never a wrapped id."""
    ids = np.asarray(values, np.int64).astype(dtype)
    true = ids.tolist()  # Python ints: the values the ids hold
    spec = ftt.TTSpec.create(1000, 8, 4, row_shape=(10, 10, 10))
    cores = ftt.init_cores(jax.random.key(3), spec, std=1.0)
    valid = np.asarray([0 <= v < 1000 for v in true])
    if oob == "error" and not valid.all():
        with pytest.raises(ValueError, match="out of range|do not fit"):
            ftt.tt_lookup(cores, ids, oob=oob)
        return
    got = np.asarray(ftt.tt_lookup(cores, ids, oob=oob))
    clipped = np.asarray([min(max(v, 0), 999) for v in true], np.int64)
    want = _dense_rows(cores, clipped)
    if oob == "zero":
        want = want * valid[:, None]
    assert math.isclose(np.abs(got - want).max(initial=0.0), 0.0, abs_tol=1e-5)


@st.composite
def collection_cases(draw):
    """A collection (TT tables of 3 or 2 cores, dense tables; features sharing tables) and
    one input per feature in a drawn form: one id, padded (mask, weights), CSR (empty bags,
    weights) or segment ids (any order, dropped segments); ids partly out of range."""
    from flowtt_jax.collection import TableConfig

    dim = draw(st.sampled_from([4, 16]))
    batch = draw(st.sampled_from([1, 3, 8]))
    rng = np.random.default_rng(draw(st.integers(0, 2**20)))
    tables, features = [], {}
    for t in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["tt", "tt", "dense"]))
        rows = draw(st.sampled_from([1, 2, 7, 100, 1000]) | st.integers(1, 10**6))
        rows = min(rows, 5000) if kind == "dense" else rows
        names = tuple(f"t{t}f{j}" for j in range(draw(st.integers(1, 2))))
        tables.append(
            TableConfig(
                f"t{t}",
                rows,
                dim,
                kind=kind,
                rank=draw(st.sampled_from([2, 4])),
                mode=draw(st.sampled_from(["sum", "mean", "sqrtn"])),
                feature_names=names,
                num_cores=draw(st.sampled_from([3, 3, 3, 2])),
            )
        )
        for name in names:
            b = draw(st.sampled_from([batch, batch, 5]))  # some features of another batch
            form = draw(st.sampled_from(["one", "padded", "csr", "segments"]))
            length = draw(st.integers(0, 4))  # 0: a feature without ids (padded, CSR)
            n = b if form == "one" else b * length
            ids = rng.integers(-2, rows + 2, n)
            ids[rng.random(n) < 0.25] = rows - 1  # the table's last row
            weights = rng.standard_normal(n).astype(np.float32) if draw(st.booleans()) else None
            if form == "one":
                features[name] = ids if weights is None else {"ids": ids, "weights": weights}
            elif form == "padded":
                x = {"ids": ids.reshape(b, length)}
                if draw(st.booleans()):
                    x["mask"] = rng.random((b, length)) < 0.7
                if weights is not None:
                    x["weights"] = weights.reshape(b, length)
                features[name] = x
            elif form == "csr":
                cuts = np.sort(rng.integers(0, n + 1, b - 1))
                features[name] = {"ids": ids, "offsets": np.concatenate([[0], cuts, [n]]), "weights": weights}
            else:
                seg = rng.integers(-1, b + 1, n)  # -1 and b: dropped
                features[name] = {"ids": ids, "segment_ids": seg, "num_bags": b, "weights": weights}
    oob = draw(st.sampled_from(["zero", "clip"]))
    return tuple(tables), features, oob


def _per_feature_loop(layout, params, features, oob):
    """Every feature pooled alone by the reference op over its table's own parameters."""
    from flowtt_jax.collection import bag_kwargs, dense_embedding_bag

    out = {}
    for cfg in layout.tables:
        values = layout.table_params(params, cfg.name)
        for f in cfg.feature_keys:
            ids, kw = bag_kwargs(features[f])
            kw = {k: v for k, v in kw.items() if v is not None}
            if cfg.kind == "dense":
                out[f] = dense_embedding_bag(values[0], ids, mode=cfg.mode, oob=oob, **kw)
            else:
                out[f] = ftt.tt_embedding_bag(
                    values,
                    ids,
                    mode=cfg.mode,
                    num_embeddings=cfg.num_embeddings,
                    oob=oob,
                    impl="reference",
                    **kw,
                )
    return out


@examples(ci=4, gpu=150)
@given(case=collection_cases(), impl=st.sampled_from(["auto", "reference"]))
def test_collection_matches_a_per_feature_loop(case, impl):
    """``CollectionLayout.apply`` (packs, one table-batched op per shape group, one dense
    gather, features of two batch sizes) against each feature pooled alone: outputs and the
    gradients of the packed parameters and of the features' weights. (A 2-core table runs
    the reference op on both sides: for those only the packing and slicing is checked.)"""
    from flowtt_jax.collection.layout import CollectionLayout

    tables, features, oob = case
    layout = CollectionLayout(tables)
    params = layout.init(jax.random.key(0))
    rng = np.random.default_rng(1)
    want = _per_feature_loop(layout, params, features, oob)
    cot = {f: rng.standard_normal(w.shape).astype(np.float32) for f, w in want.items()}

    weighted = {
        f: v["weights"] for f, v in features.items() if isinstance(v, dict) and v.get("weights") is not None
    }

    def loss(fn):
        def total(p, w):
            feats = {f: {**v, "weights": w[f]} if f in w else v for f, v in features.items()}
            return sum(jnp.sum(o * cot[f]) for f, o in fn(p, feats).items())

        return total

    got = layout.apply(params, features, oob=oob, impl=impl)
    assert set(got) == set(want)
    bad = compare({f: got[f] for f in want}, {f: np.asarray(w, np.float64) for f, w in want.items()})
    grad = functools.partial(jax.grad, argnums=(0, 1))
    g_got = grad(loss(lambda p, x: layout.apply(p, x, oob=oob, impl=impl)))(params, weighted)
    g_want = grad(loss(lambda p, x: _per_feature_loop(layout, p, x, oob)))(params, weighted)
    for got_part, want_part in zip(g_got, g_want):
        bad += compare(got_part, {k: np.asarray(v, np.float64) for k, v in want_part.items()})
    assert not bad, (impl, oob, tables, bad)
