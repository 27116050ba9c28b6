"""The main job's learning curves (``examples/dlrm.py --compare --curve-every N --out --plot``,
``examples/curves.py``) and its per-table-type optimizer (``--tt-lr``), on a tiny Meta-like run."""

from __future__ import annotations

import importlib.util
import json
import math

import jax.numpy as jnp
import numpy as np

from examples import curves, dlrm

B, STEPS, EVERY = 32, 5, 2
TINY_META = [
    "--preset", "meta", "--tables", "8", "--steps", str(STEPS), "--batch-size", str(B),
    "--eval-batches", "2", "--max-rows", "2000", "--rank", "4", "--dim", "8",
    "--bottom", "16", "--top", "16", "--no-progress", "--log-every", "5", "--profile-steps", "1",
]  # fmt: skip


def test_compare_records_both_curves_and_plots_them(tmp_path):
    out, png = tmp_path / "run.json", tmp_path / "run.png"
    argv = ["--compare", "--curve-every", str(EVERY), "--out", str(out), "--plot", str(png)]
    results = dlrm.main(TINY_META + argv)
    doc = json.loads(out.read_text())
    assert doc["commit"] and doc["device"] and doc["args"]["curve_every"] == EVERY
    assert set(doc["runs"]) == {"tt", "dense"}
    for name, run in doc["runs"].items():
        examples, aucs, losses = zip(*run["curve"])
        # the untrained model, every EVERY steps, and the last step once
        assert list(examples) == [0, EVERY * B, 2 * EVERY * B, STEPS * B]
        assert all(0.0 < a < 1.0 for a in aucs) and all(math.isfinite(x) and x > 0 for x in losses)
        assert aucs[-1] == run["auc"] == results[name].auc and losses[-1] == run["eval_loss"]
    tt, de = doc["runs"]["tt"], doc["runs"]["dense"]
    assert tt["bayes_auc"] == de["bayes_auc"]  # both runs scored on the same held-out examples
    assert tt["curve"][0][1:] != de["curve"][0][1:]  # ... by different models
    assert doc["dense_minus_tt_auc"] == de["auc"] - tt["auc"]
    assert doc["memory_ratio"] == de["embedding_bytes"] / tt["embedding_bytes"] > 1
    if importlib.util.find_spec("matplotlib") is None:
        assert not png.exists()
    else:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_log_loss_is_the_training_loss():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=500).astype(np.float32) * 3
    labels = (rng.random(500) < 0.3).astype(np.float32)
    want = float(dlrm.bce(jnp.asarray(logits), jnp.asarray(labels)))
    assert abs(curves.log_loss(labels, logits) - want) < 1e-5


def _frozen(argv: list[str]) -> set[tuple[int, tuple[int, ...]]]:
    """(index, shape) of the state's arrays that one training step leaves as they were."""
    args = dlrm.parse_args(TINY_META + argv)
    run = dlrm.build_run(args, dense_tables=False, log=lambda *a: None)
    before = [np.array(x) for x in run.state]
    d, s, y, _ = run.batch(0, B, stream=0)
    after, _ = run.train_step(run.state, d, s, y)
    return {(i, a.shape) for i, (a, b) in enumerate(zip(before, after)) if np.array_equal(a, np.asarray(b))}


def test_tt_lr_applies_to_the_tt_cores_alone():
    # --tt-lr 0 freezes the TT cores (the model's only 4-D arrays: packed [rows, r, c, r]) and
    # nothing else: the MLPs and every optimizer moment move as at another TT learning rate,
    # where only counters (ids out of range: none) stay
    frozen, moving = _frozen(["--tt-lr", "0"]), _frozen(["--tt-lr", "1e-3"])
    assert moving < frozen
    assert len(frozen - moving) == 3 and all(len(shape) == 4 for _, shape in frozen - moving)
    args = dlrm.parse_args(TINY_META + ["--tt-optimizer", "adagrad"])
    assert (args.optimizer, args.tt_optimizer, args.tt_lr) == ("adam", "adagrad", args.lr)
