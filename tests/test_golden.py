"""Reproducibility pinned, not only repeated.

- Golden bits: SHA-256 of the outputs and gradients of small fixed inputs, checked in
  per platform under ``tests/golden/`` (``cpu_<machine>.json``, ``cuda_sm<NN>.json``).
  A reordered or re-parallelised loop that stays deterministic changes bits and fails
  here. Recording: ``FLOWTT_GOLDEN_RECORD=DIR`` writes the hashes this run computes to
  ``DIR/<platform>.json`` (merged into what is there); a platform without a checked-in
  file skips. CUDA, on the device:
  ``FLOWTT_GOLDEN_RECORD=$OUT python -m pytest -m gpu tests/test_golden.py``, then copy
  ``$OUT/cuda_sm90.json`` to ``tests/golden/``.
- Exact arithmetic: integer-valued cores, weights and cotangents, where float32 is exact
  in any order, compared with ``==`` against the float64 reference (every path).
- The documented summation order of the pooling (increasing position in a bag; sorted,
  i.e. increasing position, per unique id in the backward) on inputs where float32
  rounding depends on the order, compared with ``==`` to a float32 simulation.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform as host_platform
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flowtt_jax as ftt
from flowtt_jax import tt_embedding_bag_group
from flowtt_jax.kernels import ffi
from flowtt_jax.kernels.group_plan import GroupLayout
from flowtt_jax.ops.pooled import kernels_unsupported_reason
from tests.helpers import cuda_device, f32, poisoned_call

GOLDEN_DIR = Path(__file__).resolve().parent / "golden"
GPU = cuda_device()
PLATFORMS = [
    pytest.param("cpu", id="cpu"),
    pytest.param(
        "cuda",
        id="cuda",
        marks=[pytest.mark.gpu, pytest.mark.skipif(GPU is None, reason="needs a GPU and _flowtt_cuda")],
    ),
]

SPEC = ftt.TTSpec.create(2880, 16, 8, row_shape=(8, 9, 40), col_shape=(2, 2, 4))
SPECS_GROUP = (SPEC, ftt.TTSpec.create(300, 16, 8, row_shape=(5, 6, 10), col_shape=(2, 2, 4)))


def _device(platform: str) -> jax.Device:
    return GPU if platform == "cuda" else jax.devices("cpu")[0]


def _key(platform: str) -> str:
    if platform == "cuda":
        return "cuda_sm" + str(GPU.compute_capability).replace(".", "")
    return f"cpu_{host_platform.machine()}"


def _bits(seed: int, size: int) -> np.ndarray:
    """splitmix64 of 0..size-1 (seeded): fixed forever, unlike library RNG streams."""
    with np.errstate(over="ignore"):
        x = np.arange(size, dtype=np.uint64) + np.uint64(seed) * np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def _uniform(seed: int, shape) -> np.ndarray:
    """float32 in [-1, 1), 24-bit values (exact in float32)."""
    b = _bits(seed, int(np.prod(shape))) >> np.uint64(40)
    return (b.astype(np.float64) / 2**23 - 1.0).astype(np.float32).reshape(shape)


def _ints(seed: int, shape, lo: int, hi: int) -> np.ndarray:
    return ((_bits(seed, int(np.prod(shape))) % np.uint64(hi - lo)).astype(np.int64) + lo).reshape(shape)


def _inputs(spec: ftt.TTSpec, seed: int, n: int = 700, num_bags: int = 40):
    """ids [n] (a hot id 300 times, a hot prefix group, uniform, the last row), CSR offsets
    with empty bags, weights with zeros and negatives, a cotangent [num_bags, D]."""
    rows = spec.num_embeddings
    ids = _ints(seed, (n,), 0, rows)
    ids[_ints(seed + 1, (300,), 0, n)] = 1234 % rows  # a hot id: runs longer than 32
    p3 = spec.row_shape[2]
    ids[::7] = (57 * p3) % rows // p3 * p3 + ids[::7] % p3  # one prefix group (i1, i2), many i3
    ids[::11] = rows - 1
    cuts = np.sort(_ints(seed + 2, (num_bags - 1,), 0, n + 1))
    cuts[5:9] = cuts[5]  # empty bags
    offsets = np.concatenate([[0], cuts, [n]]).astype(np.int32)
    weights = _uniform(seed + 3, (n,)) * 2
    weights[::13] = 0.0
    dout = _uniform(seed + 4, (num_bags, spec.embedding_dim))
    return ids.astype(np.int32), offsets, weights, dout


def _cores(spec: ftt.TTSpec, seed: int):
    return tuple(jnp.asarray(_uniform(seed + k, s)) for k, s in enumerate(spec.core_shapes))


def _bag_vjp(cores, ids, offsets, weights, dout, **kw):
    f = lambda c, w: ftt.tt_embedding_bag(c, ids, offsets=offsets, weights=w, impl="ffi", **kw)
    out, vjp = jax.vjp(f, cores, weights)
    (d_cores, d_weights) = vjp(jnp.asarray(dout))
    return out, d_cores, d_weights


def _case_bag_sum():
    cores = _cores(SPEC, 10)
    ids, offsets, _, dout = _inputs(SPEC, 20)
    f = lambda c: ftt.tt_embedding_bag(c, ids, offsets=offsets, impl="ffi")
    out, vjp = jax.vjp(f, cores)
    (g,) = vjp(jnp.asarray(dout))
    return {"out": out, "dg1": g[0], "dg2": g[1], "dg3": g[2]}


def _case_bag_weighted_mean():
    cores = _cores(SPEC, 30)
    ids, offsets, weights, dout = _inputs(SPEC, 40)
    out, g, d_w = _bag_vjp(cores, ids, offsets, weights, dout, mode="mean")
    return {"out": out, "dg1": g[0], "dg2": g[1], "dg3": g[2], "d_weights": d_w}


def _case_lookup():
    cores = _cores(SPEC, 50)
    ids, _, _, _ = _inputs(SPEC, 60)
    dout = _uniform(70, (ids.shape[0], SPEC.embedding_dim))
    out, vjp = jax.vjp(lambda c: ftt.tt_lookup(c, ids, impl="ffi"), cores)
    (g,) = vjp(jnp.asarray(dout))
    return {"out": out, "dg1": g[0], "dg2": g[1], "dg3": g[2]}


def _case_bag_fwd_chunks():
    """The no-gradient forward in chunks of 64 unique rows (chunk-major sums)."""
    cores = _cores(SPEC, 80)
    ids, offsets, weights, _ = _inputs(SPEC, 90)
    plan = ffi.plan(jnp.asarray(ids), SPEC.row_shape[2], SPEC.num_embeddings)
    chunked = jax.jit(ffi.bag_fwd, static_argnums=4)(
        cores, plan, jnp.asarray(weights), jnp.asarray(offsets), 64
    )
    return {"out_chunks64": chunked, "out_forward": ftt.tt_embedding_bag(cores, ids, offsets=offsets)}


def _case_group():
    layout = GroupLayout(SPECS_GROUP)
    if kernels_unsupported_reason(layout=layout):
        pytest.skip(f"batched kernels: {kernels_unsupported_reason(layout=layout)}")
    packed = layout.pack([_cores(s, 100 + 10 * t) for t, s in enumerate(SPECS_GROUP)])
    ids, offsets, weights, _ = _inputs(SPECS_GROUP[1], 120, n=600, num_bags=60)  # 3 features x 20
    dout = _uniform(130, (3, 20, 16))
    f = lambda p, w: tt_embedding_bag_group(p, layout, ids, offsets, (0, 1, 0), weights=w, impl="ffi")
    out, vjp = jax.vjp(f, packed, jnp.asarray(weights))
    g, d_w = vjp(jnp.asarray(dout))
    return {"out": out, "dg1": g[0], "dg2": g[1], "dg3": g[2], "d_weights": d_w}


CASES = {
    "bag_sum": _case_bag_sum,
    "bag_weighted_mean": _case_bag_weighted_mean,
    "lookup": _case_lookup,
    "bag_fwd_chunks": _case_bag_fwd_chunks,
    "group": _case_group,
}


def _digest(x) -> str:
    a = np.ascontiguousarray(np.asarray(x))
    return f"{a.dtype}{list(a.shape)}:" + hashlib.sha256(a.tobytes()).hexdigest()


def _record(key: str, device: jax.Device, case: str, digests: dict[str, str]) -> None:
    out_dir = os.environ.get("FLOWTT_GOLDEN_RECORD")
    if not out_dir:
        return
    path = Path(out_dir) / f"{key}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    data = json.loads(path.read_text()) if path.exists() else {}
    data.setdefault("cases", {})[case] = digests
    data["recorded_with"] = {"jax": jax.__version__, "device": str(device.device_kind)}
    path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("platform", PLATFORMS)
def test_golden_bits(platform, case):
    if not ffi.available():
        pytest.skip("no extension")
    key = _key(platform)
    with jax.default_device(_device(platform)):
        digests = {name: _digest(x) for name, x in CASES[case]().items()}
    _record(key, _device(platform), case, digests)
    path = GOLDEN_DIR / f"{key}.json"
    if not path.exists():
        pytest.skip(
            f"no {path.name}: record with FLOWTT_GOLDEN_RECORD=DIR, copy DIR/{key}.json to tests/golden/"
        )
    golden = json.loads(path.read_text())["cases"].get(case)
    if golden is None:
        pytest.skip(f"{case} not recorded in {path.name}")
    changed = sorted(k for k in golden if golden[k] != digests.get(k))
    assert not changed, (
        f"{case}: {changed} changed bits against {path.name} (a summation order moved; if on purpose, "
        "re-record with FLOWTT_GOLDEN_RECORD and say why in the commit)"
    )


# ---- exact arithmetic: integer values, exact in float32 in any order ----


def _int_cores(spec, seed):
    return tuple(
        jnp.asarray(_ints(seed + k, s, -1, 2).astype(np.float32)) for k, s in enumerate(spec.core_shapes)
    )


def _exact_case(seed, n=500, num_bags=30):
    ids, offsets, _, _ = _inputs(SPEC, seed, n=n, num_bags=num_bags)
    weights = _ints(seed + 5, (n,), -2, 3).astype(np.float32)
    dout = _ints(seed + 6, (num_bags, SPEC.embedding_dim), -2, 3).astype(np.float32)
    return ids, offsets, weights, dout


def _f64_grads(fn, cores, weights, dout):
    with jax.enable_x64(True), jax.default_device(jax.devices("cpu")[0]):
        c64 = tuple(jnp.asarray(np.asarray(c), jnp.float64) for c in cores)
        out, vjp = jax.vjp(fn, c64, jnp.asarray(weights, jnp.float64))
        return out, *vjp(jnp.asarray(dout, jnp.float64))


def _assert_exact(got, want):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        g, w = np.asarray(g, np.float64), np.asarray(w)
        assert np.all(np.abs(w) < 2**24) and np.array_equal(g, w), np.abs(g - w).max()


@pytest.mark.parametrize("platform", PLATFORMS)
def test_exact_integer_bags_equal_the_float64_reference(platform):
    cores = _int_cores(SPEC, 200)
    ids, offsets, weights, dout = _exact_case(210)

    def bags(impl):
        return lambda c, w: ftt.tt_embedding_bag(c, ids, offsets=offsets, weights=w, impl=impl)

    want = _f64_grads(bags("reference"), cores, weights, dout)
    with jax.default_device(_device(platform)):
        for impl in ("ffi", "reference"):
            out, vjp = jax.vjp(bags(impl), cores, jnp.asarray(weights))
            _assert_exact((out, *vjp(jnp.asarray(dout))), want)
            fwd = jax.jit(bags(impl))(cores, jnp.asarray(weights))  # no-gradient forward
            _assert_exact(fwd, want[0])
        lookup = lambda c, w: ftt.tt_lookup(c, ids, impl="ffi") * w[:, None]
        d_rows = _ints(220, (ids.shape[0], SPEC.embedding_dim), -2, 3).astype(np.float32)
        out, vjp = jax.vjp(lookup, cores, jnp.asarray(weights))
        _assert_exact(
            (out, *vjp(jnp.asarray(d_rows))),
            _f64_grads(
                lambda c, w: ftt.tt_lookup(c, ids, impl="reference") * w[:, None], cores, weights, d_rows
            ),
        )


@pytest.mark.parametrize("platform", PLATFORMS)
def test_exact_integer_group_equals_the_float64_reference(platform):
    layout = GroupLayout(SPECS_GROUP)
    packed = layout.pack([_int_cores(s, 300 + 10 * t) for t, s in enumerate(SPECS_GROUP)])
    ids, offsets, weights, _ = _exact_case(310, n=400, num_bags=45)
    dout = _ints(320, (3, 15, 16), -2, 3).astype(np.float32)
    group = lambda impl: (
        lambda p, w: tt_embedding_bag_group(p, layout, ids % 300, offsets, (0, 1, 0), weights=w, impl=impl)
    )
    want = _f64_grads(group("reference"), packed, weights, dout)
    with jax.default_device(_device(platform)):
        out, vjp = jax.vjp(group("auto"), packed, jnp.asarray(weights))
        _assert_exact((out, *vjp(jnp.asarray(dout))), want)


# ---- the pooling's documented order, on order-sensitive inputs ----


def _seq_f32(values) -> np.float32:
    acc = np.float32(0)
    for v in values:
        acc = np.float32(acc + np.float32(v))
    return acc


@pytest.mark.parametrize("platform", PLATFORMS)
def test_pooling_sums_in_the_documented_order(platform):
    """Bag contributions 2^24, 1, 1, -2^24 (and more) sum to 0 in increasing position
    (2^24 + 1 rounds to 2^24), to 2 reversed, to 1 pairwise: only the documented order
    passes. The backward sums one id's occurrences in sorted (= increasing position) order."""
    if not ffi.available():
        pytest.skip("no extension")
    big = float(2**24)
    seqs = [[big, 1.0, 1.0, -big], [1.0, big, -big, 1.0, 1.0], [-big, 1.0, big, 1.0, 3.0, -4.0]]
    dim = 8
    weights = np.concatenate([np.asarray(s, np.float32) for s in seqs])
    n = weights.shape[0]
    offsets = np.concatenate([[0], np.cumsum([len(s) for s in seqs])]).astype(np.int32)
    rows = np.zeros((n, dim), np.float32)
    rows[0] = 1.0  # every position reads unique row 0 (all ones)
    ids = jnp.zeros((n,), jnp.int32)
    plan = ftt.make_plan(ids, 1)
    device = _device(platform)
    (out,) = poisoned_call(
        "flowtt_bag_pool_fwd",
        [f32((len(seqs), dim))],
        rows,
        plan.inverse,
        weights,
        offsets,
        np.zeros((0,), np.int32),
        np.zeros((0, dim), np.float32),
        device=device,
        batch=np.int64(0),
        lo=np.int64(0),
    )
    want = np.array([_seq_f32(s) for s in seqs], np.float32)
    assert want[0] == 0 and _seq_f32(seqs[0][::-1]) == 2  # the order shows
    assert np.array_equal(np.asarray(out), np.repeat(want[:, None], dim, 1))

    # backward: one id at every position, position k in bag k, dout[k] = the sequence
    flat = weights
    dout = np.repeat(flat[:, None], dim, 1)
    ones = np.ones(n, np.float32)
    bag_ids = np.arange(n, dtype=np.int32)
    d_rows, _ = poisoned_call(
        "flowtt_bag_pool_bwd",
        [f32((n, dim)), f32((n,))],
        dout,
        rows,
        ones,
        plan.inverse,
        bag_ids,
        plan.perm,
        plan.run_offsets,
        plan.counts,
        device=device,
        lo=np.int64(0),
    )
    assert np.array_equal(np.asarray(d_rows)[0], np.full(dim, _seq_f32(flat), np.float32))
