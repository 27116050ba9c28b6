"""Seeded workload generators: one TT table (the single-table sweep), Meta-like collections
and DLRM batches (``dlrm_batch``: the scaling stage's).

Every workload comes in the packed form of a table-batched op (FBGEMM's TBE, design 3b):
one flat int32 ``ids`` array, feature-major ``offsets [F*B + 1]`` (bag b of feature f is
``ids[offsets[f*B + b] : offsets[f*B + b + 1]]``), a static ``feature_table`` map and one
``TTSpec`` per table. A single table is the case F = T = 1.

Single table (``single_table``): N = 10^7 rows (row shape 200 x 200 x 250), D in {32, 128},
rank in {32, 64}, B bags of U[1, 27] ids (mean 14), ids uniform over the table or Zipf(alpha)
ranks (numpy's unbounded ``zipf`` minus 1) scattered over the table by the multiplicative
hash ``rank * 2654435761 mod N`` (computed in uint64, wrapping). It is the draw of the
original ``bench_single_table.py``, kept bit for bit: S1 (D 32, rank 32, B 32768, Zipf 1.05,
seed 0) has 457,971 ids. ``weighted=True`` adds per-id float32 weights, uniform in [0.5, 1.5)
from their own stream (``default_rng([seed, 2])``), so the ids stay the same; the case is
named with the suffix ``_w``.

Meta-like collection (``MetaLikeCollection``): a synthetic stand-in for Meta's 2022 synthetic
embedding-lookup trace (the source of the EcoRec and FlowTT papers' Meta-240/480/788
workloads, which take its first 240/480/788 tables). That trace is not available here; the
stand-in only matches the properties listed below, not the trace's actual tables:

- rows per table log-uniform in [10^4, 4*10^7]; dim 32, rank 32, automatic TT shapes;
- each table is one-hot (pooling exactly 1) with probability 0.1, else Poisson pooling
  (empty bags possible) with a per-table mean drawn log-normally (sigma 1) and scaled so
  that the expected mean pooling over all features is 13.6;
- ids of table t: exact bounded Zipf(alpha_t) ranks over its N_t rows (P(k) ~ k^-alpha_t),
  alpha_t uniform in [1.01, 1.2], hot ranks scattered over the table by the bijection
  ``rank * 2654435761 mod N_t`` (a prime above every N_t);
- one feature per table.

A table's rows, one-hot flag, alpha and raw pooling draw depend only on (seed, table index),
so the first 240 tables of the 480- and 788-table collections are the 240-table collection's
tables, like the papers' prefixes of the trace (only the pooling scale is renormalised per
collection). ``stats`` reports what a draw gives: mean pooling, one-hot fraction, unique ids.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Iterable, Sequence

import numpy as np

from flowtt_jax.tt.spec import TTSpec

__all__ = [
    "HASH",
    "Workload",
    "MetaLikeCollection",
    "single_table",
    "bounded_zipf",
    "prefix_groups",
    "dlrm_batch",
]

#: Knuth's multiplicative-hash constant, a prime: ``rank * HASH mod N`` scatters hot ranks.
HASH = 2654435761
S1_ROW_SHAPE = (200, 200, 250)


@dataclasses.dataclass(frozen=True)
class Workload:
    """Packed bags over a set of TT tables (see the module docstring).

    Attributes:
      name: case name, e.g. ``"D32_r32_B32768_zipf1.05"`` or ``"meta240_B4096"``.
      batch: B, bags per feature.
      ids: int32 ``[nnz]``, feature-major.
      offsets: int32 ``[F*B + 1]``, non-decreasing, ``offsets[0] = 0``, ``offsets[-1] = nnz``.
      feature_table: table of each feature, ``[F]``.
      specs: one ``TTSpec`` per table.
      params: the generator's parameters (JSON-able).
      weights: float32 per-id weights ``[nnz]``, or None (unweighted bags).
    """

    name: str
    batch: int
    ids: np.ndarray
    offsets: np.ndarray
    feature_table: tuple[int, ...]
    specs: tuple[TTSpec, ...]
    params: dict
    weights: np.ndarray | None = None

    @property
    def num_features(self) -> int:
        return len(self.feature_table)

    @property
    def nnz(self) -> int:
        return int(self.ids.shape[0])

    @property
    def feature_bounds(self) -> tuple[int, ...]:
        """Start of each feature's ids and the end of the last: ``offsets[::B]``, ``[F + 1]``."""
        return tuple(int(x) for x in self.offsets[:: self.batch])

    def stats(self) -> dict:
        """Sizes, pooling and reuse of the draw, and the FlowTT FLOP floor (float32 FLOPs).

        FLOP floor of the forward: per table, one ``G1[i1] . G2[i2]`` product per unique
        (i1, i2) prefix (2 q1 q2 r1 r2), one ``P . G3[i3]`` per unique id (2 D r2), plus one
        add per id and column for pooling; forward + backward: three times the TT part
        (dG3 and dP per unique id, dG1 and dG2 per prefix) plus two pooling passes. Weighted
        bags pool by a multiply-add (2 FLOPs per id and column) and the backward adds the
        weights' gradient (a dot of D per id); their stats carry ``"weighted": True``.
        """
        bounds = self.feature_bounds
        unique = groups = tt_flops = 0
        for f, t in enumerate(self.feature_table):
            spec = self.specs[t]
            u = np.unique(self.ids[bounds[f] : bounds[f + 1]])
            g = prefix_groups(u, spec.row_shape[-1])
            unique, groups = unique + u.size, groups + g
            q1, q2 = spec.col_shape[0], spec.col_shape[1]
            r1, r2 = spec.ranks[1], spec.ranks[2]
            tt_flops += 2.0 * g * q1 * q2 * r1 * r2 + 2.0 * u.size * spec.embedding_dim * r2
        dims = np.array([self.specs[t].embedding_dim for t in self.feature_table])
        lengths = np.diff(self.offsets).reshape(self.num_features, self.batch)
        pool_flops = float((lengths.sum(axis=1) * dims).sum())
        weighted = self.weights is not None
        pool = pool_flops * (2 if weighted else 1)
        d_weights = 2 * pool_flops if weighted else 0.0
        dense = sum(s.dense_params for s in self.specs) * 4
        tt = sum(s.num_params for s in self.specs) * 4
        out = {
            "tables": len(self.specs),
            "features": self.num_features,
            "batch": self.batch,
            "nnz": self.nnz,
            "num_unique": int(unique),
            "num_groups": int(groups),
            "unique_fraction": unique / max(self.nnz, 1),
            "mean_pooling": self.nnz / (self.num_features * self.batch),
            "one_hot_fraction": float(np.mean(np.all(lengths == 1, axis=1))),
            "rows": int(sum(s.num_embeddings for s in self.specs)),
            "dense_param_bytes": dense,
            "tt_param_bytes": tt,
            "compression_ratio": dense / tt,
            "flop_floor": {"fwd": tt_flops + pool, "fwd_bwd": 3 * tt_flops + 2 * pool + d_weights},
        }
        return {**out, "weighted": True} if weighted else out


