"""Compression planning from a memory budget: which tables become TT, at which rank, and
which stay dense (``docs/planner.md``).

``plan_tables(tables, budget_bytes, ...)`` returns a ``TablePlan``: the ``TableConfig``s of
a ``TTEmbeddingCollection`` whose step fits ``budget_bytes`` as ``estimate_memory`` counts
it (parameters, optimizer state, activations and kernel scratch), and a report per table.

The rule:

1. **Options.** Each table may be TT at a rank of ``ranks`` (capped at full rank; ranks
   whose core shapes the kernels refuse are dropped, with a note) or dense. TT options
   that cost at least the dense table's bytes are dropped: a table whose dense bytes are
   at most TT's at the smallest rank is *tiny* and dense from the start.
2. **Start.** Every table at its cheapest option; if that does not fit, the single-table
   moves that shrink the collection's estimate most (packs make bytes non-additive) until
   none does; if that does not fit either, ``ValueError`` with the bytes it needs and the
   tables that dominate.
3. **Small tables dense.** Tables of fewer than ``dense_below`` rows become dense first,
   smallest first, while the budget allows: below that size a TT table is slower than the
   dense one (measured: ``docs/planner.md``) and saves little.
4. **Rank and cache where the traffic is.** Then, repeatedly, the move (a table to any
   higher option: a rank, a rank with a hot-row cache, dense) of the highest
   ``(gain in modelled hits) / (added bytes)`` that fits. A table's modelled hits are
   ``ids per batch * coverage(k)``: the share of its lookups that go to its ``k`` most
   popular rows under a bounded Zipf law fitted to the sample's ids and unique ids
   (``fit_zipf``), ``k`` = its cached rows plus ``TT_ROW_WORTH`` times the rows' worth of
   parameters its TT stores (``num_params / dim``; dense: every row).

Deterministic: the same inputs give the same plan (ties go to the earlier table).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np

from flowtt_jax.collection.config import SparseUpdate, TableConfig, check_tables
from flowtt_jax.kernels import ffi
from flowtt_jax.memory import BatchStats, MemoryEstimate, estimate_memory
from flowtt_jax.ops.pooled import kernels_unsupported_reason
from flowtt_jax.tt.spec import TTSpec

__all__ = [
    "DEFAULT_RANKS",
    "DENSE_BELOW",
    "STEP_SLACK",
    "TableChoice",
    "TablePlan",
    "fit_zipf",
    "plan_tables",
    "zipf_coverage",
]

DEFAULT_RANKS = (4, 8, 16, 32, 64)
#: Rows under which a table is made dense first (rule 3): the measured rows where one
#: table's training step (1024 ids, Adam) is as fast dense as TT at rank 4 on 2 CPU cores.
DENSE_BELOW = 4096
#: The step-time model (``_step_cost``, in dense row-element updates): a TT id costs this
#: many, calibrated by ``DENSE_BELOW`` (a 4,096-row dense table's full update, 5 passes over
#: N x D, takes the time of 1,024 TT ids at rank 4).
TT_ID_COST = 20.0
#: How much slower (modelled) than the fastest plan the planner passed on its way a plan may
#: make the step by default (``plan_tables(step_slack=...)``).
STEP_SLACK = 0.1
#: Passes over a parameter per training step: read, gradient written and read, update, and
#: an Adam-like optimizer's two slots.
STEP_PASSES = 5
#: What one row's worth of TT parameters (``num_params / dim``) holds, in exact rows, in the
#: hits model (rule 4) where a table may take a cache: TT rows share their cores, so a TT
#: parameter holds less than a cached row's (the compression study: hashed dense beat TT at
#: 10-100x fewer bytes). Without cache options the TT's rows' worth counts whole.
TT_ROW_WORTH = 0.5
#: Hot-row cache sizes the planner tries per TT table, as fractions of its rows (each
#: rounded up to 64 rows; ``plan_tables(cache=True)`` with a traffic sample).
CACHE_FRACTIONS = (1 / 1024, 1 / 128, 1 / 16)
_EXACT = 4096  # Zipf ranks summed exactly; past them, geometric bins / the integral
_MAX_ZIPF = 8.0


# ----------------------------------------------------------------------------- skew model
def _tail_mass(lo, hi, a: float):
    """``integral_lo^hi x^-a dx`` (floats or float64 arrays ``lo``, ``hi``)."""
    if abs(a - 1.0) < 1e-9:
        return np.log(hi / lo)
    return (hi ** (1.0 - a) - lo ** (1.0 - a)) / (1.0 - a)


def _mass(num_rows: int, a: float, k: float) -> float:
    """``sum_{i <= k} i^-a`` over ranks ``1..num_rows`` (exact up to ``_EXACT``, then the
    integral from ``_EXACT + 0.5`` to ``k + 0.5``)."""
    k = min(float(k), float(num_rows))
    head = np.arange(1, min(int(k), _EXACT) + 1, dtype=np.float64)
    total = float(np.sum(head**-a))
    if k > _EXACT:
        total += float(_tail_mass(_EXACT + 0.5, k + 0.5, a))
    elif k > int(k):  # a fractional row: linear within it
        total += (k - int(k)) * (int(k) + 1) ** -a
    return total


def zipf_coverage(num_rows: int, a: float, k: float) -> float:
    """Share of lookups that hit the ``k`` most popular of ``num_rows`` rows when ids follow
    a bounded Zipf law of exponent ``a`` (``p_i ~ i^-a``, ``i = 1..num_rows``); in [0, 1]."""
    if k >= num_rows:
        return 1.0
    return _mass(num_rows, a, k) / _mass(num_rows, a, num_rows)


def _expected_unique(num_rows: int, ids: int, a: float) -> float:
    """Expected unique rows among ``ids`` draws from the bounded Zipf law."""
    norm = _mass(num_rows, a, num_rows)
    head = np.arange(1, min(num_rows, _EXACT) + 1, dtype=np.float64)
    p = head**-a / norm
    total = float(np.sum(-np.expm1(ids * np.log1p(-np.minimum(p, 1.0 - 1e-16)))))
    if num_rows > _EXACT:  # geometric bins of ranks, each at its mean probability
        edges = np.unique(np.round(np.geomspace(_EXACT + 0.5, num_rows + 0.5, 2000)))
        lo, hi = edges[:-1], edges[1:]
        count = hi - lo
        p_bin = _tail_mass(lo, hi, a) / norm / count
        total += float(np.sum(count * -np.expm1(ids * np.log1p(-p_bin))))
    return total


@functools.lru_cache(maxsize=4096)
def fit_zipf(num_rows: int, ids: int, unique: int) -> float:
    """The exponent ``a`` in [0, 8] of the bounded Zipf law over ``num_rows`` rows under which
    ``ids`` draws give ``unique`` expected unique rows (bisection: more skew, fewer uniques).
    0 (uniform) when ``unique`` reaches the uniform law's expectation."""
    if ids <= 0 or unique <= 0:
        raise ValueError(f"fit_zipf needs ids >= 1 and unique >= 1, got ids={ids}, unique={unique}")
    if unique >= _expected_unique(num_rows, ids, 0.0):
        return 0.0
    lo, hi = 0.0, _MAX_ZIPF
    if unique <= _expected_unique(num_rows, ids, hi):
        return hi
    for _ in range(40):
        mid = 0.5 * (lo + hi)
        if _expected_unique(num_rows, ids, mid) > unique:
            lo = mid
        else:
            hi = mid
    return round(0.5 * (lo + hi), 6)


