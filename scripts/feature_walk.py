"""Follow ``features`` from ``CollectionLayout.apply`` through the code (issue 51): a static
walk of the calls that pass the ids on, from the user's call to the op, and its module hops.

    python -m scripts.feature_walk [--json PATH] [--end ENTRY ...] [--planning ENTRY ...]

The package is parsed with ``ast`` (nothing imported or run). From ``START`` with ``features``
*tracked*, a name is tracked in a function walked when it is a parameter given a tracked value
(in a nested function, also a tracked name of the enclosing one); when an assignment's value
uses a tracked name (``x = f(tracked)``; ``out[k] = tracked`` tracks ``out``); when it is the
target of a ``for``, comprehension or ``with ... as`` over a tracked expression; when a method
is called on it with a tracked argument (``out.append(tracked)``): a fixed point over the body,
flow- and path-insensitive. Each call whose arguments or receiver use a tracked name is taken
in evaluation order; one resolving to a package function (through imports, re-exports, nested
functions, ``self.method`` in MRO order, ``Class.method``, a class's ``__init__``) is entered
once and followed depth-first (walked again when a later call tracks other parameters).

``END`` and ``PLANNING`` hold functions ``path:qualname``, modules ``path`` or folders ``path/``:

- ``END``, the op's entry: ``collection/pool.py:pool_packed`` (the batch is handed to the op
  there), ``ops/``, ``kernels/``, ``tt/``: entered (a stop), not followed;
- ``PLANNING``, calls that read only static sizes and dtypes of ``features`` for the memory
  plan (``CollectionLayout._form_sizes``, ``_call_packs``, ``_kernels``, ``_cast_to_batch``,
  ``memory.py``, ``budget.py``, ``collection/xla_fit.py``): not the data path, not entered,
  listed as *planning calls, not followed*; what they return is a static plan (the packs,
  the parameters in the batch's dtype), not the features: an assignment from one does not
  track its target.

The functions entered, in order, give a module sequence; a run of one module in it is one
*visit* (issue 51's stop). *Stops* = visits, *modules* = distinct modules, *returns* = stops -
modules, the visits to a module left before (``AABACB``: ``ABACB``, 5 stops, 3 modules, 2
returns). Printed: the functions as a call tree (detail), the visits, the figures.

Listed, not followed: methods of a value (the receiver's type is not inferred; the package's
methods of that name as candidates), calls of local or module-level values, subclass overrides
of a ``self.method``, package functions handed to outside calls (*callbacks*), package classes
without an ``__init__`` (*constructors*), outside calls (counted). Not seen: properties,
operators and other implicit calls, values passed other than as arguments and call results.
"""

from __future__ import annotations

import argparse
import ast
import collections
import dataclasses
import functools
import json
from pathlib import Path
from typing import Any

from scripts.package_ast import Package, dotted, is_property

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "flowtt_jax"
START = ("flowtt_jax/collection/layout.py", "CollectionLayout.apply")
PARAM = "features"
END = (  # entered (a stop), not followed: the op's entry
    "flowtt_jax/collection/pool.py:pool_packed",
    "flowtt_jax/ops/",
    "flowtt_jax/kernels/",
    "flowtt_jax/tt/",
)
PLANNING = (  # the memory planner: neither entered nor followed, listed
    "flowtt_jax/collection/layout.py:CollectionLayout._form_sizes",
    "flowtt_jax/collection/layout.py:CollectionLayout._call_packs",
    "flowtt_jax/collection/layout.py:CollectionLayout._kernels",
    "flowtt_jax/collection/layout.py:_cast_to_batch",
    "flowtt_jax/memory.py",
    "flowtt_jax/budget.py",
    "flowtt_jax/collection/xla_fit.py",
)


def _root_name(node: ast.AST) -> str | None:
    while isinstance(node, (ast.Attribute, ast.Subscript, ast.Starred)):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


