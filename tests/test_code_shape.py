"""The code's shape, kept: no function in the planner, the shared core or the worker runtime runs
over 60 lines without a written reason (complexity over 15 is ruff's C901, pyproject.toml), and
nothing imports inside a function but a heavy optional dependency that says so."""

from __future__ import annotations

import ast
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAX_LINES = 60
# A function over MAX_LINES carries "# long: <why>" on its def line (or the line before it).
REASON = re.compile(r"#\s*long:\s*\S")
# What a function may import inside its body: optional or heavy dependencies, each with a comment
# on the import line (or the line before it) that says so.
OPTIONAL = ("matplotlib", "moto", "werkzeug", "optuna", "torch.utils.tensorboard")


def _modules(*folders: str) -> list[str]:
    out = []
    for folder in folders:
        for d, _, files in os.walk(os.path.join(ROOT, folder)):
            out += [os.path.join(d, f) for f in files if f.endswith(".py")]
    return sorted(out)


def _functions(path: str) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    with open(path) as f:
        tree = ast.parse(f.read())
    return [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def _first_line(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    return min([fn.lineno] + [d.lineno for d in fn.decorator_list])


def test_no_long_function_without_a_reason() -> None:
    long = []
    for path in _modules("planner", "lambdas", "core"):
        with open(path) as f:
            lines = f.read().splitlines()
        for fn in _functions(path):
            span = fn.end_lineno - fn.lineno + 1  # type: ignore[operator]
            head = lines[_first_line(fn) - 2 : fn.lineno]
            if span > MAX_LINES and not any(REASON.search(line) for line in head):
                long.append(f"{os.path.relpath(path, ROOT)}:{fn.lineno} {fn.name} ({span} lines)")
    assert not long, "functions over 60 lines: cut them along their cases, or say why on the def line (# long: ...):\n" + "\n".join(long)


def test_function_level_imports_are_optional_dependencies_that_say_so() -> None:
    found = []
    for path in _modules("sdk", "planner", "lambdas", "core"):
        rel = os.path.relpath(path, ROOT)
        with open(path) as f:
            lines = f.read().splitlines()
        for fn in _functions(path):
            imports = [n for n in ast.walk(fn) if isinstance(n, (ast.Import, ast.ImportFrom))]
            for node in imports:
                name = node.module if isinstance(node, ast.ImportFrom) else node.names[0].name
                # a comment on the function's first import (or the line before it) covers the rest
                first = min(n.lineno for n in imports)
                commented = any("#" in line for line in lines[first - 2 : node.lineno])
                if not (name or "").startswith(OPTIONAL) or not commented:
                    found.append(f"{rel}:{node.lineno} {fn.name} imports {name}")
    assert not found, "import at the top of the module, or (a heavy optional dependency) say so in a comment:\n" + "\n".join(found)


def test_no_two_test_modules_share_a_name() -> None:
    """pytest imports test modules by their basename (rootdir import mode, no __init__.py): two
    files of one name in different folders stop the whole run at collection."""
    seen: dict[str, str] = {}
    clashes = []
    for folder, _, files in os.walk(os.path.join(ROOT, "tests")):
        for name in files:
            if name.startswith("test_") and name.endswith(".py"):
                path = os.path.relpath(os.path.join(folder, name), ROOT)
                if name in seen:
                    clashes.append((seen[name], path))
                seen.setdefault(name, path)
    assert not clashes, f"test modules of the same name (rename one): {clashes}"
