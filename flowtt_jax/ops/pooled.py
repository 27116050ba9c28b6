"""The one pooling op under every public op: weighted bag sums of prepared bags over one
table's cores or a shape group's packed cores, by the kernels or the reference.

A single table is the T = 1 case of the table-batched op. ``pooled`` takes either one
table's cores (``layout=None``) or a group's packed cores with its static layout
(``GroupLayout``, or a device's slot of a table-wise layout), runs one prologue (promote
to float32, the empty shortcut, the kernels' size check, the casts inside ``shard_map``,
the AD error text) and one ``jax.custom_vjp`` whose static *stage set* picks the kernels:

- ``SingleTable``: the single-table kernels, tuned for one table's ids (S1): the plan
  ``flowtt_plan`` (forward-only without a gradient: no sort where the table's bitmap is
  small), rows ``flowtt_tt_rows_*``; without a gradient the rows and the pooling are one
  op (``flowtt_bag_fwd``) computing the unique rows in chunks of ``bag_chunk_rows``.
  A group of one table whose packed cores are exactly its cores takes them too.
- ``TableBatched``: every table of the group in one plan (``flowtt_tb_plan``, or
  ``make_group_plan`` over ``flowtt_plan`` for a device's slot) and one launch per stage
  (``flowtt_tb_rows_*``).

Both pool with ``flowtt_bag_pool_fwd`` in a fixed order (batch-major rows when ``batch``)
and differentiate once, in reverse mode: core gradients (bitwise reproducible) and the
weights' (only when ``weighted``: then the forward keeps its rows for the backward).
Tables of other than 3 cores, float64 tables and shapes past the platform's kernels run
on the reference (``choose_impl``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from flowtt_jax.capacity import capacity_passes
from flowtt_jax.fallback import warn_reference
from flowtt_jax.kernels import ffi
from flowtt_jax.kernels.group_plan import GroupLayout, make_group_plan
from flowtt_jax.kernels.plan import GroupPlan, Plan
from flowtt_jax.tt import reference

__all__ = [
    "IMPLS",
    "bag_chunk_rows",
    "batch_major_rows",
    "choose_impl",
    "kernels_unsupported_reason",
    "pooled",
    "takes_single_table_kernels",
    "to_batch_major",
]

IMPLS = ("auto", "ffi", "reference")
KERNEL_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
_TB_TARGETS = ("flowtt_tb_bags", "flowtt_tb_plan", "flowtt_tb_rows_fwd", "flowtt_tb_rows_bwd")

#: The no-gradient forward's scratch budget for unique rows, in bytes: it computes and
#: pools ``bag_chunk_rows(D, B)`` float32 rows at a time ...
ROWS_CHUNK_BYTES = 40 << 20
#: ... or this many [B, D] outputs' worth, if more: every chunk after the first reads and
#: writes the whole output again, so chunks of at least 8 outputs keep that traffic under
#: 1/8 of the rows' own (D128 B65536: one chunk of 268 MB instead of 7 of 42 MB).
ROWS_CHUNK_OUTPUTS = 8


def bag_chunk_rows(dim: int, num_bags: int) -> int:
    """``chunk_rows`` of ``flowtt_bag_fwd`` for ``num_bags`` bags of rows of ``dim`` float32:
    the larger of ``ROWS_CHUNK_BYTES`` in rows and ``ROWS_CHUNK_OUTPUTS * num_bags``, at
    least 64."""
    return max(64, ROWS_CHUNK_BYTES // (4 * dim), ROWS_CHUNK_OUTPUTS * num_bags)


def kernels_unsupported_reason(cores: Sequence[Any] | None = None, layout: Any = None) -> str | None:
    """Why the kernels cannot run these cores on the default backend, or None.

    ``cores``: one table's cores (``layout=None``; arrays or shapes with ``.shape`` and
    ``.dtype``), or a shape group's packed cores with its ``layout`` (whose
    ``packed_shapes()`` the platform's table-batched kernels must take; without ``cores``,
    float32 ones of those shapes).
    """
    if cores is None:
        cores = [jax.ShapeDtypeStruct(s, jnp.float32) for s in layout.packed_shapes()]
    dtypes = [c.dtype for c in cores]
    if len(cores) != 3 or not all(d in KERNEL_DTYPES for d in dtypes):
        return (
            f"the kernels take 3 cores of float32, bfloat16 or float16, got {len(cores)} cores "
            f"of {sorted({str(d) for d in dtypes})}"
        )
    if not ffi.available():
        return "the compiled extension (_flowtt_cpu) is not built"
    platform = "gpu" if jax.default_backend() == "gpu" else "cpu"
    if layout is None:
        return ffi.cuda_unsupported_reason([c.shape for c in cores]) if platform == "gpu" else None
    if not all(ffi.has_target(t, platform) for t in _TB_TARGETS):
        return f"this build has no table-batched kernels (flowtt_tb_rows_*) for {platform}"
    return ffi.cuda_unsupported_reason(layout.packed_shapes(), True) if platform == "gpu" else None


def choose_impl(impl: str, cores: Sequence[Any], layout: Any = None, *, warn: bool = True) -> str:
    """``"ffi"`` or ``"reference"`` for ``impl`` in ``IMPLS`` and these cores (as
    ``kernels_unsupported_reason`` takes them): ``"auto"`` takes the kernels where they
    can run, else the reference with one ``ReferenceFallbackWarning`` per reason when
    ``warn`` (``flowtt_jax.fallback``); ``"ffi"`` raises ``ValueError`` where they cannot."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if impl == "reference":
        return impl
    reason = kernels_unsupported_reason(cores, layout)
    if reason is None:
        return "ffi"
    if impl == "ffi":
        raise ValueError(f"impl='ffi': {reason} (use impl='reference')")
    if warn:
        op = "tt_embedding_bag / tt_lookup" if layout is None else "the table-batched op"
        warn_reference(reason, f"{op} (tt_embedding_bag_group, TTEmbeddingCollection)")
    return "reference"


