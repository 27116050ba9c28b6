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
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import numpy as np

__all__ = ["batch_counts", "capacity_passes", "feature_ids", "measure_unique_ids"]

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


def _feature_ids(value: Any, feature: str) -> tuple[np.ndarray, int]:
    """``(the ids a feature's input looks up, its bags)`` for every documented input form:
    ids ``[B]`` / ``[B, L]``, ``(ids, offsets [B + 1])``, or a dict with ``"ids"`` and one of
    ``"offsets"`` (ids outside the bags not counted), ``"segment_ids"`` + ``"num_bags"``,
    ``"mask"`` (masked ids not counted), optional ``"weights"``."""
    if isinstance(value, tuple):
        value = {"ids": value[0], "offsets": value[1]}
    if not isinstance(value, Mapping):
        ids = np.asarray(value)
        if ids.ndim not in (1, 2):
            raise ValueError(f"feature {feature!r}: ids must be [B] or [B, L], got shape {ids.shape}")
        return ids.ravel(), ids.shape[0]
    if "ids" not in value:
        raise ValueError(f"feature {feature!r}: a dict input needs 'ids', got keys {sorted(value)}")
    ids = np.asarray(value["ids"])
    if value.get("offsets") is not None:
        offsets = np.asarray(value["offsets"]).astype(np.int64)
        lo, hi = (int(offsets[0]), int(offsets[-1])) if offsets.size else (0, 0)
        return ids.ravel()[lo:hi], max(offsets.shape[0] - 1, 0)
    if value.get("segment_ids") is not None:
        num = int(value.get("num_bags") or 0)
        seg = np.asarray(value["segment_ids"]).ravel()
        return ids.ravel()[(seg >= 0) & (seg < num)], num
    if value.get("mask") is not None:
        return ids[np.asarray(value["mask"], bool)].ravel(), ids.shape[0]
    return ids.ravel(), ids.shape[0] if ids.ndim else 1


def _jagged_features(batch: Any) -> dict[str, tuple[np.ndarray, int]]:
    """A ``KeyedJagged``'s ``{feature: (its ids, bags)}`` (its ``keys`` name the features)."""
    if batch.keys is None:
        raise ValueError("a KeyedJagged sample batch needs keys (the feature names) to be measured")
    ids = np.asarray(batch.ids).ravel()
    num = len(batch.keys)
    if batch.lengths is not None:
        lengths = np.asarray(batch.lengths).astype(np.int64).reshape(num, -1)
        offsets = np.concatenate([[0], np.cumsum(lengths)])
    else:
        offsets = np.asarray(batch.offsets).astype(np.int64)
    bags = (offsets.shape[0] - 1) // max(num, 1)
    return {k: (ids[offsets[f * bags] : offsets[(f + 1) * bags]], bags) for f, k in enumerate(batch.keys)}


def feature_ids(
    batches: Iterable[Any], feature_tables: Mapping[str, str], what: str
) -> Iterator[dict[str, tuple[np.ndarray, int]]]:
    """Each sample batch as ``{feature: (its ids flat on the host, its bags)}``: feature dicts
    in any input form the collections take (``_feature_ids``; host or device arrays) or
    ``KeyedJagged`` batches with keys. A feature ``feature_tables`` lacks raises ``KeyError``
    naming ``what``."""
    for batch in batches:
        if not isinstance(batch, Mapping) and hasattr(batch, "ids") and hasattr(batch, "keys"):
            features = _jagged_features(batch)  # a KeyedJagged
        elif isinstance(batch, Mapping):
            features = {f: _feature_ids(v, f) for f, v in batch.items()}
        else:
            raise TypeError(
                f"{what}: a sample batch is a feature dict or a KeyedJagged, got {type(batch).__name__}"
            )
        unknown = sorted(set(features) - set(feature_tables))
        if unknown:
            raise KeyError(f"{what}: features {unknown} are read by no table")
        yield features


def batch_counts(
    batches: Iterable[Any], feature_tables: Mapping[str, str], what: str
) -> tuple[int, dict[str, int], dict[str, int]]:
    """``(bags per feature, ids per feature, unique ids per table)``, each the most over
    sample ``batches``: feature dicts in any input form the collections take (``_feature_ids``;
    host or device arrays) or ``KeyedJagged`` batches with keys. ``feature_tables``:
    ``{feature: table name}``; a feature it lacks raises ``KeyError`` naming ``what`` and the
    features."""
    batch_size, ids, unique = 0, {}, {}
    for features in feature_ids(batches, feature_tables, what):
        per_table: dict[str, list[np.ndarray]] = {}
        for feature, (flat, bags) in features.items():
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

    ``batches``: feature dicts in any input form the collections take, or ``KeyedJagged``
    batches with keys; ``feature_tables``: ``{feature: table name}``. A table no batch
    touched gets 64. Pass the result as
    ``TableConfig.max_unique_ids``.
    """
    if margin < 1:
        raise ValueError(f"margin must be >= 1, got {margin}")
    _, _, unique = batch_counts(batches, feature_tables, "measure_unique_ids")
    most = {t: unique.get(t, 0) for t in feature_tables.values()}
    return {t: max(64, -(-math.ceil(u * margin) // 64) * 64) for t, u in most.items()}
