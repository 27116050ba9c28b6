"""Many TT tables of one shape group: packed cores and one on-device plan for all of them.

A *shape group* is a set of 3-core TT tables with the same column shape and ranks
(``docs/batched_contract.md``). Their cores are stored packed per core index, table
``t``'s core k being rows ``[core_offsets[k][t], core_offsets[k][t+1])`` of the packed
core, so a step never concatenates cores. ``make_group_plan`` sorts every (table, id)
of a batch once and hands the kernels explicit packed core-row indices: one launch
per stage serves the whole group. Where they fit int32, the sort keys are *prefix
keys* ``S * (prefix_base[t] + id // p3_t) + id % p3_t`` (``S = max_t p3_t``): their order is
the (table, id) order and ``key // S`` is the (table, i1, i2) prefix group, so the
single-table plan op gives the groups too.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from flowtt_jax.kernels.plan import GroupPlan, Plan, changes, make_plan, runs
from flowtt_jax.tt import reference
from flowtt_jax.tt.spec import TTSpec

__all__ = ["GroupLayout", "GroupPlan", "make_group_plan", "window_plan"]

_INT32_MAX = 2**31 - 1
_UINT32_MAX = 2**32 - 1


@dataclasses.dataclass(frozen=True)
class GroupLayout:
    """Static layout of a shape group: per-table specs and where each table's cores sit
    in the packed cores. Hashable (a static argument under ``jit``)."""

    specs: tuple[TTSpec, ...]

    def __post_init__(self) -> None:
        specs = tuple(self.specs)
        object.__setattr__(self, "specs", specs)
        if not specs:
            raise ValueError("a shape group needs at least one table")
        first = specs[0]
        for t, s in enumerate(specs):
            if len(s.row_shape) != 3:
                raise ValueError(f"table {t}: the batched op takes 3-core tables, got {len(s.row_shape)}")
            if s.col_shape != first.col_shape or s.ranks != first.ranks:
                raise ValueError(
                    f"table {t}: col_shape {s.col_shape} / ranks {s.ranks} differ from table 0's "
                    f"{first.col_shape} / {first.ranks}: tables of one group share both"
                )

    @property
    def num_tables(self) -> int:
        return len(self.specs)

    @property
    def dim(self) -> int:
        return self.specs[0].embedding_dim

    @property
    def core_offsets(self) -> tuple[tuple[int, ...], ...]:
        """Per core index k: ``T + 1`` row offsets of the tables in the packed core k."""
        return tuple(
            tuple(int(x) for x in np.concatenate([[0], np.cumsum([s.row_shape[k] for s in self.specs])]))
            for k in range(3)
        )

    @property
    def row_base(self) -> tuple[int, ...]:
        """``T + 1`` offsets of the tables in one key space of padded rows (prod(row_shape))."""
        sizes = [math.prod(s.row_shape) for s in self.specs]
        return tuple(int(x) for x in np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)]))

    @property
    def prefix_keys(self) -> tuple[int, tuple[int, ...]] | None:
        """``(S, prefix_base)`` of the prefix keys: ``S = max_t p3_t`` and the ``T + 1`` offsets
        of the tables' (i1, i2) prefixes (exclusive cumsum of p1 * p2); None when the key
        space ``S * prefix_base[-1]`` passes int32."""
        sizes = [s.row_shape[0] * s.row_shape[1] for s in self.specs]
        base = tuple(int(x) for x in np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)]))
        extent = max(s.row_shape[2] for s in self.specs)
        return (extent, base) if extent * base[-1] <= _INT32_MAX else None

    def tb_plan_meta(self) -> tuple[np.ndarray, int, bool, int]:
        """``(meta [8, T] int32, extent, row_keys, num_keys)`` of the plan op
        ``flowtt_tb_plan``: per table N, p2, p3, the packed core offsets o1, o2, o3, the
        prefix base and the low 32 bits of ``row_base``; the key form: prefix keys
        (``extent = S = max_t p3_t``, key space ``S * sum_t p1_t * p2_t``), or row keys
        ``row_base[t] + id`` where only those fit 32 bits (one radix pass and half the key
        bytes fewer on the GPU than 64-bit keys); keys past 32 bits sort as uint64."""
        sizes = [s.row_shape[0] * s.row_shape[1] for s in self.specs]
        base = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)])
        if base[-1] > _INT32_MAX:
            raise ValueError(f"a shape group of {base[-1]} (i1, i2) prefixes: at most 2^31 - 1")
        offs = self.core_offsets
        row_base = np.asarray(self.row_base, np.int64)
        meta = np.stack(
            [
                [s.num_embeddings for s in self.specs],
                [s.row_shape[1] for s in self.specs],
                [s.row_shape[2] for s in self.specs],
                offs[0][:-1],
                offs[1][:-1],
                offs[2][:-1],
                base[:-1],
                (row_base[:-1] & _UINT32_MAX).astype(np.uint32).view(np.int32),
            ]
        ).astype(np.int32)
        extent = max(s.row_shape[2] for s in self.specs)
        prefix_keys = extent * int(base[-1])
        row_keys = prefix_keys > _UINT32_MAX + 1 and int(row_base[-1]) <= _UINT32_MAX + 1
        return meta, extent, row_keys, int(row_base[-1]) if row_keys else prefix_keys

    def packed_shapes(self) -> tuple[tuple[int, ...], ...]:
        """Shapes of the packed cores: ``[sum_t p_k, r_{k-1}, q_k, r_k]``."""
        s0 = self.specs[0]
        return tuple(
            (self.core_offsets[k][-1], s0.ranks[k], s0.col_shape[k], s0.ranks[k + 1]) for k in range(3)
        )

    def table_cores(self, packed: Sequence[jax.Array], t: int) -> tuple[jax.Array, ...]:
        """Table ``t``'s cores ``[p_k, r_{k-1}, q_k, r_k]``: static slices of the packed cores."""
        offs = self.core_offsets
        return tuple(c[offs[k][t] : offs[k][t + 1]] for k, c in enumerate(packed))

    def pack(self, tables: Sequence[Sequence[jax.Array]]) -> tuple[jax.Array, ...]:
        """Packed cores from per-table cores (for init, import and tests, not per step)."""
        if len(tables) != self.num_tables:
            raise ValueError(f"expected {self.num_tables} tables' cores, got {len(tables)}")
        for t, (cores, spec) in enumerate(zip(tables, self.specs)):
            shapes = tuple(tuple(c.shape) for c in cores)
            if shapes != spec.core_shapes:
                raise ValueError(f"table {t}: core shapes {shapes} != spec's {spec.core_shapes}")
        return tuple(jnp.concatenate([cores[k] for cores in tables], axis=0) for k in range(3))

    def table_arrays(self) -> dict[str, jax.Array]:
        """Per-table int32 metadata [T]: rows, p2, p3 and the packed core offsets."""
        offs = self.core_offsets
        return {
            "num_rows": jnp.asarray([s.num_embeddings for s in self.specs], jnp.int32),
            "p2": jnp.asarray([s.row_shape[1] for s in self.specs], jnp.int32),
            "p3": jnp.asarray([s.row_shape[2] for s in self.specs], jnp.int32),
            "o1": jnp.asarray(offs[0][:-1], jnp.int32),
            "o2": jnp.asarray(offs[1][:-1], jnp.int32),
            "o3": jnp.asarray(offs[2][:-1], jnp.int32),
        }


