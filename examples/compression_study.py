"""What a memory budget buys: the DLRM on synthetic Criteo-format data at several embedding
budgets, three ways at each, scored on held-out data (AUC, log loss).

    python examples/compression_study.py                  # CPU scale (about 13 minutes on 2 cores)
    python examples/compression_study.py --docs docs/planner.md   # also rewrite the docs' table

At each budget (``--factors``: 10x, 100x, 1000x fewer bytes than the dense tables) the
embedding parameters get at most that many bytes, spent:

- ``uniform``: one TT rank for every table, the largest that fits (``make_table_configs``;
  tables under ``DENSE_BELOW`` rows dense when that fits, else none);
- ``planner``: ``flowtt_jax.plan_tables`` (ranks ``--planner-ranks``: 2 and ``DEFAULT_RANKS``;
  small tables dense first, rank where the sample batches' traffic is; ``docs/planner.md``);
- ``planner_cache``: the same with hot-row caches (``plan_tables(cache=True)``: a TT table
  may hold its hottest rows dense, ``TableConfig.cache_rows``), the hot ids counted on the
  sample batches (``TTEmbeddingCollection.refresh_cache``);
- ``hashed``: dense tables of at most ``m`` rows, ids hashed by ``id mod m`` (the hashing
  trick), ``m`` the largest that fits;
- ``dense`` (with ``--methods dense``): the uncompressed tables, the ceiling (once, at 1x).

The GPU study (issue 54; >= 10 M examples a run, 3 seeds, full cardinalities)::

    python examples/compression_study.py --steps 2442 --batch-size 4096 --eval-batches 64 \
        --seeds 0 1 2 --methods dense hashed uniform planner planner_cache --crossover-rows

The budget counts parameters only (all three train with Adam, whose state is twice the
parameters for every method alike). The data (``criteo_synth.py``) give the tables reasons
to differ: the Criteo Kaggle cardinalities, a Zipf exponent per feature (uniform in
``--zipf-range``) and a teacher weight per feature (log-normal, sigma 1, root-mean-square 1),
drawn from ``--data-seed``; the planner sees the skew and the traffic of sample batches,
never the labels. Also measured (``--crossover-rows``): one table's training step, dense
against TT, by rows: the crossover behind ``DENSE_BELOW``.

Writes the JSON (device, date, commit, arguments, per run: method, budget, embedding bytes,
AUC, log loss, tables) to ``--out`` and a plot of AUC and log loss against embedding bytes
to ``--plot``; ``results_table(doc)`` and ``crossover_table(doc)`` are the Markdown tables
``--docs`` writes (``--from-json`` redoes the plot and tables from a run's JSON).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import re
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import flowtt_jax as ftt
from flowtt_jax.collection import TableConfig, make_table_configs
from flowtt_jax.memory import BatchStats, estimate_memory
from flowtt_jax.nnx import TTEmbeddingCollection
from flowtt_jax.planner import DEFAULT_RANKS, DENSE_BELOW

if __package__:  # imported as examples.compression_study
    from .criteo_synth import SynthConfig, SynthCriteo
    from .dlrm import DLRM, bce, embedding_bytes, roc_auc
else:  # run as a script (its folder is sys.path[0])
    from criteo_synth import SynthConfig, SynthCriteo
    from dlrm import DLRM, bce, embedding_bytes, roc_auc

ROOT = Path(__file__).resolve().parents[1]
METHODS = ("uniform", "planner", "planner_cache", "hashed", "dense")


# ----------------------------------------------------------------------------- the three ways
def param_bytes(tables: Sequence[TableConfig]) -> int:
    """Parameter bytes of a collection of ``tables`` (float32), as ``estimate_memory`` counts."""
    return estimate_memory(tables, BatchStats(0, {}), training=False).parameters


def uniform_tables(cards: dict[str, int], dim: int, budget: int) -> list[TableConfig] | None:
    """One rank for every TT table, the largest in 1..64 within ``budget`` (small tables dense
    when that fits, else every table TT); None if not even rank 1 fits."""
    for threshold in (DENSE_BELOW, 0):
        fits = [
            r
            for r in range(1, 65)
            if param_bytes(make_table_configs(cards, dim, rank=r, dense_threshold=threshold)) <= budget
        ]
        if fits:
            return make_table_configs(cards, dim, rank=max(fits), dense_threshold=threshold)
    return None


def hashed_rows(cards: dict[str, int], dim: int, budget: int) -> int:
    """The largest ``m`` with ``sum_t min(N_t, m) * dim * 4 <= budget`` (bisection)."""
    lo, hi = 0, max(cards.values())
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if sum(min(n, mid) for n in cards.values()) * dim * 4 <= budget:
            lo = mid
        else:
            hi = mid - 1
    return lo


def make_data(args: argparse.Namespace) -> SynthCriteo:
    """The study's data: per-feature skew and signal drawn from ``--data-seed``."""
    rng = np.random.default_rng([args.data_seed, 44])
    zipf = rng.uniform(*args.zipf_range, 26).round(3)
    signal = rng.lognormal(0.0, 1.0, 26)
    signal = (signal / np.sqrt(np.mean(signal**2))).round(3)
    config = SynthConfig(
        max_rows=args.max_rows or None,
        seed=args.data_seed,
        feature_zipf_a=tuple(float(a) for a in zipf),
        feature_signal=tuple(float(s) for s in signal),
    )
    return SynthCriteo(config)


