"""Table-batched TT bags: every feature of a shape group in one plan and one launch per stage.

``tt_embedding_bag_group`` is FBGEMM's table-batched embedding bag with TT tables: one
flat ids array, feature-major offsets ``[F*B + 1]`` (bag b of feature f is
``ids[offsets[f*B + b] : offsets[f*B + b + 1]]``), optional per-id weights and a static
feature -> table map (features may share a table), over the packed cores of a
``GroupLayout``. The pipeline: each position's bag, table and out-of-range policy
(``flowtt_tb_bags``, one pass), per-feature pooling weights -> one sort of all (table,
id) keys (``flowtt_tb_plan``, the plan of ``make_group_plan``) -> unique rows of every
table (``flowtt_tb_rows_fwd``) -> fixed-order pooling of all ``F*B`` bags (the
single-table ``flowtt_bag_pool_fwd``), under one ``jax.custom_vjp`` whose backward gives
the packed core gradients (``flowtt_tb_rows_bwd``, bitwise reproducible) and the weights'.
A group of one table takes the single-table kernels instead (``ops.fused_bag``: T = 1 is
the single-table op).

``impl``: ``"auto"`` (the kernels when built and the group's shapes are supported, else
the reference), ``"ffi"`` (require them), ``"reference"`` (per-position gathers in
``jax.numpy``: the "TT from XLA ops" baseline).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from flowtt_jax.fallback import warn_reference
from flowtt_jax.inputs.bag import MODES, packed_bags, scale_by_modes
from flowtt_jax.inputs.oob import as_ids
from flowtt_jax.kernels import ffi
from flowtt_jax.kernels.group_plan import GroupLayout, GroupPlan, make_group_plan
from flowtt_jax.kernels.plan import Plan
from flowtt_jax.ops.single import choose_impl as choose_single_table_impl
from flowtt_jax.ops.single import fused_bag
from flowtt_jax.tt import reference

__all__ = [
    "tt_embedding_bag_group",
    "pooled_group",
    "choose_impl",
    "kernels_unsupported_reason",
]

IMPLS = ("auto", "ffi", "reference")
_TARGETS = ("flowtt_tb_bags", "flowtt_tb_plan", "flowtt_tb_rows_fwd", "flowtt_tb_rows_bwd")


def kernels_unsupported_reason(layout: GroupLayout) -> str | None:
    """Why the batched kernels cannot run this group on the default backend, or None."""
    if not ffi.available():
        return "the compiled extension (_flowtt_cpu) is not built"
    platform = "gpu" if jax.default_backend() == "gpu" else "cpu"
    if not all(ffi.has_target(t, platform) for t in _TARGETS):
        return f"this build has no table-batched kernels (flowtt_tb_rows_*) for {platform}"
    if platform == "gpu":
        return ffi.cuda_tb_unsupported_reason(layout.packed_shapes())
    return None


def _f32(shape) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, jnp.float32)


def _plan_args(plan: GroupPlan):
    return plan.u_i3, plan.g_i1, plan.g_i2, plan.group_offsets, plan.counts


def _rows_fwd(packed, plan: GroupPlan, dim: int) -> jax.Array:
    return ffi.call("flowtt_tb_rows_fwd", _f32((plan.u_i3.shape[0], dim)), *packed, *_plan_args(plan))


def _rows_bwd(packed, d_rows, plan: GroupPlan):
    outs = tuple(_f32(c.shape) for c in packed)
    return tuple(ffi.call("flowtt_tb_rows_bwd", outs, *packed, d_rows, *_plan_args(plan)))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _group_bags(layout, weighted, batch, packed, weights, ids, tables, offsets, bag_ids):
    return _group_bags_fwd(layout, weighted, batch, packed, weights, ids, tables, offsets, bag_ids)[0]


def _plan(layout, ids, tables) -> GroupPlan:
    """The plan op ``flowtt_tb_plan`` for a ``GroupLayout``; other layouts (a table-wise
    ``DeviceGroupLayout``) sort with ``flowtt_plan`` and build the groups in XLA."""
    if isinstance(layout, GroupLayout):
        return ffi.tb_plan(ids, tables, *layout.tb_plan_meta())
    return make_group_plan(layout, ids, tables, ffi.plan)


def _group_bags_fwd(layout, weighted, batch, packed, weights, ids, tables, offsets, bag_ids):
    plan = _plan(layout, ids, tables)
    rows = _rows_fwd(packed, plan, layout.dim)
    out = ffi.pool_fwd(rows, plan.inverse, weights, offsets, batch)
    return out, (packed, weights, bag_ids, plan, ffi.rows_residual(rows, weighted))


def _group_bags_bwd(layout, weighted, batch, res, dout):
    packed, weights, bag_ids, plan, rows = res
    single = Plan(plan.perm, plan.inverse, plan.u_i3, plan.run_offsets, plan.group_offsets, plan.counts)
    out_rows = batch_major_rows(bag_ids, dout.shape[0], batch)  # dout's row of each position's bag
    d_rows, d_weights = ffi.pool_bwd(dout, rows, weights, out_rows, single, with_d_weights=weighted)
    d_packed = _rows_bwd(packed, d_rows, plan)
    if d_weights is None:
        d_weights = jnp.zeros_like(weights)
    return d_packed, d_weights, None, None, None, None


_group_bags.defvjp(_group_bags_fwd, _group_bags_bwd)


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


def _reference_bags(layout: GroupLayout, packed, weights, ids, tables, bag_ids, num_bags):
    """Bags [num_bags, D] by per-position gathers of the packed cores (no plan)."""
    meta = layout.table_arrays()
    p2, p3 = meta["p2"][tables], meta["p3"][tables]
    prefix = ids // p3
    i1 = meta["o1"][tables] + prefix // p2
    i2 = meta["o2"][tables] + prefix % p2
    i3 = meta["o3"][tables] + ids % p3
    g1, g2, g3 = packed
    rows = jnp.einsum("nxa,naqb,nbz->nxqz", g1[i1, 0], g2[i2], g3[i3, :, :, 0])
    rows = rows.reshape(ids.shape[0], -1)
    return reference.pool(rows, weights, bag_ids, num_bags)


def feature_modes(mode: str | Sequence[str], num_features: int) -> tuple[str, ...]:
    """One pooling mode per feature from ``mode`` (one for all, or a sequence of F)."""
    modes = (mode,) * num_features if isinstance(mode, str) else tuple(mode)
    if len(modes) != num_features:
        raise ValueError(f"mode: one per feature ({num_features}), got {len(modes)}")
    for m in modes:
        if m not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {m!r}")
    return modes


def choose_impl(impl: str, layout: GroupLayout, dtypes) -> str:
    """``"ffi"`` or ``"reference"`` for ``impl`` in ``IMPLS`` (``ValueError`` when ``"ffi"``
    cannot run; ``"auto"`` on the reference warns once per reason, ``flowtt_jax.fallback``)."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if impl == "reference":
        return impl
    reason = kernels_unsupported_reason(layout)
    if reason is None and not all(d in (jnp.float32, jnp.bfloat16, jnp.float16) for d in dtypes):
        reason = f"the kernels take float32/bfloat16/float16 cores, got {[str(d) for d in dtypes]}"
    if impl == "ffi" and reason:
        raise ValueError(f"impl='ffi': {reason} (use impl='reference')")
    if reason:
        warn_reference(reason, "the table-batched op (tt_embedding_bag_group, TTEmbeddingCollection)")
    return "reference" if reason else "ffi"


