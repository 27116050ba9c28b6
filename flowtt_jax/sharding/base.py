"""A collection's batch split over a mesh axis: per-shard bag inputs, the ``shard_map``
around a layout's per-device code, and ``ShardedLayout``, the base of the sharded layouts
(of ``sharding`` and ``sharding.tablewise``).

Every feature's input is split along its first dimension into ``S`` equal parts, ``S``
the size of the mesh axis; each device gets one. Padded forms (``[B]``, ``[B, L]`` ids,
``mask`` and ``weights`` ``[B, L]``) split as they are. A flat ids array with CSR
``offsets [B + 1]`` or ``segment_ids`` cannot: how many ids fall in each part depends on
the data, and shapes must not. Those features come *per shard*: ids ``[S, C]`` (shard s
holds the ids of bags ``[s*B/S, (s+1)*B/S)``, padded to a capacity ``C``) with

- ``offsets [S, B/S + 1]``: each shard's local CSR (``offsets[s, 0] = 0``; ids of shard s
  past ``offsets[s, -1]`` are padding, in no bag), or
- ``segment_ids [S, C]``: the local bag of each id (``[0, B/S)``; others are dropped), with
  ``num_bags = B``, the global bag count;

and optional ``weights [S, C]``. ``shard_bags`` makes that form from a global CSR on the
host. Each device then runs the single-device code on a local CSR (offsets rebased to
its own ids): no collective touches the ids.
"""

from __future__ import annotations

import abc
import dataclasses
import functools
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify
from jax.sharding import Mesh, PartitionSpec

from flowtt_jax.inputs.normalise import saturate_int32
from flowtt_jax.inputs.validate import as_ids, host_ids

__all__ = ["shard_bags", "local_features", "run_sharded", "ShardedLayout"]

_PER_SHARD_KEYS = ("ids", "offsets", "segment_ids", "weights")


def shard_bags(
    ids: np.ndarray,
    *,
    num_shards: int,
    offsets: np.ndarray | None = None,
    segment_ids: np.ndarray | None = None,
    num_bags: int | None = None,
    weights: np.ndarray | None = None,
    capacity: int | None = None,
) -> dict[str, np.ndarray]:
    """One feature's global bags -> the per-shard CSR input of a sharded collection (host, numpy).

    Args:
      ids: int ids [n], with CSR ``offsets [B + 1]`` or ``segment_ids [n]`` + ``num_bags``
        (ids outside ``[offsets[0], offsets[-1])`` or of a segment outside ``[0, B)`` are dropped).
      num_shards: S, the mesh axis size (in a multi-process run: this process's shards of
        its own batch); must divide B.
      weights: optional per-id weights [n].
      capacity: C, ids per shard (default: the largest shard's count, at least 1). Give a
        fixed value to keep shapes, and so compiled steps, the same from batch to batch
        (and across processes); ``ValueError`` if a shard has more ids.

    Returns:
      ``{"ids": [S, C], "offsets": [S, B/S + 1], "weights": [S, C]}`` (weights only when
      given); shard s's ids are ``ids[s, :offsets[s, -1]]``, the rest padding (id 0, weight 0).
    """
    ids = host_ids(ids)  # int64 past int32 without x64: saturated (out of range), not wrapped
    if ids.ndim != 1:
        raise ValueError(f"ids must be flat [n], got shape {ids.shape}")
    w = None if weights is None else np.asarray(weights)
    if w is not None and w.shape != ids.shape:
        raise ValueError(f"weights shape {w.shape} != ids shape {ids.shape}")
    if (offsets is None) == (segment_ids is None):
        raise ValueError("give exactly one of offsets or segment_ids")
    if segment_ids is not None:
        if num_bags is None:
            raise ValueError("segment_ids needs num_bags")
        seg = np.asarray(segment_ids)
        keep = np.flatnonzero((seg >= 0) & (seg < num_bags))
        order = keep[np.argsort(seg[keep], kind="stable")]
        ids, w = ids[order], None if w is None else w[order]
        offsets = np.searchsorted(seg[order], np.arange(num_bags + 1), side="left")
    offsets = np.asarray(offsets, np.int64)
    if offsets.ndim != 1 or offsets.size < 1 or np.any(np.diff(offsets) < 0):
        raise ValueError("offsets must be a non-decreasing [B + 1] array")
    if offsets[0] < 0 or offsets[-1] > ids.size:
        raise ValueError(f"offsets must lie in [0, {ids.size}], got [{offsets[0]}, {offsets[-1]}]")
    num = offsets.size - 1
    if not isinstance(num_shards, (int, np.integer)) or num_shards < 1:
        raise ValueError(f"num_shards must be an int >= 1, got {num_shards!r}")
    if num % num_shards:
        raise ValueError(f"{num} bags do not split into {num_shards} equal shards")
    per = num // num_shards
    starts = offsets[::per] if per else np.zeros(num_shards + 1, np.int64)
    counts = np.diff(starts)
    cap = max(1, int(counts.max(initial=0))) if capacity is None else int(capacity)
    if counts.max(initial=0) > cap:
        raise ValueError(f"a shard has {counts.max()} ids, more than capacity {cap}")
    out_ids = np.zeros((num_shards, cap), ids.dtype)
    out_w = None if w is None else np.zeros((num_shards, cap), w.dtype)
    local = np.empty((num_shards, per + 1), np.int32)
    for s in range(num_shards):
        lo, hi = starts[s], starts[s + 1]
        out_ids[s, : hi - lo] = ids[lo:hi]
        if out_w is not None:
            out_w[s, : hi - lo] = w[lo:hi]
        local[s] = offsets[s * per : (s + 1) * per + 1] - lo
    out = {"ids": out_ids, "offsets": local}
    if out_w is not None:
        out["weights"] = out_w
    return out


