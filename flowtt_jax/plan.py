"""On-device FlowTT plan: group ids by sort, all shapes static (size nnz).

Sorting ids sorts them by prefix (mixed radix, first digit most significant), so
unique ids and unique prefix groups are runs of the sorted ids. Everything here
is ``jax.numpy`` / ``jax.lax``: it jits, vmaps and never leaves the device.
See ``docs/op_contract.md`` for the meaning of each field.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

__all__ = ["Plan", "make_plan"]


class Plan(NamedTuple):
    """Grouping of ``n`` ids; every field is int32.

    perm [n]: positions sorted by id (stable).
    inverse [n]: position -> unique index.
    unique_ids [n]: ascending unique ids, then padding (0).
    run_offsets [n+1]: occurrences of unique u are perm[run_offsets[u]:run_offsets[u+1]].
    group_offsets [n+1]: prefix group g is unique indices [group_offsets[g], group_offsets[g+1]).
    counts [2]: (num_unique, num_groups).
    """

    perm: jax.Array
    inverse: jax.Array
    unique_ids: jax.Array
    run_offsets: jax.Array
    group_offsets: jax.Array
    counts: jax.Array


def _starts_to_offsets(is_start: jax.Array, total: jax.Array) -> jax.Array:
    """Indices where ``is_start`` holds, compacted, padded with ``total``: shape [n+1]."""
    n = is_start.shape[0]
    slot = jnp.where(is_start, jnp.cumsum(is_start) - 1, n + 1)  # n + 1: dropped
    offsets = jnp.full((n + 1,), total, jnp.int32)
    return offsets.at[slot].set(jnp.arange(n, dtype=jnp.int32), mode="drop")


def make_plan(ids: jax.Array, last_extent: int) -> Plan:
    """Plan for flat int32 ``ids`` [n] (n >= 1, values in range).

    ``last_extent`` is p_d, the extent of the last core: the prefix of id i is
    ``i // p_d`` (for 3 cores, the pair (i1, i2)).
    """
    n = ids.shape[0]
    iota = jnp.arange(n, dtype=jnp.int32)
    sorted_ids, perm = jax.lax.sort((ids.astype(jnp.int32), iota), num_keys=1, is_stable=True)
    new_id = jnp.concatenate([jnp.ones((1,), bool), sorted_ids[1:] != sorted_ids[:-1]])
    uidx = (jnp.cumsum(new_id) - 1).astype(jnp.int32)  # unique index of each sorted position
    num_unique = uidx[-1] + 1
    inverse = jnp.zeros((n,), jnp.int32).at[perm].set(uidx, unique_indices=True)
    unique_ids = jnp.zeros((n,), jnp.int32).at[jnp.where(new_id, uidx, n)].set(
        sorted_ids, mode="drop"
    )
    run_offsets = _starts_to_offsets(new_id, jnp.int32(n))
    prefix = unique_ids // last_extent
    live = iota < num_unique
    new_group = live & jnp.concatenate([jnp.ones((1,), bool), prefix[1:] != prefix[:-1]])
    group_offsets = _starts_to_offsets(new_group, num_unique)
    counts = jnp.stack([num_unique, new_group.sum(dtype=jnp.int32)])
    return Plan(perm, inverse, unique_ids, run_offsets, group_offsets, counts)
