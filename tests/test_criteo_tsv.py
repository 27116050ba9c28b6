"""The Criteo TSV loader (``examples/criteo_tsv.py``) against a per-line Python parse of
small files in the real format, its host sharding, prefetcher and errors, and
``examples/dlrm.py --data`` end to end."""

from __future__ import annotations

import collections
import gzip
import math
import os
import re
import socket
import subprocess
import sys
import threading
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from examples import criteo_tsv as ct
from examples import dlrm
from examples.criteo_synth import CRITEO_KAGGLE_CARDINALITIES, NUM_DENSE


def _lines(n: int, seed: int, first_id: int = 0) -> list[str]:
    """n lines (no '\\n') with every field form: empty, negative and long (9-16 characters)
    integers, short and upper-case hex; the odd features draw from 20 values. I1 is a
    unique line id (first_id + i)."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        fields = [str(int(rng.random() < 0.3)), str(first_id + i)]
        for _ in range(NUM_DENSE - 1):  # empty, small negative, 9-16 characters, small
            kind, long = rng.integers(6), int(rng.integers(10**7, 10**15))
            value = [-int(rng.integers(1, 4)), long * 10, -long, int(rng.integers(0, 10**6))]
            fields.append("" if kind == 0 else str(value[min(kind - 1, 3)]))
        for f in range(ct.NUM_SPARSE):  # odd features: 20 values, repeated (a vocabulary)
            x, kind = int(rng.integers(0, 20 if f % 2 else 2**32)), rng.integers(10)
            fields.append(["", f"{x:X}", f"{x % 4096:x}"][kind] if kind < 3 else f"{x:08x}")
        out.append("\t".join(fields))
    return out


def _reference(line: str) -> tuple[int, list[int], list[int | None]]:
    """The straightforward parse: label, 13 ints (empty: 0), 26 hex values (empty: None)."""
    f = line.rstrip("\n").split("\t")
    assert len(f) == ct.NUM_COLUMNS
    return int(f[0]), [int(x) if x else 0 for x in f[1:14]], [int(x, 16) if x else None for x in f[14:]]


def _write(path, lines: list[str], newline_at_end: bool = True, gz: bool = False) -> str:
    text = ("\n".join(lines) + ("\n" if newline_at_end else "")).encode()
    if gz:
        with gzip.open(path, "wb") as f:
            f.write(text)
    else:
        path.write_bytes(text)
    return str(path)


def _config(paths, batch_size: int, **kw) -> ct.TSVConfig:
    kw.setdefault("process_index", 0)
    kw.setdefault("process_count", 1)
    return ct.TSVConfig(paths, batch_size, **kw)


def _ids(loader: ct.TSVLoader) -> list[np.ndarray]:
    """The I1 (line id) column of each of the loader's batches."""
    return [p.ints[:, 0] for p in loader.parsed()]


@pytest.fixture
def day_dir(tmp_path):
    """A directory of two day files (natural order: day_2 before day_10; the second gzip, no
    trailing '\\n'), and their lines in stream order."""
    a, b = _lines(70, seed=1), _lines(50, seed=2, first_id=70)
    d = tmp_path / "days"
    d.mkdir()
    _write(d / "day_2", a)
    _write(d / "day_10", b, newline_at_end=False, gz=True)
    return str(d), a + b


def test_parse_matches_per_line_python():
    lines = _lines(300, seed=0)
    parsed = ct.parse_lines(("\n".join(lines) + "\n").encode())
    ref = [_reference(x) for x in lines]
    np.testing.assert_array_equal(parsed.label, [r[0] for r in ref])
    np.testing.assert_array_equal(parsed.ints, np.array([r[1] for r in ref], np.int64))
    np.testing.assert_array_equal(parsed.present, [[c is not None for c in r[2]] for r in ref])
    np.testing.assert_array_equal(parsed.cats, [[c or 0 for c in r[2]] for r in ref])
    assert parsed.ints.dtype == np.int64 and parsed.cats.dtype == np.uint32
    # the generator made every form
    assert (parsed.ints < -(10**7)).any() and (parsed.ints >= 10**14).any() and (~parsed.present).any()
    assert any(c.isupper() for x in lines for c in x) and ct.parse_lines(b"").label.size == 0