def _per_shard(value: Any) -> bool:
    return isinstance(value, Mapping) and (
        value.get("offsets") is not None or value.get("segment_ids") is not None
    )


def local_features(features: Mapping[str, Any], num_shards: int) -> dict[str, Any]:
    """One device's features, inside ``shard_map``: per-shard inputs (leading dim 1 here)
    become local CSR / segment inputs (``num_bags`` divided by ``num_shards``); the
    padded forms are already local."""
    out = {}
    for name, value in features.items():
        if not _per_shard(value):
            out[name] = value
            continue
        value = dict(value)
        if value["ids"].ndim != 2 or value["ids"].shape[0] != 1:
            raise ValueError(
                f"feature {name!r}: with offsets or segment_ids a sharded collection takes per-shard "
                f"ids [S, C] (S = {num_shards}, the mesh axis size; see flowtt_jax.sharding.shard_bags), "
                f"got {value['ids'].shape[0] * num_shards} rows in all"
            )
        for k in _PER_SHARD_KEYS:
            if value.get(k) is not None:
                value[k] = value[k][0]
        if value.get("segment_ids") is not None:
            if value.get("num_bags") is None or value["num_bags"] % num_shards:
                raise ValueError(
                    f"feature {name!r}: num_bags (the global B) must be a multiple of {num_shards}"
                )
            value["num_bags"] = value["num_bags"] // num_shards
        out[name] = value
    return out


def _split_static(features: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, int]]:
    """(arrays, static ``num_bags`` per feature): only arrays cross ``shard_map``."""
    arrays, static = {}, {}
    for name, value in features.items():
        if isinstance(value, Mapping):
            if value.get("num_bags") is not None:
                static[name] = int(value["num_bags"])
            value = {k: v for k, v in value.items() if k != "num_bags" and v is not None}
        arrays[name] = value
    return arrays, static


def _merge_static(arrays: Mapping[str, Any], static: Mapping[str, int]) -> dict[str, Any]:
    return {n: {**v, "num_bags": static[n]} if n in static else v for n, v in arrays.items()}


def per_device(mesh: Mesh, axis: str, fn: Callable, param_spec: Any, out_spec: PartitionSpec, params, *batch):
    """``fn(params, *batch)`` on every device: called as it is inside a ``shard_map`` over
    ``axis``, else in its own (``params`` split as ``param_spec``, every ``batch`` argument
    along dim 0 over ``axis``, the output as ``out_spec``)."""
    if axis in jax.sharding.get_abstract_mesh().manual_axes:
        return fn(params, *batch)
    in_specs = (param_spec,) + (PartitionSpec(axis),) * len(batch)
    # jitted: one program, not an eager compile per op (which crashed XLA's CPU compiler over
    # 4-8 virtual devices with jax 0.11.2: SIGSEGV in backend_compile_and_load of an FFI call)
    mapped = jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_spec, check_vma=False)
    return jax.jit(mapped)(params, *batch)


