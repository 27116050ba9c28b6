"""Unique-row capacities: how many unique (table, id) rows one pass of the table-batched op
holds, and what happens past it.

The op's largest activations are the unique rows ``f32[U, D]`` and their gradient. XLA
needs static shapes, so they are sized by a *capacity* ``C`` (static) rather than by the
ids ``n`` (``U <= n``, typically 8-25 % of ``n`` on recommender traces): pass ``k`` computes
and pools the uniques ``[k*C, (k+1)*C)`` and, in the backward, their core gradients, which
are summed over the passes in pass order (deterministic; equal to one pass within float
rounding). There are ``ceil(n / C)`` passes, each past the first costing a few launches that
return at once while ``U <= C``; a batch with more uniques than ``C`` (an *overflow*) runs
the extra passes: outputs and gradients stay exact, and the overflow is reported
(``CapacityOverflowWarning`` once per process and capacity, ``overflow_count()``), never
truncated.

Where the capacity comes from (``TableConfig.max_unique_ids``, the op's
``unique_capacity``): ``measure_unique_ids`` on sample batches, times a margin.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable, Sequence

import numpy as np

__all__ = [
    "CapacityOverflowWarning",
    "capacity_passes",
    "measure_unique_ids",
    "overflow_count",
    "report_overflow",
]

#: The most passes one call compiles (``ceil(n / capacity)``).
MAX_PASSES = 64

_SEEN: set[tuple[str, int]] = set()
_COUNT = [0]


class CapacityOverflowWarning(UserWarning):
    """A batch had more unique rows than its capacity: the op ran extra passes (exact, slower)."""


def capacity_passes(num_ids: int, capacity: int | None) -> tuple[int, int]:
    """``(rows a pass holds, passes)`` for ``num_ids`` ids at ``capacity`` (None or at least
    ``num_ids``: one pass of ``num_ids``)."""
    if capacity is None or capacity >= num_ids:
        return num_ids, 1
    if capacity < 1:
        raise ValueError(f"unique_capacity must be >= 1, got {capacity}")
    passes = math.ceil(num_ids / capacity)
    if passes > MAX_PASSES:
        raise ValueError(
            f"unique_capacity {capacity} for {num_ids} ids: {passes} passes, at most {MAX_PASSES} "
            f"(each is compiled); use at least {math.ceil(num_ids / MAX_PASSES)}"
        )
    return capacity, passes


def overflow_count() -> int:
    """Calls (this process) whose unique rows exceeded their capacity."""
    return _COUNT[0]


def report_overflow(num_unique, capacity: int, what: str) -> None:
    """Host side of the op's overflow check (``jax.debug.callback``): counts and warns once
    per ``(what, capacity)`` when ``num_unique > capacity``."""
    num_unique = int(np.asarray(num_unique))
    if num_unique <= capacity:
        return
    _COUNT[0] += 1
    if (what, capacity) in _SEEN:
        return
    _SEEN.add((what, capacity))
    warnings.warn(
        f"{what}: {num_unique} unique rows in a batch, capacity {capacity}: ran "
        f"{math.ceil(num_unique / capacity)} passes (exact, slower). Raise the capacity "
        "(TableConfig.max_unique_ids / unique_capacity; flowtt_jax.capacity.measure_unique_ids).",
        CapacityOverflowWarning,
        stacklevel=2,
    )


def measure_unique_ids(
    batches: Iterable[dict[str, tuple]],
    feature_tables: dict[str, str],
    margin: float = 1.2,
) -> dict[str, int]:
    """The capacity of each table from sample batches: the most unique ids any batch looked
    up in it (over all of its features), times ``margin``, rounded up to a multiple of 64.

    ``batches``: dicts ``{feature: (ids, offsets)}`` or ``{feature: ids}`` (host or device
    arrays; ids of every bag); ``feature_tables``: ``{feature: table name}``. A table no
    batch touched gets 64. Pass the result as ``TableConfig.max_unique_ids``.
    """
    if margin < 1:
        raise ValueError(f"margin must be >= 1, got {margin}")
    most: dict[str, int] = dict.fromkeys(feature_tables.values(), 0)
    for batch in batches:
        unknown = sorted(set(batch) - set(feature_tables))
        if unknown:
            raise KeyError(f"measure_unique_ids: features {unknown} have no table in feature_tables")
        ids_of: dict[str, list[np.ndarray]] = {}
        for feature, value in batch.items():
            ids = value[0] if isinstance(value, Sequence) and not hasattr(value, "shape") else value
            ids_of.setdefault(feature_tables[feature], []).append(np.asarray(ids).ravel())
        for table, parts in ids_of.items():
            most[table] = max(most[table], int(np.unique(np.concatenate(parts)).size))
    return {t: max(64, -(-math.ceil(u * margin) // 64) * 64) for t, u in most.items()}
