"""Shared test helpers: id distributions, fresh random cores, error measures, and the
checkers of the raw FFI targets (parametrised by the call that runs a target on a device).

Import as ``from tests.helpers import ...`` (the repository root is on ``pythonpath``).
"""

from __future__ import annotations

import functools
import importlib.util
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flowtt_jax as ftt
from flowtt_jax.tt import reference

ID_KINDS = ("uniform", "zipf1.05", "zipf1.2", "all_equal", "last_row")

#: ``impl="reference"`` as a parameter of the kernels' grids, marked slow: the default run
#: checks the kernels against the oracle; the oracle's own grid runs with ``--slow``.
SLOW_REFERENCE = pytest.param("reference", marks=pytest.mark.slow)


def make_ids(kind: str, n: int, num_embeddings: int, seed: int) -> np.ndarray:
    """int32 ids [n] drawn from a named distribution; hot ids scattered over the table."""
    rng = np.random.default_rng(seed)
    if kind == "uniform":
        ids = rng.integers(0, num_embeddings, n)
    elif kind.startswith("zipf"):
        ranks = rng.zipf(float(kind[4:]), n) - 1
        ids = (ranks * 2654435761) % num_embeddings
    elif kind == "all_equal":
        ids = np.full(n, rng.integers(0, num_embeddings))
    elif kind == "last_row":
        ids = np.where(rng.random(n) < 0.5, num_embeddings - 1, rng.integers(0, num_embeddings, n))
    else:
        raise ValueError(kind)
    return ids.astype(np.int32)


def random_offsets(num_bags: int, n: int, seed: int, empty_fraction: float = 0.2) -> np.ndarray:
    """CSR offsets [num_bags + 1] over n ids with some empty bags."""
    rng = np.random.default_rng(seed)
    cuts = np.sort(rng.integers(0, n + 1, num_bags - 1))
    offsets = np.concatenate([[0], cuts, [n]]).astype(np.int32)
    # Force some empty bags by repeating offsets.
    k = int(empty_fraction * num_bags)
    if k:
        idx = rng.choice(np.arange(1, num_bags), size=min(k, num_bags - 1), replace=False)
        offsets[idx] = offsets[idx - 1]
        offsets = np.maximum.accumulate(offsets)
    return offsets


def make_cores(spec: ftt.TTSpec, seed: int, dtype=jnp.float32):
    return ftt.init_cores(jax.random.key(seed), spec, std=1.0, dtype=dtype)


def rel_err(a, b) -> float:
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    assert np.all(np.isfinite(a)), "non-finite values"
    denom = np.linalg.norm(b)
    return float(np.linalg.norm(a - b) / (denom if denom > 0 else 1.0))


def close(a, b, tol: float = 1e-5) -> None:
    """``a`` and ``b`` equal within ``tol`` (relative and absolute), compared in float32."""
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=tol, atol=tol)


def custom_call_targets(text: str) -> set[str]:
    """Custom-call targets named in compiled HLO text or in lowered StableHLO text
    (``jit(f).lower(...).as_text()``); host callbacks show up here."""
    return set(re.findall(r'custom_call_target="([^"]+)"', text)) | set(
        re.findall(r"stablehlo\.custom_call @([\w.]+)", text)
    )


def assert_no_host_callback(compiled_text: str) -> None:
    targets = custom_call_targets(compiled_text)
    assert not any("callback" in t for t in targets), targets


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _aliased_call(target: str, out_shapes: tuple, attrs: tuple, *args):
    aliases = {len(args) - len(out_shapes) + k: k for k in range(len(out_shapes))}
    call = jax.ffi.ffi_call(target, out_shapes, input_output_aliases=aliases)
    return call(*args, **{name: value for name, _, value in attrs})


def poisoned_call(target: str, out_shapes, *args, device: jax.Device | None = None, **attrs):
    """``jax.ffi.ffi_call`` under jit with each output aliased to a poisoned buffer
    appended after ``args`` (NaN for floats, -7 for ints), so an unwritten element shows.
    One compiled program per target, shapes and attributes (typed: ``np.int64(0)`` and ``0``
    are two programs), shared by every call.

    ``device``: where the operands and the poisoned buffers go (default: as they are).
    """
    put = (lambda x: x) if device is None else (lambda x: jax.device_put(x, device))
    poison = [
        put(np.full(s.shape, np.nan if jnp.issubdtype(s.dtype, jnp.floating) else -7, s.dtype))
        for s in out_shapes
    ]
    attrs_key = tuple((name, type(value), value) for name, value in sorted(attrs.items()))
    return _aliased_call(target, tuple(out_shapes), attrs_key, *(put(a) for a in args), *poison)


