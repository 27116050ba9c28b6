"""Issue 51's measure of the collection call's input path (``scripts/feature_walk.py``): the
walk of ``features`` from ``CollectionLayout.apply`` to the op's entry (``pool_packed``) makes
at most ``MAX_STOPS`` stops (module visits: a run of functions in one module is one) with at
most ``MAX_RETURNS`` returns to a module it had left (stops - modules); the memory planner's
calls are listed, not followed. ``python -m scripts.feature_walk`` prints the walk."""

from __future__ import annotations

import json

import pytest

from scripts import feature_walk
from scripts.feature_walk import figures, module_visits, walk

MAX_STOPS = 10
MAX_RETURNS = 3


@pytest.fixture(scope="module")
def result():
    return walk()


def test_module_visits_and_figures():
    assert module_visits(list("AABACB")) == list("ABACB")
    assert figures(list("AABACB")) == {"stops": 5, "modules": 3, "returns": 2}
    assert figures(list("AABBCC")) == {"stops": 3, "modules": 3, "returns": 0}
    assert figures([]) == {"stops": 0, "modules": 0, "returns": 0}


def _package(tmp_path, modules: dict[str, str]) -> None:
    """A package ``flowtt_jax`` under ``tmp_path`` of ``{module file name: source}``."""
    pkg = tmp_path / "flowtt_jax"
    pkg.mkdir()
    for name, text in {"__init__.py": "", **modules}.items():
        (pkg / name).write_text(text)


def test_walker_on_a_small_package(tmp_path):
    a = (
        "from flowtt_jax import b\n"
        "from flowtt_jax.c import helper as h, other\n"
        "\n"
        "class Base:\n"
        "    def _back(self, v):\n"
        "        return v\n"
        "\n"
        "class L(Base):\n"
        "    def run(self, features, unrelated):\n"
        "        x = self._prep(features)\n"
        "        y = b.step(x)\n"
        "        other(unrelated)\n"
        "        for item in y:\n"
        "            self._back(item)\n"
        "        return b.finish(value=y)\n"
        "\n"
        "    def _prep(self, f):\n"
        "        return h(f)\n"
    )
    b = (
        "import flowtt_jax.c as c\n"
        "\n"
        "def step(v, w=None):\n"
        "    return c.helper(v, w)\n"
        "\n"
        "def finish(*, value):\n"
        "    def inner(q):\n"
        "        return q\n"
        "    return inner(value) + value.method(1)\n"
    )
    c = "def helper(v, w=None):\n    return v\n\ndef other(u):\n    return u\n"
    _package(tmp_path, {"a.py": a, "b.py": b, "c.py": c})
    r = walk(tmp_path, ("flowtt_jax/a.py", "L.run"), "features", end=(), planning=())
    assert [f.label for f in r.functions] == [
        "flowtt_jax/a.py:L.run",
        "flowtt_jax/a.py:L._prep",
        "flowtt_jax/c.py:helper",  # c.other takes no tracked value: not entered
        "flowtt_jax/b.py:step",
        "flowtt_jax/a.py:Base._back",
        "flowtt_jax/b.py:finish",
        "flowtt_jax/b.py:finish.<locals>.inner",
    ]
    assert r.functions[2].params == ["v"] and r.functions[3].params == ["v"]
    assert r.visits == [
        "flowtt_jax/a.py",
        "flowtt_jax/c.py",
        "flowtt_jax/b.py",
        "flowtt_jax/a.py",
        "flowtt_jax/b.py",
    ]
    assert r.figures == {"stops": 5, "modules": 3, "returns": 2}
    assert r.per_module == {"flowtt_jax/a.py": 2, "flowtt_jax/b.py": 2, "flowtt_jax/c.py": 1}
    assert [u["call"] for u in r.unresolved] == ["value.method(1)"]
    # b.step is the end (entered, not followed: c.helper is not entered from it); c.py is planning
    r = walk(
        tmp_path,
        ("flowtt_jax/a.py", "L.run"),
        "features",
        end=("flowtt_jax/b.py:step",),
        planning=("flowtt_jax/c.py",),
    )
    assert [f.label for f in r.functions][:3] == [
        "flowtt_jax/a.py:L.run",
        "flowtt_jax/a.py:L._prep",
        "flowtt_jax/b.py:step",
    ]
    assert [f.followed for f in r.functions][:3] == [True, True, False]
    assert [p["callee"] for p in r.planning] == ["flowtt_jax/c.py:helper"]


