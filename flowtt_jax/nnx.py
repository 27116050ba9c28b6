"""Flax NNX layers over TT-compressed embedding tables.

- ``TTEmbed``: drop-in for ``nnx.Embed`` -- ids of any shape -> rows ``[..., features]``.
- ``TTEmbedBag``: pooled bags (offsets / segment ids / padded ids + mask, per-id
  weights, ``sum | mean | sqrtn``).
- ``EmbedBag``: the same bag interface over a plain dense table (for small tables and
  as the uncompressed baseline).
- ``TTEmbeddingCollection``: named tables (TT or dense) from a list of
  ``TableConfig``; one call pools every feature and returns ``{feature: [B, features]}``.

Parameters: the TT cores are ``nnx.Param``s named ``core_0 .. core_{d-1}`` (shape
``[p_k, r_{k-1}, q_k, r_k]``), read with ``p[...]``; a dense table is ``embedding``.
These are the same names as the ``flowtt_jax.linen`` twins, so the two agree given the
same cores.

dtypes: ``param_dtype`` is the storage dtype of the cores. ``dtype`` is the output
dtype (default: ``param_dtype``). The TT contraction always accumulates in float32 (bf16
cores are upcast inside the op) and the result is cast to ``dtype`` at the end.

``impl`` (``"auto" | "ffi" | "reference"``) is passed through to the ops: ``"auto"``
uses the compiled kernels when the extension is built, else the pure-jnp reference.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import errors, nnx

from flowtt_jax.collection.cache import check_hot_ids
from flowtt_jax.collection.cache import hot_ids as cache_hot_ids
from flowtt_jax.collection.config import TableConfig
from flowtt_jax.collection.layout import CollectionLayout, labeller
from flowtt_jax.collection.sparse_rows import init_sparse_state
from flowtt_jax.inputs.jagged import KeyedJagged
from flowtt_jax.layer_methods import BagCall, DenseBagMethods, TTTableMethods
from flowtt_jax.memory import BatchStats, MemoryEstimate, MemoryPlan, estimate_memory
from flowtt_jax.tt.cores import CoreInit, check_cores, normal, resolve_init
from flowtt_jax.tt.cores import from_dense as _tt_svd
from flowtt_jax.tt.spec import TTSpec

__all__ = ["TTEmbed", "TTEmbedBag", "EmbedBag", "TTEmbeddingCollection", "TableConfig", "resolve_init"]


class _TTTable(TTTableMethods, nnx.Module):
    """Shared parameter handling of ``TTEmbed`` and ``TTEmbedBag``."""

    def __init__(
        self,
        num_embeddings: int,
        features: int,
        *,
        rank: int | tuple[int, ...] = 32,
        dtype: Any | None = None,
        param_dtype: Any = jnp.float32,
        embedding_init: CoreInit | float | None = None,
        row_shape: tuple[int, ...] | None = None,
        col_shape: tuple[int, ...] | None = None,
        num_cores: int = 3,
        oob: str = "zero",
        impl: str = "auto",
        rngs: nnx.Rngs,
    ):
        self.num_embeddings = int(num_embeddings)
        self.features = int(features)
        self.dtype = dtype
        self.param_dtype = param_dtype
        self.oob = oob
        self.impl = impl
        self.spec = TTSpec.create(
            self.num_embeddings,
            self.features,
            rank,
            num_cores=num_cores,
            row_shape=row_shape,
            col_shape=col_shape,
        )
        init = resolve_init(embedding_init)
        cores = check_cores(init(rngs.params(), self.spec, param_dtype), self.spec, param_dtype)
        self.num_cores = len(cores)
        for k, c in enumerate(cores):
            setattr(self, f"core_{k}", nnx.Param(c))

    @property
    def cores(self) -> tuple[jax.Array, ...]:
        """The current core values (``[p_k, r_{k-1}, q_k, r_k]`` each)."""
        return tuple(getattr(self, f"core_{k}")[...] for k in range(self.num_cores))

    @classmethod
    def from_dense(
        cls,
        table: jax.Array,
        rank: int | tuple[int, ...] = 32,
        *,
        rngs: nnx.Rngs | None = None,
        on_device: bool = False,
        **kwargs: Any,
    ):
        """A layer initialised with the TT-SVD of a dense ``[N, D]`` table (truncated to ``rank``).

        Exact when ``rank`` is at least the full TT rank; otherwise the best
        truncation TT-SVD finds. Runs on the host in float64, or on jax's default device
        with ``on_device`` (``flowtt_jax.tt.cores.from_dense``).
        """
        table = jnp.asarray(table)
        n, d = table.shape
        init = lambda key, spec, dtype: _tt_svd(table, spec, dtype, on_device=on_device)  # noqa: E731
        return cls(n, d, rank=rank, embedding_init=init, rngs=rngs or nnx.Rngs(0), **kwargs)


class TTEmbed(_TTTable):
    """TT-compressed ``nnx.Embed``: int ids of any shape -> ``[..., features]``.

    Args:
      num_embeddings: rows N (ids ``0..N-1``; others follow ``oob``).
      features: embedding dim D.
      rank: TT rank (int or the d-1 internal ranks); capped at full rank.
      dtype: output dtype (default ``param_dtype``); computation accumulates in fp32.
      param_dtype: storage dtype of the cores.
      embedding_init: None (row std ``1/sqrt(D)``, as ``nnx.Embed``), a float row std,
        or ``(key, spec, dtype) -> cores``.
      row_shape, col_shape, num_cores: TT shapes (automatic by default).
      oob: ``"zero" | "clip" | "error"`` for ids outside ``[0, N)``.
      impl: ``"auto" | "ffi" | "reference"``.
      rngs: ``nnx.Rngs`` (uses the ``params`` stream).
    """

    def __call__(self, ids: jax.Array) -> jax.Array:
        return self._lookup(ids)


class TTEmbedBag(BagCall, _TTTable):
    """Pooled TT embedding bags (``torch.nn.EmbeddingBag`` over a TT table).

    Same constructor as ``TTEmbed`` plus ``mode`` (the default pooling). Call with
    ids ``[n]`` + ``offsets`` ([B+1] CSR), ids ``[n]`` + ``segment_ids`` + ``num_bags``,
    or padded ids ``[B, L]`` (+ optional bool ``mask``); optional per-id ``weights``.
    Returns ``[B, features]``; an empty bag gives zeros.
    """

    def __init__(self, num_embeddings: int, features: int, *, mode: str = "sum", **kwargs: Any):
        super().__init__(num_embeddings, features, **kwargs)
        self.mode = mode


class EmbedBag(DenseBagMethods, nnx.Module):
    """Bags over a plain dense ``[N, D]`` table (param ``embedding``); same call as ``TTEmbedBag``.

    ``embedding_init``: None (normal, std ``1/sqrt(features)``), a float std, or a Flax
    initializer ``(key, shape, dtype)``. ``lookup(ids)`` gives unpooled rows.
    """

    def __init__(
        self,
        num_embeddings: int,
        features: int,
        *,
        mode: str = "sum",
        dtype: Any | None = None,
        param_dtype: Any = jnp.float32,
        embedding_init: Callable | float | None = None,
        oob: str = "zero",
        rngs: nnx.Rngs,
    ):
        self.num_embeddings = int(num_embeddings)
        self.features = int(features)
        self.mode = mode
        self.dtype = dtype
        self.param_dtype = param_dtype
        self.oob = oob
        key = rngs.params()
        shape = (self.num_embeddings, self.features)
        if embedding_init is None or isinstance(embedding_init, (int, float)):
            std = 1.0 / math.sqrt(features) if embedding_init is None else float(embedding_init)
            table = std * normal(key, shape)
        else:
            table = embedding_init(key, shape, param_dtype)
        self.embedding = nnx.Param(jnp.asarray(table, param_dtype))

    @property
    def _table(self) -> jax.Array:
        return self.embedding[...]

    def to_dense(self) -> jax.Array:
        return self._table.astype(self.out_dtype)


class OverflowCount(nnx.Variable):
    """A collection's per-pack count of calls whose unique rows exceeded the capacity
    (updated on the device by every call; not a parameter: optimizers over ``nnx.Param``
    leave it alone)."""


class SparseTable(nnx.Variable):
    """A dense table updated on its touched rows only (``TableConfig.sparse``,
    ``flowtt_jax.sparse``): not an ``nnx.Param``, so ``nnx.grad`` / optax leave it alone."""


class SparseSlot(nnx.Variable):
    """A sparse table's optimizer state (accumulators, moments, per-row step counts)."""


