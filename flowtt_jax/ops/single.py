"""Public ops: ``tt_lookup`` and ``tt_embedding_bag``.

Both run one pipeline: oob policy -> canonical bags -> on-device plan -> fused
unique-row kernel -> fixed-order pooling, under one ``jax.custom_vjp`` whose
backward gives gradients for every core and for per-id weights. Without a
gradient the plan is the forward-only one (no sort where the table's bitmap is
small) and the rows and the pooling are one op (``flowtt_bag_fwd``) that computes
the unique rows in chunks of at most ``bag_chunk_rows``; the training forward
computes all [n, D] rows and keeps them for the backward only when the weights'
gradient needs them (weighted bags).

``impl``: ``"auto"`` (the FFI kernels when the extension is built and the table
has 3 cores of float32, bfloat16 or float16 (computed in float32) that the platform's
kernels support, else the reference), ``"ffi"`` (require the kernels),
``"reference"`` (pure jax.numpy). The kernels are differentiable once, in reverse
mode (``jax.grad``, ``jax.vjp``); forward mode and higher orders need
``impl="reference"`` (``flowtt_jax.ffi``).

Input policies (the same on both paths): ids of any integer dtype (``flowtt_jax.oob``);
out-of-range ids by ``oob``; a position of weight exactly 0 (a dropped id, a masked or
out-of-bag position, a zero user weight) is skipped, never multiplied, so a non-finite
row cannot turn it into NaN (its weight's gradient is still the row's dot product with
the bag's gradient); zero bags or zero ids give empty / zero outputs and zero
gradients; at most ``bag.MAX_NNZ`` (2^31 - 2) ids and bags per call.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from flowtt_jax.fallback import warn_reference
from flowtt_jax.inputs.bag import MODES, CanonicalBags, check_sizes, packed_bags, prepare_bags, scale_by_modes
from flowtt_jax.inputs.oob import apply_oob, as_ids, park_dropped
from flowtt_jax.kernels import ffi
from flowtt_jax.tt import reference
from flowtt_jax.tt.spec import TTSpec, as_cores

__all__ = ["tt_lookup", "tt_embedding_bag"]

IMPLS = ("auto", "ffi", "reference")
_KERNEL_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)

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


def _plan(cores, ids, forward_only: bool = False):
    return ffi.plan(ids, cores[-1].shape[0], math.prod(c.shape[0] for c in cores), forward_only)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def fused_bag(weighted, cores, weights, ids, offsets, bag_ids):
    """Bag sums [B, D] float32 by the single-table kernels: float32 ``cores``, prepared
    ``weights``/``ids``/``offsets``/``bag_ids`` (as ``prepare_bags`` gives). Without a
    gradient the forward-only plan and one ``flowtt_bag_fwd`` (rows in bounded chunks);
    the VJP's forward takes the whole plan and keeps it.
    Also the one-table case of ``batched.tt_embedding_bag_group``.

    ``weighted`` (static): the caller passed weights, so their gradient is computed.
    """
    dim = math.prod(c.shape[2] for c in cores)
    chunk_rows = bag_chunk_rows(dim, offsets.shape[0] - 1)
    return ffi.bag_fwd(cores, _plan(cores, ids, forward_only=True), weights, offsets, chunk_rows)


def _fused_bag_fwd(weighted, cores, weights, ids, offsets, bag_ids):
    plan = _plan(cores, ids)
    rows = ffi.rows_fwd(cores, plan)
    out = ffi.pool_fwd(rows, plan.inverse, weights, offsets)
    return out, (cores, weights, bag_ids, plan, ffi.rows_residual(rows, weighted))


def _fused_bag_bwd(weighted, res, dout):
    cores, weights, bag_ids, plan, rows = res
    d_rows, d_weights = ffi.pool_bwd(dout, rows, weights, bag_ids, plan, with_d_weights=weighted)
    d_cores = ffi.rows_bwd(cores, d_rows, plan)
    if d_weights is None:
        d_weights = jnp.zeros_like(weights)
    return d_cores, d_weights, None, None, None


fused_bag.defvjp(_fused_bag_fwd, _fused_bag_bwd)


def choose_impl(impl: str, cores: Sequence[jax.Array], *, warn: bool = True) -> str:
    """``"ffi"`` or ``"reference"`` for ``impl`` in ``IMPLS`` and these cores: ``"auto"``
    takes the single-table kernels where the build, the dtypes and the platform's shape
    limits allow (else the reference, with one ``ReferenceFallbackWarning`` per reason when
    ``warn``); ``"ffi"`` raises ``ValueError`` where they do not."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    kernel_ok = len(cores) == 3 and all(c.dtype in _KERNEL_DTYPES for c in cores)
    if impl == "ffi" and not kernel_ok:
        raise ValueError(
            "impl='ffi' needs 3 cores of float32, bfloat16 or float16; got "
            f"{len(cores)} cores of {[str(c.dtype) for c in cores]} (use impl='reference')"
        )
    gpu_reason = ffi.cuda_unsupported_reason(cores) if kernel_ok and jax.default_backend() == "gpu" else None
    if impl == "ffi" and gpu_reason:
        raise ValueError(gpu_reason)
    if impl == "auto":
        if not kernel_ok:
            reason = (
                f"the kernels take 3 cores of float32, bfloat16 or float16, got {len(cores)} cores "
                f"of {sorted({str(c.dtype) for c in cores})}"
            )
        elif gpu_reason:
            reason = gpu_reason
        elif not ffi.available():
            reason = "the compiled extension (_flowtt_cpu) is not built"
        else:
            return "ffi"
        if warn:
            warn_reference(reason, "tt_embedding_bag / tt_lookup")
        return "reference"
    return impl