def test_a_planning_calls_result_is_not_tracked(tmp_path):
    """A value assigned from a planning call (a static plan) is not the features: a call
    given only it is not entered; a call given the features still is."""
    a = (
        "from flowtt_jax.p import plan\n"
        "\n"
        "def run(features):\n"
        "    packs = plan(len(features))\n"
        "    use(packs)\n"
        "    return take(features, packs)\n"
        "\n"
        "def use(packs):\n"
        "    return packs\n"
        "\n"
        "def take(f, packs):\n"
        "    return f\n"
    )
    _package(tmp_path, {"a.py": a, "p.py": "def plan(n):\n    return n\n"})
    start = ("flowtt_jax/a.py", "run")
    r = walk(tmp_path, start, "features", end=(), planning=())
    assert [f.label for f in r.functions] == [
        "flowtt_jax/a.py:run",
        "flowtt_jax/p.py:plan",
        "flowtt_jax/a.py:use",
        "flowtt_jax/a.py:take",
    ]
    r = walk(tmp_path, start, "features", end=(), planning=("flowtt_jax/p.py",))
    assert [f.label for f in r.functions] == ["flowtt_jax/a.py:run", "flowtt_jax/a.py:take"]
    assert r.functions[1].params == ["f"] and [p["callee"] for p in r.planning] == ["flowtt_jax/p.py:plan"]


def test_walk_follows_the_ids_to_the_op(result):
    labels = [f.label for f in result.functions]
    assert labels[0] == "flowtt_jax/collection/layout.py:CollectionLayout.apply"
    assert "flowtt_jax/collection/batch.py" in result.visits, labels
    assert len(labels) == len(set(labels))
    # ends at the op's entry: pool_packed entered, not followed; nothing followed in ops/kernels/tt
    assert "flowtt_jax/collection/pool.py:pool_packed" in labels, labels
    ends = [f.label for f in result.functions if not f.followed]
    assert "flowtt_jax/collection/pool.py:pool_packed" in ends
    at = labels.index("flowtt_jax/collection/pool.py:pool_packed")  # nothing entered from it
    assert all(f.depth <= result.functions[at].depth for f in result.functions[at + 1 :]), labels
    op = ("flowtt_jax/ops/", "flowtt_jax/kernels/", "flowtt_jax/tt/")
    assert all(f.label in ends for f in result.functions if f.module.startswith(op))
    # the memory planner is listed, not followed
    planned = {p["callee"] for p in result.planning}
    assert "flowtt_jax/collection/layout.py:CollectionLayout._form_sizes" in planned, planned
    assert not any(f.module in ("flowtt_jax/memory.py", "flowtt_jax/budget.py") for f in result.functions)


def test_feature_walk_json(tmp_path, capsys):
    out = tmp_path / "walk.json"
    assert feature_walk.main(["--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "stops:" in printed and "planning calls, not followed" in printed
    data = json.loads(out.read_text())
    assert data["stops"] == len(data["visits"]) == sum(data["per_module"].values())
    assert data["modules"] == len(data["per_module"])
    assert data["returns"] == data["stops"] - data["modules"]
    assert data["functions"][0]["label"].endswith("CollectionLayout.apply") and data["planning"]


def test_feature_walk_targets(result):
    """Issue 51's targets: at most 10 stops (module visits) and at most 3 returns."""
    fig = result.figures
    msg = (
        f"{fig['stops']} stops in {fig['modules']} modules, {fig['returns']} returns; visits per module: "
        f"{result.per_module}; python -m scripts.feature_walk prints the walk"
    )
    assert fig["stops"] <= MAX_STOPS, msg
    assert fig["returns"] <= MAX_RETURNS, msg
