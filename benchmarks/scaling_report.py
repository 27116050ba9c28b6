"""The measurements page's ``scaling`` block from the runs of the scaling stage (``python -m benchmarks
--stage scaling``, ``benchmarks/scaling.py``; earlier runs: ``scripts/scaling_gpu.py``'s
``scaling_*.json``).

Each case (workload, per-GPU batch) is shown from the newest JSON under
``benchmarks/results/scaling/`` that has its 1-GPU row, with every row of that run for the
case: efficiencies are against the same run's 1-GPU throughput, as the stage computes them.
"""

from __future__ import annotations

import glob
import os
from pathlib import Path

from .records import load, newest_first

SCALING = os.path.join("benchmarks", "results", "scaling")


def load_runs(folder: str = SCALING) -> list[dict]:
    """The scaling JSON of ``folder`` (the stage's ``bench_scaling_*.json``, the earlier
    script's ``scaling_*.json``), newest first (by their ``date``)."""
    return newest_first(load(sorted(glob.glob(os.path.join(folder, "*scaling_*.json")))))


def case_of(row: dict) -> tuple[str, int]:
    return row.get("workload"), row.get("per_gpu_batch")


def newest_cases(runs: list[dict]) -> list[tuple[dict, tuple[str, int], list[dict]]]:
    """(run, case, rows): each case from the newest run with its measured 1-GPU row."""
    seen, out = set(), []
    for run in runs:
        for r in run["results"]:
            case = case_of(r)
            if case in seen or r.get("strategy") != "single" or "step_s" not in r:
                continue
            seen.add(case)
            out.append((run, case, [x for x in run["results"] if case_of(x) == case]))
    return sorted(out, key=lambda t: (t[1][0] != "dlrm", t[1][0], t[1][1]))


def _share(row: dict) -> str:
    shares = [g["collective_share"] for g in (row.get("profile") or {}).values()]
    return f"{100 * max(shares):.1f}%" if shares else "-"


def table(cases: list[tuple[dict, tuple[str, int], list[dict]]]) -> list[str]:
    """Markdown lines: one table row per (run, case, rows) row, with its run's efficiency."""
    lines = [
        "| workload | batch / GPU | GPUs | strategy | step ms | examples/s | efficiency "
        "| collectives | check |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for run, (workload, batch), rows in cases:
        eff = {
            (e["strategy"], e["num_gpus"]): e["efficiency"]
            for e in run.get("efficiency", [])
            if (e["workload"], e["per_gpu_batch"]) == (workload, batch)
        }
        for r in rows:
            head = f"| {workload} | {batch} | {r.get('num_gpus', '-')} | {r.get('strategy', '-')} |"
            if "step_s" not in r:
                lines.append(head + (" skipped" if "skipped" in r else " error") + " | - | - | - | - |")
                continue
            e = eff.get((r["strategy"], r["num_gpus"]))
            check = r.get("check", {}).get("ok", "-")
            lines.append(
                f"{head} {1e3 * r['step_s']:.2f} | {r['examples_per_s']:,.0f} | "
                f"{'-' if e is None else f'{e:.2f}'} | {_share(r)} | {check} |"
            )
    return lines


def section(runs: list[dict], link_root: Path) -> str:
    """Markdown: provenance, the table, the plot of the newest run."""
    cases = newest_cases(runs)
    if not cases:
        return "No scaling runs under `benchmarks/results/scaling/`.\n"
    used = sorted({id(run): run for run, _, _ in cases}.values(), key=lambda d: d["date"])
    lines = [
        "Runs: "
        + "; ".join(
            f"`{Path(r['_path']).name}` ({r['device']} x{r['num_devices']}, {r['date'][:10]}, "
            f"commit {r.get('commit', '?')[:7]}, jax {r.get('jax', '?')})"
            for r in used
        )
        + ".",
        "",
        *table(cases),
    ]
    plot = Path(used[-1]["_path"]).with_suffix(".png")
    if plot.exists():
        lines += ["", f"![scaling]({os.path.relpath(plot.resolve(), link_root)})"]
    return "\n".join(lines) + "\n"
