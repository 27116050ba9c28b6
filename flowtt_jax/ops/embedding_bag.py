"""The public ops: ``tt_embedding_bag``, ``tt_lookup`` (one table) and
``tt_embedding_bag_group`` (every feature of a shape group of tables in one call).

Each prepares its bags (the ``oob`` policy, the bag form's canonical CSR, the pooling
modes folded into the weights: ``flowtt_jax.inputs``) and pools them with the one op
``ops.pooled.pooled`` (a single table is a group of one): on-device plan -> fused
unique-row kernel -> fixed-order pooling, under one ``jax.custom_vjp`` whose backward
gives gradients for every core and for per-id weights.

``impl``: ``"auto"`` (the FFI kernels when the extension is built and the tables have 3
cores of float32, bfloat16 or float16 (computed in float32) that the platform's kernels
support, else the reference, with a warning: ``flowtt_jax.fallback``), ``"ffi"``
(require the kernels), ``"reference"`` (pure jax.numpy). The kernels are differentiable
once, in reverse mode (``jax.grad``, ``jax.vjp``); forward mode and higher orders need
``impl="reference"`` (``flowtt_jax.kernels.ffi``).

Input policies (the same on both paths): ids of any integer dtype (``inputs.oob``);
out-of-range ids by ``oob``; a position of weight exactly 0 (a dropped id, a masked or
out-of-bag position, a zero user weight) is skipped, never multiplied, so a non-finite
row cannot turn it into NaN (its weight's gradient is still the row's dot product with
the bag's gradient); zero bags or zero ids give empty / zero outputs and zero
gradients; at most ``bag.MAX_NNZ`` (2^31 - 2) ids and bags per call.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from flowtt_jax.budget import CANDIDATES, op_bytes, pass_size, resolve_budget, static_count
from flowtt_jax.inputs.normalise import CanonicalBags
from flowtt_jax.inputs.oob import apply_oob, packed_bags, park_dropped, prepare_bags
from flowtt_jax.inputs.pack import scale_by_modes
from flowtt_jax.inputs.validate import MODES, as_ids, check_sizes
from flowtt_jax.kernels.group_plan import GroupLayout
from flowtt_jax.ops.pooled import choose_impl, pooled
from flowtt_jax.tt.spec import TTSpec, as_cores

__all__ = ["tt_embedding_bag", "tt_lookup", "tt_embedding_bag_group", "feature_modes"]


def _kernel_bags_apply(ids, offsets, segment_ids, mask, n_rows: int, oob: str) -> bool:
    """Whether the kernels prepare the bags (``_kernel_bags``): the CSR form with at least
    one id and one bag, an int32 row count, and a policy other than ``"error"`` (whose
    checks are the jax.numpy path's)."""
    if offsets is None or segment_ids is not None or mask is not None or oob == "error":
        return False
    shape_n, shape_b = np.shape(ids), np.shape(offsets)
    return len(shape_n) == 1 and shape_n[0] >= 1 and len(shape_b) == 1 and shape_b[0] >= 2 and n_rows < 2**31


def _kernel_bags(ids, offsets, weights, mode: str, n_rows: int, oob: str) -> CanonicalBags:
    """``prepare_bags``' CSR form by one ``flowtt_tb_bags`` call (one feature of one table:
    each position's bag, the ``oob`` policy, dropped positions parked) and the mode's
    scale: the same values, without the bag index's scatter and scan, the clip and the
    parking as separate XLA kernels."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    num_rows = jnp.asarray([n_rows], jnp.int32)
    bags, _ = packed_bags(as_ids(ids, oob), offsets, weights, (0,), num_rows, oob, kernel=True)
    w = scale_by_modes(bags.weights, bags.offsets, bags.bag_ids, (mode,), bags.offsets.shape[0] - 1)
    return bags._replace(weights=w)


def tt_embedding_bag(
    cores: Sequence[jax.Array],
    ids: jax.Array,
    *,
    offsets: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
    num_bags: int | None = None,
    mask: jax.Array | None = None,
    weights: jax.Array | None = None,
    mode: str = "sum",
    num_embeddings: int | None = None,
    oob: str = "zero",
    impl: str = "auto",
    dtype: jnp.dtype | None = None,
) -> jax.Array:
    """Pooled TT embedding bags: ``[B, D]`` in ``dtype`` (default: the cores' dtype).

    Args:
      cores: a sequence of d cores, core k ``[p_k, r_{k-1}, q_k, r_k]`` (float32, bfloat16
        or float16 for the kernels; float64 on the reference).
      ids: ids of any integer dtype, ``[n]`` with ``offsets`` ([B+1] CSR) or ``segment_ids``
        ([n], with a static int ``num_bags`` >= 0), or padded ``[B, L]`` with optional
        bool ``mask`` [B, L].
      offsets: concrete offsets must be non-decreasing from 0 to n (else ``ValueError``).
        Traced ones are clamped into ``[0, n]`` and made non-decreasing, positions outside
        ``[offsets[0], offsets[B])`` belonging to no bag; with ``oob="error"`` they get a
        ``checkify`` check instead (see ``flowtt_jax.inputs.normalise``).
      weights: optional per-id float weights, same shape as ids (differentiable). A
        weight of exactly 0 skips its position (a non-finite row gives 0, not NaN).
      mode: ``"sum" | "mean" | "sqrtn"``; an empty bag gives zeros.
      num_embeddings: N (defaults to ``prod(row_shape)``); ids outside [0, N) follow ``oob``.
      oob: ``"error" | "clip" | "zero"`` (see ``flowtt_jax.inputs.oob``); ``"error"`` also checks
        traced offsets.
      impl: ``"auto" | "ffi" | "reference"`` (forward mode and second order: reference).
      dtype: output dtype; the contraction and pooling accumulate in float32 (at least)
        whatever the cores' dtype, and cast once at the end.
    """
    cores = as_cores(cores)
    impl = choose_impl(impl, cores)
    n_rows = TTSpec.from_cores(cores, num_embeddings).num_embeddings
    if impl == "ffi" and _kernel_bags_apply(ids, offsets, segment_ids, mask, n_rows, oob):
        bags = _kernel_bags(ids, offsets, weights, mode, n_rows, oob)
    else:
        form = dict(offsets=offsets, segment_ids=segment_ids, num_bags=num_bags, mask=mask, weights=weights)
        bags = prepare_bags(ids, num_embeddings=n_rows, oob=oob, mode=mode, **form)
    out = pooled(
        cores, bags.ids, bags.offsets, bags.bag_ids, bags.weights, weighted=weights is not None, impl=impl
    )
    return out.astype(cores[0].dtype if dtype is None else dtype)


def tt_lookup(
    cores: Sequence[jax.Array],
    ids: jax.Array,
    *,
    num_embeddings: int | None = None,
    oob: str = "zero",
    impl: str = "auto",
    dtype: jnp.dtype | None = None,
) -> jax.Array:
    """Rows of the TT table: int ids of any shape ``[...]`` -> ``[..., D]`` in ``dtype``
    (default: the cores' dtype; computed in float32 at least).

    Same pipeline as ``tt_embedding_bag`` with one bag per id, so duplicate ids
    are computed once and the backward is deterministic. Ids of any integer dtype;
    ``oob`` as there (an ``oob="zero"`` row is exactly 0 even where row 0 is not finite).
    """
    cores = as_cores(cores)
    impl = choose_impl(impl, cores)
    n_rows = TTSpec.from_cores(cores, num_embeddings).num_embeddings
    ids = as_ids(ids, oob)
    check_sizes(ids.size, ids.size)
    flat, valid = apply_oob(ids.reshape(-1), n_rows, oob)
    flat = park_dropped(flat, valid)
    n = flat.shape[0]
    w = jnp.ones((n,), jnp.float32) if valid is None else valid.astype(jnp.float32)
    pos = jnp.arange(n, dtype=jnp.int32)
    offsets = jnp.arange(n + 1, dtype=jnp.int32)
    out = pooled(cores, flat, offsets, pos, w, weighted=False, impl=impl)
    return out.astype(cores[0].dtype if dtype is None else dtype).reshape(*ids.shape, out.shape[-1])


def feature_modes(mode: str | Sequence[str], num_features: int) -> tuple[str, ...]:
    """One pooling mode per feature from ``mode`` (one for all, or a sequence of F)."""
    modes = (mode,) * num_features if isinstance(mode, str) else tuple(mode)
    if len(modes) != num_features:
        raise ValueError(f"mode: one per feature ({num_features}), got {len(modes)}")
    for m in modes:
        if m not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {m!r}")
    return modes


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
    unique_capacity: int | None = None,
    ids_per_pass: int | None = None,
    memory_budget: int | str | None = "auto",
    return_overflow: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Pooled bags of every feature of a shape group: ``[F, B, D]`` in ``dtype``, or
    ``[B, F, D]`` with ``batch_major`` (FBGEMM's layout: the pooling kernel writes it, so a
    model that wants ``[B, F*D]`` needs no transpose, nor its transpose in the backward).

    Args:
      packed: the group's packed cores (``GroupLayout.packed_shapes()``).
      layout: static ``GroupLayout`` of the group's T tables.
      ids: ids [n] of any integer dtype, each local to its feature's table (host int64
        ids past int32 without x64 are out of range, not wrapped: ``flowtt_jax.inputs.oob``).
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
      unique_capacity: static; the unique (table, id) rows the kernels hold at a time (their
        rows and row gradients are ``[unique_capacity, D]``, not ``[n, D]``); a batch with
        more runs extra passes, exact, and is counted (``return_overflow``). None: n.
      ids_per_pass: static; the kernels take the ids this many at a time, in order (one
        plan, rows and gradients of that many at a time; the backward recomputes each
        pass's): for batches whose per-id buffers do not fit at once. None: as
        ``memory_budget`` decides.
      memory_budget: ``"auto"`` (a share of the device's memory,
        ``flowtt_jax.budget.AUTO_FRACTION``), bytes, or None (all ids at once): without
        ``ids_per_pass``, the first of ``budget.CANDIDATES`` (one pass; windows of the
        uniques, a capacity of ``n / w``, where the group has several tables and no
        ``unique_capacity``; passes over the ids) whose step (this op's buffers, the cores
        and their gradient) fits, from the static shapes (``op_memory_choice``).
      return_overflow: also return ``overflowed`` bool[] (on the device, no host round
        trip): the batch had more unique rows than ``unique_capacity``.
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
    impl = choose_impl(impl, packed, layout)
    out_dtype = packed[0].dtype if dtype is None else dtype
    dim = layout.dim
    ids = as_ids(ids, oob)
    if ids.ndim != 1:
        raise ValueError(f"ids must be a flat int array [n], got {ids.dtype}{list(ids.shape)}")
    out_shape = (batch, num_features, dim) if batch_major else (num_features, batch, dim)
    unique_capacity = static_count(unique_capacity, "unique_capacity")
    ids_per_pass = static_count(ids_per_pass, "ids_per_pass")
    if ids_per_pass is None and impl == "ffi":
        ids_per_pass, unique_capacity = op_memory_choice(
            layout, packed, ids.shape[0], num_features * batch, unique_capacity, memory_budget
        )
    if ids.shape[0] == 0 or batch == 0:
        out = jnp.zeros(out_shape, out_dtype)
        return (out, jnp.zeros((), bool)) if return_overflow else out

    num_rows = layout.table_arrays()["num_rows"]
    bags, tables = packed_bags(ids, offsets, weights, feature_tables, num_rows, oob, kernel=impl == "ffi")
    w = scale_by_modes(bags.weights, bags.offsets, bags.bag_ids, modes, batch)

    out = pooled(
        packed,
        bags.ids,
        bags.offsets,
        bags.bag_ids,
        w,
        weighted=weights is not None,
        impl=impl,
        layout=layout,
        tables=tables,
        batch=batch if batch_major else 0,
        unique_capacity=unique_capacity,
        ids_per_pass=ids_per_pass,
        return_overflow=True,
    )
    out = out[0].reshape(out_shape).astype(out_dtype), out[1]
    return out if return_overflow else out[0]


def op_memory_choice(
    layout, packed, n: int, bags: int, capacity: int | None, memory_budget
) -> tuple[int | None, int | None]:
    """``(ids_per_pass, unique_capacity)`` of the table-batched op under ``memory_budget``:
    the first of ``budget.CANDIDATES`` (one pass; windows of the uniques, where the group has
    several tables and the caller set no capacity; passes over the ids) whose buffers
    (``budget.op_bytes``, training), the cores and their gradient fit; the leanest if none."""
    budget = resolve_budget(memory_budget)
    if budget is None or n == 0:
        return None, capacity
    params = sum(int(np.prod(c.shape)) * 4 for c in packed)
    one = layout.num_tables == 1
    choice = None, capacity
    for passes, windows in CANDIDATES:
        per_pass = pass_size(n, passes)
        if (per_pass is not None and per_pass >= n) or (windows > 1 and (one or capacity is not None)):
            continue
        cap = capacity if windows == 1 else -(-n // windows)
        b = op_bytes(n, bags, layout.dim, one, per_pass, cap)
        choice = per_pass, cap
        if 2 * params + b.kept + b.rows + b.out + 16 * min(n, per_pass or n) <= budget:
            return choice
    return choice
