"""How a collection's tables are stored: packs of tables that share one set of arrays
(a TT shape group, a dense dim, or one TT table of another core count), the features each
pack serves and the parameter names of its arrays. Static and hashable."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
from collections.abc import Sequence

import numpy as np

from flowtt_jax.budget import pass_size
from flowtt_jax.collection.config import TableConfig
from flowtt_jax.kernels.group_plan import GroupLayout

__all__ = ["FeatureSlot", "TablePack", "cache_names", "check_param_names", "pack_tables", "param_names"]


@dataclasses.dataclass(frozen=True)
class FeatureSlot:
    """A feature read by a pack: its name, its table's index in the pack, its pooling mode."""

    feature: str
    table: int
    mode: str


@dataclasses.dataclass(frozen=True)
class TablePack:
    """Tables stored together. ``kind``: ``"tt"`` (a shape group, ``layout`` set),
    ``"dense"`` (one ``[sum N, D]`` table) or ``"single"`` (one TT table of any core count)."""

    kind: str
    tables: tuple[TableConfig, ...]
    features: tuple[FeatureSlot, ...]
    layout: GroupLayout | None = None
    ids_per_pass: int | None = None  # the kernels take its ids this many at a time (None: all)
    unique_windows: int | None = None  # its unique rows in this many windows (None: 1)

    @property
    def unique_capacity(self) -> int | None:
        """A shape group's unique rows held at a time: the sum of its tables'
        ``max_unique_ids`` (each at most its rows) when every table has one, else None."""
        caps = [t.max_unique_ids for t in self.tables]
        if self.kind != "tt" or any(c is None for c in caps):
            return None
        return sum(min(c, t.num_embeddings) for c, t in zip(caps, self.tables))

    def capacity_for(self, num_ids: int) -> int | None:
        """The unique rows a pooling call over ``num_ids`` ids holds at a time: the smaller of
        ``unique_capacity`` and ``num_ids / unique_windows`` (rounded up to 256: windows of
        one plan's uniques, each row made once); None: all of them. A one-table group runs the
        single-table kernels, whose rows are not windowed: None there."""
        if self.kind != "tt" or len(self.tables) == 1:
            return None
        window = pass_size(num_ids, self.unique_windows) if self.unique_windows and num_ids > 0 else None
        caps = [c for c in (self.unique_capacity, window) if c is not None]
        return min(caps) if caps else None

    @property
    def array_shapes(self) -> tuple[tuple[int, ...], ...]:
        """Shapes of the pack's arrays, in ``param_names`` order."""
        if self.kind == "tt":
            return tuple(tuple(s) for s in self.layout.packed_shapes())
        if self.kind == "dense":
            return ((self.row_offsets[-1], self.tables[0].features),)
        return tuple(tuple(s) for s in self.tables[0].spec().core_shapes)

    @property
    def cache_offsets(self) -> tuple[int, ...]:
        """``T + 1`` offsets of the tables' hot-row caches in the pack's cache block
        (``TableConfig.cache_rows``; all equal: no cache)."""
        return tuple(int(x) for x in np.concatenate([[0], np.cumsum([t.cache_rows for t in self.tables])]))

    @property
    def cache_rows(self) -> int:
        """Rows of the pack's cache block (its tables' ``cache_rows`` summed; 0: none)."""
        return self.cache_offsets[-1]

    @property
    def row_offsets(self) -> tuple[int, ...]:
        """Dense packs: ``T + 1`` offsets of the tables' rows in the packed table."""
        return tuple(
            int(x) for x in np.concatenate([[0], np.cumsum([t.num_embeddings for t in self.tables])])
        )


def _group_key(cfg: TableConfig) -> tuple:
    spec = cfg.spec()
    if spec.num_cores != 3:
        return ("single", cfg.name)
    return ("tt", spec.col_shape, spec.ranks)


