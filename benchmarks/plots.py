"""PNG plots of benchmark JSON (matplotlib, Agg): latency vs batch (unweighted cases), vs
tables, memory; the scaling stage's throughput vs GPUs (``draw_scaling``).

``draw_all`` returns ``{plot: path}`` for the plots drawn and ``{plot: "skipped: why"}``
for the others (matplotlib missing, no data), so a machine without matplotlib still runs
the suite; ``python -m benchmarks.report`` draws them again from the JSON elsewhere.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

__all__ = ["draw_all", "draw_scaling", "measured", "impl_order", "PLOTS"]

PLOTS = ("latency_vs_batch", "latency_vs_tables", "memory_single", "memory_collection")
#: Implementations in the order tables and plots show them (others after, by name).
ORDER = ("dense_bag", "tt_reference", "tt_reference_dedup", "ours", "ours_per_table_loop", "ours_batched")
_STYLE = {"fwd": "-", "fwd_bwd": "--"}
_MARKERS = (("o", "\u25cf"), ("s", "\u25a0"), ("^", "\u25b2"), ("v", "\u25bc"))


def measured(rec: dict, mode: str) -> dict | None:
    """The (impl, mode) result when it was timed, else None."""
    r = rec.get(mode) or {}
    return r if isinstance(r.get("ms"), (int, float)) else None


def _cases(docs: Iterable[dict], suite: str) -> list[dict]:
    return [c for d in docs for c in d.get("cases", []) if c.get("suite") == suite]


def impl_order(names: Iterable[str]) -> list[str]:
    """``names`` in ``ORDER`` (unknown ones last, by name), without repeats."""
    rank = {n: k for k, n in enumerate(ORDER)}
    return sorted(set(names), key=lambda n: (rank.get(n, len(ORDER)), n))


def _impl_names(cases: list[dict]) -> list[str]:
    return impl_order(n for c in cases for n in c["impls"])


def _legend(ax, names: list[str]) -> None:
    """One entry per implementation (colour) and one per mode (line style)."""
    from matplotlib.lines import Line2D

    handles = [Line2D([], [], color=f"C{k}", marker="o", label=n) for k, n in enumerate(names)]
    handles += [Line2D([], [], color="gray", ls=ls, label=m.replace("_", "+")) for m, ls in _STYLE.items()]
    ax.legend(handles=handles, fontsize=7)


def _ticks(ax, xs: list[int]) -> None:
    """The x values as ticks; y labels on every decade and in between (short log ranges)."""
    from matplotlib.ticker import FuncFormatter, NullLocator

    ax.set_xticks(xs, [str(x) for x in xs])
    ax.xaxis.set_minor_locator(NullLocator())
    fmt = FuncFormatter(lambda v, _: f"{v:g}")
    ax.yaxis.set_major_formatter(fmt)
    ax.yaxis.set_minor_formatter(fmt)


def _timed(case: dict) -> bool:
    return any(measured(r, m) for r in case["impls"].values() for m in _STYLE)


def _run_label(doc: dict) -> str:
    """One run's device, date and commit, for a plot's title."""
    return f"{doc.get('device', '?')}, {str(doc.get('date', '?'))[:10]}, commit {doc.get('commit', '?')}"


def _newest_run(docs: Iterable[dict], suite: str) -> tuple[list[dict], str]:
    """The timed cases of the newest run (``docs`` newest first) that has any of ``suite``,
    and its label: a plot shows one run, never cases of several."""
    for doc in docs:
        cases = [
            c
            for c in _cases([doc], suite)
            if any(measured(r, m) for r in c["impls"].values() for m in _STYLE)
        ]
        if cases:
            return cases, _run_label(doc)
    return [], ""


def _plot_modes(ax, cases: list[dict], name: str, x: str, *, marker: str, color: str) -> None:
    """Implementation ``name``'s ms per call against ``workload[x]`` over ``cases`` (in their
    order): one line per timed mode, styled as ``_STYLE`` says."""
    for mode, ls in _STYLE.items():
        pts = [(c["workload"][x], r["ms"]) for c in cases if (r := measured(c["impls"].get(name, {}), mode))]
        if pts:
            ax.plot(*zip(*pts), ls, marker=marker, color=color)


def _sweeps(cases: list[dict]) -> list[dict]:
    """The unweighted cases of the (dim, rank) pairs measured at two batch sizes or more."""
    cases = [c for c in cases if not c["workload"].get("weighted")]
    batches: dict[tuple, set] = {}
    for c in cases:
        batches.setdefault((c["workload"]["dim"], c["workload"]["rank"]), set()).add(c["workload"]["batch"])
    return [c for c in cases if len(batches[(c["workload"]["dim"], c["workload"]["rank"])]) > 1]


def _latency_vs_batch(plt, cases: list[dict], path: Path, label: str) -> str:
    combos = sorted({(c["workload"]["dim"], c["workload"]["rank"]) for c in cases})
    dists = {c["workload"]["dist"] for c in cases}
    dist = "zipf1.05" if "zipf1.05" in dists else sorted(dists)[0]
    names = _impl_names(cases)
    fig, axes = plt.subplots(1, len(combos), figsize=(4.2 * len(combos), 3.8), squeeze=False)
    for ax, (dim, rank) in zip(axes[0], combos):
        sel = sorted(
            (
                c
                for c in cases
                if (c["workload"]["dim"], c["workload"]["rank"]) == (dim, rank)
                and c["workload"]["dist"] == dist
            ),
            key=lambda c: c["workload"]["batch"],
        )
        for k, name in enumerate(names):
            _plot_modes(ax, sel, name, "batch", marker="o", color=f"C{k}")
        ax.set(
            xscale="log",
            yscale="log",
            xlabel="bags (batch)",
            ylabel="ms per call",
            title=f"D {dim}, rank {rank}, ids {dist}",
        )
        _ticks(ax, sorted({c["workload"]["batch"] for c in sel}))
        ax.grid(True, which="both", alpha=0.3)
    _legend(axes[0][0], names)
    rows = cases[0]["workload"]["num_embeddings"]
    fig.suptitle(f"Single table of {rows:.0e} rows: time per call vs batch ({label})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return str(path)


def _latency_vs_tables(plt, cases: list[dict], path: Path, label: str) -> str:
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    batches = sorted({c["workload"]["batch"] for c in cases})
    names = _impl_names(cases)
    for k, name in enumerate(names):
        for j, batch in enumerate(batches):
            sel = sorted(
                (c for c in cases if c["workload"]["batch"] == batch),
                key=lambda c: c["workload"]["num_tables"],
            )
            _plot_modes(ax, sel, name, "num_tables", marker=_MARKERS[j % 4][0], color=f"C{k}")
    ax.set(
        xscale="log",
        yscale="log",
        xlabel="tables",
        ylabel="ms per call",
        title=f"Meta-like collections: time per call vs tables\n{label}; markers: batch "
        + ", ".join(f"{_MARKERS[j % 4][1]} {b}" for j, b in enumerate(batches))
        + "",
    )
    ax.title.set_fontsize(9)
    _ticks(ax, sorted({c["workload"]["num_tables"] for c in cases}))
    ax.grid(True, which="both", alpha=0.3)
    _legend(ax, names)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return str(path)


def _memory_cases(cases: list[dict]) -> list[dict]:
    """The S1 case where there is one, else up to two cases with a timed forward."""
    s1 = [c for c in cases if c.get("alias") == "S1"]
    return s1 or [c for c in cases if any(measured(r, "fwd") for r in c["impls"].values())][:2]


def _memory(plt, picks: list[dict], path: Path, label: str) -> str:
    fig, axes = plt.subplots(1, len(picks), figsize=(6.5 * len(picks), 4.2), squeeze=False)
    for ax, case in zip(axes[0], picks):
        names = impl_order(case["impls"])
        series = (
            ("params", lambda r: r.get("param_bytes")),
            ("peak fwd", lambda r: (measured(r, "fwd") or {}).get("peak_bytes")),
            ("peak fwd+bwd", lambda r: (measured(r, "fwd_bwd") or {}).get("peak_bytes")),
        )
        width = 0.8 / len(series)
        for j, (what, get) in enumerate(series):
            xs = [i + (j - 1) * width for i, n in enumerate(names) if get(case["impls"][n])]
            ys = [get(case["impls"][n]) / 2**20 for n in names if get(case["impls"][n])]
            ax.bar(xs, ys, width, label=what, color=f"C{j}")
        ax.set_xticks(range(len(names)), names, rotation=20, ha="right", fontsize=8)
        ax.set(yscale="log", ylabel="MiB", title=f"{case.get('alias') or case['case']}")
        ax.grid(True, axis="y", which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(
        f"Device memory per implementation\n{label}; XLA memory analysis + FFI scratch; missing bar: not run",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return str(path)


def _pyplot():
    """``matplotlib.pyplot`` on the Agg backend, or the reason it is missing (a str)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        msg = f"skipped: matplotlib not available ({e})"
        print(f"plots {msg}")
        return msg
    return plt


