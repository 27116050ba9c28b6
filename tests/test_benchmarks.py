"""The benchmark suite: ``python -m benchmarks --quick`` end to end on CPU (JSON structure,
positive finite numbers, plots, the README generator), the scaling stage on 2 virtual CPU
devices, the workload generators' statistics and reproducibility, and the package's imports
(no cycle)."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from benchmarks import scaling_report
from benchmarks import workloads as wl
from benchmarks.impls import REGISTRY
from flowtt_jax.kernels import ffi

ROOT = Path(__file__).resolve().parents[1]

MODES = ("fwd", "fwd_bwd")


def run_benchmarks(out: Path, *argv: str, **env: str) -> str:
    """``python -m benchmarks *argv --out-dir out`` on the CPU with commit ``test-commit``
    and the environment ``env`` added; asserts it succeeds, returns its stdout."""
    if not ffi.available():
        pytest.skip("compiled extension not built (ours needs it)")
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks", *argv, "--out-dir", str(out)],
        cwd=ROOT,
        env={**os.environ, "JAX_PLATFORMS": "cpu", "FLOWTT_COMMIT": "test-commit", **env},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    run_benchmarks(out, "--quick")
    (path,) = out.glob("bench_quick_all_cpu_*.json")
    return out, json.loads(path.read_text())


def _numbers(x, path=""):
    """Every (path, number) in a JSON tree."""
    if isinstance(x, bool):
        return
    if isinstance(x, (int, float)):
        yield path, x
    elif isinstance(x, dict):
        for k, v in x.items():
            yield from _numbers(v, f"{path}.{k}")
    elif isinstance(x, list):
        for i, v in enumerate(x):
            yield from _numbers(v, f"{path}[{i}]")


@pytest.mark.slow
def test_quick_run_json(quick_run):
    _, doc = quick_run
    for key in ("device", "date", "commit", "jax", "timing_method", "status", "cases", "plots"):
        assert key in doc, key
    assert doc["commit"] == "test-commit" and doc["quick"] is True
    assert doc["status"] == "complete" and doc["timing_method"] == "queued"
    suites = {c["suite"] for c in doc["cases"]}
    assert suites == {"single", "collection"}
    for case in doc["cases"]:
        expected = {name for name, impl in REGISTRY.items() if case["suite"] in impl.suites}
        assert set(case["impls"]) == expected, case["case"]
        assert case["stats"]["nnz"] > 0 and case["stats"]["compression_ratio"] > 1
        for name, rec in case["impls"].items():
            assert rec["param_bytes"] > 0 and rec["compression_ratio"] >= 1, (case["case"], name)
            for mode in MODES:
                r = rec[mode]
                assert "error" not in r and "skipped" not in r, (case["case"], name, mode, r)
                assert r["ms"] > 0 and r["compile_s"] > 0 and r["lower_s"] > 0
                assert r["peak_bytes"] > 0 and r["temp_bytes"] >= 0
                assert r["memory"]["argument_size"] > 0 and r["memory"]["output_size"] > 0
                assert r["floor"]["kind"] in ("flops", "bytes") and r["floor"]["amount"] > 0
    for path, x in _numbers(doc):
        assert math.isfinite(x) and x >= 0, (path, x)


@pytest.mark.slow
def test_quick_run_plots_and_readme(quick_run, tmp_path):
    out, doc = quick_run
    pytest.importorskip("matplotlib")
    for name, where in doc["plots"].items():
        assert Path(where).is_file() and Path(where).stat().st_size > 1000, name
    # The README generator takes the newest non-quick run of each stage.
    full = {**doc, "quick": False}
    src = tmp_path / "run.json"
    src.write_text(json.dumps(full))
    readme = tmp_path / "README.md"
    readme.write_text(
        "a\n<!-- bench:start -->\nold\n<!-- bench:end -->\nb\n"
        "<!-- bench-collection:start -->\n<!-- bench-collection:end -->\nc\n"
    )
    subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.report",
            "--readme",
            str(readme),
            "--plots-dir",
            str(tmp_path / "plots"),
            str(src),
        ],
        cwd=ROOT,
        check=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    text = readme.read_text()
    assert "old" not in text and text.startswith("a\n") and text.endswith("c\n")
    assert "| D | rank | bags |" in text and "| tables | bags |" in text
    assert "](plots/latency_vs_batch.png)" in text and "](plots/latency_vs_tables.png)" in text
    assert (tmp_path / "plots" / "memory_collection.png").is_file()


@pytest.fixture(scope="module")
def weighted_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench_w")
    run_benchmarks(
        out, "--quick", "--suite", "single", "--weighted", "--batches", "32", "--dists", "zipf1.05"
    )
    (path,) = out.glob("bench_quick_single_cpu_*.json")
    return json.loads(path.read_text())


@pytest.mark.slow
def test_weighted_run_json(weighted_run, tmp_path):
    doc = weighted_run
    assert doc["status"] == "complete"
    plain, weighted = doc["cases"]
    assert (plain["case"], weighted["case"]) == ("D32_r8_B32_zipf1.05", "D32_r8_B32_zipf1.05_w")
    assert "weighted" not in plain["workload"] and "weighted" not in plain["stats"]
    assert weighted["workload"]["weighted"] is True and weighted["stats"]["weighted"] is True
    assert weighted["stats"]["nnz"] == plain["stats"]["nnz"]
    for mode in MODES:
        assert weighted["stats"]["flop_floor"][mode] > plain["stats"]["flop_floor"][mode]
    assert set(weighted["impls"]) == {n for n, i in REGISTRY.items() if "single" in i.suites}
    for name, rec in weighted["impls"].items():
        for mode in MODES:
            assert rec[mode]["ms"] > 0 and rec[mode]["floor"]["amount"] > 0, (name, mode, rec[mode])
    src = tmp_path / "run.json"
    src.write_text(json.dumps({**doc, "quick": False}))
    readme = tmp_path / "README.md"
    readme.write_text("<!-- bench:start -->\n<!-- bench:end -->\n")
    cmd = [sys.executable, "-m", "benchmarks.report", "--readme", str(readme), str(src)]
    subprocess.run(cmd + ["--plots-dir", str(tmp_path / "plots")], cwd=ROOT, check=True)
    text = readme.read_text()
    assert "| zipf1.05 |" in text and "| zipf1.05, weighted |" in text
    assert "of the per-id weights" in text


def test_weighted_alias_and_draw(tmp_path):
    from benchmarks.__main__ import Runner, parse_args

    argv = "--stage single-d32 --impls dense_bag,ours --ranks 32 --dists zipf1.05 --batches 32768 --weighted"
    doc: dict = {}
    Runner(parse_args(argv.split()), tmp_path / "x.json", doc)
    assert [(c["case"], c["alias"]) for c in doc["cases"]] == [
        ("D32_r32_B32768_zipf1.05", "S1"),
        ("D32_r32_B32768_zipf1.05_w", "S1_weighted"),
    ]
    plain, w = wl.single_table(batch=512), wl.single_table(batch=512, weighted=True)
    np.testing.assert_array_equal(w.ids, plain.ids)
    np.testing.assert_array_equal(w.weights, wl.single_table(batch=512, weighted=True).weights)
    assert plain.weights is None and w.name == plain.name + "_w"
    assert w.weights.dtype == np.float32 and w.weights.shape == w.ids.shape
    assert w.weights.min() >= 0.5 and w.weights.max() < 1.5


@pytest.mark.parametrize("name", [n for n, i in REGISTRY.items() if "single" in i.suites])
def test_weighted_impls_match_reference(name):
    """Each single-table impl's weighted forward and its gradient w.r.t. the weights equal a
    NumPy weighted bag over the TT table (dense_bag: given that table)."""
    import jax

    from benchmarks.__main__ import QUICK, single_kwargs
    from benchmarks.impls import tt_cores
    from flowtt_jax.tt import reference

    impl = REGISTRY[name]
    if name.startswith("ours") and not ffi.available():
        pytest.skip("compiled extension not built")
    w = wl.single_table(**single_kwargs(QUICK, 32, 8, 32, "zipf1.05", 0, weighted=True))
    cores = tt_cores(w)
    n = w.specs[0].num_embeddings
    table = np.asarray(jax.jit(reference.tt_rows)(cores[0], np.arange(n)))
    params = jax.device_put(table) if impl.dense else impl.init(w, cores)
    cot = np.random.default_rng(0).standard_normal((w.batch, 32)).astype(np.float32)
    fwd = impl.build(w)

    @jax.jit  # one program (op by op, the forward and its vjp compiled ~30 ops an impl)
    def forward_and_vjp(params, weights, cot):
        out, vjp = jax.vjp(lambda ww: fwd(params, w.ids, w.offsets, ww), weights)
        return out, vjp(cot)[0]

    out, d_weights = forward_and_vjp(params, w.weights, cot)
    bag = np.repeat(np.arange(w.batch), np.diff(w.offsets))
    rows = table[w.ids].astype(np.float64)
    want = np.zeros((w.batch, 32))
    np.add.at(want, bag, rows * w.weights[:, None])
    np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(d_weights, (rows * cot[bag]).sum(1), rtol=1e-4, atol=1e-5)


def _legacy_draw(num_embeddings, bags, dist, seed=0):
    """The draw of the original bench_single_table.make_workload (S1 must not change)."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 28, bags)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    n = int(offsets[-1])
    if dist == "uniform":
        ids = rng.integers(0, num_embeddings, n)
    else:
        ranks = rng.zipf(float(dist[4:]), n) - 1
        ids = (ranks.astype(np.uint64) * np.uint64(2654435761)) % np.uint64(num_embeddings)
    return ids.astype(np.int32), offsets