# ----------------------------------------------------------------------------- the plan
@dataclasses.dataclass(frozen=True)
class TableChoice:
    """One table of a plan. Bytes are the table's alone (``estimate_memory`` of it by itself
    on its features' ids): ``activation_bytes`` includes its parameters' gradient when
    training and its kernel scratch. ``zipf_a``: the fitted skew (None: no sample);
    ``coverage``: the modelled share of its lookups its bytes hold; ``note``: why its kind;
    ``cache_rows``: its hot-row cache (0: none)."""

    name: str
    kind: str
    rank: int | tuple[int, ...] | None
    row_shape: tuple[int, ...] | None
    num_embeddings: int
    ids_per_batch: int
    zipf_a: float | None
    parameter_bytes: int
    optimizer_bytes: int
    activation_bytes: int
    coverage: float
    note: str = ""
    cache_rows: int = 0


@dataclasses.dataclass(frozen=True)
class TablePlan:
    """A compression plan: ``tables`` (``TableConfig``s for ``TTEmbeddingCollection``, in
    the input's order), ``choices`` (one report row per table), ``estimate`` (the whole
    collection's ``MemoryEstimate``, at most ``budget``) and plan-wide ``notes``."""

    tables: tuple[TableConfig, ...]
    choices: tuple[TableChoice, ...]
    estimate: MemoryEstimate
    budget: int
    notes: tuple[str, ...] = ()
    step_cost: float = 0.0  # the modelled training step (``_step_cost``, summed over tables)

    @property
    def total(self) -> int:
        return self.estimate.total

    @property
    def parameter_bytes(self) -> int:
        return self.estimate.parameters

    def __str__(self) -> str:
        head = (
            "table",
            "kind",
            "rank",
            "row shape",
            "rows",
            "cache",
            "ids",
            "zipf",
            "params",
            "opt",
            "act",
            "cover",
        )
        body = [
            (
                c.name,
                c.kind,
                "-" if c.rank is None else str(c.rank),
                "-" if c.row_shape is None else "x".join(map(str, c.row_shape)),
                f"{c.num_embeddings:,}",
                f"{c.cache_rows:,}" if c.cache_rows else "-",
                f"{c.ids_per_batch:,}",
                "-" if c.zipf_a is None else f"{c.zipf_a:.2f}",
                _fmt(c.parameter_bytes),
                _fmt(c.optimizer_bytes),
                _fmt(c.activation_bytes),
                f"{c.coverage:.3f}",
            )
            for c in self.choices
        ]
        widths = [max(len(r[i]) for r in [head, *body]) for i in range(len(head))]

        def line(row: Sequence[str], note: str = "") -> str:
            cells = (x.ljust(w) if i < 4 else x.rjust(w) for i, (x, w) in enumerate(zip(row, widths)))
            return ("  ".join(cells) + "  " + note).rstrip()

        e = self.estimate
        return "\n".join(
            [line(head, "note"), *(line(r, c.note) for r, c in zip(body, self.choices))]
            + [
                f"collection: parameters {_fmt(e.parameters)}, optimizer state {_fmt(e.optimizer_state)}, "
                f"activations {_fmt(e.activation_bytes)}, scratch {_fmt(e.scratch)}; total {_fmt(e.total)} "
                f"of {_fmt(self.budget)} ({e.total / self.budget:.0%})"
            ]
            + [f"note: {n}" for n in self.notes]
        )


