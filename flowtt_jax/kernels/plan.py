"""On-device FlowTT plan: group ids by sort, all shapes static (size nnz).

Sorting ids sorts them by prefix (mixed radix, first digit most significant), so
unique ids and unique prefix groups are runs of the sorted ids. ``make_plan`` is
pure ``jax.numpy`` / ``jax.lax``: it jits, vmaps and never leaves the device.
``flowtt_jax.kernels.ffi.plan`` builds the same plan with one FFI call (``flowtt_plan``: C++ on
CPU, cub radix sort + scan on CUDA). See ``docs/op_contract.md`` for the meaning
of each field.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

__all__ = ["GroupPlan", "Plan", "make_plan"]


class Plan(NamedTuple):
    """Grouping of ``n`` ids; every field is int32.

    perm [n]: positions sorted by id (stable).
    inverse [n]: position -> unique index.
    unique_ids [n]: ascending unique ids, then padding (0).
    run_offsets [n+1]: occurrences of unique u are perm[run_offsets[u]:run_offsets[u+1]].
    group_offsets [n+1]: prefix group g is unique indices [group_offsets[g], group_offsets[g+1]).
    counts [2]: (num_unique, num_groups).

    The forward-only plan (``ffi.plan(..., forward_only=True)``, what a forward without
    gradient reads) has ``perm`` and ``run_offsets`` of shape [0], the other fields as here.
    """

    perm: jax.Array
    inverse: jax.Array
    unique_ids: jax.Array
    run_offsets: jax.Array
    group_offsets: jax.Array
    counts: jax.Array


class GroupPlan(NamedTuple):
    """The plan of ``docs/batched_contract.md``; every field int32.

    perm [n], inverse [n], run_offsets [n+1], group_offsets [n+1] as the single-table
    plan (keys in (table, id) order); u_i3 [n]: packed g3 row per unique; g_i1, g_i2 [n]:
    packed g1 / g2 rows per prefix group; counts [2]: (num_unique, num_groups).
    """

    perm: jax.Array
    inverse: jax.Array
    run_offsets: jax.Array
    group_offsets: jax.Array
    u_i3: jax.Array
    g_i1: jax.Array
    g_i2: jax.Array
    counts: jax.Array


def _starts_to_offsets(is_start: jax.Array, rank: jax.Array, total: jax.Array) -> jax.Array:
    """Indices where ``is_start`` holds, compacted, padded with ``total``: shape [n+1].

    ``rank`` is ``cumsum(is_start) - 1`` (the caller has it already).
    """
    n = is_start.shape[0]
    slot = jnp.where(is_start, rank, n + 1)  # n + 1: dropped
    offsets = jnp.full((n + 1,), total, jnp.int32)
    return offsets.at[slot].set(jnp.arange(n, dtype=jnp.int32), mode="drop", unique_indices=True)


def changes(keys: jax.Array) -> jax.Array:
    """[n] bool: where sorted ``keys`` [n] start a new run (always at 0)."""
    return jnp.concatenate([jnp.ones((1,), bool), keys[1:] != keys[:-1]])


def runs(starts: jax.Array, total: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(run index of every position [n], run start offsets [n+1] padded with total)`` for
    ``starts`` [n] bool (where a run starts; 0 starts one unless masked out)."""
    idx = (jnp.cumsum(starts, dtype=jnp.int32) - 1).astype(jnp.int32)
    return idx, _starts_to_offsets(starts, idx, total)


def make_plan(ids: jax.Array, last_extent: int) -> Plan:
    """Plan for flat int32 ``ids`` [n] (n >= 1, values in range).

    ``last_extent`` is p_d, the extent of the last core: the prefix of id i is
    ``i // p_d`` (for 3 cores, the pair (i1, i2)). One sort, two prefix sums, three
    scatters of distinct indices and one gather.
    """
    n = ids.shape[0]
    iota = jnp.arange(n, dtype=jnp.int32)
    sorted_ids, perm = jax.lax.sort((ids.astype(jnp.int32), iota), num_keys=1, is_stable=True)
    uidx, run_offsets = runs(changes(sorted_ids), jnp.int32(n))  # unique index per sorted position
    num_unique = uidx[-1] + 1
    inverse = jnp.zeros((n,), jnp.int32).at[perm].set(uidx, unique_indices=True)
    live = iota < num_unique
    unique_ids = jnp.where(live, sorted_ids[jnp.minimum(run_offsets[:n], n - 1)], 0)
    gidx, group_offsets = runs(live & changes(unique_ids // last_extent), num_unique)
    counts = jnp.stack([num_unique, gidx[-1] + 1])
    return Plan(perm, inverse, unique_ids, run_offsets, group_offsets, counts)
