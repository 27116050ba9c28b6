"""Hot-row caches of TT tables (``TableConfig.cache_rows``; TT-Rec's cache, done as one
more gather inside each pack's call). Flax-free; used by ``collection.layout``.

A pack with caches holds two more arrays: ``{prefix}_cache`` float ``[K, D]`` (trainable:
the cached rows' values) and ``{prefix}_hot`` int32 ``[K]`` (not trainable: which ids they
are), ``K`` the sum of its tables' ``cache_rows``. Table t owns slots
``[cache_offsets[t], cache_offsets[t + 1])``, its hot ids sorted ascending and padded with
``EMPTY`` (an id no table has). A call routes every id on the device: a branchless binary
search of its table's slots (``route``); a hit is pooled from the cache block and takes
weight 0 in the TT kernels (which then add nothing for it, nor give its cores a
gradient), a miss goes to the kernels as before. No host round trip, no shape that
depends on the batch's values.

Which ids are hot: ``hot_ids`` counts sample batches on the host (the ``measure`` way) and
picks each table's most frequent; ``with_hot_ids`` installs them (jittable: a refresh
between steps is one device program) -- an id that stays keeps its trained value, one
that enters starts at its TT row, one that leaves falls back to its TT row (its trained
value is dropped). Until then a table caches its first ``cache_rows`` ids.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from flowtt_jax.capacity import feature_ids
from flowtt_jax.tt import reference

__all__ = [
    "EMPTY",
    "check_hot_ids",
    "first_rows",
    "hot_ids",
    "route",
    "pool_cached",
    "sorted_hot",
    "tt_rows_of",
]

#: A hot-id slot that holds no id (sorts after every id of a table under 2^31 - 1 rows).
EMPTY = np.iinfo(np.int32).max


def route(pack: Any, hot: jax.Array, tables: jax.Array | None, ids: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(hit bool [n], slot int32 [n])``: whether each id (of table ``tables[i]`` of the
    pack, a ``packs.TablePack``; None: table 0) is cached, and its slot in the cache block. A binary search of
    the table's sorted slots, ``ceil(log2(cache_rows + 1))`` gathers of ``hot`` per id."""
    offs = np.asarray(pack.cache_offsets, np.int32)
    if tables is None:
        lo, end = jnp.int32(offs[0]), jnp.int32(offs[1])
    else:
        lo, end = jnp.asarray(offs[:-1])[tables], jnp.asarray(offs[1:])[tables]
    keys = ids.astype(jnp.int32)  # in range (the oob policy ran): under 2^31 - 1
    size, last = end - lo, pack.cache_rows - 1
    for _ in range(int(np.diff(offs).max()).bit_length()):  # lo: first slot with hot >= key
        half = size // 2
        mid = lo + half
        right = hot[jnp.minimum(mid, last)] < keys
        lo = jnp.where(right, mid + 1, lo)
        size = jnp.where(right, size - half - 1, half)
    slot = jnp.minimum(lo, last)
    return (lo < end) & (hot[slot] == keys), slot


def pool_cached(
    cache: jax.Array, hit: jax.Array, slot: jax.Array, weights: jax.Array, bag_ids: jax.Array, num_bags: int
) -> jax.Array:
    """``[num_bags, D]`` float32 (float64 stays): the cached ids' rows pooled into their bags
    (``weights`` where ``hit``, else 0)."""
    rows = cache[slot]
    rows = rows.astype(jnp.promote_types(rows.dtype, jnp.float32))
    return reference.pool(rows, jnp.where(hit, weights, 0), bag_ids, num_bags)


#: ``tt_rows_of`` contracts this many bytes of gathered core slices at a time (the
#: reference gathers ``r q r`` floats per id and core: a 440 k-row cache at rank 64 in one
#: go asked XLA for 71 GB).
ROWS_CHUNK_BYTES = 64 << 20


