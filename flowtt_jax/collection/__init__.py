"""Collections of embedding tables: ``TableConfig`` (``config``), the static packing of tables
into shape groups (``layout``), their parameters' initialisation (``init``) and pooling
(``pool``). The Flax layers over them are ``flowtt_jax.nnx`` / ``flowtt_jax.linen``."""

from flowtt_jax.collection.config import TableConfig, check_tables, make_table_configs
from flowtt_jax.inputs.validate import bag_kwargs
from flowtt_jax.ops.dense import dense_embedding_bag, dense_lookup

__all__ = [
    "TableConfig",
    "make_table_configs",
    "check_tables",
    "bag_kwargs",
    "dense_embedding_bag",
    "dense_lookup",
]
