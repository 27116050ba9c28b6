"""Per-table views of a collection's packed parameters (Flax-free): a table's cores or
dense rows, its hot-row cache, its materialised rows, and checkpoints by table name. The
mixin ``TableViews`` of ``collection.layout.CollectionLayout`` (it reads the layout's
``packs``, ``tables``, ``param_names``, ``cache_names`` and ``locate``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from flowtt_jax.collection.cache import EMPTY, sorted_hot, tt_rows_of
from flowtt_jax.collection.config import TableConfig
from flowtt_jax.tt.cores import to_dense

__all__ = ["TableViews", "table_shapes"]


class TableViews:
    """Per-table reads and writes of a layout's packed parameters (``{name: array}``)."""

    packs: Any
    tables: Any

    def table_params(self, params: Mapping[str, jax.Array], name: str) -> tuple[jax.Array, ...]:
        """Table ``name``'s own parameters: its TT cores ``[p_k, r_{k-1}, q_k, r_k]``, or
        ``(table [N, D],)`` for a dense table (static slices of the packs)."""
        p, t = self.locate(name)
        pack, arrays = self.packs[p], tuple(params[n] for n in self.param_names(p))
        if pack.kind == "tt":
            return pack.layout.table_cores(arrays, t)
        if pack.kind == "dense":
            lo, hi = pack.row_offsets[t], pack.row_offsets[t + 1]
            return (arrays[0][lo:hi],)
        return arrays

    def with_table(self, params: Mapping[str, jax.Array], name: str, values: Sequence[jax.Array]) -> dict:
        """``params`` with table ``name``'s parameters replaced by ``values`` (same shapes
        as ``table_params``: a tuple of cores, or a dense table's array itself or ``(array,)``),
        e.g. the TT-SVD of a dense table; a ``ValueError`` names the table and the shapes."""
        p, t = self.locate(name)
        pack, names = self.packs[p], self.param_names(p)
        old = self.table_params(params, name)
        if pack.kind == "dense" and hasattr(values, "shape"):  # a dense table's array itself
            values = (values,)
        shapes = [tuple(np.shape(v)) for v in values] if isinstance(values, (tuple, list)) else None
        if shapes != [tuple(o.shape) for o in old]:
            want = "its [N, D] array" if pack.kind == "dense" else f"a tuple of its {len(old)} cores"
            raise ValueError(
                f"table {name!r} ({pack.kind}) takes {want} of shapes {[tuple(o.shape) for o in old]}, "
                f"got {shapes if shapes is not None else type(values).__name__}"
            )
        values = tuple(jnp.asarray(v) for v in values)
        out = dict(params)
        if pack.kind == "tt":
            offs = pack.layout.core_offsets
            for k, (n, v) in enumerate(zip(names, values)):
                out[n] = params[n].at[offs[k][t] : offs[k][t + 1]].set(v.astype(params[n].dtype))
        elif pack.kind == "dense":
            lo, hi = pack.row_offsets[t], pack.row_offsets[t + 1]
            out[names[0]] = params[names[0]].at[lo:hi].set(values[0].astype(params[names[0]].dtype))
        else:
            out.update({n: v.astype(params[n].dtype) for n, v in zip(names, values)})
        return out

    def to_dense(self, params: Mapping[str, jax.Array], name: str) -> jax.Array:
        """Table ``name`` materialised ``[N, D]`` (float32 accumulation, the params' dtype): a
        TT table's rows, its cached rows from its cache."""
        p, t = self.locate(name)
        values = self.table_params(params, name)
        if self.packs[p].kind == "dense":
            return values[0]
        cfg = self.packs[p].tables[t]
        dense = to_dense(tuple(c.astype(jnp.float32) for c in values), cfg.num_embeddings).astype(
            values[0].dtype
        )
        cache = self.table_cache(params, name)
        if cache is None:
            return dense
        return dense.at[cache[1]].set(cache[0].astype(dense.dtype), mode="drop")  # EMPTY: dropped

    def table_cache(self, params: Mapping[str, jax.Array], name: str) -> tuple[jax.Array, jax.Array] | None:
        """Table ``name``'s hot-row cache ``(rows [k, D], ids int32 [k])`` (ids ascending,
        ``cache.EMPTY`` in unused slots; static slices of its pack's block), or None."""
        p, t = self.locate(name)
        pack, names = self.packs[p], self.cache_names(p)
        lo, hi = pack.cache_offsets[t], pack.cache_offsets[t + 1]
        if names is None or hi == lo:
            return None
        return params[names[0]][lo:hi], params[names[1]][lo:hi]

    def with_cache(self, params: Mapping[str, jax.Array], name: str, rows: Any, ids: Any) -> dict:
        """``params`` with table ``name``'s cache set to ``rows [k, D]`` at slots ``ids [k]``
        (``table_cache``'s form: ascending, ``EMPTY``-padded)."""
        old = self.table_cache(params, name)
        if old is None:
            raise ValueError(f"table {name!r} has no hot-row cache (TableConfig.cache_rows)")
        if tuple(np.shape(rows)) != tuple(old[0].shape) or tuple(np.shape(ids)) != tuple(old[1].shape):
            raise ValueError(
                f"table {name!r}: a cache of rows {tuple(old[0].shape)} and ids {tuple(old[1].shape)}, "
                f"got {tuple(np.shape(rows))} and {tuple(np.shape(ids))}"
            )
        p, t = self.locate(name)
        (block, hot), lo = self.cache_names(p), self.packs[p].cache_offsets[t]
        out = dict(params)
        out[block] = params[block].at[lo : lo + old[0].shape[0]].set(jnp.asarray(rows, params[block].dtype))
        out[hot] = params[hot].at[lo : lo + old[1].shape[0]].set(jnp.asarray(ids, jnp.int32))
        return out

    def with_hot_ids(self, params: Mapping[str, jax.Array], name: str, ids: Any) -> dict:
        """``params`` with table ``name`` caching ``ids`` (int, at most its ``cache_rows``; host
        or device, jittable: a refresh between steps is one device program): an id already
        cached keeps its trained row, a new one starts at its TT row; an id that leaves goes
        back to its TT row (its trained value is dropped)."""
        old = self.table_cache(params, name)
        if old is None:
            raise ValueError(f"table {name!r} has no hot-row cache (TableConfig.cache_rows)")
        p, t = self.locate(name)
        cfg = self.packs[p].tables[t]
        new = sorted_hot(ids, old[1].shape[0], cfg.num_embeddings, name)
        at = jnp.minimum(jnp.searchsorted(old[1], new), old[1].shape[0] - 1)
        kept = (old[1][at] == new) & (new != EMPTY)
        rows = jnp.where(kept[:, None], old[0][at], tt_rows_of(self.table_params(params, name), new))
        return self.with_cache(params, name, rows, new)

    def table_state(self, params: Mapping[str, jax.Array]) -> dict[str, tuple[jax.Array, ...]]:
        """``{table name: its parameters}`` (``table_params``: TT cores, or ``(table,)``; a
        cached table's cores then its cache's rows and ids, ``table_cache``): a checkpoint that
        survives reordering tables, adding them or re-ranking others (``load_table_state``)."""
        return {
            cfg.name: self.table_params(params, cfg.name) + (self.table_cache(params, cfg.name) or ())
            for cfg in self.tables
        }

    def load_table_state(
        self,
        params: Mapping[str, jax.Array],
        state: Mapping[str, Sequence[jax.Array]],
        *,
        strict: bool = True,
        allow_nonfinite: bool = False,
    ) -> dict[str, jax.Array]:
        """``params`` with every table of ``state`` (``table_state``'s form) loaded by name.
        ``ValueError`` naming the tables when ``state`` has a table this collection lacks,
        lacks one of its tables (``strict``), a table's shapes differ (another rank or size),
        or a table holds NaN or inf values (unless ``allow_nonfinite``; traced values are not
        checked): nothing is loaded then."""
        names = [cfg.name for cfg in self.tables]
        unknown = sorted(set(state) - set(names))
        missing = [n for n in names if n not in state] if strict else []
        shapes = {cfg.name: table_shapes(cfg) for cfg in self.tables if cfg.name in state}
        differ = {
            n: ([tuple(v.shape) for v in state[n]], list(s))
            for n, s in shapes.items()
            if tuple(tuple(v.shape) for v in state[n]) != s
        }
        problems = [
            f"table {n!r}: shapes {got} != the collection's {want}" for n, (got, want) in differ.items()
        ]
        if not allow_nonfinite:
            bad = [
                n
                for n in shapes
                if n not in differ
                and any(
                    not isinstance(v, jax.core.Tracer) and not np.all(np.isfinite(np.asarray(v)))
                    for v in state[n]
                )
            ]
            if bad:
                problems.append(f"tables {bad} hold NaN or inf values (allow_nonfinite=True loads them)")
        if unknown:
            problems.insert(0, f"tables not in this collection: {unknown}")
        if missing:
            problems.insert(0, f"tables missing from the state: {missing}")
        if problems:
            raise ValueError("the table state does not fit this collection: " + "; ".join(problems))
        out = dict(params)
        for n in names:
            if n in state:
                cores = len(self.table_params(out, n))
                out = self.with_table(out, n, tuple(state[n][:cores]))
                if len(state[n]) > cores:  # its cache's rows and ids
                    out = self.with_cache(out, n, *state[n][cores:])
        return out

    def table_bytes(self, params: Mapping[str, jax.Array]) -> dict[str, int]:
        """Bytes of parameters stored per table."""
        return {
            cfg.name: sum(
                int(x.size) * x.dtype.itemsize
                for x in self.table_params(params, cfg.name) + (self.table_cache(params, cfg.name) or ())
            )
            for cfg in self.tables
        }


def table_shapes(cfg: TableConfig) -> tuple[tuple[int, ...], ...]:
    """A table's own parameters' shapes (``table_state``'s): its cores' (then its cache's
    ``(k, D)`` and ``(k,)``), or ``((N, D),)`` if dense."""
    if cfg.kind == "dense":
        return ((cfg.num_embeddings, cfg.features),)
    cache = ((cfg.cache_rows, cfg.features), (cfg.cache_rows,)) if cfg.cache_rows else ()
    return tuple(cfg.spec().core_shapes) + cache
