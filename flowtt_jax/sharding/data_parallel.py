"""Data parallelism: replicated parameters, the batch split over a mesh axis, one
``shard_map`` per call (a single-table op's ``data_parallel``, a collection's
``DataParallelLayout``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax
from jax.sharding import Mesh, PartitionSpec

from flowtt_jax.collection.layout import CollectionLayout
from flowtt_jax.sharding.base import ShardedLayout

__all__ = ["DataParallelLayout", "collection_data_parallel", "data_parallel"]


def data_parallel(fn: Callable[..., Any], mesh: Mesh, axis: str = "data") -> Callable[..., Any]:
    """Wraps ``fn(cores, *batched) -> out`` to run per device slice of the batch.

    ``cores`` (any pytree) is replicated; every leaf of each ``batched`` argument and of
    the output is split along dim 0 over mesh axis ``axis`` (its size must divide the
    batch). Inputs should already be placed that way (``NamedSharding(mesh, P(axis))``
    for the batch, ``P()`` for the cores), as ``shard_map`` asks on meshes with explicit
    axes. Gradients w.r.t. ``cores`` are summed over devices by XLA (an all-reduce).

    Example::

        bag = data_parallel(lambda c, ids, w: ftt.tt_embedding_bag(c, ids, weights=w,
                                                                     mode="mean"), mesh)
        out = jax.jit(bag)(cores, ids, weights)   # ids, weights [B, L] sharded over "data"
    """

    def wrapped(cores, *batched):
        in_specs = (PartitionSpec(),) + (PartitionSpec(axis),) * len(batched)
        mapped = jax.shard_map(
            fn, mesh=mesh, in_specs=in_specs, out_specs=PartitionSpec(axis), check_vma=False
        )
        return mapped(cores, *batched)

    return wrapped


@dataclasses.dataclass(frozen=True)
class DataParallelLayout(ShardedLayout, CollectionLayout):
    """A ``CollectionLayout`` run data parallel over mesh axis ``axis``: the same
    (replicated) parameters; ``apply`` takes the batch split along dim 0 and returns
    ``{feature: [B, D]}`` split the same way, each device pooling its own bags (one
    ``shard_map``, or directly when already inside one over ``axis``)."""

    axis: str = "data"

    def param_specs(self) -> dict[str, PartitionSpec]:
        """Every parameter replicated: ``P()``."""
        return {n: PartitionSpec() for p in range(len(self.packs)) for n in self.param_names(p)}

    def local_apply(
        self, params: Mapping[str, jax.Array], features: Mapping[str, Any], *, oob: str, impl: str, dtype: Any
    ) -> dict[str, jax.Array]:
        """``CollectionLayout.apply`` on this device's bags."""
        return CollectionLayout.apply(self, params, features, oob=oob, impl=impl, dtype=dtype)

    def local_apply_stacked(
        self, params: Mapping[str, jax.Array], ids: jax.Array, weights: jax.Array | None, *, oob, impl, dtype
    ) -> jax.Array:
        """``CollectionLayout.apply_stacked`` on this device's stacked ids."""
        return CollectionLayout.apply_stacked(self, params, ids, weights, oob=oob, impl=impl, dtype=dtype)


def collection_data_parallel(layout: CollectionLayout, mesh: Mesh, axis: str = "data") -> DataParallelLayout:
    """``layout`` run data parallel over ``mesh`` axis ``axis`` (same parameters).

    Example::

        dp = collection_data_parallel(layout, mesh)
        out = jax.jit(dp.apply)(params, features)  # params replicated, features split on dim 0
    """
    return DataParallelLayout(
        layout.tables,
        mesh,
        axis,
        ids_per_pass=layout.ids_per_pass,
        memory_budget=layout.memory_budget,
        unique_windows=layout.unique_windows,
    )
