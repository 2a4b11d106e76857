"""The package reads as its map says: every module is on the module map (the package
docstring and the README's table)."""
from __future__ import annotations

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

