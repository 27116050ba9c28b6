"""Shared pieces of the Flax layers: table configs, feature inputs, dense pooling and the
layers' Flax-free methods (``TTTableMethods``, ``DenseBagMethods``, ``BagCall``).

``TableConfig`` describes one table of a ``TTEmbeddingCollection`` (``flowtt_jax.nnx``
or ``flowtt_jax.linen``): TT-compressed or plain dense (small tables, where a TT
saves nothing), its rank/shapes, pooling mode and the features that read it.

A feature's input (the value of ``features[name]`` in a collection call) is one of:

- an int array ``[B]``: one id per example (a bag of length 1, e.g. Criteo);
- an int array ``[B, L]``: padded bags, every slot used;
- a ``dict`` with key ``"ids"`` and optionally ``"offsets"`` (CSR [B+1]),
  ``"segment_ids"`` + ``"num_bags"``, ``"mask"`` ([B, L] bool), ``"weights"``
  (same shape as ids) -- the keyword arguments of ``tt_embedding_bag``.

Or every feature at once: a ``KeyedJagged`` (``flowtt_jax.inputs.jagged``; one flat ids array with
``lengths [F, B]`` or feature-major ``offsets [F*B + 1]``), or stacked ids ``[B, F(, L)]``.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from collections.abc import Mapping, Sequence
from typing import Any

from flowtt_jax.inputs.validate import MODES
from flowtt_jax.tt.spec import TTSpec

__all__ = [
    "SparseUpdate",
    "TableConfig",
    "make_table_configs",
    "check_tables",
]

KINDS = ("tt", "dense")


def spec_of(table: Any) -> TTSpec:
    """``TTSpec.create`` of ``table``'s fields ``num_embeddings``, ``features``, ``rank``,
    ``num_cores``, ``row_shape``, ``col_shape`` (a ``TableConfig``, a linen TT layer)."""
    return TTSpec.create(
        table.num_embeddings,
        table.features,
        table.rank,
        num_cores=table.num_cores,
        row_shape=table.row_shape,
        col_shape=table.col_shape,
    )


SPARSE_RULES = ("sgd", "adagrad", "rowwise_adagrad", "adam")


@dataclasses.dataclass(frozen=True)
class SparseUpdate:
    """A dense table updated on the rows a batch touched only (FBGEMM's fused row-wise
    optimizers, TorchRec's fused / sparse ones): ``flowtt_jax.sparse``.

    ``rule``: ``"sgd"``, ``"adagrad"`` (optax's ``adagrad`` with ``initial_accumulator_value=0``:
    an ``[N, D]`` accumulator), ``"rowwise_adagrad"`` (FBGEMM's default: one accumulator per
    row, the mean of its squared gradient) or ``"adam"`` (lazy: moments and step count per
    row, moved only when the row is touched); ``learning_rate``, ``eps``, ``b1``, ``b2``.
    """

    rule: str = "rowwise_adagrad"
    learning_rate: float = 0.01
    eps: float = 1e-7
    b1: float = 0.9
    b2: float = 0.999

    def __post_init__(self) -> None:
        if self.rule not in SPARSE_RULES:
            raise ValueError(f"SparseUpdate rule must be one of {SPARSE_RULES}, got {self.rule!r}")
        for field in ("learning_rate", "eps", "b1", "b2"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
                raise ValueError(f"SparseUpdate {field} must be a number >= 0, got {value!r}")


@dataclasses.dataclass(frozen=True)
class TableConfig:
    """One embedding table of a collection.

    Attributes:
      name: table name (the parameter / submodule name).
      num_embeddings: rows N.
      features: embedding dim D.
      kind: ``"tt"`` (TT-compressed cores) or ``"dense"`` (a plain ``[N, D]`` table).
      rank: TT rank (int or internal ranks), ignored for dense tables.
      mode: pooling ``"sum" | "mean" | "sqrtn"``.
      feature_names: features that look up this table (default: ``(name,)``);
        several features may share one table.
      row_shape, col_shape, num_cores: optional TT shapes (see ``TTSpec.create``).
      init_std: std of the (materialised) rows at init; default ``1/sqrt(D)``.
      max_unique_ids: the most unique ids one batch looks up in this table (all its
        features together; ``flowtt_jax.capacity.measure_unique_ids``): when every TT table
        of a shape group has one, the group's kernels hold their sum of unique rows at a
        time, not one per id (a batch past it runs exact extra passes, reported). None: one
        per id.
      optimizer: a label for per-table optimizer settings (``optax.multi_transform`` by
        ``param_labels()``); tables of different labels never share a packed array. None:
        the default label.
      sparse: a ``SparseUpdate`` for a dense table: its gradient comes as (touched rows, row
        gradients) and its update touches those rows only (``flowtt_jax.sparse``); it is then
        not an ``nnx.Param`` (optax optimizers leave it alone). None: a plain parameter.
      cache_rows: a TT table's hot-row cache (``collection.cache``): this many of its rows held
        as a trainable dense ``[cache_rows, D]`` block that its lookups read instead of the
        cores (its most frequent rows, from sample batches; the first ``cache_rows`` ids until
        then). 0: none.
    """

    name: str
    num_embeddings: int
    features: int
    kind: str = "tt"
    rank: int | tuple[int, ...] = 32
    mode: str = "sum"
    feature_names: tuple[str, ...] | None = None
    row_shape: tuple[int, ...] | None = None
    col_shape: tuple[int, ...] | None = None
    num_cores: int = 3
    init_std: float | None = None
    max_unique_ids: int | None = None
    optimizer: str | None = None
    sparse: SparseUpdate | None = None
    cache_rows: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.name, str):
            raise TypeError(f"TableConfig name must be a str, got {self.name!r}")
        where = f"table {self.name!r}"
        for field in ("num_embeddings", "features", "num_cores"):
            object.__setattr__(self, field, _as_int(getattr(self, field), f"{where}: {field}"))
        if self.kind not in KINDS:
            raise ValueError(f"{where}: kind must be one of {KINDS}, got {self.kind!r}")
        if self.mode not in MODES:
            raise ValueError(f"{where}: mode must be one of {MODES}, got {self.mode!r}")
        if self.num_embeddings < 1 or self.features < 1:
            raise ValueError(f"{where}: num_embeddings and features must be >= 1")
        if isinstance(self.rank, (tuple, list)):
            object.__setattr__(self, "rank", tuple(_as_int(r, f"{where}: rank") for r in self.rank))
        else:
            object.__setattr__(self, "rank", _as_int(self.rank, f"{where}: rank"))
        for field in ("row_shape", "col_shape"):
            value = getattr(self, field)
            if value is not None:
                if not isinstance(value, (tuple, list)):
                    raise TypeError(f"{where}: {field} must be a tuple of ints, got {value!r}")
                object.__setattr__(self, field, tuple(_as_int(v, f"{where}: {field}") for v in value))
        if self.feature_names is not None:
            if isinstance(self.feature_names, str) or not all(isinstance(f, str) for f in self.feature_names):
                raise TypeError(
                    f"{where}: feature_names must be a sequence of str, got {self.feature_names!r}"
                    + (
                        f" (one feature: ({self.feature_names!r},))"
                        if isinstance(self.feature_names, str)
                        else ""
                    )
                )
            object.__setattr__(self, "feature_names", tuple(self.feature_names))
        if self.max_unique_ids is not None:
            object.__setattr__(
                self, "max_unique_ids", _as_int(self.max_unique_ids, f"{where}: max_unique_ids")
            )
            if self.max_unique_ids < 1:
                raise ValueError(f"{where}: max_unique_ids must be >= 1, got {self.max_unique_ids}")
        if self.optimizer is not None and (not isinstance(self.optimizer, str) or not self.optimizer):
            raise TypeError(
                f"{where}: optimizer must be a non-empty str label or None, got {self.optimizer!r}"
            )
        if self.sparse is not None:
            if not isinstance(self.sparse, SparseUpdate):
                raise TypeError(f"{where}: sparse must be a SparseUpdate or None, got {self.sparse!r}")
            if self.kind != "dense":
                raise ValueError(
                    f"{where}: sparse updates are for dense tables (kind='dense'), got kind={self.kind!r}"
                )
        object.__setattr__(self, "cache_rows", _as_int(self.cache_rows, f"{where}: cache_rows"))
        if self.cache_rows:
            if self.kind != "tt":
                raise ValueError(f"{where}: cache_rows is for TT tables (a dense table holds every row)")
            if not 0 < self.cache_rows <= self.num_embeddings or self.num_embeddings >= 2**31 - 1:
                raise ValueError(
                    f"{where}: cache_rows must be in [0, num_embeddings={self.num_embeddings}] "
                    f"(and the table under 2^31 - 1 rows), got {self.cache_rows}"
                )
        if self.init_std is not None and not (isinstance(self.init_std, (int, float)) and self.init_std > 0):
            raise ValueError(f"{where}: init_std must be a positive number, got {self.init_std!r}")

    @property
    def feature_keys(self) -> tuple[str, ...]:
        return self.feature_names if self.feature_names else (self.name,)

    @property
    def std(self) -> float:
        return self.init_std if self.init_std is not None else 1.0 / math.sqrt(self.features)

    def spec(self) -> TTSpec:
        """The TT spec of a TT table."""
        return spec_of(self)

    @property
    def num_params(self) -> int:
        """Parameters actually stored (TT cores and hot-row cache, or the dense table)."""
        return (
            self.spec().num_params + self.cache_rows * self.features
            if self.kind == "tt"
            else self.dense_params
        )

    @property
    def dense_params(self) -> int:
        return self.num_embeddings * self.features


def _as_int(value: Any, what: str) -> int:
    """``value`` as an int (numpy ints too); ``TypeError`` naming ``what`` for a float, a str..."""
    if isinstance(value, bool):
        raise TypeError(f"{what} must be an int, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{what} must be an int, got {value!r}") from None


def make_table_configs(
    cardinalities: Mapping[str, int] | Sequence[int],
    features: int,
    *,
    rank: int = 32,
    dense_threshold: int = 0,
    mode: str = "sum",
    all_dense: bool = False,
    prefix: str = "t",
) -> list[TableConfig]:
    """Configs for many tables: TT for tables with ``>= dense_threshold`` rows, dense below.

    ``cardinalities`` is ``{name: rows}`` or a list (names ``f"{prefix}{i}"``).
    ``all_dense=True`` makes every table dense (the uncompressed baseline).
    """
    if not isinstance(cardinalities, Mapping):
        cardinalities = {f"{prefix}{i}": int(n) for i, n in enumerate(cardinalities)}
    return [
        TableConfig(
            name,
            int(n),
            features,
            kind="dense" if all_dense or n < dense_threshold else "tt",
            rank=rank,
            mode=mode,
        )
        for name, n in cardinalities.items()
    ]


def check_tables(tables: Sequence[TableConfig]) -> tuple[TableConfig, ...]:
    """The tables of a collection as a tuple; ``ValueError`` on a repeated table name or
    a feature read by more than one table."""
    tables = tuple(tables)
    names = [t.name for t in tables]
    if len(set(names)) != len(names):
        raise ValueError(f"duplicate table names in {names}")
    feats = [f for t in tables for f in t.feature_keys]
    if len(set(feats)) != len(feats):
        raise ValueError(f"a feature reads more than one table: {feats}")
    return tables
