"""A collection's fresh parameters, drawn pack by pack in one compiled program.

Each table is drawn from the distribution a lone table would get (TT cores whose
materialised rows have std ``cfg.std``, as ``init_cores``; dense rows ``normal(cfg.std)``),
but a pack's arrays are drawn at once: one normal per packed array, scaled row by row by
its table's std. So the program has a few ops per pack, not per table, and one
``jax.jit`` compile serves the whole collection (788 Meta-like tables: one compile of a
handful of ops, where a draw per table is a compile per table shape). Under
``nnx.eval_shape`` the program is only traced.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from flowtt_jax.collection.cache import first_rows, tt_rows_of
from flowtt_jax.collection.packs import TablePack
from flowtt_jax.tt.cores import normal, resolve_init

__all__ = ["init_params"]


def init_params(
    packs: tuple[TablePack, ...],
    names: tuple[tuple[str, ...], ...],
    key: jax.Array,
    param_dtype: Any = jnp.float32,
    caches: tuple[tuple[str, str] | None, ...] | None = None,
) -> dict[str, jax.Array]:
    """``{parameter name: array}`` of ``packs``, pack p's arrays named ``names[p]`` and
    drawn with ``fold_in(key, p)``; ``param_dtype`` is the storage dtype (drawn in float32).
    ``caches[p]``: the names of pack p's hot-row cache block and hot ids (``packs.cache_names``),
    which start as each cached table's first rows (``collection.cache.first_rows``)."""
    return _init(packs, names, caches or (None,) * len(packs), jnp.dtype(param_dtype), key)


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3))
def _init(packs, names, caches, dtype: np.dtype, key: jax.Array) -> dict[str, jax.Array]:
    params = _init_arrays(packs, names, dtype, key)
    for p, pack in enumerate(packs):
        if caches[p] is not None:
            cores = tuple(params[n] for n in names[p])
            hot = first_rows(pack)
            rows = [
                tt_rows_of(pack.layout.table_cores(cores, t) if pack.kind == "tt" else cores, hot[lo:hi])
                for t, (lo, hi) in enumerate(zip(pack.cache_offsets[:-1], pack.cache_offsets[1:]))
                if hi > lo
            ]
            params[caches[p][0]] = jnp.concatenate(rows)
            params[caches[p][1]] = hot
    return params


def _init_arrays(packs, names, dtype: np.dtype, key: jax.Array) -> dict[str, jax.Array]:
    params = {}
    for p, pack in enumerate(packs):
        pack_key = jax.random.fold_in(key, p)
        if pack.kind == "single":  # one TT table of another core count: its own draw
            cfg = pack.tables[0]
            cores = resolve_init(cfg.std)(pack_key, cfg.spec(), dtype)
            params.update(zip(names[p], cores))
            continue
        if pack.kind == "dense":
            stds = [c.std for c in pack.tables]
            shapes = [(sum(c.num_embeddings for c in pack.tables), pack.tables[0].features)]
            rows = [[c.num_embeddings for c in pack.tables]]  # each array's rows per table
        else:
            ranks = pack.layout.specs[0].ranks
            # init_cores: core std (std^2 / prod(ranks))^(1 / 2d) gives rows of std `std`
            stds = [(c.std**2 / math.prod(ranks)) ** (1.0 / 6.0) for c in pack.tables]
            shapes = pack.layout.packed_shapes()
            rows = [[s.row_shape[k] for s in pack.layout.specs] for k in range(3)]
        for k, (name, shape, sizes) in enumerate(zip(names[p], shapes, rows)):
            draw = normal(jax.random.fold_in(pack_key, k), shape)
            params[name] = (draw * _row_scale(stds, sizes, len(shape))).astype(dtype)
    return params


def _row_scale(stds: Sequence[float], sizes: Sequence[int], ndim: int) -> jax.Array | float:
    """Each packed row's table std, shaped to broadcast over ``[rows, ...]``: a scalar when
    the tables share one std (the default within a pack: same dim), else a gather of the
    ``T`` stds by each row's table (no per-row host constant)."""
    if len(set(stds)) == 1:
        return float(stds[0])
    ends = jnp.asarray(np.cumsum(sizes), jnp.int32)
    rows = jax.lax.iota(jnp.int32, int(sum(sizes)))
    table = jnp.searchsorted(ends, rows, side="right")
    scale = jnp.asarray(stds, jnp.float32)[table]
    return scale.reshape((-1,) + (1,) * (ndim - 1))
