"""The import graph of ``sim`` and ``hw_validate``: no cycles, layers import one way, ``sim`` never
imports torch, deepspeed or ``hw_validate`` (only ``sim.cli`` may reach it), and nothing imports
``sim.cli``. Every import counts, including those inside functions; ``if TYPE_CHECKING:`` blocks do not."""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parents[2]

#: sim's packages, lowest first: a package may import its own and lower ones only
#: (``errors`` and ``ioutil`` are leaf modules every layer may use).
LAYERS = ["errors", "ioutil", "inputs", "model", "hardware", "routing", "network", "frameworks", "host",
          "engine", "api", "studies", "reports", "cli"]  # fmt: skip
#: studies and reports sit side by side: neither imports the other, except the plots of a study
SIDE_BY_SIDE = {("studies", "reports"), ("reports", "studies")}
#: modules every layer may import (the progress reporter the engine and the studies call into);
#: they import nothing of sim themselves
LEAF_MODULES = {"sim.reports.progress"}


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING"
    )


def _imports(path: Path, module: str) -> set[str]:
    tree = ast.parse(path.read_text())
    out: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                pkg = base if path.name == "__init__.py" else base[:-1]
                pkg = pkg[: len(pkg) - node.level + 1]
                mod = ".".join(pkg + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            out.add(mod)
            out.update(f"{mod}.{a.name}" for a in node.names)  # `from pkg import submodule`
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return out


def import_graph() -> nx.DiGraph:
    files = sorted((ROOT / "sim").rglob("*.py")) + sorted((ROOT / "hw_validate").rglob("*.py"))
    modules = {_module_name(p): p for p in files}
    g = nx.DiGraph()
    g.add_nodes_from(modules)
    for name, path in modules.items():
        for imp in _imports(path, name):
            top = imp.split(".")[0]
            if top in ("torch", "deepspeed"):
                g.add_edge(name, top)
            target = imp
            while target and target not in modules:  # `from sim.x import name` -> sim.x
                target = target.rpartition(".")[0]
            if target and target != name and not (path.name == "__init__.py" and target == name):
                g.add_edge(name, target)
    return g


def _layer(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "sim" or len(parts) < 2:
        return None
    return parts[1]


def test_no_import_cycles():
    g = import_graph()
    cycles = [sorted(c) for c in nx.strongly_connected_components(g) if len(c) > 1]
    assert not cycles, f"import cycles: {cycles}"


def test_sim_never_imports_hw_validate_torch_or_deepspeed():
    g = import_graph()
    bad = [
        (a, b)
        for a, b in g.edges
        if a.startswith("sim") and not a.startswith("sim.cli") and (b.startswith("hw_validate") or b in ("torch", "deepspeed"))
    ]
    assert not bad, bad


def test_nothing_imports_the_cli():
    g = import_graph()
    bad = [(a, b) for a, b in g.edges if b.startswith("sim.cli") and not (a.startswith("sim.cli") or a == "sim.__main__")]
    assert not bad, bad


def test_layers_import_one_way():
    g = import_graph()
    bad = []
    for a, b in g.edges:
        la, lb = _layer(a), _layer(b)
        if la is None or lb is None or la == lb or la not in LAYERS or lb not in LAYERS:
            continue
        if (la, lb) in SIDE_BY_SIDE or b in LEAF_MODULES:
            continue
        if LAYERS.index(lb) > LAYERS.index(la):
            bad.append(f"{a} -> {b}")
    assert not bad, "imports against the layering " + " > ".join(LAYERS) + ":\n" + "\n".join(bad)


def test_leaf_modules_import_nothing_of_sim():
    g = import_graph()
    bad = [(a, b) for a in LEAF_MODULES for b in g.successors(a) if b.startswith("sim")]
    assert not bad, bad


def test_every_sim_module_is_in_a_layer():
    g = import_graph()
    stray = sorted(m for m in g if m.startswith("sim.") and _layer(m) not in LAYERS + ["__main__"])
    assert not stray, stray


def test_the_checker_sees_a_planted_cycle(tmp_path):
    a = tmp_path / "a.py"
    a.write_text("def f():\n    from sim.b import x\n")
    assert "sim.b.x" in _imports(a, "sim.a") and "sim.b" in _imports(a, "sim.a")
    t = tmp_path / "t.py"
    t.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import torch\n")
    assert "torch" not in _imports(t, "sim.t")