def _fmt(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


@dataclasses.dataclass(frozen=True)
class _Option:
    config: TableConfig
    estimate: MemoryEstimate  # the table alone
    held: float  # rows' worth of parameters (dense: every row)
    step: float = 0.0  # modelled training-step cost (``_step_cost``)

    @property
    def bytes(self) -> int:
        return self.estimate.total


@dataclasses.dataclass(frozen=True)
class _Table:
    options: tuple[_Option, ...]  # ascending bytes; the last is dense
    hits: tuple[float, ...]  # each option's modelled hits per batch
    ids: int  # ids per batch over its features (0: none in the sample)
    zipf_a: float | None
    notes: tuple[str, ...]


def _as_configs(tables: Mapping[str, int] | Sequence[int] | Sequence[TableConfig], dim: int | None):
    if isinstance(tables, Mapping) or not all(isinstance(t, TableConfig) for t in tables):
        if dim is None:
            raise TypeError("plan_tables: pass dim= with cardinalities (TableConfigs carry their own)")
        items = (
            tables.items() if isinstance(tables, Mapping) else ((f"t{i}", n) for i, n in enumerate(tables))
        )
        return [TableConfig(name, n, dim) for name, n in items]
    wrong = [t.name for t in tables if dim is not None and t.features != dim]
    if wrong:
        raise ValueError(f"plan_tables: dim={dim} but tables {wrong} have another dim")
    try:
        return list(check_tables(tables))  # up front: duplicate names, a feature read twice
    except ValueError as e:
        raise ValueError(f"plan_tables: {e}") from None


def _machine_reason() -> str | None:
    """Why no TT table runs the kernels here whatever its shape (then shapes are not
    checked, and the plan says so), or None."""
    if not ffi.available():
        return "the compiled kernels are not built: every TT table runs the pure-JAX reference"
    arch = ffi.cuda_arch_reason()
    return f"{arch}: every TT table runs the pure-JAX reference here" if arch else None


def _kernel_reason(spec: TTSpec, check: bool) -> str | None:
    """Why the kernels of this machine (and the CUDA ones, where built) refuse ``spec``."""
    if not check:
        return None
    shapes = [jax.ShapeDtypeStruct(s, np.float32) for s in spec.core_shapes]
    reason = kernels_unsupported_reason(shapes)
    if reason is None and spec.num_cores == 3:
        reason = ffi.cuda_unsupported_reason(spec.core_shapes) or ffi.cuda_unsupported_reason(
            spec.core_shapes, True
        )
    return reason


def _step_cost(cfg: TableConfig, ids: int) -> float:
    """A table's modelled training-step cost, in dense row-element updates: a dense table
    updated in full passes over its ``N x D`` parameters ``STEP_PASSES`` times; one updated
    sparsely (``TableConfig.sparse``) over its ids' rows; a TT table pays ``TT_ID_COST`` per
    id and element, plus its cores' passes."""
    d = cfg.features
    if cfg.kind == "dense":
        return float(STEP_PASSES * d * (max(ids, 1) if cfg.sparse is not None else cfg.num_embeddings))
    return TT_ID_COST * ids * d + STEP_PASSES * cfg.num_params


def _table_options(
    base: TableConfig,
    ranks: Sequence[int],
    stats: BatchStats,
    traffic: BatchStats | None,
    kw: dict,
    check: bool,
    dense_update: SparseUpdate | None = None,
    cache: bool = False,
) -> _Table:
    feats = base.feature_keys
    alone = BatchStats(
        stats.batch_size,
        {f: stats.ids[f] for f in feats if f in stats.ids},
        {base.name: stats.unique[base.name]} if base.name in stats.unique else {},
    )
    ids = unique = 0
    if traffic is not None:
        ids = sum(traffic.ids.get(f, 0) for f in feats)
        unique = min(traffic.unique.get(base.name, 0), ids)
    dense_cfg = dataclasses.replace(base, kind="dense", sparse=dense_update)
    dense = _Option(
        dense_cfg,
        estimate_memory([dataclasses.replace(dense_cfg, sparse=None)], alone, **kw),
        float(base.num_embeddings),
        _step_cost(dense_cfg, ids),
    )
    options, seen, notes = [], set(), []
    zipf_a = fit_zipf(base.num_embeddings, ids, unique) if ids and unique else None
    caches = _cache_sizes(base.num_embeddings) if cache and zipf_a is not None else (0,)
    for r in sorted(set(ranks)):
        spec = dataclasses.replace(base, kind="tt", rank=r, cache_rows=0).spec()
        inner = spec.ranks[1:-1]
        if inner in seen:
            continue
        seen.add(inner)
        reason = _kernel_reason(spec, check)
        if reason is not None:
            notes.append(f"rank {r} dropped: {reason}")
            continue
        for c in caches:
            cfg = dataclasses.replace(
                base, kind="tt", rank=inner[0] if len(set(inner)) == 1 else inner, cache_rows=c
            )
            opt = _Option(
                cfg,
                estimate_memory([cfg], alone, **kw),
                (TT_ROW_WORTH if len(caches) > 1 else 1.0) * spec.num_params / base.features,
                _step_cost(cfg, ids),
            )
            if opt.bytes < dense.bytes:
                options.append(opt)
    if len(caches) > 1:  # ranks x caches: by bytes
        options.sort(key=lambda o: o.bytes)
    options.append(dense)
    weight = 1 if traffic is None else ids  # no sample: every table read once a batch
    hits = tuple(weight * _coverage(base.num_embeddings, zipf_a, o) for o in options)
    return _Table(tuple(options), hits, ids, zipf_a, tuple(notes))


def _cache_sizes(num_rows: int) -> tuple[int, ...]:
    """0 and the ``CACHE_FRACTIONS`` of ``num_rows``, each rounded up to 64 rows, below them."""
    sizes = {-(-int(num_rows * f) // 64) * 64 for f in CACHE_FRACTIONS}
    return (0, *sorted(c for c in sizes if 0 < c < num_rows))


def _coverage(num_rows: int, zipf_a: float | None, option: _Option) -> float:
    """The modelled share of a table's lookups ``option`` holds: its cache's rows exactly
    (the hottest), then its TT's rows' worth (``held``, from the next hottest on)."""
    cfg = option.config
    if cfg.kind == "dense":
        return 1.0
    a = zipf_a or 0.0
    return zipf_coverage(num_rows, a, cfg.cache_rows + option.held)


def plan_tables(
    tables: Mapping[str, int] | Sequence[int] | Sequence[TableConfig],
    budget_bytes: int,
    *,
    dim: int | None = None,
    stats: BatchStats | None = None,
    traffic: BatchStats | None = None,
    optimizer: Any = None,
    training: bool = True,
    ranks: Sequence[int] = DEFAULT_RANKS,
    dense_below: int = DENSE_BELOW,
    step_slack: float | None = STEP_SLACK,
    dense_update: SparseUpdate | None = None,
    cache: bool = True,
) -> TablePlan:
    """Which tables become TT and at which rank, the rest dense, so that the collection's
    step fits ``budget_bytes`` (the rule: this module's docstring, ``docs/planner.md``).

    Args:
      tables: ``{name: rows}``, a list of rows (names ``t0, t1, ...``; both need ``dim``) or
        ``TableConfig``s (their names, dims, features, modes and capacities are kept; kind and
        rank are planned).
      budget_bytes: what ``estimate_memory`` of the plan may total.
      stats: ``BatchStats`` of sample batches (``BatchStats.measure``): sizes the activations
        and scratch; None: they are not counted (a budget of parameters and optimizer state).
      traffic: the ``BatchStats`` rank is allocated by (ids and unique ids per table);
        default ``stats``. Without either, every table counts as read uniformly, once a batch.
      optimizer: an optax transform whose state counts (None: no state).
      training: count the step's parameter gradients (and the backward's buffers).
      ranks: TT ranks to choose from (each capped at a table's full rank).
      dense_below: tables with fewer rows are made dense first while the budget allows.
      step_slack: the planner knows time too: a move (a higher rank, or dense for a table of
        ``dense_below`` rows or more) is taken only if the plan's modelled training step
        (``_step_cost``: a dense table updated in full costs its rows, a TT table its ids and
        its cores' passes) stays within ``1 + step_slack`` of the fastest plan on its way, so
        a larger budget does not buy a step that much slower than a smaller budget's (a large
        table stays TT rather than dense and updated in full every step). None: bytes and
        traffic only (the accuracy-per-byte plan, whatever its step time).
      dense_update: a ``SparseUpdate`` the dense tables of the plan get (``TableConfig.sparse``:
        their touched rows updated only, so a dense table costs its ids, not its rows).
      cache: a TT table may also hold a hot-row cache (``TableConfig.cache_rows``, of
        ``CACHE_FRACTIONS`` of its rows) where a traffic sample gives its skew: the cached rows
        count as exact hits, its TT's rows' worth as ``TT_ROW_WORTH`` each (rule 4).

    Raises ``ValueError`` when even the cheapest plan exceeds the budget, with its bytes and
    the tables that dominate them.
    """
    configs = _as_configs(tables, dim)
    if not configs:
        raise ValueError("plan_tables: no tables")
    if (
        isinstance(budget_bytes, bool)
        or not isinstance(budget_bytes, (int, float, np.integer, np.floating))
        or not np.isfinite(budget_bytes)
    ):
        raise ValueError(f"plan_tables: budget_bytes must be a finite number of bytes, got {budget_bytes!r}")
    if int(budget_bytes) < 1 or not ranks or min(ranks) < 1:
        raise ValueError(f"plan_tables: need budget_bytes >= 1 and ranks >= 1, got {budget_bytes}, {ranks}")
    budget = int(budget_bytes)
    kw = {"optimizer": optimizer, "training": training}
    sizes = stats if stats is not None else BatchStats(0, {})
    machine = _machine_reason()
    traffic = traffic if traffic is not None else stats
    if step_slack is not None and not (isinstance(step_slack, (int, float)) and step_slack >= 0):
        raise ValueError(f"plan_tables: step_slack must be a number >= 0 or None, got {step_slack!r}")
    plan = [
        _table_options(c, ranks, sizes, traffic, kw, machine is None, dense_update, cache) for c in configs
    ]
    level = [0] * len(plan)

    def joint(lv: Sequence[int]) -> MemoryEstimate:
        return estimate_memory([t.options[i].config for t, i in zip(plan, lv)], sizes, **kw)

    est = joint(level)
    if est.total > budget:  # packs make bytes non-additive: look for a smaller plan nearby
        level, est = _descend(plan, level, est, joint)
    if est.total > budget:
        heavy = sorted(range(len(plan)), key=lambda t: -plan[t].options[level[t]].bytes)[:3]
        top = ", ".join(f"{configs[t].name} ({plan[t].options[level[t]].bytes:,} B)" for t in heavy)
        raise ValueError(
            f"plan_tables: no plan fits {budget:,} bytes: the smallest found (TT at ranks from "
            f"{min(ranks)}, dense where TT saves nothing) needs {est.total:,} bytes (parameters "
            f"{est.parameters:,}, optimizer state {est.optimizer_state:,}, activations "
            f"{est.activation_bytes:,}, scratch {est.scratch:,}); largest tables alone: {top}"
        )
    refused: set[tuple[int, int]] = set()

    def step_of(lv: Sequence[int]) -> float:
        return sum(t.options[i].step for t, i in zip(plan, lv))

    fastest = step_of(level)  # the fastest modelled step of the plans passed so far
    slowed: set[int] = set()  # tables a move of which was refused for the step's time
    while True:
        moves = []
        for t, table in enumerate(plan):
            now = table.options[level[t]]
            small = configs[t].num_embeddings < dense_below
            for i in range(level[t] + 1, len(table.options)):
                if (t, i) in refused:
                    continue
                cost = max(table.options[i].bytes - now.bytes, 1)
                if small and i == len(table.options) - 1:  # rule 3: dense first, cheapest first
                    moves.append((0, cost, 0.0, t, i))
                    continue
                gain = table.hits[i] - table.hits[level[t]]
                if gain > 0:
                    moves.append((1, -gain / cost, cost, t, i))
        if not moves:
            break
        *_, t, i = min(moves)
        trial = level.copy()
        trial[t] = i
        small_dense = i == len(plan[t].options) - 1 and configs[t].num_embeddings < dense_below
        if step_slack is not None and not small_dense and step_of(trial) > (1 + step_slack) * fastest:
            refused.add((t, i))
            slowed.add(t)
            continue
        trial_est = joint(trial)
        if trial_est.total <= budget:
            level, est = trial, trial_est
            fastest = min(fastest, step_of(level))
            refused = {(u, j) for u, j in refused if u != t}
        else:
            refused.add((t, i))
    choices = tuple(
        _choice(c, table, level[t], dense_below, t in slowed and table.options[level[t]].config.kind == "tt")
        for t, (c, table) in enumerate(zip(configs, plan))
    )
    notes = (machine,) if machine else ()
    tables_out = tuple(t.options[i].config for t, i in zip(plan, level))
    return TablePlan(tables_out, choices, est, budget, notes, step_of(level))


def _descend(
    plan: Sequence[_Table], level: list[int], est: MemoryEstimate, joint: Any
) -> tuple[list[int], MemoryEstimate]:
    """The plan from ``level`` down the steepest single-table moves in ``joint``'s total,
    to a plan no one move shrinks: a shape group's tables at distinct ranks form separate
    packs, whose activations can total less than the group's."""
    while True:
        best = None
        for t, table in enumerate(plan):
            for i in range(len(table.options)):
                if i != level[t]:
                    trial = level.copy()
                    trial[t] = i
                    e = joint(trial)
                    if e.total < (best[1].total if best else est.total):
                        best = (trial, e)
        if best is None:
            return level, est
        level, est = best


def _choice(base: TableConfig, table: _Table, level: int, dense_below: int, slowed: bool) -> TableChoice:
    opt = table.options[level]
    cfg, e = opt.config, opt.estimate
    notes = list(table.notes)
    if slowed:
        notes.append(
            "a larger option would slow the step (step_slack; dense_update= updates touched rows only)"
        )
    if cfg.kind == "dense":
        if len(table.options) == 1:
            notes.append("tiny: TT saves no bytes")
        elif base.num_embeddings < dense_below:
            notes.append(f"small: < dense_below={dense_below:,} rows")
    elif base.num_embeddings < dense_below:
        notes.append("small, but dense did not fit the budget")
    if cfg.kind == "tt" and cfg.cache_rows:
        hot = zipf_coverage(base.num_embeddings, table.zipf_a or 0.0, cfg.cache_rows)
        notes.append(f"cache: its {cfg.cache_rows:,} hottest rows hold {hot:.0%} of its lookups")
    spec = cfg.spec() if cfg.kind == "tt" else None
    return TableChoice(
        base.name,
        cfg.kind,
        cfg.rank if spec else None,
        spec.row_shape if spec else None,
        base.num_embeddings,
        table.ids,
        table.zipf_a,
        e.parameters,
        e.optimizer_state,
        e.activation_bytes + e.scratch,
        _coverage(base.num_embeddings, table.zipf_a, opt),
        "; ".join(notes),
        cfg.cache_rows,
    )