def draw_all(docs: list[dict], out_dir: Path | str, prefix: str = "") -> dict[str, str]:
    """Draws ``PLOTS`` into ``out_dir/<prefix><plot>.png``, each from the newest run of
    ``docs`` (newest first) that has its suite."""
    plt = _pyplot()
    if isinstance(plt, str):
        return {p: plt for p in PLOTS}
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (single, single_run), (coll, coll_run) = (_newest_run(docs, s) for s in ("single", "collection"))
    todo = {
        "latency_vs_batch": (
            _latency_vs_batch,
            _sweeps(single),
            single_run,
            "no unweighted single-table case at two batch sizes in the newest run",
        ),
        "latency_vs_tables": (_latency_vs_tables, coll, coll_run, "no timed collection case"),
        "memory_single": (_memory, _memory_cases(single), single_run, "no timed single-table case"),
        "memory_collection": (_memory, _memory_cases(coll), coll_run, "no timed collection case"),
    }
    out = {}
    for name, (fn, data, label, why) in todo.items():
        if not data:
            out[name] = f"skipped: {why}"
            continue
        try:
            out[name] = fn(plt, data, out_dir / f"{prefix}{name}.png", label)
        finally:
            plt.close("all")
    return out


def draw_scaling(results: list[dict], path: Path) -> str:
    """The scaling stage's plot (``path``): examples/s against GPUs per case (workload,
    per-GPU batch), one line per strategy from the 1-GPU run, and the ideal."""
    plt = _pyplot()
    if isinstance(plt, str):
        return plt
    cases = sorted({(r["workload"], r["per_gpu_batch"]) for r in results if "examples_per_s" in r})
    if not cases:
        return "skipped: no timed run"
    fig, axes = plt.subplots(1, len(cases), figsize=(4 * len(cases), 3.4), squeeze=False)
    for ax, (wl, b) in zip(axes[0], cases):
        runs = [
            r for r in results if (r["workload"], r["per_gpu_batch"]) == (wl, b) and "examples_per_s" in r
        ]
        base = next((r for r in runs if r["strategy"] == "single"), None)
        for strategy, marker in (("data", "o"), ("table", "s")):
            pts = sorted((r["num_gpus"], r["examples_per_s"]) for r in runs if r["strategy"] == strategy)
            if base is not None:
                pts = [(1, base["examples_per_s"])] + pts
            if len(pts) > 1:
                ax.plot(*zip(*pts), marker=marker, label=strategy)
        gpus = sorted({r["num_gpus"] for r in runs})
        if base is not None:
            ax.plot(gpus, [g * base["examples_per_s"] for g in gpus], "k:", label="ideal")
        ax.set_xticks(gpus)
        ax.set_title(f"{wl}, {b} per GPU")
        ax.set_xlabel("GPUs")
        ax.set_ylabel("examples / s")
        ax.legend()
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=120)
    finally:
        plt.close("all")
    return str(path)
