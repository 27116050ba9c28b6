"""Loading, registering and calling the compiled FFI ops (see docs/op_contract.md).

The CPU extension ``_flowtt_cpu`` is always built; ``_flowtt_cuda`` exists when the
package was built with CUDA. Every target of every extension present is registered
when this module is imported (``import flowtt_jax`` does it), for its platform ("cpu",
"CUDA"), whether or not that jax backend exists: registering needs no device (jax
keeps a platform's registrations until its plugin loads), so a module exported with
``jax.export`` runs in a fresh process after ``import flowtt_jax``.

Exporting: the targets are not on jax's list of custom calls with a stable binary
interface, so ``jax.export.export`` needs ``disabled_checks=disabled_safety_checks()``
(one ``jax.export.DisabledSafetyCheck.custom_call`` per target); the serialized module
runs where the same (or an ABI-compatible) flowtt_jax is imported.

Differentiation: the kernels come with reverse-mode rules only (``jax.custom_vjp``):
one ``jax.grad`` / ``jax.vjp``. Forward mode (``jax.jvp``, ``jax.jacfwd``) and
derivatives of the gradient (``jax.hessian``, grad of grad) raise
``NotImplementedError`` naming ``impl="reference"``, which supports them all (the
linear function of ``jax.linearize`` is forward mode too: jax's own error, raised
outside this package).

Inside ``jax.shard_map`` with ``check_vma=True`` (jax's default): ``jax.ffi.ffi_call``
wants operands of one type and types its results as device-invariant, whatever its
operands. ``call`` casts every operand to the mesh axes any of them varies over and its
results back to them (``to_varying``), and the ops cast their cores and weights to the axes
any of their inputs varies over before their ``custom_vjp``, so its cotangents have their
primals' types and a replicated core's gradient is summed over the devices (the transpose
of the cast), as jax does for its own ops: one sum per op call (a collection casts each
pack's parameters once, whatever the number of its calls).
"""

from __future__ import annotations

import contextlib
import functools
import importlib

import jax
import jax.numpy as jnp
import numpy as np

from flowtt_jax.kernels.plan import GroupPlan, Plan

__all__ = [
    "AD_UNSUPPORTED",
    "CUDA_MAX_NNZ",
    "available",
    "check_kernel_nnz",
    "cuda_unsupported_reason",
    "disabled_safety_checks",
    "explain_ad_errors",
    "plan",
    "plan_bitmap_applies",
    "tb_plan",
    "tb_window",
    "to_varying",
    "varying_axes",
    "rows_fwd",
    "rows_bwd",
    "tb_rows_fwd",
    "tb_rows_bwd",
    "pool_fwd",
    "pool_bwd",
    "bag_fwd",
]


def _import(name: str):
    try:
        return importlib.import_module(f"flowtt_jax.{name}")
    except ImportError:
        return None


@functools.cache
def _register() -> tuple[str, ...]:
    """Registers every available extension's targets; returns the platforms done."""
    done = []
    for module, platform in (("_flowtt_cpu", "cpu"), ("_flowtt_cuda", "CUDA")):
        ext = _import(module)
        if ext is None:
            continue
        for name, capsule in ext.registrations().items():
            jax.ffi.register_ffi_target(name, capsule, platform=platform)
        done.append(platform)
    return tuple(done)


def _target_names() -> tuple[str, ...]:
    names = set()
    for module in ("_flowtt_cpu", "_flowtt_cuda"):
        ext = _import(module)
        if ext is not None:
            names.update(ext.registrations())
    return tuple(sorted(names))


def disabled_safety_checks() -> list:
    """``disabled_checks`` for ``jax.export.export`` of a function using these ops: one
    ``DisabledSafetyCheck.custom_call`` per target of the extensions present."""
    return [jax.export.DisabledSafetyCheck.custom_call(name) for name in _target_names()]