def pool_single_table(cores, ids, offsets, bag_ids, weights, weighted, num_bags, impl, dtype) -> jax.Array:
    """Weighted bag sums of prepared bags (``prepare_bags``' fields; ``impl`` as ``choose_impl``
    gives) in float32 (float64 cores stay float64), cast once to ``dtype``."""
    dtype = cores[0].dtype if dtype is None else dtype
    c32 = tuple(jnp.promote_types(c.dtype, jnp.float32) for c in cores)
    c32 = tuple(c.astype(t) for c, t in zip(cores, c32))
    if ids.shape[0] == 0 or num_bags == 0:  # nothing to pool: zeros, and zero gradients
        return jnp.zeros((num_bags, math.prod(c.shape[2] for c in cores)), dtype)
    if impl == "reference":
        rows = reference.tt_rows(c32, ids)
        out = reference.pool(rows, weights.astype(rows.dtype), bag_ids, num_bags)
    else:
        ffi.check_kernel_nnz(ids.shape[0])
        axes = ffi.varying_axes(c32, weights, ids, offsets, bag_ids)  # ffi.py: inside shard_map
        c32, weights = ffi.to_varying((c32, weights), axes)
        with ffi.explain_ad_errors():
            out = fused_bag(weighted, c32, weights.astype(jnp.float32), ids, offsets, bag_ids)
    return out.astype(dtype)


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
        ``checkify`` check instead (see ``flowtt_jax.bag``).
      weights: optional per-id float weights, same shape as ids (differentiable). A
        weight of exactly 0 skips its position (a non-finite row gives 0, not NaN).
      mode: ``"sum" | "mean" | "sqrtn"``; an empty bag gives zeros.
      num_embeddings: N (defaults to ``prod(row_shape)``); ids outside [0, N) follow ``oob``.
      oob: ``"error" | "clip" | "zero"`` (see ``flowtt_jax.oob``); ``"error"`` also checks
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
    return pool_single_table(
        cores,
        bags.ids,
        bags.offsets,
        bags.bag_ids,
        bags.weights,
        weights is not None,
        bags.offsets.shape[0] - 1,
        impl,
        dtype,
    )


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
    out = pool_single_table(cores, flat, offsets, pos, w, False, n, impl, dtype)
    return out.reshape(*ids.shape, out.shape[-1])