@pytest.mark.parametrize("dist", ["uniform", "zipf1.05", "zipf1.2"])
def test_single_table_is_the_original_draw(dist):
    w = wl.single_table(batch=4096, dist=dist)
    ids, offsets = _legacy_draw(10**7, 4096, dist)
    np.testing.assert_array_equal(w.ids, ids)
    np.testing.assert_array_equal(w.offsets, offsets)
    assert w.specs[0].row_shape == (200, 200, 250)


def test_s1():
    w = wl.single_table()
    s = w.stats()
    assert (s["nnz"], s["num_unique"], s["num_groups"]) == (457971, 262350, 39946)  # as measured
    lengths = np.diff(w.offsets)
    assert lengths.min() == 1 and lengths.max() == 27 and abs(lengths.mean() - 14) < 0.1
    assert w.ids.min() >= 0 and w.ids.max() < 10**7


@pytest.fixture(scope="module")
def meta240():
    return wl.MetaLikeCollection.create(240, seed=0)


def test_meta_like_tables(meta240):
    c = meta240
    assert c.rows.min() >= 10**4 and c.rows.max() <= 4 * 10**7
    logs = np.log(c.rows)
    assert abs(logs.mean() - (np.log(1e4) + np.log(4e7)) / 2) < 0.5  # log-uniform
    assert 0.05 <= c.one_hot.mean() <= 0.15
    assert abs(c.pooling_mean.mean() - 13.6) < 1e-9  # expected pooling over all features
    assert np.all(c.pooling_mean[c.one_hot] == 1.0)
    assert c.alpha.min() >= 1.01 and c.alpha.max() <= 1.2
    assert all(s.embedding_dim == 32 and s.ranks == (1, 32, 32, 1) for s in c.specs)
    assert all(s.num_embeddings == n for s, n in zip(c.specs, c.rows))
    # The first tables of a larger collection are the smaller collection's tables.
    big = wl.MetaLikeCollection.create(480, seed=0)
    np.testing.assert_array_equal(big.rows[:240], c.rows)
    np.testing.assert_array_equal(big.alpha[:240], c.alpha)


