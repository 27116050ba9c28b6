"""Flax NNX models with a ``TTEmbeddingCollection`` on many devices (``flowtt_jax.sharding``).

A step runs the *whole* model per device inside one ``shard_map`` (data parallel: every
device its slice of the batch, replicated weights), and the collection inside runs its
own strategy there: data parallel (pool the local bags) or table-wise (``all_to_all``
to the tables' owners and back). Parameters carry their ``PartitionSpec`` as nnx
``out_sharding`` metadata (table-wise cores ``P(axis)``, all else replicated), which the
optimizer state inherits, so ``place_state`` and the step's ``shard_map`` read it.

Usage::

    mesh = jax.make_mesh((jax.device_count(),), ("data",))
    model = DLRM(...)
    shard_collection(model.embeddings, mesh)                       # data parallel, or:
    costs = table_costs(model.embeddings.layout, sample)            # a sample batch, host
    shard_collection(model.embeddings, mesh, placement=place_tables(costs, mesh.shape["data"]))
    optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
    graphdef, state = nnx.split((model, optimizer))
    state = place_state(state, mesh)
    step = make_train_step(graphdef, loss_fn, mesh)                # loss_fn(model, *batch) -> mean
    state, loss = step(state, *shard_batch(batch, mesh))
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from flowtt_jax.collection.layout import CollectionLayout
from flowtt_jax.nnx import TTEmbeddingCollection
from flowtt_jax.sharding.data_parallel import DataParallelLayout
from flowtt_jax.sharding.placement import TableWisePlacement
from flowtt_jax.sharding.tablewise import TableWiseLayout

__all__ = [
    "shard_collection",
    "unshard_collection",
    "place_state",
    "shard_batch",
    "sharded_call",
    "sharded_value_and_grad",
    "make_train_step",
]


def shard_collection(
    collection: TTEmbeddingCollection,
    mesh: Mesh,
    *,
    axis: str = "data",
    placement: TableWisePlacement | None = None,
) -> None:
    """Switches ``collection`` (in place) to data parallel (``placement=None``) or to
    table-wise placement over ``mesh`` axis ``axis``, its parameters placed on ``mesh``.

    Create the optimizer after this (table-wise parameters change shape). Every process
    of a multi-host run calls it with the same values. ``unshard_collection`` reverts.
    """
    if isinstance(collection.layout, (DataParallelLayout, TableWiseLayout)):
        raise ValueError("the collection is already sharded: unshard_collection first")
    tables, per_pass = collection.layout.tables, collection.layout.ids_per_pass
    budget, windows = collection.layout.memory_budget, collection.layout.unique_windows
    values = {k: p[...] for k, p in collection.params.items()}
    if placement is None:
        layout = DataParallelLayout(
            tables, mesh, axis, ids_per_pass=per_pass, memory_budget=budget, unique_windows=windows
        )
    else:
        layout = TableWiseLayout(
            tables, mesh, axis, placement, ids_per_pass=per_pass, memory_budget=budget, unique_windows=windows
        )
        values = jax.jit(layout.shard_params)(values)  # one program, whatever the table count
    specs = layout.param_specs()
    for name, value in values.items():
        spec = specs[name]
        placed = jax.device_put(value, NamedSharding(mesh, spec))
        meta = (
            {"out_sharding": tuple(spec) + (None,) * (value.ndim - len(spec)), "mesh": mesh} if spec else {}
        )
        collection.params[name] = nnx.Param(placed, **meta)
    collection.layout = layout


def unshard_collection(collection: TTEmbeddingCollection) -> None:
    """Back to an unsharded ``CollectionLayout`` with the usual packed parameters
    (replicated over the mesh: for export, checkpoints or a single-device evaluation)."""
    layout = collection.layout
    if not isinstance(layout, (DataParallelLayout, TableWiseLayout)):
        return
    values = {k: p[...] for k, p in collection.params.items()}
    if isinstance(layout, TableWiseLayout):
        replicated = NamedSharding(layout.mesh, PartitionSpec())
        values = jax.jit(layout.gather_params, out_shardings=replicated)(values)
    for name, value in values.items():
        collection.params[name] = nnx.Param(value)
    collection.layout = CollectionLayout(
        layout.tables,
        ids_per_pass=layout.ids_per_pass,
        memory_budget=layout.memory_budget,
        unique_windows=layout.unique_windows,
    )


def _specs(state: nnx.State) -> Any:
    """The ``PartitionSpec`` tree of a state (nnx ``out_sharding`` metadata, else ``P()``)."""
    return nnx.get_partition_spec(state)


def place_state(state: nnx.State, mesh: Mesh) -> nnx.State:
    """``state`` (e.g. ``nnx.state((model, optimizer))``) placed on ``mesh`` as its
    metadata says: table-wise cores and their optimizer moments split, all else replicated.
    Process-local values must be the same in every process (same seeds)."""

    def put(spec: PartitionSpec | None, x: Any) -> Any:
        # None: a leafless node (an optax.multi_transform state's MaskedNode): nothing to place
        return x if spec is None else jax.device_put(x, NamedSharding(mesh, spec))

    return jax.tree.map(
        put, _specs(state), state, is_leaf=lambda s: s is None or isinstance(s, PartitionSpec)
    )


def shard_batch(batch: Any, mesh: Mesh, axis: str = "data") -> Any:
    """Global arrays split along dim 0 over ``axis`` from each process's own part of the
    batch (numpy or local arrays; in one process: the whole batch). Every leaf's dim 0
    is its part: bags, examples, or shards of the per-shard bag forms."""
    sharding = NamedSharding(mesh, PartitionSpec(axis))
    return jax.tree.map(lambda x: jax.make_array_from_process_local_data(sharding, np.asarray(x)), batch)


def sharded_call(fn: Callable[..., Any], mesh: Mesh, axis: str = "data") -> Callable[..., Any]:
    """``fn(model, *batch)`` run per device inside ``shard_map`` (e.g. a prediction):
    ``model``'s state as its metadata says, every ``batch`` leaf and every output leaf
    split along dim 0 over ``axis``. The model is not updated."""

    def call(model, *batch):
        graphdef, state = nnx.split(model)

        def local(state, *batch):
            return fn(nnx.merge(graphdef, state), *batch)

        in_specs = (_specs(state),) + (PartitionSpec(axis),) * len(batch)
        mapped = jax.shard_map(
            local, mesh=mesh, in_specs=in_specs, out_specs=PartitionSpec(axis), check_vma=False
        )
        return mapped(state, *batch)

    return call


def sharded_value_and_grad(
    loss_fn: Callable[..., jax.Array], mesh: Mesh, axis: str = "data", wrt: Any = nnx.Param
) -> Callable[..., tuple[jax.Array, nnx.State]]:
    """``(model, *batch) -> (loss, grads)`` with ``loss_fn(model, *batch)`` (a scalar mean
    over the batch it gets) run per device on its slice: ``loss`` is the mean over devices
    (the global mean: slices are equal), ``grads`` (an ``nnx.State`` of ``wrt``, like
    ``nnx.value_and_grad``'s) the gradient of it -- replicated weights' summed over
    devices by ``shard_map``'s transpose, table-wise cores' local."""

    def value_and_grad(model, *batch):
        graphdef, params, rest = nnx.split(model, wrt, ...)

        def global_loss(params):
            def local(params, rest, *batch):
                return jnp.reshape(loss_fn(nnx.merge(graphdef, params, rest), *batch), (1,))

            in_specs = (_specs(params), _specs(rest)) + (PartitionSpec(axis),) * len(batch)
            mapped = jax.shard_map(
                local, mesh=mesh, in_specs=in_specs, out_specs=PartitionSpec(axis), check_vma=False
            )
            return jnp.mean(mapped(params, rest, *batch))

        return jax.value_and_grad(global_loss)(params)

    return value_and_grad


def make_train_step(
    graphdef: nnx.GraphDef,
    loss_fn: Callable[..., jax.Array],
    mesh: Mesh,
    axis: str = "data",
    *,
    wrt: Any = nnx.Param,
    donate: bool = True,
) -> Callable[..., tuple[nnx.State, jax.Array]]:
    """A jitted ``step(state, *batch) -> (state, loss)`` for ``graphdef, state =
    nnx.split((model, optimizer))`` (``optimizer``: an ``nnx.Optimizer`` over ``wrt``):
    ``sharded_value_and_grad`` then ``optimizer.update`` (outside the ``shard_map``, so
    optimizers with global statistics see every shard). ``state`` from ``place_state``,
    batch from ``shard_batch``; ``state`` is donated unless ``donate=False``."""
    value_and_grad = sharded_value_and_grad(loss_fn, mesh, axis, wrt)

    @functools.partial(jax.jit, donate_argnums=(0,) if donate else ())
    def step(state, *batch):
        model, optimizer = nnx.merge(graphdef, state)
        loss, grads = value_and_grad(model, *batch)
        optimizer.update(model, grads)
        return nnx.state((model, optimizer)), loss

    return step
