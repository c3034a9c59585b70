"""The import direction of docs/architecture.md, checked on every module's imports (top level and inside
functions): tools -> testsupport -> actors -> (topology, transport, algo); algo imports nothing of ours."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
OURS = ("actors", "algo", "configs", "testsupport", "tools", "topology", "transport")
# package -> the packages of ours it may import (besides itself)
ALLOWED = {
    "algo": set(),
    "transport": set(),
    "topology": set(),
    "actors": {"algo", "topology", "transport"},
    "testsupport": {"actors", "algo", "topology", "transport"},
    "tools": {"actors", "algo", "testsupport", "topology", "transport"},
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


def test_the_check_sees_imports_inside_functions(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text("import os\n\ndef f():\n    from tools.up import main\n    import actors.base\n")
    assert imported_packages(module) == {"tools", "actors"}