def test_meta_like_draw(meta240):
    batch = 256
    w = meta240.draw(batch)
    f, b = w.num_features, w.batch
    assert (f, b, w.feature_table) == (240, batch, tuple(range(240)))
    o = w.offsets
    assert o.shape == (f * b + 1,) and o.dtype == np.int32 and w.ids.dtype == np.int32
    assert o[0] == 0 and o[-1] == w.nnz and np.all(np.diff(o) >= 0)
    lengths = np.diff(o).reshape(f, b)
    assert np.all(lengths[meta240.one_hot] == 1)
    assert abs(w.nnz / (f * b) - 13.6) < 0.5
    bounds = w.feature_bounds
    for t in range(f):
        seg = w.ids[bounds[t] : bounds[t + 1]]
        assert seg.size == 0 or (seg.min() >= 0 and seg.max() < meta240.rows[t])
    s = w.stats()
    assert abs(s["one_hot_fraction"] - meta240.one_hot.mean()) < 1e-9
    assert 0 < s["unique_fraction"] < 1 and s["num_groups"] <= s["num_unique"]
    # Seeded: the same seed draws the same bags, another seed others.
    again = wl.MetaLikeCollection.create(240, seed=0).draw(batch)
    np.testing.assert_array_equal(again.ids, w.ids)
    np.testing.assert_array_equal(again.offsets, w.offsets)
    other = wl.MetaLikeCollection.create(240, seed=1).draw(batch)
    assert other.nnz != w.nnz or not np.array_equal(other.ids, w.ids)


