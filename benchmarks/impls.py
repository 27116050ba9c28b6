"""The implementations the benchmarks compare: one registry, one calling convention.

An implementation turns a ``Workload`` into a forward ``fwd(params, ids, offsets, weights=None)``
over the packed bags (``ids [nnz]``, feature-major ``offsets [F*B + 1]``, optional float32
per-id ``weights [nnz]``) returning ``[B, F*D]`` (the features' sum-pooled bags side by side);
the runner times ``fwd`` and its vjp with respect to ``params`` (the core gradients; the dense
table's gradient for the dense bag), and to the weights too for a weighted workload. Every
implementation here takes weights.

- ``dense_bag``: the uncompressed tables, concatenated; one gather and one segment sum.
- ``tt_reference``: ``tt_embedding_bag(impl="reference")`` (TT from XLA ops) per table.
- ``tt_reference_dedup``: EcoRec's algorithm in XLA ops per table: ``jnp.unique`` of the ids
  (static size nnz), TT rows of the unique ids, gathered back and pooled.
- ``ours`` (single table) / ``ours_per_table_loop`` (collections): ``tt_embedding_bag``
  (impl="ffi", the fused kernels) per table, in one jitted loop over the tables.
- ``ours_batched``: ``tt_embedding_bag_group`` (impl="ffi"), the table-batched op: one plan
  and one launch per stage for every table of a shape group (packed cores); on a single
  table it is the T = 1 case, to compare with ``ours``.

Adding one (e.g. the table-batched op) is one decorated builder::

    @register("ours_batched", suites=("collection",), ours=True, init=pack, description="...")
    def _ours_batched(w: Workload) -> Fwd:
        ...  # return fwd(params, ids, offsets, weights=None) -> [B, F*D]

where ``pack(w, per_table_cores)`` makes its params (e.g. packed cores) and ``scratch=``
may report run-time scratch that XLA's memory analysis cannot see.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import flowtt_jax as ftt
from flowtt_jax import tt_embedding_bag_group
from flowtt_jax.kernels.group_plan import GroupLayout
from flowtt_jax.tt import reference

from .workloads import Workload

__all__ = ["Impl", "REGISTRY", "register", "tt_cores", "ffi_scratch_bytes"]

Fwd = Callable[..., jax.Array]  # fwd(params, ids, offsets, weights=None) -> [B, F*D]
TTCores = tuple[tuple[jax.Array, ...], ...]


def tt_cores(w: Workload, seed: int = 1) -> TTCores:
    """Per-table cores drawn on the host (rows of std 1/sqrt(D), as ``ftt.init_cores``)."""
    rng = np.random.default_rng(seed)
    out = []
    for spec in w.specs:
        std = (1.0 / spec.embedding_dim / math.prod(spec.ranks)) ** (1.0 / (2 * spec.num_cores))
        out.append(
            tuple(
                jax.device_put(rng.standard_normal(s, dtype=np.float32) * np.float32(std))
                for s in spec.core_shapes
            )
        )
    return tuple(out)


def _tt_param_bytes(w: Workload) -> int:
    return sum(s.num_params for s in w.specs) * 4


def _dense_param_bytes(w: Workload) -> int:
    return sum(s.dense_params for s in w.specs) * 4


@dataclasses.dataclass(frozen=True)
class Impl:
    """A registered implementation.

    Attributes:
      build: workload -> ``fwd(params, ids, offsets, weights=None)``.
      init: (workload, per-table TT cores) -> params (default: the cores themselves).
      param_bytes: workload -> bytes of params, known before they exist (memory checks).
      per_table_loop: its program grows with the number of tables (compile-time cap).
      ours: one of ours (runs before the baselines, so a time budget cuts those first).
      scratch: (workload, mode) -> run-time scratch bytes the op allocates outside XLA's
        memory analysis (added to the memory figures), or None where unknown.
    """

    name: str
    suites: tuple[str, ...]
    description: str
    build: Callable[[Workload], Fwd]
    init: Callable[[Workload, TTCores], Any]
    param_bytes: Callable[[Workload], int]
    per_table_loop: bool = False
    dense: bool = False
    ours: bool = False
    scratch: Callable[[Workload, str], int | None] | None = None


REGISTRY: dict[str, Impl] = {}


def register(
    name: str,
    *,
    suites: tuple[str, ...],
    description: str,
    init: Callable[[Workload, TTCores], Any] = lambda w, cores: cores,
    param_bytes: Callable[[Workload], int] = _tt_param_bytes,
    per_table_loop: bool = False,
    ours: bool = False,
    scratch: Callable[[Workload, str], int | None] | None = None,
    dense: bool = False,
) -> Callable[[Callable[[Workload], Fwd]], Callable]:
    """Decorator: registers a builder ``workload -> fwd`` under ``name`` (in registry order)."""

    def deco(build: Callable[[Workload], Fwd]) -> Callable[[Workload], Fwd]:
        REGISTRY[name] = Impl(
            name, suites, description, build, init, param_bytes, per_table_loop, dense, ours, scratch
        )
        return build

    return deco


def _bag_ids(offsets: jax.Array, n: int) -> jax.Array:
    """Bag of each position from CSR offsets: how many bag starts after 0 are <= it."""
    starts = jnp.zeros((n,), jnp.int32).at[offsets[1:-1]].add(1, mode="drop")
    return jnp.cumsum(starts)


def _per_table(
    bag: Callable[[tuple, jax.Array, jax.Array, ftt.TTSpec, jax.Array | None], jax.Array],
) -> Callable[[Workload], Fwd]:
    """Builder of a loop over the features: ``bag(cores, ids, offsets, spec, weights)`` ->
    [B, D] each (``weights`` None when unweighted)."""

    def build(w: Workload) -> Fwd:
        bounds, b = w.feature_bounds, w.batch

        def fwd(params, ids, offsets, weights=None):
            outs = []
            for f, t in enumerate(w.feature_table):
                s, e = bounds[f], bounds[f + 1]
                wt = None if weights is None else weights[s:e]
                outs.append(bag(params[t], ids[s:e], offsets[f * b : (f + 1) * b + 1] - s, w.specs[t], wt))
            return jnp.concatenate(outs, axis=1)

        return fwd

    return build


def _dense_init(w: Workload, cores: TTCores) -> jax.Array:
    dims = {s.embedding_dim for s in w.specs}
    if len(dims) != 1:
        raise ValueError(f"dense_bag needs one embedding dim, got {sorted(dims)}")
    rows = sum(s.num_embeddings for s in w.specs)
    shape = (rows, dims.pop())
    return jax.jit(lambda k: 0.01 * jax.random.normal(k, shape, jnp.float32))(jax.random.key(3))


@register(
    "dense_bag",
    suites=("single", "collection"),
    init=_dense_init,
    param_bytes=_dense_param_bytes,
    dense=True,
    description="uncompressed tables, concatenated: one gather + one segment sum",
)
def _dense_bag(w: Workload) -> Fwd:
    f_count, b = w.num_features, w.batch
    dim = w.specs[0].embedding_dim
    row_start = np.concatenate([[0], np.cumsum([s.num_embeddings for s in w.specs])])
    if row_start[-1] >= 2**31:
        raise ValueError(f"{row_start[-1]} rows do not fit int32 ids")
    feature_row = row_start[list(w.feature_table)].astype(np.int32)

    def fwd(table, ids, offsets, weights=None):
        bag = _bag_ids(offsets, ids.shape[0])
        if f_count > 1:
            ids = ids + jnp.asarray(feature_row)[bag // b]
        rows = jnp.take(table, ids, axis=0)
        if weights is not None:
            rows = rows * weights[:, None]
        out = jax.ops.segment_sum(rows, bag, num_segments=f_count * b)
        return out.reshape(f_count, b, dim).transpose(1, 0, 2).reshape(b, f_count * dim)

    return fwd


def _tt_bag(impl: str):
    def bag(cores, ids, offsets, spec, weights):
        return ftt.tt_embedding_bag(
            cores, ids, offsets=offsets, weights=weights, num_embeddings=spec.num_embeddings, impl=impl
        )

    return bag


def _dedup_bag(cores, ids, offsets, spec, weights):
    n, b = ids.shape[0], offsets.shape[0] - 1
    if n == 0:
        return jnp.zeros((b, spec.embedding_dim), jnp.float32)
    uniq, inv = jnp.unique(ids, size=n, fill_value=0, return_inverse=True)
    rows = reference.tt_rows(cores, uniq)[inv.reshape(-1)]
    if weights is not None:
        rows = rows * weights[:, None]
    return jax.ops.segment_sum(rows, _bag_ids(offsets, n), num_segments=b)


_SCRATCH_KEYS = {"fwd": ("plan_fwd", "bag_fwd"), "fwd_bwd": ("plan", "rows_fwd", "pool_bwd", "rows_bwd")}


def _single_table_scratch(spec: ftt.TTSpec, n: int, num_bags: int, mode: str) -> int:
    """Largest run-time scratch of the single-table CUDA calls of ``num_bags`` bags of ``n`` ids.

    ``fwd`` (no gradient): the plan and the fused bag forward run one after the other;
    ``fwd_bwd``: plan, rows forward, pooling backward and rows backward.
    """
    from flowtt_jax import _flowtt_cuda
    from flowtt_jax.ops.pooled import bag_chunk_rows

    s = _flowtt_cuda.scratch_bytes(
        *spec.row_shape,
        *spec.col_shape,
        spec.ranks[1],
        spec.ranks[2],
        n,
        bag_chunk_rows(spec.embedding_dim, num_bags),
    )
    return max(int(s.get(k, 0)) for k in _SCRATCH_KEYS[mode])


def ffi_scratch_bytes(w: Workload, mode: str) -> int | None:
    """Largest run-time scratch of one flowtt CUDA call over the features (None off GPU)."""
    if jax.default_backend() != "gpu":
        return None
    bounds = w.feature_bounds
    sizes = [(w.specs[t], bounds[f + 1] - bounds[f]) for f, t in enumerate(w.feature_table)]
    return max([_single_table_scratch(spec, n, w.batch, mode) for spec, n in sizes if n], default=0)


register(
    "tt_reference",
    suites=("single", "collection"),
    per_table_loop=True,
    description="TT from XLA ops (tt_embedding_bag impl='reference'), per table",
)(_per_table(_tt_bag("reference")))
register(
    "tt_reference_dedup",
    suites=("single", "collection"),
    per_table_loop=True,
    description="EcoRec's algorithm in XLA ops: unique ids (static size nnz), TT rows, "
    "gather back, pool; per table",
)(_per_table(_dedup_bag))
# the fused kernels per table, under one name per suite
for _name, _suite, _description in (
    ("ours", "single", "tt_embedding_bag impl='ffi' (the fused kernels)"),
    (
        "ours_per_table_loop",
        "collection",
        "tt_embedding_bag impl='ffi' called per table in one jitted loop (not the table-batched op)",
    ),
):
    register(
        _name,
        suites=(_suite,),
        per_table_loop=True,
        ours=True,
        scratch=ffi_scratch_bytes,
        description=_description,
    )(_per_table(_tt_bag("ffi")))


def _shape_groups(w: Workload) -> list[tuple[GroupLayout, tuple[int, ...]]]:
    """The workload's tables as shape groups: ``(layout, table indices)`` in first-seen order."""
    groups: dict[tuple, list[int]] = {}
    for t, spec in enumerate(w.specs):
        groups.setdefault((spec.col_shape, spec.ranks), []).append(t)
    return [(GroupLayout(tuple(w.specs[t] for t in ts)), tuple(ts)) for ts in groups.values()]


