"""Stage 1 of the input pipeline, **validate**: what a user passes, checked where it enters,
with errors that name the argument or the feature (``jax.numpy`` and numpy only; nothing here
changes a value but the host ids JAX would wrap).

- ids of any integer dtype (``as_ids``; host int64 past int32 without x64 saturated,
  ``host_ids``), real weights (``as_weights``), int32 sizes (``check_sizes``);
- a bag op's or a feature's form (``check_bag_form``: CSR ``offsets``, ``segment_ids`` +
  ``num_bags``, padded ``[B, L]`` with a ``mask``) as a ``BagForm``; concrete CSR offsets are
  checked here, traced ones ``checkify``-checked under ``oob="error"`` (else clamped by
  ``inputs.normalise``);
- a collection's inputs: a feature dict's values (``bag_kwargs``, ``feature_inputs``), an
  unpooled lookup's (``lookup_input``), stacked ids (``check_stacked``).

Then ``inputs.normalise`` (one flat CSR), ``inputs.oob`` (the policy), ``inputs.pack``
(the modes)."""

from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify

__all__ = [
    "MAX_NNZ",
    "MODES",
    "OOB_POLICIES",
    "BagForm",
    "as_ids",
    "as_weights",
    "bag_kwargs",
    "check_bag_form",
    "check_csr",
    "check_integer",
    "check_mode",
    "check_policy",
    "check_sizes",
    "check_stacked",
    "feature_inputs",
    "host_ids",
    "lookup_input",
]

OOB_POLICIES = ("error", "clip", "zero")
MODES = ("sum", "mean", "sqrtn")
_I32 = np.iinfo(np.int32)

#: The most ids (and bags) one call takes: the plan and the kernels index positions and
#: bags with int32, and the plan's [n + 1] offsets need n + 1 < 2^31.
MAX_NNZ = 2**31 - 2


def check_policy(policy: str) -> None:
    if policy not in OOB_POLICIES:
        raise ValueError(f"oob must be one of {OOB_POLICIES}, got {policy!r}")


