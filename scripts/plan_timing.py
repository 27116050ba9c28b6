"""Device time of the plan op, whole (sort) against forward-only (the bitmap where it
applies), over table sizes and batch sizes: where the bitmap pays, to set
``plan_bitmap::kWordsPerId`` (cuda/contract/plan_bitmap.h) from measurements.

Zipf(1.05) ids scattered over the table as the benchmarks draw them, prefix extent 250.
Prints one line per (num_rows, n) and writes ``plan_timing.json`` to ``--out``:

    python3 -m scripts.plan_timing --out $OUT
"""

from __future__ import annotations

import argparse
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.timing import timed
from benchmarks.workloads import HASH
from flowtt_jax.kernels import ffi


def zipf_ids(n: int, num_rows: int, seed: int = 0) -> np.ndarray:
    ranks = np.random.default_rng(seed).zipf(1.05, n).astype(np.uint64) - 1
    return ((ranks * np.uint64(HASH)) % np.uint64(num_rows)).astype(np.int32)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=".")
    ap.add_argument("--rows", default="1000000,10000000,50000000")
    ap.add_argument("--ns", default="4096,16384,65536,262144,1048576")
    args = ap.parse_args()
    records = []
    for num_rows in map(int, args.rows.split(",")):
        for n in map(int, args.ns.split(",")):
            ids = jnp.asarray(zipf_ids(n, num_rows))
            rec = {"num_rows": num_rows, "n": n, "bitmap": ffi.plan_bitmap_applies(n, num_rows)}
            for name, fwd in (("whole", False), ("forward_only", True)):
                fn = jax.jit(lambda x, fwd=fwd, r=num_rows: ffi.plan(x, 250, r, fwd))
                t = timed(fn, (ids,))
                kernels = t.get("profile", {}).get("kernels_ms")
                rec[name] = {"ms": t["ms"], "method": t["method"], "kernels_ms": kernels}
            records.append(rec)
            print(
                f"rows {num_rows:>10} n {n:>8} bitmap {rec['bitmap']!s:5} "
                f"whole {rec['whole']['ms']:.4f} ms  forward-only {rec['forward_only']['ms']:.4f} ms",
                flush=True,
            )
    os.makedirs(args.out, exist_ok=True)
    doc = {"device": str(jax.devices()[0]), "commit": os.environ.get("FLOWTT_COMMIT"), "records": records}
    with open(os.path.join(args.out, "plan_timing.json"), "w") as f:
        json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
