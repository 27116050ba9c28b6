"""The README's Python code blocks run as written, in order, in one namespace (CPU, the
sizes they show), and give the shapes their comments promise."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

README = Path(__file__).resolve().parents[1] / "README.md"


def python_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```$", text, flags=re.M | re.S)


def test_readme_python_blocks_run():
    blocks = python_blocks(README.read_text())
    assert len(blocks) >= 4
    ns: dict = {}
    for block in blocks:
        exec(compile(block, str(README), "exec"), ns)  # noqa: S102 - the README is ours
    assert ns["rows"].shape == (5, 32) and ns["bags"].shape == (2, 32)
    assert {k: v.shape for k, v in ns["out"].items()} == {
        "user": (2, 32),
        "item": (2, 32),
        "country": (2, 32),
    }
    assert ns["stacked"].shape == (2, 3, 32) and ns["pooled"].shape == (2, 3, 32)
    assert ns["jagged_rows"].shape == (9, 32) and ns["group_out"].shape == (3, 1, 16)
    assert set(ns["state"]) == {"user", "item", "country"}
    # the packed batch gives the dict call's values: user's bags are ids 7 and 9
    user_rows = ns["ftt"].tt_lookup(ns["coll"].cores("user"), np.array([7, 9]))
    np.testing.assert_allclose(np.asarray(ns["pooled"][:, 0]), np.asarray(user_rows), rtol=1e-5, atol=1e-7)
    assert all(np.isfinite(np.asarray(g)).all() for g in ns["grads"])
