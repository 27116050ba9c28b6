"""Flax linen twins of ``flowtt_jax.nnx``: ``TTEmbed``, ``TTEmbedBag``, ``EmbedBag``,
``TTEmbeddingCollection``.

Same maths and the same parameter names (``core_0 .. core_{d-1}``, ``embedding`` for
dense tables), so a linen and an nnx layer given the same cores give the same output.
A ``TTEmbeddingCollection`` stores packed tables (``flowtt_jax.collection_layout``).

Initialisation draws all cores of a table from one key (the ``params`` rng of the
first core), so custom ``embedding_init``s that build the cores jointly (e.g. TT-SVD)
work. ``TTEmbed.params_from_dense(table, rank)`` gives a ``{"core_k": ...}`` dict
for ``module.apply({"params": ...}, ids)``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from flowtt_jax.collection.config import TableConfig, spec_of
from flowtt_jax.collection.layout import CollectionLayout, labeller
from flowtt_jax.inputs.jagged import KeyedJagged
from flowtt_jax.layer_methods import BagCall, DenseBagMethods, TTTableMethods
from flowtt_jax.tt.cores import CoreInit, check_cores, resolve_init
from flowtt_jax.tt.cores import from_dense as _tt_svd
from flowtt_jax.tt.spec import TTSpec

__all__ = ["TTEmbed", "TTEmbedBag", "EmbedBag", "TTEmbeddingCollection", "TableConfig"]


class _TTTable(TTTableMethods, nn.Module):
    num_embeddings: int
    features: int
    rank: int | tuple[int, ...] = 32
    dtype: Any | None = None
    param_dtype: Any = jnp.float32
    embedding_init: CoreInit | float | None = None
    row_shape: tuple[int, ...] | None = None
    col_shape: tuple[int, ...] | None = None
    num_cores: int = 3
    oob: str = "zero"
    impl: str = "auto"

    @property
    def spec(self) -> TTSpec:
        return spec_of(self)

    def _cores(self) -> tuple[jax.Array, ...]:
        spec = self.spec
        init = resolve_init(self.embedding_init)
        cache: dict[str, tuple] = {}

        def core_init(key, k):
            if "cores" not in cache:
                cache["cores"] = check_cores(init(key, spec, self.param_dtype), spec, self.param_dtype)
            return cache["cores"][k]

        return tuple(self.param(f"core_{k}", core_init, k) for k in range(spec.num_cores))

    def setup(self) -> None:
        self.cores = self._cores()

    # linen wraps only the methods a module class defines itself
    to_dense = TTTableMethods.to_dense
    attend = TTTableMethods.attend

    @classmethod
    def params_from_dense(
        cls,
        table: jax.Array,
        rank: int | tuple[int, ...] = 32,
        *,
        param_dtype: Any = jnp.float32,
        row_shape=None,
        col_shape=None,
        num_cores: int = 3,
        on_device: bool = False,
    ) -> dict[str, jax.Array]:
        """``{"core_k": ...}`` from the TT-SVD of a dense ``[N, D]`` table (on the host in
        float64, or on jax's default device with ``on_device``)."""
        n, d = jnp.shape(table)
        spec = TTSpec.create(n, d, rank, num_cores=num_cores, row_shape=row_shape, col_shape=col_shape)
        cores = _tt_svd(table, spec, param_dtype, on_device=on_device)
        return {f"core_{k}": c for k, c in enumerate(cores)}


class TTEmbed(_TTTable):
    """TT-compressed ``nn.Embed``: int ids of any shape -> ``[..., features]``.

    Fields as ``flowtt_jax.nnx.TTEmbed``'s constructor arguments.
    """

    def __call__(self, ids: jax.Array) -> jax.Array:
        return self._lookup(ids)


class TTEmbedBag(BagCall, _TTTable):
    """Pooled TT embedding bags; call as ``flowtt_jax.nnx.TTEmbedBag``."""

    mode: str = "sum"

    __call__ = BagCall.__call__  # linen wraps only the methods a module class defines itself


class EmbedBag(DenseBagMethods, nn.Module):
    """Bags over a plain dense ``[N, D]`` table (param ``embedding``)."""

    num_embeddings: int
    features: int
    mode: str = "sum"
    dtype: Any | None = None
    param_dtype: Any = jnp.float32
    embedding_init: Callable | float | None = None
    oob: str = "zero"

    def setup(self) -> None:
        init = self.embedding_init
        if init is None or isinstance(init, (int, float)):
            init = nn.initializers.normal(stddev=self.features**-0.5 if init is None else float(init))
        self.embedding = self.param("embedding", init, (self.num_embeddings, self.features), self.param_dtype)

    @property
    def _table(self) -> jax.Array:
        return self.embedding

    # linen wraps only the methods a module class defines itself
    __call__ = BagCall.__call__
    lookup = DenseBagMethods.lookup


class TTEmbeddingCollection(nn.Module):
    """Named TT / dense tables pooled in one call; see ``flowtt_jax.nnx.TTEmbeddingCollection``.

    Params: ``{name: array}`` with the names of ``CollectionLayout.param_names`` (packed
    cores of each TT shape group, packed dense tables), as in the nnx twin; all of them
    drawn from the first param's key. ``CollectionLayout(tables).table_params(params,
    name)`` reads one table's cores. ``memory_budget``, ``ids_per_pass`` and ``unique_windows`` as the nnx
    twin's; with ``mutable=["stats"]`` a call adds its per-table out-of-range ids to
    ``stats/out_of_range_counts`` (int32 [num_tables], ``tables`` order) and, where a table has
    a capacity, its per-pack capacity overflows to ``stats/overflow_counts`` (int32
    [num_packs], ``CollectionLayout.pack_labels`` order).
    """

    tables: Sequence[TableConfig]
    dtype: Any | None = None
    param_dtype: Any = jnp.float32
    oob: str = "zero"
    impl: str = "auto"
    ids_per_pass: int | None = None
    memory_budget: int | str | None = "auto"
    unique_windows: int | None = None

    def param_labels(self, default: str = "default") -> Any:
        """``optax.multi_transform``'s labeller of the parameters by their tables'
        ``TableConfig.optimizer`` (every other leaf ``default``), as the nnx twin's."""
        return labeller(CollectionLayout(tuple(self.tables)).param_labels(default), default)

    @nn.compact
    def __call__(
        self,
        features: Mapping[str, Any] | KeyedJagged | jax.Array,
        weights: jax.Array | None = None,
        *,
        pooled: bool = True,
    ) -> dict[str, jax.Array] | jax.Array:
        """A feature dict, a ``KeyedJagged``, or stacked ids (and ``weights``) as the nnx twin
        takes them; ``pooled=False`` for each id's row."""
        layout = CollectionLayout(
            tuple(self.tables),
            ids_per_pass=self.ids_per_pass,
            memory_budget=self.memory_budget,
            unique_windows=self.unique_windows,
        )
        cache: dict[str, dict] = {}

        def init(key, name):
            if "params" not in cache:
                cache["params"] = layout.init(key, self.param_dtype)
            return cache["params"][name]

        names = [n for p in range(len(layout.packs)) for n in layout.param_names(p)]
        hot = layout.hot_names()  # hot-row caches: the rows trained, their ids in "tt_cache"
        names += [c[0] for p in range(len(layout.packs)) if (c := layout.cache_names(p))]
        params = {n: self.param(n, init, n) for n in names}
        params.update(
            {n: self.variable("tt_cache", n, lambda n=n: init(self.make_rng("params"), n)).value for n in hot}
        )
        kw = dict(oob=self.oob, impl=self.impl, dtype=self.dtype, param_dtype=self.param_dtype)
        out, counts = layout.call(params, features, weights, pooled=pooled, with_counts=True, **kw)
        # counted when "stats" is mutable: made (zeros) by init, counted by calls. Per pack the
        # calls that overflowed their capacity (only where one exists: else nothing can
        # overflow); per table the ids out of its range
        if self.is_mutable_collection("stats"):
            oob = self.variable("stats", "out_of_range_counts", jnp.zeros, (len(layout.tables),), jnp.int32)
            capped = any(p.unique_capacity is not None for p in layout.packs)
            over = capped and self.variable(
                "stats", "overflow_counts", jnp.zeros, (len(layout.packs),), jnp.int32
            )
            if not self.is_initializing():
                oob.value = oob.value + counts.out_of_range
                if capped:
                    over.value = over.value + counts.overflow
        return out
