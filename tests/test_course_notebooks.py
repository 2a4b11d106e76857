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

from tinyserve.workbook.predict import Prediction

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
    # Run headless, nobody commits a guess: every measurement's comparison must say so, and
    # must not reveal a guess-versus-answer verdict that no learner asked for.
    for cell in nb.cells:
        if cell.cell_type == "code" and ".record(" in cell.source:
            text = "".join(o.get("text", "") for o in cell.outputs if o.output_type == "stream")
            assert Prediction.NO_GUESS in text, f"{path.name}: {cell.source!r} printed {text!r}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_predicts_before_measuring(path: Path) -> None:
    """Each chapter asks for a committed guess in a cell shown with .ui(): a Prediction, whose
    measurement cell below calls .record(measured), or one of the workbook's labs (KVCacheLab,
    RooflineLab), whose answer is computed; each hides its answer until a guess is committed
    (tests/test_workbook_lab.py and the labs' own tests)."""
    code = [c.source for c in nbformat.read(path, as_version=4).cells if c.cell_type == "code"]
    predictions = [i for i, s in enumerate(code) if "Prediction(" in s and ".ui()" in s]
    labs = [i for i, s in enumerate(code) if "Lab(" in s and ".ui()" in s]
    assert predictions or labs, f"{path.name}: no predict-first cell (a Prediction or a lab's .ui())"
    if predictions:
        recorded = [i for i, s in enumerate(code) if ".record(" in s]
        assert recorded and min(recorded) > min(predictions), \
            f"{path.name}: the measurement must come after the guess and call .record(measured)"