@pytest.mark.parametrize("alpha,n", [(1.01, 50), (1.2, 7), (1.1, 1000)])
def test_bounded_zipf_matches_its_pmf(alpha, n):
    draws = wl.bounded_zipf(np.random.default_rng(0), alpha, n, 200_000)
    assert draws.min() >= 0 and draws.max() < n
    pmf = np.arange(1, n + 1.0) ** -alpha
    pmf /= pmf.sum()
    freq = np.bincount(draws, minlength=n) / draws.size
    sigma = np.sqrt(pmf * (1 - pmf) / draws.size)
    assert np.all(np.abs(freq - pmf) < 5 * sigma + 1e-4)


def test_hot_rows_scattered():
    """Zipf ranks map to rows by a bijection mod N (no two ranks share a row)."""
    for n in (10**4, 12345, 4 * 10**7):
        ranks = np.arange(min(n, 10**6), dtype=np.uint64)
        rows = (ranks * np.uint64(wl.HASH)) % np.uint64(n)
        assert np.unique(rows).size == ranks.size


def test_scaling_block_takes_each_case_from_its_newest_run(tmp_path):
    def run(date, commit, step_1, step_2):
        rows = [
            {
                "workload": "dlrm",
                "per_gpu_batch": 64,
                "num_gpus": 1,
                "strategy": "single",
                "step_s": step_1,
                "examples_per_s": 64 / step_1,
            },
            {
                "workload": "dlrm",
                "per_gpu_batch": 64,
                "num_gpus": 2,
                "strategy": "data",
                "step_s": step_2,
                "examples_per_s": 128 / step_2,
                "check": {"ok": True},
            },
        ]
        eff = [
            {
                "workload": "dlrm",
                "per_gpu_batch": 64,
                "strategy": "data",
                "num_gpus": 2,
                "efficiency": step_1 / step_2,
            }
        ]
        doc = {
            "device": "gpu:X",
            "num_devices": 2,
            "date": date,
            "commit": commit,
            "jax": "0",
            "results": rows,
            "efficiency": eff,
        }
        (tmp_path / f"scaling_X_{date}.json").write_text(json.dumps(doc))

    run("2026-01-01T00:00", "old0000", 1.0, 2.0)
    run("2026-02-01T00:00", "new1111", 0.001, 0.00125)
    text = scaling_report.section(scaling_report.load_runs(str(tmp_path)), tmp_path)
    assert "new1111" in text and "old0000" not in text
    assert "| dlrm | 64 | 2 | data | 1.25 | 102,400 | 0.80 | - | True |" in text
    assert "| dlrm | 64 | 1 | single | 1.00 | 64,000 | - | - | - |" in text