def run_sharded(
    mesh: Mesh,
    axis: str,
    param_specs: Mapping[str, PartitionSpec],
    local_fn: Callable[[Mapping[str, jax.Array], dict[str, Any]], dict[str, jax.Array]],
    params: Mapping[str, jax.Array],
    features: Mapping[str, Any],
) -> dict[str, jax.Array]:
    """``local_fn(local params, local features) -> {feature: [B/S, D]}`` on every device.

    Inside a ``shard_map`` over ``axis`` (e.g. a whole model's step) it is called directly;
    otherwise it runs in its own ``shard_map``: parameters split as ``param_specs``
    says, every feature array along dim 0, outputs ``{feature: [B, D]}`` split along dim 0.
    """
    num_shards = mesh.shape[axis]
    if axis in jax.sharding.get_abstract_mesh().manual_axes:
        return local_fn(params, local_features(features, num_shards))
    arrays, static = _split_static(features)
    for name, value in arrays.items():
        if _per_shard(value) and np.ndim(value["ids"]) == 2 and value["ids"].shape[0] != num_shards:
            raise ValueError(
                f"feature {name!r}: per-shard ids have {value['ids'].shape[0]} shards, the mesh axis "
                f"{axis!r} has {num_shards}"
            )

    def body(p, a):
        return local_fn(p, local_features(_merge_static(a, static), num_shards))

    specs = {k: param_specs[k] for k in params}
    mapped = jax.shard_map(
        body, mesh=mesh, in_specs=(specs, PartitionSpec(axis)), out_specs=PartitionSpec(axis), check_vma=False
    )
    return jax.jit(mapped)(dict(params), arrays)  # one program (per_device says why)