def tt_embedding_bag_group(
    packed: Sequence[jax.Array],
    layout: GroupLayout,
    ids: jax.Array,
    offsets: jax.Array,
    feature_tables: Sequence[int],
    *,
    weights: jax.Array | None = None,
    mode: str | Sequence[str] = "sum",
    oob: str = "zero",
    impl: str = "auto",
    dtype: jnp.dtype | None = None,
    batch_major: bool = False,
) -> jax.Array:
    """Pooled bags of every feature of a shape group: ``[F, B, D]`` in ``dtype``, or
    ``[B, F, D]`` with ``batch_major`` (FBGEMM's layout: the pooling kernel writes it, so a
    model that wants ``[B, F*D]`` needs no transpose, nor its transpose in the backward).

    Args:
      packed: the group's packed cores (``GroupLayout.packed_shapes()``).
      layout: static ``GroupLayout`` of the group's T tables.
      ids: ids [n] of any integer dtype, each local to its feature's table (host int64
        ids past int32 without x64 are out of range, not wrapped: ``flowtt_jax.oob``).
      offsets: int [F*B + 1], feature-major CSR (non-decreasing; concrete offsets are
        checked, traced ones clamped into a valid CSR like ``tt_embedding_bag``'s, or
        ``checkify``-checked with ``oob="error"``).
      feature_tables: static table index in ``[0, T)`` per feature (F entries).
      weights: optional float per-id weights [n] (differentiable); a weight of exactly 0
        skips its position (a non-finite row gives 0, not NaN).
      mode: ``"sum" | "mean" | "sqrtn"``, or one per feature; an empty bag gives zeros.
      oob: ``"error" | "clip" | "zero"`` against each id's own table.
      impl: ``"auto" | "ffi" | "reference"`` (the kernels: one reverse-mode derivative;
        forward mode and higher orders need ``"reference"``).
      dtype: output dtype (default: the cores'); accumulation is float32 at least.
    """
    packed = tuple(packed)
    shapes = tuple(tuple(c.shape) for c in packed)
    if shapes != layout.packed_shapes():
        raise ValueError(f"packed core shapes {shapes} != the layout's {layout.packed_shapes()}")
    feature_tables = tuple(int(t) for t in feature_tables)
    num_features = len(feature_tables)
    if num_features == 0 or not all(0 <= t < layout.num_tables for t in feature_tables):
        raise ValueError(
            f"feature_tables must be table indices in [0, {layout.num_tables}), got {feature_tables}"
        )
    offsets = jnp.asarray(offsets)
    if offsets.ndim != 1 or (offsets.shape[0] - 1) % num_features:
        raise ValueError(
            f"offsets must be [F*B + 1] with F = {num_features} features, got shape {offsets.shape}"
        )
    batch = (offsets.shape[0] - 1) // num_features
    modes = feature_modes(mode, num_features)
    impl = choose_impl(impl, layout, [c.dtype for c in packed])
    out_dtype = packed[0].dtype if dtype is None else dtype
    dim = layout.dim
    ids = as_ids(ids, oob)
    if ids.ndim != 1:
        raise ValueError(f"ids must be a flat int array [n], got {ids.dtype}{list(ids.shape)}")
    out_shape = (batch, num_features, dim) if batch_major else (num_features, batch, dim)
    if ids.shape[0] == 0 or batch == 0:
        return jnp.zeros(out_shape, out_dtype)

    num_rows = layout.table_arrays()["num_rows"]
    bags, tables = packed_bags(ids, offsets, weights, feature_tables, num_rows, oob, kernel=impl == "ffi")
    w = scale_by_modes(bags.weights, bags.offsets, bags.bag_ids, modes, batch)

    out = pooled_group(
        packed,
        layout,
        bags.ids,
        tables,
        bags.offsets,
        bags.bag_ids,
        w,
        weighted=weights is not None,
        impl=impl,
        batch=batch if batch_major else 0,
    )
    return out.reshape(out_shape).astype(out_dtype)


