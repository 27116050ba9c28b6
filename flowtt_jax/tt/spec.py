"""TT table specification: shapes, ranks and their automatic choice.

A table of ``num_embeddings`` N rows and ``embedding_dim`` D is stored as d cores,
core k of shape ``[p_k, r_{k-1}, q_k, r_k]`` with ``prod(row_shape) >= N``,
``prod(col_shape) == D`` and ranks ``(1, r_1, ..., r_{d-1}, 1)``.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from collections.abc import Mapping

import numpy as np

__all__ = ["TTSpec", "as_cores", "factor_rows", "factor_cols"]

# Weight of shape imbalance (log max/min) against padding fraction when choosing
# the row shape: an exact factorisation wins over a slightly more balanced one.
_BALANCE_WEIGHT = 0.01


def _score(shape: tuple[int, ...], n: int) -> float:
    pad = math.prod(shape) / n - 1.0
    return pad + _BALANCE_WEIGHT * math.log(max(shape) / min(shape))


#: Ids are int32: ``prod(row_shape)`` (and so N) must stay below this.
ID_LIMIT = 2**31


def _best_pair(n: int, limit: int) -> tuple[int, int] | None:
    """Best (p1, p2) with n <= p1 * p2 < limit, p1 <= p2 (vectorised search around sqrt n)."""
    root = math.isqrt(n)
    lo = max(1, int(root / 1.6))
    p1 = np.arange(lo, max(root, 1) + 2, dtype=np.int64)
    p2 = -(-n // p1)
    ok = (p1 <= p2) & (p1 * p2 < limit)
    if not ok.any():
        return None
    p1, p2 = p1[ok], p2[ok]
    pad = (p1 * p2) / n - 1.0
    score = pad + _BALANCE_WEIGHT * np.log(p2 / p1)
    i = int(np.argmin(score))
    return int(p1[i]), int(p2[i])


def _factor(n: int, d: int, limit: int) -> tuple[int, ...] | None:
    if d == 1:
        return (n,) if n < limit else None
    if d == 2:
        return _best_pair(n, limit)
    root = n ** (1.0 / d)
    best, best_shape = math.inf, None
    for p1 in range(max(1, int(root / 1.6)), int(math.ceil(root)) + 2):
        rest = _factor(-(-n // p1), d - 1, -(-limit // p1))  # p1 * prod(rest) < limit
        if rest is None:
            continue
        shape = tuple(sorted((p1,) + rest))
        s = _score(shape, n)
        if s < best:
            best, best_shape = s, shape
    return best_shape


@functools.lru_cache(maxsize=4096)  # a collection asks for each table's shape more than once
def factor_rows(n: int, d: int, limit: int = ID_LIMIT) -> tuple[int, ...]:
    """Near-balanced ``d`` factors with ``n <= product < limit``, ascending.

    Minimises ``padding fraction + 0.01 * log(max / min)``: a factorisation padded by
    0.1% beats one 10% less balanced, but not one twice as unbalanced. For 10^7 that
    gives 202*222*223 (212 padding rows); pass ``row_shape`` for e.g. (200, 200, 250).
    ``limit`` (2^31: int32 ids) binds only near it: 2^31 - 2 gives 993*1302*1661 exactly.
    """
    if n < 1 or d < 1:
        raise ValueError(f"need n >= 1 and d >= 1, got n={n}, d={d}")
    shape = _factor(n, d, limit)
    if shape is None:
        hint = "pass row_shape"
        if _is_prime(n):
            hint = (
                f"{n} is prime, so only a degenerate row shape holds it, e.g. "
                f"row_shape={(n,) + (1,) * (d - 1)}; or use at most 2^31 - 2 rows (993 x 1302 x 1661)"
            )
        raise ValueError(
            f"no near-balanced row shape of {d} factors with {n} <= product < {limit} (ids are int32): {hint}"
        )
    return shape


def _is_prime(n: int) -> bool:
    return n > 1 and all(n % k for k in range(2, math.isqrt(n) + 1))


def factor_cols(dim: int, d: int) -> tuple[int, ...]:
    """``d`` factors with product exactly ``dim``, most balanced, ascending."""
    if dim < 1 or d < 1:
        raise ValueError(f"need dim >= 1 and d >= 1, got dim={dim}, d={d}")
    divisors = [k for k in range(1, dim + 1) if dim % k == 0]
    best, best_shape = math.inf, None
    for combo in itertools.combinations_with_replacement(divisors, d - 1):
        last, rem = divmod(dim, math.prod(combo))
        if rem:
            continue
        shape = tuple(sorted(combo + (last,)))
        ratio = shape[-1] / shape[0]
        if ratio < best:
            best, best_shape = ratio, shape
    assert best_shape is not None
    return best_shape


def as_cores(cores) -> tuple:
    """``cores`` as a tuple of 4-D arrays, or a ``TypeError`` / ``ValueError`` that names
    what was passed: TT cores are a sequence (the tuple ``init_cores`` returns), not a
    dict or one array."""
    if isinstance(cores, Mapping):
        raise TypeError(
            "cores must be a sequence of TT cores [p, r_in, q, r_out] (the tuple init_cores "
            f"returns), got a {type(cores).__name__} with keys {list(cores)[:4]}; pass the cores "
            "as a tuple in core order (first core first)"
        )
    if hasattr(cores, "shape") and hasattr(cores, "dtype"):
        raise TypeError(
            "cores must be a sequence of TT cores [p, r_in, q, r_out] (the tuple init_cores "
            f"returns), got a single array of shape {tuple(cores.shape)}"
        )
    try:
        cores = tuple(cores)
    except TypeError:
        raise TypeError(f"cores must be a sequence of TT cores, got {type(cores).__name__}") from None
    for k, c in enumerate(cores):
        if not (hasattr(c, "shape") and hasattr(c, "dtype")):
            raise TypeError(f"cores[{k}] must be an array [p, r_in, q, r_out], got {type(c).__name__}")
    if len(cores) < 2:
        raise ValueError(f"a TT table needs at least 2 cores, got {len(cores)}")
    shapes = [tuple(c.shape) for c in cores]
    if any(len(s) != 4 for s in shapes):
        raise ValueError(f"cores must be 4-D [p, r_in, q, r_out], got shapes {shapes}")
    return cores


def _as_ranks(rank, count: int) -> tuple[int, ...]:
    """``rank`` (an int, or a sequence of ints) as ``count`` internal ranks; ``TypeError``
    naming ``rank`` for anything else (a float, a string, a bool)."""

    def is_int(x) -> bool:
        return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))

    if is_int(rank):
        return (int(rank),) * count
    if isinstance(rank, (str, bytes)) or not hasattr(rank, "__iter__") or not all(is_int(r) for r in rank):
        raise TypeError(f"rank must be an int or a sequence of {count} ints, got {rank!r}")
    return tuple(int(r) for r in rank)


def _max_ranks(row_shape: tuple[int, ...], col_shape: tuple[int, ...]) -> tuple[int, ...]:
    """Largest useful internal ranks (the full-rank TT of a dense table)."""
    sizes = [p * q for p, q in zip(row_shape, col_shape)]
    return tuple(min(math.prod(sizes[: k + 1]), math.prod(sizes[k + 1 :])) for k in range(len(sizes) - 1))


@dataclasses.dataclass(frozen=True)
class TTSpec:
    """Shape of a TT embedding table (hashable, usable as a static argument).

    Attributes:
      num_embeddings: N, rows addressable by ids ``0..N-1``.
      embedding_dim: D, row length.
      row_shape: (p_1, ..., p_d), ``prod >= N``.
      col_shape: (q_1, ..., q_d), ``prod == D``.
      ranks: (1, r_1, ..., r_{d-1}, 1).
    """

    num_embeddings: int
    embedding_dim: int
    row_shape: tuple[int, ...]
    col_shape: tuple[int, ...]
    ranks: tuple[int, ...]

    def __post_init__(self) -> None:
        d = len(self.row_shape)
        if self.num_embeddings < 1 or self.embedding_dim < 1:
            raise ValueError(
                f"num_embeddings and embedding_dim must be >= 1, got "
                f"{self.num_embeddings}, {self.embedding_dim}"
            )
        if d < 2:
            raise ValueError(f"a TT table needs at least 2 cores, got row_shape={self.row_shape}")
        if len(self.col_shape) != d or len(self.ranks) != d + 1:
            raise ValueError(
                f"row_shape {self.row_shape}, col_shape {self.col_shape} and ranks "
                f"{self.ranks} disagree on the number of cores"
            )
        if min(self.row_shape) < 1 or min(self.col_shape) < 1 or min(self.ranks) < 1:
            raise ValueError(f"shapes and ranks must be positive: {self}")
        if math.prod(self.row_shape) < self.num_embeddings:
            raise ValueError(
                f"prod(row_shape)={math.prod(self.row_shape)} < num_embeddings={self.num_embeddings}"
            )
        if math.prod(self.col_shape) != self.embedding_dim:
            raise ValueError(
                f"prod(col_shape)={math.prod(self.col_shape)} != embedding_dim={self.embedding_dim}"
            )
        if self.ranks[0] != 1 or self.ranks[-1] != 1:
            raise ValueError(f"boundary ranks must be 1, got {self.ranks}")
        if math.prod(self.row_shape) >= ID_LIMIT:
            raise ValueError(
                f"prod(row_shape)={math.prod(self.row_shape)} must be < 2^31: ids are int32 (the "
                f"largest table has num_embeddings = 2^31 - 1)"
            )

    @classmethod
    def create(
        cls,
        num_embeddings: int,
        embedding_dim: int | None = None,
        rank: int | tuple[int, ...] = 32,
        *,
        features: int | None = None,
        num_cores: int = 3,
        row_shape: tuple[int, ...] | None = None,
        col_shape: tuple[int, ...] | None = None,
    ) -> TTSpec:
        """Spec with automatic shapes; ``rank`` (int or internal ranks) is capped at full rank.
        ``features`` is ``embedding_dim`` under the layers' (Flax's) name: give one."""
        if (embedding_dim is None) == (features is None):
            raise TypeError("TTSpec.create takes the dim as embedding_dim or features (one of them)")
        embedding_dim = features if embedding_dim is None else embedding_dim
        if num_embeddings < 1 or embedding_dim < 1:
            raise ValueError(
                f"num_embeddings and embedding_dim must be >= 1, got {num_embeddings}, {embedding_dim}"
            )
        if num_cores < 2:
            raise ValueError(f"a TT table needs at least 2 cores, got num_cores={num_cores}")
        if num_embeddings >= ID_LIMIT:
            raise ValueError(f"num_embeddings={num_embeddings} must be < 2^31: ids are int32")
        row_shape = tuple(row_shape) if row_shape else factor_rows(num_embeddings, num_cores)
        col_shape = tuple(col_shape) if col_shape else factor_cols(embedding_dim, len(row_shape))
        d = len(row_shape)
        inner = _as_ranks(rank, d - 1)
        if len(inner) != d - 1:
            raise ValueError(f"expected {d - 1} internal ranks, got {inner}")
        if min(inner) < 1:
            raise ValueError(f"ranks must be >= 1, got {inner}")
        inner = tuple(min(r, m) for r, m in zip(inner, _max_ranks(row_shape, col_shape)))
        return cls(num_embeddings, embedding_dim, row_shape, col_shape, (1, *inner, 1))

    @property
    def num_cores(self) -> int:
        return len(self.row_shape)

    @property
    def core_shapes(self) -> tuple[tuple[int, int, int, int], ...]:
        """``[p_k, r_{k-1}, q_k, r_k]`` for each core."""
        r = self.ranks
        return tuple((p, r[k], q, r[k + 1]) for k, (p, q) in enumerate(zip(self.row_shape, self.col_shape)))

    @property
    def num_params(self) -> int:
        return sum(math.prod(s) for s in self.core_shapes)

    @property
    def dense_params(self) -> int:
        return self.num_embeddings * self.embedding_dim

    @property
    def compression_ratio(self) -> float:
        """Dense parameter count over TT parameter count."""
        return self.dense_params / self.num_params

    @classmethod
    def from_cores(cls, cores, num_embeddings: int | None = None) -> TTSpec:
        """Spec read off core shapes (N defaults to ``prod(row_shape)``)."""
        shapes = [tuple(c.shape) for c in as_cores(cores)]
        for k in range(len(shapes) - 1):
            if shapes[k][3] != shapes[k + 1][1]:
                raise ValueError(f"rank mismatch between cores {k} and {k + 1}: {shapes}")
        row_shape = tuple(s[0] for s in shapes)
        col_shape = tuple(s[2] for s in shapes)
        ranks = (shapes[0][1],) + tuple(s[3] for s in shapes)
        n = math.prod(row_shape) if num_embeddings is None else int(num_embeddings)
        return cls(n, math.prod(col_shape), row_shape, col_shape, ranks)