@dataclasses.dataclass
class Frame:
    """A function as the walk sees it: where it is, its enclosing function and class."""

    module: str
    qualname: str
    node: ast.FunctionDef | ast.AsyncFunctionDef
    cls: tuple[str, str] | None  # (module, class) of a method or a function nested in one
    parent: Frame | None
    tracked: set[str] = dataclasses.field(default_factory=set)


def _params(node: ast.FunctionDef) -> list[str]:
    a = node.args
    return [p.arg for p in (*a.posonlyargs, *a.args, *a.kwonlyargs)] + [
        p.arg for p in (a.vararg, a.kwarg) if p is not None
    ]


def _body_nodes(node: ast.AST):
    """The nodes of a function's body, not entering nested functions or classes (lambdas and
    comprehensions are entered)."""
    stack = list(reversed(node.body)) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else [node]
    while stack:
        n = stack.pop()
        yield n
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        stack.extend(reversed(list(ast.iter_child_nodes(n))))


@functools.cache
def _body(node: ast.FunctionDef) -> tuple[ast.AST, ...]:
    return tuple(n for n in _body_nodes(node) if n is not node)


@functools.cache
def _nested_defs(node: ast.FunctionDef) -> dict[str, ast.FunctionDef]:
    return {n.name: n for n in _body(node) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}


@functools.cache
def _local_names(node: ast.FunctionDef) -> frozenset[str]:
    """Names a function binds itself (parameters, assignments, loop targets, imports, defs)."""
    names = set(_params(node))
    for n in _body(node):
        if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
            names.add(n.id)
        elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(n.name)
        elif isinstance(n, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in n.names}
        elif isinstance(n, ast.arg):  # lambda parameters
            names.add(n.arg)
    return frozenset(names)


def _uses(expr: ast.AST | None, tracked: set[str], skip=None) -> bool:
    """Whether ``expr`` reads a tracked name; ``skip(call)``: a call whose whole subtree is
    left out (a planning call: its result is a static plan, not the features)."""
    if expr is None or (skip is not None and isinstance(expr, ast.Call) and skip(expr)):
        return False
    if isinstance(expr, ast.Name):
        return expr.id in tracked
    return any(_uses(c, tracked, skip) for c in ast.iter_child_nodes(expr))


def _store_names(target: ast.AST) -> set[str]:
    """The names an assignment target binds or mutates (``a``, ``a, *b``, ``a[k]``, ``a.x``)."""
    if isinstance(target, (ast.Tuple, ast.List)):
        return set().union(*(_store_names(t) for t in target.elts)) if target.elts else set()
    if isinstance(target, ast.Starred):
        return _store_names(target.value)
    root = _root_name(target)
    return {root} - {"self", "cls"} if root else set()


def _track(frame: Frame, imported: set[str], planning=None) -> None:
    """Grows ``frame.tracked`` to its fixed point over the function's body; ``planning(call)``:
    a planning call, whose result is not tracked."""
    tracked = frame.tracked
    nodes = _body(frame.node)

    def uses(expr: ast.AST | None) -> bool:
        return _uses(expr, tracked, planning)

    while True:
        before = len(tracked)
        for n in nodes:
            if isinstance(n, ast.Assign) and uses(n.value):
                for t in n.targets:
                    tracked |= _store_names(t)
            elif isinstance(n, (ast.AnnAssign, ast.AugAssign, ast.NamedExpr)) and uses(n.value):
                tracked |= _store_names(n.target)
            elif isinstance(n, (ast.For, ast.AsyncFor, ast.comprehension)) and uses(n.iter):
                tracked |= _store_names(n.target)
            elif isinstance(n, ast.withitem) and n.optional_vars is not None and uses(n.context_expr):
                tracked |= _store_names(n.optional_vars)
            elif isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute):
                root = _root_name(n.func.value)
                args = [*n.args, *(k.value for k in n.keywords)]
                if root and root not in imported and root not in ("self", "cls"):
                    if any(uses(a) for a in args):
                        tracked.add(root)  # a method given a tracked value: its receiver holds it
        if len(tracked) == before:
            return