AD_UNSUPPORTED = (
    "flowtt_jax: the FFI kernels (impl='auto' / 'ffi') have reverse-mode rules only: one jax.grad "
    "or jax.vjp. Forward mode (jax.jvp, jax.jacfwd, jax.linearize's linear function) and "
    "derivatives of a gradient (jax.hessian, grad of grad) are not supported on them; pass "
    "impl='reference' (pure jax.numpy, every order and mode of differentiation) for those"
)


@contextlib.contextmanager
def explain_ad_errors():
    """Turns jax's errors for forward-mode or higher-order differentiation of the kernels
    (a ``jax.custom_vjp`` under ``jvp``, an FFI call under ``jvp``) into one
    ``NotImplementedError`` that names ``impl="reference"``."""
    try:
        yield
    except (TypeError, ValueError) as e:
        text = str(e)
        if "forward-mode autodiff" in text or "cannot be differentiated" in text:
            raise NotImplementedError(AD_UNSUPPORTED) from e
        raise


#: The CUDA rows kernels take nnz < 2^30 (their handlers refuse more).
CUDA_MAX_NNZ = 2**30 - 1


def check_kernel_nnz(nnz: int) -> None:
    """``ValueError`` when the default backend's kernels cannot take ``nnz`` ids in one
    call (CUDA: ``CUDA_MAX_NNZ``; every backend: ``bag.MAX_NNZ``, checked earlier)."""
    if jax.default_backend() == "gpu" and nnz > CUDA_MAX_NNZ:
        raise ValueError(
            f"{nnz} ids in one call: the CUDA kernels take at most {CUDA_MAX_NNZ} (2^30 - 1); split the batch"
        )


def available() -> bool:
    """True when the compiled CPU extension is importable (the FFI path can run)."""
    return "cpu" in _register()


def arch_mismatch(built: str, capability: str) -> str | None:
    """Why kernels built for CMake's CUDA architectures ``built`` (e.g. ``"90"``,
    ``"80,90-real,100-virtual"``) cannot run on a GPU of compute ``capability`` (``"9.0"``),
    or None: it needs its own architecture's code, or PTX of one at most its own."""
    major, minor = (int(x) for x in capability.split("."))
    mine = 10 * major + minor
    real, ptx = set(), set()
    for entry in filter(None, (e.strip() for e in built.split(","))):
        number = int("".join(ch for ch in entry.split("-")[0] if ch.isdigit()))
        if not entry.endswith("-virtual"):
            real.add(number)
        if not entry.endswith("-real"):
            ptx.add(number)  # a plain entry embeds both (CMake's CUDA_ARCHITECTURES)
    if mine in real or any(p <= mine for p in ptx):
        return None
    return (
        f"the CUDA kernels were built for sm_{built} and this GPU is sm_{mine}: rebuild with "
        f"FLOWTT_CUDA_ARCHITECTURES={mine} (pip install -e . again)"
    )


@functools.cache
def cuda_arch_reason() -> str | None:
    """``arch_mismatch`` of the CUDA module's build and the default GPU (None without one);
    checked once, when the kernels are first chosen for a GPU call."""
    ext = _import("_flowtt_cuda") if "CUDA" in _register() else None
    if ext is None or jax.default_backend() != "gpu":
        return None
    capability = getattr(jax.devices()[0], "compute_capability", None)
    return arch_mismatch(ext.cuda_architectures(), capability) if capability else None


def cuda_unsupported_reason(shapes, table_batched: bool = False) -> str | None:
    """Why the CUDA kernels (the table-batched ones for a group's packed cores) cannot take
    3 cores of these shapes, or None (also None without CUDA)."""
    ext = _import("_flowtt_cuda") if "CUDA" in _register() else None
    if ext is None:
        return None
    arch = cuda_arch_reason()
    if arch:
        return arch
    (p1, _, q1, r1), (p2, _, q2, r2), (p3, _, q3, _) = shapes
    reason = ext.tb_unsupported_reason if table_batched else ext.unsupported_reason
    return reason(p1, p2, p3, q1, q2, q3, r1, r2)