def prefix_groups(unique_ids: np.ndarray, last_extent: int) -> int:
    """Number of distinct (i1, i2) prefixes among sorted unique ids (3 cores: id // p3)."""
    if unique_ids.size == 0:
        return 0
    prefix = unique_ids // last_extent
    return int(np.count_nonzero(np.diff(prefix)) + 1)


def single_table(
    num_embeddings: int = 10**7,
    dim: int = 32,
    rank: int = 32,
    batch: int = 32768,
    dist: str = "zipf1.05",
    seed: int = 0,
    row_shape: Sequence[int] | None = S1_ROW_SHAPE,
    weighted: bool = False,
) -> Workload:
    """One table, ``batch`` bags of U[1, 27] ids; ``dist`` is ``"uniform"`` or ``"zipf<alpha>"``.

    The draw is the original single-table benchmark's (lengths, then ids, from one
    ``default_rng(seed)``), so the defaults give S1 exactly. ``row_shape=None`` picks
    automatic shapes (for tables other than 10^7 rows). ``weighted`` adds per-id weights
    (module docstring).
    """
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 28, batch)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    n = int(offsets[-1])
    if dist == "uniform":
        ids = rng.integers(0, num_embeddings, n)
    elif dist.startswith("zipf"):
        ranks = rng.zipf(float(dist[4:]), n) - 1
        ids = (ranks.astype(np.uint64) * np.uint64(HASH)) % np.uint64(num_embeddings)
    else:
        raise ValueError(f"dist must be 'uniform' or 'zipf<alpha>', got {dist!r}")
    spec = TTSpec.create(num_embeddings, dim, rank, row_shape=tuple(row_shape) if row_shape else None)
    weights = np.random.default_rng([seed, 2]).uniform(0.5, 1.5, n).astype(np.float32) if weighted else None
    return Workload(
        name=f"D{dim}_r{rank}_B{batch}_{dist}" + ("_w" if weighted else ""),
        batch=batch,
        ids=ids.astype(np.int32),
        offsets=offsets,
        feature_table=(0,),
        specs=(spec,),
        params={
            "generator": "single_table",
            "num_embeddings": num_embeddings,
            "dim": dim,
            "rank": rank,
            "batch": batch,
            "dist": dist,
            "seed": seed,
            "row_shape": list(spec.row_shape),
            "col_shape": list(spec.col_shape),
            **({"weighted": True} if weighted else {}),
        },
        weights=weights,
    )