@pytest.mark.slow
def test_layer_impls_equal_the_packed_op():
    """``ours_layer`` (KeyedJagged call) and ``ours_layer_dict`` (dict call) give the values
    of ``ours_batched`` on a Meta-like collection, and their gradients (CPU: bit for bit)."""
    import jax

    from benchmarks.impls import CONSTRUCT_S, tt_cores

    if not ffi.available():
        pytest.skip("compiled extension not built")
    w = wl.MetaLikeCollection.create(5, seed=2, rows_range=(1e3, 1e5)).draw(16)
    cores = tt_cores(w)
    cot = np.random.default_rng(1).standard_normal((w.batch, 5 * 32)).astype(np.float32)
    results = {}
    for name in ("ours_batched", "ours_layer", "ours_layer_dict"):
        impl = REGISTRY[name]
        params = impl.init(w, cores)
        out, vjp = jax.vjp(lambda p, impl=impl: impl.build(w)(p, w.ids, w.offsets), params)
        (grads,) = vjp(cot)
        results[name] = (np.asarray(out), [np.asarray(g) for g in jax.tree.leaves(grads)])
    assert CONSTRUCT_S[("ours_layer", w.name)] > 0
    out, grads = results["ours_batched"]
    assert np.any(out)
    assert len(grads) == 9  # three shape groups (small tables cap their ranks), in the same order

    # CPU: bit for bit; the GPU's kernels sum in another order per call form (H100, 3a61906:
    # 10 % of the bags differ in the last bits, 7.6e-6 absolute on values of ~40)
    def same(a, b):
        if jax.default_backend() == "cpu":
            np.testing.assert_array_equal(a, b)
        else:
            assert np.linalg.norm(a - b) <= 1e-5 * np.linalg.norm(b), (name, np.abs(a - b).max())

    for name in ("ours_layer", "ours_layer_dict"):
        same(results[name][0], out)
        for a, b in zip(results[name][1], grads, strict=True):
            same(a, b)


@pytest.fixture(scope="module")
def scaling_run(tmp_path_factory):
    """The scaling stage at its quick sizes on 2 virtual CPU devices: (JSON path, JSON, stdout)."""
    out = tmp_path_factory.mktemp("scaling")
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=2"
    stdout = run_benchmarks(out, "--stage", "scaling", "--quick", XLA_FLAGS=flags)
    (path,) = (out / "scaling").glob("bench_quick_scaling_cpu_*.json")
    return path, json.loads(path.read_text()), stdout


@pytest.mark.slow
def test_scaling_run_json(scaling_run):
    _, doc, stdout = scaling_run
    assert doc["stage"] == "scaling" and doc["quick"] is True and doc["status"] == "complete"
    assert doc["commit"] == "test-commit" and doc["num_devices"] == 2
    assert doc["env"]["NCCL_NVLS_ENABLE"] == os.environ.get("NCCL_NVLS_ENABLE", "0")
    runs = {(r["workload"], r["num_gpus"], r["strategy"]): r for r in doc["results"]}
    per_case = ((1, "single"), (2, "data"), (2, "table"))
    assert set(runs) == {(w, n, s) for w in ("dlrm", "meta3") for n, s in per_case}
    for key, r in runs.items():
        assert "error" not in r and "skipped" not in r, (key, r)
        assert r["per_gpu_batch"] == 32 and r["global_batch"] == 32 * r["num_gpus"]
        assert r["step_s"] > 0 and r["examples_per_s"] > 0 and r["compile_s"] > 0
        assert len(r["repeats_s"]) == 3 and r["memory_analysis"]["argument_size"] > 0
        assert r["profile"] is None  # no GPU in the trace
        if r["num_gpus"] == 2:
            assert r["check"]["ok"] is True, (key, r["check"])
    assert runs[("dlrm", 2, "table")]["placement"]["imbalance"] >= 1
    assert {(e["workload"], e["strategy"]) for e in doc["efficiency"]} == {
        (w, s) for w in ("dlrm", "meta3") for s in ("data", "table")
    }
    assert all(e["efficiency"] > 0 for e in doc["efficiency"])
    assert "| meta3 | 32 | 2 | table |" in stdout