def _sorted_unique(layout: GroupLayout, ids: jax.Array, tables: jax.Array, sort_plan):
    """``(perm, inverse, run_offsets, num_unique, unique table [n], unique id [n])``."""
    n = ids.shape[0]
    base = layout.row_base
    if base[-1] <= _INT32_MAX:
        # One int32 key per position: table base + id (only the needed bits are sorted).
        keys = jnp.asarray(base[:-1], jnp.int32)[tables] + ids
        p = sort_plan(keys, 1, base[-1])
        num_unique = p.counts[0]
        # the table of unique u: that of its first occurrence (past num_unique: masked later)
        ut = tables[p.perm[jnp.minimum(p.run_offsets[:n], n - 1)]]
        uid = p.unique_ids - jnp.asarray(base[:-1], jnp.int32)[ut]
        return p.perm, p.inverse, p.run_offsets, num_unique, ut, uid
    iota = jnp.arange(n, dtype=jnp.int32)
    if base[-1] <= _UINT32_MAX:
        # uint32 keys (XLA's sort; one radix sort of key-value pairs on the GPU)
        keys = jnp.asarray(base[:-1], jnp.uint32)[tables] + ids.astype(jnp.uint32)
        sk, perm = jax.lax.sort((keys, iota), num_keys=1, is_stable=True)
        new = changes(sk)
    else:
        # past 32 bits: two stable sorts (by id, then by table) give the (table, id) order
        _, by_id = jax.lax.sort((ids, iota), num_keys=1, is_stable=True)
        _, perm = jax.lax.sort((tables[by_id], by_id), num_keys=1, is_stable=True)
        st, sid = tables[perm], ids[perm]
        new = changes(st) | changes(sid)
    uidx, run_offsets = runs(new, jnp.int32(n))
    num_unique = uidx[-1] + 1
    inverse = jnp.zeros((n,), jnp.int32).at[perm].set(uidx, unique_indices=True)
    first = perm[jnp.minimum(run_offsets[:n], n - 1)]
    return perm, inverse, run_offsets, num_unique, tables[first], ids[first]


