"""Turn benchmarks/results/*.json (bench_single_table.py output) into a markdown table.

Usage: python benchmarks/report.py [results/single_table_*.json] > benchmarks/results/REPORT.md
       python benchmarks/report.py --readme README.md [results/single_table_*.json]
         (rewrites the block between the README's bench markers; default: the newest file)
"""

from __future__ import annotations

import contextlib
import glob
import io
import json
import re
import sys


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


def main(paths):
    paths = paths or sorted(glob.glob("benchmarks/results/single_table_*.json"))
    for p in paths:
        data = json.load(open(p))
        print(f"## {p}\n")
        print(f"device `{data.get('device')}`, date {data.get('date')}, commit `{data.get('git_commit')}`, "
              f"jax {data.get('jax')}; timing: {data.get('timing')} (K={data.get('K')}, R={data.get('R')})\n")
        print("| config | weighted | nnz | unique | groups | impl | fwd ms (device) | fwd+bwd ms (device) | "
              "fwd ms (queued) | fwd+bwd ms (queued) | fwd temp MB (XLA) | fwd temp MB (XLA + FFI scratch) | "
              "fwd % of fp32 peak |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        for r in data["results"]:
            for impl in ("dense_bag", "tt_reference", "tt_reference_dedup", "ours"):
                x = r.get(impl, {})
                if "error" in x:
                    print(f"| {r['config']} | {weighted(r)} | {r['nnz']} | {r.get('num_unique')} | {r.get('num_groups')} | "
                          f"{impl} | error: {x['error'][:80]} | | | | | | |")
                    continue
                frac = x.get("fwd_fraction_of_fp32_peak")
                print(f"| {r['config']} | {weighted(r)} | {r['nnz']} | {r.get('num_unique')} | {r.get('num_groups')} | {impl} | "
                      f"{fmt(busy(x, 'fwd_device'))} | {fmt(busy(x, 'fwd_bwd_device'))} | "
                      f"{fmt(x.get('fwd_ms'))} | {fmt(x.get('fwd_bwd_ms'))} | {mb(x.get('fwd_temp_bytes'))} | "
                      f"{mb(x.get('fwd_temp_total_bytes', x.get('fwd_temp_bytes') if impl != 'ours' else None))} | "
                      f"{fmt(100 * frac, 1) if isinstance(frac, float) else '-'} |")
        print()
        for r in data["results"]:
            print(f"- {r['config']}: dispatch floor {fmt(r.get('dispatch_floor_ms'))} ms; fwd FLOP floor "
                  f"{r.get('fwd_flop_floor', 0):.3g} ({fmt(r.get('fwd_floor_ms_fp32'), 4)} ms at fp32 peak); "
                  f"ours breakdown (ms, each jitted alone): {r.get('ours_breakdown_ms')}; "
                  f"FFI scratch bytes: {r.get('ours_scratch_bytes')}")
        print()
        for r in data["results"]:
            ours = r.get("ours", {})
            if not isinstance(ours.get("fwd_device"), dict) or "categories_ms" not in ours["fwd_device"]:
                continue
            fwd, fb = ours["fwd_device"]["categories_ms"], ours["fwd_bwd_device"]["categories_ms"]
            print(f"Where the device time of ours goes, {r['config']} (ms per call, profiler):\n")
            print("| part | fwd | fwd+bwd |")
            print("|---|---|---|")
            for cat in sorted(set(fwd) | set(fb), key=lambda c: -fb.get(c, 0.0)):
                print(f"| {cat} | {fmt(fwd.get(cat), 4)} | {fmt(fb.get(cat), 4)} |")
            print(f"| busy (union of kernels) | {fmt(ours['fwd_device']['busy_ms'], 4)} | "
                  f"{fmt(ours['fwd_bwd_device']['busy_ms'], 4)} |\n")


def replace_block(readme: str, name: str, body: str) -> None:
    """Rewrites the text between ``<!-- {name}:start -->`` and ``<!-- {name}:end -->``."""
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    text = open(readme).read()
    if start not in text or end not in text:
        raise SystemExit(f"{readme} has no {start} ... {end} block")
    block = f"{start}\n{body}{end}"
    open(readme, "w").write(re.sub(re.escape(start) + ".*?" + re.escape(end), lambda _: block, text,
                                   flags=re.S))


def update_readme(readme: str, paths) -> None:
    """The README shows the newest results file unless paths are given."""
    paths = paths or sorted(glob.glob("benchmarks/results/single_table_*.json"))[-1:]
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        main(paths)
    replace_block(readme, "bench", buf.getvalue().replace("## ", "#### "))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--readme"]:
        update_readme(sys.argv[2], sys.argv[3:])
    else:
        main(sys.argv[1:])
