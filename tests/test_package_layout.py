"""The package reads as its map says: every module is on the module map (the package
docstring and the README's table), ``tinyserve`` never imports ``bench``, no function in it
passes 80 lines, and every assignment has its ``test_<assignment>_exercise.py``.

``python tests/test_package_layout.py [FOLDER ...]`` lists the longest functions of each folder
(default: tinyserve and autograder)."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import tinyserve

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "tinyserve"


def modules() -> list[str]:
    """Every module of the package as the map names it: ``engine``, ``serving/``, ``server``."""
    names = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE)
        if rel.name == "__init__.py":
            if len(rel.parts) > 1:
                names.append(f"{rel.parts[0]}/")
        else:
            names.append(rel.stem)
    return names


def test_every_module_is_on_the_package_docstring_map() -> None:
    doc = tinyserve.__doc__ or ""
    missing = [m for m in modules() if not re.search(rf"(?<![\w/]){re.escape(m)}(?![\w/])", doc)]
    assert not missing, f"tinyserve/__init__.py's module map misses {missing}: add a line for each"


def test_every_module_is_on_the_readme_layout_table() -> None:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("### The `tinyserve` package", 1)[1].split("\n## ", 1)[0]
    missing = [m for m in modules() if f"`{m}`" not in section]
    assert not missing, f"the README's module table misses {missing}: add them to a row"


def bench_imports() -> list[str]:
    """``file:line`` of every import of ``bench`` in the package, outside the CLI's bench
    command (the one front door that runs the suites; no library module may need them)."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text())
        allowed: set[int] = set()
        if path.name == "__main__.py" and len(path.relative_to(PACKAGE).parts) == 1:
            for node in ast.walk(tree):
                if isinstance(node, ast.FunctionDef) and node.name in CLI_BENCH_FUNCTIONS:
                    allowed |= {n.lineno for n in ast.walk(node) if hasattr(n, "lineno")}
        for node in ast.walk(tree):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0
                     else [])
            if any(n == "bench" or n.startswith("bench.") for n in names) \
                    and node.lineno not in allowed:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return found


#: The CLI's ``bench`` command: the only code in ``tinyserve`` that may import ``bench``.
CLI_BENCH_FUNCTIONS = {"_cmd_bench", "add_bench_parser"}


def test_tinyserve_never_imports_bench() -> None:
    found = bench_imports()
    assert not found, (f"tinyserve imports bench at {found}: bench depends on tinyserve, never "
                       f"the reverse; move what tinyserve needs into tinyserve")


#: A function longer than this holds more than one idea (the house style's limit).
MAX_FUNCTION_LINES = 80


def function_lengths(folder: Path, base: Path = ROOT) -> list[tuple[int, str]]:
    """``(lines, "path:line name")`` of every function and method under ``folder`` (paths
    relative to ``base``), longest first."""
    found = []
    for path in sorted(folder.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                found.append((lines, f"{path.relative_to(base)}:{node.lineno} {node.name}"))
    return sorted(found, reverse=True)


def test_no_function_in_tinyserve_passes_80_lines() -> None:
    long = [f"{where} ({n} lines)" for n, where in function_lengths(PACKAGE)
            if n > MAX_FUNCTION_LINES]
    assert not long, f"split these along their own comments: {long}"


def test_function_lengths_are_counted_from_the_source(tmp_path: Path) -> None:
    body = "\n".join(f"    x{i} = {i}" for i in range(81))
    (tmp_path / "m.py").write_text(f"def short():\n    pass\n\n\ndef long():\n{body}\n")
    assert function_lengths(tmp_path, tmp_path) == [(82, "m.py:5 long"), (2, "m.py:1 short")]


def test_every_assignment_has_its_exercise_test() -> None:
    assignments = sorted(p.name for p in (ROOT / "solutions").iterdir() if p.is_dir()
                         and any(p.glob("*.ipynb")))
    missing = [a for a in assignments if not (ROOT / "tests" / f"test_{a}_exercise.py").exists()]
    assert assignments and not missing, f"name each assignment's tests test_<assignment>_exercise.py: {missing}"


if __name__ == "__main__":
    import sys
    for folder in sys.argv[1:] or ["tinyserve", "autograder"]:
        print(f"{folder}: the longest functions (limit {MAX_FUNCTION_LINES} lines)")
        for n, where in function_lengths(ROOT / folder)[:10]:
            print(f"  {n:4d}  {where}")