@pytest.mark.slow
def test_scaling_block_renders_from_the_stage(scaling_run, tmp_path):
    path, doc, _ = scaling_run
    pytest.importorskip("matplotlib")
    assert Path(doc["plots"]["scaling"]) == path.with_suffix(".png") and path.with_suffix(".png").is_file()
    # The report reads non-quick runs of its folder: the stage's JSON named as a stage writes it.
    folder = tmp_path / "scaling"
    folder.mkdir()
    name = path.name.replace("bench_quick_", "bench_")
    (folder / name).write_text(json.dumps({**doc, "quick": False}))
    (folder / name).with_suffix(".png").write_bytes(path.with_suffix(".png").read_bytes())
    text = scaling_report.section(scaling_report.load_runs(str(folder)), tmp_path)
    assert f"`{name}` (cpu:cpu x2, {doc['date'][:10]}, commit test-co," in text
    eff = {(e["workload"], e["strategy"]): e["efficiency"] for e in doc["efficiency"]}
    for r in doc["results"]:
        e = eff.get((r["workload"], r["strategy"]))
        e = "-" if e is None else f"{e:.2f}"
        cells = f"{1e3 * r['step_s']:.2f} | {r['examples_per_s']:,.0f} | {e} |"
        assert f"| {r['workload']} | 32 | {r['num_gpus']} | {r['strategy']} | {cells}" in text
    assert text.index("| dlrm |") < text.index("| meta3 |")
    assert f"![scaling](scaling/{name[:-5]}.png)" in text


def test_scaling_arguments():
    from benchmarks.__main__ import FULL, SCALING_BUDGET, parse_args

    a = parse_args(["--stage", "scaling", "--meta-cases", "788x4096,240x32768", "--strategies", "data"])
    assert a.suite == "scaling" and a.meta_cases == ((788, 4096), (240, 32768)) and a.strategies == ("data",)
    assert a.dlrm_batches == FULL["dlrm_batches"] and a.time_budget == SCALING_BUDGET and a.workers >= 1
    assert parse_args(["--stage", "scaling", "--meta-cases", ""]).meta_cases == ()
    for argv in (
        ["--stage", "scaling", "--batches", "32"],  # the single-device suites' option
        ["--stage", "collection", "--gpus", "2"],  # the scaling stage's
        ["--stage", "scaling", "--strategies", "pipeline"],
    ):
        with pytest.raises(SystemExit):
            parse_args(argv)


def _benchmarks_imports() -> dict[str, set[str]]:
    """Each module of ``benchmarks/`` and the package's modules it imports, at any depth of
    its code (function-level imports too)."""
    import ast

    folder = ROOT / "benchmarks"
    modules = {p.stem for p in folder.glob("*.py")}
    graph = {}
    for name in modules:
        found = set()
        for node in ast.walk(ast.parse((folder / f"{name}.py").read_text())):
            if isinstance(node, ast.Import):
                parts = [a.name.split(".") for a in node.names]
                found |= {p[1] for p in parts if p[0] == "benchmarks" and len(p) > 1}
            elif isinstance(node, ast.ImportFrom):
                mod = node.module or ""
                if node.level == 0 and not mod.startswith("benchmarks"):
                    continue
                sub = mod.split(".")[1:] if node.level == 0 else mod.split(".")
                # "from . import x" / "from benchmarks import x": x is the module
                found |= {sub[0]} if sub and sub[0] else {a.name for a in node.names}
        graph[name] = (found & modules) - {name}
    return graph


def test_benchmarks_have_no_import_cycle():
    graph = _benchmarks_imports()
    assert "scaling_report" in graph["report"] and "records" in graph["scaling_report"]  # it sees imports
    state: dict[str, int] = {}  # 1: on the DFS path, 2: done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            assert state.get(nxt) != 1, "import cycle: " + " -> ".join(path[path.index(nxt) :] + [node, nxt])
            if nxt not in state:
                visit(nxt, path + [node])
        state[node] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [])