# ----------------------------------------------------------------------------- training
def train_eval(
    tables: Sequence[TableConfig],
    data: SynthCriteo,
    args,
    seed: int,
    rows: int | None = None,
    samples: Sequence[dict] = (),
) -> dict:
    """Trains the DLRM over ``tables`` (ids ``mod rows`` when given; init ``seed``) for
    ``--steps`` batches of stream 0; AUC and log loss on ``--eval-batches`` batches of stream 1.
    Cached tables hold the hottest ids of the sample batches ``samples`` (feature dicts)."""
    model = DLRM(tables, dim=args.dim, bottom=args.bottom, top=args.top, rngs=nnx.Rngs(seed))
    if any(t.cache_rows for t in tables):
        model.embeddings.refresh_cache(samples)
    emb_bytes = embedding_bytes(model)
    opt = nnx.Optimizer(model, optax.adam(args.lr), wrt=nnx.Param)
    graphdef, state = nnx.split((model, opt))
    del model, opt
    mod = None if rows is None else np.minimum(np.array(data.cardinalities, np.int32), rows)

    def ids(sparse):
        return sparse if mod is None else sparse % jnp.asarray(mod)

    @functools.partial(jax.jit, donate_argnums=0)
    def step(state, dense, sparse, labels):
        model, opt = nnx.merge(graphdef, state)
        loss, grads = nnx.value_and_grad(lambda m: bce(m(dense, ids(sparse)), labels))(model)
        opt.update(model, grads)
        return nnx.state((model, opt)), loss

    @jax.jit
    def predict(state, dense, sparse):
        return nnx.merge(graphdef, state)[0](dense, ids(sparse))

    t0 = time.perf_counter()
    for i in range(args.steps):
        d, s, y, _ = data.batch(i, args.batch_size, stream=0)
        state, loss = step(state, d, s, y)
        if i == 0:
            loss.block_until_ready()
            t1 = time.perf_counter()  # the steps after the compile
    loss = float(loss)
    seconds = time.perf_counter() - t0
    step_ms = 1e3 * (time.perf_counter() - t1) / max(args.steps - 1, 1)
    scores, labels = [], []
    for i in range(args.eval_batches):
        d, s, y, _ = data.batch(i, args.batch_size, stream=1)
        scores.append(np.asarray(predict(state, d, s)))
        labels.append(np.asarray(y))
    scores, labels = np.concatenate(scores), np.concatenate(labels)
    return {
        "embedding_bytes": emb_bytes,
        "auc": roc_auc(labels, scores),
        "logloss": float(bce(jnp.asarray(scores), jnp.asarray(labels))),
        "train_loss": loss,
        "train_seconds": seconds,
        "step_ms": step_ms,
    }


def measure_crossover(rows: Sequence[int], ranks: Sequence[int], batch: int, reps: int = 20) -> list[dict]:
    """Seconds of one table's training step (``batch`` Zipf(1.2) ids, dim 16, Adam), dense
    and TT at each of ``ranks``, for each table size in ``rows`` (best of 3 x ``reps``)."""

    def seconds(cfg: TableConfig) -> float:
        coll = TTEmbeddingCollection([cfg], rngs=nnx.Rngs(0))
        opt = nnx.Optimizer(coll, optax.adam(1e-3), wrt=nnx.Param)
        rng = np.random.default_rng(0)
        ids = jnp.asarray((rng.zipf(1.2, batch) - 1) % cfg.num_embeddings, jnp.int32)

        @nnx.jit
        def step(coll, opt, ids):
            loss, grads = nnx.value_and_grad(lambda c: (c({cfg.name: ids})[cfg.name] ** 2).sum())(coll)
            opt.update(coll, grads)
            return loss

        step(coll, opt, ids).block_until_ready()
        best = float("inf")
        for _ in range(3):
            t = time.perf_counter()
            for _ in range(reps):
                out = step(coll, opt, ids)
            out.block_until_ready()
            best = min(best, (time.perf_counter() - t) / reps)
        return best

    out = []
    for n in rows:
        row = {"rows": n, "dense_s": seconds(TableConfig("t", n, 16, kind="dense"))}
        row.update({f"tt{r}_s": seconds(TableConfig("t", n, 16, rank=r)) for r in ranks})
        print("crossover " + "  ".join(f"{k} {v:.3g}" if k != "rows" else f"{v:>7}" for k, v in row.items()))
        out.append(row)
    return out


