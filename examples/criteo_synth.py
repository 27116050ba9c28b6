"""Synthetic Criteo-format click data with a planted, learnable signal.

Each example has 13 dense features (non-negative counts, fed to the model as
``log1p``), 26 categorical ids (one per sparse feature, the Criteo Kaggle
cardinalities) and a 0/1 click label. Batches are generated on the fly from
``(seed, stream, batch index)``, so two runs (TT and dense) see identical data and
the train (stream 0) and held-out (stream 1) sets never overlap.

How the data is made (all documented knobs are ``SynthConfig`` fields):

1. **Ids.** For feature f with N_f rows, a popularity rank is drawn from a bounded
   power law (Zipf-like, exponent ``zipf_a``, inverse-CDF sampling of a continuous
   Pareto on [1, N_f + 1)). The rank is scattered over [0, N_f) by a per-feature
   affine bijection ``id = (a_f * rank + b_f) mod N_f`` (gcd(a_f, N_f) = 1), so popular
   ids are spread over the whole table as in hashed real data, not packed at 0.
2. **Teacher.** A hidden teacher gives every (feature, raw id) a ``hidden_dim``-vector
   ``e_f(id)`` by hashing (splitmix64 of (f, id, component) -> uniform with unit
   variance); nothing is stored, so 10^7-row features cost nothing.
   ``logit = bias + sparse_scale * sum_f <v_f, e_f(id_f)> / sqrt(26 * hidden_dim)
   + pair_scale * sum_(f,g) in pairs <e_f(id_f), e_g(id_g)> / sqrt(|pairs| * hidden_dim)
   + dense_scale * <w, z(x)>``, with random unit ``v_f``, ``w``, a fixed set of feature
   pairs, and ``z(x)`` the standardised ``log1p`` of the dense features.
   ``label ~ Bernoulli(sigmoid(logit))``; ``bias`` sets the click rate (about 20%).
3. **Learnability.** The signal is low-dimensional per id (``hidden_dim`` = 4 numbers)
   and carried mostly by the popular ids (Zipf), which a model with small (or
   low-rank TT) embeddings sees many times within a few hundred steps. The Bayes
   AUC (the teacher's own logit as the score) is the ceiling for any model.
4. **Row cap.** ``max_rows`` (when set) caps each feature's cardinality by hashing the
   model-visible id: ``id mod max_rows`` (the ids are already scattered, so this is a
   hash). The teacher still uses the raw id, so collisions cost accuracy, for every
   model alike.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

__all__ = ["CRITEO_KAGGLE_CARDINALITIES", "NUM_DENSE", "SynthConfig", "SynthCriteo"]

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

_M64 = np.uint64(0xFFFFFFFFFFFFFFFF)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    x = (x + np.uint64(0x9E3779B97F4A7C15)) & _M64
    x = ((x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)) & _M64
    x = ((x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)) & _M64
    return x ^ (x >> np.uint64(31))


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


class SynthCriteo:
    """Batches of synthetic Criteo-format data: see the module docstring."""

    def __init__(self, config: SynthConfig = SynthConfig()):
        self.config = c = config
        self.raw_cardinalities = tuple(int(n) for n in c.cardinalities)
        cap = c.max_rows
        self.cardinalities = tuple(min(n, cap) if cap else n for n in self.raw_cardinalities)
        rng = np.random.default_rng([c.seed, 12345])
        f = len(self.raw_cardinalities)
        self.num_sparse = f
        # affine scatter of popularity ranks: id = (a * rank + b) mod N, gcd(a, N) = 1
        self._a = np.empty(f, np.int64)
        self._b = np.empty(f, np.int64)
        for i, n in enumerate(self.raw_cardinalities):
            while True:
                a = int(rng.integers(1, max(n, 2)))
                if math.gcd(a, n) == 1:
                    break
            self._a[i], self._b[i] = a, int(rng.integers(0, n))
        v = rng.normal(size=(f, c.hidden_dim))
        self._v = v / np.linalg.norm(v, axis=1, keepdims=True)
        w = rng.normal(size=NUM_DENSE)
        self._w = w / np.linalg.norm(w)
        pairs = set()
        while len(pairs) < min(c.num_pairs, f * (f - 1) // 2):
            i, j = sorted(rng.choice(f, 2, replace=False).tolist())
            pairs.add((i, j))
        self._pairs = np.array(sorted(pairs), np.int64).reshape(-1, 2)
        # dense counts: x = floor(exp(N(mu, sigma))) per feature; standardiser of log1p(x)
        self._mu = rng.uniform(0.0, 3.0, NUM_DENSE)
        self._sigma = rng.uniform(0.5, 1.5, NUM_DENSE)
        probe = self._dense_counts(np.random.default_rng([c.seed, 999]), 20000)
        lx = np.log1p(probe)
        self._z_mean, self._z_std = lx.mean(0), lx.std(0) + 1e-6

    # -- pieces ---------------------------------------------------------------------
    def _dense_counts(self, rng: np.random.Generator, b: int) -> np.ndarray:
        return np.floor(np.exp(rng.normal(self._mu, self._sigma, size=(b, NUM_DENSE))))

    def _ranks(self, rng: np.random.Generator, b: int) -> np.ndarray:
        a = self.config.zipf_a
        n = np.array(self.raw_cardinalities, np.float64)
        u = rng.random((b, self.num_sparse))
        hi = (n + 1.0) ** (1.0 - a)
        x = (1.0 + u * (hi - 1.0)) ** (1.0 / (1.0 - a))  # continuous Pareto on [1, N+1)
        return np.minimum(np.floor(x).astype(np.int64) - 1, n.astype(np.int64) - 1)

    def teacher_embedding(self, raw_ids: np.ndarray) -> np.ndarray:
        """``e_f(id)`` for raw ids ``[B, 26]``: ``[B, 26, hidden_dim]``, unit variance."""
        k = self.config.hidden_dim
        f = np.arange(self.num_sparse, dtype=np.uint64)[None, :, None]
        comp = np.arange(k, dtype=np.uint64)[None, None, :]
        key = (
            raw_ids.astype(np.uint64)[:, :, None] * np.uint64(0x100000001B3)
            + f * np.uint64(0x9E3779B97F4A7C15)
            + comp * np.uint64(0xD1B54A32D192ED03)
            + np.uint64(self.config.seed) * np.uint64(0xA24BAED4963EE407)
        ) & _M64
        h = _splitmix64(key)
        u = (h >> np.uint64(11)).astype(np.float64) * (1.0 / 2**53)
        return (u - 0.5) * math.sqrt(12.0)

    # -- public ---------------------------------------------------------------------
    def batch(self, index: int, batch_size: int, stream: int = 0):
        """``(dense [B,13] f32 log1p counts, sparse [B,26] int32 ids, labels [B] f32, logits [B])``."""
        c = self.config
        rng = np.random.default_rng([c.seed, stream, index])
        counts = self._dense_counts(rng, batch_size)
        raw = (self._ranks(rng, batch_size) * self._a + self._b) % np.array(self.raw_cardinalities)
        e = self.teacher_embedding(raw)
        f, k = self.num_sparse, c.hidden_dim
        first = np.einsum("bfk,fk->b", e, self._v) / math.sqrt(f * k)
        pair = np.einsum("bpk,bpk->b", e[:, self._pairs[:, 0]], e[:, self._pairs[:, 1]])
        pair = pair / math.sqrt(max(len(self._pairs), 1) * k)
        z = (np.log1p(counts) - self._z_mean) / self._z_std
        logit = c.bias + c.sparse_scale * first + c.pair_scale * pair + c.dense_scale * (z @ self._w)
        labels = (rng.random(batch_size) < 1.0 / (1.0 + np.exp(-logit))).astype(np.float32)
        ids = raw % np.array(self.cardinalities) if c.max_rows else raw
        return (
            np.log1p(counts).astype(np.float32),
            ids.astype(np.int32),
            labels,
            logit.astype(np.float32),
        )
