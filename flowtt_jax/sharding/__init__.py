"""Many devices: data parallelism (the default) and table-wise model parallelism (design 5).

TT cores are megabytes, so the default is to replicate them and split the batch. Under
a plain ``jax.jit`` with a sharded batch the ops are correct but XLA does not partition
the FFI custom calls: every device would gather and run the whole batch. So the ops run
inside ``jax.shard_map``, each device on its own slice, and the replicated parameters'
gradients are summed over devices (an all-reduce, from ``shard_map``'s transpose).

- ``data_parallel(fn, mesh)``: a single-table op ``fn(cores, *batched)``.
- ``collection_data_parallel(layout, mesh)``: a collection (``CollectionLayout``) with
  replicated parameters; its ``apply(params, features)`` takes the batch split along dim
  0 (per-shard forms for CSR / segment inputs: ``shard_bags``, ``sharding_base``).
- ``collection_table_wise(layout, mesh, placement)`` with ``place_tables(table_costs(...))``:
  every TT table on one device, ids and pooled bags exchanged by ``all_to_all``
  (``sharding_tablewise``, placement by ``sharding_placement``); the same numbers.
- One shape group's packed batch (``tt_embedding_bag_group``, ``sharding_group``):
  ``shard_packed``, ``GroupDataParallel``, ``GroupTableWise``; programs whose size does
  not grow with the number of features (hundreds of tables).
- Flax NNX (``sharding_nnx``, loaded on first access): ``shard_collection`` switches a
  model's ``TTEmbeddingCollection`` to either strategy, ``make_train_step`` /
  ``sharded_value_and_grad`` / ``sharded_call`` run a whole model per device.

Multi-host: the same code after ``jax.distributed.initialize()``; the mesh spans every
process's devices and each process feeds its own part of the batch
(``sharding_nnx.shard_batch``). Collectives are JAX's own (NCCL on GPU).

The ops are right inside a user's own ``shard_map`` with jax's default ``check_vma=True``
(the FFI calls type their results like their operands, and the ops cast their cores and
weights to the batch's varying axes, so replicated cores' gradients are summed over
devices: ``flowtt_jax.ffi``). The ``shard_map``s here pass ``check_vma=False`` all the same:
they run the user's whole function (``make_train_step``, ``data_parallel``), which need
not be typed for varying axes (a ``scan`` carry started from ``jnp.zeros``), and every
replicated parameter's gradient is summed once at the boundary, not once per use
(``docs/sharding.md``).
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Mapping
from typing import Any

import jax
from jax.sharding import Mesh, PartitionSpec

from flowtt_jax.collection.layout import CollectionLayout
from flowtt_jax.sharding.base import ShardedLayout, local_features, shard_bags
from flowtt_jax.sharding.group import GroupDataParallel, GroupTableWise, shard_packed
from flowtt_jax.sharding.placement import (
    PER_ID_COST,
    TableCost,
    TableWisePlacement,
    group_costs,
    place_tables,
    table_cost,
    table_costs,
)
from flowtt_jax.sharding.tablewise import SplitGroup, TableWiseLayout

__all__ = [
    "data_parallel",
    "DataParallelLayout",
    "collection_data_parallel",
    "collection_table_wise",
    "TableWiseLayout",
    "TableWisePlacement",
    "TableCost",
    "PER_ID_COST",
    "place_tables",
    "table_cost",
    "table_costs",
    "group_costs",
    "shard_bags",
    "local_features",
    "shard_packed",
    "GroupDataParallel",
    "GroupTableWise",
    "SplitGroup",
]

#: Flax NNX helpers (``sharding_nnx``), loaded on first access so this module needs no Flax.
_NNX = (
    "shard_collection",
    "unshard_collection",
    "make_train_step",
    "sharded_value_and_grad",
    "sharded_call",
    "place_state",
    "shard_batch",
)


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
class DataParallelLayout(ShardedLayout):
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
    return DataParallelLayout(layout.tables, mesh, axis)


def collection_table_wise(
    layout: CollectionLayout, mesh: Mesh, placement: TableWisePlacement, axis: str = "data"
) -> TableWiseLayout:
    """``layout`` with its TT tables placed by ``placement`` over ``mesh`` axis ``axis``;
    parameters from ``TableWiseLayout.shard_params``, placed by ``param_specs``.

    Example::

        placement = place_tables(table_costs(layout, sample_features), mesh.shape["data"])
        tw = collection_table_wise(layout, mesh, placement)
        params = tw.shard_params(layout.init(key))
        out = jax.jit(tw.apply)(params, features)
    """
    return TableWiseLayout(layout.tables, mesh, axis, placement)


def __getattr__(name: str):
    if name in _NNX:
        return getattr(importlib.import_module(f"{__name__}.nnx"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