@dataclasses.dataclass(frozen=True)
class ShardedLayout(abc.ABC):
    """A ``CollectionLayout`` run per device over mesh axis ``axis``, as a mixin before it
    (``class L(ShardedLayout, CollectionLayout)``, fields ``tables, mesh, axis``): subclasses
    place the parameters (``param_specs``) and say what a device computes (``local_apply``)."""

    mesh: Mesh
    axis: str
    #: pooled inside a ``shard_map``: capacity overflows are not counted across it (yet)
    counts_calls = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.axis not in self.mesh.axis_names:
            raise ValueError(f"mesh axis {self.axis!r} is not an axis of the mesh {self.mesh.axis_names}")
        cached = [t.name for t in self.tables if t.cache_rows]
        if cached:
            raise ValueError(
                f"tables {cached} have hot-row caches (TableConfig.cache_rows), which run on one "
                "device for now: a sharded collection takes tables with cache_rows=0"
            )

    def check_params(self, params: Mapping[str, jax.Array], dtype: Any = None) -> None:
        """``ValueError`` unless ``params`` has exactly this layout's names (their shapes are
        per device inside a ``shard_map``, global outside) and, given ``dtype``, that dtype."""
        want = {n for p in range(len(self.packs)) for n in self.param_names(p)}
        if set(params) != want:
            raise ValueError(
                f"the parameters do not fit this collection's tables: missing {sorted(want - set(params))}, "
                f"not of this layout {sorted(set(params) - want)} (restore by table name: table_state / "
                "load_table_state)"
            )
        typed = sorted(n for n in want if dtype is not None and params[n].dtype != jnp.dtype(dtype))
        if typed:
            raise ValueError(
                f"the parameters {typed} do not have the collection's dtype {jnp.dtype(dtype)} "
                "(a state of another param_dtype?)"
            )

    @abc.abstractmethod
    def param_specs(self) -> dict[str, PartitionSpec]:
        """``PartitionSpec`` of every parameter."""

    @abc.abstractmethod
    def local_apply(
        self, params: Mapping[str, jax.Array], features: Mapping[str, Any], *, oob: str, impl: str, dtype: Any
    ) -> dict[str, jax.Array]:
        """One device's ``{feature: [B/S, D]}`` from its parameters and its slice of the batch."""

    def apply(
        self,
        params: Mapping[str, jax.Array],
        features: Mapping[str, Any],
        *,
        oob: str = "zero",
        impl: str = "auto",
        dtype: Any | None = None,
    ) -> dict[str, jax.Array]:
        """``{feature: [B, D]}`` from parameters placed as ``param_specs`` says and a batch split
        along dim 0 over ``axis``, split the same way; runs in its own ``shard_map`` unless
        called inside one over ``axis``."""
        ids = {k: v["ids"] if isinstance(v, Mapping) else v for k, v in features.items()}
        local = functools.partial(
            self.local_apply, oob="clip" if oob == "error" else oob, impl=impl, dtype=dtype
        )
        # oob="error": every id in range, so the devices' clip leaves them as they are
        return self._checked(
            oob, ids, lambda: run_sharded(self.mesh, self.axis, self.param_specs(), local, params, features)
        )

    def _checked(self, oob: str, ids: Mapping[str, Any], run: Any) -> Any:
        """``run()``, with ``oob="error"``'s check of ``ids`` (``{feature: ids}``): before it
        for concrete ids (a ``ValueError`` before any work), after it for traced ones (a
        ``checkify`` check; checkify cannot carry an error raised before a ``shard_map``
        over several devices into it)."""
        if oob != "error":
            return run()
        traced = any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(dict(ids)))
        if not traced:
            for name, value in ids.items():
                self._check_ids(name, value)
        out = run()
        if traced:
            for name, value in ids.items():
                self._check_ids(name, value)
        return out

    def _check_ids(self, feature: str, ids: Any) -> None:
        """``oob="error"`` of a sharded call, before its ``shard_map`` (inside one a
        ``checkify`` check cannot be functionalized): ``ValueError`` for concrete ids out of
        range of the feature's table, a ``checkify`` check for traced ones (``ftt.checked``).
        Per-shard inputs' padding ids are 0, in range."""
        cfg = self.table_of_feature(feature)
        ids = as_ids(ids if isinstance(ids, jax.Array) else np.asarray(ids), "error")
        ids32 = saturate_int32(ids)
        valid = (ids32 >= 0) & (ids32 < cfg.num_embeddings)
        where = f"feature {feature!r} (table {cfg.name!r}): ids out of range [0, {cfg.num_embeddings})"
        if isinstance(valid, jax.core.Tracer):
            # reductions, not an index: ids split over the mesh take no dynamic slice
            high = jnp.max(jnp.where(valid, np.iinfo(np.int32).min, ids32), initial=np.iinfo(np.int32).min)
            low = jnp.min(jnp.where(valid, np.iinfo(np.int32).max, ids32), initial=np.iinfo(np.int32).max)
            bad = jnp.where(high >= cfg.num_embeddings, high, low)
            checkify.check(jnp.all(valid), where + ": found {bad}", bad=bad)
        elif not np.all(valid):
            raise ValueError(f"{where}, e.g. {np.asarray(ids)[~np.asarray(valid)][:5].tolist()}")

    def apply_jagged(self, params: Mapping[str, jax.Array], batch: Any, **kw: Any) -> jax.Array:
        """Not for a sharded collection: a ``KeyedJagged``'s flat ids do not split by example
        over the mesh (give each device its own batch inside a ``shard_map`` over the
        unsharded collection, or call with a feature dict or stacked ids)."""
        raise NotImplementedError(
            f"a collection sharded over mesh axis {self.axis!r} takes a feature dict or stacked ids, "
            "not a KeyedJagged (its flat ids do not split by example over the mesh)"
        )

    def lookup(self, params: Mapping[str, jax.Array], features: Any, **kw: Any) -> Any:
        """Not for a sharded collection (unpooled rows are the unsharded collection's)."""
        raise NotImplementedError(
            f"a collection sharded over mesh axis {self.axis!r} has no unpooled lookup; call the "
            "unsharded collection's lookup"
        )

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
        """``CollectionLayout.apply_stacked``'s ``[B, F, D]`` from parameters placed as
        ``param_specs`` says and stacked ids (and weights) split along dim 0 over ``axis``,
        split the same way; in its own ``shard_map`` unless called inside one over ``axis``."""
        ids, weights = self._check_stacked(ids, weights, oob)
        local = functools.partial(
            self.local_apply_stacked, oob="clip" if oob == "error" else oob, impl=impl, dtype=dtype
        )
        specs = {k: self.param_specs()[k] for k in params}
        columns = {name: ids[:, f] for f, name in enumerate(self.feature_names)} if oob == "error" else {}
        return self._checked(
            oob,
            columns,
            lambda: per_device(
                self.mesh, self.axis, local, specs, PartitionSpec(self.axis), dict(params), ids, weights
            ),
        )

    def local_apply_stacked(
        self, params: Mapping[str, jax.Array], ids: jax.Array, weights: jax.Array | None, *, oob, impl, dtype
    ) -> jax.Array:
        """One device's ``[B/S, F, D]`` from its stacked ids ``[B/S, F, L]``: as a feature
        dict through ``local_apply`` (layouts that pool stacked ids directly override it)."""
        features = {
            f: {"ids": ids[:, i]} if weights is None else {"ids": ids[:, i], "weights": weights[:, i]}
            for i, f in enumerate(self.feature_names)
        }
        out = self.local_apply(params, features, oob=oob, impl=impl, dtype=dtype)
        # concatenated, not stacked: the dict call's [B, F*D] columns fold back to it
        flat = jnp.concatenate([out[f] for f in self.feature_names], axis=-1)
        return flat.reshape(ids.shape[0], len(self.feature_names), -1)