def _reference_sort_plan(keys: jax.Array, last_extent: int, num_keys: int) -> Plan:
    return make_plan(keys, last_extent)


def _prefix_key_plan(
    layout: GroupLayout,
    prefix_keys: tuple[int, tuple[int, ...]],
    ids: jax.Array,
    tables: jax.Array,
    sort_plan,
) -> GroupPlan:
    """The plan from one ``sort_plan`` of the prefix keys: its runs and prefix groups are
    the (table, id) uniques and the (table, i1, i2) groups."""
    n = ids.shape[0]
    meta = layout.table_arrays()
    extent, base = prefix_keys
    div, rem = jax.lax.div, jax.lax.rem  # live operands are >= 0: truncation is floor division
    prefix_base = jnp.asarray(base[:-1], jnp.int32)
    p3 = meta["p3"][tables]
    p = sort_plan((prefix_base[tables] + div(ids, p3)) * extent + rem(ids, p3), extent, extent * base[-1])
    num_unique, num_groups = p.counts[0], p.counts[1]
    iota = jnp.arange(n, dtype=jnp.int32)
    # the table of unique u: that of its first occurrence
    ut = tables[p.perm[jnp.minimum(p.run_offsets[:n], n - 1)]]
    u_i3 = jnp.where(iota < num_unique, meta["o3"][ut] + rem(p.unique_ids, extent), 0)
    head = jnp.minimum(p.group_offsets[:n], n - 1)  # first unique index of each group
    gt = ut[head]
    local = div(p.unique_ids[head], extent) - prefix_base[gt]  # i1 * p2 + i2 in table gt
    p2 = meta["p2"][gt]
    g_live = iota < num_groups
    g_i1 = jnp.where(g_live, meta["o1"][gt] + div(local, p2), 0)
    g_i2 = jnp.where(g_live, meta["o2"][gt] + rem(local, p2), 0)
    return GroupPlan(p.perm, p.inverse, p.run_offsets, p.group_offsets, u_i3, g_i1, g_i2, p.counts)


