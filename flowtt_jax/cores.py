"""TT cores: initialisation, materialisation and TT-SVD from a dense table.

Cores are a tuple of arrays, core k of shape ``[p_k, r_{k-1}, q_k, r_k]``.
"""

from __future__ import annotations

import math
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from .spec import TTSpec

__all__ = ["Cores", "init_cores", "to_dense", "from_dense"]

Cores = tuple[jax.Array, ...]


def init_cores(
    key: jax.Array,
    spec: TTSpec,
    std: float | None = None,
    dtype: jnp.dtype = jnp.float32,
) -> Cores:
    """Gaussian cores whose *materialised rows* have standard deviation ``std``.

    An entry of a row is a sum of ``prod(internal ranks)`` products of d core
    entries, so each core gets std ``(std**2 / prod(ranks)) ** (1 / (2 d))``.
    ``std`` defaults to ``1 / sqrt(D)``, the std of ``nnx.Embed``'s default init.
    """
    if std is None:
        std = 1.0 / math.sqrt(spec.embedding_dim)
    d = spec.num_cores
    core_std = (std**2 / math.prod(spec.ranks)) ** (1.0 / (2 * d))
    keys = jax.random.split(key, d)
    return tuple(
        (core_std * jax.random.normal(k, s, jnp.float32)).astype(dtype)
        for k, s in zip(keys, spec.core_shapes)
    )


def to_dense(cores: Sequence[jax.Array], num_embeddings: int | None = None) -> jax.Array:
    """Materialise the table: ``[N, D]`` (N defaults to ``prod(row_shape)``)."""
    spec = TTSpec.from_cores(cores, num_embeddings)
    acc = cores[0][:, 0]  # [p1, q1, r1]
    for core in cores[1:]:
        # acc [P, Q, r] x core [p, r, q, s] -> [P, p, Q, q, s]
        acc = jnp.einsum("aqr,brcs->abqcs", acc, core.astype(acc.dtype))
        pa, pb, qa, qb, s = acc.shape
        acc = acc.reshape(pa * pb, qa * qb, s)
    return acc[: spec.num_embeddings, :, 0]


def from_dense(table: jax.Array | np.ndarray, spec: TTSpec, dtype: jnp.dtype = jnp.float32) -> Cores:
    """TT-SVD of a dense ``[N, D]`` table, truncated to ``spec.ranks``.

    Exact (up to float64 rounding) when the ranks are the full ranks
    (``TTSpec.create`` caps ranks there); the error falls as ranks grow.
    Runs on the host in float64.
    """
    t = np.asarray(table, dtype=np.float64)
    if t.shape != (spec.num_embeddings, spec.embedding_dim):
        raise ValueError(
            f"table shape {t.shape} != (num_embeddings, embedding_dim) = "
            f"({spec.num_embeddings}, {spec.embedding_dim})"
        )
    rows = math.prod(spec.row_shape)
    t = np.concatenate([t, np.zeros((rows - t.shape[0], t.shape[1]))], axis=0)
    d = spec.num_cores
    # [p1..pd, q1..qd] -> [p1, q1, p2, q2, ...]
    t = t.reshape(spec.row_shape + spec.col_shape)
    t = t.transpose([ax for k in range(d) for ax in (k, d + k)])
    cores = []
    r_prev = 1
    rest = t.reshape(1, -1)
    for k in range(d - 1):
        p, q = spec.row_shape[k], spec.col_shape[k]
        mat = rest.reshape(r_prev * p * q, -1)
        u, s, vt = np.linalg.svd(mat, full_matrices=False)
        r = min(spec.ranks[k + 1], s.shape[0])
        core = u[:, :r].reshape(r_prev, p, q, r).transpose(1, 0, 2, 3)
        if r < spec.ranks[k + 1]:  # matrix rank below the spec's rank: pad with zeros
            core = np.pad(core, ((0, 0), (0, 0), (0, 0), (0, spec.ranks[k + 1] - r)))
            s = np.pad(s[:r], (0, spec.ranks[k + 1] - r))
            vt = np.pad(vt[:r], ((0, spec.ranks[k + 1] - r), (0, 0)))
        cores.append(core)
        r_prev = spec.ranks[k + 1]
        rest = s[:r_prev, None] * vt[:r_prev]
    p, q = spec.row_shape[-1], spec.col_shape[-1]
    cores.append(rest.reshape(r_prev, p, q, 1).transpose(1, 0, 2, 3))
    return tuple(jnp.asarray(c, dtype=dtype) for c in cores)
