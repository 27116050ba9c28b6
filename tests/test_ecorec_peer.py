"""The EcoRec peer (``benchmarks/ecorec_peer.py``) on the CPU: its sizes are the suite's, our
specs map to EcoRec's arguments exactly, the NumPy emulation of EcoRec's GEMMs (the device
check's reference) equals our TT bags and their gradients, the chunked draw equals
``MetaLikeCollection.draw`` with its stats, the cores are ``impls.tt_cores``' draws, the JSON of
``--backend numpy --quick``, and a workload import without jax. The GPU run (torch + CUDA +
an EcoRec checkout in ``ECOREC_PATH``) is skipped elsewhere."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flowtt_jax as ftt
from benchmarks import __main__ as suite
from benchmarks import ecorec_peer as peer
from benchmarks import impls
from benchmarks import workloads as wl

ROOT = Path(__file__).resolve().parents[1]


def test_sizes_are_the_suites():
    for mine, theirs in ((peer.FULL, suite.FULL), (peer.QUICK, suite.QUICK)):
        assert mine["rows_range"] == theirs["rows_range"]
        assert mine["collection_rank"] == theirs["collection_rank"]
        assert mine["tables"] == theirs["tables"]
        assert mine["batches"] == theirs["collection_batches"]


def test_meta_specs_map_exactly():
    coll = wl.MetaLikeCollection.create(240, 0, rows_range=(1e4, 4e7), rank=32)
    for spec in coll.specs:
        args = peer.ecorec_args(spec)
        assert args["num_embeddings"] == spec.num_embeddings and args["embedding_dim"] == 32
        assert args["tt_ranks"] == [32, 32] and args["tt_q_shapes"] == [2, 4, 4]
        assert args["tt_p_shapes"] == list(spec.row_shape)
        assert math.prod(args["tt_p_shapes"]) >= spec.num_embeddings  # EcoRec's assert
    summary = peer.mapping_summary(coll.specs)
    assert summary["exact"] and not summary["unsupported"]
    assert summary["col_shapes"] == [(2, 4, 4)] and summary["ranks"] == [(1, 32, 32, 1)]


def test_unsupported_specs_are_named():
    with pytest.raises(ValueError, match="3-core"):
        peer.ecorec_args(ftt.TTSpec.create(10_000, 32, 8, num_cores=2))
    with pytest.raises(ValueError, match="D % 4"):
        peer.ecorec_args(ftt.TTSpec.create(10_000, 18, 4))
    bad = peer.mapping_summary([ftt.TTSpec.create(10_000, 32, 8, num_cores=4)])
    assert not bad["exact"] and bad["unsupported"][0].startswith("table 0")


@pytest.fixture
def table():
    spec = ftt.TTSpec.create(5_000, 32, (3, 5))
    cores = next(peer.our_cores([spec], seed=4))
    rng = np.random.default_rng(5)
    lengths = np.array([3, 0, 1, 7, 2])
    ids = rng.integers(0, spec.num_embeddings, lengths.sum())
    ids[:3] = [spec.num_embeddings - 1, 0, ids[4]]  # the last row, row 0, a duplicate
    return spec, cores, ids, lengths


def test_numpy_emulation_is_our_bag(table):
    spec, cores, ids, lengths = table
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    ours = jax.jit(ftt.tt_embedding_bag)(cores, ids, offsets=offsets)  # one program, not op by op
    got = peer.np_bag(cores, spec.row_shape, ids, lengths)
    np.testing.assert_allclose(got, np.asarray(ours), rtol=1e-5, atol=1e-6)
    # EcoRec's storage: core k flattened to [p_k, r_{k-1} q_k r_k], read back in the same order.
    flat = [c.reshape(c.shape[0], -1) for c in cores]
    assert [f.shape for f in flat] == [(s[0], s[1] * s[2] * s[3]) for s in spec.core_shapes]
    again = [f.reshape(s) for f, s in zip(flat, spec.core_shapes)]
    np.testing.assert_array_equal(peer.np_bag(again, spec.row_shape, ids, lengths), got)


def test_numpy_gradients_are_ours(table):
    spec, cores, ids, lengths = table
    offsets = jnp.asarray(np.concatenate([[0], np.cumsum(lengths)]))
    cot = np.random.default_rng(6).standard_normal((len(lengths), 32)).astype(np.float32)

    def loss(cs):
        return jnp.sum(ftt.tt_embedding_bag(cs, jnp.asarray(ids), offsets=offsets, impl="reference") * cot)

    ours = jax.jit(jax.grad(loss))(list(cores))  # one program, not op by op
    got = peer.np_bag_grads(cores, spec.row_shape, ids, lengths, cot)
    for g, o in zip(got, ours):
        np.testing.assert_allclose(g, np.asarray(o), rtol=1e-4, atol=1e-5)


def test_empty_bags_and_tables():
    spec = ftt.TTSpec.create(1_000, 32, 4)
    cores = next(peer.our_cores([spec]))
    out = peer.np_bag(cores, spec.row_shape, np.zeros(0, np.int64), np.zeros(3, np.int64))
    assert out.shape == (3, 32) and not out.any()
    grads = peer.np_bag_grads(cores, spec.row_shape, np.zeros(0, np.int64), np.zeros(3, np.int64), out)
    assert all(not g.any() for g in grads)


def test_cores_are_impls_draws():
    coll = wl.MetaLikeCollection.create(3, 0, rows_range=(1e3, 1e5), rank=8)
    w = coll.draw(16)
    for mine, theirs in zip(peer.our_cores(w.specs), impls.tt_cores(w)):
        for a, b in zip(mine, theirs):
            np.testing.assert_array_equal(a, np.asarray(b))


@pytest.mark.parametrize("tables,batch", [(3, 32), (19, 64)])
def test_chunked_draw_is_the_draw(tables, batch):
    coll = wl.MetaLikeCollection.create(tables, 0, rows_range=(1e3, 1e5), rank=8)
    w, stats = peer.draw_case(coll, batch)
    ref = coll.draw(batch)
    assert w.name == ref.name and w.params == ref.params and w.specs == ref.specs
    np.testing.assert_array_equal(w.ids, ref.ids)
    np.testing.assert_array_equal(w.offsets, ref.offsets)
    assert w.ids.dtype == ref.ids.dtype and w.offsets.dtype == ref.offsets.dtype
    want = ref.stats()
    assert list(stats) == list(want)
    for k, v in want.items():
        assert stats[k] == pytest.approx(v, rel=1e-12), k


def test_busy_union():
    spans = [(0, 10), (5, 20), (30, 40), (35, 36)]
    b = peer.busy(spans, 2)
    assert b["busy_ms"] == pytest.approx(30 / 2 / 1e6) and b["span_ms"] == pytest.approx(40 / 2 / 1e6)
    assert peer.top_names({"a": 4e6, "b": 8e6}, 2, top=1) == {"b": 4.0}


def test_cases_and_missing_checkout(tmp_path):
    a = peer.parse_args(["--cases", "240x4096,788x32768"])
    assert peer.case_list(a, peer.FULL) == [(240, 4096), (788, 32768)]
    a = peer.parse_args(["--tables", "240,480", "--batches", "4096"])
    assert peer.case_list(a, peer.FULL) == [(240, 4096), (480, 4096)]
    assert len(peer.case_list(peer.parse_args([]), peer.FULL)) == 6
    pytest.importorskip("torch")
    with pytest.raises(FileNotFoundError, match="ecorec-path"):
        peer.build_extension(tmp_path, tmp_path / "build", "9.0")


def run_peer(tmp_path: Path, *argv: str) -> dict:
    """``python3 -m benchmarks.ecorec_peer --backend numpy --quick *argv`` in a fresh process
    (no jax there: the draw's fork pool is safe); its one JSON document."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "benchmarks.ecorec_peer", "--backend", "numpy", "--quick"]
    subprocess.run([*cmd, "--out-dir", str(tmp_path), *argv], cwd=ROOT, env=env, check=True)
    (path,) = tmp_path.glob("bench_quick_ecorec_numpy_*.json")
    return json.loads(path.read_text())


def test_quick_numpy_run_json(tmp_path):
    doc = run_peer(tmp_path, "--repeats", "2", "--workers", "2")
    assert doc["schema"] == "flowtt-bench/1" and doc["stage"] == "ecorec" and doc["status"] == "complete"
    assert doc["quick"] and doc["device"] == "cpu:numpy" and doc["commit"] and doc["date"]
    assert [c["case"] for c in doc["cases"]] == ["meta2_B32", "meta3_B32"]
    for case in doc["cases"]:
        rec = case["impls"]["numpy_emulation"]
        assert rec["mapping"]["exact"] and rec["param_bytes"] == case["stats"]["tt_param_bytes"]
        assert case["workload"]["rank"] == 8 and case["stats"]["nnz"] > 0
        for mode in peer.MODES:
            r = rec[mode]
            assert r["ms"] > 0 and r["repeats"] == 2 and len(r["times_ms"]) == 2
            assert r["ms"] == pytest.approx(sum(r["times_ms"]) / 2)  # the median of 2


def test_time_budget_skips(tmp_path):
    doc = run_peer(tmp_path, "--time-budget", "1", "--workers", "1")
    assert doc["status"] == "complete" and all(c.get("skipped") == "time budget" for c in doc["cases"])


def test_workloads_import_without_jax():
    code = (
        "import sys; from benchmarks import ecorec_peer as p; wl = p.workloads_module(); "
        "w = wl.MetaLikeCollection.create(2, 0).draw(8); "
        "assert w.nnz > 0 and 'jax' not in sys.modules and 'torch' not in sys.modules, sorted(sys.modules)"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, check=True)


def fake_ecorec(torch):
    """A stand-in for EcoRec's ``TTEmbeddingBag`` on the CPU: its constructor and call, its
    int64 inputs, its core storage ``[p_k, r_{k-1} q_k r_k]`` and its backward, an SGD step."""

    class Step(torch.autograd.Function):
        @staticmethod
        def forward(ctx, bag, ids, offsets, *cores):
            ctx.bag, ctx.args = bag, (ids, offsets)
            return bag.pooled(ids, offsets, cores)

        @staticmethod
        def backward(ctx, d):
            bag = ctx.bag
            cores = [c.detach().requires_grad_() for c in bag.tt_cores]
            with torch.enable_grad():
                grads = torch.autograd.grad(bag.pooled(*ctx.args, cores), cores, d)
            with torch.no_grad():
                for c, g in zip(bag.tt_cores, grads):
                    c -= bag.learning_rate * g
            return (None,) * (3 + len(cores))

    class Bag(torch.nn.Module):
        def __init__(
            self, num_embeddings, embedding_dim, tt_ranks, tt_p_shapes, tt_q_shapes, learning_rate, device
        ):
            super().__init__()
            self.embedding_dim, self.learning_rate = embedding_dim, learning_rate
            self.p, self.q, r = tt_p_shapes, tt_q_shapes, [1, *tt_ranks, 1]
            shapes = [(p, r[k] * q * r[k + 1]) for k, (p, q) in enumerate(zip(self.p, self.q))]
            self.tt_cores = torch.nn.ParameterList(
                torch.nn.Parameter(torch.randn(s, device=device)) for s in shapes
            )

        def pooled(self, ids, offsets, cores):
            (_, p2, p3), (q1, q2, q3) = self.p, self.q
            r1, r2 = cores[0].shape[1] // q1, cores[2].shape[1] // q3
            g1 = cores[0][ids // (p2 * p3)].view(-1, q1, r1)
            g2 = cores[1][(ids // p3) % p2].view(-1, r1, q2 * r2)
            g3 = cores[2][ids % p3].view(-1, r2, q3)
            rows = ((g1 @ g2).view(-1, q1 * q2, r2) @ g3).reshape(len(ids), -1)
            bag = torch.repeat_interleave(torch.arange(len(offsets) - 1), offsets.diff())
            return torch.zeros(len(offsets) - 1, rows.shape[1]).index_add_(0, bag, rows)

        def forward(self, indices, offsets):
            assert indices.dtype == offsets.dtype == torch.int64 and int(offsets[0]) == 0
            assert int(offsets[-1]) == len(indices) and len(indices) > 0
            return Step.apply(self, indices, offsets, *self.tt_cores)

    return Bag


def test_torch_glue_on_cpu():
    """The torch backend's glue (inputs, loop, concatenation, backward seed, check, timing) with
    a stand-in for EcoRec on the CPU: its bags are the NumPy emulation's, lr 0 keeps the cores."""
    torch = pytest.importorskip("torch")
    backend = peer.TorchBackend(torch, fake_ecorec(torch), device="cpu")
    coll = wl.MetaLikeCollection.create(3, 0, rows_range=(1e3, 1e5), rank=8)
    w, _ = peer.draw_case(coll, 32)
    info = backend.prepare(w)
    assert info["param_bytes"] == sum(s.num_params for s in w.specs) * 4 and info["empty_features"] == 0
    check = backend.check(16)
    assert check["ok"] and check["features"] == 3 and check["grad_max_abs_ref"] > 0, check
    ref = peer.NumpyBackend()
    ref.prepare(w)
    np.testing.assert_allclose(backend.fwd().numpy(), ref.fwd(), rtol=1e-4, atol=1e-5)
    before = [c.detach().clone() for c in backend.tables[0].tt_cores]
    backend.fwd_bwd()
    assert all(torch.equal(a, b) for a, b in zip(before, backend.tables[0].tt_cores))
    a = peer.parse_args(["--repeats", "2", "--warmup", "1"])
    run = peer.records.Run(a, Path("unused.json"), {})
    for mode in peer.MODES:
        r = peer.measure(backend, mode, run, w.nnz, info["param_bytes"])
        assert r["ms"] > 0 and r["method"] == "perf_counter" and "peak_bytes" not in r


def test_ecorec_on_the_gpu(tmp_path):
    """The real peer, quick sizes: needs torch with CUDA and ``ECOREC_PATH`` (an SC24_ADE checkout)."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available() or not os.environ.get("ECOREC_PATH"):
        pytest.skip("needs a CUDA device and ECOREC_PATH")
    argv = ["--ecorec-path", os.environ["ECOREC_PATH"], "--quick", "--out-dir", str(tmp_path)]
    argv += ["--build-dir", str(tmp_path / "build"), "--workers", "1"]
    assert peer.main(argv) == 0
    doc = json.loads(next(tmp_path.glob("*.json")).read_text())
    for case in doc["cases"]:
        rec = case["impls"]["ecorec"]
        assert rec["check"]["ok"], rec["check"]
        assert all(rec[m]["ms"] > 0 and rec[m]["peak_bytes"] > rec["param_bytes"] for m in peer.MODES)
