"""TT cores: initialisation, materialisation and TT-SVD from a dense table.

Cores are a tuple of arrays, core k of shape ``[p_k, r_{k-1}, q_k, r_k]``.
``resolve_init`` and ``check_cores`` turn a layer's ``embedding_init`` into checked
cores for the Flax layers (``flowtt_jax.nnx`` and ``flowtt_jax.linen``); they need no Flax.
"""

from __future__ import annotations

import inspect
import logging
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from flowtt_jax.tt.spec import TTSpec

__all__ = [
    "Cores",
    "CoreInit",
    "normal",
    "init_cores",
    "to_dense",
    "from_dense",
    "resolve_init",
    "check_cores",
]

Cores = tuple[jax.Array, ...]

_LOG = logging.getLogger("flowtt_jax")

# ``embedding_init``: None (rows with std 1/sqrt(features), like nnx.Embed), a float
# (that row std), a Flax initializer ``(key, shape, dtype)`` (its scale is matched), or
# a callable ``(key, spec, dtype) -> tuple of cores``.
CoreInit = Callable[[jax.Array, TTSpec, Any], Sequence[jax.Array]]

# Rows drawn from a Flax initializer to measure the scale it would give a dense table.
_SCALE_SAMPLE_ROWS = 4096


def normal(key: jax.Array, shape: Sequence[int]) -> jax.Array:
    """``jax.random.normal(key, shape, float32)``, bit for bit (threefry draws by flat index),
    drawn flat and reshaped: XLA's CPU compile of a 4-D draw takes 1-2 s, of the flat one 0.2 s."""
    return jax.random.normal(key, (math.prod(shape),), jnp.float32).reshape(shape)


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
    return tuple((core_std * normal(k, s)).astype(dtype) for k, s in zip(keys, spec.core_shapes))


def to_dense(cores: Sequence[jax.Array], num_embeddings: int | None = None) -> jax.Array:
    """Materialise the table: ``[N, D]`` (N defaults to ``prod(row_shape)``)."""
    spec = TTSpec.from_cores(cores, num_embeddings)
    acc = cores[0][:, 0]  # [p1, q1, r1]
    for core in cores[1:]:
        # acc [P, Q, r] x core [p, r, q, s] -> [P, p, Q, q, s]
        acc = jnp.einsum("aqr,brcs->abqcs", acc, core.astype(acc.dtype), precision=jax.lax.Precision.HIGHEST)
        pa, pb, qa, qb, s = acc.shape
        acc = acc.reshape(pa * pb, qa * qb, s)
    return acc[: spec.num_embeddings, :, 0]


def from_dense(
    table: jax.Array | np.ndarray,
    spec: TTSpec,
    dtype: jnp.dtype = jnp.float32,
    *,
    return_error: bool = False,
    on_device: bool = False,
) -> Cores | tuple[Cores, float]:
    """TT-SVD of a dense ``[N, D]`` table, truncated to ``spec.ranks``.

    A table with NaN or inf values raises ``ValueError`` (the SVD would give NaN cores, or not
    return). Exact (up to rounding) when the ranks are the full ranks (``TTSpec.create`` caps ranks
    there); the error falls as ranks grow. Runs on the host in float64, or with
    ``on_device`` on jax's default device (``jnp.linalg.svd`` in float32, float64 under
    ``jax_enable_x64``: a large table's SVDs on a GPU rather than the host's cores). The
    relative error ``||table - TT||_F / ||table||_F`` of the truncation (in float64, before
    the cast to ``dtype``) is logged at INFO on the ``flowtt_jax`` logger and, with
    ``return_error``, returned: ``(cores, error)``.

    Cost (host, 2 cores, a 2 M x 32 table at rank 16, 2026-12-05): 1.2 s for the
    decomposition (leading subspaces by Gram eigenvectors / QR, ``_leading``; 14.2 s with
    full SVDs before), plus 4.8 s for the error (a float64 reconstruction) when it is
    returned or logged.
    """
    if tuple(np.shape(table)) != (spec.num_embeddings, spec.embedding_dim):
        raise ValueError(
            f"table shape {tuple(np.shape(table))} != (num_embeddings, embedding_dim) = "
            f"({spec.num_embeddings}, {spec.embedding_dim})"
        )
    finite = (
        jnp.all(jnp.isfinite(jnp.asarray(table))) if on_device else np.all(np.isfinite(np.asarray(table)))
    )
    if not bool(finite):  # an SVD of NaN / inf gives NaN cores, or never returns (LAPACK on inf)
        raise ValueError(
            "from_dense: the table has non-finite values (NaN or inf); fix or drop those rows first"
        )
    xp = jnp if on_device else np
    t = jnp.asarray(table, jnp.promote_types(jnp.float32, jnp.asarray(table).dtype)) if on_device else None
    t = np.asarray(table, dtype=np.float64) if t is None else t
    rows = math.prod(spec.row_shape)
    t = xp.concatenate([t, xp.zeros((rows - t.shape[0], t.shape[1]), t.dtype)], axis=0)
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
        u, rest = _leading(mat, spec.ranks[k + 1], xp)
        r = u.shape[1]
        core = u.reshape(r_prev, p, q, r).transpose(1, 0, 2, 3)
        if r < spec.ranks[k + 1]:  # matrix rank below the spec's rank: pad with zeros
            core = xp.pad(core, ((0, 0), (0, 0), (0, 0), (0, spec.ranks[k + 1] - r)))
            rest = xp.pad(rest, ((0, spec.ranks[k + 1] - r), (0, 0)))
        cores.append(core)
        r_prev = spec.ranks[k + 1]
    p, q = spec.row_shape[-1], spec.col_shape[-1]
    cores.append(rest.reshape(r_prev, p, q, 1).transpose(1, 0, 2, 3))
    out = tuple(jnp.asarray(c, dtype=dtype) for c in cores)
    if not (return_error or _LOG.isEnabledFor(logging.INFO)):
        return out
    error = _relative_error(table, [np.asarray(c, np.float64) for c in cores], spec.num_embeddings)
    _LOG.info(
        "from_dense: rank %s TT of a %s table, relative error %.3g", spec.ranks, tuple(np.shape(table)), error
    )
    return (out, error) if return_error else out


