"""Imports run one way, as docs/concepts.md's table of levels and rooms states: a module of
colfunc imports from a lower level or from its own room, never from a higher level or from
another room of its level, at module level or inside a function."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "colfunc"


def _table() -> dict[str, tuple[int, str]]:
    """``{top-level module: (level, room)}`` from the docs' table."""
    text = (ROOT / "docs" / "concepts.md").read_text()
    rows = re.findall(r"^\| (\d+) \| (\w+) \| ([^|]+) \|", text, flags=re.M)
    assert rows, "docs/concepts.md has no table of levels"
    where: dict[str, tuple[int, str]] = {}
    for level, room, names in rows:
        for name in re.findall(r"`(\w+)`", names):
            assert name not in where, f"{name} is in the table twice"
            where[name] = (int(level), room)
    return where


def _type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _imports(tree: ast.AST) -> list[tuple[int, str]]:
    """Every ``(line, colfunc module)`` the code imports, outside ``if TYPE_CHECKING:``."""
    out: list[tuple[int, str]] = []

    def visit(node: ast.AST) -> None:
        if _type_checking(node):
            return
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "colfunc":  # from colfunc import tree, hf: each a module
                out.extend((node.lineno, f"colfunc.{a.name}") for a in node.names)
            elif node.module.startswith("colfunc."):
                out.append((node.lineno, node.module))
        elif isinstance(node, ast.Import):
            out.extend((node.lineno, a.name) for a in node.names if a.name.startswith("colfunc"))
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return out


def _top(module: str) -> str:
    """The top-level module of a dotted name under colfunc (``colfunc`` itself: ``__init__``)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def test_every_module_is_placed_in_the_table() -> None:
    table = _table()
    tops = {p.stem if p.is_file() else p.name for p in PACKAGE.iterdir()}
    tops = {t for t in tops if not t.startswith((".", "__pycache__")) and t != "__init__"}
    tops -= {p.name for p in PACKAGE.iterdir() if p.is_dir() and not (p / "__init__.py").exists()}
    assert sorted(tops - set(table)) == [], "modules missing from docs/concepts.md's table"
    assert sorted(set(table) - tops) == [], "the table names modules that do not exist"


def test_no_import_runs_upward_or_across_rooms() -> None:
    table = _table()
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(ROOT).with_suffix("")
        here = _top(".".join(rel.parts))
        if here == "__init__":
            continue  # the package imports everything it re-exports
        level, room = table[here]
        for line, target in _imports(ast.parse(path.read_text())):
            there = _top(target)
            if there == "__init__":
                wrong.append(f"{rel}.py:{line} imports the colfunc package itself")
                continue
            t_level, t_room = table[there]
            if t_level > level or (t_level == level and t_room != room):
                wrong.append(
                    f"{rel}.py:{line} ({here}: level {level}, {room}) imports {target} "
                    f"({there}: level {t_level}, {t_room})"
                )
    assert not wrong, "imports against the layers:\n" + "\n".join(wrong)


def test_the_checker_sees_imports_inside_functions() -> None:
    code = "def f():\n    from colfunc import train\n\nif TYPE_CHECKING:\n    import colfunc.cli\n"
    assert _imports(ast.parse(code)) == [(2, "colfunc.train")]