def check_mode(mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")


def check_integer(dtype, name: str = "ids") -> None:
    if not jnp.issubdtype(dtype, jnp.integer):
        raise TypeError(f"{name} must be an integer array, got dtype {dtype}")


def as_ids(ids, policy: str, name: str = "ids") -> jax.Array:
    """``ids`` as a JAX integer array, without JAX's silent wrap-around of host ids.

    JAX arrays and tracers pass unchanged. Host ids whose values do not fit the dtype
    JAX would give them (int64 / uint64 past int32 / uint32 while ``jax_enable_x64`` is
    off) are out of range of every table: ``policy == "error"`` raises ``ValueError``
    naming them, else they are saturated to the int32 bounds (still out of range).
    ``name`` names the argument in errors.
    """
    check_policy(policy)
    if isinstance(ids, jax.Array):
        check_integer(ids.dtype, name)
        return ids
    return jnp.asarray(host_ids(ids, policy, name))


def host_ids(ids, policy: str = "zero", name: str = "ids") -> np.ndarray:
    """Host ids as numpy in a dtype JAX keeps as is: int64 / uint64 values past int32 while
    ``jax_enable_x64`` is off (which ``jnp.asarray`` or ``jax.device_put`` would wrap: 2^32 + 5
    to 5) saturated to the int32 bounds, so they stay out of range of every table
    (``policy == "error"``: ``ValueError`` naming them)."""
    host = np.asarray(ids)
    check_integer(host.dtype, name)
    if jax.dtypes.canonicalize_dtype(host.dtype).itemsize < host.dtype.itemsize:
        wide = (host < _I32.min) | (host > _I32.max)
        if np.any(wide):
            if policy == "error":
                bad = host[wide]
                raise ValueError(
                    f"{bad.size} value(s) of {name} do not fit in int32 (jax_enable_x64 is off), so "
                    f"they are out of range of any table, e.g. {bad[:5].tolist()}"
                )
            host = np.clip(host, _I32.min, _I32.max)
        host = host.astype(np.int32)
    return host


def as_weights(weights, what: str = "weights") -> jax.Array:
    """Per-id weights as a float array (float32 at least; float64 stays under x64). Integer
    weights are converted (documented policy); bool weights (a mask passed as weights?) and
    complex ones (the imaginary part would be dropped) raise ``TypeError`` naming ``what``."""
    w = weights if isinstance(weights, jax.Array) else jnp.asarray(np.asarray(weights))
    if w.dtype == jnp.bool_ or jnp.issubdtype(w.dtype, jnp.complexfloating):
        raise TypeError(
            f"{what} must be real numbers (float, or int converted to float), got dtype {w.dtype}"
            + (": pass a bool mask as mask=, not weights" if w.dtype == jnp.bool_ else "")
        )
    return w.astype(jnp.promote_types(w.dtype, jnp.float32))


def check_sizes(nnz: int, num_bags: int) -> None:
    """``ValueError`` unless ``nnz`` ids and ``num_bags`` bags fit the int32 indexing."""
    if nnz > MAX_NNZ or num_bags > MAX_NNZ:
        raise ValueError(
            f"{nnz} ids in {num_bags} bags: one call takes at most {MAX_NNZ} (2^31 - 2) of each, "
            "since the plan and the kernels index them with int32; split the batch"
        )


def check_csr(offsets: jax.Array, n: int, traced_check: bool, feature: str | None = None) -> None:
    """Concrete offsets: ``ValueError`` unless valid CSR over n ids. Traced: a
    ``checkify.check`` when ``traced_check``, else nothing (they are clamped,
    ``normalise.clamp_csr``). ``feature`` names the offsets' feature in the message."""
    message = "offsets must be non-decreasing with offsets[0] == 0 and offsets[-1] == len(ids) == "
    if feature is not None:
        message = f"feature {feature!r}: " + message
    if isinstance(offsets, jax.core.Tracer):
        if traced_check:
            steps = offsets[1:] >= offsets[:-1]
            checkify.check(
                (offsets[0] == 0) & (offsets[-1] == n) & jnp.all(steps),
                message + f"{n}; got first {{first}}, last {{last}}, first decrease after index {{at}}",
                first=offsets[0],
                last=offsets[-1],
                at=jnp.where(jnp.all(steps), -1, jnp.argmin(steps)) if steps.size else -1,
            )
        return
    o = np.asarray(offsets)
    if o[0] != 0 or o[-1] != n or np.any(np.diff(o) < 0):
        raise ValueError(message + f"{n}; got first {o[:1].tolist()}, last {o[-1:].tolist()}")


class BagForm(NamedTuple):
    """One bag op's or feature's checked input. ``form``: ``"csr"`` (``ids [n]``, ``offsets
    [B+1]`` integer, numpy or JAX), ``"segments"`` (``ids [n]``, ``segment_ids [n]`` integer,
    ``num_bags`` B), ``"padded"`` (``ids [B, L]``, optional bool ``mask [B, L]``); ``ids`` JAX
    integer (their dtype kept), ``weights`` float of the ids' shape or None; ``batch`` B."""

    form: str
    ids: jax.Array
    batch: int
    offsets: Any = None
    segment_ids: jax.Array | None = None
    mask: jax.Array | None = None
    weights: jax.Array | None = None


def check_bag_form(
    ids: Any,
    *,
    offsets: Any = None,
    segment_ids: Any = None,
    num_bags: Any = None,
    mask: Any = None,
    weights: Any = None,
    policy: str = "zero",
    check_offsets: bool = False,
    feature: str | None = None,
) -> BagForm:
    """The bag forms' checks (``ValueError`` / ``TypeError``; ``feature`` names the feature):
    CSR ``offsets`` (concrete: valid over the ids; traced: a ``checkify.check`` when
    ``check_offsets``), ``segment_ids`` with a static ``num_bags >= 0``, or padded ``[B, L]``
    ids with an optional ``mask``; weights of the ids' shape; int32 sizes."""
    what = "" if feature is None else f"feature {feature!r}: "
    if offsets is not None and segment_ids is not None:
        raise ValueError(what + "give either offsets or segment_ids, not both")
    ids = as_ids(ids, policy)
    w = None if weights is None else as_weights(weights, what + "weights")  # keeps float64 under x64
    if w is not None and w.shape != ids.shape:
        raise ValueError(what + f"weights shape {w.shape} != ids shape {ids.shape}")
    if offsets is not None or segment_ids is not None:
        if ids.ndim != 1:
            raise ValueError(what + f"with offsets / segment_ids, ids must be 1-D, got shape {ids.shape}")
        if mask is not None:
            raise ValueError(what + "mask is for padded [B, L] ids only")
    n = ids.size
    check_sizes(n, 0)
    if offsets is not None:
        if not isinstance(offsets, jax.Array):
            offsets = np.asarray(offsets)  # checked before jnp.asarray could wrap int64 values
        if offsets.ndim != 1 or offsets.shape[0] < 1:
            raise ValueError(what + f"offsets must be 1-D of length num_bags + 1, got {offsets.shape}")
        check_integer(offsets.dtype, what + "offsets")
        check_csr(offsets, n, check_offsets, feature)
        batch = offsets.shape[0] - 1
        bag = BagForm("csr", ids, batch, offsets=offsets, weights=w)
    elif segment_ids is not None:
        if num_bags is None:
            raise ValueError(what + "segment_ids needs num_bags (a static int)")
        try:
            num_bags = operator.index(num_bags)
        except TypeError:
            raise TypeError(what + f"num_bags must be a static int, got {num_bags!r}") from None
        if num_bags < 0:
            raise ValueError(what + f"num_bags must be >= 0, got {num_bags}")
        segment_ids = as_ids(segment_ids, "zero", "segment_ids")  # any int dtype, no wrap-around
        if segment_ids.shape != ids.shape:
            raise ValueError(what + f"segment_ids shape {segment_ids.shape} != ids shape {ids.shape}")
        bag = BagForm("segments", ids, num_bags, segment_ids=segment_ids, weights=w)
    else:
        if ids.ndim != 2:
            raise ValueError(
                what + f"without offsets or segment_ids, ids must be padded [B, L], got shape {ids.shape}"
            )
        if mask is not None:
            mask = jnp.asarray(mask)
            if mask.shape != ids.shape:
                raise ValueError(what + f"mask shape {mask.shape} != ids shape {ids.shape}")
        bag = BagForm("padded", ids, ids.shape[0], mask=mask, weights=w)
    check_sizes(n, bag.batch)
    return bag


def bag_kwargs(value: Any) -> tuple[jax.Array, dict]:
    """``(ids, kwargs)`` of a collection feature input, ``tt_embedding_bag``'s (the dict's
    form, parsed; ``ValueError`` for an unknown key).

    A 1-D array is one id per example (bags of one id: padded ``[B, 1]``).
    """
    if isinstance(value, Mapping):
        kw = dict(value)
        ids = _host_or_jax(kw.pop("ids"))
        unknown = set(kw) - {"offsets", "segment_ids", "num_bags", "mask", "weights"}
        if unknown:
            raise ValueError(f"unknown feature input keys {sorted(unknown)}")
        if ids.ndim == 1 and "offsets" not in kw and "segment_ids" not in kw:
            ids = ids[:, None]
            for k in ("mask", "weights"):
                if kw.get(k) is not None:
                    kw[k] = jnp.asarray(kw[k])[:, None]
        return ids, kw
    ids = _host_or_jax(value)
    if ids.ndim == 1:
        ids = ids[:, None]
    return ids, {}


def _host_or_jax(ids: Any) -> Any:
    """JAX arrays as they are, anything else as numpy: not ``jnp.asarray``, which would wrap
    host int64 ids past int32 (without x64) before ``as_ids`` can see them."""
    return ids if isinstance(ids, jax.Array) else np.asarray(ids)


def feature_inputs(
    features: Mapping[str, Any], names: Sequence[str], tables: Sequence[str], policy: str
) -> list[BagForm]:
    """The checked forms of features ``names`` (of tables ``tables``, named in errors) of a
    feature dict: ``KeyError`` for a missing one; their ids and bags together within int32."""
    forms = []
    for name, table in zip(names, tables):
        if name not in features:
            raise KeyError(f"missing input for feature {name!r} (table {table!r})")
        ids, kw = bag_kwargs(features[name])
        forms.append(check_bag_form(ids, **kw, policy=policy, check_offsets=policy == "error", feature=name))
    check_sizes(sum(f.ids.size for f in forms), sum(f.batch for f in forms))
    return forms


def lookup_input(value: Any, name: str, oob: str) -> tuple[jax.Array, jax.Array | None]:
    """``(ids, weights | None)`` of a feature of an unpooled lookup: ids of any shape, or
    ``{"ids": ..., "weights": ..., "offsets": ...}`` (weights of the ids' shape; CSR offsets
    are allowed and not needed: the rows come back in the ids' own layout)."""
    weights = None
    if isinstance(value, Mapping):
        unknown = set(value) - {"ids", "weights", "offsets"}
        if unknown or "ids" not in value:
            raise ValueError(
                f"feature {name!r}: an unpooled lookup takes ids, or a dict with 'ids' and optional "
                f"'weights' and 'offsets'; got keys {sorted(value)}"
            )
        weights = value.get("weights")
        value = value["ids"]
    ids = as_ids(value if isinstance(value, jax.Array) else np.asarray(value), oob)
    if weights is not None:
        weights = as_weights(weights, f"feature {name!r}: weights")
        if weights.shape != ids.shape:
            raise ValueError(f"feature {name!r}: weights shape {weights.shape} != ids shape {ids.shape}")
    return ids, weights


def check_stacked(
    feature_names: Sequence[str], dims: Sequence[int], ids: Any, weights: Any, oob: str
) -> tuple[jax.Array, jax.Array | None]:
    """Stacked ids (and weights) as ``[B, F, L]`` after their checks (``ValueError`` /
    ``TypeError`` naming the argument); ``dims``: each table's output dim (one for all)."""
    ids = as_ids(ids, oob)
    num = len(feature_names)
    if ids.ndim not in (2, 3) or ids.shape[1] != num:
        raise ValueError(
            f"stacked ids must be [B, F] or [B, F, L] with F = {num} features "
            f"(columns in feature_names order), got shape {ids.shape}"
        )
    dims = sorted(set(dims))
    if len(dims) > 1:
        raise ValueError(f"a stacked output needs one dim for every table, got dims {dims}")
    if weights is not None:
        weights = as_weights(weights, "stacked weights")
        if weights.shape != ids.shape:
            raise ValueError(f"weights shape {weights.shape} != ids shape {ids.shape}")
        weights = weights if weights.ndim == 3 else weights[..., None]
    return (ids if ids.ndim == 3 else ids[..., None]), weights
