"""Stage 3 of the input pipeline, **oob**: each position's table and the out-of-range id
policy against it, ``"error" | "clip" | "zero"``; and the bag ops' entry through stages 1-3
(``prepare_bags``: one table; ``packed_bags``: a packed batch of several tables).

- ``"error"``: concrete ids raise ``ValueError``; traced ids add a
  ``checkify.check`` (wrap the jitted function in ``checkify.checkify``).
- ``"clip"``: ids are clamped into ``[0, N)``.
- ``"zero"`` (default): an out-of-range id contributes a zero row (its weight is 0, and
  a position of weight 0 is never read: a non-finite row 0 cannot leak into it); it
  still counts towards a bag's length for ``mean`` / ``sqrtn``.

Whatever the policy, ids handed to kernels are int32 in ``[0, N)``; a dropped position
(weight 0: masked, in no bag, out of range under ``"zero"``) is parked on a kept one's id.

Every integer dtype is accepted. Ids are compared with N after a saturating cast to
int32 (int8/int16/uint8/uint16 widen exactly; wider ids above 2^31 - 1 or below -2^31
become those bounds, which no table reaches: they stay out of range and ``"clip"``
sends them to the nearest end). Host ids (numpy arrays, Python ints and lists) that do
not fit JAX's default integer type -- int64 values past int32 while ``jax_enable_x64``
is off, which ``jnp.asarray`` would wrap silently -- are saturated the same way before
JAX sees them (``validate.as_ids``): ``"error"`` names them, ``"zero"`` and ``"clip"`` apply.

On the kernel path (``"clip"`` / ``"zero"``), one ``flowtt_tb_bags`` call gives a packed
batch's valid CSR, bags, tables, policy and parking (``table_oob``), the jax.numpy path its
oracle.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify

from flowtt_jax.inputs.normalise import CanonicalBags, canonical_bags, csr_bags, saturate_int32
from flowtt_jax.inputs.validate import check_bag_form, check_integer, check_mode, check_policy
from flowtt_jax.kernels import ffi

__all__ = [
    "apply_bags_oob",
    "apply_oob",
    "apply_table_oob",
    "count_out_of_range",
    "packed_bags",
    "park_dropped",
    "prepare_bags",
    "table_oob",
]


def apply_oob(ids: jax.Array, num_embeddings: int, policy: str) -> tuple[jax.Array, jax.Array | None]:
    """Returns ``(int32 ids in [0, N), valid)``; ``valid`` is a bool mask for "zero", else None.

    ``ids``: a JAX integer array of any integer dtype (``as_ids`` first for host input).
    """
    check_policy(policy)
    check_integer(ids.dtype)
    ids32 = saturate_int32(ids)
    valid = (ids32 >= 0) & (ids32 < num_embeddings)
    if policy == "error":
        if isinstance(valid, jax.core.Tracer):  # traced ids, or concrete ones under checkify
            checkify.check(
                jnp.all(valid),
                f"ids out of range [0, {num_embeddings}): found {{bad}}",
                bad=ids.reshape(-1)[jnp.argmin(valid.reshape(-1))] if ids.size else 0,
            )
        else:
            bad = np.asarray(ids)[~np.asarray(valid)]
            if bad.size:
                raise ValueError(
                    f"{bad.size} id(s) out of range [0, {num_embeddings}), e.g. {bad[:5].tolist()}"
                )
    clipped = jnp.clip(ids32, 0, num_embeddings - 1)
    if policy == "zero":
        return jnp.where(valid, clipped, 0), valid
    return clipped, None


def apply_table_oob(
    ids: jax.Array,
    tables: jax.Array,
    num_rows: jax.Array,
    policy: str,
    table_names: tuple[str, ...] | None = None,
    *,
    live: jax.Array | None = None,
    where: tuple[jax.Array, int, tuple[str, ...]] | None = None,
) -> tuple[jax.Array, jax.Array | None]:
    """``apply_oob`` for positions of several tables: ids [n] int32, tables
    [n] int32 table indices, num_rows [T] each table's N. Returns ``(int32 ids in
    [0, N_t), valid)``, ``valid`` a bool mask for ``"zero"``, else None. ``table_names``
    (T names) name the table in ``"error"``'s messages; ``live`` [n] bool: the positions
    ``"error"`` checks (None: all; a position in no bag of this call, e.g. another pack's or
    a static-capacity tail, is not this call's to refuse); ``where``: ``(bag_ids [n], batch,
    feature names)`` of feature-major bags, so the message names the feature and example."""
    if ids.dtype != jnp.int32:  # another dtype would compare in a promoted one (uint32: wrapped)
        raise TypeError(f"apply_table_oob takes int32 ids (normalise.saturate_int32), got {ids.dtype}")
    limit = jnp.asarray(num_rows)[tables]
    valid = (ids >= 0) & (ids < limit)
    if policy == "error":
        ok = valid if live is None else valid | ~live
        traced = any(isinstance(x, jax.core.Tracer) for x in (ids, valid, ok))
        if traced:
            names = "" if table_names is None else f" (tables by index: {_name_list(table_names)})"
            first = jnp.argmin(ok) if ids.size else 0
            at, extra = "position {pos} of the packed batch", {}
            if where is not None and ids.size:
                bag_ids, batch, features = where
                at = "feature #{feature} example {example} (position {pos} of the packed batch)"
                names += f"; features by index: {_name_list(features)}"
                extra = dict(feature=bag_ids[first] // max(batch, 1), example=bag_ids[first] % max(batch, 1))
            checkify.check(
                jnp.all(ok),
                "ids out of range of their tables: found {bad} in table #{table} (of {rows} rows) at "
                + at
                + names,
                bad=ids[first] if ids.size else 0,
                table=tables[first] if ids.size else 0,
                rows=limit[first] if ids.size else 0,
                pos=first,
                **extra,
            )
        else:
            bad = np.flatnonzero(~np.asarray(ok))
            if bad.size:
                i = int(bad[0])
                t = int(np.asarray(tables)[i])
                table = f"table {table_names[t]!r}" if table_names is not None else f"table #{t}"
                at = f"position {i} of the packed batch"
                if where is not None:
                    bag_ids, batch, features = where
                    bag = int(np.asarray(bag_ids)[i])
                    at = f"feature {features[bag // max(batch, 1)]!r}, example {bag % max(batch, 1)} ({at})"
                raise ValueError(
                    f"{bad.size} id(s) out of range of their tables, e.g. id {np.asarray(ids)[i]} "
                    f"of {table} ({np.asarray(limit)[i]} rows) at {at}"
                )
    clipped = jnp.clip(ids, 0, limit - 1)
    if policy == "zero":
        return jnp.where(valid, clipped, 0), valid
    return clipped, None


def _name_list(names: tuple[str, ...], most: int = 16) -> str:
    shown = ", ".join(f"#{i} {n!r}" for i, n in enumerate(names[:most]))
    return shown + (f", ... ({len(names)} tables)" if len(names) > most else "")


def park_dropped(ids: jax.Array, live: jax.Array | None, *others: jax.Array):
    """``ids`` [n] with every position where ``live`` is False moved onto the first live
    position's id (``others``, e.g. the positions' tables, move with it).

    A dropped position (weight 0) then adds no unique row of its own: its id's row is
    one the batch reads anyway, so a non-finite row that only dropped ids address
    (row 0 of the ``"zero"`` policy, a padding id) reaches neither the output nor, through
    ``0 * inf`` in the backward, the core gradients. ``live`` None: nothing is dropped.
    Returns ``ids``, or ``(ids, *others)`` when ``others`` are given.
    """
    if live is None or ids.shape[0] == 0:
        return (ids, *others) if others else ids
    first = jnp.argmax(live)  # 0 when nothing is live: then every output is 0 anyway
    moved = tuple(jnp.where(live, x, x[first]) for x in (ids, *others))
    return moved if others else moved[0]


def apply_bags_oob(
    bags: CanonicalBags, ids: jax.Array, valid: jax.Array | None, *others: jax.Array
) -> CanonicalBags | tuple:
    """``bags`` after the ``oob`` policy gave ``(ids, valid)`` for their ids (``apply_oob``,
    or ``apply_table_oob`` for positions of several tables).

    Returns ``CanonicalBags`` whose ids are those int32 ids and whose weights are 0 for the
    ids ``oob="zero"`` drops (they still count towards a bag's length for ``mean`` /
    ``sqrtn``); ``keep`` is False at every dropped position (masked, in no bag, out of
    range under ``"zero"``), whose id is parked on a kept one (``park_dropped``; ``others``,
    e.g. the positions' tables, move with it and come back after the bags).
    """
    w = bags.weights if valid is None else jnp.where(valid, bags.weights, 0.0)
    live = bags.keep if valid is None else (valid if bags.keep is None else valid & bags.keep)
    parked = park_dropped(ids, live, *others)
    if not others:
        return bags._replace(ids=parked, weights=w, keep=live)
    return (bags._replace(ids=parked[0], weights=w, keep=live), *parked[1:])


def count_out_of_range(
    ids: jax.Array,
    offsets: jax.Array,
    keep: jax.Array | None,
    slot_tables: np.ndarray,
    num_rows: jax.Array | np.ndarray,
    batch: int,
    oob: str,
    ends: jax.Array | None = None,
) -> jax.Array:
    """int32 ``[T]``: ids of feature-major bags (``offsets`` over int32 ``ids [n]``, ``batch``
    bags a feature, feature f of table ``slot_tables[f]``, table t of ``num_rows[t]`` rows;
    ``keep``: False where a position is dropped, e.g. masked; ``ends [F]``: where each
    feature's bags end, its positions from there to the next feature's first bag in none)
    out of range of their table, before the policy; zeros under ``oob="error"`` (it raises
    instead). Each position's
    feature from the features' bounds (a scatter of F marks and a cumulative sum), the counts
    from a cumulative sum and a gather of the bounds: no scatter over the ids. The
    collections' default counters."""
    num_tables = len(num_rows)
    n = ids.shape[0]
    if oob == "error" or n == 0 or not len(slot_tables) or batch == 0:
        return jnp.zeros((num_tables,), jnp.int32)
    bounds = jnp.clip(offsets[::batch], 0, n)  # [F + 1]: where each feature's bags start and end
    feature = jnp.cumsum(jnp.zeros((n + 1,), jnp.int32).at[bounds[1:-1]].add(1)[:n], dtype=jnp.int32)
    limit = jnp.asarray(num_rows)[slot_tables][feature]
    bad = (ids < 0) | (ids >= limit)
    if keep is not None:
        bad = bad & keep
    if ends is not None:
        bad = bad & (jax.lax.iota(jnp.int32, n) < ends[feature])
    running = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(bad, dtype=jnp.int32)])
    per_feature = running[bounds[1:]] - running[bounds[:-1]]
    return jax.ops.segment_sum(per_feature, jnp.asarray(slot_tables), num_segments=num_tables)


