"""The compression study's quick CPU version (``examples/compression_study.py``), as CI runs
it: every method at one budget on capped tables, a few steps; the JSON, table and plot."""

from __future__ import annotations

import json
import math

import pytest

from examples import compression_study as study


@pytest.mark.slow
def test_study_runs_every_method(tmp_path):
    out, png = tmp_path / "study.json", tmp_path / "study.png"
    argv = ["--steps", "3", "--batch-size", "64", "--eval-batches", "2", "--factors", "100", "--seeds", "0"]
    argv += ["--crossover-rows", "--max-rows", "100000", "--out", str(out), "--plot", str(png)]
    doc = study.main([*argv, "--methods", "dense", "uniform", "planner", "planner_cache", "hashed"])
    assert json.loads(out.read_text())["runs"] == doc["runs"] and png.stat().st_size > 0
    runs = {r["method"]: r for r in doc["runs"]}
    assert set(runs) == set(study.METHODS) and runs["dense"]["factor"] == 1
    for method, r in runs.items():
        assert 0 < r["auc"] < 1 and math.isfinite(r["logloss"]) and r["step_ms"] > 0, method
        assert r["embedding_bytes"] <= r["budget_bytes"], method
    cached = [t for t in runs["planner_cache"]["tables"] if t[4]]
    assert cached and all(t[1] == "tt" for t in cached)  # the planner gave TT tables caches
    assert not any(t[4] for t in runs["planner"]["tables"])
    table = study.results_table(doc)
    assert "planner_cache" in table and "rows cached" in table