def has_target(name: str, platform: str) -> bool:
    """True when the extension for ``platform`` ("cpu" or "gpu") registered target ``name``."""
    module = {"cpu": "_flowtt_cpu", "gpu": "_flowtt_cuda"}[platform]
    ext = _import(module) if _register() else None
    return ext is not None and name in ext.registrations()


def _varying(x) -> frozenset:
    """Manual mesh axes ``x``'s type varies over (empty outside ``shard_map`` or with
    ``check_vma=False``)."""
    aval = jax.typeof(x)
    mat = getattr(aval, "mat", None)  # jax >= 0.10: ManualAxisType
    return frozenset(mat.varying if mat is not None else (getattr(aval, "vma", None) or ()))


def varying_axes(*trees) -> tuple[str, ...]:
    """The manual mesh axes any array of ``trees`` varies over, sorted."""
    return tuple(sorted(frozenset().union(*(_varying(x) for x in jax.tree.leaves(trees)))))


def to_varying(tree, axes: tuple[str, ...]):
    """``tree`` with every array typed as varying over ``axes`` (``jax.lax.pcast``; its
    transpose sums over them); arrays that already vary over them pass unchanged."""
    if not axes:
        return tree

    def cast(x):
        missing = tuple(a for a in axes if a not in _varying(x))
        if not missing:
            return x
        if hasattr(jax.lax, "pcast"):
            return jax.lax.pcast(x, missing, to="varying")
        return jax.lax.pvary(x, missing)  # jax before pcast

    return jax.tree.map(cast, tree)


def call(target: str, outs, *args, **attrs):
    """``jax.ffi.ffi_call`` of one of this package's targets (sequential under vmap);
    operands and results typed varying over the mesh axes any operand varies over."""
    return _call(target, outs, *args, **attrs)


def _require_extension() -> None:
    if not available():
        raise ImportError(
            "flowtt_jax was installed without its compiled extension (_flowtt_cpu); "
            "reinstall with `pip install -e .` or use impl='reference'"
        )


def _call(target: str, outs, *args, aliases: dict[int, int] | None = None, **attrs):
    _require_extension()
    axes = varying_axes(args)
    with explain_ad_errors():
        results = jax.ffi.ffi_call(target, outs, vmap_method="sequential", input_output_aliases=aliases)(
            *to_varying(args, axes), **attrs
        )
    return to_varying(results, axes)


def _f32(shape) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, jnp.float32)


def plan(ids: jax.Array, last_extent: int, num_rows: int, forward_only: bool = False) -> Plan:
    """``plan.make_plan(ids, last_extent)`` as one call of target ``flowtt_plan``.

    ``ids`` [n] int are clamped to ``[0, num_rows)``: for in-range ids the plan equals
    ``make_plan``'s bit for bit. ``num_rows`` (< 2^31) also bounds the radix sort's key
    bits on the GPU. ``last_extent``, ``num_rows`` and ``forward_only`` are static.

    ``forward_only``: the plan of a forward without gradient (what ``bag_fwd`` and
    ``rows_fwd`` read): ``perm`` and ``run_offsets`` are ``[0]``, the other fields the same.
    Where the table's bitmap (``num_rows / 32`` words) is at most 2 words per id it is
    built without a sort (``cuda/contract/plan_bitmap.h``).
    """
    if ids.ndim != 1:
        raise ValueError(f"ids must be flat [n], got shape {ids.shape}")
    n = ids.shape[0]
    sizes = (0, n, n, 0, n + 1, 2) if forward_only else (n, n, n, n + 1, n + 1, 2)
    outs = tuple(jax.ShapeDtypeStruct((m,), jnp.int32) for m in sizes)
    return Plan(
        *_call(
            "flowtt_plan",
            outs,
            ids.astype(jnp.int32),
            last_extent=np.int64(last_extent),
            num_rows=np.int64(num_rows),
        )
    )