# ----------------------------------------------------------------------------- report
def describe(tables: Sequence[TableConfig]) -> list[list]:
    return [
        [t.name, t.kind, t.rank if t.kind == "tt" else None, t.num_embeddings, t.cache_rows] for t in tables
    ]


def summarize(doc: dict) -> list[dict]:
    """One row per (budget, method) in run order: the seeds' mean AUC and log loss and their
    half range (``*_pm``), or the run's ``error``."""
    groups: dict[tuple, list[dict]] = {}
    for r in doc["runs"]:
        groups.setdefault((r["factor"], r["method"]), []).append(r)
    rows = []
    for runs in groups.values():
        row = {k: runs[0][k] for k in ("factor", "method", "budget_bytes", "hashed_rows")}
        if "error" in runs[0]:
            rows.append({**row, "error": runs[0]["error"]})
            continue
        row.update(embedding_bytes=runs[0]["embedding_bytes"], tables=runs[0]["tables"], seeds=len(runs))
        for key in ("auc", "logloss"):
            v = np.array([r[key] for r in runs])
            row[key], row[f"{key}_pm"] = float(v.mean()), float(np.ptp(v) / 2)
        row["step_ms"] = float(np.mean([r.get("step_ms", np.nan) for r in runs]))
        rows.append(row)
    return rows