def _pack_groups(w: Workload, cores: TTCores) -> tuple[tuple[jax.Array, ...], ...]:
    return tuple(layout.pack([cores[t] for t in ts]) for layout, ts in _shape_groups(w))


#: Margin of the measured unique rows in ``ours_batched_capacity``'s capacities.
CAPACITY_MARGIN = 1.1


def group_capacities(w: Workload) -> tuple[int, ...]:
    """Per shape group: its batch's unique (table, id) rows times ``CAPACITY_MARGIN``, a
    multiple of 64 (what ``flowtt_jax.capacity.measure_unique_ids`` gives on this batch)."""
    bounds, caps = w.feature_bounds, []
    for _, ts in _shape_groups(w):
        keys = [
            np.int64(t) << 32 | w.ids[bounds[f] : bounds[f + 1]].astype(np.int64)
            for f, t in enumerate(w.feature_table)
            if t in ts
        ]
        unique = np.unique(np.concatenate(keys)).size if keys else 0
        caps.append(max(64, -(-math.ceil(unique * CAPACITY_MARGIN) // 64) * 64))
    return tuple(caps)


def batched_scratch_bytes(w: Workload, mode: str, capacities: tuple[int, ...] | None = None) -> int | None:
    """Largest run-time scratch of one CUDA call of the table-batched op over the shape
    groups (None off GPU): a one-table group's single-table calls, else the plan's sort of
    the group's (table, id) keys and the table-batched rows forward (and backward) of a
    pass (``capacities``: per group, else every id's)."""
    if jax.default_backend() != "gpu":
        return None
    from flowtt_jax import _flowtt_cuda

    bounds, worst = w.feature_bounds, 0
    for g, (layout, ts) in enumerate(_shape_groups(w)):
        n = sum(bounds[f + 1] - bounds[f] for f, t in enumerate(w.feature_table) if t in ts)
        if n == 0:
            continue
        spec = layout.specs[0]
        if len(ts) == 1:
            bags = w.batch * sum(t in ts for t in w.feature_table)
            worst = max(worst, _single_table_scratch(spec, n, bags, mode))
            continue
        (p1, _, q1, r1), (p2, _, q2, r2), (p3, _, q3, _) = layout.packed_shapes()
        rows = n if capacities is None else min(n, capacities[g])
        tb = _flowtt_cuda.tb_scratch_bytes(p1, p2, p3, q1, q2, q3, r1, r2, rows)
        plan = _flowtt_cuda.tb_plan_scratch_bytes(n, layout.tb_plan_meta()[3]) or 0
        keys = ("tb_rows_fwd",) if mode == "fwd" else ("tb_rows_fwd", "tb_rows_bwd")
        worst = max(worst, int(plan), *(int(tb[k]) for k in keys))
    return worst


@register(
    "ours_batched",
    suites=("single", "collection"),
    ours=True,
    init=_pack_groups,
    scratch=batched_scratch_bytes,
    description="tt_embedding_bag_group impl='ffi': one plan and one launch per stage for all "
    "tables of a shape group (packed cores)",
)
def _ours_batched(w: Workload) -> Fwd:
    return _batched(w, None)


@register(
    "ours_batched_capacity",
    suites=("collection",),
    ours=True,
    init=_pack_groups,
    scratch=lambda w, mode: batched_scratch_bytes(w, mode, group_capacities(w)),
    description="ours_batched with unique_capacity per shape group: the batch's unique rows "
    f"x {CAPACITY_MARGIN} (rows and their gradient [capacity, D], not [nnz, D])",
)
def _ours_batched_capacity(w: Workload) -> Fwd:
    return _batched(w, group_capacities(w))


def _batched(w: Workload, capacities: tuple[int, ...] | None) -> Fwd:
    """``tt_embedding_bag_group`` per shape group (``capacities``: each group's
    ``unique_capacity``)."""
    groups = _shape_groups(w)
    caps = capacities or (None,) * len(groups)
    bounds, b = w.feature_bounds, w.batch
    feature_group = []
    for t in w.feature_table:
        g = next(i for i, (_, ts) in enumerate(groups) if t in ts)
        feature_group.append((g, groups[g][1].index(t)))

    def fwd(params, ids, offsets, weights=None):
        outs = [None] * w.num_features
        for g, (layout, _) in enumerate(groups):
            feats = [f for f, (fg, _) in enumerate(feature_group) if fg == g]
            tables = tuple(feature_group[f][1] for f in feats)
            if len(groups) == 1:  # [B, F, D] as the pooling writes it -> [B, F*D]
                out = tt_embedding_bag_group(
                    params[g],
                    layout,
                    ids,
                    offsets,
                    tables,
                    weights=weights,
                    impl="ffi",
                    batch_major=True,
                    unique_capacity=caps[g],
                )
                return out.reshape(b, -1)

            # this group's features' slices, re-packed feature-major
            def packed(x, feats=feats):  # x's slices of this group's features, in turn
                return None if x is None else jnp.concatenate([x[bounds[f] : bounds[f + 1]] for f in feats])

            g_ids, g_weights = packed(ids), packed(weights)
            starts = np.cumsum([0] + [bounds[f + 1] - bounds[f] for f in feats])
            g_offsets = jnp.concatenate(
                [offsets[f * b : (f + 1) * b] - bounds[f] + int(s) for f, s in zip(feats, starts)]
                + [jnp.full((1,), starts[-1], offsets.dtype)]
            )
            out = tt_embedding_bag_group(
                params[g],
                layout,
                g_ids,
                g_offsets,
                tables,
                weights=g_weights,
                impl="ffi",
                unique_capacity=caps[g],
            )
            # split, not indexing: an index's transpose pads to the whole [F, B, D] (F^2 work)
            for f, part in zip(feats, jnp.split(out, len(feats))):
                outs[f] = part[0]
        return jnp.concatenate(outs, axis=1)

    return fwd


#: Seconds the layers took to construct, by (impl name, workload name) (``init`` records).
CONSTRUCT_S: dict[tuple[str, str], float] = {}


def _layer_tables(w: Workload):
    """One ``TableConfig`` per table of the workload (its spec's shapes and ranks), feature
    ``f{i}`` reading table ``feature_table[i]``; the collection's ``feature_names`` must be
    the workload's feature order (features in table order)."""
    from flowtt_jax.collection import TableConfig

    if list(w.feature_table) != sorted(w.feature_table):
        raise ValueError("the layer benchmarks need the workload's features in table order")
    return [
        TableConfig(
            f"t{t}",
            spec.num_embeddings,
            spec.embedding_dim,
            rank=spec.ranks[1:-1],
            row_shape=spec.row_shape,
            col_shape=spec.col_shape,
            num_cores=spec.num_cores,
            feature_names=tuple(f"f{i}" for i, ft in enumerate(w.feature_table) if ft == t),
        )
        for t, spec in enumerate(w.specs)
    ]


def _layer_init(name: str):
    """``init`` of a layer impl: constructs the ``TTEmbeddingCollection`` (timed, as a user
    does), then loads the per-table cores every impl shares; params: its ``nnx.State``."""

    def init(w: Workload, cores: TTCores):
        import time

        from flax import nnx

        from flowtt_jax.nnx import TTEmbeddingCollection

        jax.clear_caches()  # a user's first construction: its program is compiled, not reused
        t0 = time.perf_counter()
        coll = TTEmbeddingCollection(_layer_tables(w), rngs=nnx.Rngs(0))
        jax.block_until_ready(nnx.state(coll))
        CONSTRUCT_S[(name, w.name)] = time.perf_counter() - t0
        layout = coll.layout
        index = {cfg.name: t for t, cfg in enumerate(layout.tables)}
        for p, pack in enumerate(layout.packs):
            per_table = [cores[index[cfg.name]] for cfg in pack.tables]
            values = pack.layout.pack(per_table) if pack.kind == "tt" else per_table[0]
            for param, v in zip(layout.param_names(p), values):
                coll.params[param][...] = v
        # the parameters are what is differentiated; the rest (the out-of-range counter) stays
        graph, params, rest = nnx.split(coll, nnx.Param, ...)
        _LAYER_GRAPHS[(name, w.name)] = (graph, rest)
        return params

    return init


_LAYER_GRAPHS: dict[tuple[str, str], Any] = {}


def _layer_build(name: str, packed: bool):
    def build(w: Workload) -> Fwd:
        from flax import nnx

        from flowtt_jax import KeyedJagged

        graph, rest = _LAYER_GRAPHS[(name, w.name)]
        bounds, b = w.feature_bounds, w.batch
        names = [f"f{i}" for i in range(w.num_features)]

        def fwd(params, ids, offsets, weights=None):
            coll = nnx.merge(graph, params, rest)
            if packed:
                return coll(KeyedJagged(ids, offsets=offsets, weights=weights)).reshape(b, -1)
            feats = {}
            for f, name_f in enumerate(names):  # the per-feature arrays a dict caller holds
                s, e = bounds[f], bounds[f + 1]
                feats[name_f] = {"ids": ids[s:e], "offsets": offsets[f * b : (f + 1) * b + 1] - s}
                if weights is not None:
                    feats[name_f]["weights"] = weights[s:e]
            out = coll(feats)
            return jnp.concatenate([out[f] for f in names], axis=1)

        return fwd

    return build


for _name, _packed, _description in (
    (
        "ours_layer",
        True,
        "ftt.nnx.TTEmbeddingCollection called with a KeyedJagged (one flat ids array, "
        "feature-major offsets): the layer users call over the table-batched op",
    ),
    (
        "ours_layer_dict",
        False,
        "ftt.nnx.TTEmbeddingCollection called with a {feature: {ids, offsets}} dict (the "
        "features' slices of the batch)",
    ),
):
    register(
        _name,
        suites=("collection",),
        ours=True,
        init=_layer_init(_name),
        scratch=batched_scratch_bytes,
        description=_description,
    )(_layer_build(_name, _packed))