def plan_bitmap_applies(n: int, num_rows: int) -> bool:
    """Whether ``plan(ids [n], ..., num_rows, forward_only=True)`` takes the table's bitmap
    (no sort) on either platform: at most 2 bitmap words (64 rows) per id."""
    _require_extension()
    return bool(_import("_flowtt_cpu").plan_bitmap_applies(n, num_rows))


def tb_plan(
    ids: jax.Array, tables: jax.Array, meta: np.ndarray, extent: int, row_keys: bool, num_keys: int
) -> GroupPlan:
    """A shape group's plan (``kernels.group_plan.make_group_plan``) as one call of target
    ``flowtt_tb_plan``: a ``GroupPlan``.

    ``ids``, ``tables`` [n] int32 (clamped to their table's rows and to ``[0, T)``);
    ``meta`` [8, T] int32 and the key form ``extent``, ``row_keys``, ``num_keys`` as
    ``GroupLayout.tb_plan_meta()`` gives them (static).
    """
    n = ids.shape[0]
    outs = tuple(jax.ShapeDtypeStruct((m,), jnp.int32) for m in (n, n, n + 1, n + 1, n, n, n, 2))
    return GroupPlan(
        *_call(
            "flowtt_tb_plan",
            outs,
            ids.astype(jnp.int32),
            tables.astype(jnp.int32),
            jnp.asarray(meta, jnp.int32),
            extent=np.int64(extent),
            row_keys=bool(row_keys),
            num_keys=np.int64(num_keys),
        )
    )


def tb_bags(
    ids: jax.Array,
    offsets: jax.Array,
    feature_tables: jax.Array,
    num_rows: jax.Array,
    batch: int,
    clip: bool,
    ends: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array]:
    """The positions of a packed feature-major batch as target ``flowtt_tb_bags`` prepares
    them: ``(ids, tables, live, bag_ids, csr)``, the first four [n] (``live`` float32 1/0,
    the others int32), ``csr`` [F*batch + 1] int32.

    ``ids`` [n] int32 (n >= 1), ``offsets`` [F*batch + 1] int32 of any values,
    ``feature_tables`` [F] and ``num_rows`` [T] int32; ``batch`` (static) bags per feature;
    ``clip`` (static): the ``"clip"`` policy, else ``"zero"``; ``ends`` [F] int32 (None: no
    end): feature f's positions from ``ends[f]`` on are in no bag (``normalise.PackedCSR``'s
    ``bounds[:, -1]``). Equal to ``oob.table_oob``'s jax.numpy path: the valid CSR
    (``offsets`` clamped into [0, n], then their running maximum), bag of each position in it
    (clipped to the bags), its feature's table, its id clipped into the table (``"zero"``: 0
    where out of range), live where the position is in a bag before its feature's end (and,
    under ``"zero"``, in range), dropped positions parked on the first live one.
    """
    n = ids.shape[0]
    f = np.shape(feature_tables)[0]
    ends = jnp.full((f,), np.iinfo(np.int32).max, jnp.int32) if ends is None else ends.astype(jnp.int32)
    outs = (
        *(jax.ShapeDtypeStruct((n,), jnp.int32) for _ in range(2)),
        _f32((n,)),
        jax.ShapeDtypeStruct((n,), jnp.int32),
        jax.ShapeDtypeStruct(offsets.shape, jnp.int32),
    )
    return tuple(
        _call(
            "flowtt_tb_bags",
            outs,
            ids.astype(jnp.int32),
            offsets.astype(jnp.int32),
            jnp.asarray(feature_tables, jnp.int32),
            jnp.asarray(num_rows, jnp.int32),
            ends,
            batch=np.int64(batch),
            clip=bool(clip),
        )
    )


def _dim(cores) -> int:
    return cores[0].shape[2] * cores[1].shape[2] * cores[2].shape[2]