def _gaps(bag_ids: jax.Array, bounds: jax.Array, batch: int) -> jax.Array:
    """bool ``[n]``: positions (in bags ``bag_ids`` of a ``normalise.PackedCSR`` with ``bounds``)
    past their feature's last bag, in no bag of the user's: one gather of ``[F]`` ends, fused."""
    return jax.lax.iota(jnp.int32, bag_ids.shape[0]) >= bounds[:, -1][bag_ids // max(batch, 1)]


def table_oob(
    bags: CanonicalBags,
    offsets: jax.Array | None,
    slot_tables: np.ndarray,
    num_rows: jax.Array | np.ndarray,
    batch: int,
    oob: str,
    *,
    kernel: bool,
    weights: jax.Array | None = None,
    bounds: jax.Array | None = None,
    table_names: tuple[str, ...] | None = None,
    feature_names: tuple[str, ...] | None = None,
) -> tuple[CanonicalBags, jax.Array, jax.Array]:
    """Feature-major ``bags`` (int32 ids, ``batch`` bags a feature, feature f of table
    ``slot_tables[f]`` of ``num_rows`` rows) after the ``oob`` policy against each position's
    table: ``(CanonicalBags, tables [n] int32, out_of_range [T] int32)`` (the count before
    the policy, ``count_out_of_range``). ``offsets``: the bags' CSR as given (a packed CSR, or
    None for canonical bags; ``bounds``: ``normalise.PackedCSR``'s, its positions in no bag
    dropped: ``_gaps``, or the kernel's ``ends``); with it, ``kernel`` takes one ``flowtt_tb_bags`` call for
    ``"clip"`` / ``"zero"`` (``weights``: the user's, None for none), the same values as the
    jax.numpy path, its oracle. ``"error"`` checks a packed CSR's positions in bags (canonical
    bags: every position) and names the table, feature (``table_names``, ``feature_names``)
    and example."""
    ends = None if bounds is None else bounds[:, -1]
    counted = bags.keep if offsets is None else None  # a packed CSR: its bounds bound the count
    counts = count_out_of_range(bags.ids, bags.offsets, counted, slot_tables, num_rows, batch, oob, ends)
    if bounds is not None and not (kernel and oob != "error"):  # a feature's positions past its bags
        keep = bags.keep & ~_gaps(bags.bag_ids, bounds, batch)
        bags = bags._replace(weights=jnp.where(keep, bags.weights, 0.0), keep=keep)
    if not (kernel and oob != "error" and offsets is not None):
        tables = jnp.asarray(slot_tables, jnp.int32)[bags.bag_ids // max(batch, 1)]
        where = None if feature_names is None else (bags.bag_ids, batch, tuple(feature_names))
        # a packed CSR's positions in no bag are not this call's (another pack's, a padded
        # tail); a feature's own ids in no bag (masked, segments past num_bags) are checked,
        # as tt_embedding_bag checks them
        live = bags.keep if offsets is not None else None
        flat, valid = apply_table_oob(bags.ids, tables, num_rows, oob, table_names, live=live, where=where)
        return (*apply_bags_oob(bags, flat, valid, tables), counts)  # dropped positions add no rows
    # the kernel drops a feature's positions past its bags (``ends``) with the rest
    flat, tables, live, bag_ids, csr = ffi.tb_bags(
        bags.ids, offsets, slot_tables, num_rows, batch, oob == "clip", ends
    )
    # live positions are kept ones: the user weights where live (the canonical bags' own
    # weights would keep XLA's running maximum of the offsets alive)
    w = live if weights is None else jnp.where(live != 0, weights.astype(bags.weights.dtype), 0.0)
    return bags._replace(ids=flat, weights=w, offsets=csr, bag_ids=bag_ids, keep=live != 0), tables, counts


def prepare_bags(
    ids: jax.Array, *, num_embeddings: int, oob: str, mode: str = "sum", **form: Any
) -> CanonicalBags:
    """A bag op's input (``ids`` and ``form``: its bag form keywords and ``weights``) through
    the stages: checked (``check_bag_form``; ``oob="error"`` also checks traced offsets),
    canonical bags with ``mode`` folded in, the ``oob`` policy for a table of
    ``num_embeddings`` rows."""
    check_mode(mode)
    bags = canonical_bags(check_bag_form(ids, **form, policy=oob, check_offsets=oob == "error"), mode)
    return apply_bags_oob(bags, *apply_oob(bags.ids, num_embeddings, oob))


def packed_bags(
    ids: jax.Array,
    offsets: jax.Array,
    weights: jax.Array | None,
    feature_tables: Sequence[int],
    num_rows: jax.Array,
    oob: str,
    *,
    kernel: bool,
) -> tuple[CanonicalBags, jax.Array]:
    """The table-batched op's packed feature-major batch (ids [n] of any integer dtype, n >= 1,
    offsets [F*B + 1], optional weights [n]) through the stages: checked (``check_bag_form``:
    traced offsets ``checkify``-checked under ``oob="error"``), each position's bag, the ``oob``
    policy against its feature's table (``table_oob``: one ``flowtt_tb_bags`` call where
    ``kernel``): ``(CanonicalBags, tables [n] int32)``, weights as given (not the modes')."""
    batch = (np.shape(offsets)[0] - 1) // len(feature_tables)
    form = check_bag_form(ids, offsets=offsets, weights=weights, policy=oob, check_offsets=oob == "error")
    offsets = saturate_int32(jnp.asarray(form.offsets))
    bags = csr_bags(form.ids, offsets, form.weights)
    slot_tables = np.asarray(feature_tables, np.int32)
    bags, tables, _ = table_oob(
        bags, offsets, slot_tables, num_rows, batch, oob, kernel=kernel, weights=form.weights
    )
    return bags, tables
