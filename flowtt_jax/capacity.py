"""Unique-row capacities: how many unique (table, id) rows one pass of the table-batched op
holds, and what happens past it.

The op's largest activations are the unique rows ``f32[U, D]`` and their gradient. XLA
needs static shapes, so they are sized by a *capacity* ``C`` (static) rather than by the
ids ``n`` (``U <= n``, typically 8-25 % of ``n`` on recommender traces): pass ``k`` computes
and pools the uniques ``[k*C, (k+1)*C)`` and, in the backward, their core gradients, which
are summed over the passes in pass order (deterministic; equal to one pass within float
rounding). There are ``ceil(n / C)`` passes, each past the first costing a few launches that
return at once while ``U <= C``; a batch with more uniques than ``C`` (an *overflow*) runs
the extra passes: outputs and gradients stay exact, never truncated, and the overflow is
counted on the device (no host round trip in the step): per shape group in the
collections' ``overflow_counts`` (``TTEmbeddingCollection.overflows()``; linen's ``"stats"``
collection), by the op with ``return_overflow=True``.

Where the capacity comes from (``TableConfig.max_unique_ids``, the op's
``unique_capacity``): ``measure_unique_ids`` on sample batches, times a margin.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

__all__ = ["batch_counts", "capacity_passes", "measure_unique_ids"]

#: The most passes one call compiles (``ceil(n / capacity)``).
MAX_PASSES = 64


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


def batch_counts(
    batches: Iterable[Mapping[str, Any]], feature_tables: Mapping[str, str], what: str
) -> tuple[int, dict[str, int], dict[str, int]]:
    """``(bags per feature, ids per feature, unique ids per table)``, each the most over
    sample ``batches``: dicts ``{feature: ids [B, L]}`` or ``{feature: (ids, offsets [B + 1])}``
    (host or device arrays). ``feature_tables``: ``{feature: table name}``; a feature it
    lacks raises ``KeyError`` naming ``what`` and the features."""
    batch_size, ids, unique = 0, {}, {}
    for batch in batches:
        unknown = sorted(set(batch) - set(feature_tables))
        if unknown:
            raise KeyError(f"{what}: features {unknown} are read by no table")
        per_table: dict[str, list[np.ndarray]] = {}
        for feature, value in batch.items():
            if isinstance(value, tuple):
                flat, bags = np.asarray(value[0]).ravel(), np.asarray(value[1]).shape[0] - 1
            else:
                flat, bags = np.asarray(value).ravel(), np.asarray(value).shape[0]
            batch_size = max(batch_size, bags)
            ids[feature] = max(ids.get(feature, 0), flat.size)
            per_table.setdefault(feature_tables[feature], []).append(flat)
        for table, parts in per_table.items():
            unique[table] = max(unique.get(table, 0), int(np.unique(np.concatenate(parts)).size))
    return batch_size, ids, unique


def measure_unique_ids(
    batches: Iterable[Mapping[str, Any]],
    feature_tables: Mapping[str, str],
    margin: float = 1.2,
) -> dict[str, int]:
    """The capacity of each table from sample batches: the most unique ids any batch looked
    up in it (over all of its features), times ``margin``, rounded up to a multiple of 64.

    ``batches``: as ``batch_counts`` takes them; ``feature_tables``: ``{feature: table
    name}``. A table no batch touched gets 64. Pass the result as
    ``TableConfig.max_unique_ids``.
    """
    if margin < 1:
        raise ValueError(f"margin must be >= 1, got {margin}")
    _, _, unique = batch_counts(batches, feature_tables, "measure_unique_ids")
    most = {t: unique.get(t, 0) for t in feature_tables.values()}
    return {t: max(64, -(-math.ceil(u * margin) // 64) * 64) for t, u in most.items()}
