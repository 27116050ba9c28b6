"""Packed jagged batches: every feature's bags in one flat ids array.

``KeyedJagged`` is the input form data pipelines produce (TorchRec's
``KeyedJaggedTensor``): one flat ``ids [n]``, per-bag ``lengths [F, B]`` or feature-major
``offsets [F*B + 1]`` (bag b of feature f is ``ids[offsets[f*B + b] : offsets[f*B + b + 1]]``),
optional per-id ``weights [n]``, features in the collection's ``feature_names`` order. A
``TTEmbeddingCollection`` takes it straight to the table-batched op, with no per-feature
op in the program.

``KeyedJagged.csr`` is the form's stage 1 (validate, ``inputs.validate``'s checks) and
gives the packed CSR the other stages take (``collection.batch``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify

from flowtt_jax.inputs.normalise import (
    PackedCSR,
    bag_of_positions,
    clamp_csr,
    concat_weights,
    offsets_of,
    saturate_int32,
)
from flowtt_jax.inputs.validate import as_ids, as_weights, check_csr, check_sizes

__all__ = ["KeyedJagged"]


@dataclasses.dataclass(frozen=True)
class KeyedJagged:
    """Every feature's bags in one flat array (a pytree; ``keys`` is static).

    Attributes:
      ids: int ``[n]`` (any integer dtype), feature-major: feature 0's bags, then feature 1's...
      lengths: int ``[F, B]``: ids in bag b of feature f. Give this or ``offsets``. They may
        sum to less than n: a batch padded to a static capacity, whose tail is in no bag.
      offsets: int ``[F*B + 1]``: feature-major CSR over ``ids`` (non-decreasing from 0 to n;
        concrete ones are checked, traced ones clamped as ``tt_embedding_bag``'s).
      weights: optional float ``[n]`` per-id weights (differentiable).
      keys: optional feature names, the order of the features in ``ids``: each of the
        collection's ``feature_names`` once, in any order (reordered on the device; without
        keys, ``feature_names`` order). Outputs come in ``feature_names`` order.
    """

    ids: Any
    lengths: Any = None
    offsets: Any = None
    weights: Any = None
    keys: tuple[str, ...] | None = None

    def __post_init__(self) -> None:  # no check of the arrays: pytree maps rebuild it with others
        if self.keys is not None:
            if isinstance(self.keys, str):
                raise TypeError(f"KeyedJagged keys must be a sequence of feature names, got {self.keys!r}")
            object.__setattr__(self, "keys", tuple(self.keys))

    def csr(self, feature_names: Sequence[str], oob: str) -> PackedCSR:
        """The batch as a ``PackedCSR`` over ``feature_names`` (``ValueError`` naming what
        does not match; concrete offsets checked, traced ones ``checkify``-checked under
        ``oob="error"``)."""
        num = len(feature_names)
        if (self.lengths is None) == (self.offsets is None):
            raise ValueError("KeyedJagged: give exactly one of lengths [F, B] and offsets [F*B + 1]")
        if self.keys is not None and self.keys != tuple(feature_names):
            missing = [f for f in feature_names if f not in self.keys]
            unknown = [k for k in self.keys if k not in feature_names]
            repeated = sorted({k for k in self.keys if self.keys.count(k) > 1})
            if missing or unknown or repeated:
                raise ValueError(
                    "KeyedJagged keys must name each of the collection's features once (any order)"
                    + (f"; missing {missing}" if missing else "")
                    + (f"; unknown {unknown}" if unknown else "")
                    + (f"; repeated {repeated}" if repeated else "")
                )
        ids = as_ids(self.ids, oob)
        if ids.ndim != 1:
            raise ValueError(f"KeyedJagged ids must be flat [n], got shape {ids.shape}")
        n = ids.shape[0]
        if self.lengths is not None:
            lengths = _int_array(self.lengths, "lengths")
            if lengths.ndim != 2 or lengths.shape[0] != num:
                raise ValueError(
                    f"KeyedJagged lengths must be [F, B] with F = {num} features, got {lengths.shape}"
                )
            batch = lengths.shape[1]
            if not isinstance(lengths, jax.core.Tracer):
                total = int(np.sum(np.asarray(lengths, np.int64)))
                if np.any(np.asarray(lengths) < 0) or total > n:
                    raise ValueError(
                        f"KeyedJagged lengths must be >= 0 and sum to at most len(ids) = {n}, got {total}"
                    )
            elif oob == "error":  # traced: checked on the device (ftt.checked raises it)
                wide = jnp.asarray(lengths).astype(jnp.int32)
                checkify.check(
                    jnp.all(wide >= 0) & (jnp.sum(jnp.maximum(wide, 0)) <= n),
                    f"KeyedJagged lengths must be >= 0 and sum to at most len(ids) = {n}: "
                    "found min {low}, sum {total}",
                    low=jnp.min(wide) if wide.size else 0,
                    total=jnp.sum(wide),
                )
            offsets = offsets_of(jnp.maximum(saturate_int32(jnp.asarray(lengths)).reshape(-1), 0))
        else:
            offsets = _int_array(self.offsets, "offsets")
            if offsets.ndim != 1 or (offsets.shape[0] - 1) % max(num, 1):
                want = f"[F*B + 1] with F = {num} features"
                raise ValueError(f"KeyedJagged offsets must be {want}, got shape {offsets.shape}")
            batch = (offsets.shape[0] - 1) // max(num, 1)
            check_csr(offsets, n, oob == "error")  # traced: clamped (or checkify-checked)
        weights = None
        if self.weights is not None:
            weights = as_weights(self.weights, "KeyedJagged weights")
            if weights.shape != (n,):
                raise ValueError(f"KeyedJagged weights shape {weights.shape} != ids shape {(n,)}")
        check_sizes(n, num * batch)
        return PackedCSR(ids, offsets, weights, batch)

    @classmethod
    def from_features(cls, features: Mapping[str, Any]) -> KeyedJagged:
        """A batch from per-feature inputs (TorchRec's ``KeyedJaggedTensor.from_lengths_sync``
        by name): ``{name: ids [B] (one id each) | padded [B, L] | {"ids": [n_f], "lengths":
        [B] or "offsets": [B + 1], optional "weights": [n_f]}}``, every feature of the same B;
        keys in the mapping's order. One concatenation per array kind."""
        if not features:
            raise ValueError("KeyedJagged.from_features needs at least one feature")
        ids, lengths, weights, batches = [], [], [], {}
        for name, value in features.items():
            v = value if isinstance(value, Mapping) else {"ids": value}
            unknown = set(v) - {"ids", "lengths", "offsets", "weights"}
            if unknown or "ids" not in v:
                raise ValueError(
                    f"feature {name!r}: takes ids, or a dict of ids with lengths or offsets "
                    f"(and weights); got keys {sorted(v)}"
                )
            x = v["ids"] if isinstance(v["ids"], jax.Array) else np.asarray(v["ids"])
            if v.get("lengths") is not None and v.get("offsets") is not None:
                raise ValueError(f"feature {name!r}: give lengths or offsets, not both")
            if v.get("lengths") is not None:
                n = jnp.asarray(v["lengths"])
            elif v.get("offsets") is not None:
                n = jnp.diff(jnp.asarray(v["offsets"]))
            elif x.ndim in (1, 2):  # one id per example, or padded [B, L]
                n = jnp.full((x.shape[0],), 1 if x.ndim == 1 else x.shape[1], jnp.int32)
            else:
                raise ValueError(
                    f"feature {name!r}: ids must be [B], [B, L] or flat with lengths, got {x.shape}"
                )
            batches[name] = n.shape[0]
            ids.append(jnp.asarray(x).reshape(-1))
            lengths.append(n.astype(jnp.int32))
            weights.append(None if v.get("weights") is None else jnp.asarray(v["weights"]).reshape(-1))
        if len(set(batches.values())) != 1:
            raise ValueError(
                f"KeyedJagged.from_features: every feature needs the same batch size, got {batches}"
            )
        w = None
        if any(x is not None for x in weights):
            w = concat_weights(weights, [int(i.shape[0]) for i in ids])
        return cls(jnp.concatenate(ids), lengths=jnp.stack(lengths), weights=w, keys=tuple(features))

    def to_padded(self, rows: jax.Array, max_len: int) -> dict[str, tuple[jax.Array, jax.Array]]:
        """Unpooled rows of this batch (``lookup``'s ``[n, D]``, in the order of its ids) as
        ``{key: (rows [B, max_len, D], mask [B, max_len] bool)}``: bag b's ids' rows in order,
        zeros and False past its length (ids past ``max_len`` are left out). Needs ``keys``."""
        if self.keys is None:
            raise ValueError("KeyedJagged.to_padded needs keys (the feature names)")
        max_len = int(max_len)
        num = len(self.keys)
        csr = self.csr(self.keys, "zero")
        n, batch = rows.shape[0], csr.batch
        offsets = clamp_csr(csr.offsets, n)
        bag = jnp.clip(bag_of_positions(offsets, n), 0, max(num * batch - 1, 0))
        pos = jax.lax.iota(jnp.int32, n)
        within = pos - offsets[bag]
        keep = (pos >= offsets[0]) & (pos < offsets[-1]) & (within < max_len)
        slot = jnp.where(keep, bag * max_len + within, num * batch * max_len)  # out of range: dropped
        size = num * batch * max_len
        out = jnp.zeros((size, rows.shape[-1]), rows.dtype).at[slot].set(rows, mode="drop")
        mask = jnp.zeros((size,), bool).at[slot].set(True, mode="drop")
        out = out.reshape(num, batch, max_len, rows.shape[-1])
        mask = mask.reshape(num, batch, max_len)
        return {k: (out[f], mask[f]) for f, k in enumerate(self.keys)}


jax.tree_util.register_dataclass(
    KeyedJagged, data_fields=["ids", "lengths", "offsets", "weights"], meta_fields=["keys"]
)


def _int_array(x: Any, name: str) -> Any:
    x = x if isinstance(x, jax.Array) else np.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise TypeError(f"KeyedJagged {name} must be an integer array, got dtype {x.dtype}")
    return x
