"""Out-of-range id policy: ``"error" | "clip" | "zero"``, and the ids' dtypes.

- ``"error"``: concrete ids raise ``ValueError``; traced ids add a
  ``checkify.check`` (wrap the jitted function in ``checkify.checkify``).
- ``"clip"``: ids are clamped into ``[0, N)``.
- ``"zero"`` (default): an out-of-range id contributes a zero row (its weight is 0, and
  a position of weight 0 is never read: a non-finite row 0 cannot leak into it); it
  still counts towards a bag's length for ``mean`` / ``sqrtn``.

Whatever the policy, ids handed to kernels are int32 in ``[0, N)``.

Every integer dtype is accepted. Ids are compared with N after a saturating cast to
int32 (int8/int16/uint8/uint16 widen exactly; wider ids above 2^31 - 1 or below -2^31
become those bounds, which no table reaches: they stay out of range and ``"clip"``
sends them to the nearest end). Host ids (numpy arrays, Python ints and lists) that do
not fit JAX's default integer type -- int64 values past int32 while ``jax_enable_x64``
is off, which ``jnp.asarray`` would wrap silently -- are saturated the same way before
JAX sees them (``as_ids``): ``"error"`` names them, ``"zero"`` and ``"clip"`` apply.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify

from flowtt_jax.inputs.csr import saturate_int32

__all__ = [
    "OOB_POLICIES",
    "apply_oob",
    "apply_table_oob",
    "as_ids",
    "host_ids",
    "park_dropped",
    "saturate_int32",
]

OOB_POLICIES = ("error", "clip", "zero")

_I32 = np.iinfo(np.int32)


def _check_policy(policy: str) -> None:
    if policy not in OOB_POLICIES:
        raise ValueError(f"oob must be one of {OOB_POLICIES}, got {policy!r}")


def _check_integer(dtype, name: str = "ids") -> None:
    if not jnp.issubdtype(dtype, jnp.integer):
        raise TypeError(f"{name} must be an integer array, got dtype {dtype}")


def as_ids(ids, policy: str, name: str = "ids") -> jax.Array:
    """``ids`` as a JAX integer array, without JAX's silent wrap-around of host ids.

    JAX arrays and tracers pass unchanged. Host ids whose values do not fit the dtype
    JAX would give them (int64 / uint64 past int32 / uint32 while ``jax_enable_x64`` is
    off) are out of range of every table: ``policy == "error"`` raises ``ValueError``
    naming them, else they are saturated to the int32 bounds (still out of range).
    ``name`` names the argument in errors.
    """
    _check_policy(policy)
    if isinstance(ids, jax.Array):
        _check_integer(ids.dtype, name)
        return ids
    return jnp.asarray(host_ids(ids, policy, name))


def host_ids(ids, policy: str = "zero", name: str = "ids") -> np.ndarray:
    """Host ids as numpy in a dtype JAX keeps as is: int64 / uint64 values past int32 while
    ``jax_enable_x64`` is off (which ``jnp.asarray`` or ``jax.device_put`` would wrap: 2^32 + 5
    to 5) saturated to the int32 bounds, so they stay out of range of every table
    (``policy == "error"``: ``ValueError`` naming them)."""
    host = np.asarray(ids)
    _check_integer(host.dtype, name)
    if jax.dtypes.canonicalize_dtype(host.dtype).itemsize < host.dtype.itemsize:
        wide = (host < _I32.min) | (host > _I32.max)
        if np.any(wide):
            if policy == "error":
                bad = host[wide]
                raise ValueError(
                    f"{bad.size} value(s) of {name} do not fit in int32 (jax_enable_x64 is off), so "
                    f"they are out of range of any table, e.g. {bad[:5].tolist()}"
                )
            host = np.clip(host, _I32.min, _I32.max)
        host = host.astype(np.int32)
    return host


def apply_oob(ids: jax.Array, num_embeddings: int, policy: str) -> tuple[jax.Array, jax.Array | None]:
    """Returns ``(int32 ids in [0, N), valid)``; ``valid`` is a bool mask for "zero", else None.

    ``ids``: a JAX integer array of any integer dtype (``as_ids`` first for host input).
    """
    _check_policy(policy)
    _check_integer(ids.dtype)
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
    """``apply_oob`` for positions of several tables: ids [n] of any integer dtype, tables
    [n] int32 table indices, num_rows [T] each table's N. Returns ``(int32 ids in
    [0, N_t), valid)``, ``valid`` a bool mask for ``"zero"``, else None. ``table_names``
    (T names) name the table in ``"error"``'s messages; ``live`` [n] bool: the positions
    ``"error"`` checks (None: all; a position in no bag of this call, e.g. another pack's or
    a static-capacity tail, is not this call's to refuse); ``where``: ``(bag_ids [n], batch,
    feature names)`` of feature-major bags, so the message names the feature and example."""
    _check_policy(policy)
    _check_integer(ids.dtype)
    limit = jnp.asarray(num_rows)[tables]
    ids32 = saturate_int32(ids)  # any int dtype: out-of-range ids stay out of range
    valid = (ids32 >= 0) & (ids32 < limit)
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
    clipped = jnp.clip(ids32, 0, limit - 1)
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