def results_table(doc: dict) -> str:
    """The runs as a Markdown table: per budget and method, embedding bytes, AUC and log loss
    (mean over the seeds +- half their range) and the tables."""
    a = doc["args"]
    lines = [
        f"{doc['device']}, {doc['date'][:10]}, commit `{doc['commit'][:8]}`; {a['steps']} steps x "
        f"{a['batch_size']}, seeds {a['seeds']}, held-out {a['eval_batches'] * a['batch_size']:,} examples "
        f"(Bayes AUC {doc['bayes_auc']:.4f}); dense tables {doc['dense_bytes'] / 2**20:,.0f} MiB; "
        f"{doc['elapsed_s'] / 60:.1f} min in all.\n",
        "| budget | method | embedding bytes | AUC | log loss | step ms | tables |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in summarize(doc):
        budget = f"{r['factor']}x ({r['budget_bytes'] / 2**20:.2f} MiB)"
        if "error" in r:
            need = re.search(r"needs ([\d,]+) bytes", r["error"])
            why = f"no plan: the smallest needs {need.group(1)} bytes" if need else r["error"]
            lines.append(f"| {budget} | {r['method']} | - | - | - | - | {why} |")
            continue
        kinds = [t[1] for t in r["tables"]]
        ranks = {str(tuple(t[2]) if isinstance(t[2], list) else t[2]) for t in r["tables"] if t[1] == "tt"}
        ranks = sorted(ranks, key=lambda x: (len(x), x))
        cached = sum(t[4] for t in r["tables"] if len(t) > 4)
        what = (
            f"rows <= {r['hashed_rows']:,}"
            if r["method"] == "hashed"
            else f"{kinds.count('tt')} TT (rank {', '.join(ranks)}), {kinds.count('dense')} dense"
            + (f", {cached:,} rows cached" if cached else "")
        )
        lines.append(
            f"| {budget} | {r['method']} | {r['embedding_bytes'] / 2**20:.2f} MiB | {r['auc']:.4f} +- "
            f"{r['auc_pm']:.4f} | {r['logloss']:.4f} +- {r['logloss_pm']:.4f} | {r['step_ms']:.1f} | {what} |"
        )
    return "\n".join(lines) + "\n"


def crossover_table(doc: dict) -> str:
    """The crossover runs as a Markdown table: a training step's time by rows, dense and TT."""
    runs = doc["crossover"]
    ranks = [k[2:-2] for k in runs[0] if k.startswith("tt")]
    lines = [
        f"One table, dim 16, {doc['args']['batch_size']} Zipf(1.2) ids, forward + backward + Adam; "
        f"{doc['device']}, {doc['date'][:10]}, commit `{doc['commit'][:8]}`:\n",
        "| rows | dense | " + " | ".join(f"TT rank {r}" for r in ranks) + " |",
        "|---" * (2 + len(ranks)) + "|",
    ]
    for r in runs:
        tt = " | ".join(f"{r[f'tt{k}_s'] * 1e3:.2f} ms" for k in ranks)
        lines.append(f"| {r['rows']:,} | {r['dense_s'] * 1e3:.2f} ms | {tt} |")
    return "\n".join(lines) + "\n"


def plot(doc: dict, path: Path) -> None:
    """AUC and log loss against embedding bytes (log x), one line per method (the seeds'
    mean, bars: their range)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in summarize(doc) if "error" not in r]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for method, marker in zip(METHODS, "osD^*"):
        mine = sorted((r for r in rows if r["method"] == method), key=lambda r: r["embedding_bytes"])
        x = [r["embedding_bytes"] / 2**20 for r in mine]
        for ax, key in zip(axes, ("auc", "logloss")):
            y, pm = [r[key] for r in mine], [r[f"{key}_pm"] for r in mine]
            ax.errorbar(x, y, yerr=pm, marker=marker, capsize=3, label=method)
    for ax, what in zip(axes, ("held-out AUC", "held-out log loss")):
        ax.set_xscale("log")
        ax.set_xlabel("embedding parameter bytes (MiB, log)")
        ax.set_ylabel(what)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(title=f"Bayes AUC {doc['bayes_auc']:.3f}")
    fig.suptitle(
        f"DLRM, synthetic Criteo, budgets {', '.join(f'{f}x' for f in doc['args']['factors'])} below dense, "
        f"seeds {doc['args']['seeds']} ({doc['device']}, {doc['date'][:10]}, commit {doc['commit'][:8]})",
        fontsize=10,
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def replace_block(page: Path, name: str, body: str) -> None:
    """Rewrites ``page`` between ``<!-- {name}:start -->`` and ``<!-- {name}:end -->``."""
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    text = page.read_text()
    if start not in text or end not in text:
        raise SystemExit(f"{page} has no {start} ... {end} block")
    page.write_text(
        re.sub(re.escape(start) + ".*?" + re.escape(end), lambda _: f"{start}\n{body}{end}", text, flags=re.S)
    )


def _relative(path: Path) -> str:
    """``path`` relative to the repository when inside it (the JSON names no checkout)."""
    path = path.resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def commit() -> str:
    run = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=ROOT)
    return run.stdout.strip() or "unknown"


# ----------------------------------------------------------------------------- cli
def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument(
        "--factors", type=int, nargs="+", default=[10, 100, 1000, 10000], help="budgets: dense bytes / factor"
    )
    p.add_argument("--methods", nargs="+", choices=METHODS, default=[m for m in METHODS if m != "dense"])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=1024)
    p.add_argument("--eval-batches", type=int, default=32)
    p.add_argument("--sample-batches", type=int, default=4, help="batches the planner measures")
    p.add_argument(
        "--planner-ranks",
        type=int,
        nargs="+",
        default=[2, *DEFAULT_RANKS],
        help="the planner's ranks (rank 2 below the default's: the smallest budgets need it)",
    )
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--bottom", type=int, nargs="*", default=[64])
    p.add_argument("--top", type=int, nargs="*", default=[128, 64])
    p.add_argument(
        "--max-rows", type=int, default=0, help="cap rows by id mod cap (0: full Criteo cardinalities)"
    )
    p.add_argument("--zipf-range", type=float, nargs=2, default=[1.05, 1.5])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1], help="model init seeds (one run each)")
    p.add_argument("--data-seed", type=int, default=0)
    p.add_argument("--crossover-rows", type=int, nargs="*", default=[1000, 2000, 4096, 8192, 16384, 65536])
    p.add_argument("--out", type=Path, default=None, help="JSON (default: benchmarks/results/cpu/...)")
    p.add_argument("--plot", type=Path, default=ROOT / "benchmarks/results/plots/compression_study.png")
    p.add_argument(
        "--docs",
        type=Path,
        default=None,
        help="rewrite this page's compression-study and dense-crossover blocks",
    )
    p.add_argument(
        "--from-json", type=Path, default=None, help="report this run's JSON (plot, tables), no training"
    )
    return p.parse_args(argv)


def report(doc: dict, plot_path: Path, docs: Path | None) -> None:
    """The plot, the tables printed, and ``docs``' blocks rewritten, from a run's document."""
    plot(doc, plot_path)
    print(results_table(doc))
    if "crossover" in doc:
        print(crossover_table(doc))
    if docs:
        replace_block(docs, "compression-study", results_table(doc))
        if "crossover" in doc:
            replace_block(docs, "dense-crossover", crossover_table(doc))


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.from_json:
        doc = json.loads(args.from_json.read_text())
        report(doc, args.plot, args.docs)
        return doc
    t_start = time.perf_counter()
    dev = jax.devices()[0]
    now = datetime.datetime.now(datetime.timezone.utc)
    data = make_data(args)
    cards = {f"C{i + 1}": n for i, n in enumerate(data.cardinalities)}
    dense_bytes = sum(cards.values()) * args.dim * 4
    samples = [
        np.asarray(data.batch(10**6 + i, args.batch_size, stream=0)[1]) for i in range(args.sample_batches)
    ]
    samples = [{name: s[:, f] for f, name in enumerate(cards)} for s in samples]
    traffic = BatchStats.measure(samples, make_table_configs(cards, args.dim))
    bayes = []
    for i in range(args.eval_batches):
        _, _, y, logit = data.batch(i, args.batch_size, stream=1)
        bayes.append((np.asarray(y), np.asarray(logit)))
    doc = {
        "study": "compression",
        "device": f"{dev.platform}:{dev.device_kind}",
        "date": now.isoformat(timespec="seconds"),
        "commit": commit(),
        "jax": jax.__version__,
        "args": {k: (_relative(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "data": {
            "cardinalities": list(data.cardinalities),
            "zipf_a": list(data.config.feature_zipf_a),
            "signal": list(data.config.feature_signal),
        },
        "dense_bytes": dense_bytes,
        "bayes_auc": roc_auc(np.concatenate([b[0] for b in bayes]), np.concatenate([b[1] for b in bayes])),
        "planner": {"ranks": args.planner_ranks, "dense_below": DENSE_BELOW},
        "runs": [],
    }
    out = args.out or ROOT / f"benchmarks/results/cpu/compression_study_{dev.platform}_{now:%Y-%m-%d}.json"
    print(f"dense tables {dense_bytes:,} bytes; Bayes AUC {doc['bayes_auc']:.4f}; budgets {args.factors}x")
    plans = [(1, m) for m in args.methods if m == "dense"]
    plans += [(f, m) for f in args.factors for m in args.methods if m != "dense"]
    for factor, method in plans:
        budget = dense_bytes // factor
        run = {"method": method, "factor": factor, "budget_bytes": budget, "hashed_rows": None}
        tables = None
        if method == "uniform":
            tables = uniform_tables(cards, args.dim, budget)
            if tables is None:
                run["error"] = f"not even rank 1 fits {budget:,} bytes"
        elif method == "dense":
            tables = make_table_configs(cards, args.dim, all_dense=True)
        elif method.startswith("planner"):
            try:
                plan = ftt.plan_tables(
                    cards,
                    budget,
                    dim=args.dim,
                    traffic=traffic,
                    training=False,
                    ranks=args.planner_ranks,
                    step_slack=None,  # accuracy per byte: the study's question
                    cache=method == "planner_cache",
                )
                print(plan)
                tables = list(plan.tables)
            except ValueError as e:
                run["error"] = str(e)
        else:
            run["hashed_rows"] = hashed_rows(cards, args.dim, budget)
            capped = {k: min(n, run["hashed_rows"]) for k, n in cards.items()}
            tables = make_table_configs(capped, args.dim, all_dense=True)
        if tables is None:
            print(f"{factor:>5}x {method:<8} {run['error']}")
            doc["runs"].append(run)
            continue
        for seed in args.seeds:
            trained = train_eval(tables, data, args, seed, run["hashed_rows"], samples)
            result = {**run, "seed": seed, **trained}
            result["tables"] = describe(tables)
            doc["runs"].append(result)
            print(
                f"{factor:>5}x {method:<8} seed {seed} {result['embedding_bytes'] / 2**20:9.2f} MiB  "
                f"AUC {result['auc']:.4f}  log loss {result['logloss']:.4f}  "
                f"step {result['step_ms']:.1f} ms ({result['train_seconds']:.0f} s)",
                flush=True,
            )
    if args.crossover_rows:
        doc["crossover"] = measure_crossover(args.crossover_rows, (4, 16), args.batch_size)
    doc["elapsed_s"] = time.perf_counter() - t_start
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1) + "\n")
    report(doc, args.plot, args.docs)
    print(f"wrote {out} and {args.plot} ({doc['elapsed_s']:.0f} s)")
    return doc


if __name__ == "__main__":
    main()
