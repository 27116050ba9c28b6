"""Methods shared by the nnx and linen layers (Flax-free). Linen wraps only the methods a
module class defines itself, so the linen layers bind the public ones in their class bodies."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from flowtt_jax.ops.dense import dense_embedding_bag, dense_lookup
from flowtt_jax.ops.embedding_bag import tt_embedding_bag, tt_lookup
from flowtt_jax.tt.cores import to_dense


class LayerMethods:
    """``out_dtype`` of a layer with ``dtype`` and ``param_dtype``."""

    @property
    def out_dtype(self) -> Any:
        """The output dtype: ``dtype``, else ``param_dtype``."""
        return self.dtype if self.dtype is not None else self.param_dtype


class BagCall(LayerMethods):
    """``__call__`` of the bag layers: ``tt_embedding_bag``'s bag arguments to ``self._pool``
    (``mode`` defaults to ``self.mode``)."""

    def __call__(
        self,
        ids: jax.Array,
        *,
        offsets: jax.Array | None = None,
        segment_ids: jax.Array | None = None,
        num_bags: int | None = None,
        mask: jax.Array | None = None,
        weights: jax.Array | None = None,
        mode: str | None = None,
    ) -> jax.Array:
        bags = dict(offsets=offsets, segment_ids=segment_ids, num_bags=num_bags, mask=mask, weights=weights)
        return self._pool(ids, mode or self.mode, **bags)


class TTTableMethods(LayerMethods):
    """Methods of the TT layers over ``self.cores`` (with ``num_embeddings``, ``oob``, ``impl``)."""

    def to_dense(self) -> jax.Array:
        """Materialised ``[num_embeddings, features]`` table (fp32 accumulation, ``dtype`` out).

        Costs ``N * D`` memory and about ``2 * N * D * r`` FLOPs: for export and tests.
        """
        c32 = tuple(c.astype(jnp.float32) for c in self.cores)
        return to_dense(c32, self.num_embeddings).astype(self.out_dtype)

    def attend(self, query: jax.Array) -> jax.Array:
        """``query @ table.T``: ``[..., features] -> [..., num_embeddings]``, like ``Embed.attend``.

        Materialises the full table with ``to_dense`` (``N * D`` floats and about
        ``2 N D r`` FLOPs per call, plus the ``[..., N]`` output): fine for vocabularies
        of language-model size, not for 10^7-row recommender tables.
        """
        table = self.to_dense().astype(jnp.float32)
        out = jnp.dot(jnp.asarray(query).astype(jnp.float32), table.T)
        return out.astype(self.out_dtype)

    def _lookup(self, ids: jax.Array) -> jax.Array:
        return tt_lookup(
            self.cores,
            ids,
            num_embeddings=self.num_embeddings,
            oob=self.oob,
            impl=self.impl,
            dtype=self.out_dtype,
        )

    def _pool(self, ids: jax.Array, mode: str, **bags: Any) -> jax.Array:
        return tt_embedding_bag(
            self.cores,
            ids,
            **bags,
            mode=mode,
            num_embeddings=self.num_embeddings,
            oob=self.oob,
            impl=self.impl,
            dtype=self.out_dtype,
        )


class DenseBagMethods(BagCall):
    """Methods of ``EmbedBag`` over its dense ``[N, D]`` table ``self._table`` (with ``oob``)."""

    def lookup(self, ids: jax.Array) -> jax.Array:
        """Unpooled rows ``[..., features]``."""
        return dense_lookup(self._table, ids, oob=self.oob).astype(self.out_dtype)

    def _pool(self, ids: jax.Array, mode: str, **bags: Any) -> jax.Array:
        return dense_embedding_bag(self._table, ids, **bags, mode=mode, oob=self.oob, dtype=self.out_dtype)
