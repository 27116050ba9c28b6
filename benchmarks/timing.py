"""How the benchmarks measure: compile, XLA memory analysis, device time, device memory.

Device time (``timed``): on a GPU, ``device_profile`` -- a ``jax.profiler`` trace of
``iters`` calls queued back to back after warm-up, parsed with
``jax.profiler.ProfileData``; the time per call is the union of the GPU kernel and memcpy
intervals of all streams divided by ``iters`` (busy time: no host dispatch, no idle gaps);
``device_profiles``, the same per GPU with the share of it in collectives (NCCL kernels).
Elsewhere (CPU), ``queued_ms`` -- K calls queued then one ``block_until_ready``; the median
over R repeats of wall / K (includes host dispatch). ``iters`` and K adapt to the time of a
call so one measurement takes about ``target_s``.

Memory: ``memory_analysis`` of the compiled executable (arguments, outputs, temporaries;
the FFI handlers' scratch is allocated at run time and is not in it), and the device's
``memory_stats`` (bytes in use, the process's peak so far) where the backend has them.
"""

from __future__ import annotations

import glob
import os
import re
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax

__all__ = [
    "CompileTimeout",
    "compile_timed",
    "memory_analysis",
    "device_free_bytes",
    "memory_stats",
    "timed",
    "blocking_ms",
    "device_profile",
    "device_profiles",
    "queued_ms",
    "queued_times",
    "peaks",
    "method",
]

# Nominal peaks by device kind: fp32 FLOP/s without tensor cores, HBM bytes/s (datasheets).
_PEAKS = {"H200": (67e12, 4.8e12), "H100": (67e12, 3.35e12), "A100": (19.5e12, 2.0e12)}

# Where device time goes: the first pattern that matches a kernel name wins.
CATEGORIES = (
    ("rows backward (dG1/dG2/dG3)", r"rows_bwd|dg[123]_|tb_pcache"),
    ("radix sort (plan; + i3 bucketing in the backward)", r"RadixSort|tb_radix|tb_bounds|tb_ug_"),
    ("plan scan + finalize", r"DeviceScan|finalize_kernel|finish_kernel|clamp_kernel|bitmap_"),
    ("rows forward (prefix map + GEMM tile kernel)", r"rows_fwd|build_map|tb_fwd"),
    ("pooling fwd/bwd", r"pool_"),
    ("memset / memcpy", r"Memset|Memcpy|memcpy"),
)


def method() -> str:
    """``"profiler"`` on a GPU backend, else ``"queued"`` (wall clock)."""
    return "profiler" if jax.default_backend() == "gpu" else "queued"


def peaks() -> dict | None:
    """``{"fp32_flops", "hbm_bytes_per_s"}`` of the default device, or None when unknown."""
    kind = jax.devices()[0].device_kind
    for key, (flops, bw) in _PEAKS.items():
        if key in kind:
            return {"fp32_flops": flops, "hbm_bytes_per_s": bw, "source": f"{key} datasheet"}
    return None


class CompileTimeout(Exception):
    """A compile did not finish in time; it goes on in a daemon thread."""


def compile_timed(fn: Callable, args: tuple, timeout: float | None = None) -> tuple[Any, float, float]:
    """``jax.jit(fn).lower(*args).compile()``: (executable, lower seconds, compile seconds).

    Runs in a daemon thread (XLA releases the GIL while compiling) so that the caller can
    give up after ``timeout`` seconds (``CompileTimeout``) and still take SIGTERM.
    """
    result: dict[str, Any] = {}

    def work() -> None:
        try:
            t0 = time.perf_counter()
            lowered = jax.jit(fn).lower(*args)
            t1 = time.perf_counter()
            result["out"] = (lowered.compile(), t1 - t0, time.perf_counter() - t1)
        except BaseException as e:  # noqa: BLE001  (re-raised in the caller's thread)
            result["error"] = e

    thread = threading.Thread(target=work, daemon=True, name="compile")
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        raise CompileTimeout(f"compile did not finish in {timeout:.0f} s")
    if "error" in result:
        raise result["error"]
    return result["out"]


