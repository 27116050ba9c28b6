"""The results JSON of ``python -m benchmarks``, for every stage: where a run's document goes,
the header it starts with, rewriting it after every measurement, and reading runs back.

The lowest module of the package's run and report sides (it imports none of theirs), so
the stages (``__main__``, ``scaling``) and the reports (``report``, ``scaling_report``)
share it without importing each other. ``jax`` is imported only to start a run: the
reports read JSON without it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["SCHEMA", "commit", "jsonable", "start", "Run", "load", "newest_first"]

SCHEMA = "flowtt-bench/1"


def commit() -> str:
    """``FLOWTT_COMMIT`` when set, else the checkout's HEAD, else ``"unknown"``."""
    env = os.environ.get("FLOWTT_COMMIT")
    if env:
        return env
    try:
        return subprocess.run(
            ["git", "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            cwd=Path(__file__).parent,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def jsonable(x: Any) -> Any:
    """``json.dumps``'s ``default``: NumPy scalars and arrays as Python ones, the rest as str."""
    if isinstance(x, (np.integer, np.floating, np.bool_)):
        return x.item()
    if isinstance(x, np.ndarray):
        return x.tolist()
    return str(x)


def start(out_dir: Path, a: argparse.Namespace, stage: str, argv: list[str] | None) -> tuple[Path, dict]:
    """A new run of ``stage``: its JSON path ``out_dir/bench_[quick_]<stage>_<device>_<UTC
    time>.json`` and the header of its document (device, date, commit, jax, argv, time
    budget); the stage adds its own fields."""
    import jax

    dev = jax.devices()[0]
    now = datetime.datetime.now(datetime.timezone.utc)
    short = dev.device_kind.split()[-1].lower() if dev.platform == "gpu" else dev.platform
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"bench_{'quick_' if a.quick else ''}{stage}_{short}_{now:%Y-%m-%dT%H%M%S}.json"
    doc = {
        "schema": SCHEMA,
        "suite": a.suite,
        "stage": stage,
        "quick": a.quick,
        "device": f"{dev.platform}:{dev.device_kind}",
        "device_count": jax.device_count(),
        "date": now.isoformat(timespec="seconds"),
        "commit": commit(),
        "jax": jax.__version__,
        "argv": argv,
        "time_budget_s": a.time_budget,
    }
    return path, doc


class Run:
    """A stage's run: its document ``doc`` at ``path`` (rewritten whole after every
    measurement, so a run cut short keeps what it measured) and the time budget
    (``a.time_budget`` seconds from now; None: no limit)."""

    stop_reason: str | None = None  # set when the run must end early (e.g. a compile overran)
    bar: Any = None  # a tqdm bar, when one shows the progress

    def __init__(self, a: argparse.Namespace, path: Path, doc: dict):
        self.a, self.path, self.doc = a, path, doc
        self.t0 = time.monotonic()

    def write(self) -> None:
        self.doc["elapsed_s"] = time.monotonic() - self.t0
        tmp = self.path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.doc, indent=1, default=jsonable) + "\n")
        os.replace(tmp, self.path)

    def remaining(self) -> float:
        if self.a.time_budget is None:
            return float("inf")
        return self.a.time_budget - (time.monotonic() - self.t0)

    def log(self, msg: str) -> None:
        if self.bar is not None:
            self.bar.write(msg)
        else:
            print(msg, flush=True)


def load(paths: list[str]) -> list[dict]:
    """The documents of ``paths``, each with its path as ``_path``."""
    docs = []
    for p in paths:
        d = json.load(open(p))
        d["_path"] = p
        docs.append(d)
    return docs


def newest_first(docs: list[dict]) -> list[dict]:
    """The non-quick runs, newest first (a later run of a case overrides an earlier one)."""
    return sorted((d for d in docs if not d.get("quick")), key=lambda d: d["date"], reverse=True)