def cuda_device() -> jax.Device | None:
    """The first GPU when jax has a GPU backend and the ``_flowtt_cuda`` extension is
    built, else None."""
    if importlib.util.find_spec("flowtt_jax._flowtt_cuda") is None:
        return None
    try:
        gpus = jax.devices("gpu")
    except RuntimeError:
        return None
    return gpus[0] if gpus else None


# ---- the raw FFI targets, shared by test_ffi_kernels.py (CPU) and test_cuda.py (GPU). ----
# `call(target, out_shapes, *args, **attrs)` runs a target with poisoned outputs on one
# device: poisoned_call above, with or without its `device`.


def f32(shape) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, jnp.float32)


def _dim(cores) -> int:
    return cores[0].shape[2] * cores[1].shape[2] * cores[2].shape[2]


def target_rows_fwd(call, cores, plan):
    """flowtt_tt_rows_fwd: unique rows [n, D] float32 (past num_unique: unspecified)."""
    n = plan.inverse.shape[0]
    (rows,) = call(
        "flowtt_tt_rows_fwd",
        [f32((n, _dim(cores)))],
        *cores,
        plan.unique_ids,
        plan.group_offsets,
        plan.counts,
    )
    return rows


def target_pool_fwd(call, rows, plan, weights, offsets, batch: int = 0, lo: int = 0, counts=None, prev=None):
    """flowtt_bag_pool_fwd: bags [B, D] float32 from rows [m, D] (uniques [lo, lo + m),
    capped at ``counts[0]`` when given) and CSR offsets [B+1], added onto ``prev`` when given
    (``batch`` > 0: feature-major bags written batch-major, as ``ffi.pool_fwd``)."""
    out_shape = [f32((len(offsets) - 1, rows.shape[1]))]
    counts = np.zeros((0,), np.int32) if counts is None else counts
    prev = np.zeros((0, rows.shape[1]), np.float32) if prev is None else prev
    (out,) = call(
        "flowtt_bag_pool_fwd",
        out_shape,
        rows,
        plan.inverse,
        weights,
        offsets,
        counts,
        prev,
        batch=np.int64(batch),
        lo=np.int64(lo),
    )
    return out


