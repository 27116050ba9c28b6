"""The DLRM example runs end to end (tiny settings) and its pieces are right."""

import math

import numpy as np
import pytest

from examples import dlrm
from examples.criteo_synth import CRITEO_KAGGLE_CARDINALITIES, SynthConfig, SynthCriteo

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
]


def test_tt_run_tiny():
    res = dlrm.main(TINY)["tt"]
    assert math.isfinite(res.final_loss) and math.isfinite(res.eval_loss)
    assert 0.0 <= res.auc <= 1.0 and 0.0 <= res.bayes_auc <= 1.0
    assert res.embedding_bytes < res.dense_equivalent_bytes < res.full_dense_bytes
    assert res.memory_ratio > 1


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
    d1, s1, y1, l1 = data.batch(3, 128)
    d2, s2, y2, l2 = data.batch(3, 128)
    np.testing.assert_array_equal(s1, s2)
    np.testing.assert_array_equal(y1, y2)
    assert d1.shape == (128, 13) and s1.shape == (128, 26) and y1.shape == (128,)
    assert (s1 >= 0).all() and (s1 < np.array(data.cardinalities)).all()
    assert max(data.cardinalities) == 1000
    _, s3, _, _ = data.batch(3, 128, stream=1)
    assert not np.array_equal(s1, s3)
    # the planted signal is informative: the teacher's logit ranks labels well
    _, _, y, logit = data.batch(0, 4000, stream=1)
    assert dlrm.roc_auc(y, logit) > 0.75


def test_check_fails_when_targets_are_missed():
    # Tiny tables compress little (far below 100x): --check must turn that into exit 1.
    with pytest.raises(SystemExit) as exc:
        dlrm.main(TINY + ["--compare", "--check", "--impl", "reference"])
    assert exc.value.code == 1
    with pytest.raises(SystemExit):
        dlrm.main(TINY + ["--check"])  # --check without --compare is a usage error