def pooled_group(
    packed: Sequence[jax.Array],
    layout: GroupLayout,
    ids: jax.Array,
    tables: jax.Array,
    offsets: jax.Array,
    bag_ids: jax.Array,
    weights: jax.Array,
    *,
    weighted: bool,
    impl: str,
    batch: int = 0,
) -> jax.Array:
    """Weighted bag sums ``[num_bags, D]`` (float32, float64 cores stay float64) of
    prepared inputs: ids [n] int32 in range of their tables [n] int32, valid CSR
    ``offsets [num_bags + 1]``, ``bag_ids [n]`` in ``[0, num_bags)`` and effective weights
    [n] (modes and dropped ids folded in); n >= 1. ``weighted`` (static): the weights'
    gradient is wanted; ``impl``: ``"ffi"`` or ``"reference"`` (as ``choose_impl`` gives);
    ``batch`` (static): 0, row j is bag j; else ``batch`` divides num_bags, the bags are
    feature-major (``f*batch + b``) and the rows batch-major (``b*F + f``).
    """
    c32 = tuple(c.astype(jnp.promote_types(c.dtype, jnp.float32)) for c in packed)
    num_bags = offsets.shape[0] - 1
    if batch and num_bags % batch:
        raise ValueError(f"batch {batch} does not divide the {num_bags} bags")
    if impl == "reference":
        out = _reference_bags(layout, c32, weights.astype(c32[0].dtype), ids, tables, bag_ids, num_bags)
        return to_batch_major(out, batch)
    ffi.check_kernel_nnz(ids.shape[0])
    axes = ffi.varying_axes(c32, weights, ids, tables, offsets, bag_ids)  # ffi.py: inside shard_map
    c32, weights = ffi.to_varying((c32, weights), axes)
    weights = weights.astype(jnp.float32)
    with ffi.explain_ad_errors():
        if _takes_single_table_kernels(layout, c32):
            return to_batch_major(fused_bag(weighted, c32, weights, ids, offsets, bag_ids), batch)
        return _group_bags(layout, weighted, batch, c32, weights, ids, tables, offsets, bag_ids)


def _takes_single_table_kernels(layout, packed) -> bool:
    """A group of one table runs on the single-table kernels (``ops.fused_bag``, so the
    forward without a gradient is their chunked ``flowtt_bag_fwd``, as for
    ``tt_embedding_bag``): those kernels are tuned for one table's ids (T = 1 is S1), the
    table-batched ones pay for the many-table bookkeeping. Only where the packed cores are
    exactly that table's cores: not a device's slot of a table-wise layout
    (``DeviceGroupLayout``: cores padded to the largest table of the slot, row shapes that
    differ from device to device)."""
    if not isinstance(layout, GroupLayout) or layout.num_tables != 1:
        return False
    if tuple(c.shape for c in packed) != tuple(layout.specs[0].core_shapes):
        return False
    return choose_single_table_impl("auto", packed, warn=False) == "ffi"
