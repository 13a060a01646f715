"""No import cycles among wanlink's modules, counting imports inside functions too."""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE_ROOT = Path(__file__).resolve().parent.parent / "wanlink"


def module_names(root: Path = PACKAGE_ROOT) -> dict[str, Path]:
    """Dotted name -> file for every module of the package (``wanlink.io`` for io/__init__.py)."""
    modules = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The longest prefix of ``name`` that is a wanlink module (``wanlink.x.Y`` -> ``wanlink.x``)."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def import_graph(modules: dict[str, Path] | None = None) -> dict[str, set[str]]:
    """Module -> the wanlink modules it imports anywhere in its source (module level or lazily)."""
    modules = module_names() if modules is None else modules
    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                candidates = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                candidates = [f"{base}.{alias.name}" for alias in node.names]  # a submodule, else base itself
            else:
                continue
            for candidate in candidates:
                target = _resolve(candidate, modules)
                if target is not None and target != name:
                    targets.add(target)
        graph[name] = targets
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def test_the_graph_sees_lazy_and_relative_imports(tmp_path):
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("from . import low\n")
    (package / "sub" / "low.py").write_text("def f():\n    from pkg.high import g\n")
    (package / "high.py").write_text("from pkg.sub.low import f\n")
    graph = import_graph(module_names(package))
    assert graph["pkg.sub"] == {"pkg.sub.low"}
    assert graph["pkg.sub.low"] == {"pkg.high"}
    assert cycles(graph) == [["pkg.high", "pkg.sub.low"]]


def test_no_import_cycles_in_wanlink():
    assert cycles(import_graph()) == []