def memory_analysis(compiled) -> dict:
    """The executable's ``*_in_bytes`` figures (host ones only when non-zero) and
    ``peak_bytes`` = arguments + outputs + temporaries - aliased, an upper bound (XLA's own
    ``peak_memory``, where present, leaves temporaries out on CPU); FFI run-time scratch is
    not in either."""
    ma = compiled.memory_analysis()
    if ma is None:
        return {}
    out = {
        name[: -len("_in_bytes")]: int(v)
        for name in dir(ma)
        if name.endswith("_in_bytes")
        and isinstance(v := getattr(ma, name), int)
        and (v or not name.startswith("host_"))
    }
    out["peak_bytes"] = (
        out.get("argument_size", 0)
        + out.get("output_size", 0)
        + out.get("temp_size", 0)
        - out.get("alias_size", 0)
    )
    return out


def memory_stats(device: jax.Device | None = None) -> dict | None:
    """``device``'s (default: the default device's) allocator statistics (None on backends
    without them)."""
    stats = (device or jax.devices()[0]).memory_stats()
    return dict(stats) if stats else None


def device_free_bytes() -> int:
    """Bytes the device can still allocate: allocator limit - in use, or (CPU) MemAvailable."""
    stats = memory_stats()
    if stats and "bytes_limit" in stats:
        return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def blocking_ms(f: Callable, args: tuple, warm: int) -> float:
    """Runs ``warm`` blocking calls; wall ms of the last."""
    ms = 0.0
    for _ in range(warm):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        ms = (time.perf_counter() - t0) * 1e3
    return ms


def queued_ms(f: Callable, args: tuple, k: int, r: int) -> float:
    """Median over ``r`` repeats of (wall of ``k`` queued calls and one block) / ``k``, in ms."""
    return statistics.median(queued_times(f, args, k, r))


def queued_times(f: Callable, args: tuple, k: int, r: int) -> list[float]:
    """(Wall of ``k`` queued calls and one block) / ``k`` in ms, for each of ``r`` repeats."""
    ts = []
    for _ in range(r):
        t0 = time.perf_counter()
        out = None
        for _ in range(k):
            out = f(*args)
        jax.block_until_ready(out)
        ts.append((time.perf_counter() - t0) / k * 1e3)
    return ts


def trace(f: Callable, args: tuple, iters: int) -> Any:
    """The ``jax.profiler.ProfileData`` of a trace of ``iters`` queued calls (None when the
    profiler wrote no trace)."""
    from jax.profiler import ProfileData

    with tempfile.TemporaryDirectory() as d:
        jax.profiler.start_trace(d)
        try:
            out = None
            for _ in range(iters):
                out = f(*args)
            jax.block_until_ready(out)
        finally:
            jax.profiler.stop_trace()
        paths = sorted(glob.glob(os.path.join(d, "**", "*.xplane.pb"), recursive=True))
        return ProfileData.from_file(paths[-1]) if paths else None


def gpu_events(data: Any) -> dict[str, list]:
    """The events of each GPU's streams in a trace: ``{plane name: [event]}`` (GPUs with
    stream events only)."""
    out: dict[str, list] = {}
    for plane in data.planes if data is not None else ():
        if plane.name.startswith("/device:GPU"):
            events = [ev for line in plane.lines if line.name.startswith("Stream") for ev in line.events]
            if events:
                out[plane.name] = events
    return out


def union_ns(events: list) -> float:
    """Length of the union of the events' intervals (ns): the time any of them runs."""
    total, end = 0.0, -1
    for s, e in sorted((ev.start_ns, ev.start_ns + ev.duration_ns) for ev in events):
        if s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total


