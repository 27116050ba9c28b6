"""Top source lines of an Nsight Compute source-page export, by warp-stall samples.

Usage: python scripts/ncu_source_summary.py ncu_source_<kernel>.csv [top]
(the CSV that scripts/profile_kernels.sh writes; needs a -lineinfo build).
Prints the total samples, the kernel's stall reasons, then per source line:
file:line, samples, instructions executed and the three largest stall reasons.
"""

from __future__ import annotations

import csv
import sys


def read_lines(path: str) -> tuple[list[str], list[tuple[str, dict[str, str]]]]:
    """(column names, [(source file, row)]) of the CUDA-source rows (those with a line number)."""
    header: list[str] = []
    rows: list[tuple[str, dict[str, str]]] = []
    current = "?"
    with open(path, newline="") as f:
        for rec in csv.reader(f):
            if not rec:
                continue
            if rec[0] == "File Path":
                current = rec[1] if len(rec) > 1 else "?"
            elif rec[0] == "Line No":
                header = rec
            elif header and len(rec) == len(header) and rec[0]:
                rows.append((current, dict(zip(header, rec))))
    return header, rows


def main(path: str, top: int = 15) -> None:
    header, rows = read_lines(path)
    stalls = [h for h in header if h.startswith("stall_") and "Not Issued" not in h]

    def samples(r: dict[str, str]) -> int:
        return int(r.get("Warp Stall Sampling (All Samples)") or 0)

    print("total samples", sum(samples(r) for _, r in rows))
    totals = {s: sum(int(r.get(s) or 0) for _, r in rows) for s in stalls}
    print("stall reasons", sorted(totals.items(), key=lambda kv: -kv[1])[:8])
    for src, r in sorted(rows, key=lambda fr: -samples(fr[1]))[:top]:
        worst = sorted(((s, int(r.get(s) or 0)) for s in stalls), key=lambda kv: -kv[1])[:3]
        print(
            f"{src.rsplit('/', 1)[-1]}:{r['Line No']} samples {samples(r)} "
            f"inst {r.get('Instructions Executed', '?')} {worst}"
        )


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 15)