def test_batches_match_the_reference_transforms(tmp_path):
    lines = _lines(200, seed=3)
    path = _write(tmp_path / "train.txt", lines)
    cap = 1000
    for max_rows in (None, cap):
        loader = ct.TSVLoader(_config(path, 50, max_rows=max_rows))
        batches = list(loader)
        assert len(batches) == 4
        for k, b in enumerate(batches):
            assert b["dense"].shape == (50, 13) and b["dense"].dtype == np.float32
            assert b["sparse"].shape == (50, 26) and b["sparse"].dtype == np.int32
            assert b["label"].shape == (50,) and b["label"].dtype == np.float32
            for r, line in enumerate(lines[50 * k : 50 * (k + 1)]):
                label, ints, cats = _reference(line)
                assert b["label"][r] == label
                want = [np.float32(math.log1p(max(x, 0))) for x in ints]
                np.testing.assert_array_equal(b["dense"][r], np.array(want, np.float32))
                for f, (x, n) in enumerate(zip(cats, CRITEO_KAGGLE_CARDINALITIES)):
                    full = 0 if x is None else 1 + x % (n - 1)
                    assert b["sparse"][r, f] == (full % min(n, cap) if max_rows else full), (r, f)


def test_hash_is_in_range_and_reserves_zero_for_empty(tmp_path):
    lines = _lines(400, seed=4)
    path = _write(tmp_path / "t.txt", lines)
    cards = (1, 2, 3, 7, 2**31 - 1, *CRITEO_KAGGLE_CARDINALITIES[5:])
    for max_rows, rows in ((None, cards), (100, tuple(min(n, 100) for n in cards))):
        loader = ct.TSVLoader(_config(path, 400, cardinalities=cards, max_rows=max_rows))
        assert loader.cardinalities == rows and loader.raw_cardinalities == cards
        (b,), parsed = list(loader), next(loader.parsed())
        assert (b["sparse"] >= 0).all() and (b["sparse"] < np.array(rows)).all()
        assert (b["sparse"][~parsed.present] == 0).all()
        if max_rows is None:  # no value lands on the reserved row of a table of 2+ rows
            assert (b["sparse"][:, 1:][parsed.present[:, 1:]] > 0).all()
            assert (b["sparse"][:, 0] == 0).all()  # one row: every value there
            assert len(np.unique(b["sparse"][:, 3])) == 7  # 1 + x mod 6 and the empty 0


def test_log_transform():
    x = np.array([[-7, -1, 0, 1, 2, 10**6, 2**40]])
    want = [0.0, 0.0, 0.0, math.log(2), math.log(3), math.log1p(10**6), math.log1p(2**40)]
    got = ct.dense_transform(x)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got[0], np.array(want, np.float32))


def test_files_directory_and_gzip_are_one_stream(tmp_path, day_dir):
    d, lines = day_dir
    assert [s.path.rsplit("/", 1)[1] for s in ct.expand_paths(d)] == ["day_2", "day_10"]
    assert [s.path for s in ct.expand_paths(d + "/day_*")] == [s.path for s in ct.expand_paths(d)]
    for drop_last, sizes in ((True, [32, 32, 32]), (False, [32, 32, 32, 24])):
        batches = list(ct.TSVLoader(_config(d, 32, drop_last=drop_last)))
        assert [b["label"].size for b in batches] == sizes
        want = np.array([_reference(x)[0] for x in lines[: sum(sizes)]], np.float32)
        np.testing.assert_array_equal(np.concatenate([b["label"] for b in batches]), want)
    # small read chunks: lines cut across chunks, and batches across the two files
    ids = _ids(ct.TSVLoader(_config(d, 40, chunk_bytes=333, drop_last=False)))
    np.testing.assert_array_equal(np.concatenate(ids), np.arange(120))
    # two gzip members in one file read as one
    g = tmp_path / "two.gz"
    g.write_bytes(gzip.compress(("\n".join(lines[:5]) + "\n").encode()) + gzip.compress(lines[5].encode()))
    assert np.array_equal(np.concatenate(_ids(ct.TSVLoader(_config(str(g), 3)))), np.arange(6))
    g.write_bytes(gzip.compress(("\n".join(lines) + "\n").encode())[:-40])
    with pytest.raises(ValueError, match="truncated gzip"):
        list(ct.TSVLoader(_config(str(g), 3)))