def batch_major_rows(bags: jax.Array, num_bags: int, batch: int) -> jax.Array:
    """Rows of feature-major bags ``f*batch + b`` in the batch-major layout: ``b*F + f`` with
    ``F = num_bags // batch``; ``bags`` as they are when ``batch`` is 0."""
    if batch == 0:
        return bags
    return (bags % batch) * (num_bags // batch) + bags // batch


def to_batch_major(out: jax.Array, batch: int) -> jax.Array:
    """Feature-major bags ``[F*batch, D]`` as ``[batch*F, D]`` (row ``b*F + f``); ``out`` as it
    is when ``batch`` is 0."""
    if batch == 0:
        return out
    return jnp.swapaxes(out.reshape(-1, batch, out.shape[-1]), 0, 1).reshape(out.shape)


@dataclasses.dataclass(frozen=True)
class SingleTable:
    """The single-table kernels' stages over one table's 3 cores (static)."""

    def plan(self, cores, ids, tables, forward_only: bool = False) -> Plan:
        num_rows = math.prod(c.shape[0] for c in cores)
        return ffi.plan(ids, cores[-1].shape[0], num_rows, forward_only)

    def rows_fwd(self, cores, plan) -> jax.Array:
        return ffi.rows_fwd(cores, plan)

    def rows_bwd(self, cores, d_rows, plan) -> tuple[jax.Array, ...]:
        return ffi.rows_bwd(cores, d_rows, plan)

    def forward(self, cores, weights, ids, tables, offsets, batch: int, prev=None):
        """Without a gradient: the forward-only plan and one ``flowtt_bag_fwd`` (added to
        ``prev`` when given); ``(bags, False)``: no capacity to overflow."""
        dim = math.prod(c.shape[2] for c in cores)
        chunk_rows = bag_chunk_rows(dim, offsets.shape[0] - 1)
        plan = self.plan(cores, ids, tables, forward_only=True)
        out = to_batch_major(ffi.bag_fwd(cores, plan, weights, offsets, chunk_rows), batch)
        return (out if prev is None else prev + out), jnp.zeros((), bool)


@dataclasses.dataclass(frozen=True)
class TableBatched:
    """The table-batched kernels' stages over a shape group's packed cores (static), with
    unique rows held ``capacity`` at a time (``flowtt_jax.capacity``; None: all of them)."""

    layout: Any
    capacity: int | None = None

    def plan(self, cores, ids, tables) -> GroupPlan:
        """``flowtt_tb_plan`` for a ``GroupLayout``; other layouts (a table-wise
        ``DeviceGroupLayout``) sort with ``flowtt_plan`` and build the groups in XLA."""
        if isinstance(self.layout, GroupLayout):
            return ffi.tb_plan(ids, tables, *self.layout.tb_plan_meta())
        return make_group_plan(self.layout, ids, tables, ffi.plan)

    def rows_fwd(self, cores, plan, after=None) -> jax.Array:
        return ffi.tb_rows_fwd(cores, plan, self.layout.dim, after)

    def window(self, plan, lo: int, size: int, after=None) -> GroupPlan:
        """The rows ops' plan of the uniques ``[lo, lo + size)`` of ``plan``."""
        return ffi.tb_window(plan, lo, size, after)

    def rows_bwd(self, cores, d_rows, plan) -> tuple[jax.Array, ...]:
        return ffi.tb_rows_bwd(cores, d_rows, plan)

    def forward(self, cores, weights, ids, tables, offsets, batch: int, prev=None):
        return _kernel_bags_fwd(
            self, False, batch, prev is not None, cores, weights, ids, tables, offsets, None, prev
        )[0]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _kernel_bags(stages, weighted, batch, onto, cores, weights, ids, tables, offsets, bag_ids, prev):
    """``(bags [num_bags, D] float32, overflowed bool[])`` by the kernels of ``stages``
    (``pooled``'s arguments, float32 cores and weights); ``overflowed``: the plan had more
    unique rows than the stages' capacity (passes over the uniques ran; exact). ``weighted``
    (static): the weights' gradient is wanted; ``onto`` (static): the bags are added onto
    ``prev`` [num_bags, D] (in place where the pooling writes them), else ``prev`` is None."""
    return stages.forward(cores, weights, ids, tables, offsets, batch, prev)


def _windows(stages, n: int) -> tuple[int, range]:
    """``(rows a pass holds, the passes' first uniques)`` of ``stages`` for ``n`` ids."""
    size, _ = capacity_passes(n, getattr(stages, "capacity", None))
    return size, range(0, n, size)


def _kernel_bags_fwd(stages, weighted, batch, onto, cores, weights, ids, tables, offsets, bag_ids, prev):
    plan = stages.plan(cores, ids, tables)
    size, starts = _windows(stages, ids.shape[0])
    if len(starts) == 1:
        rows = stages.rows_fwd(cores, plan)
        out = ffi.pool_fwd(rows, plan.inverse, weights, offsets, batch, prev=prev)
        return (out, jnp.zeros((), bool)), (cores, weights, bag_ids, plan, ffi.rows_residual(rows, weighted))
    # capacity passes: the rows of uniques [lo, lo + size), pooled onto the output; passes
    # past the uniques return at once on the device. The overflow is a device flag (no host
    # round trip): the caller counts it (collection variables, the op's return_overflow).
    overflowed = plan.counts[0] > size
    out = prev
    for lo in starts:
        # after the previous pass's pooling (a trailing operand the kernels ignore): one
        # pass's [size, D] rows are dead before the next pass's are made (XLA would make
        # every pass's rows first otherwise: they depend on the cores and the plan only)
        rows = stages.rows_fwd(cores, stages.window(plan, lo, size, after=out), after=out)
        out = ffi.pool_fwd(rows, plan.inverse, weights, offsets, batch, lo=lo, counts=plan.counts, prev=out)
    return (out, overflowed), (cores, weights, bag_ids, plan, None)


def _kernel_bags_bwd(stages, weighted, batch, onto, res, cts):
    dout, _ = cts  # the overflow flag's cotangent: float0
    cores, weights, bag_ids, plan, rows = res
    out_rows = batch_major_rows(bag_ids, dout.shape[0], batch)  # dout's row of each position's bag
    size, starts = _windows(stages, weights.shape[0])
    d_cores = d_weights = None
    for lo in starts:  # one pass, or the capacity's: gradients summed in pass order
        sub = plan
        if len(starts) > 1:  # the window made here, after the previous pass (not the forward's)
            sub = stages.window(plan, lo, size, after=dout if d_cores is None else d_cores)
            if weighted:  # the weights' gradient reads the pass's rows again
                rows = stages.rows_fwd(cores, sub, after=d_cores)
        d_rows, d_w = ffi.pool_bwd(
            dout, rows, weights, out_rows, plan, with_d_weights=weighted, lo=lo, m=size, after=d_cores
        )
        grads = stages.rows_bwd(cores, d_rows, sub)
        d_cores = grads if d_cores is None else tuple(a + b for a, b in zip(d_cores, grads))
        d_weights = d_w if d_weights is None else d_weights + d_w
    if d_weights is None:
        d_weights = jnp.zeros_like(weights)
    return d_cores, d_weights, None, None, None, None, dout if onto else None


_kernel_bags.defvjp(_kernel_bags_fwd, _kernel_bags_bwd)


def takes_single_table_kernels(layout: Any, cores: Sequence[jax.Array]) -> bool:
    """Whether a group's packed cores run on the single-table kernels: a ``GroupLayout`` of
    one table whose packed cores are exactly that table's (not a device's slot of a
    table-wise layout: cores padded to the slot's largest table), where those kernels can
    run. They are tuned for one table's ids (T = 1 is S1); the table-batched ones pay for
    the many-table bookkeeping."""
    if not isinstance(layout, GroupLayout) or layout.num_tables != 1:
        return False
    if tuple(c.shape for c in cores) != tuple(layout.specs[0].core_shapes):
        return False
    return choose_impl("auto", cores, warn=False) == "ffi"


def _reference_rows(cores, ids, layout, tables) -> jax.Array:
    """Rows [n, D] by per-position gathers: of one table's d cores, or of a group's packed
    cores (each position's core rows offset by its table's place in the pack)."""
    if layout is None:
        return reference.tt_rows(cores, ids)
    meta = layout.table_arrays()
    p2, p3 = meta["p2"][tables], meta["p3"][tables]
    prefix = ids // p3
    core_rows = (
        meta["o1"][tables] + prefix // p2,
        meta["o2"][tables] + prefix % p2,
        meta["o3"][tables] + ids % p3,
    )
    return reference.contract([c[i] for c, i in zip(cores, core_rows)])


def pooled(
    cores: Sequence[jax.Array],
    ids: jax.Array,
    offsets: jax.Array,
    bag_ids: jax.Array,
    weights: jax.Array,
    *,
    weighted: bool,
    impl: str,
    layout: Any = None,
    tables: jax.Array | None = None,
    batch: int = 0,
    unique_capacity: int | None = None,
    ids_per_pass: int | None = None,
    return_overflow: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Weighted bag sums ``[num_bags, D]`` in float32 (float64 cores stay float64) of
    prepared bags: ids [n] int32 in range of their table, valid CSR ``offsets
    [num_bags + 1]``, ``bag_ids [n]`` in ``[0, num_bags)`` and effective weights [n] (modes
    and dropped ids folded in).

    ``cores``: one table's cores (``layout=None``), or a shape group's packed cores with
    its static ``layout`` and ``tables [n]`` int32 (each position's table). ``weighted``
    (static): the weights' gradient is wanted; ``impl``: ``"ffi"`` or ``"reference"`` (as
    ``choose_impl`` gives); ``batch`` (static): 0, row j is bag j; else ``batch`` divides
    num_bags, the bags are feature-major (``f*batch + b``) and the rows batch-major
    (``b*F + f``); ``unique_capacity`` (static): the unique rows the table-batched kernels
    hold at a time (``flowtt_jax.capacity``; None: n); ``ids_per_pass`` (static): the kernels
    see at most this many ids at a time (``_in_passes``; None: all n). ``return_overflow``:
    also return ``overflowed`` bool[] (on the device): some pass had more unique rows than
    ``unique_capacity`` (the op ran passes over its uniques: exact, slower).
    """
    out, overflowed = _pooled(
        cores,
        ids,
        offsets,
        bag_ids,
        weights,
        weighted,
        impl,
        layout,
        tables,
        batch,
        unique_capacity,
        ids_per_pass,
    )
    return (out, overflowed) if return_overflow else out


def _pooled(cores, ids, offsets, bag_ids, weights, weighted, impl, layout, tables, batch, capacity, per_pass):
    """``pooled``'s ``(bags, overflowed)``."""
    no = jnp.zeros((), bool)
    c32 = tuple(c.astype(jnp.promote_types(c.dtype, jnp.float32)) for c in cores)
    num_bags = offsets.shape[0] - 1
    if batch and num_bags % batch:
        raise ValueError(f"batch {batch} does not divide the {num_bags} bags")
    if ids.shape[0] == 0 or num_bags == 0:  # nothing to pool: zeros, and zero gradients
        dim = math.prod(c.shape[2] for c in cores)
        return jnp.zeros((num_bags, dim), c32[0].dtype), no
    if impl == "reference":
        rows = _reference_rows(c32, ids, layout, tables)
        return to_batch_major(reference.pool(rows, weights.astype(rows.dtype), bag_ids, num_bags), batch), no
    ffi.check_kernel_nnz(ids.shape[0])
    axes = ffi.varying_axes(c32, weights, ids, tables, offsets, bag_ids)  # ffi.py: inside shard_map
    c32, weights = ffi.to_varying((c32, weights), axes)
    single = layout is None or takes_single_table_kernels(layout, c32)
    stages = SingleTable() if single else TableBatched(layout, capacity)
    args = (c32, weights.astype(jnp.float32), ids, tables, offsets, bag_ids)
    with ffi.explain_ad_errors():
        if per_pass is not None and per_pass < ids.shape[0]:
            return _in_passes(stages, weighted, batch, per_pass, *args)
        return _kernel_bags(stages, weighted, batch, False, *args, None)


def _in_passes(stages, weighted, batch, size, cores, weights, ids, tables, offsets, bag_ids):
    """``_kernel_bags`` over the ids ``size`` at a time: pass ``k`` (a ``lax.scan`` step, in
    order) pools positions ``[k*size, (k+1)*size)`` onto the output (a bag cut by a pass's
    end is summed over both passes). Its plan, rows and their gradients are sized by ``size``;
    the backward recomputes each pass's (``jax.checkpoint``) and adds its core gradients in
    reverse pass order, so the step holds one pass's buffers at a time beside the per-id
    inputs. Bitwise reproducible; one pass's result within float rounding. Returns
    ``(bags, overflowed)``: any pass had more uniques than the stages' capacity."""
    n, num_bags = ids.shape[0], offsets.shape[0] - 1
    passes = -(-n // size)

    @jax.checkpoint
    def step(out, k):  # pass k's bags added onto out (in place where the pooling writes them)
        first = k * size
        start = jnp.minimum(first, n - size)  # the last pass's slice ends at n (and overlaps)
        mine = start + jnp.arange(size) >= first  # the overlap is the previous pass's
        cut = lambda x: jax.lax.dynamic_slice_in_dim(x, start, size)  # noqa: E731
        local = jnp.clip(offsets, first, first + size) - start
        args = (jnp.where(mine, cut(weights), 0.0), cut(ids), None if tables is None else cut(tables))
        return _kernel_bags(stages, weighted, batch, True, cores, *args, local, cut(bag_ids), out)

    dim = math.prod(c.shape[2] for c in cores)
    out0 = jnp.zeros((num_bags, dim), jnp.float32)
    out, overflowed = jax.lax.scan(step, out0, jnp.arange(passes, dtype=jnp.int32))
    return out, jnp.any(overflowed)