def _leading(mat, rank: int, xp) -> tuple:
    """``(u [m, r], rest [r, n])``: ``u`` the ``r = min(rank, m, n)`` leading left singular
    vectors of ``mat [m, n]`` and ``rest = u^T mat`` (``S V^T`` of the truncated SVD). Wide
    matrices (a TT-SVD's first unfolding of a large table) from the eigenvectors of the
    ``[m, m]`` Gram matrix, tall ones from a QR and the SVD of its ``[n, n]`` R: matrix
    products instead of the bidiagonalisation of the whole matrix (a 2 M x 32 table: ~10x
    faster on 2 cores); ``rest`` needs no division by singular values, so a full-rank
    truncation stays exact to rounding."""
    m, n = mat.shape
    r = min(rank, m, n)
    if m <= n:
        _, vecs = xp.linalg.eigh(mat @ mat.T)  # ascending eigenvalues
        u = vecs[:, ::-1][:, :r]
        return u, u.T @ mat
    q, upper = xp.linalg.qr(mat)  # mat = q @ upper, q [m, n]
    u_r, _, _ = xp.linalg.svd(upper, full_matrices=False)
    u_r = u_r[:, :r]
    return q @ u_r, u_r.T @ upper


def _relative_error(table, cores: Sequence[np.ndarray], num_embeddings: int) -> float:
    """``||table - to_dense(cores)||_F / ||table||_F`` in float64 on the host (0 for a zero table)."""
    acc = cores[0][:, 0]
    for core in cores[1:]:
        acc = np.einsum("aqr,brcs->abqcs", acc, core)
        pa, pb, qa, qb, r = acc.shape
        acc = acc.reshape(pa * pb, qa * qb, r)
    t = np.asarray(table, np.float64)
    norm = np.linalg.norm(t)
    return float(np.linalg.norm(t - acc[:num_embeddings, :, 0]) / norm) if norm > 0 else 0.0


def _is_flax_initializer(fn: Callable) -> bool:
    """True for ``(key, shape, dtype)`` initializers (jax.nn / flax initializers)."""
    try:
        params = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return False
    return len(params) >= 2 and params[1] == "shape"


def resolve_init(embedding_init: CoreInit | Callable | float | None) -> CoreInit:
    """Normalise ``embedding_init`` to a callable ``(key, spec, dtype) -> cores``.

    A Flax initializer cannot fill TT cores directly; its scale carries over: the
    cores are drawn so the materialised rows have the RMS of ``_SCALE_SAMPLE_ROWS``
    rows it draws for a dense table of the same width.
    """
    if embedding_init is None or isinstance(embedding_init, (int, float)):
        std = None if embedding_init is None else float(embedding_init)
        return lambda key, spec, dtype: init_cores(key, spec, std=std, dtype=dtype)
    if not callable(embedding_init):
        raise TypeError(
            "embedding_init must be None, a float row std, a Flax initializer (key, shape, dtype) "
            f"or a callable (key, spec, dtype) -> cores; got {embedding_init!r}"
        )
    if _is_flax_initializer(embedding_init):

        def matched_scale(key, spec, dtype):
            sample_key, core_key = jax.random.split(key)
            sample = embedding_init(sample_key, (_SCALE_SAMPLE_ROWS, spec.embedding_dim), jnp.float32)
            std = jnp.sqrt(jnp.mean(jnp.square(sample)))
            return init_cores(core_key, spec, std=float(std), dtype=dtype)

        return matched_scale
    return embedding_init


def check_cores(cores: Sequence[jax.Array], spec: TTSpec, dtype: Any) -> Cores:
    """``cores`` cast to ``dtype``; ``ValueError`` unless their shapes are ``spec.core_shapes``."""
    cores = tuple(jnp.asarray(c, dtype) for c in cores)
    shapes = tuple(tuple(c.shape) for c in cores)
    if shapes != spec.core_shapes:
        raise ValueError(f"initializer returned cores of shapes {shapes}, spec needs {spec.core_shapes}")
    return cores
