"""Every graded source notebook in solutions/ follows the rules the grading pipeline and its
tamper defence rely on. New assignments are checked by being added, with no new test code."""
from __future__ import annotations

import re
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = sorted((ROOT / "solutions").glob("*/*.ipynb"))


def _meta(cell) -> dict:  # type: ignore[no-untyped-def]
    return cell.metadata.get("nbgrader", {})


def _is_test(cell) -> bool:  # type: ignore[no-untyped-def]
    return bool(_meta(cell).get("grade")) and not _meta(cell).get("solution")


def test_there_are_assignments() -> None:
    names = {p.parent.name for p in SOURCES}
    assert {"harbor_capacity", "kv_cache_basics"} <= names


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: p.parent.name)
def test_source_notebook_follows_the_grading_rules(path: Path) -> None:
    source = nbformat.read(path, as_version=4)
    ids = [_meta(c)["grade_id"] for c in source.cells if _meta(c)]
    assert len(ids) == len(set(ids)), "grade_ids must be unique"
    for cell in source.cells:
        assert cell.get("outputs", []) == [] and cell.get("execution_count") is None, \
            "source notebooks are committed without outputs"
        meta = _meta(cell)
        if not meta:
            continue
        gid = meta["grade_id"]
        assert meta["schema_version"] == 3 and re.fullmatch(r"[A-Za-z0-9_]+", gid), gid
        if meta["grade"]:
            assert meta.get("points", 0) > 0, f"{gid}: graded cells carry points"
        if _is_test(cell):
            assert cell.cell_type == "code" and meta["locked"], f"{gid}: test cells are locked code"
            assert not re.search(r"^\s*assert\b", cell.source, re.M), \
                f"{gid}: test cells use the testkit helpers, not bare assert"
            # Tensors are compared only through references captured in the locked first cell,
            # never through a function the submission could have patched.
            assert "torch.allclose" not in cell.source, gid
        if meta["solution"] and cell.cell_type == "code":
            assert cell.source.count("### BEGIN SOLUTION") == \
                cell.source.count("### END SOLUTION") >= 1, gid
        if "HIDDEN TESTS" in cell.source:
            assert _is_test(cell), f"{gid}: hidden tests only inside test cells"
        if meta["solution"] and meta["grade"]:
            assert cell.cell_type == "markdown", f"{gid}: written answers are markdown"
    first = next(c for c in source.cells if c.cell_type == "code")
    assert _meta(first).get("locked") and not _meta(first).get("grade"), \
        "the first code cell is locked and ungraded"
    assert "from autograder.testkit import" in first.source, \
        "the first code cell loads the test helpers before any submitted code runs"
