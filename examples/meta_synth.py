"""Synthetic Meta-like recommendation data: hundreds of variable-length multi-hot features,
made on device as one packed jagged batch (``flowtt_jax.KeyedJagged``) per step.

The tables follow the seed's Meta-like collections (FlowTT's Meta-240/480/788): rows
log-uniform in ``rows_range``, about 10% one-hot features, the others multi-hot with a
lognormal spread of mean poolings scaled so the expected pooling over all features is
``mean_pooling`` (13.6). ``SynthMeta.batch(index, batch_size, stream)`` is one jitted
program returning ``(dense [B, 13], KeyedJagged, labels [B], teacher logits [B])``:

1. **Bag lengths.** Bag b of feature f has ``floor(-m_f log u + 1/2)`` ids (an exponential
   of mean m_f, rounded; one-hot features: 1), ``u`` a counter-based hash of
   ``(seed, stream, index, f, b)`` (``criteo_synth.hash32``). The ids array has a static
   capacity of ``capacity_slack`` times the expected ids; bags that would pass it are
   cut (the tail of the array is then in no bag), so every batch has one shape.
2. **Ids.** A bounded power law (exponent ``zipf_a``) popularity rank per id, hashed with
   its feature into ``[0, N_f)``: popular ids are spread over the table.
3. **Labels.** A hidden teacher: every (feature, raw id) has a hashed ``hidden_dim``-vector;
   ``logit = bias + sparse_scale * sum_f <v_f, mean of the bag's vectors> / sqrt(F * h)
   + dense_scale * <w, x>`` over 13 standard-normal dense features; ``label ~
   Bernoulli(sigmoid(logit))``. ``max_rows`` caps the model-visible ids by ``id mod cap``
   (the teacher keeps the raw id), as ``criteo_synth`` does.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.scipy.special import ndtri

from flowtt_jax import KeyedJagged

if __package__:  # imported as examples.meta_synth
    from .criteo_synth import NUM_DENSE, hash32, unit
else:  # run from examples/ (its folder is sys.path[0])
    from criteo_synth import NUM_DENSE, hash32, unit

__all__ = ["MetaSynthConfig", "SynthMeta"]

_LENGTH, _RANK, _DENSE, _LABEL, _TEACHER = 0x1B56C4E9, 0x7F4A7C15, 0x2F6B1D33, 0x5851F42D, 0x3C6EF372


@dataclasses.dataclass(frozen=True)
class MetaSynthConfig:
    num_tables: int = 240
    rows_range: tuple[float, float] = (1e4, 4e7)
    one_hot_prob: float = 0.1
    mean_pooling: float = 13.6
    pooling_sigma: float = 1.0
    max_rows: int | None = None
    zipf_a: float = 1.2
    hidden_dim: int = 4
    sparse_scale: float = 3.0
    dense_scale: float = 1.0
    bias: float = -1.5
    capacity_slack: float = 1.05
    seed: int = 0


class SynthMeta:
    """Batches of Meta-like multi-hot data, made on device: see the module docstring."""

    def __init__(self, config: MetaSynthConfig = MetaSynthConfig()):
        self.config = c = config
        rng = np.random.default_rng([c.seed, 777])
        f = c.num_tables
        lo, hi = np.log(c.rows_range[0]), np.log(c.rows_range[1])
        self.raw_cardinalities = tuple(int(n) for n in np.exp(rng.uniform(lo, hi, f)))
        cap = c.max_rows
        self.cardinalities = tuple(min(n, cap) if cap else n for n in self.raw_cardinalities)
        one_hot = rng.random(f) < c.one_hot_prob
        z = rng.lognormal(0.0, c.pooling_sigma, f)
        target = (c.mean_pooling * f - one_hot.sum()) / max((~one_hot).sum(), 1)
        scale = target / z[~one_hot].mean() if (~one_hot).any() else 0.0
        self.pooling_mean = np.where(one_hot, 1.0, z * scale).astype(np.float32)
        self.one_hot = one_hot
        v = rng.normal(size=(f, c.hidden_dim))
        self._v = (v / np.linalg.norm(v, axis=1, keepdims=True)).astype(np.float32)
        w = rng.normal(size=NUM_DENSE)
        self._w = (w / np.linalg.norm(w)).astype(np.float32)
        self.names = tuple(f"t{i}" for i in range(f))
        self._batch = jax.jit(self._make_batch, static_argnums=2)

    def capacity(self, batch_size: int) -> int:
        """The static number of ids of a batch (``capacity_slack`` times the expected)."""
        return max(1, math.ceil(self.config.capacity_slack * batch_size * float(self.pooling_mean.sum())))

    def batch(self, index: int, batch_size: int, stream: int = 0):
        """``(dense [B, 13], KeyedJagged, labels [B], teacher logits [B])`` of batch ``index``."""
        return self._batch(np.uint32(stream), np.uint32(index), batch_size)

    def _make_batch(self, stream, index, b: int):
        c, f = self.config, self.config.num_tables
        cap = self.capacity(b)
        seed = np.uint32(c.seed)
        slot = jnp.arange(f * b, dtype=jnp.uint32)
        u = unit(hash32(_LENGTH, seed, stream, index, slot))
        # a broadcast, not jnp.repeat: XLA does not fold broadcasts of a constant, while
        # repeat's cumsum of host constants was folded into an s32[F*B] constant (6.4 s at
        # 240 x 4,096 on the GPU)
        mean = jnp.broadcast_to(jnp.asarray(self.pooling_mean)[:, None], (f, b)).reshape(f * b)
        length = jnp.where(mean == 1.0, 1.0, jnp.floor(-mean * jnp.log(u) + 0.5)).astype(jnp.int32)
        start = jnp.cumsum(length) - length
        length = jnp.clip(cap - start, 0, length)  # bags past the capacity are cut
        bag = jnp.repeat(jnp.arange(f * b, dtype=jnp.int32), length, total_repeat_length=cap)
        live = jnp.arange(cap) < jnp.sum(length)
        feat = bag // b
        n_raw = jnp.asarray(np.asarray(self.raw_cardinalities, np.float32))[feat]
        pos = jnp.arange(cap, dtype=jnp.uint32)
        v = hash32(_RANK, seed, stream, index, pos).astype(jnp.float32) * (1.0 / 2**32) + (1.0 / 2**33)
        e = 1.0 - c.zipf_a
        top = (n_raw + 1.0) ** e
        rank = jnp.floor((top + v * (1.0 - top)) ** (1.0 / e)).astype(jnp.uint32) - 1
        raw_n = jnp.asarray(np.asarray(self.raw_cardinalities, np.uint32))[feat]
        raw = hash32(_TEACHER, seed, feat, rank) % raw_n
        n_vis = jnp.asarray(np.asarray(self.cardinalities, np.uint32))[feat]
        ids = jnp.where(live, raw % n_vis, 0).astype(jnp.int32)
        # the teacher: each bag's mean hashed vector, dotted with its feature's v
        comp = jnp.arange(c.hidden_dim, dtype=jnp.uint32)
        emb = (unit(hash32(_TEACHER, seed, feat[:, None], raw[:, None], comp)) - 0.5) * math.sqrt(12.0)
        inv = 1.0 / jnp.maximum(length, 1).astype(jnp.float32)
        weight = jnp.where(live, inv[bag], 0.0)
        pooled = jax.ops.segment_sum(emb * weight[:, None], bag, num_segments=f * b).reshape(f, b, -1)
        sparse = jnp.einsum("fbh,fh->b", pooled, jnp.asarray(self._v)) / math.sqrt(f * c.hidden_dim)
        dense = ndtri(unit(hash32(_DENSE, seed, stream, index, jnp.arange(b * NUM_DENSE, dtype=jnp.uint32))))
        dense = dense.reshape(b, NUM_DENSE)
        logit = c.bias + c.sparse_scale * sparse + c.dense_scale * dense @ jnp.asarray(self._w)
        draw = unit(hash32(_LABEL, seed, stream, index, jnp.arange(b, dtype=jnp.uint32)))
        labels = (draw < jax.nn.sigmoid(logit)).astype(jnp.float32)
        return dense, KeyedJagged(ids, lengths=length.reshape(f, b)), labels, logit