@functools.cache
def _calls_in_order(node: ast.FunctionDef) -> list[ast.Call]:
    """The body's calls in evaluation order: by where each call ends (a call's arguments end
    before it), statements in source order."""
    calls = [n for n in _body(node) if isinstance(n, ast.Call)]
    return sorted(calls, key=lambda c: (c.end_lineno, c.end_col_offset, -c.lineno, -c.col_offset))


@dataclasses.dataclass
class Entered:  # a function the walk entered
    index: int
    module: str  # repository-relative path
    qualname: str
    depth: int
    params: list[str]  # the tracked parameters it was first entered with
    called_from: str | None  # path:line of the call
    followed: bool = True  # False: an END (the op's entry)

    @property
    def label(self) -> str:
        return f"{self.module}:{self.qualname}"


def module_visits(sequence: list[str]) -> list[str]:
    """The sequence with each run of one module merged into one visit (``AABACB``: ``ABACB``)."""
    return [m for i, m in enumerate(sequence) if i == 0 or m != sequence[i - 1]]


def figures(sequence: list[str]) -> dict[str, int]:
    """Issue 51's figures of a module sequence: stops (visits), modules, returns."""
    stops, modules = len(module_visits(sequence)), len(set(sequence))
    return {"stops": stops, "modules": modules, "returns": stops - modules}


@dataclasses.dataclass
class WalkResult:
    start: str  # path:qualname
    param: str
    functions: list[Entered] = dataclasses.field(default_factory=list)
    planning: list[dict] = dataclasses.field(default_factory=list)
    unresolved: list[dict] = dataclasses.field(default_factory=list)
    callbacks: list[dict] = dataclasses.field(default_factory=list)
    constructors: list[dict] = dataclasses.field(default_factory=list)
    external: dict[str, int] = dataclasses.field(default_factory=dict)  # name -> call sites
    rewalks: list[dict] = dataclasses.field(default_factory=list)
    overrides: list[dict] = dataclasses.field(default_factory=list)

    @property
    def visits(self) -> list[str]:
        return module_visits([f.module for f in self.functions])

    @property
    def figures(self) -> dict[str, int]:
        return figures([f.module for f in self.functions])

    @property
    def per_module(self) -> dict[str, int]:  # visits per module
        return dict(collections.Counter(self.visits).most_common())

    def as_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["functions"] = [d | {"label": f.label} for d, f in zip(out["functions"], self.functions)]
        return self.figures | {"visits": self.visits, "per_module": self.per_module} | out


