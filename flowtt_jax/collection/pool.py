"""One pooling call per pack (Flax-free; used by ``collection.layout``): the bags a
``collection.batch.PackBatch`` holds, pooled by ``ops.pooled`` (a TT shape group's
table-batched op, or the single-table op for a TT table of another core count) or by
one gather and segment sum (dense tables), and the capacity overflow flags of the TT
calls, collected for the caller to count on the device.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp

from flowtt_jax.collection.cache import pool_cached, route
from flowtt_jax.collection.packs import TablePack
from flowtt_jax.collection.sparse_rows import gather_rows
from flowtt_jax.inputs.normalise import CanonicalBags
from flowtt_jax.ops.pooled import choose_impl, pooled, to_batch_major
from flowtt_jax.tt import reference

__all__ = ["call_counters", "note_out_of_range", "pack_impl", "pool_batch", "pool_packed"]


#: The innermost ``call_counters`` list of the call being traced (None: none open).
_FLAGS: contextvars.ContextVar[list | None] = contextvars.ContextVar("flowtt_call_counters", default=None)


@contextlib.contextmanager
def call_counters() -> Iterator[list[tuple[str, Any, jax.Array]]]:
    """Collects the device counters of the pooling traced inside, for a caller in the same
    trace to count: ``("overflow", first table's name, bool[])`` of every TT pooling call
    (``pool_packed``) and ``("out_of_range", table names, int32 [T])`` of every batch
    (``note_out_of_range``); a call opens its own (a nested one, e.g. inside a ``shard_map``,
    keeps its entries)."""
    flags: list[tuple[str, Any, jax.Array]] = []
    token = _FLAGS.set(flags)
    try:
        yield flags
    finally:
        _FLAGS.reset(token)


def note_out_of_range(names: tuple[str, ...], counts: jax.Array) -> None:
    """Adds a batch's out-of-range ids per table (``names``) to the open ``call_counters``."""
    flags = _FLAGS.get()
    if flags is not None:
        flags.append(("out_of_range", names, counts))


def _dim(pack: TablePack, arrays) -> int:
    return arrays[0].shape[-1] if pack.kind == "dense" else pack.tables[0].features


def _acc_dtype(arrays):
    return jnp.promote_types(arrays[0].dtype, jnp.float32)


def pack_impl(pack: TablePack, arrays, impl: str) -> str:
    """``"ffi"`` or ``"reference"`` for the pack (``"reference"`` for a dense pack)."""
    if pack.kind == "dense":
        return "reference"
    return choose_impl(impl, arrays, None if pack.kind == "single" else pack.layout)


def pool_packed(
    pack: TablePack,
    arrays,
    packed: CanonicalBags,
    tables,
    weighted: bool,
    impl: str,
    batch: int = 0,
    name: str = "",
    cache: tuple[jax.Array, jax.Array] | None = None,
):
    """``[num_bags, D]`` float32 (float64 params stay float64): the bags of ``packed``
    (in range of their ``tables``) pooled in one call; ``batch`` as ``ops.pooled``'s
    (0: row j is bag j; else batch-major rows of feature-major bags); ``name``: the pack's
    parameter name (a dense pack's rows are gathered by ``sparse_rows.gather_rows``);
    ``cache``: a TT pack's hot-row cache block and hot ids (``collection.cache``): its hits
    are pooled from the block and weigh 0 in the kernels."""
    num_bags = packed.offsets.shape[0] - 1
    if packed.ids.shape[0] == 0 or num_bags == 0:
        return jnp.zeros((num_bags, _dim(pack, arrays)), _acc_dtype(arrays))
    which = pack_impl(pack, arrays, impl)
    if pack.kind == "dense":
        row_base = jnp.asarray(pack.row_offsets[:-1], jnp.int32)[tables]
        rows = gather_rows(name, arrays[0], row_base + packed.ids)  # a sparse table's through a tape
        rows = rows.astype(jnp.promote_types(rows.dtype, jnp.float32))
        # a weight of 0 adds nothing
        return to_batch_major(reference.pool(rows, packed.weights, packed.bag_ids, num_bags), batch)
    single = pack.kind == "single"
    cached = None
    if cache is not None:
        hit, slot = route(pack, cache[1], None if len(pack.tables) == 1 else tables, packed.ids)
        cached = pool_cached(cache[0], hit, slot, packed.weights, packed.bag_ids, num_bags)
        packed = packed._replace(weights=jnp.where(hit, 0, packed.weights))
    out, overflowed = pooled(
        arrays,
        packed.ids,
        packed.offsets,
        packed.bag_ids,
        packed.weights,
        weighted=weighted,
        impl=which,
        layout=None if single else pack.layout,
        tables=None if single else tables,
        batch=batch,
        unique_capacity=pack.capacity_for(packed.ids.shape[0]),
        ids_per_pass=pack.ids_per_pass,
        return_overflow=True,
    )
    flags = _FLAGS.get()
    if flags is not None:
        flags.append(("overflow", pack.tables[0].name, overflowed))
    return out if cached is None else out + to_batch_major(cached, batch).astype(out.dtype)


def pool_batch(
    pack: TablePack,
    arrays: tuple[jax.Array, ...],
    name: str,
    cache: tuple[jax.Array, jax.Array] | None,
    b: Any,
    impl: str,
    dtype: Any,
    *,
    batch_major: bool = False,
    cast: bool = True,
) -> jax.Array:
    """A ``collection.batch.PackBatch`` ``b`` of ``pack`` (its parameters ``arrays``, the first
    named ``name``; its hot-row ``cache``) pooled (``pool_packed``; batch-major where asked),
    in ``dtype`` (None: the parameters'; ``cast=False``: the pooling's own float32 or
    float64); its out-of-range counts noted (``note_out_of_range``)."""
    note_out_of_range(tuple(t.name for t in pack.tables), b.out_of_range)
    batch = b.batch if batch_major else 0
    out = pool_packed(pack, arrays, b.bags, b.tables, b.weighted, impl, batch, name, cache)
    return out.astype(arrays[0].dtype if dtype is None else dtype) if cast else out
