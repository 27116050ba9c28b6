"""EcoRec (SC24, repository SC24_ADE) as a peer on the Meta-like collections; docs/benchmarks_ecorec.md
says what maps exactly, what differs and how to run it on the device:

    python3 -m benchmarks.ecorec_peer --ecorec-path third_party/SC24_ADE \\
        --cases 240x4096,240x32768 --out-dir DIR [--time-budget S] [--quick]

Per case (``--tables``/``--batches``: their product): the bags of ``python -m benchmarks --suite
collection``, one EcoRec ``TTEmbeddingBag`` per table with our shapes and cores, forward and
forward + backward over all tables (CUDA events, a torch.profiler busy time, peak memory), JSON
in the suite's shape. EcoRec's extension is built by ``torch.utils.cpp_extension`` into
``--build-dir`` (cached by a hash of sources, torch, CUDA, arch, flags). ``--backend numpy``: the
harness on the host with a NumPy emulation of EcoRec's GEMMs (tests; not a peer). torch is
imported by the torch backend only; the workloads load without flowtt_jax's ``__init__`` (no jax).
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import importlib
import importlib.util
import math
import multiprocessing
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path
from typing import Any

import numpy as np

from . import records

ROOT = Path(__file__).resolve().parents[1]
IMPL = "ecorec"
MODES = ("fwd", "fwd_bwd")
#: The suite's collection sizes (``benchmarks.__main__``'s FULL and QUICK; a test keeps them equal).
FULL = {"rows_range": (1e4, 4e7), "collection_rank": 32, "tables": (240, 480, 788), "batches": (4096, 32768)}
QUICK = {"rows_range": (1e3, 1e5), "collection_rank": 8, "tables": (2, 3), "batches": (32,)}
#: EcoRec's setup.py flags less -g (host debug info) and -masm=intel (the torch headers' asm).
CXX_FLAGS = ("-O3", "-DUSE_MKL", "-m64", "-mfma")
NVCC_FLAGS = ("-O3", "--expt-relaxed-constexpr", "-D__CUDA_NO_HALF_OPERATORS__")
SOURCES = ("tt_emb_kernel_wrap.cpp", "tt_emb_cuda.cu", "tt_cuda_utils.cuh")
DIFFERENCES = [
    "ids int64 (EcoRec's kernels require it); per table its id slice and offsets rebased to 0",
    "per-table Python loop (EcoRec has no table-batched op), outputs concatenated to [B, F*D]",
    "fwd under torch.no_grad",
    "fwd_bwd: EcoRec's fused backward + SGD step (dense core gradients, cores -= lr * grad), lr 0",
    "target of the squared error: torch.randn (seed 2), ours jax.random.normal(key(2))",
    "ms: CUDA events around the call (EcoRec's host syncs included); profile.busy_ms ~ our ms",
]


class Interrupted(BaseException):
    """SIGTERM (the device call's timeout): ends the run, the JSON keeps what was measured."""


def workloads_module() -> types.ModuleType:
    """``benchmarks.workloads``; flowtt_jax (unless imported) as a bare package over its folder, so
    ``flowtt_jax.tt.spec`` (NumPy only) loads without its ``__init__`` (jax, the built extension)."""
    if "flowtt_jax" not in sys.modules:
        pkg = types.ModuleType("flowtt_jax")
        pkg.__path__ = [str(ROOT / "flowtt_jax")]
        sys.modules["flowtt_jax"] = pkg
    return importlib.import_module("benchmarks.workloads")


def ecorec_args(spec) -> dict:
    """``TTEmbeddingBag`` keyword arguments for a ``TTSpec`` (ValueError where EcoRec's kernels
    cannot take it: they have 3 cores, ``D % 4 == 0``, int32 sizes)."""
    if spec.num_cores != 3:
        raise ValueError(f"EcoRec's kernels are 3-core only, the spec has {spec.num_cores} cores")
    if spec.embedding_dim % 4 or math.prod(spec.col_shape) != spec.embedding_dim:
        raise ValueError(f"EcoRec needs D % 4 == 0 and prod(col_shape) == D: {spec}")
    if spec.num_embeddings >= 2**31 or spec.row_shape[0] * spec.row_shape[1] >= 2**31:
        raise ValueError(f"EcoRec's sizes are int32: {spec}")
    return {
        "num_embeddings": int(spec.num_embeddings),
        "embedding_dim": int(spec.embedding_dim),
        "tt_ranks": [int(r) for r in spec.ranks[1:-1]],
        "tt_p_shapes": [int(p) for p in spec.row_shape],
        "tt_q_shapes": [int(q) for q in spec.col_shape],
    }


def mapping_summary(specs) -> dict:
    """How a collection's specs map to EcoRec's arguments (all exact, or why not)."""
    bad = []
    for t, spec in enumerate(specs):
        try:
            ecorec_args(spec)
        except ValueError as e:
            bad.append(f"table {t}: {e}")
    out = {"exact": not bad, "unsupported": bad, "col_shapes": sorted({tuple(s.col_shape) for s in specs})}
    out.update(ranks=sorted({tuple(s.ranks) for s in specs}), row_shapes=len({s.row_shape for s in specs}))
    return {**out, "core_layout": "EcoRec core k [p_k, r_{k-1}*q_k*r_k] = ours [p_k, r_{k-1}, q_k, r_k]"}


def core_std(spec) -> float:
    """Our cores' std (``impls.tt_cores``, ``ftt.init_cores``: rows of std 1/sqrt(D))."""
    return (1.0 / spec.embedding_dim / math.prod(spec.ranks)) ** (1.0 / (2 * spec.num_cores))


def our_cores(specs, seed: int = 1):
    """Per table, the host cores of ``impls.tt_cores`` (the same draws, NumPy, our layout)."""
    rng = np.random.default_rng(seed)
    for spec in specs:
        std = np.float32(core_std(spec))
        yield tuple(rng.standard_normal(s, dtype=np.float32) * std for s in spec.core_shapes)


def _factors(cores, row_shape, ids):
    p1, p2, p3 = row_shape
    ids = np.asarray(ids, np.int64)
    idx = (ids // (p2 * p3), (ids // p3) % p2, ids % p3)
    (_, _, q1, r1), (_, _, q2, r2), (_, _, q3, _) = (c.shape for c in cores)
    g1 = cores[0][idx[0]].reshape(-1, q1, r1)
    g2 = cores[1][idx[1]].reshape(-1, r1, q2 * r2)
    g3 = cores[2][idx[2]].reshape(-1, r2, q3)
    pre = (g1 @ g2).reshape(-1, q1 * q2, r2)  # EcoRec's part 1 (once per (i1, i2) prefix there)
    return idx, (g1, g2, g3), pre


def np_bag(cores, row_shape, ids, lengths) -> np.ndarray:
    """Sum-pooled bags ``[B, D]`` of one 3-core table, the rows built as EcoRec's two GEMMs."""
    _, (_, _, g3), pre = _factors(cores, row_shape, ids)
    dim = math.prod(c.shape[2] for c in cores)
    out = np.zeros((len(lengths), dim))
    np.add.at(out, np.repeat(np.arange(len(lengths)), lengths), (pre @ g3).reshape(len(ids), dim))
    return out.astype(np.float32)


def np_bag_grads(cores, row_shape, ids, lengths, cot) -> tuple[np.ndarray, ...]:
    """Gradients of ``sum(np_bag(...) * cot)`` w.r.t. the cores (our layout)."""
    idx, (g1, g2, g3), pre = _factors(cores, row_shape, ids)
    n, (q1, q2, q3), r2 = len(ids), (c.shape[2] for c in cores), g3.shape[1]
    drow = np.asarray(cot)[np.repeat(np.arange(len(lengths)), lengths)].reshape(n, q1 * q2, q3)
    d3 = pre.transpose(0, 2, 1) @ drow
    dpre = (drow @ g3.transpose(0, 2, 1)).reshape(n, q1, q2 * r2)
    d2 = g1.transpose(0, 2, 1) @ dpre
    d1 = dpre @ g2.transpose(0, 2, 1)
    grads = [np.zeros(c.shape, np.float64) for c in cores]
    for g, i, d in zip(grads, idx, (d1, d2, d3)):
        np.add.at(g, i, d.reshape((n,) + g.shape[1:]))
    return tuple(g.astype(np.float32) for g in grads)


def _draw_chunk(job) -> tuple[np.ndarray, np.ndarray, dict]:
    """(ids, lengths, stats) of some tables of a draw (a pool worker's part)."""
    coll, batch, tables = job
    wl = workloads_module()
    parts = coll.draw_tables(batch, tables)
    ids = np.concatenate([p[0] for p in parts])
    lengths = np.concatenate([p[1] for p in parts])
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    specs = tuple(coll.specs[t] for t in tables)
    sub = wl.Workload("chunk", batch, ids, offsets, tuple(range(len(tables))), specs, {})
    return ids, lengths, sub.stats()


def merge_stats(parts: list[dict], batch: int) -> dict:
    """``Workload.stats()`` of a whole draw from its chunks' stats."""
    total = lambda *keys: {k: sum(p[k] for p in parts) for k in keys}  # noqa: E731
    s = {**total("tables", "features"), "batch": batch, **total("nnz", "num_unique", "num_groups")}
    s.update(
        unique_fraction=s["num_unique"] / max(s["nnz"], 1), mean_pooling=s["nnz"] / (s["features"] * batch)
    )
    s["one_hot_fraction"] = sum(p["one_hot_fraction"] * p["features"] for p in parts) / s["features"]
    s.update(total("rows", "dense_param_bytes", "tt_param_bytes"))
    s["compression_ratio"] = s["dense_param_bytes"] / s["tt_param_bytes"]
    return {**s, "flop_floor": {m: sum(p["flop_floor"][m] for p in parts) for m in MODES}}


def draw_case(coll, batch: int, map_fn=map):
    """``coll.draw(batch)`` (the same bags, tables drawn in chunks of 8 by ``map_fn``) and its stats."""
    wl = workloads_module()
    chunks = [range(t, min(t + 8, coll.num_tables)) for t in range(0, coll.num_tables, 8)]
    parts = list(map_fn(_draw_chunk, [(coll, batch, c) for c in chunks]))
    offsets = np.concatenate([[0], np.cumsum(np.concatenate([p[1] for p in parts]))])
    if offsets[-1] >= 2**31:
        raise ValueError(f"{offsets[-1]} ids do not fit int32 offsets")
    ids, tables = np.concatenate([p[0] for p in parts]), tuple(range(coll.num_tables))
    params = {**coll.params, "batch": batch}
    w = wl.Workload(
        f"meta{coll.num_tables}_B{batch}", batch, ids, offsets.astype(np.int32), tables, coll.specs, params
    )
    return w, merge_stats([p[2] for p in parts], batch)


def wall_ms(fn) -> float:
    t = time.perf_counter()
    fn()
    return (time.perf_counter() - t) * 1e3


class NumpyBackend:
    """The harness on the host: EcoRec's GEMM order in NumPy (tests; not a peer)."""

    name, method, device = "numpy_emulation", "perf_counter", "cpu:numpy"
    description = "NumPy emulation of EcoRec's GEMMs, one table at a time (tests the harness; not a peer)"

    def prepare(self, w) -> dict:
        self.w, self.cores = w, list(our_cores(w.specs))
        self.lengths = np.diff(w.offsets).reshape(w.num_features, w.batch)
        dim = sum(w.specs[t].embedding_dim for t in w.feature_table)
        self.target = np.random.default_rng(2).standard_normal((w.batch, dim)).astype(np.float32)
        return {"param_bytes": sum(c.nbytes for cs in self.cores for c in cs), "input_bytes": w.ids.nbytes}

    def _bags(self):
        b = self.w.feature_bounds
        return [
            np_bag(self.cores[t], self.w.specs[t].row_shape, self.w.ids[b[f] : b[f + 1]], self.lengths[f])
            for f, t in enumerate(self.w.feature_table)
        ]

    def fwd(self):
        return np.concatenate(self._bags(), axis=1)

    def fwd_bwd(self):
        out, b = self.fwd(), self.w.feature_bounds
        cot = np.split(out - self.target, self.w.num_features, axis=1)
        for f, t in enumerate(self.w.feature_table):
            ids = self.w.ids[b[f] : b[f + 1]]
            np_bag_grads(self.cores[t], self.w.specs[t].row_shape, ids, self.lengths[f], cot[f])
        return out

    elapsed_ms = staticmethod(lambda fn: wall_ms(fn))
    memory_begin = memory_end = profile = staticmethod(lambda *args: None)  # no device memory, no trace

    def check(self, bags: int) -> dict:
        return {"skipped": "the NumPy emulation is its own reference"}

    def release(self) -> None:
        self.w = self.cores = None


def toolkit_fallbacks(cuda_home: str | None, out: Path) -> tuple[list[str], list[str]]:
    """Extra (include, library) folders where torch's toolkit lacks what the build needs: cuBLAS,
    cuSPARSE, cuSOLVER headers (torch's CUDA headers include them; its pip CUDA libraries
    ``nvidia/*/`` have them), an unversioned ``libcudart.so`` (else a link in ``out/libs``)."""
    need = ("cublas_v2.h", "cusparse.h", "cusolverDn.h")
    homes = [Path(cuda_home or "/usr/local/cuda"), Path("/usr/local/cuda")]
    spec = importlib.util.find_spec("nvidia")
    pip = sorted(d for r in (spec.submodule_search_locations if spec else []) for d in Path(r).glob("*"))
    includes = []
    if not any(
        all((d / n).is_file() for n in need)
        for h in homes
        for d in (h / "include", *h.glob("targets/*/include"))
    ):
        includes = [str(d / "include") for d in pip if any((d / "include" / n).is_file() for n in need)]
    libs = [d for h in homes for d in (h / "lib64", h / "lib", *h.glob("targets/*/lib"))] + [
        d / "lib" for d in pip
    ]
    if any((d / "libcudart.so").exists() for d in libs[:2]):  # where torch links from
        return includes, []
    for d in libs:
        if (d / "libcudart.so").exists():
            return includes, [str(d)]
    for so in (so for d in libs for so in sorted(d.glob("libcudart.so.*"))):
        (out / "libs").mkdir(parents=True, exist_ok=True)
        (out / "libs" / "libcudart.so").unlink(missing_ok=True)
        (out / "libs" / "libcudart.so").symlink_to(so)
        return includes, [str(out / "libs")]
    return includes, []


def build_extension(eco: Path, build_dir: Path, arch: str, log=print) -> tuple[Path, dict]:
    """EcoRec's ``_C`` extension built (or found) under ``build_dir/<key>``: (its .so, build info)."""
    import torch

    src = eco / "ecorec" / "tt_emb"
    missing = [s for s in SOURCES if not (src / s).is_file()]
    if missing:
        raise FileNotFoundError(f"no EcoRec sources {missing} under {src} (--ecorec-path)")
    h = hashlib.sha256()
    for s in SOURCES:
        h.update((src / s).read_bytes())
    sources_sha = h.hexdigest()
    from torch.utils.cpp_extension import CUDA_HOME

    key = (torch.__version__, torch.version.cuda, CUDA_HOME, arch, CXX_FLAGS, NVCC_FLAGS, sys.version)
    h.update(repr(key).encode())
    out = build_dir / f"ecorec_{h.hexdigest()[:16]}"
    info = {"dir": str(out), "arch": arch, "cxx_flags": CXX_FLAGS, "nvcc_flags": NVCC_FLAGS}
    info["sources_sha256"] = sources_sha
    includes, libs = toolkit_fallbacks(CUDA_HOME, out)
    info.update(cuda_home=CUDA_HOME, extra_include_dirs=includes, extra_library_dirs=libs)
    found = sorted((out / "lib").glob("_C*.so"))
    if found:
        return found[0], {**info, "cached": True}
    (out / "src").mkdir(parents=True, exist_ok=True)
    for s in SOURCES:
        (out / "src" / s).write_bytes((src / s).read_bytes())
    (out / "setup_peer.py").write_text(
        "import sys\n"
        "from setuptools import setup\n"
        "from torch.utils.cpp_extension import BuildExtension, CUDAExtension\n"
        "cxx, nvcc, inc, lib = (a.split(':') for a in sys.argv[1:5])\n"
        'srcs = ["src/tt_emb_kernel_wrap.cpp", "src/tt_emb_cuda.cu"]\n'
        "kw = dict(include_dirs=[d for d in inc if d], library_dirs=[d for d in lib if d])\n"
        'ext = CUDAExtension("_C", srcs, extra_compile_args={"cxx": cxx, "nvcc": nvcc}, **kw)\n'
        'setup(name="ecorec_peer_ext", ext_modules=[ext], cmdclass={"build_ext": BuildExtension},\n'
        '      script_args=["build_ext", "--build-lib", "lib", "--build-temp", "tmp"])\n'
    )
    env = {**os.environ, "TORCH_CUDA_ARCH_LIST": arch, "MAX_JOBS": os.environ.get("MAX_JOBS", "8")}
    log(f"building EcoRec's extension for sm {arch} in {out} ...")
    t = time.monotonic()
    with open(out / "build.log", "w") as f:
        args = [":".join(x) for x in (CXX_FLAGS, NVCC_FLAGS, includes, libs)]
        cmd = [sys.executable, "setup_peer.py", *args]
        rc = subprocess.run(cmd, cwd=out, env=env, stdout=f, stderr=subprocess.STDOUT).returncode
    found = sorted((out / "lib").glob("_C*.so"))
    if rc or not found:
        tail = (out / "build.log").read_text()[-3000:]
        raise RuntimeError(f"EcoRec's build failed (rc {rc}), {out}/build.log ends:\n{tail}")
    return found[0], {**info, "cached": False, "build_s": time.monotonic() - t}


def load_ecorec(eco: Path, so: Path):
    """EcoRec's ``TTEmbeddingBag``: its ``tt_emb.py`` over the built ``_C`` (as ``ecorec._C``)."""
    import torch  # noqa: F401  (the extension links against the libraries torch loads)

    for package in ("ecorec", "ecorec.tt_emb"):  # the checkout's packages, by path (no sys.path edit)
        folder = eco.resolve().joinpath(*package.split("."))
        spec = importlib.util.spec_from_loader(package, None, is_package=True)
        spec.submodule_search_locations = [str(folder)]  # its __init__ (if any) is not run
        sys.modules[package] = importlib.util.module_from_spec(spec)
    spec = importlib.util.spec_from_file_location("ecorec._C", so)
    sys.modules["ecorec._C"] = mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return importlib.import_module("ecorec.tt_emb.tt_emb").TTEmbeddingBag


class TorchBackend:
    """EcoRec on the GPU: one ``TTEmbeddingBag`` per table, a loop over the features (``device``
    cpu: the glue alone, with a stand-in class; wall times, no memory, no trace)."""

    name = IMPL
    description = "EcoRec's TTEmbeddingBag (SC24_ADE ecorec/tt_emb), one per table, in a Python loop"

    def __init__(self, torch, bag_cls, device=None):
        self.torch, self.cls = torch, bag_cls
        self.dev = torch.device(device or f"cuda:{torch.cuda.current_device()}")
        self.cuda = self.dev.type == "cuda"
        self.method = "cuda_events" if self.cuda else "perf_counter"
        self.device = f"gpu:{torch.cuda.get_device_name(self.dev)}" if self.cuda else "cpu:torch"
        self.tables = self.features = self.target = None

    def _sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()

    def prepare(self, w) -> dict:
        t, dev = self.torch, self.dev
        self.release()
        self.w, self.tables = w, []
        for spec, cores in zip(w.specs, our_cores(w.specs)):
            emb = self.cls(**ecorec_args(spec), learning_rate=0.0, device=dev)
            with t.no_grad():
                for p, c in zip(emb.tt_cores, cores):
                    p.copy_(t.from_numpy(c.reshape(p.shape)))
            self.tables.append(emb)
        ids = t.from_numpy(w.ids).to(dev).long()
        offsets = t.from_numpy(w.offsets.astype(np.int64)).to(dev)
        b, bounds = w.batch, w.feature_bounds
        self.features = [
            (tab, ids[bounds[f] : bounds[f + 1]], offsets[f * b : (f + 1) * b + 1] - bounds[f])
            for f, tab in enumerate(w.feature_table)
        ]
        dim = sum(w.specs[tab].embedding_dim for tab in w.feature_table)
        self.target = t.randn(b, dim, generator=t.Generator(device=dev).manual_seed(2), device=dev)
        self._sync()
        inputs = ids.nbytes + offsets.nbytes + self.target.nbytes + sum(o.nbytes for _, _, o in self.features)
        params = sum(p.nbytes for emb in self.tables for p in emb.tt_cores)
        empty = sum(1 for _, i, _ in self.features if i.numel() == 0)
        return {"param_bytes": params, "input_bytes": inputs, "empty_features": empty}

    def forward(self):
        outs = []
        for tab, ids, offs in self.features:
            emb = self.tables[tab]
            if ids.numel() == 0:  # EcoRec divides by the number of unique ids
                outs.append(self.torch.zeros(offs.numel() - 1, emb.embedding_dim, device=self.dev))
            else:
                outs.append(emb(ids, offs))
        return self.torch.cat(outs, dim=1)

    def fwd(self):
        with self.torch.no_grad():
            return self.forward()

    def fwd_bwd(self):
        out = self.forward()
        self.torch.autograd.backward(out, out.detach() - self.target)
        return out

    def elapsed_ms(self, fn) -> float:
        if not self.cuda:
            return wall_ms(fn)
        start, end = self.torch.cuda.Event(enable_timing=True), self.torch.cuda.Event(enable_timing=True)
        start.record()
        r = fn()
        end.record()
        end.synchronize()
        del r
        return start.elapsed_time(end)

    def memory_begin(self) -> int | None:
        if self.cuda:
            self._sync()
            self.torch.cuda.reset_peak_memory_stats(self.dev)
            return self.torch.cuda.memory_allocated(self.dev)

    def memory_end(self) -> int | None:
        if self.cuda:
            self._sync()
            return self.torch.cuda.max_memory_allocated(self.dev)

    def profile(self, fn, iters: int) -> dict:
        """Busy time per call: the union of the GPU intervals of a torch.profiler trace."""
        from torch.autograd import DeviceType
        from torch.profiler import ProfilerActivity, profile

        if not self.cuda:
            return None
        self._sync()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(iters):
                r = fn()
                del r
            self._sync()
        spans, names = [], {}
        for e in prof.profiler.kineto_results.events():
            if e.device_type() != DeviceType.CUDA:
                continue
            if hasattr(e, "start_ns"):
                s, d = e.start_ns(), e.duration_ns()
            else:  # older torch: microseconds
                s, d = e.start_us() * 1000, e.duration_us() * 1000
            spans.append((s, s + d))
            names[e.name()[:90]] = names.get(e.name()[:90], 0) + d
        return {**busy(spans, iters), "kernels_ms": top_names(names, iters)}

    def _subset(self, f: int, bags: int):
        """The first ``bags`` bags of feature ``f``: (table, ids, offsets, host ids, host lengths)."""
        tab, ids, offs = self.features[f]
        sub_offs = offs[: min(self.w.batch, bags) + 1].contiguous()
        sub_ids = ids[: int(sub_offs[-1])].contiguous()
        return tab, sub_ids, sub_offs, sub_ids.cpu().numpy(), np.diff(sub_offs.cpu().numpy())

    def _host_cores(self, emb, tab: int) -> list[np.ndarray]:
        return [
            p.detach().cpu().numpy().copy().reshape(s)
            for p, s in zip(emb.tt_cores, self.w.specs[tab].core_shapes)
        ]

    def check(self, bags: int) -> dict:
        """EcoRec vs the NumPy reference: bags of the first 3 features, one table's gradient."""
        t, specs = self.torch, self.w.specs
        out = {"bags": bags, "features": min(3, len(self.features)), "fwd_max_abs_err": 0.0}
        out["fwd_max_abs_ref"] = 0.0
        for f in range(out["features"]):
            tab, ids, offs, h_ids, lengths = self._subset(f, bags)
            if h_ids.size:
                with t.no_grad():
                    got = self.tables[tab](ids, offs).cpu().numpy()
                ref = np_bag(self._host_cores(self.tables[tab], tab), specs[tab].row_shape, h_ids, lengths)
                out["fwd_max_abs_err"] = max(out["fwd_max_abs_err"], float(np.abs(got - ref).max()))
                out["fwd_max_abs_ref"] = max(out["fwd_max_abs_ref"], float(np.abs(ref).max()))
        ok = out["fwd_max_abs_err"] <= 1e-3 * out["fwd_max_abs_ref"]
        # The gradient: EcoRec's backward is an SGD step; with lr 1 on a copy, grad = before - after.
        tab, ids, offs, h_ids, lengths = self._subset(0, bags)
        if h_ids.size:
            emb = self.cls(**ecorec_args(specs[tab]), learning_rate=1.0, device=self.dev)
            with t.no_grad():
                for p, q in zip(emb.tt_cores, self.tables[tab].tt_cores):
                    p.copy_(q)
            before = self._host_cores(emb, tab)
            y = emb(ids, offs)
            cot = t.randn(y.shape, generator=t.Generator(device=self.dev).manual_seed(3), device=self.dev)
            y.backward(cot)
            self._sync()
            got = [b.astype(np.float64) - a for b, a in zip(before, self._host_cores(emb, tab))]
            ref = np_bag_grads(before, specs[tab].row_shape, h_ids, lengths, cot.cpu().numpy())
            out["grad_max_abs_err"] = max(float(np.abs(g - r).max()) for g, r in zip(got, ref))
            out["grad_max_abs_ref"] = max(float(np.abs(r).max()) for r in ref)
            ok = ok and out["grad_max_abs_err"] <= 1e-3 * out["grad_max_abs_ref"]
        return {**out, "ok": bool(ok)}

    def release(self) -> None:
        self.tables = self.features = self.target = None
        if self.cuda:
            self._sync()
            self.torch.cuda.empty_cache()


def busy(spans: list[tuple[int, int]], iters: int) -> dict:
    """Per call: the union of the intervals (ns) and their first-to-last span, in ms."""
    total, end = 0, None
    for s, e in sorted(spans):
        if end is None or s > end:
            total, end = total + (e - s), e
        elif e > end:
            total, end = total + (e - end), e
    span = (max(e for _, e in spans) - min(s for s, _ in spans)) if spans else 0
    out = {"busy_ms": total / iters / 1e6, "span_ms": span / iters / 1e6}
    return {**out, "events_per_call": len(spans) / iters}


def top_names(names: dict, iters: int, top: int = 12) -> dict:
    return {k: v / iters / 1e6 for k, v in sorted(names.items(), key=lambda kv: -kv[1])[:top]}


def measure(backend, mode: str, run: records.Run, nnz: int, param_bytes: int) -> dict:
    """One mode: memory peak over the calls, first call, warm-up, the median of the repeats."""
    a = run.a
    fn = backend.fwd if mode == "fwd" else backend.fwd_bwd
    before = backend.memory_begin()
    first = backend.elapsed_ms(fn)
    for _ in range(a.warmup - 1):
        backend.elapsed_ms(fn)
    # Repeats within half the time left (at least 2).
    fits = int(0.5 * run.remaining() * 1e3 / max(first, 1e-3)) if a.time_budget else a.repeats
    reps = max(2, min(a.repeats, fits))
    times = [backend.elapsed_ms(fn) for _ in range(reps)]
    res: dict[str, Any] = {"ms": statistics.median(times), "method": backend.method, "times_ms": times}
    res.update(first_call_ms=first, warmup=a.warmup, repeats=reps)
    peak = backend.memory_end()
    if peak is not None:
        res["device_memory"] = {"allocated_before": before, "max_allocated": peak}
        res["peak_bytes"] = peak
        res["peak_bytes_above_params"] = peak - param_bytes
        res["bytes_per_id"] = (peak - param_bytes) / max(nnz, 1)
    if a.profile and run.remaining() > 3 * statistics.median(times) / 1e3 + 5:
        try:
            prof = backend.profile(fn, 3)
        except Exception as e:  # noqa: BLE001  (the timing is still worth having)
            prof = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        if prof is not None:
            res["profile"] = prof
    return res


def case_list(a: argparse.Namespace, sizes: dict) -> list[tuple[int, int]]:
    if a.cases:
        return list(a.cases)
    return [(t, b) for b in a.batches or sizes["batches"] for t in a.tables or sizes["tables"]]


def _csv(kind):
    return lambda s: tuple(kind(x) for x in s.split(",") if x)


def _case(s: str) -> tuple[int, int]:
    tables, batch = s.split("x")
    return int(tables), int(batch)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python3 -m benchmarks.ecorec_peer", description="EcoRec as a peer")
    ap.add_argument("--ecorec-path", type=Path, default=ROOT / "third_party" / "SC24_ADE")
    ap.add_argument("--out-dir", type=Path, default=Path(tempfile.gettempdir()) / "flowtt_jax_bench")
    ap.add_argument("--build-dir", type=Path, default=Path.home() / ".cache" / "flowtt_jax" / "ecorec")
    ap.add_argument("--arch", default=os.environ.get("TORCH_CUDA_ARCH_LIST", "9.0"))
    ap.add_argument("--build-only", action="store_true", help="build (or find) the extension and stop")
    ap.add_argument("--backend", choices=("torch", "numpy"), default="torch")
    ap.add_argument("--quick", action="store_true", help="the suite's QUICK collection sizes")
    ap.add_argument("--tables", type=_csv(int), help="collection sizes, e.g. 240,480,788")
    ap.add_argument("--batches", type=_csv(int), help="bags per feature, e.g. 4096,32768")
    ap.add_argument("--cases", type=_csv(_case), help="TABLESxBATCH list (instead of the product)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--time-budget", type=float, help="seconds; later measurements are skipped")
    ap.add_argument("--no-profile", dest="profile", action="store_false", help="no torch.profiler pass")
    ap.add_argument("--no-check", dest="check", action="store_false", help="no check vs NumPy")
    ap.add_argument("--check-bags", type=int, default=64)
    ap.add_argument("--workers", type=int, default=min(16, os.cpu_count() or 1), help="draw processes")
    return ap.parse_args(argv)


def header(a: argparse.Namespace, backend, argv, extra: dict) -> tuple[Path, dict]:
    now = datetime.datetime.now(datetime.timezone.utc)
    name = backend.device.split(":", 1)[1]
    short = next((t for t in name.split() if re.match(r"^[A-Za-z]+\d+", t)), name.split()[-1]).lower()
    path = a.out_dir / f"bench_{'quick_' if a.quick else ''}ecorec_{short}_{now:%Y-%m-%dT%H%M%S}.json"
    doc = {"schema": records.SCHEMA, "suite": "collection", "stage": "ecorec", "quick": a.quick}
    doc.update(device=backend.device, device_count=1, date=now.isoformat(timespec="seconds"))
    doc.update(commit=records.commit(), **extra, argv=argv, time_budget_s=a.time_budget)
    doc["timing_method"] = backend.method
    doc["timing"] = (
        "ms: median over repeats of one call's time (on the GPU CUDA events around the call, host gaps "
        "included); profile.busy_ms: the union of a torch.profiler trace's GPU intervals per call"
    )
    doc["cases"] = []
    return path, doc


def run_case(run: records.Run, backend, coll, batch: int, map_fn) -> None:
    a, t0 = run.a, time.monotonic()
    w, stats = draw_case(coll, batch, map_fn)
    entry = {"suite": "collection", "case": w.name, "alias": None, "workload": w.params}
    entry["stats"] = {**stats, "draw_s": time.monotonic() - t0}
    rec: dict[str, Any] = {"description": backend.description}
    rec.update(mapping=mapping_summary(w.specs), differences=DIFFERENCES)
    entry["impls"] = {backend.name: rec}
    run.doc["cases"].append(entry)
    pct, draw_s = 100 * stats["unique_fraction"], entry["stats"]["draw_s"]
    run.log(f"{w.name}: {w.nnz} ids, {pct:.1f}% unique, drawn in {draw_s:.1f} s")
    try:
        rec.update(backend.prepare(w))
        rec["compression_ratio"] = stats["dense_param_bytes"] / rec["param_bytes"]
        if a.check:
            rec["check"] = backend.check(a.check_bags)
            run.log(f"  check: {rec['check']}")
    except Exception as e:  # noqa: BLE001  (recorded, the run goes on)
        rec["error"] = f"{type(e).__name__}: {str(e)[:400]}"
        run.log(f"  error: {rec['error']}")
        backend.release()
        return
    for mode in MODES:
        if run.remaining() < 10:
            rec[mode] = {"skipped": "time budget"}
            continue
        try:
            rec[mode] = measure(backend, mode, run, w.nnz, rec["param_bytes"])
            r = rec[mode]
            busy_ms = r.get("profile", {}).get("busy_ms")
            run.log(f"  {mode}: {r['ms']:.3f} ms (busy {busy_ms}), peak {r.get('peak_bytes')}")
        except Exception as e:  # noqa: BLE001
            rec[mode] = {"error": f"{type(e).__name__}: {str(e)[:400]}"}
            run.log(f"  {mode}: {rec[mode]['error']}")
        run.write()
    backend.release()


def _on_sigterm(signum, frame) -> None:
    raise Interrupted("SIGTERM")


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    argv = sys.argv[1:] if argv is None else argv
    sizes = QUICK if a.quick else FULL
    wl = workloads_module()
    # The draw's processes start before torch (and CUDA) exist in this process.
    pool = multiprocessing.get_context("fork").Pool(a.workers) if a.workers > 1 and not a.build_only else None
    try:
        extra: dict[str, Any] = {"sizes": {k: sizes[k] for k in ("rows_range", "collection_rank")}}
        if a.backend == "torch":
            import torch

            so, build = build_extension(a.ecorec_path, a.build_dir, a.arch, log=print)
            print(f"EcoRec extension: {so} ({'cached' if build['cached'] else 'built'})", flush=True)
            if a.build_only:
                return 0
            backend = TorchBackend(torch, load_ecorec(a.ecorec_path, so))
            extra.update(torch=torch.__version__, cuda=torch.version.cuda)
            src = a.ecorec_path / "FLOWTT_SOURCE"  # written with the checkout's copy (no .git travels)
            source = src.read_text().strip() if src.is_file() else "unknown"
            extra["ecorec"] = {"path": str(a.ecorec_path), "source": source, "build": build}
        else:
            backend = NumpyBackend()
        path, doc = header(a, backend, argv, extra)
        a.out_dir.mkdir(parents=True, exist_ok=True)
        run = records.Run(a, path, doc)
        signal.signal(signal.SIGTERM, _on_sigterm)
        doc["status"] = "running"
        try:
            for tables, batch in case_list(a, sizes):
                if run.remaining() < 30:
                    doc["cases"].append({"case": f"meta{tables}_B{batch}", "skipped": "time budget"})
                    continue
                coll = wl.MetaLikeCollection.create(
                    tables, a.seed, rows_range=sizes["rows_range"], rank=sizes["collection_rank"]
                )
                run_case(run, backend, coll, batch, pool.imap if pool else map)
                run.write()
            doc["status"] = "complete"
        except Interrupted as e:
            doc["status"] = f"interrupted: {e}"
        finally:
            run.write()
            print(f"wrote {path}", flush=True)
        return 0
    finally:
        if pool is not None:
            pool.terminate()


if __name__ == "__main__":
    sys.exit(main())
