"""The DLRM example runs end to end (tiny settings) and its pieces are right."""

import math

import jax.numpy as jnp
import numpy as np
import pytest

from examples import dlrm
from examples.criteo_synth import (
    CRITEO_KAGGLE_CARDINALITIES,
    SynthConfig,
    SynthCriteo,
    affine_mod,
    hash32,
    unit,
)

TINY = [
    "--steps",
    "4",
    "--batch-size",
    "64",
    "--eval-batches",
    "4",
    "--max-rows",
    "5000",
    "--rank",
    "4",
    "--bottom",
    "16",
    "--top",
    "16",
    "--no-progress",
    "--log-every",
    "2",
    "--profile-steps",
    "1",
]


def test_tt_run_tiny():
    res = dlrm.main(TINY)["tt"]
    assert math.isfinite(res.final_loss) and math.isfinite(res.eval_loss)
    assert 0.0 <= res.auc <= 1.0 and 0.0 <= res.bayes_auc <= 1.0
    assert res.embedding_bytes < res.dense_equivalent_bytes < res.full_dense_bytes
    assert res.memory_ratio > 1
    t = res.step_times
    assert min(t.data, t.forward, t.train_step, t.loop) > 0 and res.examples_per_second > 0


def test_compare_tiny():
    out = dlrm.main(TINY + ["--compare", "--optimizer", "adagrad", "--impl", "reference"])
    tt, de = out["tt"], out["dense"]
    assert de.embedding_bytes == de.dense_equivalent_bytes == tt.dense_equivalent_bytes
    assert tt.embedding_bytes < de.embedding_bytes
    for r in (tt, de):
        assert math.isfinite(r.final_loss) and 0.0 <= r.auc <= 1.0


def test_roc_auc_matches_pairwise_definition():
    rng = np.random.default_rng(0)
    y = rng.random(300) < 0.3
    s = np.round(rng.normal(size=300) + y, 1)  # many ties
    pos, neg = s[y], s[~y]
    pairwise = ((pos[:, None] > neg[None]).sum() + 0.5 * (pos[:, None] == neg[None]).sum()) / (
        pos.size * neg.size
    )
    assert abs(dlrm.roc_auc(y, s) - pairwise) < 1e-12
    assert dlrm.roc_auc(np.array([0, 1]), np.array([0.0, 1.0])) == 1.0


def test_synthetic_data_deterministic_and_capped():
    assert len(CRITEO_KAGGLE_CARDINALITIES) == 26
    data = SynthCriteo(SynthConfig(max_rows=1000))
    d1, s1, y1, l1 = map(np.asarray, data.batch(3, 128))
    # a second generator (as in the dense run) makes the same bits; rows do not depend on B
    d2, s2, y2, l2 = map(np.asarray, SynthCriteo(SynthConfig(max_rows=1000)).batch(3, 256))
    for a, b in ((d1, d2), (s1, s2), (y1, y2), (l1, l2)):
        np.testing.assert_array_equal(a, b[:128])
    assert d1.shape == (128, 13) and s1.shape == (128, 26) and y1.shape == (128,)
    assert s1.dtype == np.int32 and d1.dtype == y1.dtype == l1.dtype == np.float32
    assert (s1 >= 0).all() and (s1 < np.array(data.cardinalities)).all()
    assert max(data.cardinalities) == 1000
    _, s3, _, _ = data.batch(3, 128, stream=1)
    assert not np.array_equal(s1, np.asarray(s3))
    # the planted signal is informative: the teacher's logit ranks labels well
    _, _, y, logit = map(np.asarray, data.batch(0, 4000, stream=1))
    assert dlrm.roc_auc(y, logit) > 0.75
    assert 0.1 < y.mean() < 0.3


def test_synthetic_ids_follow_the_bounded_power_law():
    data = SynthCriteo(SynthConfig(zipf_a=1.2))
    m = 50_000
    _, ids, _, _ = map(np.asarray, data.batch(0, m, stream=1))
    for f in (2, 9, 16):  # C3 (10^7 rows), C10, C17 (10 rows)
        n, a, b = CRITEO_KAGGLE_CARDINALITIES[f], int(data._a[f]), int(data._b[f])
        assert (ids[:, f] >= 0).all() and (ids[:, f] < n).all()
        rank = (ids[:, f].astype(np.int64) - b) * pow(a, -1, n) % n  # undo the affine scatter
        for r in (1, 10, 1000, 100_000, 1_000_000):
            if r < n:
                cdf = (1 - (r + 1) ** -0.2) / (1 - (n + 1) ** -0.2)  # P(rank < r)
                assert abs((rank < r).mean() - cdf) < 4 * np.sqrt(cdf * (1 - cdf) / m) + 1e-9, (f, r)


