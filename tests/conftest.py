"""pytest setup: float32-exact matmuls, fixtures, and the seed of the randomised tests.

Shared helpers (id distributions, cores, checkers) live in ``tests/helpers.py``.
"""

from __future__ import annotations

import itertools
import os
import zlib
from collections.abc import Iterator

if os.environ.get("PYTEST_XDIST_WORKER"):  # workers share the machine (and a GPU): no preallocation
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

# The references compare at float32 accuracy: keep XLA's GPU matmuls out of TF32.
jax.config.update("jax_default_matmul_precision", "highest")

#: Base seed of the tests that draw fresh inputs every run (the ``seeds`` fixture):
#: ``FLOWTT_TEST_SEED`` when set, else drawn now; pytest's header shows it.
#: The environment carries it to pytest-xdist's workers (one seed for the whole run).
TEST_SEED = int(os.environ.get("FLOWTT_TEST_SEED", np.random.SeedSequence().entropy % 2**31))
os.environ["FLOWTT_TEST_SEED"] = str(TEST_SEED)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--slow",
        action="store_true",
        help="also run the tests marked slow (long property and size runs; CI runs them: -m slow --slow)",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--slow"):
        return
    skip = pytest.mark.skip(reason="slow: run with --slow (CI does)")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


def pytest_report_header(config: pytest.Config) -> str:
    return f"flowtt_jax: FLOWTT_TEST_SEED={TEST_SEED} (set it to repeat this run's random inputs)"


@pytest.fixture
def x64() -> Iterator[None]:
    with jax.enable_x64(True):
        yield


@pytest.fixture
def seeds(request: pytest.FixtureRequest) -> Iterator[int]:
    """Seeds for one test's fresh random inputs: consecutive ints from a start drawn from
    ``TEST_SEED`` and the test's id (printed, so a failure shows it)."""
    start = (TEST_SEED + zlib.crc32(request.node.nodeid.encode())) % 2**31
    print(f"seeds from {start} (FLOWTT_TEST_SEED={TEST_SEED})")
    return itertools.count(start)