class Walker:
    def __init__(self, pkg: Package, result: WalkResult, end=END, planning=PLANNING) -> None:
        self.pkg = pkg
        self.out = result
        self.end, self.planning = tuple(end), tuple(planning)
        self.walked: dict[tuple[str, str], set[str]] = {}  # key -> tracked parameters walked with
        self._seen_sites: set[tuple] = set()

    # -- entering a function

    def enter(self, frame: Frame, params: set[str], depth: int, site: str | None) -> None:
        key = (frame.module, frame.qualname)
        path = self.pkg.module(frame.module).path
        functions, end = self.out.functions, _matches(self.end, path, frame.qualname)
        if key not in self.walked:
            functions.append(Entered(len(functions) + 1, path, frame.qualname, depth, sorted(params), site))
            functions[-1].followed = not end
            self.walked[key] = set()
        elif params <= self.walked[key] or end:
            return
        else:
            new = sorted(params - self.walked[key])
            self.out.rewalks.append({"function": f"{path}:{frame.qualname}", "new_params": new, "from": site})
        if end:  # the op's entry: a stop, not followed
            return
        self.walked[key] |= params
        frame.tracked = set(self.walked[key])
        if frame.parent is not None:  # a closure reads its enclosing function's tracked names
            own = _local_names(frame.node)
            frame.tracked |= {n for n in frame.parent.tracked if n not in own}
        self.walk_body(frame, depth)

    def walk_body(self, frame: Frame, depth: int) -> None:
        info = self.pkg.module(frame.module)
        local = _local_names(frame.node)
        imported = (set(info.imports) | set(info.functions) | set(info.classes)) - local
        _track(frame, imported, lambda call: self.is_planning(frame, call))
        for call in _calls_in_order(frame.node):
            self.call(frame, call, depth)

    def is_planning(self, frame: Frame, call: ast.Call) -> bool:
        """Whether ``call`` resolves to a ``PLANNING`` function."""
        target, _, _ = self.callee(frame, call.func)
        if target[0] not in ("function", "method", "nested"):
            return False
        callee = self.frame_of(target)
        return _matches(self.planning, self.pkg.module(callee.module).path, callee.qualname)

    # -- one call

    def call(self, frame: Frame, call: ast.Call, depth: int) -> None:
        tracked = frame.tracked
        path = self.pkg.module(frame.module).path
        site = f"{path}:{call.lineno}"
        arg_tracked = [_uses(a, tracked) for a in call.args]
        kw_tracked = [_uses(k.value, tracked) for k in call.keywords]
        if not any(arg_tracked) and not any(kw_tracked) and not _uses(call.func, tracked):
            return
        target, bound, receiver_tracked = self.callee(frame, call.func)
        if not any(arg_tracked) and not any(kw_tracked) and not receiver_tracked:
            return
        record = {"site": site, "in": frame.qualname, "call": _short(call)}
        kind = target[0]
        if kind == "method" and bound and frame.cls and (frame.cls, target[3]) not in self._seen_sites:
            self._seen_sites.add((frame.cls, target[3]))
            if others := self.pkg.overrides(*frame.cls, target[3]):
                self.out.overrides.append(record | {"overrides": others, "note": ", ".join(others)})
        if kind == "class" and (init := self.pkg.method(target[1], target[2], "__init__")):
            target, kind, bound = ("method", *init, "__init__", True), "method", True
        if kind in ("function", "method", "nested"):
            callee = self.frame_of(target)
            label = f"{self.pkg.module(callee.module).path}:{callee.qualname}"
            if not _matches(self.planning, *label.split(":")):
                params = self.bind(callee.node, call, arg_tracked, kw_tracked, bound)
                return self.enter(callee, params, depth + 1, site)
        if (site, call.col_offset) in self._seen_sites:
            return
        self._seen_sites.add((site, call.col_offset))
        if kind in ("function", "method", "nested"):
            self.out.planning.append(record | {"callee": label, "note": label})
        elif kind == "class":
            post = "__post_init__" in self.pkg.module(target[1]).classes[target[2]].methods
            name = f"{self.pkg.module(target[1]).path}:{target[2]}"
            note = name + (" (its __post_init__ not entered)" if post else "")
            self.out.constructors.append(record | {"class": name, "post_init": post, "note": note})
        elif kind == "external":
            self.out.external[target[1]] = self.out.external.get(target[1], 0) + 1
            if funcs := self.function_args(frame, call):
                self.out.callbacks.append(
                    record | {"callee": target[1], "functions": funcs, "note": ", ".join(funcs)}
                )
        else:
            why = target[1]
            if receiver_tracked:
                why = "method of a tracked value" + (
                    ", tracked arguments" if any(arg_tracked + kw_tracked) else ""
                )
            found = self.pkg.methods_named(call.func.attr) if isinstance(call.func, ast.Attribute) else []
            note = why + (f"; candidates: {', '.join(found)}" if found else "")
            self.out.unresolved.append(record | {"why": why, "candidates": found, "note": note})

    def callee(self, frame: Frame, func: ast.AST) -> tuple[tuple, bool, bool]:
        """``(target, bound, receiver tracked)`` of a call's function expression."""
        chain = dotted(func)
        if chain is None:  # a call's result, a subscript, ...
            tracked = isinstance(func, ast.Attribute) and _uses(func.value, frame.tracked)
            return ("unknown", f"callee {ast.unparse(func)} is not a name"), False, tracked
        head, rest = chain[0], chain[1:]
        # a function nested in this one or an enclosing one
        f: Frame | None = frame
        while f is not None:
            if head in _nested_defs(f.node) and not rest:
                return ("nested", f, head), False, False
            if head in _local_names(f.node):
                break
            f = f.parent
        if f is not None and head in _local_names(f.node):
            if head in ("self", "cls") and frame.cls and len(rest) == 1:
                found = self.pkg.method(*frame.cls, rest[0])
                if found and is_property(self.pkg.module(found[0]).classes[found[1]].methods[rest[0]]):
                    return ("unknown", f"property {head}.{rest[0]}"), False, False
                if found:
                    return ("method", *found, rest[0], True), True, False
                return ("unknown", f"{head}.{rest[0]}: not a method of {frame.cls[1]}"), False, False
            tracked = bool(rest) and head in frame.tracked
            what = "a local value" if not rest else "method of a local value"
            return ("unknown", f"{what} {head}"), False, tracked
        target = self.pkg.resolve(frame.module, head)
        for a in rest:
            target = self.pkg.attribute(target, a)
        return target, False, False

    def frame_of(self, target: tuple) -> Frame:
        if target[0] == "nested":
            _, parent, name = target
            node = _nested_defs(parent.node)[name]
            return Frame(parent.module, f"{parent.qualname}.<locals>.{name}", node, parent.cls, parent)
        if target[0] == "function":
            _, module, name = target
            return Frame(module, name, self.pkg.module(module).functions[name], None, None)
        _, module, cls, name, _bound = target
        node = self.pkg.module(module).classes[cls].methods[name]
        return Frame(module, f"{cls}.{name}", node, (module, cls), None)

    def bind(self, node: ast.FunctionDef, call: ast.Call, arg_tracked, kw_tracked, bound: bool) -> set[str]:
        """The callee's parameters that receive a tracked value."""
        a = node.args
        positional = [p.arg for p in (*a.posonlyargs, *a.args)]
        static = any(dotted(d) in (["staticmethod"],) for d in node.decorator_list)
        if bound and not static:
            positional = positional[1:]
        keyword = set(positional[len(a.posonlyargs) :]) | {p.arg for p in a.kwonlyargs}
        out: set[str] = set()
        starred_at = None
        for i, (arg, t) in enumerate(zip(call.args, arg_tracked)):
            if isinstance(arg, ast.Starred) and starred_at is None:
                starred_at = i
            if not t:
                continue
            if isinstance(arg, ast.Starred) or starred_at is not None:
                out |= set(positional[starred_at:]) | ({a.vararg.arg} if a.vararg else set())
            elif i < len(positional):
                out.add(positional[i])
            elif a.vararg:
                out.add(a.vararg.arg)
        for k, t in zip(call.keywords, kw_tracked):
            if not t:
                continue
            if k.arg is None:  # **mapping
                out |= keyword | ({a.kwarg.arg} if a.kwarg else set())
            elif k.arg in keyword:
                out.add(k.arg)
            elif a.kwarg:
                out.add(a.kwarg.arg)
        return out

    def function_args(self, frame: Frame, call: ast.Call) -> list[str]:
        """Package functions passed as arguments (callbacks of an outside call)."""
        out = []
        for arg in [*call.args, *(k.value for k in call.keywords)]:
            chain = dotted(arg)
            if not chain:
                continue
            target, _, _ = self.callee(frame, arg)
            if target[0] in ("function", "method", "nested"):
                out.append(self.frame_of(target).qualname)
        return out


