"""The memory policy's check of its choice by XLA: where ``estimate_memory`` puts a call's
step near its budget, the candidates (the estimate's passes, then more) are compiled as
the training step XLA would run for this batch form (abstract shapes: no data, no run) and
the fewest whose memory analysis fits is taken.

Each checked step's bytes are kept (``STEP_BYTES``, by the layout, the parameters' and
inputs' shapes and dtypes, the call's options and the device kind): a second trace of the
same call (a train step and an eval step of one batch form, a retrace) compiles nothing.

The estimate models the op's buffers (``docs/memory.md``) and is within 15 % of XLA on the
common forms, but XLA's schedule of many packs, one-id features and the reference path can
differ from it by more; far below the budget (under ``VERIFY_SHARE`` of it) that does not
matter and nothing is compiled. Compiled bytes: arguments (the parameters and the batch),
temporaries and outputs (the parameters' gradients), plus the estimate's kernel scratch,
which the kernels allocate at run time where XLA's analysis does not see it.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from collections.abc import Hashable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from flowtt_jax.budget import CANDIDATES, pass_size

__all__ = ["VERIFY_SHARE", "check_by_xla", "pinned_layout"]

#: An estimate at or above this share of the budget is checked by XLA's analysis.
VERIFY_SHARE = 0.5
#: Checked steps' bytes by ``_signature`` (the most recent ``_KEPT``).
STEP_BYTES: collections.OrderedDict[Hashable, int] = collections.OrderedDict()
_KEPT = 64


def _is_array(x: Any) -> bool:
    return hasattr(x, "shape") and hasattr(x, "dtype")


def _abstract(tree: Any) -> tuple[list, Any, list]:
    """``(abstract arrays, treedef, leaves)`` of a call's inputs: every array leaf (jax,
    numpy, a tracer) as a ``ShapeDtypeStruct``; other leaves stay as they are (static)."""
    leaves, treedef = jax.tree.flatten(tree)
    arrays = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in leaves if _is_array(x)]
    return arrays, treedef, leaves


@functools.lru_cache(maxsize=32)
def pinned_layout(layout: Any, ids_per_pass: int | None, windows: int = 1) -> Any:
    """``layout`` with its passes and windows fixed (no budget: the candidate runs as given)."""
    return dataclasses.replace(
        layout, ids_per_pass=ids_per_pass, unique_windows=windows if windows > 1 else None, memory_budget=None
    )


def _pack_blocks(layout, out: Mapping[str, Any]) -> list:
    """A dict call's outputs as one ``[B, F*D]`` block per pack (its features' columns in
    its order, which fold back to the pack's pooled array), or one by one where a pack's
    features have other batch sizes or shapes (other forms)."""
    blocks = []
    for pack in layout.packs:
        named = [out[s.feature] for s in pack.features if s.feature in out]
        one_block = len({(np.shape(x)[0], x.dtype) for x in named}) == 1
        if one_block and all(np.ndim(x) == 2 for x in named):
            blocks.append(jnp.concatenate(named, -1))
        else:
            blocks += named
    return blocks


def _compiled_bytes(layout, params, inputs, pooled: bool, kw: Mapping[str, Any]) -> int:
    """Arguments + temporaries + outputs of the training step of ``layout.call`` on the
    abstract ``params`` and ``inputs`` (``(features, weights)``)."""
    arrays, treedef, leaves = _abstract(inputs)
    slots = [i for i, x in enumerate(leaves) if _is_array(x)]
    abstract_params = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in params.items()}

    def loss(p, arrays):
        full = list(leaves)
        for i, a in zip(slots, arrays):
            full[i] = a
        features, weights = jax.tree.unflatten(treedef, full)
        out = layout.call(p, features, weights, pooled=pooled, **kw)
        # a loss that needs the outputs in its backward, as a model's does (a sum would not);
        # a dict's outputs concatenated pack by pack: each pack's [B, F*D] columns fold back
        # to it (F reductions would each compile), and no copy a model might not make
        blocks = pooled and isinstance(out, Mapping)  # unpooled rows are split by rows, not columns
        parts = _pack_blocks(layout, out) if blocks else jax.tree.leaves(out)
        return sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in parts)

    compiled = jax.jit(jax.grad(loss)).lower(abstract_params, arrays).compile()
    m = compiled.memory_analysis()
    return int(m.argument_size_in_bytes + m.temp_size_in_bytes + m.output_size_in_bytes)


def _signature(layout, params, inputs, pooled: bool, kw: Mapping[str, Any]) -> Hashable | None:
    """What ``_compiled_bytes`` depends on, hashable: the layout, each parameter's and input
    leaf's shape and dtype (static leaves as they are), ``pooled``, ``kw`` and the device
    kind; None where something in it is not hashable (then nothing is kept)."""
    leaves, treedef = jax.tree.flatten(inputs)
    key = (
        layout,
        tuple(sorted((k, tuple(v.shape), str(v.dtype)) for k, v in params.items())),
        treedef,
        tuple((tuple(x.shape), str(x.dtype)) if _is_array(x) else ("static", x) for x in leaves),
        pooled,
        tuple(sorted(kw.items())),
        jax.devices()[0].device_kind,
    )
    try:
        hash(key)
    except TypeError:
        return None
    return key


def _step_bytes(layout, params, inputs, pooled: bool, kw: Mapping[str, Any]) -> int:
    """``_compiled_bytes``, compiled once per ``_signature``."""
    key = _signature(layout, params, inputs, pooled, kw)
    if key is None:
        return _compiled_bytes(layout, params, inputs, pooled, kw)
    if key not in STEP_BYTES:
        STEP_BYTES[key] = _compiled_bytes(layout, params, inputs, pooled, kw)
        while len(STEP_BYTES) > _KEPT:
            STEP_BYTES.popitem(last=False)
    STEP_BYTES.move_to_end(key)
    return STEP_BYTES[key]


def check_by_xla(plan: Any, plan_at, layout, params, inputs, most_ids: int, pooled: bool, kw) -> Any:
    """``plan`` (the estimate's choice for this call) checked by XLA's analysis where its
    estimate is at least ``VERIFY_SHARE`` of the budget: the fastest candidate
    (``memory.CANDIDATES``) whose compiled step (plus the estimate's kernel scratch) fits,
    looking at faster ones where the estimate's choice fits and leaner ones where it does
    not; the leanest if none does. ``plan_at(candidate)``: the estimate's plan of a
    candidate; ``most_ids``: the largest TT pack's ids (the passes' size)."""
    if plan.budget is None or plan.estimate.total < VERIFY_SHARE * plan.budget:
        return plan
    choices = [(p, w) for p, w in CANDIDATES if p == 1 or pass_size(most_ids, p) < most_ids]

    def check(candidate: tuple[int, int]) -> Any:
        estimate = plan_at(candidate)
        pinned = pinned_layout(layout, estimate.ids_per_pass, estimate.windows)
        xla = _step_bytes(pinned, params, inputs, pooled, kw) + estimate.estimate.scratch
        return dataclasses.replace(estimate, fits=xla <= plan.budget, xla_bytes=xla)

    # from the estimate's choice: faster ones while they fit, else leaner until one does
    k = choices.index(plan.candidate) if plan.candidate in choices else len(choices) - 1
    best = check(choices[k])
    step = -1 if best.fits else 1
    while 0 <= k + step < len(choices):
        k += step
        trial = check(choices[k])
        if step < 0 and not trial.fits:
            break
        best = trial
        if step > 0 and trial.fits:
            break
    return best