def make_group_plan(layout: GroupLayout, ids: jax.Array, tables: jax.Array, sort_plan=None) -> GroupPlan:
    """Plan for ids [n] int32 (each in ``[0, N_t)`` of its table) and tables [n] int32
    (in ``[0, T)``); n >= 1.

    ``sort_plan(keys, last_extent, num_keys)`` is the single-table ``Plan`` of int32 keys
    in ``[0, num_keys)`` (``flowtt_jax.kernels.ffi.plan``: cub radix sort + scan on the GPU);
    default: the pure-JAX ``make_plan``. A ``GroupLayout`` whose prefix keys fit int32
    takes one ``sort_plan`` for the whole plan; other layouts (``row_base`` keys, e.g. a
    ``DeviceGroupLayout``) rebuild the groups in XLA.
    """
    ids, tables = ids.astype(jnp.int32), tables.astype(jnp.int32)
    sort_plan = sort_plan or _reference_sort_plan
    prefix_keys = layout.prefix_keys if isinstance(layout, GroupLayout) else None
    if prefix_keys is not None:
        return _prefix_key_plan(layout, prefix_keys, ids, tables, sort_plan)
    n = ids.shape[0]
    meta = layout.table_arrays()
    perm, inverse, run_offsets, num_unique, ut, uid = _sorted_unique(layout, ids, tables, sort_plan)
    iota = jnp.arange(n, dtype=jnp.int32)
    live = iota < num_unique
    ut = jnp.where(live, ut, 0)
    uid = jnp.where(live, uid, 0)
    p2, p3 = meta["p2"][ut], meta["p3"][ut]
    prefix = uid // p3
    gidx, group_offsets = runs(live & (changes(ut) | changes(prefix)), num_unique)
    num_groups = gidx[-1] + 1
    head = jnp.minimum(group_offsets[:n], n - 1)  # first unique index of each group
    g_live = iota < num_groups
    g_i1 = jnp.where(g_live, meta["o1"][ut[head]] + prefix[head] // p2[head], 0)
    g_i2 = jnp.where(g_live, meta["o2"][ut[head]] + prefix[head] % p2[head], 0)
    u_i3 = jnp.where(live, meta["o3"][ut] + uid % p3, 0)
    counts = jnp.stack([num_unique, num_groups]).astype(jnp.int32)
    return GroupPlan(
        perm,
        inverse,
        run_offsets,
        group_offsets,
        u_i3.astype(jnp.int32),
        g_i1.astype(jnp.int32),
        g_i2.astype(jnp.int32),
        counts,
    )


def window_plan(plan: GroupPlan, lo: int, size: int) -> GroupPlan:
    """The rows ops' plan of the uniques ``[lo, lo + size)`` of ``plan`` (``lo``, ``size``
    static), capped at num_unique: ``u_i3``, ``g_i1``, ``g_i2`` [size] and ``group_offsets``
    [size + 1] relative to ``lo`` (a prefix group cut by the window's ends keeps its part in
    it), counts (uniques, groups) of the window, 0 past the uniques; ``perm``, ``inverse``
    and ``run_offsets`` are ``plan``'s (the rows ops do not read them). Unique rows of the
    window are ``tb_rows_fwd`` of it; a window past the uniques has counts (0, 0)."""
    num_unique = plan.counts[0]
    iota = jnp.arange(size, dtype=jnp.int32)
    hi = jnp.clip(num_unique, lo, lo + size)
    live = iota < hi - lo

    def group_of(u):  # the prefix group holding unique u (group_offsets is ascending)
        g = jnp.searchsorted(plan.group_offsets, u, side="right", method="scan_unrolled") - 1
        return g.astype(jnp.int32)

    first = jnp.int32(0) if lo == 0 else group_of(jnp.int32(lo))
    num_groups = jnp.where(hi > lo, group_of(hi - 1) - first + 1, 0).astype(jnp.int32)
    g_live = iota < num_groups

    def take(x, start, fill=0):
        return jnp.take(x, start + iota, mode="fill", fill_value=fill)

    # past the groups: clipped to the window's end (so is the fill)
    offsets = jnp.take(
        plan.group_offsets, first + jnp.arange(size + 1, dtype=jnp.int32), mode="fill", fill_value=_INT32_MAX
    )
    return GroupPlan(
        plan.perm,
        plan.inverse,
        plan.run_offsets,
        (jnp.clip(offsets, lo, hi) - lo).astype(jnp.int32),
        jnp.where(live, take(plan.u_i3, lo), 0),
        jnp.where(g_live, take(plan.g_i1, first), 0),
        jnp.where(g_live, take(plan.g_i2, first), 0),
        jnp.stack([hi - lo, num_groups]).astype(jnp.int32),
    )


def unique_groups(plan: GroupPlan) -> jax.Array:
    """Prefix group of every unique index [n] int32 (past num_unique: the last group)."""
    n = plan.u_i3.shape[0]
    g = jnp.searchsorted(
        plan.group_offsets[1:], jnp.arange(n, dtype=jnp.int32), side="right", method="scan_unrolled"
    )
    return jnp.minimum(g, jnp.maximum(plan.counts[1] - 1, 0)).astype(jnp.int32)


def plan_rows(packed: Sequence[jax.Array], plan: GroupPlan) -> jax.Array:
    """The contract's op 1 in ``jax.numpy``: unique rows [n, D] (0 past num_unique).

    The oracle of ``flowtt_tb_rows_fwd``; its ``jax.vjp`` is that of ``flowtt_tb_rows_bwd``.
    """
    g1, g2, g3 = packed
    ug = unique_groups(plan)
    rows = reference.contract([g1[plan.g_i1[ug]], g2[plan.g_i2[ug]], g3[plan.u_i3]])
    live = jnp.arange(rows.shape[0]) < plan.counts[0]
    return jnp.where(live[:, None], rows, 0)
