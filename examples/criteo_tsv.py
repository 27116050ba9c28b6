"""Criteo TSV files (Kaggle ``train.txt``, Criteo 1TB ``day_0`` .. ``day_23``; plain or gzip) as
training batches: parsed on the host by vectorised numpy, prefetched onto the device.

**Format.** One example a line, 40 tab-separated columns: the label (0/1), 13 integer
features (decimal, possibly negative or empty), 26 categorical features (at most 8 hex
digits, any case; Criteo's have 8; possibly empty). No header; the last line may lack its
``'\\n'``. A file is gzip when it starts with gzip's magic bytes (``.gz`` or not).

**Batches** (``TSVLoader``): ``{"dense": [b, 13] float32, "sparse": [b, 26] int32, "label":
[b] float32}``, b = this process's share of ``batch_size``:

- dense = ``log(1 + max(x, 0))`` of each integer in float64, rounded to float32 (empty: 0),
  as in the DLRM reference code; label = 0.0 or 1.0;
- sparse: each value to an id of its feature's full table of rows_f rows, then with
  ``max_rows`` to ``id mod max_rows`` (``criteo_synth``'s row cap, ``dlrm.py --max-rows``).
  An empty field's id is 0, a row no value maps to; ``categorical="hash"`` (rows_f:
  ``cardinalities``, default Criteo Kaggle's): ``1 + x mod (rows_f - 1)`` of the hex value x
  (Criteo's values are 32-bit hashes already; the DLRM reference takes them mod the rows);
  ``categorical="vocab"`` (rows_f: 1 + the vocabulary's size): 1 + the value's rank among
  those seen ``min_count`` times or more in a pass over training files (``build_vocab``;
  ``Vocab.save``/``load``: .npz), else 0.

**Stream.** The files (one, a list, a directory -- its files in natural order, ``day_2``
before ``day_10`` -- or a glob; a ``Segment`` is a file's line range) are one stream of
lines; each ``batch_size`` consecutive lines are a global batch (across file boundaries).
``drop_last=False`` also yields the final partial batch; ``repeat=True`` starts over at the end.

**Hosts** (``jax.distributed``). Process k of P parses lines ``[k B/P, (k+1) B/P)`` of each
global batch of B lines (of the final r lines: ``[k r/P, (k+1) r/P)``): disjoint blocks that
cover every batch, in process order, so on a data-sharded mesh the global batch is the same
B lines for any P. Every process reads the whole stream (cheap next to parsing), so all
count the same batches without communicating.

**Errors.** A malformed line (not 40 columns; a label not 0/1; an integer not ``-?[0-9]+``
of at most 16 characters; a categorical not 1-8 hex digits) raises ``ValueError`` naming the
file and line (1-based); ``DevicePrefetcher`` re-raises it in the consumer.

**Speed.** Each field is one big-endian 64-bit word ending at its last byte (a strided view
of the buffer), decoded by SWAR arithmetic (8 digits at once in numpy uint64 ops over
``[lines, fields]``; integers of 9-16 characters take a second word). ``python
examples/criteo_tsv.py PATH...`` measures lines/s: about 400,000 (plain) and 280,000 (gzip)
on one core of a busy 2-core CPU.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import glob
import itertools
import os
import queue
import re
import sys
import threading
import time
import zlib
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np

if __package__:  # imported as examples.criteo_tsv
    from .criteo_synth import CRITEO_KAGGLE_CARDINALITIES, NUM_DENSE
else:  # run as a script, or imported by examples/dlrm.py run as one
    from criteo_synth import CRITEO_KAGGLE_CARDINALITIES, NUM_DENSE

__all__ = [
    "CriteoTSV",
    "DevicePrefetcher",
    "NUM_COLUMNS",
    "NUM_SPARSE",
    "ParsedLines",
    "Segment",
    "TSVConfig",
    "TSVLoader",
    "Vocab",
    "add_data_arguments",
    "build_vocab",
    "expand_paths",
    "parse_lines",
    "split_tail",
]

NUM_SPARSE = len(CRITEO_KAGGLE_CARDINALITIES)
NUM_COLUMNS = 1 + NUM_DENSE + NUM_SPARSE

# ----------------------------------------------------------------------------- files


@dataclasses.dataclass(frozen=True)
class Segment:
    """The lines ``[start, stop)`` (0-based; ``stop=None``: to the end) of one file."""

    path: str
    start: int = 0
    stop: int | None = None

    def __str__(self) -> str:
        whole = self.start == 0 and self.stop is None
        return self.path if whole else f"{self.path} lines {self.start + 1}-{self.stop or 'end'}"


def _natural_key(path: str | Segment) -> list:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", str(path))]


def expand_paths(paths: str | os.PathLike | Segment | Sequence) -> list[Segment]:
    """Segments of a file, a directory (its files, natural order), a glob, or a list of them."""
    if isinstance(paths, (str, os.PathLike, Segment)):
        paths = [paths]
    out = []
    for p in paths:
        p = p if isinstance(p, Segment) else os.fspath(p)
        if isinstance(p, Segment) or os.path.isfile(p):
            found = [p]
        elif os.path.isdir(p):
            found = [str(q) for q in Path(p).iterdir() if q.is_file() and not q.name.startswith(".")]
        else:
            found = [q for q in glob.glob(p) if os.path.isfile(q)]
        if not found:
            raise FileNotFoundError(f"no Criteo TSV file at {p!r}")
        out += [q if isinstance(q, Segment) else Segment(q) for q in sorted(found, key=_natural_key)]
    return out


def _chunks(path: str, chunk_bytes: int) -> Iterator[bytes]:
    """The bytes of a file, decompressed when gzip (every member), in chunks of about
    ``chunk_bytes`` (zlib itself: twice ``gzip.open``'s speed on 4 MB reads)."""
    with open(path, "rb") as f:
        data = f.read(chunk_bytes)
        if data[:2] != b"\x1f\x8b":
            while data:
                yield data
                data = f.read(chunk_bytes)
            return
        dec, open_member = zlib.decompressobj(wbits=31), False
        while data:
            try:
                out = dec.decompress(data)
            except zlib.error as e:
                raise ValueError(f"{path}: bad gzip data ({e})") from None
            if out:
                yield out
            open_member = not dec.eof
            data = dec.unused_data if dec.eof else b""  # the next member starts there
            if dec.eof:
                dec = zlib.decompressobj(wbits=31)
            data = data or f.read(chunk_bytes)
        if open_member:
            raise ValueError(f"{path}: truncated gzip file")


def count_lines(path: str, chunk_bytes: int = 1 << 24) -> int:
    """Lines in a file (a last line without ``'\\n'`` counts): one pass over it."""
    n, last = 0, b"\n"
    for data in _chunks(path, chunk_bytes):
        n, last = n + data.count(b"\n"), data[-1:]
    return n + (last != b"\n")


def split_tail(segments: Sequence[Segment], lines: int) -> tuple[list[Segment], list[Segment]]:
    """``(head, tail)``: the stream of whole-file ``segments`` without and with only its last
    ``lines`` lines. Counts the lines of the files it takes the tail from (a pass over each)."""
    head, tail, need = list(segments), [], lines
    while need > 0 and head:
        seg = head.pop()
        n = count_lines(seg.path)
        if n > need:
            head.append(Segment(seg.path, 0, n - need))
            tail.insert(0, Segment(seg.path, n - need, n))
        else:
            tail.insert(0, seg)
        need -= n
    if need > 0 or not head:
        raise ValueError(f"{lines:,} held-out lines leave no training data in {[s.path for s in segments]}")
    return head, tail


def _blocks(seg: Segment, chunk_bytes: int) -> Iterator[tuple[bytes, int, np.ndarray, int]]:
    """Whole lines of ``seg``: ``(block, begin, ends, first)``, line ``first + i`` (0-based) is
    ``block[ends[i-1] (begin for i = 0) : ends[i]]``, '\\n' included (added to a last line)."""
    line, rest = 0, b""
    chunks = _chunks(seg.path, chunk_bytes)
    for data in itertools.chain(chunks, [None]):
        if data is None:  # the end: a last line without its '\n' gets one
            if not rest:
                break
            data = b"\n"
        block = rest + data
        ends = np.flatnonzero(np.frombuffer(block, np.uint8) == 10) + 1
        if ends.size == 0:
            rest = block
            continue
        rest = block[ends[-1] :]
        lo = max(seg.start - line, 0)
        hi = ends.size if seg.stop is None else min(seg.stop - line, ends.size)
        if lo < hi:
            yield block, int(ends[lo - 1]) if lo else 0, ends[lo:hi], line + lo
        line += ends.size
        if seg.stop is not None and line >= seg.stop:
            chunks.close()
            return


@dataclasses.dataclass
class _Piece:
    """Consecutive lines of one file: ``block[begin:ends[-1]]``, the first is line ``first``."""

    block: bytes
    begin: int
    ends: np.ndarray
    path: str
    first: int


def _take(pieces: list[_Piece], n: int) -> tuple[list[_Piece], list[_Piece]]:
    """The first ``n`` lines of ``pieces`` and the rest."""
    head, rest = [], list(pieces)
    while n > 0 and rest:
        p = rest.pop(0)
        if p.ends.size > n:  # split it
            rest.insert(0, _Piece(p.block, int(p.ends[n - 1]), p.ends[n:], p.path, p.first + n))
            p = _Piece(p.block, p.begin, p.ends[:n], p.path, p.first)
        head.append(p)
        n -= p.ends.size
    return head, rest


def _global_batches(
    segments: Sequence[Segment], lines: int, chunk_bytes: int, drop_last: bool
) -> Iterator[list[_Piece]]:
    """The stream in batches of ``lines`` lines (the last may be short unless drop_last)."""
    pending, count = [], 0
    for seg in segments:
        for block, begin, ends, first in _blocks(seg, chunk_bytes):
            pending.append(_Piece(block, begin, ends, seg.path, first))
            count += ends.size
            while count >= lines:
                batch, pending = _take(pending, lines)
                count -= lines
                yield batch
    if count and not drop_last:
        yield pending


# ----------------------------------------------------------------------------- parsing

_U = np.uint64
_ONES = _U(0x0101010101010101)
_LO, _HI = _U(0x0F0F0F0F0F0F0F0F), _U(0xF0F0F0F0F0F0F0F0)
_ZEROS = _U(0x3030303030303030)  # eight '0'
# _KEEP[l]: the low l bytes of a word; _SIGN[l]: turns a '-' l bytes from the right into '0'
_KEEP = np.array([(1 << (8 * n)) - 1 for n in range(9)], np.uint64)
_SIGN = np.array([0] + [3 << (8 * (n - 1)) for n in range(1, 9)], np.uint64)
_PAD = b"0" * 8  # before the lines: every field's 8-byte word lies in the buffer


@dataclasses.dataclass
class ParsedLines:
    """The raw values of n lines."""

    label: np.ndarray  # [n] uint8, 0 or 1
    ints: np.ndarray  # [n, 13] int64 (empty: 0)
    cats: np.ndarray  # [n, 26] uint32 hex values (empty: 0)
    present: np.ndarray  # [n, 26] bool: the categorical field is not empty


class _Malformed(Exception):
    """``(row, reason)``: row ``row`` of a parsed buffer is malformed."""


def parse_lines(lines: bytes) -> ParsedLines:
    """Parse whole lines (each ending in '\\n'); a malformed one raises ``ValueError``
    naming its line (1-based) within ``lines``."""
    try:
        return _parse(_PAD + lines)
    except _Malformed as e:
        raise ValueError(f"malformed Criteo TSV line {e.args[0] + 1}: {e.args[1]}") from None


def _words(buf: bytes, ends: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """The 8 bytes before each field end as a big-endian word, the bytes before the field
    (lens < 8) replaced by '0': uint64, shape of ``ends``."""
    view = np.ndarray((len(buf) - 7,), dtype=">u8", buffer=buf, strides=(1,))
    keep = _KEEP[np.minimum(lens, 8)]
    return (view[ends - 8].astype(np.uint64) & keep) | (_ZEROS & ~keep)


def _decimal(w: np.ndarray) -> np.ndarray:
    """8 ASCII digits a word (most significant first) -> their value: uint64."""
    v = w - _ZEROS
    v = ((v >> _U(8)) * _U(10) + v) & _U(0x00FF00FF00FF00FF)
    v = ((v >> _U(16)) * _U(100) + v) & _U(0x0000FFFF0000FFFF)
    return ((v >> _U(32)) * _U(10000) + v) & _U(0xFFFFFFFF)


def _is_decimal(w: np.ndarray) -> np.ndarray:
    return ((w & _HI) == _ZEROS) & ((((w & _LO) + _U(0x0606060606060606)) & _HI) == 0)


def _hex(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """8 ASCII hex digits a word -> (value uint32, valid bool): letters folded to lower case
    (bit 6 set -> bit 5 set), each byte decoded to ``(c & 15) + 9 * bit6`` and valid when
    below 16 and re-encoding to the folded byte; the nibbles then packed pairwise."""
    w = w | ((w >> _U(1)) & _U(0x2020202020202020))
    v = (w & _LO) + _U(9) * ((w >> _U(6)) & _ONES)
    above9 = ((v + _U(0x7676767676767676)) >> _U(7)) & _ONES
    valid = ((v & _HI) == 0) & (w == v + _ZEROS + above9 * _U(0x27))
    v = (v | (v >> _U(4))) & _U(0x00FF00FF00FF00FF)
    v = (v | (v >> _U(8))) & _U(0x0000FFFF0000FFFF)
    v = (v | (v >> _U(16))) & _U(0xFFFFFFFF)
    return v.astype(np.uint32), valid


def _parse(buf: bytes) -> ParsedLines:
    """``parse_lines`` of ``buf`` = 8 pad bytes + lines; ``_Malformed`` names a bad row."""
    a = np.frombuffer(buf, np.uint8)
    newlines = np.flatnonzero(a == 10)
    delims = np.flatnonzero((a == 9) | (a == 10))
    n, c = newlines.size, NUM_COLUMNS
    if n == 0:
        z = np.zeros((0, NUM_SPARSE), np.uint32)
        return ParsedLines(np.zeros(0, np.uint8), np.zeros((0, NUM_DENSE), np.int64), z, z > 0)
    if delims.size != c * n or not np.array_equal(delims[c - 1 :: c], newlines):
        cols = np.bincount(np.searchsorted(newlines, delims), minlength=n + 1)[:n]
        row = int(np.flatnonzero(cols != c)[0])
        raise _Malformed(row, f"{cols[row]} tab-separated columns, expected {c}")
    ends = delims.reshape(n, c)
    starts = np.empty_like(ends)
    starts[:, 1:] = ends[:, :-1] + 1
    starts[:, 0] = np.r_[len(_PAD), ends[:-1, -1] + 1]
    lens = ends - starts

    label = a[starts[:, 0]] - 48
    bad_label = (lens[:, 0] != 1) | (label > 1)

    # integers: the last 8 characters, then (rare) the 8 before them; the sign becomes a '0'
    ie, il = ends[:, 1 : 1 + NUM_DENSE], lens[:, 1 : 1 + NUM_DENSE]
    neg = (a[starts[:, 1 : 1 + NUM_DENSE]] == 45) & (il > 0)
    w = _words(buf, ie, il) + np.where(neg & (il <= 8), _SIGN[np.minimum(il, 8)], _U(0))
    bad_int = ~_is_decimal(w) | neg & (il == 1) | (il > 16)
    ints = _decimal(w).astype(np.int64)
    long = np.nonzero(il > 8)
    if long[0].size:
        hl = np.minimum(il[long] - 8, 8)
        w = _words(buf, ie[long] - 8, hl) + np.where(neg[long], _SIGN[hl], _U(0))
        bad_int[long] |= ~_is_decimal(w)
        ints[long] += _decimal(w).astype(np.int64) * 10**8
    ints = np.where(neg, -ints, ints)

    ce, cl = ends[:, 1 + NUM_DENSE :], lens[:, 1 + NUM_DENSE :]
    cats, valid = _hex(_words(buf, ce, cl))
    bad_cat = ~valid | (cl > 8)

    bad = bad_label | bad_int.any(1) | bad_cat.any(1)
    if bad.any():
        row = int(np.flatnonzero(bad)[0])
        field = lambda j: buf[starts[row, j] : ends[row, j]].decode(errors="replace")
        if bad_label[row]:
            raise _Malformed(row, f"label {field(0)!r} is not 0 or 1")
        if bad_int[row].any():
            j = int(np.flatnonzero(bad_int[row])[0])
            raise _Malformed(row, f"integer feature I{j + 1} {field(1 + j)!r} is not -?[0-9]+ (<= 16 chars)")
        j = int(np.flatnonzero(bad_cat[row])[0])
        raise _Malformed(
            row, f"categorical feature C{j + 1} {field(1 + NUM_DENSE + j)!r} is not 1-8 hex digits"
        )
    return ParsedLines(label.astype(np.uint8), ints, cats, cl > 0)


def dense_transform(ints: np.ndarray) -> np.ndarray:
    """``log(1 + max(x, 0))`` in float64, rounded to float32: same shape."""
    return np.log1p(np.maximum(ints, 0).astype(np.float64)).astype(np.float32)


# ----------------------------------------------------------------------------- vocabulary


@dataclasses.dataclass(frozen=True)
class Vocab:
    """Per feature, the sorted hex values (uint32) seen at least ``min_count`` times."""

    keys: tuple[np.ndarray, ...]
    min_count: int

    @property
    def rows(self) -> tuple[int, ...]:
        """Table rows per feature: one per value, and row 0 (empty, rare, unseen)."""
        return tuple(k.size + 1 for k in self.keys)

    def lookup(self, cats: np.ndarray, present: np.ndarray) -> np.ndarray:
        """``[n, 26]`` values -> full-table ids ``[n, 26]`` int64 (rank + 1, or 0)."""
        out = np.zeros(cats.shape, np.int64)
        for f, keys in enumerate(self.keys):
            i = np.minimum(np.searchsorted(keys, cats[:, f]), max(keys.size - 1, 0))
            hit = present[:, f] & (keys[i] == cats[:, f]) if keys.size else np.zeros(len(cats), bool)
            out[:, f] = np.where(hit, i + 1, 0)
        return out

    def save(self, path: str | os.PathLike) -> None:
        np.savez(path, min_count=self.min_count, **{f"C{f + 1}": k for f, k in enumerate(self.keys)})

    @classmethod
    def load(cls, path: str | os.PathLike) -> Vocab:
        with np.load(path) as z:
            return cls(
                tuple(z[f"C{f + 1}"].astype(np.uint32) for f in range(NUM_SPARSE)), int(z["min_count"])
            )


def build_vocab(
    paths: str | os.PathLike | Segment | Sequence, min_count: int = 1, chunk_lines: int = 1 << 16
) -> Vocab:
    """One pass over ``paths`` (all lines, this process alone) counting each feature's values."""
    loader = TSVLoader(TSVConfig(paths, chunk_lines, drop_last=False, process_index=0, process_count=1))
    seen: list[list[tuple[np.ndarray, np.ndarray]]] = [[] for _ in range(NUM_SPARSE)]

    def merge(parts):
        values = np.concatenate([v for v, _ in parts])
        keys, inverse = np.unique(values, return_inverse=True)
        return [(keys, np.bincount(inverse, np.concatenate([c for _, c in parts])).astype(np.int64))]

    for parsed in loader.parsed():
        for f, parts in enumerate(seen):
            parts.append(np.unique(parsed.cats[parsed.present[:, f], f], return_counts=True))
            if sum(v.size for v, _ in parts[1:]) > max(parts[0][0].size, 1 << 20):
                seen[f] = merge(parts)
    keys = []
    for parts in seen:
        values, counts = merge(parts)[0] if parts else (np.zeros(0, np.uint32), np.zeros(0))
        keys.append(values[counts >= min_count].astype(np.uint32))
    return Vocab(tuple(keys), min_count)


# ----------------------------------------------------------------------------- loader


@dataclasses.dataclass(frozen=True)
class TSVConfig:
    """What ``TSVLoader`` reads and how (see the module docstring). ``batch_size``: lines of
    a global batch, over all processes; ``process_index``/``process_count``: None = jax's."""

    paths: str | os.PathLike | Segment | Sequence
    batch_size: int = 4096
    cardinalities: tuple[int, ...] = CRITEO_KAGGLE_CARDINALITIES
    max_rows: int | None = None
    categorical: str = "hash"  # or "vocab" (TSVLoader then needs a Vocab)
    drop_last: bool = True
    repeat: bool = False
    process_index: int | None = None
    process_count: int | None = None
    chunk_bytes: int = 1 << 22

    def __post_init__(self) -> None:
        if len(self.cardinalities) != NUM_SPARSE or min(self.cardinalities) < 1:
            raise ValueError(f"cardinalities: {NUM_SPARSE} positive ints, got {self.cardinalities}")
        if self.categorical not in ("hash", "vocab"):
            raise ValueError(f"categorical must be 'hash' or 'vocab', got {self.categorical!r}")


class TSVLoader:
    """Host batches of a ``TSVConfig``: iterating yields ``{"dense": [b, 13] float32,
    "sparse": [b, 26] int32, "label": [b] float32}`` numpy arrays, b = batch_size / processes."""

    def __init__(self, config: TSVConfig, vocab: Vocab | None = None):
        if (config.categorical == "vocab") != (vocab is not None):
            raise ValueError("categorical='vocab' takes a Vocab (build_vocab or Vocab.load), 'hash' none")
        self.config, self.vocab = config, vocab
        self.segments = expand_paths(config.paths)
        c = config
        self.process_count = jax.process_count() if c.process_count is None else c.process_count
        self.process_index = jax.process_index() if c.process_index is None else c.process_index
        if not 0 <= self.process_index < self.process_count:
            raise ValueError(f"process_index {self.process_index} not in [0, {self.process_count})")
        if c.batch_size < 1 or c.batch_size % self.process_count:
            raise ValueError(f"batch_size {c.batch_size} does not split over {self.process_count} processes")
        #: full-table rows per feature, and the rows after the max_rows cap (the model's tables)
        self.raw_cardinalities = vocab.rows if vocab is not None else tuple(c.cardinalities)
        cap = c.max_rows
        self.cardinalities = tuple(min(n, cap) if cap else n for n in self.raw_cardinalities)
        rows = np.array(self.raw_cardinalities, np.int64)
        if rows.max() >= 2**31:
            raise ValueError(f"table rows must be below 2**31 (int32 ids), got {rows.max()}")
        # hash: 1 + x mod (rows - 1), and 0 for a 1-row table
        self._hash_rows = np.maximum(rows - 1, 1).astype(np.uint32)
        self._hash_offset = (rows > 1).astype(np.uint32)
        self._capped_rows = np.array(self.cardinalities, np.uint32)

    def parsed(self) -> Iterator[ParsedLines]:
        """This process's block of each batch, parsed (see the module docstring)."""
        c, k, p = self.config, self.process_index, self.process_count
        while True:
            empty = True
            for batch in _global_batches(self.segments, c.batch_size, c.chunk_bytes, c.drop_last):
                empty = False
                total = sum(q.ends.size for q in batch)
                lo, hi = k * total // p, (k + 1) * total // p
                yield _parse_pieces(_take(_take(batch, lo)[1], hi - lo)[0])
            if not c.repeat:
                return
            if empty:
                raise ValueError(
                    f"no full batch of {c.batch_size} lines in {[s.path for s in self.segments]}"
                )

    def to_batch(self, parsed: ParsedLines) -> dict[str, np.ndarray]:
        """Parsed lines -> a batch (the transforms of the module docstring)."""
        if self.vocab is not None:
            ids = self.vocab.lookup(parsed.cats, parsed.present)
        else:  # uint32 throughout: a third of int64's time
            ids = parsed.cats % self._hash_rows
            ids += self._hash_offset
            ids *= parsed.present
        if self.config.max_rows:
            ids %= self._capped_rows
        return {
            "dense": dense_transform(parsed.ints),
            "sparse": ids.astype(np.int32),  # ids < rows < 2**31
            "label": parsed.label.astype(np.float32),
        }

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        return map(self.to_batch, self.parsed())

    def prefetch(self, sharding: jax.sharding.Sharding | None = None, depth: int = 2) -> DevicePrefetcher:
        """The batches on the device, parsed ahead by a thread (``DevicePrefetcher``)."""
        return DevicePrefetcher(self, sharding, depth)


def _parse_pieces(pieces: list[_Piece]) -> ParsedLines:
    try:
        return _parse(b"".join([_PAD] + [p.block[p.begin : p.ends[-1]] for p in pieces if p.ends.size]))
    except _Malformed as e:
        row, reason = e.args
        while row >= pieces[0].ends.size:  # to the piece holding the row
            row, pieces = row - pieces[0].ends.size, pieces[1:]
        raise ValueError(f"{pieces[0].path}, line {pieces[0].first + row + 1}: {reason}") from None


# ----------------------------------------------------------------------------- device

_END = object()


class DevicePrefetcher:
    """Iterator of ``batches`` (dicts of numpy arrays) as device arrays, made by a background
    thread ``depth`` batches ahead (a bounded queue): parsing and the host-to-device copy
    overlap the consumer's steps. ``sharding`` places every array (e.g. ``NamedSharding(mesh,
    P("data"))``: each process gives its rows, ``jax.make_array_from_process_local_data``);
    None: the default device. An exception in the thread (a malformed line's ``ValueError``)
    is raised by ``next``. ``close()`` (or leaving a ``with`` block) stops the thread."""

    def __init__(self, batches: Iterable[dict[str, np.ndarray]], sharding=None, depth: int = 2):
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._sharding = sharding
        self._done = False
        self._thread = threading.Thread(target=self._run, args=(batches,), name="tsv-prefetch", daemon=True)
        self._thread.start()

    def _put(self, x: np.ndarray) -> jax.Array:
        if self._sharding is None:
            return jax.device_put(x)
        return jax.make_array_from_process_local_data(self._sharding, x)

    def _offer(self, item: Any) -> bool:
        while not self._stop.is_set():
            with contextlib.suppress(queue.Full):
                self._queue.put(item, timeout=0.05)
                return True
        return False

    def _run(self, batches: Iterable[dict[str, np.ndarray]]) -> None:
        it = iter(batches)
        try:
            for batch in it:
                if not self._offer({k: self._put(v) for k, v in batch.items()}):
                    break
            else:
                self._offer(_END)
        except BaseException as e:  # handed to the consumer
            self._offer(e)
        finally:
            getattr(it, "close", lambda: None)()

    def __iter__(self) -> DevicePrefetcher:
        return self

    def __next__(self) -> dict[str, jax.Array]:
        if self._done:
            raise StopIteration
        item = self._queue.get()
        if item is _END or isinstance(item, BaseException):
            self.close()
            raise StopIteration if item is _END else item
        return item

    def close(self) -> None:
        """Stop the thread (it finishes the batch it is making) and drop what is queued."""
        self._done = True
        self._stop.set()
        self._thread.join()
        while not self._queue.empty():
            self._queue.get_nowait()

    def __enter__(self) -> DevicePrefetcher:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ----------------------------------------------------------------------------- dlrm.py


def add_data_arguments(p: argparse.ArgumentParser) -> None:
    """``examples/dlrm.py``'s real-data flags."""
    data = p.add_argument_group("real data (examples/criteo_tsv.py)")
    data.add_argument("--data", nargs="+", help="Criteo TSV files to train on (.gz, dirs, globs); repeats")
    data.add_argument("--eval-data", nargs="+", help="held out; default: --data's last --eval-batches")
    data.add_argument("--categorical", choices=("hash", "vocab"), default="hash", help="id mapping")
    data.add_argument("--vocab", help="--categorical vocab: its .npz (built from --data when missing)")
    data.add_argument("--vocab-min-count", type=int, default=4, help="building --vocab: values seen so often")


class CriteoTSV:
    """``examples/dlrm.py``'s data source over TSV files: ``batches(stream, batch_size,
    sharding)`` iterates ``(dense, sparse, labels, None)`` device batches of the training
    stream (0; repeats) or the held-out one (1); ``cardinalities``: the model's table rows."""

    def __init__(self, train: TSVConfig, held_out: TSVConfig, vocab: Vocab | None = None):
        self.configs, self.vocab = (train, held_out), vocab
        loader = TSVLoader(train, vocab)
        self.cardinalities, self.raw_cardinalities = loader.cardinalities, loader.raw_cardinalities

    @classmethod
    def from_args(cls, args: argparse.Namespace, log=print) -> CriteoTSV:
        cap = args.max_rows or None
        train = expand_paths(args.data)
        if args.eval_data:
            held_out = expand_paths(args.eval_data)
        else:
            train, held_out = split_tail(train, args.eval_batches * args.batch_size)
        vocab = None
        if args.categorical == "vocab":
            if not args.vocab:
                raise ValueError("--categorical vocab needs --vocab PATH.npz (loaded, or built there)")
            if os.path.exists(args.vocab):
                vocab = Vocab.load(args.vocab)
            else:
                t = time.perf_counter()
                vocab = build_vocab(train, args.vocab_min_count)
                vocab.save(args.vocab)
                t = time.perf_counter() - t
                log(f"vocabulary of {sum(vocab.rows):,} rows built in {t:.1f} s: {args.vocab}")
        config = lambda paths, repeat: TSVConfig(
            paths, args.batch_size, max_rows=cap, categorical=args.categorical, repeat=repeat
        )
        say = lambda segs: ", ".join(map(str, segs)) if len(segs) < 3 else f"{segs[0]} .. {segs[-1]}"
        log(f"data: training on {say(train)}; held out: {say(held_out)}")
        return cls(config(train, True), config(held_out, False), vocab)

    def loader(self, stream: int, batch_size: int, sharding=None) -> TSVLoader:
        """Stream 0 or 1 in global batches of ``batch_size``; split over the processes with a
        sharding, whole on every process without one."""
        k, p = (jax.process_index(), jax.process_count()) if sharding is not None else (0, 1)
        config = dataclasses.replace(
            self.configs[stream], batch_size=batch_size, process_index=k, process_count=p
        )
        return TSVLoader(config, self.vocab)

    def batches(self, stream: int, batch_size: int, sharding=None) -> Iterator[tuple]:
        with self.loader(stream, batch_size, sharding).prefetch(sharding) as it:
            for b in it:
                yield b["dense"], b["sparse"], b["label"], None


# ----------------------------------------------------------------------------- speed


def main(argv: Sequence[str] | None = None) -> float:
    """``python examples/criteo_tsv.py PATH...``: the host batches' lines/s (one thread)."""
    loader = TSVLoader(
        TSVConfig(list(argv or sys.argv[1:]), drop_last=False, process_index=0, process_count=1)
    )
    t, n = time.perf_counter(), 0
    for batch in loader:
        n += batch["label"].size
    rate = n / (time.perf_counter() - t)
    print(f"{n:,} lines: {rate:,.0f} lines/s (read, parse, transform; one thread)")
    return rate


if __name__ == "__main__":
    main()
