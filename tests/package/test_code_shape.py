"""The package stays readable in pieces: no module over 600 lines, no function over 80.

Issue #19 item 7 (``/work/shared/CONVENTIONS.md``: "keep them under ~600 lines"). A module
is measured in lines of its file; a function (or method) from its ``def`` line to its last
line, docstring included, decorators not. A split must follow the concepts (a module per
concept, a function per named step), not cut at the limit.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "slurm_elastic"
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 80


def _modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def _functions(tree: ast.AST, prefix: str = "") -> Iterator[tuple[str, int, int]]:
    """``(qualified name, first line, lines)`` of every function, nested ones included."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            name = f"{prefix}{node.name}"
            assert node.end_lineno is not None
            yield name, node.lineno, node.end_lineno - node.lineno + 1
            yield from _functions(node, f"{name}.")
        elif isinstance(node, ast.ClassDef):
            yield from _functions(node, f"{prefix}{node.name}.")
        else:
            yield from _functions(node, prefix)


def _long_functions(source: str, where: str) -> list[str]:
    return [
        f"{where}:{line} {name}: {length} lines"
        for name, line, length in _functions(ast.parse(source))
        if length > MAX_FUNCTION_LINES
    ]


def test_the_package_is_found() -> None:
    assert (PACKAGE / "__init__.py").is_file()
    assert len(_modules()) > 50


def test_no_module_is_over_600_lines() -> None:
    long = [
        f"{path.relative_to(PACKAGE.parent)}: {n} lines"
        for path in _modules()
        if (n := len(path.read_text(encoding="utf-8").splitlines())) > MAX_MODULE_LINES
    ]
    assert not long, f"modules over {MAX_MODULE_LINES} lines (split them by concept): " + "; ".join(
        long
    )


def test_no_function_is_over_80_lines() -> None:
    long = [
        entry
        for path in _modules()
        for entry in _long_functions(
            path.read_text(encoding="utf-8"), str(path.relative_to(PACKAGE.parent))
        )
    ]
    assert not long, (
        f"functions over {MAX_FUNCTION_LINES} lines (split them into named steps): "
        + "; ".join(long)
    )


def test_the_check_names_a_long_method_with_its_class_and_line() -> None:
    body = "\n".join(f"        x = {i}" for i in range(MAX_FUNCTION_LINES))
    source = (
        f'class Agent:\n    def run(self):\n        """Run."""\n{body}\n\ndef short():\n    pass\n'
    )
    assert _long_functions(source, "m.py") == [f"m.py:2 Agent.run: {MAX_FUNCTION_LINES + 2} lines"]