def _matches(entries: tuple[str, ...], path: str, qualname: str) -> bool:
    """Whether function ``path:qualname`` is one of ``entries`` (functions, modules, folders)."""
    return any(e in (path, f"{path}:{qualname}") or (e.endswith("/") and path.startswith(e)) for e in entries)


def _short(call: ast.Call, most: int = 90) -> str:
    text = " ".join(ast.unparse(call).split())
    return text if len(text) <= most else text[: most - 3] + "..."


def walk(
    root: Path = ROOT, start: tuple[str, str] = START, param: str = PARAM, end=END, planning=PLANNING
) -> WalkResult:
    """The walk of ``param`` from ``start`` (a repository-relative path and a qualname
    ``function`` or ``Class.method``) through package ``flowtt_jax`` under ``root``, ending at
    ``end`` and leaving ``planning`` out (see the module's docstring)."""
    pkg = Package(root, PACKAGE)
    module = ".".join(Path(start[0]).with_suffix("").parts)
    module = module.removesuffix(".__init__")
    result = WalkResult(f"{start[0]}:{start[1]}", param)
    walker = Walker(pkg, result, end, planning)
    cls, _, name = start[1].rpartition(".")
    info = pkg.module(module)
    if cls and name in getattr(info.classes.get(cls), "methods", {}):
        node, owner = info.classes[cls].methods[name], (module, cls)
    elif not cls and name in info.functions:
        node, owner = info.functions[name], None
    else:
        raise ValueError(f"no function {start[1]} in {start[0]}")
    walker.enter(Frame(module, start[1], node, owner, None), {param}, 0, None)
    result.external = dict(sorted(result.external.items(), key=lambda kv: -kv[1]))
    return result


