"""Many devices: data parallelism (the default) and table-wise model parallelism (design 5).

TT cores are megabytes, so the default is to replicate them and split the batch. Under
a plain ``jax.jit`` with a sharded batch the ops are correct but XLA does not partition
the FFI custom calls: every device would gather and run the whole batch. So the ops run
inside ``jax.shard_map``, each device on its own slice, and the replicated parameters'
gradients are summed over devices (an all-reduce, from ``shard_map``'s transpose).

- ``data_parallel(fn, mesh)``: a single-table op ``fn(cores, *batched)``.
- ``collection_data_parallel(layout, mesh)``: a collection (``CollectionLayout``) with
  replicated parameters; its ``apply(params, features)`` takes the batch split along dim
  0 (per-shard forms for CSR / segment inputs: ``shard_bags``, ``sharding.base``).
- ``collection_table_wise(layout, mesh, placement)`` with ``place_tables(table_costs(...))``:
  every TT table on one device, ids and pooled bags exchanged by ``all_to_all``
  (``sharding.tablewise``, placement by ``sharding.placement``); the same numbers.
- One shape group's packed batch (``tt_embedding_bag_group``, ``sharding.group``):
  ``shard_packed``, ``GroupDataParallel``, ``GroupTableWise``; programs whose size does
  not grow with the number of features (hundreds of tables).
- Flax NNX (``sharding.nnx``, loaded on first access): ``shard_collection`` switches a
  model's ``TTEmbeddingCollection`` to either strategy, ``make_train_step`` /
  ``sharded_value_and_grad`` / ``sharded_call`` run a whole model per device.

Multi-host: the same code after ``jax.distributed.initialize()``; the mesh spans every
process's devices and each process feeds its own part of the batch
(``sharding.nnx.shard_batch``). Collectives are JAX's own (NCCL on GPU).

The ops are also right inside a user's own ``shard_map`` (``check_vma=True``): see
``flowtt_jax.kernels.ffi`` and ``docs/sharding.md``.
"""

from __future__ import annotations

import importlib

from flowtt_jax.sharding.base import local_features, shard_bags
from flowtt_jax.sharding.data_parallel import DataParallelLayout, collection_data_parallel, data_parallel
from flowtt_jax.sharding.group import GroupDataParallel, GroupTableWise, shard_packed
from flowtt_jax.sharding.placement import (
    PER_ID_COST,
    TableCost,
    TableWisePlacement,
    group_costs,
    place_tables,
    table_cost,
)
from flowtt_jax.sharding.split import SplitGroup
from flowtt_jax.sharding.tablewise import TableWiseLayout, collection_table_wise, table_costs

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

#: Flax NNX helpers (``sharding.nnx``), loaded on first access so this module needs no Flax.
_NNX = (
    "shard_collection",
    "unshard_collection",
    "make_train_step",
    "sharded_value_and_grad",
    "sharded_call",
    "place_state",
    "shard_batch",
)


def __getattr__(name: str):
    if name in _NNX:
        return getattr(importlib.import_module(f"{__name__}.nnx"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