def rows_fwd(cores, plan: Plan) -> jax.Array:
    """Unique rows [n, D]; rows past num_unique are unspecified."""
    n = plan.unique_ids.shape[0]
    return _call(
        "flowtt_tt_rows_fwd", _f32((n, _dim(cores))), *cores, plan.unique_ids, plan.group_offsets, plan.counts
    )


def rows_bwd(cores, d_rows: jax.Array, plan: Plan) -> tuple[jax.Array, ...]:
    """Core gradients of sum(d_rows * rows)."""
    outs = tuple(_f32(c.shape) for c in cores)
    return tuple(
        _call("flowtt_tt_rows_bwd", outs, *cores, d_rows, plan.unique_ids, plan.group_offsets, plan.counts)
    )


def pool_fwd(
    rows: jax.Array,
    inverse: jax.Array,
    weights: jax.Array,
    offsets: jax.Array,
    batch: int = 0,
    *,
    lo: int = 0,
    counts: jax.Array | None = None,
    prev: jax.Array | None = None,
) -> jax.Array:
    """Bags [B, D]: weighted sums of unique rows through the inverse map, fixed order.

    ``batch`` (static): 0, row j is bag j; else the bags are feature-major (bag
    ``f*batch + b`` of ``F = B / batch`` features) and row ``b*F + f`` holds bag
    ``f*batch + b``: the ``[batch, F, D]`` layout, written so by the kernel.

    A window of uniques: ``rows`` [m, D] holds uniques ``[lo, lo + m)`` (``lo`` static),
    capped at the plan's ``counts[0]`` when ``counts`` is given; positions of other uniques
    add nothing. ``prev`` [B, D]: the sums are added onto it (its buffer becomes the
    result's; a window past the uniques costs a launch that returns at once).
    """
    out = _f32((offsets.shape[0] - 1, rows.shape[1]))
    counts = jnp.zeros((0,), jnp.int32) if counts is None else counts
    aliases = None
    if prev is None:
        prev = jnp.zeros((0, rows.shape[1]), jnp.float32)
    else:
        aliases = {5: 0}
    return _call(
        "flowtt_bag_pool_fwd",
        out,
        rows,
        inverse,
        weights,
        offsets,
        counts,
        prev,
        aliases=aliases,
        batch=np.int64(batch),
        lo=np.int64(lo),
    )


def bag_fwd(cores, plan: Plan, weights: jax.Array, offsets: jax.Array, chunk_rows: int) -> jax.Array:
    """Bags [B, D] = ``pool_fwd(rows_fwd(cores, plan), plan.inverse, weights, offsets)`` in one
    call that never holds the [n, D] rows: unique rows are computed ``chunk_rows`` (static,
    >= 1, rounded up to a multiple of 64) at a time into scratch and pooled right away.

    ``weights`` [n] f32, ``offsets`` [B+1] int32. The sums run chunk by chunk, then in
    increasing position; with num_unique <= chunk_rows the result equals the two-op path
    bit for bit.
    """
    out = _f32((offsets.shape[0] - 1, _dim(cores)))
    return _call(
        "flowtt_bag_fwd",
        out,
        *cores,
        plan.unique_ids,
        plan.group_offsets,
        plan.counts,
        plan.inverse,
        weights,
        offsets,
        chunk_rows=np.int64(chunk_rows),
    )


def _after(after) -> tuple:
    """Trailing operands (the targets accept and ignore them) that order a call after the
    arrays of ``after`` exist (None: none)."""
    return () if after is None else tuple(jax.tree.leaves(after))


def tb_rows_fwd(packed, plan: GroupPlan, dim: int, after=None) -> jax.Array:
    """A shape group's unique rows [n, D] (``flowtt_tb_rows_fwd``); rows past num_unique
    are unspecified. ``after``: arrays the call must wait for (not read)."""
    args = (*packed, *_group_plan_args(plan), *_after(after))
    return _call("flowtt_tb_rows_fwd", _f32((plan.u_i3.shape[0], dim)), *args)


