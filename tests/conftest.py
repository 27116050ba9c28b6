"""pytest setup: float32-exact matmuls, fixtures, and the seed of the randomised tests.

Shared helpers (id distributions, cores, checkers) live in ``tests/helpers.py``.
"""

from __future__ import annotations

import itertools
import os
import shutil
import tempfile
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

#: One compilation cache for the run, shared by pytest-xdist's workers (the environment carries
#: its path to them): a program another test or worker compiled already (the same collection
#: call from another test's lambda, an eager op on the same shape) is loaded instead of compiled.
#: Made fresh for each run and removed at its end, so nothing outlives it.
_OWN_CACHE = "FLOWTT_TEST_COMPILE_CACHE" not in os.environ
if _OWN_CACHE:
    os.environ["FLOWTT_TEST_COMPILE_CACHE"] = tempfile.mkdtemp(prefix="flowtt_jax_test_xla_")
jax.config.update("jax_compilation_cache_dir", os.environ["FLOWTT_TEST_COMPILE_CACHE"])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--slow",
        action="store_true",
        help="also run the tests marked slow (long property and size runs; CI runs them: -m slow --slow)",
    )


#: Moved from the default run to ``slow`` to keep the default run short (#51: <= 4 minutes
#: on 2 cores), each the longest of its kind (7-28 s on 2 cores); CI's slow run keeps them.
#: The default run keeps a faster sibling of each: the reference (or the kernels') twin or the
#: other parametrisation, the smaller collection of the same path, the single-device check.
MOVED_TO_SLOW = (
    "tests/test_group_op.py::test_collection_packs_groups_and_matches_single_ops",
    "tests/test_group_op.py::test_gradients_match_per_table_loop[ffi]",
    "tests/test_group_op.py::test_forward_matches_per_table_loop[False-ffi]",
    "tests/test_group_op.py::test_out_of_range_ids_follow_the_policy_per_table[zero-ffi]",
    "tests/test_group_op.py::test_batch_major_is_the_transposed_output_and_gradient[ffi]",
    "tests/test_group_op.py::test_layout_packs_and_slices_back",
    "tests/test_sharding_collection.py::test_oob_error_over_four_devices",
    "tests/test_memory_policy.py::test_no_call_form_has_a_host_callback_and_overflow_is_counted",
    "tests/test_memory_policy.py::test_budget_choice_fits_by_the_estimate_and_by_xla[0.6]",
    "tests/test_golden.py::test_exact_integer_bags_equal_the_float64_reference[cpu]",
    "tests/test_golden.py::test_exact_integer_group_equals_the_float64_reference[cpu]",
    "tests/test_sharding.py::test_ops_inside_a_users_shard_map_with_check_vma",
    "tests/test_collection_jagged.py::test_jagged_equals_dict_call_bitwise[False]",
    "tests/test_collection_jagged.py::test_unpooled_rows_are_each_tables_rows",
    "tests/test_collection_stacked.py::test_stacked_equals_the_feature_dict[auto-None]",
    "tests/test_nnx.py::test_collection_mixes_tt_and_dense",
    "tests/test_collection_stacked.py::test_stacked_equals_the_feature_dict[reference-None]",
    "tests/test_embedding_bag.py::test_check_grads_reference",
)


@pytest.hookimpl(tryfirst=True)  # before ``-m slow`` selects by marker
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    moved = set(MOVED_TO_SLOW)
    for item in items:
        if item.nodeid in moved:
            item.add_marker(pytest.mark.slow)
    if config.getoption("--slow"):
        return
    skip = pytest.mark.skip(reason="slow: run with --slow (CI does)")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


def pytest_unconfigure(config: pytest.Config) -> None:
    if _OWN_CACHE:
        shutil.rmtree(os.environ["FLOWTT_TEST_COMPILE_CACHE"], ignore_errors=True)


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
