"""The fuzz corpus: hostile and unusual inputs, a float64 numpy oracle, and a runner.

A ``Case`` is one call of ``tt_lookup``, ``tt_embedding_bag`` or
``tt_embedding_bag_group`` with everything fixed: table shapes (N from 1 to 10^7, D with
prime factors 7 and 13, ranks 1..64), ids (duplicates, all the same, sorted, reversed,
boundary ids, out of range, empty), bags (empty, none at all), weights (none, zero,
negative), every integer dtype, a mode and an out-of-range policy. ``run`` gives the
op's forward (no-gradient and training paths) and its gradients for a fixed cotangent;
``oracle`` gives the same from the definition in float64 numpy (no JAX).

Used by ``tests/test_fuzz.py`` (hypothesis draws the cases), by the corpus test below
(``CORPUS``: fixed seeds) and by ``scripts/fuzz_sanitize.py`` (the corpus on the GPU
under compute-sanitizer). ``FLOWTT_HYPOTHESIS_PROFILE=gpu`` runs the whole corpus here.
"""

from __future__ import annotations

import dataclasses
import math
import os

import jax
import numpy as np
import pytest

import flowtt_jax as ftt
from flowtt_jax import tt_embedding_bag_group
from flowtt_jax.kernels.group_plan import GroupLayout

INT_DTYPES = ("int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64")
ID_PATTERNS = ("uniform", "dups", "same", "sorted", "reverse", "boundary", "hot_prefix", "out_of_range")
DIMS = (1, 2, 4, 7, 8, 13, 16, 26, 32, 49, 64, 91, 128)
ROWS = (1, 2, 7, 97, 1000, 4096, 12345, 10**5, 10**6, 10**7)
RANKS = (1, 2, 3, 8, 16, 33, 64)
TOL = 2e-5  # relative to the norm of the float64 oracle


@dataclasses.dataclass(frozen=True)
class Case:
    kind: str  # "bag", "lookup" or "group"
    specs: tuple  # TTSpec per table (one unless "group")
    ids: np.ndarray  # [n] (lookup: any shape), its dtype is the one passed
    offsets: np.ndarray | None  # [B+1] ("bag"), [F*B+1] ("group")
    weights: np.ndarray | None  # [n] float32 or None
    mode: str
    oob: str
    feature_tables: tuple = (0,)
    seed: int = 0

    def describe(self) -> str:
        s = self.specs[0]
        n = self.ids.size
        bags = None if self.offsets is None else len(self.offsets) - 1
        return (
            f"{self.kind} N={[x.num_embeddings for x in self.specs]} D={s.embedding_dim} ranks={s.ranks} "
            f"n={n} bags={bags} {self.ids.dtype} w={self.weights is not None} {self.mode} {self.oob}"
        )


def make_spec(rows: int, dim: int, rank: int) -> ftt.TTSpec:
    return ftt.TTSpec.create(rows, dim, rank)


