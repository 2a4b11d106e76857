"""Every chapter notebook in course/ runs top to bottom in a fresh kernel and is committed clean.

Parametrised over ``course/*.ipynb``, so a new chapter is tested as soon as it exists. The
notebooks print timings, but nothing here checks a time: a chapter passes when every cell runs
without an error (within a generous per-cell timeout) and the committed file carries no outputs.
"""
from __future__ import annotations

import os
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

COURSE = Path(__file__).resolve().parents[1] / "course"
NOTEBOOKS = sorted(COURSE.glob("*.ipynb"))
CELL_TIMEOUT_S = 120


def test_the_course_has_chapters() -> None:
    names = [p.name for p in NOTEBOOKS]
    assert "00_request_lifecycle.ipynb" in names and "01_prefill_vs_decode.ipynb" in names, names


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_committed_without_outputs(path: Path) -> None:
    nb = nbformat.read(path, as_version=4)
    dirty = [i for i, cell in enumerate(nb.cells) if cell.cell_type == "code"
             and (cell.get("outputs") or cell.get("execution_count") is not None)]
    assert not dirty, (f"{path.name}: code cells {dirty} carry outputs or execution counts; "
                       f"clear them before committing (jupyter nbconvert --clear-output --inplace)")
    assert nb.metadata.get("kernelspec", {}).get("name") == "python3", \
        f"{path.name}: set the notebook's kernelspec to python3"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_runs_top_to_bottom(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The kernel inherits this environment: one thread keeps the chapter from fighting other
    # tests for the CPU (the notebooks report ratios, which hold at any thread count).
    monkeypatch.setenv("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", "1"))
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, timeout=CELL_TIMEOUT_S, kernel_name="python3",
                            resources={"metadata": {"path": str(COURSE)}})
    try:
        client.execute()
    except CellExecutionError as err:
        pytest.fail(f"{path.name} failed while running top to bottom:\n{err}")
    errors = [o for cell in nb.cells if cell.cell_type == "code"
              for o in cell.outputs if o.output_type == "error"]
    assert not errors, f"{path.name}: {errors[0].ename}: {errors[0].evalue}"
