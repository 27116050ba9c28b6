"""Memory budgets and the bytes of one TT pooling call, in the static terms the policy
decides by (no collection types: the op and the collections share it; ``flowtt_jax.memory``
builds the collections' estimate and plan on it, ``docs/memory.md`` states the model).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax
import numpy as np

__all__ = [
    "AUTO_FRACTION",
    "CANDIDATES",
    "PASS_CHOICES",
    "CallBytes",
    "device_memory_bytes",
    "op_bytes",
    "pass_size",
    "resolve_budget",
    "static_count",
]

#: Bytes per id: an int32 or float32 per-id array (the weights, the bag ids); the forward's
#: prepared ids, tables and live flags; the plan (a one-table group's: no group arrays).
ID_BYTES, PREPARED_BYTES, PLAN_BYTES, SINGLE_PLAN_BYTES = 4, 12, 28, 20


#: ``memory_budget="auto"``: the share of the device's memory (its allocator's
#: ``bytes_limit``; on a CPU, the machine's physical memory) one embedding step may take
#: (parameters, their gradients, activations, kernel scratch): the rest is the model's
#: dense part, the optimizer state and XLA's own.
AUTO_FRACTION = 0.25
#: The passes over the ids the policy tries, fewest first (each is compiled as one scan).
PASS_CHOICES = (1, 2, 4, 8, 16, 32, 64)
#: The policy's candidates, fastest first: ``(passes over the ids, windows of the uniques)``.
#: Windows of one plan's unique rows make each row once (rows and row gradients of a window
#: at a time; windows past the batch's uniques return at once), so they come before passes
#: over the ids, which make a hot row again in every pass and sort every pass's ids.
CANDIDATES = ((1, 1), *((1, w) for w in PASS_CHOICES[1:]), *((p, 1) for p in PASS_CHOICES[1:]))


def static_count(value: Any, name: str, most: int | None = None) -> int | None:
    """``value`` as a static int in ``[1, most]`` (or None), else a ``ValueError`` naming
    ``name`` (floats, bools, strings and traced values included)."""
    if value is None:
        return None
    ok = isinstance(value, (int, np.integer)) and not isinstance(value, bool) and value >= 1
    if not ok or (most is not None and value > most):
        bound = f"an int in [1, {most}]" if most is not None else "an int >= 1"
        raise ValueError(f"{name} must be {bound} or None, got {value!r}")
    return int(value)


def pass_size(n: int, passes: int) -> int | None:
    """Ids per pass for ``n`` ids in ``passes`` passes: ``ceil(n / passes)`` rounded up to a
    multiple of 256 (fewer distinct programs); None for one pass."""
    if passes == 1:
        return None
    per_pass = -(-n // passes)
    return -(-per_pass // 256) * 256


def device_memory_bytes(device: Any = None) -> int:
    """The memory of ``device`` (default: jax's first local device): its allocator's
    ``bytes_limit`` where it reports one (GPUs), else the machine's physical memory."""
    device = jax.local_devices()[0] if device is None else device
    stats = device.memory_stats() or {}
    if stats.get("bytes_limit"):
        return int(stats["bytes_limit"])
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def resolve_budget(memory_budget: int | str | None) -> int | None:
    """Bytes of a ``memory_budget``: ``"auto"`` (``AUTO_FRACTION`` of
    ``device_memory_bytes()``), an int >= 1, or None (no budget: buffers by ids)."""
    if memory_budget is None:
        return None
    if isinstance(memory_budget, str):
        if memory_budget != "auto":
            raise ValueError(
                f"memory_budget must be 'auto', bytes (an int >= 1) or None, got {memory_budget!r}"
            )
        return int(AUTO_FRACTION * device_memory_bytes())
    if (
        isinstance(memory_budget, bool)
        or not isinstance(memory_budget, (int, np.integer))
        or memory_budget < 1
    ):
        raise ValueError(f"memory_budget must be 'auto', bytes (an int >= 1) or None, got {memory_budget!r}")
    return int(memory_budget)


@dataclasses.dataclass(frozen=True)
class CallBytes:
    kept: int  # what a training step holds into the backward: the per-id inputs and the plan
    own: int  # the pack's forward at its peak: its plan (and per-id inputs in passes) and rows
    out: int  # the pooled output (its gradient in the backward)
    rows: int  # a pass's rows, or their gradient


def op_bytes(
    n: int, bags: int, dim: int, one_table: bool, per_pass: int | None, capacity: int | None
) -> CallBytes:
    """A TT pooling call's buffers for ``n`` ids in ``bags`` bags of dim ``dim`` (a one-table
    group: no per-group plan arrays), its kernels taking ``per_pass`` ids at a time (None:
    all) and holding ``capacity`` unique rows (None: a pass's ids)."""
    out = 4 * bags * dim
    if n == 0:
        return CallBytes(0, 0, out, 0)
    inputs = (2 * ID_BYTES + PREPARED_BYTES) * n  # prepared ids, tables, live; weights, bag ids
    m = min(n, per_pass or n)  # the ids the kernels take at a time
    held = m if capacity is None or one_table else min(m, capacity)  # one table: not windowed
    rows = 4 * held * dim
    plan = (SINGLE_PLAN_BYTES if one_table else PLAN_BYTES) * m
    if m < n:  # passes: the per-id inputs live through the passes
        return CallBytes(inputs + plan, inputs + plan + rows, out, rows)
    return CallBytes(inputs + plan, plan + rows, out, rows)
