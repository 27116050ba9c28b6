"""Compare the compiled code of every CUDA kernel between two versions of the sources.

Proves that a refactor of the CUDA sources only moved code: every `.cu` file with a
`__global__` function is compiled on each side (`nvcc -arch=sm_90 -O3 -std=c++17`,
each to a cubin, or to PTX), and each kernel's SASS (or PTX) is compared after
normalising what a move may change: namespaces and mangling (kernels are keyed by
their demangled name with the namespaces removed), instruction addresses and
encodings, branch labels, parameter and symbol names.

Usage (from the repository root):
    python scripts/compare_kernel_code.py BASE [NEW] [--mode sass|ptx] [-D NAME=VALUE ...]
        [--exclude GLOB ...] [--diff N]
BASE and NEW are git revisions; NEW defaults to the working tree. Prints one line per
kernel (identical / DIFFERS / ONLY IN BASE / new) with its registers, stack and shared
memory, and a unified diff of the first differing kernels with --diff. Exits 1 when a
kernel of BASE differs or is missing in NEW (kernels only in NEW are listed as new).
--exclude skips source files whose name matches (e.g. another op family's work in
progress). SASS needs cuobjdump (on PATH, in $CUDA_HOME/bin, or $CUOBJDUMP); PTX
needs only nvcc.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import difflib
import fnmatch
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

NVCC_FLAGS = ["-arch=sm_90", "-O3", "-std=c++17"]
# Where CUDA sources and the headers they include live (old and new layouts); each is also an
# include root (tests/native: the test helpers the table-batched harness includes).
SOURCE_DIRS = ("csrc", "cuda", "ffi", "tests/native")


def tool(name: str, env_var: str) -> str | None:
    """Path of a CUDA tool: $ENV_VAR, then PATH, then $CUDA_HOME/bin, /usr/local/cuda/bin."""
    if os.environ.get(env_var):
        return os.environ[env_var]
    found = shutil.which(name)
    if found:
        return found
    for home in (os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if home and (Path(home) / "bin" / name).exists():
            return str(Path(home) / "bin" / name)
    return None


def checkout(rev: str | None, dest: Path) -> Path:
    """The source tree of `rev` (git archive into dest), or the working tree for None."""
    top = Path(subprocess.check_output(["git", "rev-parse", "--show-toplevel"], text=True).strip())
    if rev is None:
        return top
    dest.mkdir(parents=True)
    dirs = [
        d
        for d in SOURCE_DIRS
        if subprocess.run(["git", "cat-file", "-e", f"{rev}:{d}"], cwd=top, capture_output=True).returncode
        == 0
    ]
    archive = subprocess.run(["git", "archive", rev, *dirs], cwd=top, check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    return dest


def kernel_sources(root: Path, exclude: list[str]) -> tuple[list[Path], list[Path]]:
    """(.cu files that define a __global__ function or include a header that does, include
    dirs: the source roots and every directory holding a header)."""
    files, include_dirs = [], {root / d for d in SOURCE_DIRS if (root / d).is_dir()}
    paths = [p for d in SOURCE_DIRS for p in sorted((root / d).rglob("*"))]
    kernel_headers = {p.name for p in paths if p.suffix == ".cuh" and "__global__" in p.read_text()}
    for p in paths:
        if p.suffix in (".h", ".cuh"):
            include_dirs.add(p.parent)
        if p.suffix != ".cu" or any(fnmatch.fnmatch(p.name, g) for g in exclude):
            continue
        text = p.read_text()
        included = {Path(m).name for m in re.findall(r'#include\s+"([^"]+)"', text)}
        if "__global__" in text or included & kernel_headers:
            files.append(p)
    return files, sorted(include_dirs)


def compile_all(
    root: Path, out_dir: Path, mode: str, defines: list[str], exclude: list[str], jobs: int
) -> list[Path]:
    files, include_dirs = kernel_sources(root, exclude)
    if not files:
        sys.exit(f"no .cu file with a __global__ function under {root}")
    nvcc = tool("nvcc", "NVCC") or sys.exit("nvcc not found")
    out_dir.mkdir(parents=True, exist_ok=True)

    def one(src: Path) -> Path:
        out = out_dir / (
            src.relative_to(root).as_posix().replace("/", "__") + (".cubin" if mode == "sass" else ".ptx")
        )
        cmd = [nvcc, *NVCC_FLAGS, "-cubin" if mode == "sass" else "-ptx", "-o", str(out), str(src)]
        cmd += [f"-I{d}" for d in include_dirs] + [f"-D{d}" for d in defines]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            sys.exit(f"compile failed: {' '.join(cmd)}\n{r.stderr}")
        return out

    with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
        return list(pool.map(one, files))


def demangle(names: list[str]) -> dict[str, str]:
    """mangled -> demangled name with namespaces (and the return type) removed."""
    names = sorted(set(names))
    out = subprocess.run(
        ["c++filt"], input="\n".join(names), capture_output=True, text=True, check=True
    ).stdout.splitlines()
    result = {}
    for mangled, plain in zip(names, out):
        plain = plain.replace("(anonymous namespace)::", "")
        plain = re.sub(r"\b[A-Za-z_]\w*::", "", plain)  # every namespace / class qualifier
        result[mangled] = re.sub(r"^void ", "", plain)
    return result


def split_sass(text: str) -> dict[str, list[str]]:
    funcs: dict[str, list[str]] = {}
    cur = None
    for line in text.splitlines():
        m = re.match(r"\s*Function : (\S+)", line)
        if m:
            cur = m.group(1)
            funcs[cur] = []
        elif cur is not None and line.strip():
            funcs[cur].append(line)
    return funcs


def normalise_sass(lines: list[str]) -> list[str]:
    out = []
    for line in lines:
        line = re.sub(r"/\*[0-9a-fx]+\*/", "", line)  # addresses and encodings
        line = re.sub(r"\s+", " ", line).strip()
        if line:
            out.append(line)
    return out


def split_ptx(text: str) -> dict[str, list[str]]:
    funcs: dict[str, list[str]] = {}
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        m = re.match(r"(?:\.(?:visible|weak)\s+)?\.entry\s+(\S+)\(", lines[i].strip())
        if m:
            body = [lines[i]]
            i += 1
            while i < len(lines) and lines[i] != "}":
                body.append(lines[i])
                i += 1
            funcs[m.group(1)] = body
        i += 1
    return funcs


def normalise_ptx(lines: list[str], names: dict[str, str]) -> list[str]:
    out = []
    for line in lines:
        line = re.sub(r"\$L__BB\d+_", "$L__BB_", line)  # labels are numbered per module
        line = re.sub(r"(_Z\w+?)_param_(\d+)", r"param_\2", line)
        line = re.sub(r"_Z\w+", lambda m: names.get(m.group(0), m.group(0)).replace(" ", ""), line)
        line = re.sub(r"\s+", " ", line).strip()
        if line and not line.startswith("//"):
            out.append(line)
    return out


def kernels(paths: list[Path], mode: str) -> tuple[dict[str, list[str]], dict[str, str]]:
    """{kernel key: normalised code}, {kernel key: resource usage} of compiled files."""
    raw: dict[str, list[str]] = {}
    usage: dict[str, str] = {}
    cuobjdump = tool("cuobjdump", "CUOBJDUMP") if mode == "sass" else None
    for p in paths:
        if mode == "sass":
            raw.update(split_sass(subprocess.check_output([cuobjdump, "-sass", str(p)], text=True)))
            res = subprocess.check_output([cuobjdump, "-res-usage", str(p)], text=True)
            for name, info in re.findall(r"Function (\S+):\n\s*(.*)", res):
                usage[name] = " ".join(
                    f for f in info.split() if f.split(":")[0] in ("REG", "STACK", "SHARED", "LOCAL")
                )
        else:
            raw.update(split_ptx(p.read_text()))
    names = demangle(
        list(raw) + re.findall(r"_Z\w+", "\n".join(ln for b in raw.values() for ln in b))
        if mode == "ptx"
        else list(raw)
    )
    code, res = {}, {}
    for mangled, body in raw.items():
        key = names[mangled]
        norm = normalise_sass(body) if mode == "sass" else normalise_ptx(body, names)
        if key in code and code[key] != norm:
            key += f" [{mangled}]"  # same name, different code (two files): keep both
        code[key] = norm
        res[key] = usage.get(mangled, "")
    return code, res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("base", help="git revision of the old sources")
    ap.add_argument("new", nargs="?", help="git revision of the new sources (default: working tree)")
    ap.add_argument(
        "--mode",
        choices=("sass", "ptx"),
        default=None,
        help="compare SASS (default when cuobjdump is found) or PTX",
    )
    ap.add_argument(
        "-D",
        dest="defines",
        action="append",
        default=[],
        help="NAME=VALUE compile definition for both sides (a tuning variant)",
    )
    ap.add_argument(
        "--exclude",
        action="append",
        default=[],
        metavar="GLOB",
        help="skip .cu files whose name matches GLOB (both sides)",
    )
    ap.add_argument(
        "--diff",
        type=int,
        default=0,
        metavar="N",
        help="print a unified diff of the first N differing kernels",
    )
    ap.add_argument("-j", "--jobs", type=int, default=os.cpu_count() or 2)
    args = ap.parse_args()
    mode = args.mode or ("sass" if tool("cuobjdump", "CUOBJDUMP") else "ptx")
    if mode == "sass" and not tool("cuobjdump", "CUOBJDUMP"):
        sys.exit("cuobjdump not found (set CUOBJDUMP, or use --mode ptx)")
    print(
        f"mode {mode}, nvcc {' '.join(NVCC_FLAGS)}"
        + (f" {' '.join('-D' + d for d in args.defines)}" if args.defines else "")
    )

    with tempfile.TemporaryDirectory(prefix="kernel_code_") as tmp:
        sides = {}
        for label, rev in (("base", args.base), ("new", args.new)):
            root = checkout(rev, Path(tmp) / f"{label}_src")
            sides[label] = kernels(
                compile_all(root, Path(tmp) / f"{label}_out", mode, args.defines, args.exclude, args.jobs),
                mode,
            )
    (base, base_res), (new, new_res) = sides["base"], sides["new"]

    bad = 0
    diffs_shown = 0
    for key in sorted(set(base) | set(new)):
        if key not in new:
            status = "ONLY IN BASE"
        elif key not in base:
            status = "new"
        elif base[key] == new[key]:
            status = "identical"
        else:
            n_diff = sum(
                1
                for ln in difflib.unified_diff(base[key], new[key], n=0)
                if ln[:1] in "+-" and ln[:3] not in ("+++", "---")
            )
            status = f"DIFFERS ({n_diff} lines)"
        res = new_res.get(key) or base_res.get(key, "")
        if base_res.get(key) and new_res.get(key) and base_res[key] != new_res[key]:
            res = f"{base_res[key]} -> {new_res[key]}"
        print(f"{status:22} {key[:110]}  {res}")
        if status not in ("identical", "new"):
            bad += 1
            if status.startswith("DIFFERS") and diffs_shown < args.diff:
                diffs_shown += 1
                sys.stdout.writelines(
                    ln + "\n" for ln in difflib.unified_diff(base[key], new[key], "base", "new", n=2)
                )
    added = len(set(new) - set(base))
    print(
        f"{len(base) - bad} of {len(base)} kernels of the base identical"
        + (f", {bad} not" if bad else "")
        + (f"; {added} new" if added else "")
    )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
