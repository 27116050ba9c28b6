"""Markdown, the measurements page's blocks and plots from the benchmark JSON in ``benchmarks/results/``.

Usage:
  python -m benchmarks.report [FILE.json ...] > benchmarks/results/REPORT.md
      every run in full (default: every results JSON but ``--quick`` ones, oldest first)
  python -m benchmarks.report --readme docs/measurements.md [--plots-dir DIR] [FILE.json ...]
      rewrites the measurements page's ``bench`` block (single table) and, where the page
      has one, its ``bench-collection`` block (each case and implementation from its newest run) and
      its ``scaling`` block (``benchmarks/scaling_report.py``), and draws the plots
      (default ``benchmarks/results/plots/``) that the blocks link to. Without runs of the
      suite (``python -m benchmarks``) the ``bench`` block shows the newest
      ``single_table_*.json`` of the earlier single-table script, as before.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import glob
import io
import json
import os
import re
from pathlib import Path

from . import scaling_report
from .plots import draw_all, impl_order, measured
from .records import load, newest_first

RESULTS = "benchmarks/results"
MODES = ("fwd", "fwd_bwd")


# ---- the earlier single-table script's JSON (single_table_*.json) ------------------------


def fmt(x, nd=3):
    if isinstance(x, (int, float)):
        return f"{x:.{nd}f}"
    return str(x) if x is not None else "-"


def busy(x: dict, key: str):
    """Device busy ms of a profiled run, or None."""
    d = x.get(key)
    return d.get("busy_ms") if isinstance(d, dict) else None


def weighted(r: dict) -> str:
    """Whether the config's bags carry per-id weights (then their gradient is taken too)."""
    return {True: "yes", False: "no"}.get(r.get("weighted"), "-")


def mb(x):
    if x is None:
        return "-"
    return f"{x / 1e6:.1f}" if isinstance(x, (int, float)) else str(x)