def make_ids(rng: np.random.Generator, pattern: str, n: int, rows: int, p3: int) -> np.ndarray:
    """int64 ids [n] of a pattern; "boundary" and "out_of_range" reach past [0, N)."""
    if pattern == "uniform":
        ids = rng.integers(0, rows, n)
    elif pattern == "dups":
        ids = rng.choice(rng.integers(0, rows, max(1, n // 8)), n)
    elif pattern == "same":
        ids = np.full(n, rng.integers(0, rows))
    elif pattern == "sorted":
        ids = np.sort(rng.integers(0, rows, n))
    elif pattern == "reverse":
        ids = np.sort(rng.integers(0, rows, n))[::-1]
    elif pattern == "boundary":
        ids = rng.choice(np.array([0, rows - 1, min(1, rows - 1), max(rows - 2, 0)]), n)
    elif pattern == "hot_prefix":
        base = rng.integers(0, -(-rows // p3)) * p3
        ids = np.minimum(base + rng.integers(0, p3, n), rows - 1)
    elif pattern == "out_of_range":
        ids = rng.choice(np.array([-1, -7, rows, rows + 5, 0, rows - 1]), n)
    else:
        raise ValueError(pattern)
    return ids.astype(np.int64)


def fit_dtype(ids: np.ndarray, dtype: str) -> np.ndarray:
    """ids in ``dtype``, or in int64 when they do not fit it (no wrap-around here)."""
    info = np.iinfo(dtype)
    if ids.size and (ids.min() < info.min or ids.max() > info.max):
        return ids.astype(np.int64)
    return ids.astype(dtype)


def random_offsets(rng: np.random.Generator, n: int, bags: int) -> np.ndarray:
    if bags == 0:
        return np.zeros(1, np.int32) if n == 0 else np.array([0], np.int32)
    cuts = np.sort(rng.integers(0, n + 1, bags - 1))
    if bags > 3:
        cuts[rng.integers(0, bags - 1)] = cuts[0]  # an empty bag at the front
        cuts = np.sort(cuts)
    return np.concatenate([[0], cuts, [n]]).astype(np.int32)


def make_weights(rng: np.random.Generator, kind: str, n: int) -> np.ndarray | None:
    if kind == "none":
        return None
    w = rng.standard_normal(n).astype(np.float32)
    if kind == "zeros":
        w[rng.random(n) < 0.4] = 0.0
    elif kind == "all_zero":
        w[:] = 0.0
    elif kind == "negative":
        w = -np.abs(w)
    return w


def make_case(
    seed: int,
    *,
    kind: str | None = None,
    rows=None,
    dim=None,
    rank=None,
    pattern=None,
    n=None,
    bags=None,
    weights=None,
    dtype=None,
    mode=None,
    oob=None,
) -> Case:
    """A case from a seed; any parameter given overrides the seed's draw."""
    rng = np.random.default_rng(seed)
    pick = lambda given, choices: given if given is not None else choices[rng.integers(len(choices))]
    kind = pick(kind, ("bag", "bag", "lookup", "group"))
    rows, dim, rank = pick(rows, ROWS), pick(dim, DIMS), pick(rank, RANKS)
    spec = make_spec(rows, dim, rank)
    pattern = pick(pattern, ID_PATTERNS)
    n = pick(n, (0, 1, 2, 31, 33, 64, 100, 257, 700))
    mode, oob = pick(mode, ("sum", "mean", "sqrtn")), pick(oob, ("zero", "clip"))
    specs = (spec,)
    feature_tables = (0,)
    if kind == "group":
        other = ftt.TTSpec.create(pick(None, ROWS[:7]), dim, rank, col_shape=spec.col_shape)
        if other.ranks != spec.ranks:
            other = ftt.TTSpec(other.num_embeddings, dim, other.row_shape, spec.col_shape, spec.ranks)
        specs = (spec, other)
        feature_tables = (0, 1, 0)
        rows = min(rows, other.num_embeddings)  # ids valid for both tables
    ids = make_ids(rng, pattern, n, rows, spec.row_shape[-1])
    ids = fit_dtype(ids, pick(dtype, INT_DTYPES))
    w = make_weights(rng, pick(weights, ("none", "normal", "zeros", "negative", "all_zero")), n)
    if kind == "lookup":
        return Case("lookup", specs, ids, None, None, "sum", oob, seed=seed)
    num_bags = pick(bags, (0, 1, 3, n // 4 + 1, n + 2))
    if kind == "group":
        num_bags = max(num_bags, 1) * len(feature_tables)
    offsets = random_offsets(rng, n, num_bags)
    return Case(kind, specs, ids, offsets, w, mode, oob, feature_tables, seed)


def make_cores(case: Case):
    """Gaussian cores per table, scaled as ``init_cores(std=1.0)`` scales them (rows of std
    1), drawn by numpy: no random program compiled per core shape."""
    cores = []
    for t, spec in enumerate(case.specs):
        rng = np.random.default_rng(case.seed + 17 * t)
        core_std = math.prod(spec.ranks) ** (-1.0 / (2 * spec.num_cores))
        draw = [(core_std * rng.standard_normal(s)).astype(np.float32) for s in spec.core_shapes]
        cores.append(tuple(jax.device_put(c) for c in draw))  # no program per shape
    return cores


def cotangent(case: Case, shape) -> np.ndarray:
    return np.random.default_rng(case.seed + 1).standard_normal(shape).astype(np.float32)


# ---- the float64 oracle (numpy, from the definitions) ----


def _digits(ids, row_shape):
    p1, p2, p3 = row_shape
    return ids // (p2 * p3), (ids // p3) % p2, ids % p3


def _rows_and_grads(cores, ids, d_rows=None):
    """Rows [n, D] of ids (in range) and, for d_rows [n, D], the core gradients."""
    g1, g2, g3 = (np.asarray(c, np.float64) for c in cores)
    i1, i2, i3 = _digits(ids, [c.shape[0] for c in cores])
    a, b, c = g1[i1, 0], g2[i2], g3[i3, :, :, 0]  # [n,q1,r1] [n,r1,q2,r2] [n,r2,q3]
    p = np.einsum("nxa,naqb->nxqb", a, b)
    rows = np.einsum("nxqb,nbz->nxqz", p, c).reshape(len(ids), -1)
    if d_rows is None:
        return rows, None
    dr = d_rows.reshape(p.shape[:3] + (c.shape[2],))
    dg3 = np.zeros_like(g3[..., 0])
    np.add.at(dg3, i3, np.einsum("nxqb,nxqz->nbz", p, dr))
    dp = np.einsum("nxqz,nbz->nxqb", dr, c)
    dg1 = np.zeros_like(g1[:, 0])
    np.add.at(dg1, i1, np.einsum("nxqb,naqb->nxa", dp, b))
    dg2 = np.zeros_like(g2)
    np.add.at(dg2, i2, np.einsum("nxa,nxqb->naqb", a, dp))
    return rows, (dg1[:, None], dg2, dg3[..., None])


def _bag_oracle(cores, ids, offsets, weights, mode, oob, num_rows, dout):
    """(out [B, D], core grads, weight grads [n] or None) of one table's bags."""
    ids = np.asarray(ids, np.int64)
    n, num_bags = ids.size, len(offsets) - 1
    dim = int(np.prod([c.shape[2] for c in cores]))
    bag = np.searchsorted(offsets, np.arange(n), side="right") - 1
    kept = (bag >= 0) & (bag < num_bags)
    valid = (ids >= 0) & (ids < num_rows)
    safe = np.clip(ids, 0, num_rows - 1)
    live = kept & (valid | (oob == "clip"))
    lengths = np.maximum(np.bincount(bag[kept], minlength=num_bags).astype(np.float64), 1)
    scale = {"sum": np.ones(num_bags), "mean": 1 / lengths, "sqrtn": 1 / np.sqrt(lengths)}[mode]
    if n == 0 or num_bags == 0:
        zeros = [np.zeros(c.shape) for c in cores]
        return np.zeros((num_bags, dim)), zeros, None if weights is None else np.zeros(n)
    w = np.ones(n) if weights is None else np.asarray(weights, np.float64)
    b = np.clip(bag, 0, num_bags - 1)
    eff = np.where(live, w * scale[b], 0.0)
    d_rows = eff[:, None] * dout[b]
    rows, grads = _rows_and_grads(cores, safe, d_rows)
    out = np.zeros((num_bags, dim))
    np.add.at(out, b, np.where((eff != 0)[:, None], eff[:, None] * rows, 0.0))
    d_w = None if weights is None else np.where(live, scale[b] * np.einsum("nd,nd->n", dout[b], rows), 0.0)
    return out, list(grads), d_w


def oracle(case: Case, cores) -> dict[str, np.ndarray]:
    """The case's outputs and gradients from the definition, float64."""
    spec = case.specs[0]
    if case.kind == "lookup":
        ids = np.asarray(case.ids, np.int64).reshape(-1)
        dout = cotangent(case, (ids.size, spec.embedding_dim)).astype(np.float64)
        offsets = np.arange(ids.size + 1)
        out, grads, _ = _bag_oracle(cores[0], ids, offsets, None, "sum", case.oob, spec.num_embeddings, dout)
        out = out.reshape(case.ids.shape + (spec.embedding_dim,))
        return {"out": out, **{f"dg{k + 1}": g for k, g in enumerate(grads)}}
    if case.kind == "bag":
        dout = cotangent(case, (len(case.offsets) - 1, spec.embedding_dim)).astype(np.float64)
        out, grads, d_w = _bag_oracle(
            cores[0], case.ids, case.offsets, case.weights, case.mode, case.oob, spec.num_embeddings, dout
        )
        res = {"out": out, **{f"dg{k + 1}": g for k, g in enumerate(grads)}}
        return res if d_w is None else {**res, "d_weights": d_w}
    num_f = len(case.feature_tables)
    batch = (len(case.offsets) - 1) // num_f
    dout = cotangent(case, (num_f, batch, spec.embedding_dim)).astype(np.float64)
    outs, d_w = [], np.zeros(case.ids.size)
    grads = [[np.zeros(c.shape) for c in cs] for cs in cores]
    for f, t in enumerate(case.feature_tables):
        lo, hi = case.offsets[f * batch], case.offsets[(f + 1) * batch]
        offs = case.offsets[f * batch : (f + 1) * batch + 1] - lo
        w = None if case.weights is None else case.weights[lo:hi]
        out, g, dw = _bag_oracle(
            cores[t], case.ids[lo:hi], offs, w, case.mode, case.oob, case.specs[t].num_embeddings, dout[f]
        )
        outs.append(out)
        grads[t] = [a + b for a, b in zip(grads[t], g)]
        if dw is not None:
            d_w[lo:hi] = dw
    res = {"out": np.stack(outs), **{f"dg{k + 1}": np.concatenate([g[k] for g in grads]) for k in range(3)}}
    return res if case.weights is None else {**res, "d_weights": d_w}


# ---- running a case through the library ----


def run(case: Case, impl: str, cores=None) -> dict[str, np.ndarray]:
    """The op's outputs on the default device: ``out`` (training forward, through the vjp),
    ``out_nograd`` (the forward alone, outside any differentiation), the core gradients and
    ``d_weights``; all of them from one program."""
    cores = make_cores(case) if cores is None else cores
    w, offsets = case.weights, case.offsets  # arguments of the program: traced, no host check
    rows = case.specs[0].num_embeddings
    if case.kind == "group":
        layout = GroupLayout(case.specs)
        params = jax.jit(layout.pack)(cores)
        fn = lambda p, w, o: tt_embedding_bag_group(
            p, layout, case.ids, o, case.feature_tables, weights=w, mode=case.mode, oob=case.oob, impl=impl
        )
    elif case.kind == "bag":
        params = tuple(cores[0])
        fn = lambda c, w, o: ftt.tt_embedding_bag(
            c, case.ids, offsets=o, weights=w, mode=case.mode, oob=case.oob, impl=impl, num_embeddings=rows
        )
    else:
        params = tuple(cores[0])
        fn = lambda c, w, o: ftt.tt_lookup(c, case.ids, oob=case.oob, impl=impl, num_embeddings=rows)
    fn = jax.jit(fn)
    dout = cotangent(case, jax.eval_shape(fn, params, w, offsets).shape)

    @jax.jit
    def step(params, w, offsets, dout):
        out, vjp = jax.vjp(lambda p, w: fn(p, w, offsets), params, w)
        return out, fn(params, w, offsets), *vjp(dout)

    out, out_nograd, d_params, d_w = step(params, w, offsets, dout)
    res = {"out": out, "out_nograd": out_nograd, **{f"dg{k + 1}": g for k, g in enumerate(d_params)}}
    if case.weights is not None:
        res["d_weights"] = d_w
    return {k: np.asarray(v) for k, v in res.items()}


def compare(got: dict, want: dict, tol: float = TOL) -> list[str]:
    """Names of the results outside ``tol`` (relative to the oracle's norm) or not finite."""
    bad = []
    for name, w in want.items():
        for key in [name] + (["out_nograd"] if name == "out" else []):
            g = np.asarray(got[key], np.float64)
            scale = max(np.linalg.norm(w), 1.0)
            if g.shape != w.shape or not np.isfinite(g).all() or np.linalg.norm(g - w) > tol * scale:
                bad.append(key)
    return bad


#: The fixed corpus: what ``scripts/fuzz_sanitize.py`` runs on the GPU. Seeds below
#: ``DRAWN`` are drawn by ``make_case``; the ``PINNED`` cases follow them: ids of one hot
#: prefix, so that a prefix group holds more than kCH = 64 unique ids and the kernels take
#: their checkpoint path (a group's P published to L2 for the chunks of its tail), which
#: the drawn cases reach once and the standalone harness's quick cases never.
DRAWN = 64
PINNED = (
    dict(kind="bag", rows=10**7, dim=32, rank=32, pattern="hot_prefix", n=700, weights="none"),
    dict(kind="lookup", rows=10**7, dim=32, rank=32, pattern="hot_prefix", n=700),
    dict(kind="bag", rows=10**7, dim=128, rank=64, pattern="hot_prefix", n=700, bags=16, weights="normal"),
    dict(kind="bag", rows=10**6, dim=16, rank=33, pattern="hot_prefix", n=700, weights="normal"),
    dict(kind="group", rows=10**7, dim=32, rank=16, pattern="hot_prefix", n=700, weights="normal"),
)
CORPUS_SIZE = DRAWN + len(PINNED)
KCH = 64  # unique ids per chunk of the CUDA forward (kCH, cuda/common/common.cuh)
CI_CASES = 6  # drawn cases run here by pytest unless FLOWTT_HYPOTHESIS_PROFILE=gpu (the pinned always)


def corpus_case(seed: int) -> Case:
    """Case ``seed`` of the corpus: drawn below ``DRAWN``, then the pinned ones."""
    return make_case(seed) if seed < DRAWN else make_case(seed, **PINNED[seed - DRAWN])


def corpus(size: int | None = None) -> list[Case]:
    """Cases 0..size-1 (default: the whole corpus)."""
    return [corpus_case(seed) for seed in range(CORPUS_SIZE if size is None else size)]


def kernel_refusal(case: Case, cores) -> str | None:
    """Why the default backend's kernels refuse ``case`` (None: they take it; the CPU
    kernels take every 3-core case, the CUDA ones have shape limits)."""
    from flowtt_jax.kernels import ffi
    from flowtt_jax.ops.pooled import kernels_unsupported_reason

    if case.kind == "group":
        return kernels_unsupported_reason(layout=GroupLayout(case.specs))
    return ffi.cuda_unsupported_reason([c.shape for c in cores[0]])


def _corpus_ids() -> list[int]:
    full = os.environ.get("FLOWTT_HYPOTHESIS_PROFILE") == "gpu"
    return list(range(DRAWN if full else CI_CASES)) + list(range(DRAWN, CORPUS_SIZE))


@pytest.mark.parametrize("seed", range(DRAWN, CORPUS_SIZE))
def test_pinned_cases_reach_the_checkpoint_path(seed):
    """Each pinned case has a prefix group of more than ``KCH`` unique in-range ids of its
    first table inside its bags, and the kernels take it (a check with teeth on a GPU,
    where the kernels have shape limits)."""
    case = corpus_case(seed)
    spec = case.specs[0]
    ids = case.ids.astype(np.int64).ravel()
    if case.offsets is not None:  # positions in a bag of a feature reading table 0
        bags = len(case.offsets) - 1
        per_feature = max(bags // len(case.feature_tables), 1)
        bag_of = np.searchsorted(case.offsets, np.arange(ids.size), side="right") - 1
        table_of = np.asarray(case.feature_tables)[np.minimum(bag_of, bags - 1) // per_feature]
        ids = ids[(bag_of < bags) & (table_of == 0)]
    ids = np.unique(ids[(ids >= 0) & (ids < spec.num_embeddings)])
    largest = np.unique(ids // spec.row_shape[-1], return_counts=True)[1].max()
    assert largest > KCH, (case.describe(), largest)
    assert kernel_refusal(case, make_cores(case)) is None


@pytest.mark.parametrize("seed", _corpus_ids())
def test_corpus_case_matches_the_float64_oracle(seed):
    case = corpus_case(seed)
    cores = make_cores(case)
    want = oracle(case, cores)
    for impl in ("auto", "reference"):
        got = run(case, impl, cores)
        assert not compare(got, want), (impl, case.describe(), compare(got, want))
