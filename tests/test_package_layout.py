"""The package reads as its map says: every module is on the module map (the package
docstring and the README's table), and ``tinyserve`` never imports ``bench``."""
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
