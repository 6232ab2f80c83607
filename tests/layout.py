"""The house as a reader of the code meets it: modules, who imports whom, circles, imports that run back up.

``python -m tests.layout`` prints the report (folders, largest modules, import
circles, imports from a part into the CLI or from loader/ into publisher/ and back,
and which of vLLM's two halves imports the other); tests/test_layout.py asserts the
rules the layout promises. Imports inside functions count (a lazy import is still a
dependency); those under ``if TYPE_CHECKING:`` do not.
"""

from __future__ import annotations

import ast
import os
import sys
from collections import defaultdict
from collections.abc import Iterator

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: repository folder -> the package it installs as
PARTS = {"delta": "ckptdelta.delta", "publisher": "ckptdelta.publisher", "loader": "ckptdelta.loader",
         "ckptdelta": "ckptdelta"}
VLLM = "ckptdelta.loader.engines.vllm"
WORKER = VLLM + ".worker"
#: where vLLM's two halves meet: the tensor-parallel slices and the proof (the package face imports neither)
VLLM_SHARED = (VLLM, VLLM + ".tp", VLLM + ".proof")


def modules(root: str = ROOT) -> dict[str, str]:
    """Installed module name -> source path, for every module of the package."""
    out = {}
    for folder, package in PARTS.items():
        base = os.path.join(root, folder)
        for here, dirs, files in os.walk(base):
            dirs[:] = [d for d in dirs if not d.startswith((".", "__"))]
            rel = os.path.relpath(here, base)
            pkg = package if rel == "." else package + "." + rel.replace(os.sep, ".")
            if folder == "ckptdelta" and rel.split(os.sep)[0] in ("delta", "publisher", "loader"):
                continue
            for f in files:
                if f.endswith(".py"):
                    out[pkg if f == "__init__.py" else f"{pkg}.{f[:-3]}"] = os.path.join(here, f)
    return out


def _type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST, module: str, is_package: bool) -> Iterator[str]:
    package = module if is_package else module.rpartition(".")[0]
    stack = [tree]
    while stack:
        node = stack.pop()
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _type_checking(child):
                stack.extend(child.orelse)
                continue
            if isinstance(child, ast.Import):
                for a in child.names:
                    yield a.name
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = package.split(".")
                    base = base[: len(base) - child.level + 1]
                    target = ".".join(base + ([child.module] if child.module else []))
                else:
                    target = child.module or ""
                yield target
                for a in child.names:
                    yield f"{target}.{a.name}"
            stack.append(child)


def graph(root: str = ROOT) -> dict[str, set[str]]:
    """module -> the package's modules it imports (a name that is a module's attribute counts as that module)."""
    mods = modules(root)
    out: dict[str, set[str]] = {}
    for name, path in mods.items():
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        deps = set()
        for target in _imports(tree, name, path.endswith("__init__.py")):
            if target.split(".")[0] in ("delta", "publisher", "loader"):   # the layout before one namespace
                target = "ckptdelta." + target
            while target and target not in mods:
                target = target.rpartition(".")[0]
            if target and target != name and not name.startswith(target + "."):
                deps.add(target)
        out[name] = deps
    return out


def circles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on, stack, out = set(), [], []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in g.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    sys.setrecursionlimit(10_000)
    for v in sorted(g):
        if v not in index:
            visit(v)
    return sorted(out)


def crossings(g: dict[str, set[str]]) -> list[tuple[str, str]]:
    """Imports the layout forbids: a part into the CLI, publisher/ <-> loader/, delta/ into either, and one
    half of the vLLM engine into the other."""
    def part(m: str) -> str:
        bits = m.split(".")
        if len(bits) == 1:
            return "root"
        return bits[1] if bits[1] in ("delta", "publisher", "loader", "cli") else "top"

    bad = []
    for a, deps in g.items():
        for b in deps:
            pa, pb = part(a), part(b)
            if pa in ("delta", "publisher", "loader") and pb in ("cli", "top"):
                bad.append((a, b))
            elif {pa, pb} == {"publisher", "loader"} or (pa == "delta" and pb in ("publisher", "loader")):
                bad.append((a, b))
            elif a.startswith(WORKER) and b.startswith(VLLM) and not b.startswith(WORKER) and b not in VLLM_SHARED:
                bad.append((a, b))      # a worker reaching into the replica side
            elif a.startswith(VLLM) and not a.startswith(WORKER) and b.startswith(WORKER):
                bad.append((a, b))      # the replica side reaching into a worker
    return sorted(bad)


def report(root: str = ROOT) -> str:
    mods = modules(root)
    g = graph(root)
    sizes = sorted(((sum(1 for _ in open(p, encoding="utf-8")), m) for m, p in mods.items()), reverse=True)
    folders = defaultdict(int)
    for m in mods:
        folders[m.rpartition(".")[0] if not mods[m].endswith("__init__.py") else m] += 1
    lines = [f"{len(mods)} modules in {len(folders)} packages"]
    lines += [f"  {pkg:<40} {n:>3} modules" for pkg, n in sorted(folders.items())]
    lines.append("largest modules (lines):")
    lines += [f"  {n:>5}  {m}" for n, m in sizes[:8]]
    cs = circles(g)
    lines.append(f"import circles: {len(cs)}")
    lines += ["  " + " <-> ".join(c) for c in cs]
    bad = crossings(g)
    lines.append(f"imports across the layout's lines: {len(bad)}")
    lines += [f"  {a} -> {b}" for a, b in bad]
    return "\n".join(lines)


if __name__ == "__main__":
    print(report(sys.argv[1] if len(sys.argv) > 1 else ROOT))