@pytest.mark.parametrize("processes", [2, 3])
def test_host_sharding_is_disjoint_and_covers_every_full_batch(day_dir, processes):
    d, lines = day_dir
    b = 12  # global batch: 10 full ones of 120 lines
    whole = _ids(ct.TSVLoader(_config(d, b)))
    shares = [
        _ids(ct.TSVLoader(_config(d, b, process_index=k, process_count=processes))) for k in range(processes)
    ]
    assert all(len(s) == len(whole) == 10 for s in shares)
    for i, batch in enumerate(whole):  # process k holds the k-th contiguous block of each batch
        np.testing.assert_array_equal(np.concatenate([s[i] for s in shares]), batch)
        assert all(s[i].size == b // processes for s in shares)
    # drop_last=False: the 12 lines left split into near-equal blocks, still disjoint and covering
    b = 18
    shares = [
        _ids(ct.TSVLoader(_config(d, b, drop_last=False, process_index=k, process_count=processes)))
        for k in range(processes)
    ]
    every = np.concatenate([x for s in shares for x in s])
    assert sorted(every.tolist()) == list(range(120))
    assert [s[-1].size for s in shares] == [12 // processes] * processes
    with pytest.raises(ValueError, match="does not split"):
        ct.TSVLoader(_config(d, 13, process_index=0, process_count=processes))


_TWO_PROCESSES = """
import sys, numpy as np, jax
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec
from examples import criteo_tsv as ct
path, port, pid = sys.argv[1], sys.argv[2], int(sys.argv[3])
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(f"localhost:{port}", num_processes=2, process_id=pid)
sharding = NamedSharding(jax.make_mesh((2,), ("data",)), PartitionSpec("data"))
whole = list(ct.TSVLoader(ct.TSVConfig(path, 12, process_index=0, process_count=1)))
with ct.TSVLoader(ct.TSVConfig(path, 12)).prefetch(sharding) as it:  # this process's half
    for i, batch in enumerate(it):
        for k, x in batch.items():
            assert x.shape[0] == 12 and x.sharding == sharding
            np.testing.assert_array_equal(multihost_utils.process_allgather(x, tiled=True), whole[i][k])
print("batches", i + 1)
"""


def test_two_processes_assemble_the_global_batch(day_dir):
    """jax.distributed, 2 CPU processes: each parses its half; the global batch on the mesh
    is the single process's batch."""
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = str(s.getsockname()[1])
    root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": root, "JAX_PLATFORMS": "cpu"}
    cmd = [sys.executable, "-c", _TWO_PROCESSES, day_dir[0], port]
    procs = [
        subprocess.Popen(
            [*cmd, str(k)], env=env, cwd=root, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        for k in range(2)
    ]
    try:
        outs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()  # a no-op on an ended process; ends the other when one hangs
    for p, out in zip(procs, outs):
        assert p.returncode == 0 and "batches 10" in out, out[-3000:]


def test_prefetcher_yields_the_plain_batches_on_device(day_dir):
    d, _ = day_dir
    loader = ct.TSVLoader(_config(d, 16))
    plain = list(loader)
    mesh = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1])
    sharding = NamedSharding(mesh, PartitionSpec("data"))
    for shard in (None, sharding):
        with loader.prefetch(shard) as it:
            got = list(it)
        assert len(got) == len(plain) == 7
        for g, p in zip(got, plain):
            assert set(g) == set(p)
            for k in p:
                assert isinstance(g[k], jax.Array) and g[k].dtype == p[k].dtype
                np.testing.assert_array_equal(np.asarray(g[k]), p[k])
                if shard is not None:
                    assert g[k].sharding == sharding
    # closing early stops the thread; a repeating stream keeps giving batches
    it = ct.TSVLoader(_config(d, 16, repeat=True)).prefetch(depth=2)
    many = [next(it) for _ in range(20)]  # 7 batches an epoch
    np.testing.assert_array_equal(np.asarray(many[7]["dense"]), plain[0]["dense"])
    it.close()
    assert not it._thread.is_alive() and not any(t.name == "tsv-prefetch" for t in threading.enumerate())
    with pytest.raises(StopIteration):
        next(it)


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (lambda f: f[:-1], r"39 tab-separated columns, expected 40"),
        (lambda f: f + ["x"], r"41 tab-separated columns"),
        (lambda f: f[:20] + ["zz00ab12"] + f[21:], r"categorical feature C7 'zz00ab12' is not 1-8 hex"),
        (lambda f: f[:20] + ["-1234567"] + f[21:], r"categorical feature C7 '-1234567'"),
        (lambda f: f[:20] + ["123456789"] + f[21:], r"categorical feature C7 '123456789'"),
        (lambda f: f[:3] + ["12a"] + f[4:], r"integer feature I3 '12a' is not"),
        (lambda f: f[:3] + ["-"] + f[4:], r"integer feature I3 '-'"),
        (lambda f: f[:3] + ["1234567890x"] + f[4:], r"integer feature I3 '1234567890x'"),
        (lambda f: f[:3] + ["12345-7890"] + f[4:], r"integer feature I3 '12345-7890'"),
        (lambda f: f[:3] + ["1" * 17] + f[4:], r"integer feature I3 '1{17}' is not -\?\[0-9\]\+ \(<= 16"),
        (lambda f: ["2"] + f[1:], r"label '2' is not 0 or 1"),
        (lambda f: [""] + f[1:], r"label '' is not 0 or 1"),
    ],
)
def test_malformed_lines_name_file_and_line(tmp_path, bad, message):
    a, b = _lines(30, seed=5), _lines(30, seed=6)
    b[16] = "\t".join(bad(b[16].split("\t")))
    d = tmp_path / "days"
    d.mkdir()
    _write(d / "day_0", a)
    path = _write(d / "day_1.gz", b, gz=True)
    match = rf"{re.escape(path)}, line 17: {message}"
    with pytest.raises(ValueError, match=match):
        list(ct.TSVLoader(_config(str(d), 20)))
    with ct.TSVLoader(_config(str(d), 20)).prefetch() as it:  # raised in the consumer
        next(it)
        next(it)
        with pytest.raises(ValueError, match=match):
            next(it)
    with pytest.raises(ValueError, match=r"^malformed Criteo TSV line 17: " + message):
        ct.parse_lines(("\n".join(b) + "\n").encode())