def tt_rows_of(cores: Sequence[jax.Array], ids: jax.Array) -> jax.Array:
    """Rows ``[k, D]`` (the cores' dtype, float32 accumulation) of the TT table ``cores`` at
    ``ids`` ``[k]``, in chunks of ``ROWS_CHUNK_BYTES`` (one ``lax.map``); ``EMPTY`` slots give
    zero rows."""
    valid = ids != EMPTY
    f32 = tuple(c.astype(jnp.promote_types(c.dtype, jnp.float32)) for c in cores)
    safe = jnp.where(valid, ids, 0)
    per_id = 4 * sum(int(np.prod(c.shape[1:])) for c in cores)
    chunk = max(1, min(ids.shape[0], ROWS_CHUNK_BYTES // per_id))
    pad = -ids.shape[0] % chunk
    parts = jnp.pad(safe, (0, pad)).reshape(-1, chunk)
    dim = int(np.prod([c.shape[2] for c in cores]))
    rows = jax.lax.map(lambda part: reference.tt_rows(f32, part), parts).reshape(-1, dim)[: ids.shape[0]]
    return jnp.where(valid[:, None], rows, 0).astype(cores[0].dtype)


def first_rows(pack: Any) -> jax.Array:
    """The pack's hot ids before any are measured: each table's first ``cache_rows`` ids."""
    return jnp.concatenate([jnp.arange(t.cache_rows, dtype=jnp.int32) for t in pack.tables if t.cache_rows])


def check_hot_ids(ids: Any, size: int, num_rows: int, table: str) -> jax.Array:
    """``ids`` flat (int, any shape; host or device). ``TypeError`` / ``ValueError`` naming
    ``table`` for non-integers, more than ``size`` ids or, concrete, an id outside
    ``[0, num_rows)``."""
    ids = jnp.ravel(jnp.asarray(ids))
    if not jnp.issubdtype(ids.dtype, jnp.integer) and ids.size:  # [] is float: no ids
        raise TypeError(f"table {table!r}: hot ids must be integers, got {ids.dtype}")
    if ids.size > size:
        raise ValueError(f"table {table!r}: {ids.size} hot ids for a cache of {size} rows")
    if not isinstance(ids, jax.core.Tracer) and ids.size:
        host = np.asarray(ids)
        if host.min() < 0 or host.max() >= num_rows:
            raise ValueError(
                f"table {table!r}: hot ids must be in [0, {num_rows}), got {host.min()}..{host.max()}"
            )
    return ids.astype(jnp.int32)


def sorted_hot(ids: Any, size: int, num_rows: int, table: str) -> jax.Array:
    """``ids`` (``check_hot_ids``'; jittable) as a table's hot slots: the unique ids
    ascending, padded with ``EMPTY`` to ``size``; traced ids out of ``[0, num_rows)`` are
    dropped (concrete ones raise)."""
    ids = check_hot_ids(ids, size, num_rows, table)
    ids = jnp.where((ids >= 0) & (ids < num_rows), ids, EMPTY)
    return jnp.unique(ids, size=size, fill_value=EMPTY)


def hot_ids(
    batches: Iterable[Any], tables: Sequence[Any], feature_tables: Mapping[str, str]
) -> dict[str, np.ndarray]:
    """``{table name: its most frequent ids}`` over sample ``batches`` (feature dicts in any
    input form or ``KeyedJagged``s, as ``measure_unique_ids`` takes them), at most
    ``cache_rows`` per cached table (ties: the smaller id); ids out of a table's range are
    not counted. ``feature_tables``: ``{feature: table name}``."""
    caches = {t.name: t for t in tables if getattr(t, "cache_rows", 0)}
    counts: dict[str, dict[int, int]] = {}
    for features in feature_ids(batches, feature_tables, "hot_ids"):
        for feature, (flat, _) in features.items():
            table = feature_tables[feature]
            if table not in caches:
                continue
            flat = flat[(flat >= 0) & (flat < caches[table].num_embeddings)]
            ids, n = np.unique(flat, return_counts=True)
            acc = counts.setdefault(table, {})
            for i, c in zip(ids.tolist(), n.tolist()):
                acc[i] = acc.get(i, 0) + c
    out = {}
    for name, cfg in caches.items():
        acc = counts.get(name, {})
        ranked = sorted(acc.items(), key=lambda kv: (-kv[1], kv[0]))[: cfg.cache_rows]
        out[name] = np.sort(np.asarray([i for i, _ in ranked], np.int64))
    return out
