"""The import graph of runtime/ (every import statement, at module level or inside a function), its cycles, and
imports against the packages' order.

    python3 scripts/import_graph.py        # prints each cycle and each import against the order; exit 1 if any

runtime/'s packages are ranked (RANKS, lowest first): a module imports its own package and packages ranked below
it, never one above. The order is what the packages are for: core/ is what everything shares, cli/ is the
command line on top of everything. A cycle means two modules each need the other: neither can be understood,
tested or reused alone, and a deferred import inside a function only hides it. tests/test_import_graph.py fails
on any cycle and on any import against the order.
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "runtime"
# runtime/'s packages, lowest first (runtime/__init__.py's docstring says what each holds).
RANKS = ("core", "files", "net", "quant", "formats", "model", "text", "sampling", "offload", "lora", "step_cache",
         "local", "remote", "demo", "cli")


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _resolve(current: str, is_package: bool, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    base = current.split(".") if is_package else current.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """{module: the runtime modules it imports}; `from pkg import name` counts pkg.name when that is a module."""
    files = {module_name(p, root): p for p in (root / PACKAGE).rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in files}
    for name, path in files.items():
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name.removeprefix("ernie_image.") for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(name, path.name == "__init__.py", node).removeprefix("ernie_image.")
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in files else base for alias in node.names]
            for target in targets:
                while target and target not in files:  # `import runtime.a.b` -> the deepest module that exists
                    target = target.rpartition(".")[0]
                if target and target != name and not name.startswith(target + "."):  # a package's own __init__
                    graph[name].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Each strongly connected component of more than one module (Tarjan), as a sorted list."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0

    def visit(node: str) -> None:
        nonlocal counter
        index[node] = low[node] = counter
        counter += 1
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(10000)
    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def path_in(component: list[str], graph: dict[str, set[str]]) -> list[str]:
    """One concrete loop through a component, for the message: a -> b -> ... -> a."""
    members = set(component)
    start = component[0]
    trail, seen = [start], {start}
    while True:
        nxt = sorted(graph[trail[-1]] & members)
        back = [n for n in nxt if n == start]
        if back and len(trail) > 1:
            return trail + [start]
        fresh = [n for n in nxt if n not in seen]
        if not fresh:
            return trail + [nxt[0]] if nxt else trail
        trail.append(fresh[0])
        seen.add(fresh[0])


def package_of(module: str) -> str:
    """The runtime package a module is in ("runtime.local.pipe" -> "local"); "" for runtime/__init__.py itself."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def order_violations(graph: dict[str, set[str]], ranks: tuple[str, ...] = RANKS) -> list[str]:
    """`module -> target` for each import of a package ranked above the importer's, and for each module in no
    ranked package (a module loose in runtime/, or a package missing from `ranks`)."""
    found = []
    for module, targets in sorted(graph.items()):
        package = package_of(module)
        if module == PACKAGE:
            continue
        if package not in ranks:
            found.append(f"{module}: not in a ranked package (add its package to RANKS, or move it into one)")
            continue
        for target in sorted(targets):
            other = package_of(target)
            if other != package and (other not in ranks or ranks.index(other) > ranks.index(package)):
                found.append(f"{module} -> {target}")
    return found


if __name__ == "__main__":
    graph = import_graph()
    found = cycles(graph)
    for component in found:
        print(" -> ".join(path_in(component, graph)), f"  ({len(component)} modules)")
    against_order = order_violations(graph)
    for line in against_order:
        print("against the order:", line)
    sys.exit(1 if found or against_order else 0)