def legacy_markdown(p: str) -> None:
    """Prints the markdown of one ``single_table_*.json``."""
    data = json.load(open(p))
    print(f"## {p}\n")
    print(
        f"device `{data.get('device')}`, date {data.get('date')}, commit `{data.get('git_commit')}`, "
        f"jax {data.get('jax')}; timing: {data.get('timing')} (K={data.get('K')}, R={data.get('R')})\n"
    )
    print(
        "| config | weighted | nnz | unique | groups | impl | fwd ms (device) | fwd+bwd ms (device) | "
        "fwd ms (queued) | fwd+bwd ms (queued) | fwd temp MB (XLA) | fwd temp MB (XLA + FFI scratch) | "
        "fwd % of fp32 peak |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in data["results"]:
        for impl in ("dense_bag", "tt_reference", "tt_reference_dedup", "ours"):
            x = r.get(impl, {})
            head = f"| {r['config']} | {weighted(r)} | {r['nnz']} | {r.get('num_unique')} |"
            head += f" {r.get('num_groups')} |"
            if "error" in x:
                print(f"{head} {impl} | error: {x['error'][:80]} | | | | | | |")
                continue
            frac = x.get("fwd_fraction_of_fp32_peak")
            print(
                f"{head} {impl} | "
                f"{fmt(busy(x, 'fwd_device'))} | {fmt(busy(x, 'fwd_bwd_device'))} | "
                f"{fmt(x.get('fwd_ms'))} | {fmt(x.get('fwd_bwd_ms'))} | {mb(x.get('fwd_temp_bytes'))} | "
                f"{mb(x.get('fwd_temp_total_bytes', x.get('fwd_temp_bytes') if impl != 'ours' else None))} | "
                f"{fmt(100 * frac, 1) if isinstance(frac, float) else '-'} |"
            )
    print()
    for r in data["results"]:
        print(
            f"- {r['config']}: dispatch floor {fmt(r.get('dispatch_floor_ms'))} ms; fwd FLOP floor "
            f"{r.get('fwd_flop_floor', 0):.3g} ({fmt(r.get('fwd_floor_ms_fp32'), 4)} ms at fp32 peak); "
            f"ours breakdown (ms, each jitted alone): {r.get('ours_breakdown_ms')}; "
            f"FFI scratch bytes: {r.get('ours_scratch_bytes')}"
        )
    print()
    for r in data["results"]:
        ours = r.get("ours", {})
        if not isinstance(ours.get("fwd_device"), dict) or "categories_ms" not in ours["fwd_device"]:
            continue
        breakdown(r["config"], ours["fwd_device"], ours["fwd_bwd_device"])


def breakdown(label: str, fwd: dict, fb: dict) -> None:
    """Where the device time of ours goes: per part, from two profiles (fwd, fwd+bwd)."""
    cf, cb = fwd["categories_ms"], fb["categories_ms"]
    print(f"Where the device time of ours goes, {label} (ms per call, profiler):\n")
    print("| part | fwd | fwd+bwd |")
    print("|---|---|---|")
    for cat in sorted(set(cf) | set(cb), key=lambda c: -cb.get(c, 0.0)):
        print(f"| {cat} | {fmt(cf.get(cat), 4)} | {fmt(cb.get(cat), 4)} |")
    print(f"| busy (union of kernels) | {fmt(fwd['busy_ms'], 4)} | {fmt(fb['busy_ms'], 4)} |\n")


# ---- the suite's JSON (python -m benchmarks) ----------------------------------------------


def suite_files(results: str = RESULTS) -> list[str]:
    return sorted(glob.glob(os.path.join(results, "bench_*.json")))


def cases_of(docs: list[dict], suite: str) -> list[dict]:
    """Cases of ``suite`` over runs given newest first: each case's newest run, with the
    implementations only older runs measured (e.g. a slow baseline not re-run) added from
    the newest of those."""
    out: dict[str, dict] = {}
    for d in docs:
        for c in d["cases"]:
            if c["suite"] != suite:
                continue
            if c["case"] not in out:
                out[c["case"]] = {**c, "impls": dict(c["impls"]), "_doc": d}
            else:
                for name, rec in c["impls"].items():
                    out[c["case"]]["impls"].setdefault(name, rec)
    return list(out.values())


def provenance(docs: list[dict]) -> str:
    lines = [
        f"- stage `{d['stage']}`: `{Path(d['_path']).name}`, device `{d['device']}`, {d['date']}, "
        f"commit `{str(d['commit'])[:7]}`, {_framework(d)}, timing `{d['timing_method']}`, "
        f"{d['status']}" + (f", time budget {d['time_budget_s']:.0f} s" if d.get("time_budget_s") else "")
        for d in docs
    ]
    return "\n".join(lines) + "\n"


def _framework(d: dict) -> str:
    """``jax <version>`` of our runs, ``torch <version>`` of a PyTorch peer's."""
    if "jax" in d:
        return f"jax {d['jax']}"
    return f"torch {d.get('torch', '?')}"


def bytes_per_id(rec: dict, nnz: int) -> float | None:
    """A measured mode's step memory per id: ours, XLA's peak of the executable plus the
    kernels' run-time scratch, less its arguments (parameters and inputs); a peer's, its
    own ``bytes_per_id`` (its allocator's peak less its parameters)."""
    if "bytes_per_id" in rec:
        return rec["bytes_per_id"]
    mem = rec.get("memory") or {}
    if "peak_memory" not in mem or not nnz:
        return None
    return (mem["peak_memory"] + (rec.get("scratch_bytes") or 0) - mem.get("argument_size", 0)) / nnz


#: The memory table's implementations, in order.
MEMORY_IMPLS = ("ecorec", "ours_batched", "ours_batched_capacity")


def memory_section(docs: list[dict]) -> None:
    """The collections' step memory per id beside the time, every implementation measured
    (EcoRec, the seed's baseline, where its peer ran: ``benchmarks/ecorec_peer.py``)."""
    cases = sorted(
        (c for c in cases_of(docs, "collection") if c["workload"]["batch"] >= 4096),
        key=lambda c: (c["workload"]["batch"], c["workload"]["num_tables"]),
    )
    present = {n for c in cases for n in c["impls"]}
    names = [n for n in MEMORY_IMPLS if n in present]
    cases = [c for c in cases if any(n in c["impls"] for n in names)]
    print(provenance(sorted({id(c["_doc"]): c["_doc"] for c in cases}.values(), key=lambda d: d["date"])))
    print(
        "Bytes per id (forward / forward + backward): ours, XLA's peak of the step's executable "
        "plus the kernels' run-time scratch, less parameters and inputs; EcoRec, its allocator's "
        "peak less its parameters (its int64 ids included). Time in ms (device busy time where "
        "profiled).\n"
    )
    print("| tables | bags | ids | unique | " + " | ".join(f"{n} B/id | {n} ms" for n in names) + " |")
    print("|---" * (4 + 2 * len(names)) + "|")
    for c in cases:
        s, cells = c["stats"], []
        nnz = s.get("nnz", 0)
        for n in names:
            rec = c["impls"].get(n, {})
            cells.append(pair(rec, functools.partial(bytes_per_id, nnz=nnz), nd=0))
            cells.append(pair(rec, lambda v: (v.get("profile") or {}).get("busy_ms", v["ms"]), nd=2))
        uniq = f"{100 * s['unique_fraction']:.1f}%" if "unique_fraction" in s else "-"
        print(f"| {s['tables']} | {s['batch']} | {s.get('nnz', 0):,} | {uniq} | " + " | ".join(cells) + " |")
    for line in notes(cases, names):
        print(line)
    print()


def ms_pair(rec: dict) -> str:
    vals = [measured(rec, m) for m in MODES]
    if not any(vals):
        return (
            "skipped"
            if any("skipped" in rec.get(m, {}) for m in MODES)
            else ("error" if any("error" in rec.get(m, {}) for m in MODES) else "-")
        )
    return " / ".join(f"{v['ms']:.3f}" if v else "-" for v in vals)


def ratio(x: float) -> str:
    return f"{x:.1f}x" if x < 10 else f"{x:.0f}x"


def pair(rec: dict, get, scale: float = 1.0, nd: int = 1) -> str:
    vals = [measured(rec, m) for m in MODES]
    out = [get(v) if v else None for v in vals]
    return " / ".join(f"{x * scale:.{nd}f}" if isinstance(x, (int, float)) else "-" for x in out)


def device_peak(rec: dict) -> str:
    """The allocator's peak bytes in use after each mode's run (MB); "<=" where the run did
    not raise the process's peak, which then bounds its own from above."""
    out = []
    for m in MODES:
        dm = (measured(rec, m) or {}).get("device_memory")
        out.append(
            "-" if not dm else ("" if dm["raised_peak"] else "<=") + f"{dm['peak_bytes_in_use'] / 1e6:.0f}"
        )
    return " / ".join(out)


def notes(cases: list[dict], names: list[str]) -> list[str]:
    """One line per skipped or failed (case, impl, mode)."""
    out = []
    for c in cases:
        for n in names:
            for m in MODES:
                r = c["impls"].get(n, {}).get(m, {})
                why = r.get("skipped") or r.get("error")
                if why:
                    out.append(
                        f"- {c.get('alias') or c['case']} {n} {m.replace('_', '+')}: "
                        f"{'skipped' if 'skipped' in r else 'error'}: {why}"
                    )
    return out


def detail_table(cases: list[dict], names: list[str]) -> None:
    """Per (case, impl): compile, memory, parameters, floor, as ``fwd / fwd+bwd`` pairs."""
    print(
        "| case | impl | ms | compile s | peak MB | temp MB | device peak MB | params MB | compression "
        "| % of floor |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for c in cases:
        for n in names:
            r = c["impls"].get(n)
            if r is None:
                continue
            params = f"{r['param_bytes'] / 1e6:.1f}" if r.get("param_bytes") else "-"
            comp = f"{r['compression_ratio']:.0f}x" if r.get("compression_ratio") else "-"
            print(
                f"| {c.get('alias') or c['case']} | {n} | {ms_pair(r)} | "
                f"{pair(r, lambda v: v['lower_s'] + v['compile_s'])} | "
                f"{pair(r, lambda v: v.get('peak_bytes'), 1e-6)} | "
                f"{pair(r, lambda v: v.get('temp_bytes'), 1e-6)} | {device_peak(r)} | {params} | {comp} | "
                f"{pair(r, lambda v: v.get('floor', {}).get('fraction'), 100.0, 2)} |"
            )
    print()


def notes_and_plots(
    cases: list[dict], names: list[str], plots: dict[str, str], plot_names: tuple[str, ...], link_root: Path
) -> None:
    """A section's end: the notes on its cases, then the plots ``plot_names`` that were drawn."""
    for line in notes(cases, names):
        print(line)
    print()
    for name in plot_names:
        if not str(plots.get(name, "")).startswith("skipped"):
            print(f"![{name.replace('_', ' ')}]({os.path.relpath(plots[name], link_root)})\n")


def single_section(docs: list[dict], plots: dict[str, str], link_root: Path) -> None:
    cases = sorted(
        cases_of(docs, "single"),
        key=lambda c: (
            c["workload"]["dim"],
            c["workload"]["rank"],
            c["workload"]["batch"],
            c["workload"]["dist"],
            c["workload"].get("weighted", False),
        ),
    )
    names = impl_order(n for c in cases for n in c["impls"])
    print("Runs:\n")
    print(provenance([d for d in docs if any(c["suite"] == "single" for c in d["cases"])]))
    weights = (
        "; and of the per-id weights in the weighted rows"
        if any(c["workload"].get("weighted") for c in cases)
        else ""
    )
    print(
        "Time per call in ms, forward / forward + backward (gradients of the cores; of the "
        f"table for dense_bag{weights}); last column: the XLA TT reference's time over ours.\n"
    )
    print("| D | rank | bags | ids | nnz | unique | " + " | ".join(names) + " | reference / ours |")
    print("|---" * (7 + len(names)) + "|")
    for c in cases:
        wl, st = c["workload"], c.get("stats", {})
        ref, ours = c["impls"].get("tt_reference", {}), c["impls"].get("ours", {})
        speed = [
            ratio(measured(ref, m)["ms"] / measured(ours, m)["ms"])
            if measured(ref, m) and measured(ours, m)
            else "-"
            for m in MODES
        ]
        label = wl["dist"] + (", weighted" if wl.get("weighted") else "")
        label += f" ({c['alias']})" if c.get("alias") else ""
        print(
            f"| {wl['dim']} | {wl['rank']} | {wl['batch']} | {label} | {st.get('nnz', '-')} | "
            f"{st.get('num_unique', '-')} | "
            + " | ".join(ms_pair(c["impls"].get(n, {})) for n in names)
            + f" | {' / '.join(speed)} |"
        )
    print()
    focus = [c for c in cases if c.get("alias")] or cases[:1]
    print(
        "Compile time, memory (XLA memory analysis; for ours plus the kernels' run-time scratch), "
        "parameters and the fraction of the floor reached (FLOP floor for TT: one prefix product "
        "per unique (i1, i2), one last step per unique id, pooling; byte floor for dense_bag), "
        "forward / forward + backward:\n"
    )
    detail_table(focus, names)
    for c in focus:
        ours = c["impls"].get("ours", {})
        f, b = measured(ours, "fwd"), measured(ours, "fwd_bwd")
        if f and b and "profile" in f and "profile" in b:
            breakdown(c.get("alias") or c["case"], f["profile"], b["profile"])
    notes_and_plots(cases, names, plots, ("latency_vs_batch", "memory_single"), link_root)


def collection_section(docs: list[dict], plots: dict[str, str], link_root: Path) -> None:
    cases = sorted(
        cases_of(docs, "collection"), key=lambda c: (c["workload"]["batch"], c["workload"]["num_tables"])
    )
    names = impl_order(n for c in cases for n in c["impls"])
    print("Runs:\n")
    print(provenance([d for d in docs if any(c["suite"] == "collection" for c in d["cases"])]))
    wl = cases[0]["workload"]
    print(
        f"Meta-like collections from `benchmarks/workloads.py`, a synthetic stand-in for Meta's "
        f"2022 synthetic trace (not available here): dim {wl['dim']}, rank {wl['rank']}, one "
        f"feature per table, seed {wl['seed']}.\n"
    )
    print(
        "| tables | bags | rows | dense GB | TT MB | compression | one-hot tables | mean pooling | "
        "unique ids |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for c in cases:
        s = c["stats"]
        uniq = f"{100 * s['unique_fraction']:.1f}%" if "unique_fraction" in s else "(not drawn)"
        pool = (
            f"{s['mean_pooling']:.2f}"
            if "mean_pooling" in s
            else f"{s['expected_mean_pooling']:.2f} (expected)"
        )
        print(
            f"| {s['tables']} | {s['batch']} | {s['rows']:,} | {s['dense_param_bytes'] / 1e9:.2f} | "
            f"{s['tt_param_bytes'] / 1e6:.1f} | {s['compression_ratio']:.0f}x | {s['one_hot_tables']} | "
            f"{pool} | {uniq} |"
        )
    print("\nTime per call in ms, forward / forward + backward:\n")
    print("| tables | bags | " + " | ".join(names) + " |")
    print("|---" * (2 + len(names)) + "|")
    for c in cases:
        print(
            f"| {c['workload']['num_tables']} | {c['workload']['batch']} | "
            + " | ".join(ms_pair(c["impls"].get(n, {})) for n in names)
            + " |"
        )
    print()
    detail_table([c for c in cases if any(measured(r, "fwd") for r in c["impls"].values())], names)
    notes_and_plots(cases, names, plots, ("latency_vs_tables", "memory_collection"), link_root)


def full_markdown(d: dict) -> None:
    """Every case of one run, in full."""
    print(f"## {d['_path']}\n")
    print(provenance([d]))
    print(f"timing: {d['timing']}\n")
    for suite in ("single", "collection"):
        cases = [c for c in d["cases"] if c["suite"] == suite]
        if cases:
            names = impl_order(n for c in cases for n in c["impls"])
            detail_table(cases, names)
            for line in notes(cases, names):
                print(line)
            print()


# ---- the page -----------------------------------------------------------------------------


def replace_block(readme: str, name: str, body: str) -> None:
    """Rewrites the text between ``<!-- {name}:start -->`` and ``<!-- {name}:end -->``."""
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    text = open(readme).read()
    if start not in text or end not in text:
        raise SystemExit(f"{readme} has no {start} ... {end} block")
    block = f"{start}\n{body}{end}"
    open(readme, "w").write(
        re.sub(re.escape(start) + ".*?" + re.escape(end), lambda _: block, text, flags=re.S)
    )


def captured(fn, *args) -> str:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        fn(*args)
    return buf.getvalue()


def update_readme(readme: str, paths: list[str], plots_dir: str) -> None:
    """The ``bench`` and ``bench-collection`` blocks and their plots from the runs, newest
    first per case and implementation."""
    given = load(paths or suite_files())
    docs = newest_first([d for d in given if "schema" in d])
    link_root = Path(readme).resolve().parent
    plots = draw_all(docs, plots_dir) if docs else {}
    plots = {k: v if v.startswith("skipped") else str(Path(v).resolve()) for k, v in plots.items()}
    if cases_of(docs, "single"):
        replace_block(readme, "bench", captured(single_section, docs, plots, link_root))
    else:
        legacy = [d["_path"] for d in given if "schema" not in d][-1:] or sorted(
            glob.glob(os.path.join(RESULTS, "single_table_*.json"))
        )[-1:]
        replace_block(readme, "bench", captured(legacy_markdown, *legacy).replace("## ", "#### "))
    if cases_of(docs, "collection"):
        if "<!-- bench-collection:start -->" in open(readme).read():
            replace_block(readme, "bench-collection", captured(collection_section, docs, plots, link_root))
        else:
            print(
                f"{readme} has no <!-- bench-collection:start --> ... <!-- bench-collection:end --> "
                "block: the collection results are not shown there"
            )
    if cases_of(docs, "collection") and "<!-- memory-collection:start -->" in open(readme).read():
        replace_block(readme, "memory-collection", captured(memory_section, docs))
    if "<!-- scaling:start -->" in open(readme).read():
        replace_block(readme, "scaling", scaling_report.section(scaling_report.load_runs(), link_root))
    for name, where in plots.items():
        print(f"plot {name}: {where}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.report", description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="*", help="results JSON (default: benchmarks/results/)")
    ap.add_argument("--readme", help="rewrite this page's bench blocks (docs/measurements.md), not print")
    ap.add_argument("--plots-dir", default=os.path.join(RESULTS, "plots"))
    a = ap.parse_args(argv)
    if a.readme:
        update_readme(a.readme, a.files, a.plots_dir)
        return
    docs = load(a.files or sorted(glob.glob(os.path.join(RESULTS, "single_table_*.json"))) + suite_files())
    for d in sorted(docs, key=lambda d: ("schema" in d, d.get("date", ""))):
        if "schema" not in d:
            legacy_markdown(d["_path"])
        elif not d.get("quick") or a.files:
            full_markdown(d)


if __name__ == "__main__":
    main()