def tb_window(plan: GroupPlan, lo: int, size: int, after=None) -> GroupPlan:
    """``kernels.group_plan.window_plan(plan, lo, size)`` as one call of target
    ``flowtt_tb_window`` (bit for bit): the rows ops' plan of the uniques ``[lo, lo + size)``
    (static). ``after``: arrays the call must wait for (not read); a window made in the
    backward after its cotangent is not merged with the forward's (XLA would keep every
    pass's window from the forward to the backward)."""
    outs = (
        jax.ShapeDtypeStruct((size + 1,), jnp.int32),
        *(jax.ShapeDtypeStruct((size,), jnp.int32) for _ in range(3)),
        jax.ShapeDtypeStruct((2,), jnp.int32),
    )
    args = (plan.group_offsets, plan.u_i3, plan.g_i1, plan.g_i2, plan.counts, *_after(after))
    go, u_i3, g_i1, g_i2, counts = _call("flowtt_tb_window", outs, *args, lo=np.int64(lo))
    return GroupPlan(plan.perm, plan.inverse, plan.run_offsets, go, u_i3, g_i1, g_i2, counts)


def tb_rows_bwd(packed, d_rows: jax.Array, plan: GroupPlan) -> tuple[jax.Array, ...]:
    """Packed core gradients of sum(d_rows * rows) (``flowtt_tb_rows_bwd``)."""
    outs = tuple(_f32(c.shape) for c in packed)
    return tuple(_call("flowtt_tb_rows_bwd", outs, *packed, d_rows, *_group_plan_args(plan)))


def _group_plan_args(plan: GroupPlan):
    return plan.u_i3, plan.g_i1, plan.g_i2, plan.group_offsets, plan.counts


def pool_bwd(
    dout,
    rows,
    weights,
    bag_ids,
    plan: Plan | GroupPlan,
    with_d_weights: bool = True,
    *,
    lo: int = 0,
    m: int | None = None,
    after=None,
):
    """(d_rows [m, D], d_weights [n] or None) of the pooling, reduced in sorted order, for
    the window of uniques ``[lo, lo + m)`` (static; default every unique: ``m = n``) capped
    at num_unique; d_rows past it are unspecified, d_weights of positions outside it 0.
    ``plan``: either plan (its ``inverse``, ``perm``, ``run_offsets`` and ``counts``).

    ``with_d_weights=False`` skips the weight gradient (the kernel gets a [0] result); only
    that gradient reads ``rows`` (the window's [m, D]), so without it ``rows`` may be None
    (the kernel gets a [0, D] placeholder made here) and the forward's rows need not live
    until the backward. ``after``: arrays the call must wait for (not read).
    """
    m = weights.shape[0] if m is None else m
    if rows is None:
        if with_d_weights:
            raise ValueError("pool_bwd: the weight gradient needs the forward's rows")
        # made in the backward, never a residual: a zero-size array passed between the two
        # shard_map bodies of a sharded step crashes XLA's GPU SPMD partitioner (jax 0.11.2)
        rows = jnp.zeros((0, dout.shape[1]), jnp.float32)
    outs = (_f32((m, dout.shape[1])), _f32(weights.shape if with_d_weights else (0,)))
    d_rows, d_weights = _call(
        "flowtt_bag_pool_bwd",
        outs,
        dout,
        rows,
        weights,
        plan.inverse,
        bag_ids,
        plan.perm,
        plan.run_offsets,
        plan.counts,
        *_after(after),
        lo=np.int64(lo),
    )
    return d_rows, (d_weights if with_d_weights else None)


def rows_residual(rows: jax.Array, with_d_weights: bool) -> jax.Array | None:
    """What the backward keeps of the forward's rows [n, D] for ``pool_bwd``: all of them
    for the weight gradient, else None (their buffer is freed after pooling)."""
    return rows if with_d_weights else None


_register()  # at import: a deserialized jax.export module finds the targets
