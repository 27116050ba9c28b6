"""flowtt_jax: Tensor-Train compressed embedding tables for JAX with fused FFI kernels."""

from .cores import Cores, from_dense, init_cores, to_dense
from .ops import tt_embedding_bag, tt_lookup
from .plan import Plan, make_plan
from .spec import TTSpec

__all__ = [
    "Cores",
    "Plan",
    "TTSpec",
    "from_dense",
    "init_cores",
    "make_plan",
    "to_dense",
    "tt_embedding_bag",
    "tt_lookup",
]
