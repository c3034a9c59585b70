"""The import direction of docs/architecture.md, checked on every module's imports (top level and inside
functions): tools -> (launch, testsupport) -> actors -> (topology, transport, algo); algo imports nothing of ours. And
no import cycle between our modules, not even one dodged by importing inside a function."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
OURS = ("actors", "algo", "configs", "launch", "testsupport", "tools", "topology", "transport")
# package -> the packages of ours it may import (besides itself)
ALLOWED = {
    "algo": set(),
    "transport": set(),
    "topology": set(),
    "actors": {"algo", "topology", "transport"},
    "launch": {"actors", "algo", "topology", "transport"},
    "testsupport": {"actors", "algo", "topology", "transport"},
    "tools": {"actors", "algo", "launch", "testsupport", "topology", "transport"},
}


def imported_packages(path: Path) -> set[str]:
    """The top-level packages of ours that `path` imports anywhere in it (relative imports stay inside)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        found.update(n.split(".")[0] for n in names if n.split(".")[0] in OURS)
    return found


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_imports_flow_one_way(package: str) -> None:
    wrong = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        bad = imported_packages(path) - ALLOWED[package] - {package}
        if bad:
            wrong[str(path.relative_to(ROOT))] = sorted(bad)
    assert not wrong, f"imports against the direction of docs/architecture.md: {wrong}"


# The tools that run test doubles as real code (docs/architecture.md names them): the engine benchmark's random
# model, the rehearsal's SGLang stand-in and tiny model directory. A new one is a choice to make in the docs too.
TOOLS_USING_TESTSUPPORT = {"tools/bench/agent.py", "tools/bench/gpu.py", "tools/rehearse/rehearsal.py", "tools/rehearse/server.py"}


def test_the_tools_using_testsupport_are_those_the_docs_name() -> None:
    using = {str(p.relative_to(ROOT)) for p in sorted((ROOT / "tools").rglob("*.py"))
             if "testsupport" in imported_packages(p)}
    assert using == TOOLS_USING_TESTSUPPORT, "update docs/architecture.md (Layout and import direction) and this list"


def test_the_check_sees_imports_inside_functions(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text("import os\n\ndef f():\n    from tools.up import main\n    import actors.runtime.base\n")
    assert imported_packages(module) == {"tools", "actors"}


def module_graph(root: Path) -> dict[str, dict[str, int]]:
    """Each module of ours -> the modules of ours it imports anywhere in it (top level, inside functions,
    relative), with the line of the first such import. `from pkg import name` counts as importing the module
    pkg.name where there is one, pkg otherwise."""
    modules: dict[str, Path] = {}
    for package in OURS:
        for path in (root / package).rglob("*.py"):
            parts = list(path.relative_to(root).with_suffix("").parts)
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path

    def known(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, dict[str, int]] = {}
    for name, path in modules.items():
        here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        edges: dict[str, int] = {}
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = ".".join(here[:len(here) - node.level + 1] + [node.module or ""]) if node.level else node.module
                targets = [f"{base.rstrip('.')}.{a.name}" for a in node.names]
            else:
                continue
            for target in filter(None, map(known, targets)):
                if target != name:
                    edges.setdefault(target, node.lineno)
        graph[name] = edges
    return graph


def import_cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        cycles.append(sorted(component))
    return cycles


def test_no_import_cycles() -> None:
    graph = module_graph(ROOT)
    found = [{a: {b: line for b, line in graph[a].items() if b in cycle} for a in cycle}
             for cycle in import_cycles(graph)]
    assert not found, ("modules that import each other (module -> {imported: line}); move what both need "
                       f"into a module below them: {found}")


def test_the_cycle_check_sees_imports_inside_functions_and_relative_ones(tmp_path: Path) -> None:
    (tmp_path / "actors" / "sub").mkdir(parents=True)
    (tmp_path / "actors" / "__init__.py").write_text("")
    (tmp_path / "actors" / "sub" / "__init__.py").write_text("")
    (tmp_path / "actors" / "a.py").write_text("from actors.b import f\n")
    (tmp_path / "actors" / "b.py").write_text("def f():\n    from actors import a\n")
    (tmp_path / "actors" / "sub" / "c.py").write_text("from .d import g\n")
    (tmp_path / "actors" / "sub" / "d.py").write_text("def g():\n    from ..sub import c\n")
    (tmp_path / "actors" / "e.py").write_text("import actors.a\n")
    graph = module_graph(tmp_path)
    assert graph["actors.b"] == {"actors.a": 2} and graph["actors.sub.c"] == {"actors.sub.d": 1}
    assert sorted(import_cycles(graph)) == [["actors.a", "actors.b"], ["actors.sub.c", "actors.sub.d"]]


# Inside actors/: each part (a subpackage, or a module at its top) -> the parts of actors/ it may import
# (besides itself). The runtime and the parts more than one actor uses sit below the actors' packages; an
# actor's package imports no other actor's, but for the reward's graders and sandbox (the rollout's
# environments, the evaluator and the dataset use them) and the rollout's episodes (the evaluator runs them).
# The rules form no cycle, so every part has a layer: docs/architecture.md draws them.
ACTOR_PARTS = {
    "runtime": set(),
    "weights": set(),
    "engines": {"runtime", "weights"},
    "batch": {"engines"},
    "weight_sync": {"engines", "runtime", "weights"},
    "reward": {"batch", "engines", "runtime"},
    "dataset": {"reward"},
    "buffer": {"batch", "dataset", "engines", "runtime"},
    "trainer": {"batch", "engines", "runtime", "weight_sync"},
    "param_server": {"runtime", "weight_sync"},
    "rollout": {"batch", "engines", "reward", "runtime", "weight_sync", "weights"},
    "evaluator": {"dataset", "engines", "reward", "rollout", "runtime", "weights"},
}


def actor_part(module: str) -> str | None:
    """The part of actors/ a dotted module name is in (None: outside actors/, or the package itself)."""
    parts = module.split(".")
    return parts[1] if parts[0] == "actors" and len(parts) > 1 else None


def test_every_part_of_actors_has_its_place_in_the_layers() -> None:
    parts = {p.stem if p.is_file() else p.name for p in (ROOT / "actors").iterdir()
             if (p.suffix == ".py" and p.stem != "__init__") or (p / "__init__.py").exists()}
    assert parts <= set(ACTOR_PARTS), f"place these in ACTOR_PARTS and docs/architecture.md: {sorted(parts - set(ACTOR_PARTS))}"


def test_imports_inside_actors_flow_down_the_layers() -> None:
    wrong = {}
    for module, edges in module_graph(ROOT).items():
        part = actor_part(module)
        if part is None:
            continue
        bad = {actor_part(t) for t in edges} - {None, part} - ACTOR_PARTS[part]
        if bad:
            wrong[module] = sorted(bad)
    assert not wrong, f"imports up the layers of actors/ (tests/test_layout.py ACTOR_PARTS): {wrong}"


def test_the_layers_of_actors_have_no_cycle() -> None:
    assert not import_cycles({part: {t: 0 for t in allowed} for part, allowed in ACTOR_PARTS.items()})