def report(result: WalkResult) -> str:
    lines = [f"`{result.param}` from {result.start}, followed through the calls that pass it on", ""]
    lines.append("functions entered (depth-first, in order; indent = call depth; '(end)': not followed):")
    for f in result.functions:
        site = f"  (from {f.called_from})" if f.called_from else ""
        end = "" if f.followed else "  (end)"
        lines.append(f"{f.index:4d} {'  ' * f.depth}{f.label}  [{', '.join(f.params)}]{site}{end}")
    v = result.visits
    lines += ["", "module visits (a run of functions in one module is one visit; '<- return': re-entered):"]
    lines += [f"  {i:3d}  {m}{'  <- return' if m in v[: i - 1] else ''}" for i, m in enumerate(v, 1)]
    lines += ["", "visits per module:", *(f"  {n:3d}  {m}" for m, n in result.per_module.items())]
    fig = result.figures
    lines += ["", f"stops: {fig['stops']}   modules: {fig['modules']}   returns: {fig['returns']}"]
    for title, items in (
        ("planning calls, not followed", result.planning),
        ("unresolved calls taking a tracked value, not followed", result.unresolved),
        ("package functions handed to calls outside the package, not followed", result.callbacks),
        ("package classes built from tracked values, no __init__ of their own", result.constructors),
        ("self.method calls whose package subclasses' overrides are not followed", result.overrides),
    ):
        lines += ["", f"{title} ({len(items)}):"]
        lines += [f"  {x['site']} in {x['in']}: {x['call']}  [{x['note']}]" for x in items]
    lines += ["", f"functions walked again for parameters a later call tracked ({len(result.rewalks)}):"]
    lines += [f"  {r['function']} +[{', '.join(r['new_params'])}] from {r['from']}" for r in result.rewalks]
    ext = ", ".join(f"{k} x{v}" for k, v in result.external.items())
    lines += ["", f"calls outside the package, not followed (call sites): {ext}"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", metavar="PATH", help="write the figures as JSON ('-': stdout)")
    for name, default in (("end", END), ("planning", PLANNING)):  # replace the constant's entries
        parser.add_argument(f"--{name}", nargs="*", default=default, metavar="ENTRY")
    args = parser.parse_args(argv)
    result = walk(end=args.end, planning=args.planning)
    data = json.dumps(result.as_dict(), indent=1)
    print(data if args.json == "-" else report(result))
    if args.json and args.json != "-":
        Path(args.json).write_text(data + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