def test_split_tail_holds_out_the_last_lines(day_dir):
    d, _ = day_dir
    segments = ct.expand_paths(d)
    assert ct.count_lines(segments[1].path) == 50  # the last line has no '\n'
    for lines, heads in ((30, 2), (50, 1), (64, 1)):
        head, tail = ct.split_tail(segments, lines)
        assert len(head) == heads
        train = np.concatenate(_ids(ct.TSVLoader(_config(head, 1))))
        held = np.concatenate(_ids(ct.TSVLoader(_config(tail, 1))))
        np.testing.assert_array_equal(train, np.arange(120 - lines))
        np.testing.assert_array_equal(held, np.arange(120 - lines, 120))
    with pytest.raises(ValueError, match="no training data"):
        ct.split_tail(segments, 120)


def test_vocabulary(tmp_path, day_dir):
    d, lines = day_dir
    vocab = ct.build_vocab(d, min_count=2, chunk_lines=17)
    counts = [collections.Counter() for _ in range(ct.NUM_SPARSE)]
    for line in lines:
        for f, x in enumerate(_reference(line)[2]):
            if x is not None:
                counts[f][x] += 1
    for f in range(ct.NUM_SPARSE):
        np.testing.assert_array_equal(vocab.keys[f], sorted(x for x, c in counts[f].items() if c >= 2))
    assert any(k.size for k in vocab.keys) and vocab.rows == tuple(k.size + 1 for k in vocab.keys)
    vocab.save(tmp_path / "v.npz")
    again = ct.Vocab.load(tmp_path / "v.npz")
    assert again.min_count == 2 and all(np.array_equal(x, y) for x, y in zip(again.keys, vocab.keys))
    loader = ct.TSVLoader(_config(d, 120, categorical="vocab"), again)
    (b,) = list(loader)
    assert loader.cardinalities == vocab.rows
    for r, line in enumerate(lines):
        for f, x in enumerate(_reference(line)[2]):
            keys = list(vocab.keys[f])
            assert b["sparse"][r, f] == (keys.index(x) + 1 if x in keys else 0)
    with pytest.raises(ValueError, match="takes a Vocab"):
        ct.TSVLoader(_config(d, 8, categorical="vocab"))


def test_speed_script_runs(day_dir, capsys):
    d, _ = day_dir
    assert ct.main([d]) > 0
    assert "120 lines" in capsys.readouterr().out


def test_dlrm_trains_on_tsv(tmp_path):
    lines = _lines(400, seed=7)
    path = _write(tmp_path / "train.txt", lines)
    argv = ["--data", path, "--steps", "3", "--batch-size", "64", "--eval-batches", "2"]
    argv += ["--max-rows", "5000", "--rank", "4", "--bottom", "16", "--top", "16", "--no-progress"]
    res = dlrm.main(argv + ["--log-every", "1", "--profile-steps", "1"])["tt"]
    assert math.isfinite(res.final_loss) and math.isfinite(res.eval_loss) and 0.0 <= res.auc <= 1.0
    assert math.isnan(res.bayes_auc) and res.steps == 3 and res.step_times.data > 0
    assert res.embedding_bytes < res.dense_equivalent_bytes
    with pytest.raises(SystemExit):
        dlrm.parse_args(["--data", path, "--preset", "meta"])
