"""Forward temporary memory of tt_embedding_bag from XLA's memory analysis (no run).

Usage: python -m benchmarks.memory_cpu [--num-embeddings N] [--dim D] [--rank R]
                                       [--out results.json] [--readme docs/measurements.md]
Prints temp bytes for the FFI path and the XLA reference at several nnz, so one
can see which grows with nnz x r^2 (per-id gathered cores) and which does not;
``--readme`` rewrites the measurements page's memory table from this run.
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
from pathlib import Path

import jax
import jax.numpy as jnp

import flowtt_jax as ftt


def temp_bytes(spec: ftt.TTSpec, num_bags: int, bag_len: int, impl: str) -> int:
    cores = [jax.ShapeDtypeStruct(s, jnp.float32) for s in spec.core_shapes]
    nnz = num_bags * bag_len
    ids = jax.ShapeDtypeStruct((nnz,), jnp.int32)
    offsets = jax.ShapeDtypeStruct((num_bags + 1,), jnp.int32)
    fn = jax.jit(lambda c, i, o: ftt.tt_embedding_bag(c, i, offsets=o, mode="mean", impl=impl))
    return fn.lower(cores, ids, offsets).compile().memory_analysis().temp_size_in_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--num-embeddings", type=int, default=10**6)
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument("--bag-len", type=int, default=14)
    parser.add_argument("--out", help="write the results as JSON here")
    parser.add_argument("--readme", help="rewrite this page's memory block (docs/measurements.md)")
    args = parser.parse_args()
    spec = ftt.TTSpec.create(args.num_embeddings, args.dim, args.rank)
    results = []
    for num_bags in (1024, 4096, 16384):
        nnz = num_bags * args.bag_len
        row = {"num_bags": num_bags, "nnz": nnz, "nnz_r2_bytes": nnz * args.rank * args.rank * 4}
        for impl in ("ffi", "reference"):
            row[f"{impl}_temp_bytes"] = temp_bytes(spec, num_bags, args.bag_len, impl)
        results.append(row)
        print(
            f"B={num_bags:6d} nnz={nnz:7d}  ffi temp {row['ffi_temp_bytes'] / 2**20:8.2f} MiB"
            f"  reference temp {row['reference_temp_bytes'] / 2**20:9.2f} MiB"
            f"  (nnz*r^2*4 = {row['nnz_r2_bytes'] / 2**20:8.2f} MiB)"
        )
    commit = (
        subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parent
        ).stdout.strip()
        or "unknown"
    )
    record = {
        "spec": repr(spec),
        "device": jax.devices()[0].device_kind,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": commit,
        "bag_len": args.bag_len,
        "results": results,
    }
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    if args.readme:
        from benchmarks.report import replace_block

        rows = "".join(
            f"| {r['num_bags']} | {r['nnz']:,} | {r['ffi_temp_bytes'] / 2**20:.2f} MiB | "
            f"{r['reference_temp_bytes'] / 2**20:.2f} MiB |\n"
            for r in results
        )
        replace_block(
            args.readme,
            "memory",
            f"{spec!r}, bags of {args.bag_len} ids, {record['device']}, {record['date']}, "
            f"commit `{commit}`:\n\n| bags | nnz | fused (FFI) temp | XLA reference temp |\n"
            f"|---|---|---|---|\n{rows}",
        )


if __name__ == "__main__":
    main()
