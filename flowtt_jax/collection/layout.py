"""A collection's tables as packs: the static layout, packed parameters and one
batched call per pack (Flax-free; ``nnx.py`` and ``linen.py`` hold the parameters).

- TT tables with 3 cores, the same column shape and the same ranks form a *shape
  group*: their cores are packed per core index (``GroupLayout``) and every feature
  reading them is pooled by one ``ops.pooled`` call (one plan, one launch per stage).
- Dense tables of the same dim are packed into one ``[sum N, D]`` table: one gather and
  one segment sum for all their features.
- TT tables with another number of cores keep their own cores and the single-table op.

Parameters are a flat ``{name: array}`` dict: ``tt{g}_{digest}_core{k}`` (group g's packed
core k), ``dense{g}_{digest}`` (dense pack g), ``{table}_core{k}`` (a single TT table); the
digest is of the pack's table names in order (``packs.param_names``). Compile time
grows with the number of packs, not of tables.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from flowtt_jax.budget import static_count
from flowtt_jax.capacity import MAX_PASSES
from flowtt_jax.collection.batch import (
    dict_batches,
    form_sizes,
    jagged_batches,
    jagged_csr,
    lookup_batches,
    stacked_batches,
)
from flowtt_jax.collection.config import SparseUpdate, TableConfig, check_tables
from flowtt_jax.collection.init import init_params
from flowtt_jax.collection.packs import (
    FeatureSlot,
    TablePack,
    cache_names,
    check_param_names,
    pack_tables,
    param_names,
)
from flowtt_jax.collection.pool import call_counters, pack_impl, pool_batch
from flowtt_jax.collection.tables import TableViews
from flowtt_jax.collection.xla_fit import check_by_xla, pinned_layout
from flowtt_jax.inputs.jagged import KeyedJagged
from flowtt_jax.inputs.validate import check_stacked
from flowtt_jax.kernels import ffi
from flowtt_jax.memory import BatchStats, MemoryPlan, apply_candidate, choose_memory_plan, resolve_budget

__all__ = ["CallCounts", "CollectionLayout", "FeatureSlot", "TablePack"]


class CallCounts(NamedTuple):
    """A call's device counters: ``overflow`` int32 ``[num_packs]``, 1 where a pack had more
    unique rows than its capacity; ``out_of_range`` int32 ``[num_tables]`` (``tables`` order),
    the ids out of range of each table, before the ``oob`` policy."""

    overflow: jax.Array
    out_of_range: jax.Array


@dataclasses.dataclass(frozen=True)
class CollectionLayout(TableViews):
    """Static packing of a collection's ``TableConfig``s (hashable).

    ``ids_per_pass``: the TT kernels take each pack's ids this many at a time (None: as
    ``memory_budget`` decides). ``memory_budget``: ``"auto"`` (default: a share of the
    device's memory, ``flowtt_jax.memory.AUTO_FRACTION``), bytes, or None (every buffer by
    the batch's ids, one pass): at trace time, from the batch's static shapes, each call
    takes the fewest passes whose step fits it (``memory_plan``).
    """

    tables: tuple[TableConfig, ...]
    ids_per_pass: int | None = dataclasses.field(default=None, kw_only=True)
    memory_budget: int | str | None = dataclasses.field(default="auto", kw_only=True)
    unique_windows: int | None = dataclasses.field(default=None, kw_only=True)
    #: Whether ``call(..., with_counts=True)`` counts (a sharded layout pools inside a
    #: ``shard_map``, whose counters stay there: its counts are zeros).
    counts_calls = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "tables", check_tables(self.tables))
        static_count(self.ids_per_pass, "ids_per_pass")  # a ValueError naming it
        static_count(self.unique_windows, "unique_windows", most=MAX_PASSES)
        if not isinstance(self.memory_budget, str):
            resolve_budget(self.memory_budget)  # a ValueError naming memory_budget
        elif self.memory_budget != "auto":
            raise ValueError(
                f"memory_budget must be 'auto', bytes (an int >= 1) or None, got {self.memory_budget!r}"
            )
        check_param_names(self.packs)

    @functools.cached_property
    def packs(self) -> tuple[TablePack, ...]:
        """TT shape groups (in order of first table), then dense packs by dim, then singles;
        the TT packs' kernels take their ids ``ids_per_pass`` at a time (None: all)."""
        return pack_tables(self.tables, self.ids_per_pass, self.unique_windows)

    def param_names(self, p: int) -> tuple[str, ...]:
        """Parameter names of pack ``p``."""
        return param_names(self.packs, p)

    def cache_names(self, p: int) -> tuple[str, str] | None:
        """Names of pack ``p``'s hot-row cache block and hot ids, or None (no cache)."""
        return cache_names(self.packs, p)

    def memory_plan(
        self,
        batch: Any,
        weights: Any = None,
        *,
        pooled: bool = True,
        params: Any = None,
        training: bool = True,
    ) -> MemoryPlan:
        """What a call runs under ``memory_budget``: its passes over the ids and their bytes.

        ``batch``: ``BatchStats`` (the estimate's choice, ``memory.choose_memory_plan``), or
        a call's inputs (a feature dict, ``KeyedJagged`` or stacked ids, arrays or
        ``ShapeDtypeStruct``s, with ``weights`` and ``pooled`` as ``call`` takes them): the
        choice the call makes, checked by XLA's analysis near the budget
        (``collection.xla_fit``; ``params``: the parameters or their shapes, default float32).
        ``ids_per_pass`` given: that is the plan."""
        if isinstance(batch, BatchStats):
            return choose_memory_plan(self.packs, batch, self.memory_budget, training=training)
        return self._checked_plan(params, batch, weights, pooled, {})

    def _form_sizes(self, features: Any, pooled: bool) -> tuple[list[int], int]:
        """``(ids per pack, bags per feature)`` of a call's inputs (``batch.form_sizes``)."""
        return form_sizes(self.packs, self.feature_names, features, pooled)

    def _stats(self, pack_ids: Sequence[int], batch: int) -> BatchStats:
        ids = {p.features[0].feature: int(n) for p, n in zip(self.packs, pack_ids) if p.features}
        return BatchStats(int(batch), ids)

    def _call_packs(self, pack_ids: Sequence[int], batch: int) -> tuple[TablePack, ...]:
        """The packs a call runs, ``pack_ids`` ids each (static) in ``batch`` bags per feature:
        ``packs`` with the estimate's ``ids_per_pass`` under the budget (``memory_plan``)."""
        if self._user_planned or self.memory_budget is None:
            return self.packs
        return self._packs_for(tuple(int(n) for n in pack_ids), int(batch))

    @property
    def _user_planned(self) -> bool:
        """The user gave the passes or windows: the budget chooses nothing."""
        return self.ids_per_pass is not None or self.unique_windows is not None

    @functools.lru_cache(maxsize=64)  # noqa: B019 (the layout is static and hashable)
    def _plan_for(self, pack_ids: tuple[int, ...], batch: int) -> MemoryPlan:
        """The estimate's plan for a call of these sizes (cached: every trace asks)."""
        return self.memory_plan(self._stats(pack_ids, batch))

    @functools.lru_cache(maxsize=64)  # noqa: B019 (the layout is static and hashable)
    def _packs_for(self, pack_ids: tuple[int, ...], batch: int) -> tuple[TablePack, ...]:
        plan = self._plan_for(pack_ids, batch)
        if plan.candidate == (1, 1):
            return self.packs
        most = max((n for p, n in zip(self.packs, pack_ids) if p.kind != "dense"), default=0)
        return apply_candidate(self.packs, most, plan.passes, plan.windows)

    def _counts(self, entries) -> CallCounts:
        """The ``call_counters`` entries of a call as its ``CallCounts``."""
        overflow = jnp.zeros((len(self.packs),), jnp.int32)
        out_of_range = jnp.zeros((len(self.tables),), jnp.int32)
        index = {t.name: i for i, t in enumerate(self.tables)}
        for kind, key, value in entries:
            if kind == "overflow":
                overflow = overflow.at[self.locate(key)[0]].max(value.astype(jnp.int32))
            else:
                out_of_range = out_of_range.at[np.asarray([index[n] for n in key])].add(value)
        return CallCounts(overflow, out_of_range)

    def pack_labels(self) -> tuple[str, ...]:
        """One label per pack: its parameter prefix and tables (``overflow_counts``' order)."""
        labels = []
        for p, pack in enumerate(self.packs):
            names = ", ".join(t.name for t in pack.tables[:4]) + (", ..." if len(pack.tables) > 4 else "")
            labels.append(f"{self.param_names(p)[0].rsplit('_', 1)[0]} ({len(pack.tables)} tables: {names})")
        return tuple(labels)

    def param_labels(self, default: str = "default") -> dict[str, str]:
        """``{parameter name: its tables' optimizer label}`` (``TableConfig.optimizer``, one per
        pack; None: ``default``)."""
        return {
            name: pack.tables[0].optimizer or default
            for p, pack in enumerate(self.packs)
            for name in self.param_names(p)
        }

    def sparse_params(self) -> dict[str, SparseUpdate]:
        """``{parameter name: SparseUpdate}`` of the packs of sparse dense tables."""
        return {
            self.param_names(p)[0]: pack.tables[0].sparse
            for p, pack in enumerate(self.packs)
            if pack.kind == "dense" and pack.tables[0].sparse is not None
        }

    def locate(self, name: str) -> tuple[int, int]:
        """``(pack index, table index in the pack)`` of table ``name``."""
        for p, pack in enumerate(self.packs):
            for t, cfg in enumerate(pack.tables):
                if cfg.name == name:
                    return p, t
        raise KeyError(f"no table named {name!r}; tables: {[c.name for c in self.tables]}")

    def init(self, key: jax.Array, param_dtype: Any = jnp.float32) -> dict[str, jax.Array]:
        """Fresh parameters, one compiled program for every pack (``collection.init``): each
        table's values from the distribution a lone table gets (TT rows of std ``cfg.std``;
        dense ``normal(cfg.std)``), pack p drawn with ``fold_in(key, p)``."""
        names = tuple(self.param_names(p) for p in range(len(self.packs)))
        caches = tuple(self.cache_names(p) for p in range(len(self.packs)))
        return init_params(self.packs, names, key, param_dtype, caches)

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every parameter's shape, by name."""
        return dict(self._param_shapes)

    @functools.cached_property
    def _param_shapes(self) -> dict[str, tuple[int, ...]]:
        """``param_shapes``, computed once: every call checks its parameters against it."""
        shapes = {}
        for p, pack in enumerate(self.packs):
            shapes.update(zip(self.param_names(p), pack.array_shapes))
            if self.cache_names(p):
                shapes.update(
                    zip(self.cache_names(p), ((pack.cache_rows, pack.tables[0].features), (pack.cache_rows,)))
                )
        return shapes

    def hot_names(self) -> tuple[str, ...]:
        """The names of the hot-row caches' id arrays (int32, not trainable)."""
        return tuple(c[1] for p in range(len(self.packs)) if (c := self.cache_names(p)))

    def check_params(self, params: Mapping[str, jax.Array], dtype: Any = None) -> None:
        """``ValueError`` unless ``params`` has exactly this layout's names and shapes (a
        state saved by another layout, restored by position after tables were re-ranked,
        added or removed) and, given ``dtype`` (a collection's ``param_dtype``), that dtype,
        naming the tables the wrong parameters would hold."""
        want = self._param_shapes
        wrong = {n: (tuple(params[n].shape) if n in params else None, s) for n, s in want.items()}
        wrong = {n: got_want for n, got_want in wrong.items() if got_want[0] != got_want[1]}
        extra = sorted(set(params) - set(want))
        hot = set(self.hot_names())
        typed = {n: params[n].dtype for n in hot if n in params and params[n].dtype != jnp.int32}
        if dtype is not None:
            typed.update(
                {
                    n: params[n].dtype
                    for n in set(want) - hot
                    if n in params and params[n].dtype != jnp.dtype(dtype)
                }
            )
        if not wrong and not extra and not typed:
            return
        owners = {
            n: [c.name for c in self.packs[p].tables]
            for p in range(len(self.packs))
            for n in self.param_names(p) + (self.cache_names(p) or ())
        }
        lines = [
            f"{n} (tables {owners[n]}): "
            + ("missing" if got is None else f"shape {got}")
            + f", the layout's {s}"
            for n, (got, s) in wrong.items()
        ]
        lines += [f"{n}: not a parameter of this layout" for n in extra]
        lines += [
            f"{n} (tables {owners[n]}): dtype {t}, the collection's "
            + ("int32" if n in hot else str(jnp.dtype(dtype)))
            for n, t in typed.items()
        ]
        raise ValueError(
            "the parameters do not fit this collection's tables (a state of another layout? "
            "restore by table name: table_state / load_table_state):\n  " + "\n  ".join(lines)
        )

    def apply(
        self,
        params: Mapping[str, jax.Array],
        features: Mapping[str, Any],
        *,
        oob: str = "zero",
        impl: str = "auto",
        dtype: Any | None = None,
    ) -> dict[str, jax.Array]:
        """``{feature: [B, D]}`` for the features ``features`` gives (every feature the tables
        read, or a subset: e.g. one tower's; see ``flowtt_jax.collection`` for the input
        forms); ``KeyError`` for a key no table reads."""
        params = _cast_to_batch(params, features)
        packs = self._call_packs(*self._form_sizes(features, True))
        out = {}
        pools = self._pool_inputs(packs, params)
        for b in dict_batches(packs, features, oob, self._kernels(packs, params, impl)):
            pooled = pool_batch(*pools[b.pack], b, impl, dtype, batch_major=True)
            pooled = pooled.reshape(b.batch, len(b.slots) * pooled.shape[-1])
            # batch-major [B, F*D] split along its columns: a model's jnp.concatenate(outs, -1)
            # (TorchRec's [B, sum D]) folds back to it, no copy and nothing compiled per
            # feature; a split, not slices, whose transposes would pad each to the whole
            # [B, F*D] (F^2 work)
            for slot, part in zip(b.slots, jnp.split(pooled, len(b.slots), axis=1)):
                out[slot.feature] = part
        return out

    def _kernels(self, packs: Sequence[TablePack], params: Mapping[str, jax.Array], impl: str) -> list[bool]:
        """Whether each pack runs the kernels (its bags are then prepared by one kernel too)."""
        return [
            pack_impl(pack, tuple(params[n] for n in self.param_names(p)), impl) == "ffi"
            for p, pack in enumerate(packs)
        ]

    def _pool_inputs(self, packs: Sequence[TablePack], params: Mapping[str, jax.Array]) -> list[tuple]:
        """Each pack's ``(pack, arrays, first parameter's name, (cache rows, hot ids) | None)``,
        what ``pool.pool_batch`` takes besides the batch."""
        out = []
        for p, pack in enumerate(packs):
            names, cache = self.param_names(p), self.cache_names(p)
            out.append(
                (
                    pack,
                    tuple(params[n] for n in names),
                    names[0],
                    cache and (params[cache[0]], params[cache[1]]),
                )
            )
        return out

    def apply_jagged(
        self,
        params: Mapping[str, jax.Array],
        batch: KeyedJagged,
        *,
        oob: str = "zero",
        impl: str = "auto",
        dtype: Any | None = None,
    ) -> jax.Array | dict[str, jax.Array]:
        """``[B, F, D]`` pooled bags of a packed jagged batch (``flowtt_jax.inputs.jagged``), the
        values of ``apply`` for the same bags; feature f is ``feature_names[f]``. Each pack
        pools its features' bags of the flat ids in one call (a pack whose features are not
        consecutive in ``feature_names`` takes them after one gather of the ids into the
        packs' order). Tables of several dims: ``{feature: [B, D_f]}`` instead
        (``jnp.concatenate([out[f] for f in feature_names], -1)`` is TorchRec's ``[B, sum D]``)."""
        csr, back, _ = jagged_csr(batch, self.feature_names, self.pack_order, oob)
        packs = self._call_packs([csr.ids.shape[0]] * len(self.packs), csr.batch)  # each pack sees every id
        batches = jagged_batches(packs, csr, oob, self._kernels(packs, params, impl), pooled=True)
        params = _cast_to_batch(params, (csr.ids, csr.weights))
        pools = self._pool_inputs(packs, params)
        pooled = [pool_batch(*pools[b.pack], b, impl, dtype, batch_major=True) for b in batches]
        parts = [x.reshape(b.batch, len(b.slots), x.shape[-1]) for b, x in zip(batches, pooled)]
        if len({cfg.features for cfg in self.tables}) > 1:  # tables of several dims: by name
            return {s.feature: x[:, i] for b, x in zip(batches, parts) for i, s in enumerate(b.slots)}
        out = jnp.concatenate(parts, axis=1) if len(parts) > 1 else parts[0]
        return out if back is None else out[:, back]

    def lookup(
        self,
        params: Mapping[str, jax.Array],
        features: Mapping[str, Any] | KeyedJagged,
        *,
        oob: str = "zero",
        impl: str = "auto",
        dtype: Any | None = None,
    ) -> dict[str, jax.Array] | jax.Array:
        """Unpooled rows (TorchRec's ``EmbeddingCollection``, FBGEMM's ``PoolingMode.NONE``):
        each id's row, through the same table-batched plan as the pooled call (each id its
        own bag). A ``KeyedJagged`` gives ``[n, D]`` in the order of its ids (rows of ids in
        no bag, or dropped by ``oob``, are 0; ``weights`` scale the rows); a feature dict
        ``{feature: ids of any shape}`` (or ``{"ids": ..., "weights": ...}``) gives
        ``{feature: [*ids.shape, D]}`` for the features it names."""
        if isinstance(features, KeyedJagged):
            self._one_dim("an unpooled packed jagged input")
            csr, _, src = jagged_csr(features, self.feature_names, self.pack_order, oob)
            n = csr.ids.shape[0]
            packs = self._call_packs([n] * len(self.packs), n)
            batches = jagged_batches(packs, csr, oob, self._kernels(packs, params, impl), pooled=False)
            params = _cast_to_batch(params, (csr.ids, csr.weights))
            pools = self._pool_inputs(packs, params)
            rows = None
            for b in batches:  # each position is live in one pack
                part = pool_batch(*pools[b.pack], b, impl, None, cast=False)
                rows = part if rows is None else rows + part
            rows = rows.astype(params[self.param_names(0)[0]].dtype if dtype is None else dtype)
            # back to the input's positions (rows in no bag are 0, so colliding adds add 0)
            return rows if src is None or n == 0 else jnp.zeros_like(rows).at[src].add(rows)
        packs = self._call_packs(*self._form_sizes(features, False))
        params = _cast_to_batch(params, features)
        out, pools = {}, self._pool_inputs(packs, params)
        for b, shapes in lookup_batches(packs, features, oob, self._kernels(packs, params, impl)):
            rows = pool_batch(*pools[b.pack], b, impl, dtype)
            sizes = [int(np.prod(shape)) for shape in shapes]
            for s, shape, part in zip(b.slots, shapes, jnp.split(rows, np.cumsum(sizes)[:-1])):
                out[s.feature] = part.reshape(*shape, -1)
        return out

    def call(
        self,
        params: Mapping[str, jax.Array],
        features: Mapping[str, Any] | KeyedJagged | jax.Array,
        weights: jax.Array | None = None,
        *,
        pooled: bool = True,
        with_counts: bool = False,
        **kw: Any,
    ) -> Any:
        """The layers' call: ``apply`` for a feature dict, ``apply_jagged`` for a
        ``KeyedJagged``, ``apply_stacked`` for stacked ids (``weights`` only with those);
        ``pooled=False``: ``lookup`` (a dict or a ``KeyedJagged``). ``kw``: ``oob``, ``impl``,
        ``dtype``, ``param_dtype`` (the parameters must have it: a layer's own dtype).
        ``with_counts``: ``(outputs, CallCounts)``, the call's device counters
        (capacity overflows per pack, out-of-range ids per table; zeros on a layout that does
        not ``counts_calls``)."""
        pinned = self._budget_layout(params, features, weights, pooled, kw)
        if pinned is not self:  # near the budget: the passes XLA's analysis chose
            return pinned.call(params, features, weights, pooled=pooled, with_counts=with_counts, **kw)
        if not with_counts:
            return self._call(params, features, weights, pooled=pooled, **kw)
        if not self.counts_calls:
            return self._call(params, features, weights, pooled=pooled, **kw), self._counts(())
        with call_counters() as entries:
            out = self._call(params, features, weights, pooled=pooled, **kw)
        return out, self._counts(entries)

    def _checked_plan(self, params, features, weights, pooled: bool, kw, sizes=None) -> MemoryPlan:
        """The estimate's plan for this call's shapes (``sizes``: ``_form_sizes``', when the
        caller has them), checked by XLA's analysis near the budget
        (``collection.xla_fit.check_by_xla``)."""
        sizes, batch = self._form_sizes(features, pooled) if sizes is None else sizes
        stats = self._stats(sizes, batch)
        plan = self._plan_for(tuple(sizes), batch)
        if self._user_planned or self.memory_budget is None:
            return plan
        if params is None:
            params = {k: jax.ShapeDtypeStruct(v, jnp.float32) for k, v in self.param_shapes().items()}
        most = max((n for p, n in zip(self.packs, sizes) if p.kind != "dense"), default=0)
        plan_at = lambda c: choose_memory_plan(self.packs, stats, self.memory_budget, candidate=c)  # noqa: E731
        return check_by_xla(plan, plan_at, self, params, (features, weights), most, pooled, kw)

    def _budget_layout(self, params, features, weights, pooled: bool, kw) -> CollectionLayout:
        """``self``, or a copy with the passes XLA's analysis chose where the estimate puts
        the call near its budget (``collection.xla_fit``)."""
        if self._user_planned or self.memory_budget is None or not self.counts_calls:
            return self
        try:
            sizes = self._form_sizes(features, pooled)
        except (IndexError, TypeError, ValueError, KeyError, AttributeError):
            return self  # malformed inputs: the call's own checks name the problem
        plan = self._checked_plan(params, features, weights, pooled, kw, sizes)
        return self if plan.xla_bytes is None else pinned_layout(self, plan.ids_per_pass, plan.windows)

    def _call(self, params, features, weights, *, pooled: bool, param_dtype: Any = None, **kw: Any):
        self.check_params(params, param_dtype)
        if isinstance(features, Mapping):
            self.check_feature_keys(features)
        if not pooled:
            if weights is not None or not isinstance(features, (Mapping, KeyedJagged)):
                raise ValueError("pooled=False takes a feature dict or a KeyedJagged (their own weights)")
            return self.lookup(params, features, **kw)
        if isinstance(features, KeyedJagged):
            if weights is not None:
                raise ValueError("weights is for stacked ids; a KeyedJagged carries its own weights")
            return self.apply_jagged(params, features, **kw)
        if isinstance(features, Mapping):
            if weights is not None:
                raise ValueError("weights is for stacked ids; a feature dict carries its own weights")
            return self.apply(params, features, **kw)
        return self.apply_stacked(params, features, weights, **kw)

    def check_feature_keys(self, features: Mapping[str, Any]) -> None:
        """``KeyError`` naming the keys of ``features`` that no table reads (a misspelt
        feature would otherwise be ignored)."""
        known = set(self.feature_names)
        unknown = [k for k in features if k not in known]
        if unknown:
            raise KeyError(
                f"unknown feature(s) {unknown}: no table reads them (features: {list(self.feature_names)})"
            )

    def table_of_feature(self, feature: str) -> TableConfig:
        """The table ``feature`` reads (``KeyError`` naming it and the known features)."""
        self.check_feature_keys({feature: None})
        return next(cfg for cfg in self.tables if feature in cfg.feature_keys)

    @functools.cached_property
    def pack_order(self) -> tuple[int, ...]:
        """The features' indices in ``feature_names`` in the packs' order (each pack's
        features consecutive)."""
        column = {f: i for i, f in enumerate(self.feature_names)}
        return tuple(column[s.feature] for pack in self.packs for s in pack.features)

    def _one_dim(self, what: str) -> None:
        dims = sorted({cfg.features for cfg in self.tables})
        if len(dims) > 1:
            raise ValueError(f"{what} gives one [B, F, D] output: every table needs one dim, got dims {dims}")

    @functools.cached_property
    def feature_names(self) -> tuple[str, ...]:
        """Every feature the tables read, in table order: the columns of a stacked input and
        the rows of a stacked output (``apply_stacked``)."""
        return tuple(f for cfg in self.tables for f in cfg.feature_keys)

    def apply_stacked(
        self,
        params: Mapping[str, jax.Array],
        ids: jax.Array,
        weights: jax.Array | None = None,
        *,
        oob: str = "zero",
        impl: str = "auto",
        dtype: Any | None = None,
    ) -> jax.Array:
        """``[B, F, D]`` pooled bags of a stacked batch, the values of ``apply``.

        ``ids``: int ``[B, F]`` (one id per example and feature, e.g. a Criteo batch) or
        ``[B, F, L]`` (padded bags of L ids), column f being feature ``feature_names[f]``;
        ``weights``: optional float of the same shape. Every table must have the same dim
        D. Each pack of TT shape group or dense tables takes its columns at once (one gather
        of the ids, no per-feature slices) and the output is the packs' bags concatenated,
        so the program has no per-feature split or stack (nor their transposes in the
        backward); a table of another core count is still pooled feature by feature.
        """
        ids, weights = self._check_stacked(ids, weights, oob)
        params = _cast_to_batch(params, (ids, weights))
        packs = self._call_packs(*self._form_sizes(ids, True))
        parts, order, pools = [], [], self._pool_inputs(packs, params)
        for b, cols in stacked_batches(packs, self.feature_names, ids, weights, oob):
            pooled = pool_batch(*pools[b.pack], b, impl, dtype)
            parts.append(pooled.reshape(len(cols), b.batch, pooled.shape[-1]))
            order += cols
        out = jnp.concatenate(parts) if len(parts) > 1 else parts[0]  # [F, B, D], packs' order
        if order != sorted(order):
            out = out.at[np.argsort(order)].get(unique_indices=True)
        return jnp.transpose(out, (1, 0, 2))

    def _check_stacked(self, ids, weights, oob: str) -> tuple[jax.Array, jax.Array | None]:
        """Stacked ids and weights as ``[B, F, L]`` after their checks (``validate.check_stacked``)."""
        return check_stacked(self.feature_names, [t.features for t in self.tables], ids, weights, oob)


def _cast_to_batch(params: Mapping[str, jax.Array], batch: Any) -> dict[str, jax.Array]:
    """``params`` typed varying over the mesh axes the batch's arrays vary over (inside a
    ``shard_map`` with ``check_vma``): one cast, so one gradient sum, per parameter however
    many calls read it (``flowtt_jax.kernels.ffi``); unchanged elsewhere."""
    arrays = [x for x in jax.tree.leaves(batch) if isinstance(x, jax.Array)]
    return ffi.to_varying(dict(params), ffi.varying_axes(arrays))


def labeller(labels: Mapping[str, str], default: str) -> Any:
    """``optax.multi_transform``'s ``param_labels`` callable: a parameter pytree (a collection's
    parameters, or a model's holding them, nnx state or linen dict) to each leaf's label: the
    label of the nearest key of its path that ``labels`` names, else ``default``."""

    def label(tree: Any) -> Any:
        def one(path, _leaf) -> str:
            for key in reversed(path):
                name = getattr(key, "key", getattr(key, "name", None))
                if isinstance(name, str) and name in labels:
                    return labels[name]
            return default

        return jax.tree_util.tree_map_with_path(one, tree)

    return label