def pack_tables(
    tables: Sequence[TableConfig], ids_per_pass: int | None = None, unique_windows: int | None = None
) -> tuple[TablePack, ...]:
    """TT shape groups (in order of first table), then dense packs by dim, then singles, each
    of one ``optimizer`` label;
    ``ids_per_pass``: the TT packs' kernels take their ids this many at a time;
    ``unique_windows``: the TT shape groups hold their unique rows in that many windows."""
    keys: dict[tuple, list[TableConfig]] = {}
    for cfg in tables:
        key = ("dense", cfg.features) if cfg.kind == "dense" else _group_key(cfg)
        # one optimizer label and one sparse update a pack
        keys.setdefault(key + (cfg.optimizer or "", cfg.sparse), []).append(cfg)
    order = {"tt": 0, "dense": 1, "single": 2}
    packs = []
    for key, cfgs in sorted(keys.items(), key=lambda kv: order[kv[0][0]]):
        slots = tuple(FeatureSlot(f, t, cfg.mode) for t, cfg in enumerate(cfgs) for f in cfg.feature_keys)
        layout = GroupLayout(tuple(c.spec() for c in cfgs)) if key[0] == "tt" else None
        per_pass = ids_per_pass if key[0] != "dense" else None
        windows = unique_windows if key[0] == "tt" else None
        packs.append(TablePack(key[0], tuple(cfgs), slots, layout, per_pass, windows))
    return tuple(packs)


def _table_signature(cfg: TableConfig) -> str:
    """What a table's stored values mean: its name, kind, rows, dim and, for a TT table, its
    row and column shapes and ranks (a state of another signature is another table's)."""
    if cfg.kind == "dense":
        return f"{cfg.name}|dense|{cfg.num_embeddings}|{cfg.features}"
    spec = cfg.spec()
    cache = f"|cache{cfg.cache_rows}" if cfg.cache_rows else ""
    shapes = f"{spec.row_shape}|{spec.col_shape}|{spec.ranks}"
    return f"{cfg.name}|tt|{cfg.num_embeddings}|{cfg.features}|{shapes}{cache}"


@functools.lru_cache(maxsize=256)  # every call names its parameters: 0.1 s a time at 788 tables
def _tables_digest(pack: TablePack) -> str:
    """8 hex digits of the pack's tables' signatures in order (``_table_signature``: name,
    kind, rows, dim, TT shapes and ranks): a state saved with other tables in the pack, the
    same in another order, or tables whose rows or shapes changed while the packed arrays
    kept their shapes, has other parameter names (a positional restore fails loudly instead
    of putting one table's rows into another)."""
    return hashlib.sha1("\0".join(_table_signature(t) for t in pack.tables).encode()).hexdigest()[:8]


def param_names(packs: Sequence[TablePack], p: int) -> tuple[str, ...]:
    """Parameter names of pack ``p``: ``tt{p}_{digest}_core{k}`` (a TT shape group's packed
    core k), ``dense{p}_{digest}`` (a dense pack), ``{table}_core{k}`` (a TT table of another
    core count); the digest is ``_tables_digest``'s."""
    pack = packs[p]
    if pack.kind == "tt":
        digest = _tables_digest(pack)
        return tuple(f"tt{p}_{digest}_core{k}" for k in range(3))
    if pack.kind == "dense":
        return (f"dense{p}_{_tables_digest(pack)}",)
    return tuple(f"{pack.tables[0].name}_core{k}" for k in range(pack.tables[0].spec().num_cores))


def cache_names(packs: Sequence[TablePack], p: int) -> tuple[str, str] | None:
    """``(cache block, hot ids)`` parameter names of pack ``p`` (its ``param_names``' prefix
    with ``_cache``, ``_hot``), or None when no table of the pack has a cache."""
    if not packs[p].cache_rows:
        return None
    prefix = param_names(packs, p)[0].rsplit("_", 1)[0]
    return f"{prefix}_cache", f"{prefix}_hot"


def check_param_names(packs: Sequence[TablePack]) -> None:
    """``ValueError`` when two packs would store their arrays under one parameter name (a
    table of another core count is named after itself), naming both packs' tables."""
    owners: dict[str, str] = {}
    for p, pack in enumerate(packs):
        tables = ", ".join(repr(t.name) for t in pack.tables)
        for name in param_names(packs, p) + (cache_names(packs, p) or ()):
            if name in owners:
                raise ValueError(
                    f"parameter {name!r} would hold both table(s) {owners[name]} and table(s) {tables}: "
                    f"rename table {pack.tables[0].name!r} (a table of other than 3 cores stores its "
                    "cores as '<table name>_core<k>')"
                )
            owners[name] = tables