@functools.partial(jax.jit, static_argnums=0)
def _with_hot_ids(layout: CollectionLayout, values: dict, hot: dict) -> dict:
    """``values`` with every table of ``hot`` caching its ids (one program)."""
    for name, ids in hot.items():
        values = layout.with_hot_ids(values, name, ids)
    return values


class HotIds(nnx.Variable):
    """The ids a pack's hot-row caches hold (int32; not trained: ``refresh_cache`` sets them)."""


class OutOfRangeCount(nnx.Variable):
    """A collection's per-table count of ids out of range of their table (before the ``oob``
    policy; updated on the device by every call; not a parameter)."""


class TTEmbeddingCollection(nnx.Module):
    """Named embedding tables, TT-compressed or dense, pooled in one call.

    ``tables``: ``TableConfig``s (see ``flowtt_jax.collection``). Call with a mapping
    ``{feature name: input}`` (an int array ``[B]`` or ``[B, L]``, or a dict of
    ``tt_embedding_bag`` arguments); returns ``{feature name: [B, features]}``. Or call
    with stacked ids ``[B, F]`` / ``[B, F, L]`` (one column per feature, in
    ``feature_names`` order; optional ``weights``), e.g. a Criteo batch; or with a
    ``KeyedJagged`` (one flat ids array, ``lengths [F, B]`` or offsets ``[F*B + 1]``: the
    form data pipelines produce for variable-length features; keys in any order); both
    return ``[B, F, features]`` with no per-feature op in the program (a ``KeyedJagged`` over
    tables of several dims: ``{feature: [B, D_f]}``). A feature dict may name a subset of the
    features (e.g. one tower's): their outputs only. ``lookup`` (or
    ``pooled=False``) gives each id's row instead of pooled bags.

    The tables are packed (``flowtt_jax.collection_layout``): the TT tables of one shape
    group (same column shape and ranks) share packed cores and run as one table-batched
    op (one plan, one launch per stage); dense tables of one dim share one packed table
    (one gather and segment sum). Parameters: ``self.params[name]`` (``nnx.Param``s named
    as ``CollectionLayout.param_names``); per table: ``cores(name)``, ``table(name)``,
    ``to_dense(name)``, ``load_table(name, ...)``, ``from_dense(name, dense)``.
    ``memory_budget``: ``"auto"`` (default; a share of the device's memory,
    ``flowtt_jax.memory.AUTO_FRACTION``), bytes, or None: at trace time, from the batch's
    static shapes, a call takes the fewest passes over the ids whose step fits
    (``memory_plan(stats)`` shows the choice; ``docs/memory.md``). ``ids_per_pass``: the TT
    kernels take each shape group's ids this many at a time, and ``unique_windows`` holds each
    shape group's unique rows in that many windows (one plan; each row made once), overriding
    the budget's choice.
    ``overflow_counts``: where a table has a capacity (``TableConfig.max_unique_ids``), per
    pack (``overflows()``) the calls whose unique rows exceeded it, counted on the device
    (not counted when the state is closed over as a constant rather than traced with the
    call); None without capacities (nothing can overflow).
    ``out_of_range_counts``: float32 ``[num_tables]`` (``tables`` order; exact to 2^24), the
    ids each table was given out of its range, counted on the device by every call whatever
    ``oob`` (``"zero"`` and ``"clip"`` keep their values; ``out_of_range()`` reads them by
    table name; ``oob="error"`` with ``ftt.checked`` raises instead); not counted on a sharded
    collection nor when the state is closed over as a constant.
    """

    def __init__(
        self,
        tables: Sequence[TableConfig],
        *,
        dtype: Any | None = None,
        param_dtype: Any = jnp.float32,
        oob: str = "zero",
        impl: str = "auto",
        ids_per_pass: int | None = None,
        memory_budget: int | str | None = "auto",
        unique_windows: int | None = None,
        rngs: nnx.Rngs,
    ):
        self.layout = CollectionLayout(
            tuple(tables),
            ids_per_pass=ids_per_pass,
            memory_budget=memory_budget,
            unique_windows=unique_windows,
        )
        self.tables = self.layout.tables
        self.dtype = dtype
        self.param_dtype = param_dtype
        self.oob = oob
        self.impl = impl
        init = self.layout.init(rngs.params(), param_dtype)
        sparse = self.layout.sparse_params()  # dense tables updated on touched rows only
        hot = set(self.layout.hot_names())  # hot-row caches' ids: not trained
        self.params = nnx.Dict(
            {
                k: SparseTable(v) if k in sparse else HotIds(v) if k in hot else nnx.Param(v)
                for k, v in init.items()
            }
        )
        self.sparse_state = nnx.Dict(
            {
                k: nnx.Dict({s: SparseSlot(z) for s, z in init_sparse_state(cfg.rule, init[k].shape).items()})
                for k, cfg in sparse.items()
            }
        )
        # only where a capacity can overflow (a table with max_unique_ids): a plain collection
        # stays stateless. float32 (exact to 2**24 calls): jax.grad over a whole nnx.state
        # takes no int leaf
        capped = any(p.unique_capacity is not None for p in self.layout.packs)
        self.overflow_counts = (
            OverflowCount(jnp.zeros((len(self.layout.packs),), jnp.float32)) if capped else None
        )
        # float32: jax.grad over a whole nnx.state takes no int leaf
        self.out_of_range_counts = OutOfRangeCount(jnp.zeros((len(self.tables),), jnp.float32))

    def _values(self) -> dict[str, jax.Array]:
        return {k: p[...] for k, p in self.params.items()}

    def __call__(
        self,
        features: Mapping[str, Any] | KeyedJagged | jax.Array,
        weights: jax.Array | None = None,
        *,
        pooled: bool = True,
    ) -> dict[str, jax.Array] | jax.Array:
        """``{feature: input}`` -> ``{feature: [B, features]}``; a ``KeyedJagged`` (every
        feature's bags in one flat array) -> ``[B, F, features]``; or stacked ids ``[B, F]`` /
        ``[B, F, L]`` (columns in ``feature_names`` order, optional ``weights`` of their
        shape) -> ``[B, F, features]``. ``pooled=False``: each id's row instead
        (``lookup``)."""
        kw = dict(oob=self.oob, impl=self.impl, dtype=self.dtype, param_dtype=self.param_dtype)
        out, counts = self.layout.call(
            self._values(), features, weights, pooled=pooled, with_counts=True, **kw
        )
        try:
            self.out_of_range_counts[...] = self.out_of_range_counts[...] + counts.out_of_range.astype(
                jnp.float32
            )
            if self.overflow_counts is not None:
                self.overflow_counts[...] = self.overflow_counts[...] + counts.overflow.astype(jnp.float32)
        except errors.TraceContextError:  # the state was closed over, not traced with the call
            pass
        return out

    def out_of_range(self) -> dict[str, int]:
        """``{table name: ids out of its range so far}`` (a host read: for reports, not inside a
        step; ``out_of_range_counts`` is the device value)."""
        counts = jax.device_get(self.out_of_range_counts[...])
        return {cfg.name: int(c) for cfg, c in zip(self.tables, counts)}

    def param_labels(self, default: str = "default") -> Any:
        """Per-table optimizer settings: ``optax.multi_transform(transforms, coll.param_labels())``
        labels this collection's parameters by their tables' ``TableConfig.optimizer`` and every
        other leaf ``default`` (a callable of the parameter pytree: this collection's state, or a
        model's holding it)."""
        return labeller(self.layout.param_labels(default), default)

    def overflows(self) -> dict[str, int]:
        """``{pack label: calls that overflowed its capacity}`` (``CollectionLayout.pack_labels``;
        a host read: for reports, not inside a step)."""
        if self.overflow_counts is None:  # no capacity: nothing can overflow
            return {label: 0 for label in self.layout.pack_labels()}
        counts = jax.device_get(self.overflow_counts[...])
        return {label: int(c) for label, c in zip(self.layout.pack_labels(), counts)}

    def memory_plan(self, stats: BatchStats, *, training: bool = True) -> MemoryPlan:
        """What a call on batches of ``stats`` runs under ``memory_budget`` (its passes over
        the ids and ``estimate_memory``'s bytes): ``CollectionLayout.memory_plan``."""
        return self.layout.memory_plan(stats, training=training)

    def lookup(self, features: Mapping[str, Any] | KeyedJagged) -> dict[str, jax.Array] | jax.Array:
        """Unpooled rows (TorchRec's ``EmbeddingCollection``): ``{feature: ids [...]}`` ->
        ``{feature: [..., features]}``, a ``KeyedJagged`` -> ``[n, features]`` in its ids'
        order (``CollectionLayout.lookup``)."""
        return self(features, pooled=False)

    @property
    def feature_names(self) -> tuple[str, ...]:
        """The features in the order of a stacked input's columns and output's rows."""
        return self.layout.feature_names

    def cores(self, name: str) -> tuple[jax.Array, ...]:
        """TT table ``name``'s cores ``[p_k, r_{k-1}, q_k, r_k]`` (views of the packed cores)."""
        if self._config(name).kind != "tt":
            raise ValueError(f"table {name!r} is dense: use table({name!r})")
        return self.layout.table_params(self._values(), name)

    def table(self, name: str) -> jax.Array:
        """Dense table ``name``'s ``[N, D]`` parameters."""
        if self._config(name).kind != "dense":
            raise ValueError(f"table {name!r} is TT: use cores({name!r}) or to_dense({name!r})")
        return self.layout.table_params(self._values(), name)[0]

    def to_dense(self, name: str) -> jax.Array:
        """Table ``name`` materialised ``[N, D]`` (for export and tests)."""
        return self.layout.to_dense(self._values(), name)

    def load_table(self, name: str, values: Sequence[jax.Array] | jax.Array) -> None:
        """Replaces table ``name``'s parameters: a TT table's cores (a tuple), a dense table's
        ``[N, D]`` array (or ``(array,)``)."""
        new = self.layout.with_table(self._values(), name, values)
        for k, p in self.params.items():
            p[...] = new[k]

    def from_dense(self, name: str, dense: jax.Array, *, on_device: bool = False) -> float:
        """Loads a dense ``[N, D]`` table into table ``name``: its TT-SVD truncated to the
        table's ranks (TT tables; on jax's default device with ``on_device``) or the table
        itself (dense tables). Returns the relative error of what was loaded,
        ``||dense - table||_F / ||dense||_F`` (0.0 for a dense table; also logged,
        ``flowtt_jax.tt.cores.from_dense``)."""
        cfg = self._config(name)
        if cfg.kind == "dense":
            self.load_table(name, (dense,))
            return 0.0
        try:
            values, error = _tt_svd(
                dense, cfg.spec(), self.param_dtype, return_error=True, on_device=on_device
            )
        except ValueError as e:  # name the table the user wrote
            raise ValueError(f"table {name!r}: {e}") from None
        self.load_table(name, values)
        return error

    def table_state(self) -> dict[str, tuple[jax.Array, ...]]:
        """``{table name: its cores, or (table,) if dense}``: a checkpoint by table name, which
        ``load_table_state`` restores into a collection with the tables in another order, more
        tables, or other tables re-ranked (a positional ``nnx.state`` fits only this layout)."""
        return self.layout.table_state(self._values())

    def load_table_state(
        self, state: Mapping[str, Sequence[jax.Array]], *, strict: bool = True, allow_nonfinite: bool = False
    ) -> None:
        """Loads every table of ``state`` (``table_state``'s form) by name; ``ValueError`` naming
        the tables if ``state`` has one this collection lacks, lacks one of its tables
        (``strict``), a table's shapes differ, or a table holds NaN or inf (unless
        ``allow_nonfinite``): nothing is loaded then."""
        new = self.layout.load_table_state(
            self._values(), state, strict=strict, allow_nonfinite=allow_nonfinite
        )
        for k, p in self.params.items():
            p[...] = new[k]

    def refresh_cache(
        self, batches: Iterable[Any] | None = None, *, hot_ids: Mapping[str, Any] | None = None
    ) -> dict[str, np.ndarray]:
        """Re-chooses the rows the cached TT tables (``TableConfig.cache_rows``) hold: each
        one's most frequent ids over sample ``batches`` (feature dicts or ``KeyedJagged``s,
        counted on the host), or ``hot_ids`` ``{table: ids}`` as given. An id that stays keeps
        its trained row, one that enters starts at its TT row, one that leaves falls back to
        its TT row (``CollectionLayout.with_hot_ids``; optimizer slots stay with the slots).
        Between steps; returns ``{table: the ids it now caches}``."""
        if (batches is None) == (hot_ids is None):
            raise ValueError("refresh_cache takes sample batches or hot_ids, one of them")
        if hot_ids is None:
            owners = {f: cfg.name for cfg in self.tables for f in cfg.feature_keys}
            hot_ids = cache_hot_ids(batches, self.tables, owners)
        sizes = {cfg.name: (cfg.cache_rows, cfg.num_embeddings) for cfg in self.tables}
        unknown = sorted(set(hot_ids) - set(sizes))
        if unknown:
            raise KeyError(f"refresh_cache: no tables named {unknown}")
        for name in hot_ids:
            if not sizes[name][0]:
                raise ValueError(f"table {name!r} has no hot-row cache (TableConfig.cache_rows)")
        hot = {n: check_hot_ids(ids, *sizes[n], n) for n, ids in hot_ids.items()}
        values = _with_hot_ids(self.layout, self._values(), hot)
        for k, p in self.params.items():
            p[...] = values[k]
        return {n: np.asarray(self.layout.table_cache(values, n)[1]) for n in hot_ids}

    def embedding_bytes(self) -> dict[str, int]:
        """Bytes of parameters stored per table."""
        return self.layout.table_bytes(self._values())

    def estimate_memory(
        self, stats: BatchStats, *, optimizer: Any = None, training: bool = True
    ) -> MemoryEstimate:
        """``flowtt_jax.memory.estimate_memory`` of this collection's tables (in its
        parameter dtype) on batches of ``stats``."""
        dtype = next(iter(self._values().values())).dtype
        return estimate_memory(
            self.layout.tables,
            stats,
            optimizer=optimizer,
            training=training,
            param_dtype=dtype,
            ids_per_pass=self.layout.ids_per_pass,
            memory_budget=self.layout.memory_budget,
            unique_windows=self.layout.unique_windows,
        )

    def _config(self, name: str) -> TableConfig:
        p, t = self.layout.locate(name)
        return self.layout.packs[p].tables[t]
