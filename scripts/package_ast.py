"""A package's modules as ``ast`` trees and the resolution of names across them (imports,
re-exports, classes and their method resolution order), for ``scripts.feature_walk``: the
package is parsed, never imported or run."""

from __future__ import annotations

import ast
import builtins
import dataclasses
from pathlib import Path
from typing import NamedTuple

__all__ = ["ClassInfo", "ModuleInfo", "Package", "dotted", "is_property"]

_BUILTINS = frozenset(dir(builtins))


class ClassInfo(NamedTuple):
    node: ast.ClassDef
    methods: dict[str, ast.FunctionDef]


@dataclasses.dataclass
class ModuleInfo:
    path: str  # repository-relative
    functions: dict[str, ast.FunctionDef]
    classes: dict[str, ClassInfo]
    imports: dict[str, tuple]  # local name -> ("module", dotted) | ("from", dotted, attr)
    globals_: set[str]


class Package:
    """The package's modules, parsed on demand, and symbol resolution across them."""

    def __init__(self, root: Path, package: str) -> None:
        self.root = root
        self.package = package
        self.paths: dict[str, Path] = {}
        for p in (root / package).rglob("*.py"):
            parts = list(p.relative_to(root).with_suffix("").parts)
            self.paths[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
        self._modules: dict[str, ModuleInfo] = {}

    def is_internal(self, dotted: str) -> bool:
        return dotted == self.package or dotted.startswith(self.package + ".")

    def module(self, name: str) -> ModuleInfo:
        if name not in self._modules:
            path = self.paths[name]
            tree = ast.parse(path.read_text(), filename=str(path))
            functions, classes, imports, globals_ = {}, {}, {}, set()
            for node in tree.body:
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    functions[node.name] = node
                elif isinstance(node, ast.ClassDef):
                    methods = {
                        n.name: n for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
                    }
                    classes[node.name] = ClassInfo(node, methods)
                elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                    for t in targets:
                        globals_ |= {n.id for n in ast.walk(t) if isinstance(n, ast.Name)}
            package_of = name if path.name == "__init__.py" else name.rpartition(".")[0]
            for node in ast.walk(tree):  # module level and inside functions alike
                if isinstance(node, ast.Import):
                    for a in node.names:  # `import a.b` binds `a`
                        local = a.asname or a.name.split(".")[0]
                        imports[local] = ("module", a.name if a.asname else local)
                elif isinstance(node, ast.ImportFrom):
                    base = node.module or ""
                    if node.level:
                        anchor = package_of.split(".")
                        anchor = anchor[: len(anchor) - (node.level - 1)]
                        base = ".".join(anchor + ([base] if base else []))
                    for a in node.names:
                        imports[a.asname or a.name] = ("from", base, a.name)
            self._modules[name] = ModuleInfo(
                path.relative_to(self.root).as_posix(), functions, classes, imports, globals_
            )
        return self._modules[name]

    def resolve(self, module: str, name: str, seen: frozenset = frozenset()) -> tuple:
        """What ``name`` is at the top level of package module ``module``: ``("function", m,
        qualname)``, ``("class", m, name)``, ``("module", dotted)``, ``("external", dotted)``
        or ``("unknown", why)``."""
        if (module, name) in seen:
            return ("unknown", f"import cycle at {module}.{name}")
        seen = seen | {(module, name)}
        info = self.module(module)
        if name in info.functions:
            return ("function", module, name)
        if name in info.classes:
            return ("class", module, name)
        if name in info.imports:
            imp = info.imports[name]
            if imp[0] == "module":
                return ("module", imp[1]) if self.is_internal(imp[1]) else ("external", imp[1])
            _, base, attr = imp
            if f"{base}.{attr}" in self.paths:
                return ("module", f"{base}.{attr}")
            if base in self.paths:
                return self.resolve(base, attr, seen)
            if self.is_internal(base):
                return ("unknown", f"{base}.{attr} not found")
            return ("external", f"{base}.{attr}")
        if f"{module}.{name}" in self.paths and self.paths[module].name == "__init__.py":
            return ("module", f"{module}.{name}")
        if name in info.globals_:
            return ("unknown", f"module-level value {name}")
        if name in _BUILTINS:
            return ("external", name)
        return ("unknown", f"name {name} not found in {module}")

    def attribute(self, target: tuple, attr: str) -> tuple:
        """``target.attr`` for a resolved ``target``."""
        kind = target[0]
        if kind == "module":
            if f"{target[1]}.{attr}" in self.paths:
                return ("module", f"{target[1]}.{attr}")
            return self.resolve(target[1], attr)
        if kind == "external":
            return ("external", f"{target[1]}.{attr}")
        if kind == "class":
            found = self.method(target[1], target[2], attr)
            if found and is_property(self.module(found[0]).classes[found[1]].methods[attr]):
                return ("unknown", f"property {target[2]}.{attr}")
            if found:
                return ("method", *found, attr, False)
            return ("unknown", f"{target[2]}.{attr}: no such method in the package")
        return ("unknown", f"{attr} of {target[1]}")

    def method(self, module: str, cls: str, name: str) -> tuple[str, str] | None:
        """``(module, class)`` whose method ``name`` class ``cls`` runs (its MRO), or None."""
        return next(
            (k for k in self.mro(module, cls) if name in self.module(k[0]).classes[k[1]].methods), None
        )

    def bases(self, module: str, cls: str) -> list[tuple[str, str]]:
        """The package classes ``cls`` derives from directly."""
        out = []
        for base in self.module(module).classes[cls].node.bases:
            chain = dotted(base)
            if not chain:
                continue
            target = self.resolve(module, chain[0])
            for a in chain[1:]:
                target = self.attribute(target, a)
            if target[0] == "class":
                out.append((target[1], target[2]))
        return out

    def mro(self, module: str, cls: str, seen: frozenset = frozenset()) -> list[tuple[str, str]]:
        """The class's method resolution order over its package classes (C3)."""
        if (module, cls) in seen:
            return []
        seqs = [self.mro(*b, seen | {(module, cls)}) for b in self.bases(module, cls)]
        seqs = [q for q in seqs + [self.bases(module, cls)] if q]
        out = [(module, cls)]
        while seqs:
            for q in seqs:
                head = q[0]
                if not any(head in r[1:] for r in seqs):
                    break
            else:  # inconsistent: Python would refuse the class; keep the order given
                head = seqs[0][0]
            out.append(head)
            seqs = [r[1:] if r[0] == head else r for r in seqs]
            seqs = [q for q in seqs if q]
        return out

    def overrides(self, module: str, cls: str, name: str) -> list[str]:
        """``path:Class.name`` of the methods ``name`` that ``self.name`` runs instead of
        ``cls``'s in the package's subclasses of ``cls`` (their MRO finds another first)."""
        mine = self.method(module, cls, name)
        out = set()
        for m in sorted(self.paths):
            for c in self.module(m).classes:
                order = self.mro(m, c)
                if (module, cls) not in order[1:]:
                    continue
                found = self.method(m, c, name)
                if found and found != mine:
                    out.add(f"{self.module(found[0]).path}:{found[1]}.{name}")
        return sorted(out)

    def methods_named(self, name: str) -> list[str]:
        """``path:Class.name`` of every package class defining method ``name`` (candidates)."""
        out = []
        for m in sorted(self.paths):
            info = self.module(m)
            out += [f"{info.path}:{c}.{name}" for c, ci in info.classes.items() if name in ci.methods]
        return out


def dotted(node: ast.AST) -> list[str] | None:
    """``a.b.c`` as ``["a", "b", "c"]`` (None unless a chain of names)."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return [node.id, *reversed(parts)]


def is_property(node: ast.FunctionDef) -> bool:
    """A ``property`` / ``cached_property`` (or its setter): reading it runs no call."""
    names = {(dotted(d) or [""])[-1] for d in node.decorator_list}
    return bool(names & {"property", "cached_property", "setter", "deleter"})