def bounded_zipf(rng: np.random.Generator, alpha: float, n: int, size: int) -> np.ndarray:
    """Exact Zipf ranks in [0, n): P(k) proportional to (k + 1)^-alpha, alpha > 1.

    Rejection-inversion (Hoermann and Derflinger 1996), vectorised: about one uniform
    per draw whatever n, no table of n probabilities.
    """
    s = float(alpha)

    def h_int(x):  # integral of x^-s: (x^(1-s) - 1) / (1 - s)
        return np.expm1((1.0 - s) * np.log(x)) / (1.0 - s)

    def h_int_inv(y):
        return np.exp(np.log1p(np.maximum(y * (1.0 - s), -1.0 + 1e-16)) / (1.0 - s))

    lo, hi = h_int(1.5) - 1.0, h_int(n + 0.5)
    threshold = 2.0 - h_int_inv(h_int(2.5) - 2.0**-s)
    out = np.empty(size, np.int64)
    todo = np.arange(size)
    while todo.size:
        u = hi + rng.random(todo.size) * (lo - hi)
        x = h_int_inv(u)
        k = np.clip(np.floor(x + 0.5), 1, n)
        ok = (k - x <= threshold) | (u >= h_int(k + 0.5) - k**-s)
        out[todo[ok]] = k[ok].astype(np.int64) - 1
        todo = todo[~ok]
    return out