def check_pool_batch_major(call, rows, plan, weights, offsets, batch: int) -> None:
    """flowtt_bag_pool_fwd with ``batch`` (0: the smallest proper divisor of the bags): every
    row written (``call`` poisons), row ``b*F + f`` bit for bit the plain call's bag
    ``f*batch + b``; a ``batch`` that does not divide the bags is refused by name."""
    num_bags = len(offsets) - 1
    batch = batch or next((b for b in range(2, num_bags) if num_bags % b == 0), num_bags)
    plain = np.asarray(target_pool_fwd(call, rows, plan, weights, offsets))
    got = np.asarray(target_pool_fwd(call, rows, plan, weights, offsets, batch=batch))
    want = plain.reshape(num_bags // batch, batch, -1).transpose(1, 0, 2).reshape(plain.shape)
    assert np.isfinite(got).all() and got.tobytes() == want.tobytes()
    bad = next(b for b in range(2, num_bags + 1) if num_bags % b)
    with pytest.raises(Exception, match="batch must be 0 or divide"):
        jax.block_until_ready(target_pool_fwd(call, rows, plan, weights, offsets, batch=bad))


def target_pool_bwd(
    call, dout, rows, weights, plan, bag_ids, with_d_weights: bool = True, lo: int = 0, m: int | None = None
):
    """flowtt_bag_pool_bwd: ``(d_rows [m, D], d_weights [n] or [0])`` float32 for the uniques
    ``[lo, lo + m)`` (default every one: m = n; ``rows`` [m, D], or ``[0, D]`` without the
    weight gradient)."""
    n, dim = weights.shape[0], dout.shape[1]
    m = n if m is None else m
    outs = [f32((m, dim)), f32((n if with_d_weights else 0,))]
    args = (plan.inverse, bag_ids, plan.perm, plan.run_offsets, plan.counts)
    return call("flowtt_bag_pool_bwd", outs, dout, rows, weights, *args, lo=np.int64(lo))


def target_rows_bwd(call, cores, d_rows, plan):
    """flowtt_tt_rows_bwd: the core gradients of sum(d_rows * rows), float32."""
    outs = [f32(c.shape) for c in cores]
    return call("flowtt_tt_rows_bwd", outs, *cores, d_rows, plan.unique_ids, plan.group_offsets, plan.counts)


def bag_ids_of(offsets: np.ndarray, n: int) -> np.ndarray:
    """Bag of each position [n] for CSR offsets [B+1]: -1 before bag 0, B after the last."""
    return (np.searchsorted(offsets, np.arange(n), side="right") - 1).astype(np.int32)


def hot_prefix_ids(row_shape, n: int, seed: int) -> np.ndarray:
    """int32 ids [n], 3/4 of them in one prefix group (i1, i2): hundreds of unique ids
    in a group when row_shape[-1] is large; the rest uniform."""
    rng = np.random.default_rng(seed)
    p3, num_rows = row_shape[-1], int(np.prod(row_shape))
    hot = rng.integers(0, num_rows // p3) * p3 + rng.integers(0, p3, n)
    return np.where(rng.random(n) < 0.75, hot, rng.integers(0, num_rows, n)).astype(np.int32)


def pooled_reference(cores, ids, weights, offsets) -> np.ndarray:
    """float64 bags [B, D] on the CPU (flowtt_jax.tt.reference): sum of weights[k] * row(ids[k])
    over each bag's positions; positions outside every bag are dropped."""
    num_bags = len(offsets) - 1
    with jax.enable_x64(True), jax.default_device(jax.devices("cpu")[0]):
        c64 = [np.asarray(c, np.float64) for c in cores]
        w64 = np.asarray(weights, np.float64)
        return np.asarray(_pooled64(c64, np.asarray(ids), w64, bag_ids_of(offsets, len(ids)), num_bags))


@functools.partial(jax.jit, static_argnums=4)
def _pooled64(cores, ids, weights, bag_ids, num_bags: int) -> jax.Array:
    return reference.pool(reference.tt_rows(cores, ids), weights, bag_ids, num_bags)


def assert_same(a, b) -> None:
    """Finite and equal bit for bit."""
    a, b = np.asarray(a), np.asarray(b)
    assert np.all(np.isfinite(a)) and a.shape == b.shape and a.tobytes() == b.tobytes()


def check_bag_fwd(
    call, cores, plan, ids, weights, offsets, chunks=(1, 64, 100, 128), tol: float = 1e-5
) -> None:
    """flowtt_bag_fwd against pool_fwd(rows_fwd) and the float64 reference.

    One chunk (chunk_rows >= num_unique, up to 2^40): equal to the two ops bit for bit.
    ``chunks`` (chunk_rows below num_unique: several chunks): within ``tol`` of both.
    """
    n, num_bags, dim = len(ids), len(offsets) - 1, _dim(cores)
    plan_args = (plan.unique_ids, plan.group_offsets, plan.counts)
    two_ops = target_pool_fwd(call, target_rows_fwd(call, cores, plan), plan, weights, offsets)
    ref = pooled_reference(cores, ids, weights, offsets)
    assert rel_err(two_ops, ref) <= tol

    def bag(chunk_rows):
        return call(
            "flowtt_bag_fwd",
            [f32((num_bags, dim))],
            *cores,
            *plan_args,
            plan.inverse,
            weights,
            offsets,
            chunk_rows=np.int64(chunk_rows),
        )[0]

    nu = int(plan.counts[0])
    for chunk_rows in (nu, n, 2**40):
        assert_same(bag(chunk_rows), two_ops)
    for chunk_rows in chunks:
        out = bag(chunk_rows)
        assert rel_err(out, ref) <= tol, (chunk_rows, rel_err(out, ref))
        assert rel_err(out, two_ops) <= tol, (chunk_rows, rel_err(out, two_ops))


def check_rows_past_num_unique_unread(call, cores, plan, weights, offsets, dout) -> None:
    """pool_fwd, pool_bwd (with and without d_weights) and rows_bwd give the same outputs,
    bit for bit, when rows / d_rows past num_unique hold NaN as when they hold 0; of
    rows_fwd's and pool_bwd's [n, D] outputs only [:num_unique] is specified."""
    n, num_bags = plan.inverse.shape[0], len(offsets) - 1
    nu = int(plan.counts[0])
    assert nu < n, "needs duplicate ids, else there is nothing past num_unique"
    bag_ids = np.clip(bag_ids_of(offsets, n), 0, num_bags - 1)

    def tails(x):
        zero, nan = np.array(x), np.array(x)
        zero[nu:], nan[nu:] = 0.0, np.nan
        return zero, nan

    rows_zero, rows_nan = tails(target_rows_fwd(call, cores, plan))
    assert_same(*(target_pool_fwd(call, r, plan, weights, offsets) for r in (rows_zero, rows_nan)))
    for with_d_weights in (True, False):
        d_zero, d_nan = (
            target_pool_bwd(call, dout, r, weights, plan, bag_ids, with_d_weights)
            for r in (rows_zero, rows_nan)
        )
        assert_same(d_zero[0][:nu], d_nan[0][:nu])
        assert_same(d_zero[1], d_nan[1])
    d_rows_zero, d_rows_nan = tails(d_zero[0])  # pool_bwd's d_rows, tail set to 0 / NaN
    grads = [target_rows_bwd(call, cores, d, plan) for d in (d_rows_zero, d_rows_nan)]
    for g_zero, g_nan in zip(*grads):
        assert_same(g_zero, g_nan)


def bag_fwd_shape_errors(cores, plan, weights, offsets):
    """(operands, out shape, chunk_rows, error match) of flowtt_bag_fwd calls that the
    handlers' shape checks (CheckBagFwd and the rows_fwd checks) reject."""
    num_bags = len(offsets) - 1
    dim = _dim(cores)
    good = (*cores, plan.unique_ids, plan.group_offsets, plan.counts, plan.inverse, weights, offsets)

    def swap(i, x):
        return good[:i] + (x,) + good[i + 1 :]

    return [
        (good, (num_bags, dim), 0, "chunk_rows must be >= 1"),
        (good, (num_bags, dim), -64, "chunk_rows must be >= 1"),
        (good, (num_bags + 1, dim), 64, "out must be"),
        (good, (num_bags, dim - 1), 64, "out must be"),
        (swap(6, plan.inverse[:-1]), (num_bags, dim), 64, "need inverse"),
        (swap(7, weights[:-1]), (num_bags, dim), 64, "need inverse"),
        (swap(8, np.asarray(offsets).reshape(1, -1)), (num_bags, dim), 64, "need inverse"),
        (swap(1, cores[0]), (num_bags, dim), 64, "ranks"),
        (swap(4, plan.group_offsets[:-1]), (num_bags, dim), 64, "plan arrays"),
    ]


def host_collection(tables, seed: int, **kwargs):
    """An nnx ``TTEmbeddingCollection`` of ``tables`` whose parameters are drawn on the host
    (standard normal; other state zero), not by its init program (a compile of seconds per
    table set): for a collection a test overwrites (``load_table_state``), only refuses with,
    or needs some random values of, not its init's. A cached table's hot ids are zeros here
    (row 0 in every slot, not ``EMPTY``): load over them before reading the cache."""
    from flax import nnx

    from flowtt_jax.nnx import TTEmbeddingCollection

    m = nnx.eval_shape(lambda: TTEmbeddingCollection(tables, rngs=nnx.Rngs(0), **kwargs))
    rng = np.random.default_rng(seed)

    def fill(path, s):
        draw = path[0].key == "params" and jnp.issubdtype(s.dtype, jnp.floating)
        return jax.device_put(
            rng.standard_normal(s.shape).astype(s.dtype) if draw else np.zeros(s.shape, s.dtype)
        )

    nnx.update(m, jax.tree_util.tree_map_with_path(fill, nnx.state(m)))
    return m
