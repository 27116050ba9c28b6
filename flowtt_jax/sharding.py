"""Data parallelism: replicated cores, batch split over a mesh axis (design section 5).

TT cores are megabytes, so the default for many devices is to replicate them and
split the batch. Under a plain ``jax.jit`` with a sharded batch the ops are correct
but XLA does not partition the FFI custom calls: every device gathers and runs the
whole batch. ``data_parallel`` runs each device's slice through the op instead, and
XLA all-reduces the core gradients.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import Mesh, PartitionSpec

__all__ = ["data_parallel"]


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
        # check_vma=False: FFI call results carry no varying-manual-axes type, so
        # shard_map's type check would reject them; the replicated cores' cotangent
        # is still psum-ed over `axis` by shard_map's transpose.
        mapped = jax.shard_map(
            fn, mesh=mesh, in_specs=in_specs, out_specs=PartitionSpec(axis), check_vma=False
        )
        return mapped(cores, *batched)

    return wrapped
