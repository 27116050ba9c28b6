"""Synthetic Criteo-format click data with a planted, learnable signal, made on device.

Each example has 13 dense features (non-negative counts, fed to the model as
``log1p``), 26 categorical ids (one per sparse feature, the Criteo Kaggle
cardinalities) and a 0/1 click label. ``SynthCriteo.batch(index, batch_size, stream)``
is one ``jax.jit`` program (jax.numpy, 32-bit integers and float32 only), so a batch
costs a small fraction of a training step's device time and no host work. Every random number is a
counter-based hash of ``(seed, stream, batch index, row, slot)``, so two runs (TT and
dense) see identical data, the train (stream 0) and held-out (stream 1) sets never
overlap, and row r of a batch does not depend on the batch size.

How the data is made (all documented knobs are ``SynthConfig`` fields):

1. **Randomness.** ``hash32`` is murmur3's 32-bit hash of a few 32-bit words (its
   block mix, then the ``fmix32`` finaliser); a uniform in (0, 1) is the top 23 bits of
   a hash, a normal is its inverse CDF (``ndtri``).
2. **Ids.** For feature f with N_f rows, a popularity rank is drawn from a bounded
   power law (Zipf-like, exponent ``zipf_a``, inverse-CDF sampling of a continuous
   Pareto on [1, N_f + 1) in float32; its uniform uses all 32 bits of a hash, so the
   rare tail ranks stay finely resolved). The rank is scattered over [0, N_f) by a
   per-feature affine bijection ``id = (a_f * rank + b_f) mod N_f`` (gcd(a_f, N_f) = 1,
   computed exactly in uint32 over the rank's bytes for N_f <= 2^24), so popular ids
   are spread over the whole table as in hashed real data, not packed at 0.
3. **Teacher.** A hidden teacher gives every (feature, raw id) a ``hidden_dim``-vector
   ``e_f(id)`` by hashing ``(seed, f, id, component)`` to a uniform with unit variance;
   nothing is stored, so 10^7-row features cost nothing.
   ``logit = bias + sparse_scale * sum_f <v_f, e_f(id_f)> / sqrt(26 * hidden_dim)
   + pair_scale * sum_(f,g) in pairs <e_f(id_f), e_g(id_g)> / sqrt(|pairs| * hidden_dim)
   + dense_scale * <w, z(x)>``, with random unit ``v_f``, ``w``, a fixed set of feature
   pairs, and ``z(x)`` the standardised ``log1p`` of the dense features (dense counts
   ``floor(exp(N(mu_j, sigma_j)))``; the standardiser is measured once on a probe of
   20,000 rows from a reserved stream). ``label ~ Bernoulli(sigmoid(logit))``;
   ``bias`` sets the click rate (about 20%). The per-feature constants (a_f, b_f, v_f,
   w, pairs, mu, sigma) come from a numpy generator seeded by ``seed``.
4. **Learnability.** The signal is low-dimensional per id (``hidden_dim`` = 4 numbers)
   and carried mostly by the popular ids (Zipf), which a model with small (or
   low-rank TT) embeddings sees many times within a few hundred steps. The Bayes
   AUC (the teacher's own logit as the score) is the ceiling for any model.
5. **Row cap.** ``max_rows`` (when set) caps each feature's cardinality by hashing the
   model-visible id: ``id mod max_rows`` (the ids are already scattered, so this is a
   hash). The teacher still uses the raw id, so collisions cost accuracy, for every
   model alike.
6. **Tables that differ.** Features differ in cardinality (the Criteo Kaggle ones) and,
   optionally, in skew and signal: ``feature_zipf_a`` (one exponent per feature, in place
   of ``zipf_a``) and ``feature_signal`` (one teacher weight per feature: ``e_f`` is
   scaled by it in every term of the logit, so 0 makes a feature pure noise; weights of
   root-mean-square 1 keep the logit's scale). Both default to None: the data are then
   bit-for-bit those of the same config without them.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.scipy.special import ndtri

__all__ = [
    "CRITEO_KAGGLE_CARDINALITIES",
    "NUM_DENSE",
    "SynthConfig",
    "SynthCriteo",
    "affine_mod",
    "hash32",
    "unit",
]

# Criteo Kaggle (Display Advertising Challenge) sparse-feature cardinalities C1..C26,
# as in facebookresearch/dlrm and TorchRec.
CRITEO_KAGGLE_CARDINALITIES = (
    1460,
    583,
    10131227,
    2202608,
    305,
    24,
    12517,
    633,
    3,
    93145,
    5683,
    8351593,
    3194,
    27,
    14992,
    5461306,
    10,
    5652,
    2173,
    4,
    7046547,
    18,
    15,
    286181,
    105,
    142572,
)
NUM_DENSE = 13
MAX_CARDINALITY = 1 << 24  # affine_mod's exactness bound
# hash domains (murmur3 seeds) and the slot layout of one row's per-batch draws
_BATCH_DOMAIN, _TEACHER_DOMAIN = 0x2545F491, 0x9E3779B9
_PROBE_STREAM = 0xFFFFFFFF  # reserved: the dense standardiser's probe


def _u32(x) -> jax.Array:
    """uint32 view of a traced array, or a host int / array (taken mod 2^32)."""
    if isinstance(x, jax.Array):
        return x.astype(jnp.uint32)
    return jnp.asarray(np.asarray(x).astype(np.uint32))


def _rotl(x: jax.Array, r: int) -> jax.Array:
    return (x << r) | (x >> (32 - r))


def hash32(domain: int, *words) -> jax.Array:
    """murmur3_32 of 32-bit words (broadcast together) with seed ``domain``: uint32."""
    h = _u32(domain)
    for w in words:
        k = _rotl(_u32(w) * jnp.uint32(0xCC9E2D51), 15) * jnp.uint32(0x1B873593)
        h = _rotl(h ^ k, 13) * jnp.uint32(5) + jnp.uint32(0xE6546B64)
    h = h ^ jnp.uint32(4 * len(words))
    # fmix32
    h = (h ^ (h >> 16)) * jnp.uint32(0x85EBCA6B)
    h = (h ^ (h >> 13)) * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def unit(bits: jax.Array) -> jax.Array:
    """Uniform in (0, 1), float32, from the top 23 bits (k + 0.5 is exact for k < 2^23)."""
    return ((bits >> 9).astype(jnp.float32) + 0.5) * (1.0 / (1 << 23))


def affine_mod(a: np.ndarray, b: np.ndarray, x: jax.Array, n: np.ndarray) -> jax.Array:
    """``(a * x + b) mod n`` in uint32 for ``0 <= a, b, x < n <= 2**24`` (a, b, n host
    constants per feature, broadcast against x): with x's bytes x_k,
    ``sum_k (a * 256^k mod n) * x_k + b``, every partial product below 2^32."""
    a, b, n = (np.asarray(t, np.int64) for t in (a, b, n))
    x, nn = _u32(x), _u32(n)
    acc = _u32(b)
    for k in range(3):
        c = _u32(a * (1 << (8 * k)) % n)
        acc = acc + (c * ((x >> (8 * k)) & jnp.uint32(0xFF))) % nn
    return acc % nn


@dataclasses.dataclass(frozen=True)
class SynthConfig:
    cardinalities: tuple[int, ...] = CRITEO_KAGGLE_CARDINALITIES
    max_rows: int | None = None
    zipf_a: float = 1.2
    hidden_dim: int = 4
    sparse_scale: float = 3.0
    pair_scale: float = 1.0
    num_pairs: int = 13
    dense_scale: float = 1.0
    bias: float = -1.5
    seed: int = 0
    feature_zipf_a: tuple[float, ...] | None = None
    feature_signal: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        if not all(1 <= n <= MAX_CARDINALITY for n in self.cardinalities):
            raise ValueError(f"cardinalities must be in [1, 2**24], got {self.cardinalities}")
        exponents = (self.zipf_a,) if self.feature_zipf_a is None else self.feature_zipf_a
        if 1.0 in exponents:
            raise ValueError("zipf_a must differ from 1 (the bounded Pareto's inverse CDF)")
        for field in ("feature_zipf_a", "feature_signal"):
            value = getattr(self, field)
            if value is not None and len(value) != len(self.cardinalities):
                raise ValueError(
                    f"{field} needs one value per feature ({len(self.cardinalities)}), got {value}"
                )


class SynthCriteo:
    """Batches of synthetic Criteo-format data, made on device: see the module docstring."""

    def __init__(self, config: SynthConfig = SynthConfig()):
        self.config = c = config
        self.raw_cardinalities = tuple(int(n) for n in c.cardinalities)
        cap = c.max_rows
        self.cardinalities = tuple(min(n, cap) if cap else n for n in self.raw_cardinalities)
        rng = np.random.default_rng([c.seed, 12345])
        f = len(self.raw_cardinalities)
        self.num_sparse = f
        self._slots = f + NUM_DENSE + 1  # per row: ranks, dense normals, label draw
        # affine scatter of popularity ranks: id = (a * rank + b) mod N, gcd(a, N) = 1
        self._a = np.empty(f, np.int64)
        self._b = np.empty(f, np.int64)
        for i, n in enumerate(self.raw_cardinalities):
            while True:
                a = int(rng.integers(1, max(n, 2)))
                if math.gcd(a, n) == 1:
                    break
            self._a[i], self._b[i] = a % n, int(rng.integers(0, n))
        v = rng.normal(size=(f, c.hidden_dim))
        self._v = (v / np.linalg.norm(v, axis=1, keepdims=True)).astype(np.float32)
        w = rng.normal(size=NUM_DENSE)
        self._w = (w / np.linalg.norm(w)).astype(np.float32)
        pairs = set()
        while len(pairs) < min(c.num_pairs, f * (f - 1) // 2):
            i, j = sorted(rng.choice(f, 2, replace=False).tolist())
            pairs.add((i, j))
        self._pairs = np.array(sorted(pairs), np.int64).reshape(-1, 2)
        # dense counts: x = floor(exp(N(mu, sigma))) per feature; standardiser of log1p(x)
        self._mu = rng.uniform(0.0, 3.0, NUM_DENSE).astype(np.float32)
        self._sigma = rng.uniform(0.5, 1.5, NUM_DENSE).astype(np.float32)
        probe = np.asarray(
            jax.jit(self._log_counts, static_argnums=2)(np.uint32(_PROBE_STREAM), np.uint32(0), 20_000),
            np.float64,
        )
        self._z_mean = probe.mean(0).astype(np.float32)
        self._z_std = (probe.std(0) + 1e-6).astype(np.float32)
        self._batch = jax.jit(self._make_batch, static_argnums=2)

    # -- pieces (traced) --------------------------------------------------------------
    def _bits(self, stream, index, b: int, first: int, count: int) -> jax.Array:
        """Hashes of slots ``first .. first+count-1`` of rows ``0..b-1``: ``[b, count]``."""
        slot = jnp.arange(b, dtype=jnp.uint32)[:, None] * jnp.uint32(self._slots) + jnp.arange(
            first, first + count, dtype=jnp.uint32
        )
        return hash32(_BATCH_DOMAIN, self.config.seed, stream, index, slot)

    def _log_counts(self, stream, index, b: int) -> jax.Array:
        normal = ndtri(unit(self._bits(stream, index, b, self.num_sparse, NUM_DENSE)))
        counts = jnp.floor(jnp.exp(self._mu + self._sigma * normal))
        return jnp.log(1.0 + counts)  # = log1p (integer counts); XLA:CPU's log1p fuses slowly here

    def _raw_ids(self, stream, index, b: int) -> jax.Array:
        bits = self._bits(stream, index, b, 0, self.num_sparse)
        v = bits.astype(jnp.float32) * (1.0 / 2**32) + (1.0 / 2**33)  # (0, 1], fine near 0
        n = np.array(self.raw_cardinalities, np.float64)
        a = self.config.zipf_a if self.config.feature_zipf_a is None else np.array(self.config.feature_zipf_a)
        e = 1.0 - a
        hi = ((n + 1.0) ** e).astype(np.float32)
        x = (hi + v * (1.0 - hi)) ** np.float32(1.0 / e)  # continuous Pareto on [1, N+1)
        rank = jnp.clip(jnp.floor(x).astype(jnp.int32) - 1, 0, n.astype(np.int32) - 1)
        return affine_mod(self._a, self._b, rank, n.astype(np.int64)).astype(jnp.int32)

    def teacher_embedding(self, raw_ids: jax.Array) -> jax.Array:
        """``e_f(id)`` for raw ids ``[B, 26]``: ``[B, 26, hidden_dim]`` float32, unit variance."""
        f = jnp.arange(self.num_sparse, dtype=jnp.uint32)[None, :, None]
        comp = jnp.arange(self.config.hidden_dim, dtype=jnp.uint32)[None, None, :]
        h = hash32(_TEACHER_DOMAIN, self.config.seed, f, _u32(raw_ids)[:, :, None], comp)
        return (unit(h) - 0.5) * math.sqrt(12.0)

    def _make_batch(self, stream, index, b: int):
        c = self.config
        raw = self._raw_ids(stream, index, b)
        log_counts = self._log_counts(stream, index, b)
        e = self.teacher_embedding(raw)
        if c.feature_signal is not None:
            e = e * jnp.asarray(c.feature_signal, jnp.float32)[None, :, None]
        f, k = self.num_sparse, c.hidden_dim
        hp = jax.lax.Precision.HIGHEST  # the same logits on every backend (no TF32)
        first = jnp.einsum("bfk,fk->b", e, self._v, precision=hp) / math.sqrt(f * k)
        pi, pj = self._pairs[:, 0], self._pairs[:, 1]
        pair = jnp.einsum("bpk,bpk->b", e[:, pi], e[:, pj], precision=hp) / math.sqrt(max(len(pi), 1) * k)
        z = (log_counts - self._z_mean) / self._z_std
        dense_part = jnp.dot(z, self._w, precision=hp)
        logit = c.bias + c.sparse_scale * first + c.pair_scale * pair + c.dense_scale * dense_part
        u = unit(self._bits(stream, index, b, f + NUM_DENSE, 1)[:, 0])
        labels = (u < jax.nn.sigmoid(logit)).astype(jnp.float32)
        ids = raw % jnp.array(self.cardinalities, jnp.int32) if c.max_rows else raw
        return log_counts, ids, labels, logit

    # -- public ---------------------------------------------------------------------
    def batch(self, index: int, batch_size: int, stream: int = 0):
        """``(dense [B,13] f32 log1p counts, sparse [B,26] int32 ids, labels [B] f32, logits [B]
        f32)``, device arrays made by one jitted program (dispatched asynchronously)."""
        if not 0 <= stream < _PROBE_STREAM:
            raise ValueError(f"stream must be in [0, 2**32 - 1), got {stream}")
        return self._batch(np.uint32(stream), np.uint32(index), batch_size)

    def batch_fn(self, sharding: jax.sharding.Sharding):
        """``batch`` with every output placed by ``sharding`` (e.g. split over a mesh axis):
        each device makes its own rows, each process only its own devices' (the same data
        as ``batch``)."""
        make = jax.jit(self._make_batch, static_argnums=2, out_shardings=sharding)

        def batch(index: int, batch_size: int, stream: int = 0):
            return make(np.uint32(stream), np.uint32(index), batch_size)

        return batch