@dataclasses.dataclass(frozen=True)
class MetaLikeCollection:
    """The tables of a Meta-like collection (no ids yet; ``draw`` makes a batch).

    Attributes:
      rows: N_t per table; one_hot: whether table t's feature has pooling 1;
      pooling_mean: Poisson mean of the multi-hot tables (1.0 for one-hot ones);
      alpha: Zipf exponent per table; specs: TT specs (dim, rank, automatic shapes).
    """

    num_tables: int
    seed: int
    rows: np.ndarray
    one_hot: np.ndarray
    pooling_mean: np.ndarray
    alpha: np.ndarray
    specs: tuple[TTSpec, ...]
    params: dict

    @classmethod
    def create(
        cls,
        num_tables: int,
        seed: int = 0,
        *,
        rows_range: tuple[float, float] = (1e4, 4e7),
        one_hot_prob: float = 0.1,
        mean_pooling: float = 13.6,
        pooling_sigma: float = 1.0,
        alpha_range: tuple[float, float] = (1.01, 1.2),
        dim: int = 32,
        rank: int = 32,
    ) -> MetaLikeCollection:
        """Table properties of ``num_tables`` tables; table t's draws depend on (seed, t) only."""
        rows, one_hot, z, alpha = [], [], [], []
        for t in range(num_tables):
            rng = np.random.default_rng([seed, t, 0])
            rows.append(int(math.exp(rng.uniform(math.log(rows_range[0]), math.log(rows_range[1])))))
            one_hot.append(bool(rng.random() < one_hot_prob))
            z.append(rng.lognormal(0.0, pooling_sigma))
            alpha.append(rng.uniform(*alpha_range))
        one_hot_a, z_a = np.array(one_hot, bool), np.array(z)
        multi = ~one_hot_a
        # Scale the multi-hot means so the expected pooling over all features is mean_pooling.
        target = (mean_pooling * num_tables - one_hot_a.sum()) / max(multi.sum(), 1)
        scale = target / z_a[multi].mean() if multi.any() else 0.0
        pooling = np.where(multi, z_a * scale, 1.0)
        specs = tuple(TTSpec.create(n, dim, rank) for n in rows)
        params = {
            "generator": "meta_like",
            "num_tables": num_tables,
            "seed": seed,
            "rows_range": list(rows_range),
            "one_hot_prob": one_hot_prob,
            "mean_pooling": mean_pooling,
            "pooling_sigma": pooling_sigma,
            "alpha_range": list(alpha_range),
            "dim": dim,
            "rank": rank,
        }
        return cls(
            num_tables, seed, np.array(rows, np.int64), one_hot_a, pooling, np.array(alpha), specs, params
        )

    @property
    def dense_param_bytes(self) -> int:
        return sum(s.dense_params for s in self.specs) * 4

    def draw_tables(self, batch: int, tables: Iterable[int]) -> list[tuple[np.ndarray, np.ndarray]]:
        """(int32 ids, bag lengths) of each table of ``tables`` in ``draw(batch)``: table t's
        bags are seeded by (seed, t, batch) alone."""
        out = []
        for t in tables:
            rng = np.random.default_rng([self.seed, t, 1, batch])
            if self.one_hot[t]:
                n_t = np.ones(batch, np.int64)
            else:
                n_t = rng.poisson(self.pooling_mean[t], batch)
            ranks = bounded_zipf(rng, self.alpha[t], int(self.rows[t]), int(n_t.sum()))
            ids = (ranks.astype(np.uint64) * np.uint64(HASH)) % np.uint64(self.rows[t])
            out.append((ids.astype(np.int32), n_t))
        return out

    def draw(self, batch: int, *, map: Callable = map, wide_offsets: bool = False) -> Workload:
        """``batch`` bags per feature (one feature per table), seeded by (seed, t, batch).

        ``map`` runs ``draw_tables`` over chunks of 8 tables (e.g. a process pool's ``map``:
        the same bags, drawn in parallel). Offsets are int32; past 2^31 ids an error, or
        with ``wide_offsets`` int64 (a batch that is split over devices before the op).
        """
        chunks = [range(t, min(t + 8, self.num_tables)) for t in range(0, self.num_tables, 8)]
        parts = [p for chunk in map(functools.partial(self.draw_tables, batch), chunks) for p in chunk]
        offsets = np.concatenate([[0], np.cumsum(np.concatenate([n for _, n in parts]))])
        if offsets[-1] >= 2**31 and not wide_offsets:
            raise ValueError(f"{offsets[-1]} ids do not fit int32 offsets")
        return Workload(
            name=f"meta{self.num_tables}_B{batch}",
            batch=batch,
            ids=np.concatenate([ids for ids, _ in parts]),
            offsets=offsets.astype(np.int32 if offsets[-1] < 2**31 else np.int64),
            feature_table=tuple(range(self.num_tables)),
            specs=self.specs,
            params={**self.params, "batch": batch},
        )


def dlrm_batch(cards: Sequence[int], batch: int, seed: int) -> tuple[np.ndarray, ...]:
    """A DLRM batch over tables of ``cards`` rows: dense ``[B, 13]`` standard normal, sparse
    ``[B, len(cards)]`` int32 Zipf(1.2) ranks scattered over each table by ``HASH``, labels
    ``[B]`` (1 with probability 0.25)."""
    rng = np.random.default_rng(seed)
    dense = rng.standard_normal((batch, 13)).astype(np.float32)
    ranks = np.minimum(rng.zipf(1.2, (batch, len(cards))) - 1, 2**40)
    sparse = ((ranks.astype(np.uint64) * np.uint64(HASH)) % np.asarray(cards, np.uint64)).astype(np.int32)
    labels = (rng.random(batch) < 0.25).astype(np.float32)
    return dense, sparse, labels