def device_profile(f: Callable, args: tuple, iters: int = 20, top: int = 12) -> dict:
    """Device time per call from a profiler trace of ``iters`` queued calls (GPU).

    busy_ms: union of the GPU stream intervals / iters; span_ms: first start to last end /
    iters; categories_ms: per part (``CATEGORIES``, the rest is XLA glue) summed / iters;
    kernels_ms: the ``top`` kernels by summed duration / iters.
    """
    events = [ev for evs in gpu_events(trace(f, args, iters)).values() for ev in evs]
    if not events:
        raise RuntimeError("no GPU stream events in the profiler trace")
    per_name: dict[str, float] = {}
    for ev in events:
        per_name[ev.name] = per_name.get(ev.name, 0.0) + ev.duration_ns
    cats: dict[str, float] = {}
    for name, ns in per_name.items():
        cat = next((c for c, pat in CATEGORIES if re.search(pat, name)), "XLA fusions (glue)")
        cats[cat] = cats.get(cat, 0.0) + ns / iters * 1e-6
    ranked = sorted(per_name.items(), key=lambda kv: -kv[1])[:top]
    spans = sorted((ev.start_ns, ev.start_ns + ev.duration_ns) for ev in events)
    return {
        "busy_ms": union_ns(events) / iters * 1e-6,
        "span_ms": (spans[-1][1] - spans[0][0]) / iters * 1e-6,  # first start to the last start's end
        "events_per_call": len(events) / iters,
        "categories_ms": dict(sorted(cats.items(), key=lambda kv: -kv[1])),
        "kernels_ms": {k[:90]: v / iters * 1e-6 for k, v in ranked},
    }


def device_profiles(f: Callable, args: tuple, iters: int = 5, collective: str = "nccl") -> dict | None:
    """Per GPU, from a profiler trace of ``iters`` queued calls: ``busy_ms`` per call (union
    of its streams' events), ``collective_ms`` (union of the kernels whose name contains
    ``collective``, any case) and their ``collective_share`` of the busy time; None
    without GPU events (CPU)."""
    out = {}
    for name, events in gpu_events(trace(f, args, iters)).items():
        busy = union_ns(events) / iters * 1e-6
        coll = union_ns([ev for ev in events if collective in ev.name.lower()]) / iters * 1e-6
        out[name] = {"busy_ms": busy, "collective_ms": coll, "collective_share": coll / busy}
    return out or None


def timed(f: Callable, args: tuple, *, target_s: float = 0.4, max_iters: int = 20, repeats: int = 5) -> dict:
    """Device time of one call of ``f`` in ms (``ms``) by ``method()``, after 2 warm-up calls.

    Returns ``ms``, ``method``, ``iters`` (calls measured), ``first_call_ms`` (wall, blocking),
    and on a GPU the ``profile`` of ``device_profile``.
    """
    first = blocking_ms(f, args, warm=2)
    iters = int(min(max_iters, max(3, target_s * 1e3 / max(first, 1e-3))))
    if method() == "profiler":
        prof = device_profile(f, args, iters=iters)
        return {
            "ms": prof["busy_ms"],
            "method": "profiler",
            "iters": iters,
            "first_call_ms": first,
            "profile": prof,
        }
    k = max(1, iters // repeats)
    return {
        "ms": queued_ms(f, args, k, repeats),
        "method": "queued",
        "iters": k * repeats,
        "first_call_ms": first,
    }


def step_times(step: Callable, feeds: Sequence[tuple], steps: int) -> tuple[dict, Any]:
    """``({compile_s, step_ms, steps_per_s}, last output)`` of a (state-donating) training
    ``step``: its first call, compile and run, timed blocking; then ``steps`` calls over
    ``feeds`` in turn, queued back to back."""
    t0 = time.perf_counter()
    jax.block_until_ready(step(*feeds[0]))
    compile_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for i in range(steps):
        out = step(*feeds[i % len(feeds)])
    jax.block_until_ready(out)
    per_step = (time.perf_counter() - t0) / steps
    times = {
        "compile_s": round(compile_s, 2),
        "step_ms": round(1e3 * per_step, 2),
        "steps_per_s": round(1 / per_step, 2),
    }
    return times, out
