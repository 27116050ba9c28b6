"""Held-out evaluation and learning curves of the main job (``examples/dlrm.py``): ROC AUC,
a fixed held-out set scored between training steps, the run's JSON and its plot.

    python examples/curves.py RUN.json PLOT.png     # re-plot a run written by dlrm.py --out

A curve is ``[(examples seen, held-out AUC, held-out log loss), ...]``, every point on the
same held-out batches (``HeldOut``), so the TT and dense runs of ``dlrm.py --compare`` are
scored on the same examples. The JSON (``write_json``) stamps device, date, commit
(``benchmarks.records.commit``), jax version and arguments; ``plot`` draws AUC and log loss
against examples seen, one line per run, the planted teacher's AUC as a dashed line.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import sys
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np

from benchmarks.records import commit

__all__ = ["CurvePoint", "HeldOut", "roc_auc", "log_loss", "run_document", "write_json", "plot"]

CurvePoint = tuple[int, float, float]  # (examples seen, AUC, log loss)


def roc_auc(labels: np.ndarray, scores: np.ndarray) -> float:
    """Rank-based ROC AUC (Mann-Whitney U) with average ranks for ties."""
    labels = np.asarray(labels).astype(bool).ravel()
    scores = np.asarray(scores, np.float64).ravel()
    n_pos = int(labels.sum())
    n_neg = labels.size - n_pos
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    order = np.argsort(scores, kind="mergesort")
    sorted_scores = scores[order]
    # average rank (1-based) over runs of equal scores
    starts = np.r_[0, np.flatnonzero(np.diff(sorted_scores)) + 1]
    ends = np.r_[starts[1:], scores.size]
    avg = (starts + ends + 1) / 2.0
    ranks = np.empty(scores.size)
    ranks[order] = np.repeat(avg, ends - starts)
    return float((ranks[labels].sum() - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg))


def log_loss(labels: np.ndarray, logits: np.ndarray) -> float:
    """Mean binary cross-entropy of ``logits`` (float64: ``log(1 + e^s) - y s``)."""
    s = np.asarray(logits, np.float64).ravel()
    return float(np.mean(np.logaddexp(0.0, s) - np.asarray(labels, np.float64).ravel() * s))


@dataclasses.dataclass
class HeldOut:
    """A fixed held-out set kept on the device: its model inputs, labels (host) and the
    planted teacher's AUC on it (nan for real data)."""

    inputs: list[tuple[Any, Any]]  # (dense, sparse) device batches
    labels: np.ndarray
    bayes_auc: float

    @classmethod
    def take(cls, batches: Iterator[tuple], n: int, fetch: Callable = np.asarray) -> HeldOut:
        """The first ``n`` batches ``(dense, sparse, labels, teacher logits or None)`` of
        ``batches``; ``fetch`` brings a device array to the host (all of it, sharded too)."""
        inputs, labels, logits = [], [], []
        for _, (d, s, y, lg) in zip(range(n), batches):
            inputs.append((d, s))
            labels.append(fetch(y))
            logits.append(None if lg is None else fetch(lg))
        if not inputs:
            raise ValueError("no held-out batch (--eval-data too short?)")
        y = np.concatenate(labels)
        bayes = roc_auc(y, np.concatenate(logits)) if logits[0] is not None else float("nan")
        return cls(inputs, y, bayes)

    def evaluate(
        self, predict: Callable[[Any, Any], Any], fetch: Callable = np.asarray
    ) -> tuple[float, float]:
        """``(AUC, log loss)`` of ``predict(dense, sparse) -> logits`` on every batch (all
        dispatched before the first is fetched)."""
        scores = [predict(d, s) for d, s in self.inputs]
        scores = np.concatenate([fetch(a) for a in scores])
        return roc_auc(self.labels, scores), log_loss(self.labels, scores)

    @property
    def size(self) -> int:
        return self.labels.size


def _finite(x: Any) -> Any:
    """``x`` with non-finite floats as None (JSON has no NaN), dicts and lists walked."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


def run_document(args: Mapping[str, Any], results: Mapping[str, Any]) -> dict:
    """The JSON document of a ``dlrm.py`` run: header, arguments, each run's result (a
    dataclass: ``dataclasses.asdict``) and, with both runs, the dense - TT comparison."""
    dev = jax.devices()[0]
    doc = {
        "what": "examples/dlrm.py: held-out AUC / log loss against examples seen",
        "device": f"{dev.platform}:{dev.device_kind}",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": commit(),
        "jax": jax.__version__,
        "args": dict(args),
        "runs": {name: dataclasses.asdict(r) for name, r in results.items()},
    }
    if {"tt", "dense"} <= set(results):
        tt, de = results["tt"], results["dense"]
        doc["dense_minus_tt_auc"] = de.auc - tt.auc
        doc["memory_ratio"] = de.embedding_bytes / tt.embedding_bytes
    return _finite(doc)


def write_json(path: str | Path, doc: dict) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1) + "\n")
    return path


def plot(doc: Mapping[str, Any], path: str | Path) -> Path | None:
    """AUC and log loss against examples seen, one line per run with a curve (the untrained
    point left out), the teacher's AUC dashed; None (and a message) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import EngFormatter
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)")
        return None
    runs = {k: r for k, r in doc["runs"].items() if r.get("curve")}
    fig, (ax_auc, ax_loss) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name, r in runs.items():
        x, auc, loss = zip(*[p for p in r["curve"] if p[0] > 0])
        label = f"{name} ({r['embedding_bytes'] / 2**20:,.1f} MiB of tables)"
        ax_auc.plot(x, auc, marker=".", label=label)
        ax_loss.plot(x, loss, marker=".", label=label)
    bayes = next((r["bayes_auc"] for r in runs.values() if r.get("bayes_auc") is not None), None)
    if bayes is not None:
        ax_auc.axhline(bayes, color="k", ls="--", lw=1, label=f"planted teacher ({bayes:.4f})")
    a = doc.get("args", {})
    title = (
        f"{a.get('preset', '?')}: {a.get('tables', '')} tables, rows <= {a.get('max_rows') or 'full'}, "
        f"batch {a.get('batch_size')}, dim {a.get('dim')}, TT rank {a.get('rank')} ({doc.get('device')})"
    )
    for ax, what in ((ax_auc, "held-out AUC"), (ax_loss, "held-out log loss")):
        ax.set_xlabel("training examples seen")
        ax.xaxis.set_major_formatter(EngFormatter())  # 200k, 1M
        ax.set_ylabel(what)
        ax.grid(alpha=0.3)
    ax_auc.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit("usage: python examples/curves.py RUN.json PLOT.png")
    print(plot(json.loads(Path(sys.argv[1]).read_text()), sys.argv[2]))
