"""flowtt_jax: Tensor-Train compressed embedding tables for JAX with fused FFI kernels.

``flowtt_jax.nnx`` and ``flowtt_jax.linen`` (Flax layers) and ``flowtt_jax.sharding``
load on first access, so the core ops need no Flax.
"""

import importlib

from flowtt_jax.capacity import measure_unique_ids
from flowtt_jax.checks import checked
from flowtt_jax.inputs.jagged import KeyedJagged
from flowtt_jax.kernels.ffi import disabled_safety_checks
from flowtt_jax.kernels.group_plan import GroupLayout
from flowtt_jax.kernels.plan import Plan, make_plan
from flowtt_jax.memory import BatchStats, MemoryEstimate, estimate_memory
from flowtt_jax.ops.embedding_bag import tt_embedding_bag, tt_embedding_bag_group, tt_lookup
from flowtt_jax.planner import TablePlan, plan_tables
from flowtt_jax.tt.cores import Cores, from_dense, init_cores, to_dense
from flowtt_jax.tt.spec import TTSpec

__all__ = [
    "BatchStats",
    "Cores",
    "GroupLayout",
    "KeyedJagged",
    "MemoryEstimate",
    "Plan",
    "TTSpec",
    "TablePlan",
    "checked",
    "disabled_safety_checks",
    "estimate_memory",
    "from_dense",
    "init_cores",
    "make_plan",
    "measure_unique_ids",
    "plan_tables",
    "to_dense",
    "tt_embedding_bag",
    "tt_embedding_bag_group",
    "tt_lookup",
]


def __getattr__(name: str):
    if name in ("nnx", "linen", "sharding"):
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