def test_affine_mod_and_hash32_are_exact():
    rng = np.random.default_rng(0)
    n = np.array([1, 3, 1000, 10131227, 2**24 - 1, 2**24])
    a = np.array([rng.integers(0, k) for k in n])
    b = np.array([rng.integers(0, k) for k in n])
    a[-1] = b[-1] = 2**24 - 1
    x = np.stack([rng.integers(0, k, 500) for k in n], 1)
    x[0, -1] = 2**24 - 1
    got = np.asarray(affine_mod(a, b, x.astype(np.int32), n)).astype(np.int64)
    want = [[(int(a[j]) * int(x[i, j]) + int(b[j])) % int(n[j]) for j in range(n.size)] for i in range(500)]
    np.testing.assert_array_equal(got, want)
    # murmur3_32 reference vectors (4-byte little-endian blocks)
    word = int.from_bytes(b"test", "little")
    assert int(hash32(0, word)) == 0xBA6BD213
    assert int(hash32(0x9747B28C, word)) == 0x704B81DC
    assert int(hash32(0, 0)) == 0x2362F9DE
    # uniforms stay strictly inside (0, 1) at the extreme bits (ndtri(1) = inf made NaNs)
    u = np.asarray(unit(jnp.array([0, 0xFFFFFFFF, 0xFFFFFF00], jnp.uint32)))
    assert (u > 0).all() and (u < 1).all()


@pytest.mark.slow
def test_check_fails_when_targets_are_missed():
    # Tiny tables compress little (far below 100x): --check must turn that into exit 1.
    with pytest.raises(SystemExit) as exc:
        dlrm.main(TINY + ["--compare", "--check", "--impl", "reference"])
    assert exc.value.code == 1
    with pytest.raises(SystemExit):
        dlrm.main(TINY + ["--check"])  # --check without --compare is a usage error


@pytest.mark.slow
def test_meta_preset_tiny():
    """``--preset meta``: Meta-like multi-hot features as one KeyedJagged batch, TT and dense."""
    out = dlrm.main(TINY + ["--preset", "meta", "--tables", "12", "--compare", "--batch-size", "16"])
    for r in out.values():
        assert math.isfinite(r.final_loss) and 0.0 <= r.auc <= 1.0
    assert out["tt"].embedding_bytes < out["dense"].embedding_bytes


def test_meta_synth_batches():
    """A Meta-like batch: one static shape, lengths within the capacity (one-hot features
    length 1, the tail in no bag), ids in range of the capped tables, deterministic, and
    mean pooling near the configured 13.6."""
    from examples.meta_synth import MetaSynthConfig, SynthMeta

    data = SynthMeta(MetaSynthConfig(num_tables=40, max_rows=3000, seed=3))
    dense, kjt, labels, logits = data.batch(0, 256)
    cap = data.capacity(256)
    lengths, ids = np.asarray(kjt.lengths), np.asarray(kjt.ids)
    assert ids.shape == (cap,) and lengths.shape == (40, 256) and dense.shape == (256, 13)
    assert lengths.min() >= 0 and lengths.sum() <= cap
    assert np.all(lengths[data.one_hot] == 1)
    assert abs(lengths.sum() / lengths.size - 13.6) < 1.5
    ends = np.cumsum(lengths.reshape(-1))
    starts = ends - lengths.reshape(-1)
    for f in range(40):
        seg = ids[starts[f * 256] : ends[(f + 1) * 256 - 1]]
        assert seg.size == 0 or (seg.min() >= 0 and seg.max() < data.cardinalities[f])
    assert set(np.unique(np.asarray(labels))) <= {0.0, 1.0} and np.all(np.isfinite(np.asarray(logits)))
    again = data.batch(0, 256)[1]
    np.testing.assert_array_equal(np.asarray(again.ids), ids)
    other = data.batch(1, 256)[1]
    assert not np.array_equal(np.asarray(other.ids), ids)
