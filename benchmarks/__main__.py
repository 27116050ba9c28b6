"""Runs the benchmark suite: ``python -m benchmarks [options]`` (``--help`` lists them).

Suites: ``single`` (the single-table sweep of ``workloads.single_table``: D x rank x batch x
ids) and ``collection`` (``workloads.MetaLikeCollection`` with T tables at each batch), for
every implementation of ``benchmarks.impls.REGISTRY`` that serves the suite; ``--stage``
picks a named part that fits one 10-minute device call on an H200 (``STAGES``), or
``scaling``: weak scaling over the GPUs of one host (``benchmarks/scaling.py``, its own
JSON under ``<out-dir>/scaling/``; the rest of this text is the single-device suites');
``--weighted`` runs each single-table case a second time with per-id weights (case ``<name>_w``,
e.g. ``S1_weighted``), its forward + backward then also w.r.t. the weights.

For each case, implementation and mode (forward; forward + backward w.r.t. the parameters,
the backward seeded by ``out - target``, the cotangent of a squared error, so it can only
start once the forward's output exists, as in a training step: with a constant cotangent
XLA runs the backward's pooling before the forward's rows and keeps both ``[nnz, D]``
buffers live, a peak no training step has):
compile time, device time (``benchmarks.timing``), XLA's memory analysis plus the flowtt
kernels' run-time scratch, the device's peak bytes in use, parameter bytes, compression and
the fraction of the FLOP floor (TT; the byte floor for the dense bag) reached. Before a
compile or a run the runner checks the time budget and the device's free memory and records
why it skips instead. A compile that overruns ``--compile-timeout`` (or the budget left)
ends the run: it goes on in the background and would disturb later timings. Order: the
single-table cases one after the other (the ids distributions of a shape share compiles);
collections ours first, then every forward, then every forward + backward, so a budget cut
or an overrun drops the costliest compiles. The JSON is rewritten after every measurement,
so a run cut short (budget, error, SIGTERM) keeps what it measured; plots come last.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import itertools
import os
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from . import impls as impls_mod
from . import plots, records, scaling, timing
from .workloads import MetaLikeCollection, Workload, single_table

STAGES = {
    "single-d32": {"suite": "single", "dims": (32,)},
    "single-d128": {"suite": "single", "dims": (128,)},
    "collection": {"suite": "collection"},
    "scaling": {"suite": "scaling"},
}
FULL = {
    "dims": (32, 128),
    "ranks": (32, 64),
    "dists": ("uniform", "zipf1.05", "zipf1.2"),
    "single_batches": (4096, 32768, 65536),
    "collection_batches": (4096, 32768),
    "tables": (240, 480, 788),
    "num_embeddings": 10**7,
    "row_shape": (200, 200, 250),
    "rows_range": (1e4, 4e7),
    "collection_rank": 32,
    "dlrm_batches": (4096, 32768),  # the scaling stage's, per GPU
    "meta_cases": ((788, 4096), (240, 32768)),  # (tables, batch per GPU)
}
QUICK = {
    "dims": (32,),
    "ranks": (8,),
    "dists": ("uniform", "zipf1.05"),
    "single_batches": (32, 128),
    "collection_batches": (32,),
    "tables": (2, 3),
    "num_embeddings": 10**5,
    "row_shape": None,
    "rows_range": (1e3, 1e5),
    "collection_rank": 8,
    "dlrm_batches": (32,),
    "meta_cases": ((3, 32),),
}
ALIASES = {"D32_r32_B32768_zipf1.05": "S1", "D32_r32_B32768_zipf1.05_w": "S1_weighted"}
MODES = ("fwd", "fwd_bwd")
#: The scaling stage's time budget when --time-budget is not given (seconds).
SCALING_BUDGET = 420.0
#: Compile time of a per-table loop grows at least linearly in the tables (issue 12: 240
#: tables 20 s / 39 s on an H200, 788 not done in 5 minutes): estimated as ~ T^1.5.
LOOP_COMPILE_EXPONENT = 1.5
MEMORY_HEADROOM = 0.95


class Interrupted(BaseException):
    """SIGTERM (a device call's timeout); not an ``Exception``, so the per-measurement
    error handlers let it through."""


def single_kwargs(
    sizes: dict, dim: int, rank: int, batch: int, dist: str, seed: int, weighted: bool = False
) -> dict:
    """``workloads.single_table`` arguments of a single-table case at ``sizes`` (FULL/QUICK);
    ``weighted`` appears only when true, so unweighted cases keep their JSON."""
    return dict(
        num_embeddings=sizes["num_embeddings"],
        dim=dim,
        rank=rank,
        batch=batch,
        dist=dist,
        seed=seed,
        row_shape=sizes["row_shape"],
        **({"weighted": True} if weighted else {}),
    )


def meta_collection(sizes: dict, tables: int, seed: int) -> MetaLikeCollection:
    """The Meta-like collection of ``tables`` tables at ``sizes`` (FULL/QUICK)."""
    rows_range, rank = sizes["rows_range"], sizes["collection_rank"]
    return MetaLikeCollection.create(tables, seed, rows_range=rows_range, rank=rank)


def _on_signal(signum: int, frame: Any) -> None:
    raise Interrupted(signal.Signals(signum).name)


def _csv(kind: Callable[[str], Any]) -> Callable[[str], tuple]:
    return lambda s: tuple(kind(x) for x in s.split(",") if x)


def _meta_case(s: str) -> tuple[int, int]:
    tables, batch = s.split("x")
    return int(tables), int(batch)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description=__doc__.split("\n\n")[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--quick", action="store_true", help="tiny sizes (CPU, well under a minute)")
    ap.add_argument(
        "--suite",
        choices=("single", "collection", "all", "scaling"),
        default=None,
        help="default: all = single + collection (or the stage's)",
    )
    ap.add_argument(
        "--stage",
        choices=tuple(STAGES),
        help="a named part of the suite: " + "; ".join(f"{k} = {v}" for k, v in STAGES.items()),
    )
    ap.add_argument(
        "--out-dir",
        default=os.path.join(tempfile.gettempdir(), "flowtt_jax_bench"),
        help="JSON and plots go here (scaling: its scaling/); default outside the repository, "
        "pass benchmarks/results to record a run",
    )
    ap.add_argument("--batches", type=_csv(int), help="bags per feature, e.g. 4096,32768")
    ap.add_argument("--tables", type=_csv(int), help="collection sizes, e.g. 240,480,788")
    ap.add_argument("--dims", type=_csv(int), help="single table: embedding dims")
    ap.add_argument("--ranks", type=_csv(int), help="single table: TT ranks")
    ap.add_argument("--dists", type=_csv(str), help="single table: uniform,zipf1.05,zipf1.2")
    ap.add_argument("--impls", type=_csv(str), help=f"subset of {', '.join(impls_mod.REGISTRY)}")
    ap.add_argument(
        "--weighted",
        action="store_true",
        help="single table: also run each case with float32 per-id weights, U[0.5, 1.5) "
        "(case <name>_w right after <name>; S1's is S1_weighted); fwd+bwd also w.r.t. the weights",
    )
    ap.add_argument(
        "--time-budget",
        type=float,
        help=f"seconds; later measurements are skipped (scaling: default {SCALING_BUDGET:.0f})",
    )
    ap.add_argument(
        "--compile-timeout",
        type=float,
        default=300.0,
        help="seconds one compile may take (default 300) before the run ends",
    )
    ap.add_argument(
        "--max-loop-tables",
        type=int,
        default=240,
        help="largest collection a per-table loop is compiled for (default 240)",
    )
    ap.add_argument("--seed", type=int, default=0)
    g = ap.add_argument_group("the scaling stage (--stage scaling)")
    g.add_argument("--gpus", type=_csv(int), help="GPU counts (default: 1 and every GPU)")
    g.add_argument(
        "--dlrm-batches", type=_csv(int), help="DLRM batches per GPU (default 4096,32768; quick 32)"
    )
    g.add_argument(
        "--meta-cases",
        type=_csv(_meta_case),
        help="Meta-like collections as TABLESxBATCH_PER_GPU (default 788x4096,240x32768; quick 3x32)",
    )
    g.add_argument(
        "--strategies", type=_csv(str), help=f"subset of {','.join(scaling.STRATEGIES)} (default: both)"
    )
    g.add_argument(
        "--workers", type=int, help="processes drawing the Meta-like batches (default: cores, <= 32)"
    )
    a = ap.parse_args(argv)
    stage = STAGES.get(a.stage, {})
    a.suite = a.suite or stage.get("suite", "all")
    a.dims = a.dims or stage.get("dims")
    if a.weighted and a.suite in ("collection", "scaling"):
        ap.error("--weighted applies to the single suite only")
    unknown = set(a.impls or ()) - set(impls_mod.REGISTRY)
    if unknown:
        ap.error(f"unknown --impls {sorted(unknown)}; known: {list(impls_mod.REGISTRY)}")
    suite_only = ("batches", "tables", "dims", "ranks", "dists", "impls")
    scaling_only = ("gpus", "dlrm_batches", "meta_cases", "strategies", "workers")
    for name in suite_only if a.suite == "scaling" else scaling_only:
        if getattr(a, name) is not None:
            ap.error(f"--{name.replace('_', '-')} does not apply to the {a.suite} suite")
    if a.suite == "scaling":
        sizes = QUICK if a.quick else FULL
        a.dlrm_batches = sizes["dlrm_batches"] if a.dlrm_batches is None else a.dlrm_batches
        a.meta_cases = sizes["meta_cases"] if a.meta_cases is None else a.meta_cases
        a.strategies = a.strategies or scaling.STRATEGIES
        if set(a.strategies) - set(scaling.STRATEGIES):
            ap.error(f"--strategies: a subset of {scaling.STRATEGIES}")
        a.workers = a.workers or min(32, os.cpu_count() or 1)
        a.time_budget = SCALING_BUDGET if a.time_budget is None else a.time_budget
    return a


@dataclasses.dataclass(eq=False)
class Case:
    """A planned case: its JSON record, how to draw it, and what its units share."""

    entry: dict
    draw: Callable[[], Workload]
    tables: int
    dense_bytes: int
    share: tuple  # compiled executables are shared by the cases with the same key
    cores_key: tuple  # and TT cores by the cases with the same tables
    data: tuple | None = None  # (workload, ids, offsets, weights or None, cotangent) once drawn


class Runner(records.Run):
    """Measures the planned units (case, impl, mode), records results or skip reasons."""

    def __init__(self, a: argparse.Namespace, path: Path, doc: dict):
        super().__init__(a, path, doc)
        self.sizes = QUICK if a.quick else FULL
        self.compiled: dict[tuple, dict] = {}
        self.cores: dict[tuple, impls_mod.TTCores] = {}
        self.params: dict[tuple, Any] = {}
        self.loop_compiles: dict[tuple[str, str], tuple[int, float]] = {}
        self.failed_compile: dict[tuple[str, str], int] = {}
        self.units = self.plan()

    def impls_for(self, suite: str) -> list[impls_mod.Impl]:
        return [
            i
            for i in impls_mod.REGISTRY.values()
            if suite in i.suites and (not self.a.impls or i.name in self.a.impls)
        ]

    # ---- the plan ----------------------------------------------------------------------
    def plan(self) -> list[tuple[Case, impls_mod.Impl, str]]:
        a, s = self.a, self.sizes
        units: list[tuple[Case, impls_mod.Impl, str]] = []
        if a.suite in ("single", "all"):
            impls = sorted(self.impls_for("single"), key=lambda i: not i.ours)
            grid = itertools.product(
                a.dims or s["dims"],
                a.ranks or s["ranks"],
                a.batches or s["single_batches"],
                a.dists or s["dists"],
                (False, True) if a.weighted else (False,),
            )
            for dim, rank, batch, dist, weighted in grid:
                kw = single_kwargs(s, dim, rank, batch, dist, a.seed, weighted)
                name = f"D{dim}_r{rank}_B{batch}_{dist}" + ("_w" if weighted else "")
                entry = {
                    "suite": "single",
                    "case": name,
                    "alias": None if a.quick else ALIASES.get(name),
                    "workload": kw,
                    "impls": {},
                }
                case = Case(
                    entry,
                    lambda kw=kw: single_table(**kw),
                    1,
                    s["num_embeddings"] * dim * 4,
                    (dim, rank, batch, weighted),
                    (dim, rank),
                )
                units += [(case, i, m) for i in impls for m in MODES]
        if a.suite in ("collection", "all"):
            cases = []
            for batch in a.batches or s["collection_batches"]:
                for tables in a.tables or s["tables"]:
                    coll = meta_collection(s, tables, a.seed)
                    tt_bytes = sum(sp.num_params for sp in coll.specs) * 4
                    stats = {
                        "tables": tables,
                        "batch": batch,
                        "rows": int(coll.rows.sum()),
                        "dense_param_bytes": coll.dense_param_bytes,
                        "tt_param_bytes": tt_bytes,
                        "compression_ratio": coll.dense_param_bytes / tt_bytes,
                        "expected_mean_pooling": float(coll.pooling_mean.mean()),
                        "one_hot_tables": int(coll.one_hot.sum()),
                    }
                    entry = {
                        "suite": "collection",
                        "case": f"meta{tables}_B{batch}",
                        "alias": None,
                        "workload": {**coll.params, "batch": batch},
                        "stats": stats,
                        "impls": {},
                    }
                    cases.append(
                        Case(
                            entry,
                            lambda c=coll, b=batch: c.draw(b),
                            tables,
                            coll.dense_param_bytes,
                            (tables, batch),
                            ("meta", tables),
                        )
                    )
            impls = self.impls_for("collection")
            for i in impls:
                if i.ours:
                    units += [(c, i, m) for c in cases for m in MODES]
            for m in MODES:
                units += [(c, i, m) for i in impls if not i.ours for c in cases]
        self.last: dict[tuple, int] = {}
        for k, (case, impl, _) in enumerate(units):
            for key in (("params", id(case), impl.name), ("case", id(case)), ("cores", case.cores_key)):
                self.last[key] = k
        self.doc["cases"] = list({id(c): c.entry for c, _, _ in units}.values())
        return units

    # ---- running -----------------------------------------------------------------------
    def run(self) -> None:
        for k, (case, impl, mode) in enumerate(self.units):
            if self.bar is not None:
                self.bar.set_description(f"{case.entry['case']} {impl.name} {mode}"[:60])
            rec = case.entry["impls"].setdefault(impl.name, {"description": impl.description})
            reason = self.stop_reason or self.skip_reason(case, impl, mode)
            if reason is None:
                rec[mode] = self.unit(case, impl, mode, rec)
            else:
                rec[mode] = {"skipped": reason}
            self.log(
                f"[{k + 1}/{len(self.units)} {time.monotonic() - self.t0:.0f}s] "
                f"{case.entry['case']} {impl.name} {mode}: {_summary(rec[mode])}"
            )
            self.release(k, case, impl)
            self.write()
            if self.bar is not None:
                self.bar.update(1)

    def finish(self, code: int) -> int:
        """The plots; prints where the JSON went."""
        doc = self.doc
        doc["plots"] = plots.draw_all([doc], self.path.parent, prefix=self.path.stem + "_")
        self.write()
        errors = sum(
            "error" in r.get(m, {}) for c in doc["cases"] for r in c["impls"].values() for m in MODES
        )
        print(
            f"wrote {self.path} ({doc['status']}, {len(doc['cases'])} cases, {errors} errors, "
            f"{doc['elapsed_s']:.0f} s)",
            flush=True,
        )
        return code

    def skip_reason(self, case: Case, impl: impls_mod.Impl, mode: str) -> str | None:
        """Why (case, impl, mode) is not run, known before drawing or compiling, or None."""
        if self.remaining() <= 0:
            return f"time budget ({self.a.time_budget:.0f} s) used up"
        if impl.per_table_loop and case.tables > self.a.max_loop_tables:
            return (
                f"per-table loop over {case.tables} tables not compiled: above --max-loop-tables "
                f"{self.a.max_loop_tables} (on an H200 the 240-table loop of ours compiled in ~20 s "
                f"fwd / ~39 s fwd+bwd and 788 tables did not compile in 5 minutes, issue 12)"
            )
        for m in MODES if mode == "fwd_bwd" else ("fwd",):
            failed = self.failed_compile.get((impl.name, m))
            if failed is not None and case.tables >= failed:
                return f"the {m} of its {failed}-table loop did not compile in time"
        if impl.dense:
            held = self.params.get((id(case), impl.name))  # the table, when fwd allocated it
            free = timing.device_free_bytes() + sum(x.nbytes for x in jax.tree.leaves(held))
            need = case.dense_bytes * (2 if mode == "fwd_bwd" else 1)
            if need > MEMORY_HEADROOM * free:
                return (
                    f"dense tables{' + gradient' if mode == 'fwd_bwd' else ''} "
                    f"{need / 1e9:.1f} GB do not fit the device ({free / 1e9:.1f} GB free)"
                )
        key = (impl.name, mode)
        if (case.share, key) not in self.compiled and impl.per_table_loop and key in self.loop_compiles:
            t0, s0 = self.loop_compiles[key]
            est = s0 * (case.tables / t0) ** LOOP_COMPILE_EXPONENT
            if est > min(self.remaining(), self.a.compile_timeout):
                return (
                    f"compile estimated at {est:.0f} s ({s0:.0f} s for {t0} tables x (T/{t0})^"
                    f"{LOOP_COMPILE_EXPONENT}) > {min(self.remaining(), self.a.compile_timeout):.0f} s "
                    "(time budget left or --compile-timeout)"
                )
        return None

    def release(self, k: int, case: Case, impl: impls_mod.Impl) -> None:
        """Frees params, a case's device data and TT cores after the last unit using them."""
        if self.last[("params", id(case), impl.name)] == k:
            self.params.pop((id(case), impl.name), None)
        if self.last[("case", id(case))] == k:
            case.data = None
        if self.last[("cores", case.cores_key)] == k:
            self.cores.pop(case.cores_key, None)
        gc.collect()

    def drawn(self, case: Case) -> tuple:
        if case.data is None:
            t = time.monotonic()
            w = case.draw()
            stats = w.stats()
            case.entry["stats"] = {**case.entry.get("stats", {}), **stats, "draw_s": time.monotonic() - t}
            dim = sum(w.specs[f].embedding_dim for f in w.feature_table)
            cot = jax.random.normal(jax.random.key(2), (w.batch, dim), jnp.float32)
            weights = None if w.weights is None else jax.device_put(w.weights)
            case.data = (w, jax.device_put(w.ids), jax.device_put(w.offsets), weights, cot)
            self.log(
                f"{w.name}: {w.nnz} ids, mean pooling {stats['mean_pooling']:.2f}, "
                f"{100 * stats['unique_fraction']:.1f}% unique, drawn in "
                f"{case.entry['stats']['draw_s']:.1f} s"
            )
        if case.cores_key not in self.cores:
            self.cores[case.cores_key] = impls_mod.tt_cores(case.data[0])
        return case.data

    def unit(self, case: Case, impl: impls_mod.Impl, mode: str, rec: dict) -> dict:
        """One (case, impl, mode): draw, init, compile (or reuse), check memory, time, floors."""
        try:
            w, ids, offsets, weights, cot = self.drawn(case)
            pkey = (id(case), impl.name)
            if pkey not in self.params:
                self.params[pkey] = impl.init(w, self.cores[case.cores_key])
                if (impl.name, w.name) in impls_mod.CONSTRUCT_S:  # the layers' construction
                    rec["construct_s"] = impls_mod.CONSTRUCT_S[(impl.name, w.name)]
                rec["param_bytes"] = int(sum(x.nbytes for x in jax.tree.leaves(self.params[pkey])))
                rec["compression_ratio"] = case.entry["stats"]["dense_param_bytes"] / rec["param_bytes"]
            params, fwd = self.params[pkey], impl.build(w)
            if mode == "fwd":
                fn, args = fwd, (params, ids, offsets) + (() if weights is None else (weights,))
            elif weights is None:

                def fn(p, i, o, target):
                    out, vjp = jax.vjp(lambda pp: fwd(pp, i, o), p)
                    return out, vjp(out - target)[0]  # d/d out of ||out - target||^2 / 2

                args = (params, ids, offsets, cot)
            else:

                def fn(p, i, o, wt, target):  # gradients w.r.t. (params, weights)
                    out, vjp = jax.vjp(lambda pp, ww: fwd(pp, i, o, ww), p, wt)
                    return out, vjp(out - target)

                args = (params, ids, offsets, weights, cot)
            ckey = (case.share, (impl.name, mode))
            if ckey not in self.compiled:
                timeout = min(self.a.compile_timeout, max(self.remaining(), 1.0))
                try:
                    compiled, lower_s, compile_s = timing.compile_timed(fn, args, timeout)
                except timing.CompileTimeout as e:
                    self.failed_compile[(impl.name, mode)] = case.tables
                    self.stop_reason = (
                        f"not run: the {mode} compile of {impl.name} for "
                        f"{case.entry['case']} overran {timeout:.0f} s and goes on in "
                        "the background (it would disturb the timings)"
                    )
                    return {"skipped": f"{e} (--compile-timeout or the time budget left)"}
                self.compiled[ckey] = {
                    "compiled": compiled,
                    "lower_s": lower_s,
                    "compile_s": compile_s,
                    "memory": timing.memory_analysis(compiled),
                    "case": case.entry["case"],
                }
                if impl.per_table_loop and case.tables > 1:
                    self.loop_compiles[(impl.name, mode)] = (case.tables, lower_s + compile_s)
            c = self.compiled[ckey]
            res: dict[str, Any] = {
                "lower_s": c["lower_s"],
                "compile_s": c["compile_s"],
                "memory": c["memory"],
            }
            if c["case"] != case.entry["case"]:
                res["compiled_for"] = c["case"]
            scratch = None
            if impl.scratch is not None:
                try:
                    scratch = impl.scratch(w, mode)
                except Exception as e:  # noqa: BLE001  (the timing is still worth having)
                    res["scratch_error"] = f"{type(e).__name__}: {e}"
            if scratch is not None:
                res["scratch_bytes"] = scratch
            mem = c["memory"]
            res["peak_bytes"] = mem.get("peak_bytes", 0) + (scratch or 0)
            res["temp_bytes"] = mem.get("temp_size", 0) + (scratch or 0)
            need = mem.get("temp_size", 0) + mem.get("output_size", 0) + (scratch or 0)
            free = timing.device_free_bytes()
            if need > MEMORY_HEADROOM * free:
                res["skipped"] = (
                    f"needs {need / 1e9:.1f} GB (XLA temporaries + outputs"
                    f"{' + FFI scratch' if scratch else ''}) > {free / 1e9:.1f} GB free"
                )
                return res
            before = timing.memory_stats()
            small = self.a.quick or timing.method() == "queued"
            res.update(
                timing.timed(
                    c["compiled"],
                    args,
                    target_s=0.1 if small else 0.4,
                    max_iters=6 if small else 20,
                    repeats=3 if small else 5,
                )
            )
            after = timing.memory_stats()
            if before and after and "peak_bytes_in_use" in after:
                res["device_memory"] = {
                    "bytes_in_use_before": before.get("bytes_in_use"),
                    "peak_bytes_in_use": after["peak_bytes_in_use"],
                    "raised_peak": after["peak_bytes_in_use"] > before.get("peak_bytes_in_use", 0),
                }
            res["floor"] = self.floor(case.entry["stats"], impl, mode, res["ms"])
            return res
        except Exception as e:  # noqa: BLE001  (recorded, the run goes on)
            return {"error": f"{type(e).__name__}: {str(e)[:400]}"}

    def floor(self, stats: dict, impl: impls_mod.Impl, mode: str, ms: float) -> dict:
        """FLOP floor (TT) or byte floor (dense bag) of the call and the fraction reached.

        Dense bytes: ids (and weights) and rows read, bags written (forward); the backward
        adds the dense table gradient (JAX's vjp of a gather writes the whole table), the
        scatter's rows and the weights' gradient.
        """
        p = self.doc["peaks"] or {}
        if impl.dense:
            dim = stats["dense_param_bytes"] // (4 * stats["rows"])
            weights = stats["nnz"] * 4 if stats.get("weighted") else 0
            fwd = stats["nnz"] * (dim + 1) * 4 + weights + stats["batch"] * stats["features"] * dim * 4
            amount = fwd if mode == "fwd" else 2 * fwd + stats["dense_param_bytes"] + weights
            kind, rate = "bytes", p.get("hbm_bytes_per_s")
        else:
            amount, kind, rate = stats["flop_floor"][mode], "flops", p.get("fp32_flops")
        out = {"kind": kind, "amount": amount}
        if rate:
            out["ms_at_peak"] = amount / rate * 1e3
            out["fraction"] = out["ms_at_peak"] / ms
        return out


def _summary(r: dict) -> str:
    if "skipped" in r or "error" in r:
        return ("skipped: " + r["skipped"]) if "skipped" in r else ("error: " + r["error"])
    frac = r.get("floor", {}).get("fraction")
    return (
        f"{r['ms']:.3f} ms ({r['method']}), compile {r['lower_s'] + r['compile_s']:.1f} s, "
        f"peak {r['peak_bytes'] / 1e6:.1f} MB" + (f", {100 * frac:.1f}% of floor" if frac else "")
    )


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    signal.signal(signal.SIGTERM, _on_signal)
    stage, argv = a.stage or a.suite, sys.argv[1:] if argv is None else argv
    if a.suite == "scaling":
        # NVLink multicast off (the 2-GPU machine's rule), before jax starts its backends
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        path, doc = records.start(Path(a.out_dir) / "scaling", a, stage, argv)
        sizes = QUICK if a.quick else FULL
        runner: Runner | scaling.Runner = scaling.Runner(
            a, path, doc, lambda tables: meta_collection(sizes, tables, a.seed)
        )
    else:
        path, doc = records.start(Path(a.out_dir), a, stage, argv)
        doc.update(
            {
                "compile_timeout_s": a.compile_timeout,
                "max_loop_tables": a.max_loop_tables,
                "timing_method": timing.method(),
                "timing": timing.__doc__.split("\n\n")[1].replace("\n", " "),
                "peaks": timing.peaks(),
                "device_bytes_limit": (timing.memory_stats() or {}).get("bytes_limit"),
                "status": "running",
                "cases": [],
                "plots": {},
            }
        )
        runner = Runner(a, path, doc)
        try:
            from tqdm import tqdm

            # disable=None: no bar without a terminal (the per-measurement lines remain)
            runner.bar = tqdm(total=len(runner.units), unit="meas", dynamic_ncols=True, disable=None)
        except ImportError:
            print("tqdm not installed: progress is printed per measurement", flush=True)
    code = 0
    try:
        runner.write()
        runner.run()
        doc["status"] = runner.stop_reason or (
            "complete" if runner.remaining() > 0 else "time budget used up"
        )
    except (Interrupted, KeyboardInterrupt) as e:
        doc["status"] = f"interrupted ({e or 'SIGINT'})"
        code = 1
    finally:
        if runner.bar is not None:
            runner.bar.close()
        runner.write()
    code = runner.finish(code)
    if runner.stop_reason:  # a compile thread is still running: do not wait for it
        os._exit(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
