"""Checks every graded exercise's tests share: notebook helpers (nbgrader metadata, running a
notebook in a kernel, the errors of its test cells), the source's points and answer cells,
the blank release, the classic mistakes run against the real test cells, and the sandboxed
end-to-end grading.

Each tests/test_<exercise>.py keeps its own test functions, data (points, mistakes, probes)
and exercise-specific assertions, and calls these for the parts that are the same.
"""
from __future__ import annotations

import atexit
import json
import shutil
import tempfile
from pathlib import Path
from typing import Sequence

import nbformat
import pytest
from nbclient import NotebookClient

from conftest import sandbox_skip_reason

ROOT = Path(__file__).resolve().parents[1]
MARKERS = ("BEGIN SOLUTION", "END SOLUTION", "BEGIN HIDDEN TESTS", "END HIDDEN TESTS")

# The end-to-end runs need the grading sandbox (the same rule as test_grading_pipeline).
needs_sandbox = pytest.mark.skipif(sandbox_skip_reason() is not None,
                                   reason=str(sandbox_skip_reason()))


# ------------------------------------------------------------------ notebook helpers

def meta(cell) -> dict:
    """The cell's nbgrader metadata ({} for a plain cell)."""
    return cell.metadata.get("nbgrader", {})


def is_test(cell) -> bool:
    """An autograded test cell: graded, and not an answer."""
    return bool(meta(cell).get("grade")) and not meta(cell).get("solution")


def execute(nb, workdir: Path, allow_errors: bool):
    """Run every cell of `nb` in a fresh python3 kernel started in `workdir`; returns `nb`."""
    client = NotebookClient(nb, timeout=60, kernel_name="python3", allow_errors=allow_errors,
                            resources={"metadata": {"path": str(workdir)}})
    client.execute()
    return nb


def execute_trusted(nb, workdir: Path):
    """Run `nb` as grading runs it (autograder.pipeline.worker.grading_plan: test cells on the trusted
    side, reaching the kernel's answers over the channel; read-only cells on both sides), in
    a fresh python3 kernel without the sandbox; returns `nb` with the test cells' outputs."""
    import subprocess

    from jupyter_client import AsyncKernelManager

    import torch

    from autograder.runner.execute import run_notebook
    from autograder.pipeline.worker import grading_plan
    # The trusted side computes the references in this process: one torch thread, as in a
    # grading worker (autograder.pipeline.grade.WORKER_ENV); two beside a busy kernel oversubscribe.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        run_notebook(nb, AsyncKernelManager(kernel_name="python3"), cwd=str(workdir),
                     plan=grading_plan(nb), cell_timeout=600, total_timeout=3600,
                     kernel_output=subprocess.DEVNULL)
    finally:
        torch.set_num_threads(threads)
    return nb


# The kernel in which run_probe ran the whole solution, kept for check_named_mistakes: it would
# otherwise start a kernel and run the solution's code again before its first wrong answer.
# One per source folder; shut down by check_named_mistakes or at the end of the module (the
# `source` fixture), so no kernel outlives the test file that started it.
_SOLUTION_KERNELS: dict[Path, NotebookClient] = {}


def _execute_keeping_kernel(nb, workdir: Path) -> NotebookClient:
    """`execute` (every check must pass), leaving the kernel running; returns its client."""
    client = NotebookClient(nb, timeout=60, kernel_name="python3", allow_errors=False,
                            resources={"metadata": {"path": str(workdir)}})
    try:
        client.execute(cleanup_kc=False)
    except BaseException:
        _shutdown(client)
        raise
    return client


def _shutdown(client: NotebookClient) -> None:
    from jupyter_core.utils import run_sync
    if client.km is not None:
        if run_sync(client.km.is_alive)():
            run_sync(client.km.shutdown_kernel)(now=False)
        run_sync(client.km.cleanup_resources)()
    if client.kc is not None:
        client.kc.stop_channels()


def shutdown_solution_kernel(source_dir: Path) -> None:
    client = _SOLUTION_KERNELS.pop(Path(source_dir), None)
    if client is not None:
        _shutdown(client)


def errors(nb) -> dict[str, dict]:
    """grade_id -> the error output of every test cell that raised."""
    found = {}
    for cell in nb.cells:
        if cell.cell_type == "code" and is_test(cell):
            for out in cell.get("outputs", []):
                if out.get("output_type") == "error":
                    found[meta(cell)["grade_id"]] = out
    return found


def graded_points(name: str, answers: dict[str, str], points: dict[str, int]) -> dict[str, int]:
    """Assignment ``name`` with ``answers`` in its solution cells, run on the grader's side:
    each test's points, 0 for a test cell that raised."""
    source_dir, path, _ = exercise_paths(name)
    nb = execute_trusted(with_answers(nbformat.read(path, as_version=4), answers), source_dir)
    failed = errors(nb)
    return {gid: 0 if gid in failed else pts for gid, pts in points.items()}


def copy_notebook(nb):
    """A deep copy, so running it leaves the module-scoped source untouched."""
    return nbformat.from_dict(json.loads(json.dumps(nb)))


def with_answers(nb, answers: dict[str, str]):
    """A copy of ``nb`` whose answer cells named in ``answers`` (grade_id -> source) hold
    that source instead: a submission made of the solution and a few other answers."""
    out = copy_notebook(nb)
    for cell in out.cells:
        if meta(cell).get("grade_id") in answers:
            cell.source = answers[meta(cell)["grade_id"]]
    return out


def with_source_tests(nb, source):
    """Put the source's test cells (hidden tests included) back by grade_id, as autograde does."""
    tests = {meta(c)["grade_id"]: c.source for c in source.cells if is_test(c)}
    for cell in nb.cells:
        if is_test(cell):
            cell.source = tests[meta(cell)["grade_id"]]
    return nb


# ------------------------------------------------------------------ the source notebook

def exercise_paths(name: str) -> tuple[Path, Path, Path]:
    """(source folder, source notebook, released notebook) of the assignment `name`."""
    source_dir = ROOT / "solutions" / name
    return source_dir, source_dir / f"{name}.ipynb", ROOT / "exercises" / name / f"{name}.ipynb"


def source_fixture(path: Path):
    """A module-scoped fixture named `source`: the source notebook at `path`, read once per
    test file (assign it to a module-level name so pytest finds it)."""
    @pytest.fixture(scope="module", name="source")
    def _source():
        yield nbformat.read(path, as_version=4)
        shutdown_solution_kernel(path.parent)   # run_probe's, if check_named_mistakes did not
    return _source


def check_rubrics_above_answers(source) -> None:
    """A manually graded answer cell holds the answer only; its rubric sits in the cell above,
    inside a mark-scheme region (### BEGIN/END MARK SCHEME), which release cuts."""
    for i, cell in enumerate(source.cells):
        m = meta(cell)
        if m and m["solution"] and m["grade"]:
            assert "Rubric" not in cell.source, f"{m['grade_id']}: the rubric sits above the answer"
            above = source.cells[i - 1].source
            if "Rubric" in above:
                start, end = above.index("### BEGIN MARK SCHEME"), above.index("### END MARK SCHEME")
                assert start < above.index("*Rubric (") < end, \
                    f"{m['grade_id']}: the rubric must sit inside a mark-scheme region"


def check_points_and_answers(source, test_points: dict[str, int], manual_points: dict[str, int],
                             answer_cells: set[str]) -> tuple[dict[str, int], dict[str, int]]:
    """The source's test cells, manual cells and answer cells are exactly the listed ones, with
    the listed points; returns the (test, manual) points found, for the totals' checks."""
    tests = {meta(c)["grade_id"]: meta(c)["points"] for c in source.cells if is_test(c)}
    manual = {meta(c)["grade_id"]: meta(c)["points"] for c in source.cells
              if meta(c).get("grade") and meta(c).get("solution")}
    assert tests == test_points and manual == manual_points
    answers = {meta(c)["grade_id"] for c in source.cells
               if meta(c).get("solution") and not meta(c).get("grade")}
    assert answers == answer_cells
    return tests, manual


def run_probe(source, source_dir: Path, probe: str) -> dict:
    """Run the whole solution (every check must pass) then `probe`, a cell that prints
    "PROBE " and a JSON object; returns that object."""
    nb = copy_notebook(source)
    nb.cells.append(nbformat.v4.new_code_cell(probe))
    shutdown_solution_kernel(source_dir)
    # Any failing check raises; the kernel stays for check_named_mistakes.
    _SOLUTION_KERNELS[Path(source_dir)] = _execute_keeping_kernel(nb, source_dir)
    text = "".join(o.get("text", "") for o in nb.cells[-1].outputs)
    return json.loads(text.split("PROBE ", 1)[1])


# ------------------------------------------------------------------ the blank release

def run_blank_release(released: Path, source, source_dir: Path) -> tuple[object, dict[str, str]]:
    """Check the released copy leaks no solution or hidden-test marker, run it with the source's
    test cells put back (as autograde does); returns the run notebook and grade_id -> error name
    of every test cell that raised."""
    text = released.read_text()
    for marker in MARKERS:
        assert marker not in text
    nb = with_source_tests(nbformat.read(released, as_version=4), source)
    execute(nb, source_dir, allow_errors=True)
    return nb, {gid: out["ename"] for gid, out in errors(nb).items()}


def check_manual_answers_blank(nb, manual_points: dict[str, int]) -> None:
    """Every manually graded answer of the release holds nbgrader's placeholder only."""
    manual = [c for c in nb.cells if meta(c).get("grade_id") in manual_points]
    assert [c.source.strip() for c in manual] == ["YOUR ANSWER HERE"] * len(manual_points)


# ------------------------------------------------------------------ the classic mistakes, named

def check_named_mistakes(source, source_dir: Path, answer_cells: set[str],
                         mistakes: Sequence[tuple], graded_cells_only: bool = False,
                         trusted: bool = False) -> None:
    """Run each wrong answer against the real test cell (hidden tests included), all in one
    kernel, and check that cell raised with a message containing the fragment.

    `mistakes` holds (test grade_id, wrong code, fragment) or (..., error name) where the error
    is not an AssertionError. The solution's non-test code cells run first and every answer
    cell runs again before each wrong answer, so each mistake is the only thing wrong in its
    cell. `graded_cells_only` leaves out the code cells without nbgrader metadata (the
    learner's own plain cells, such as a plot). `trusted` runs it as grading does
    (execute_trusted): the read-only cells keep their metadata, so they run on both sides.

    Otherwise, after run_probe, its kernel (which ran the whole solution, every check passing)
    is used instead of a fresh one running the solution's code again; either way each wrong
    answer runs after every answer cell was run again, and the kernel is shut down at the end."""
    by_id = {meta(c)["grade_id"]: c for c in source.cells if meta(c)}
    if trusted:       # grading's plan needs its own kernel: the warm one is not used
        shutdown_solution_kernel(source_dir)
    warm = None if trusted else _SOLUTION_KERNELS.pop(Path(source_dir), None)
    nb = nbformat.v4.new_notebook()

    def read_only(c) -> bool:
        return trusted and meta(c).get("locked") and not meta(c).get("solution")
    nb.cells = [] if warm else [
        nbformat.v4.new_code_cell(c.source, metadata=c.metadata if read_only(c) else {})
        for c in source.cells
        if c.cell_type == "code" and (meta(c) or not graded_cells_only) and not is_test(c)]
    answers = [c.source for c in source.cells
               if c.cell_type == "code" and meta(c).get("grade_id") in answer_cells]
    wanted = []
    for test_id, wrong, fragment, *ename in mistakes:
        nb.cells.extend(nbformat.v4.new_code_cell(text) for text in (*answers, wrong))
        cell_id = f"{test_id}_{len(wanted)}"
        test_cell = nbformat.v4.new_code_cell(by_id[test_id].source)
        test_cell.metadata = {"nbgrader": dict(meta(by_id[test_id]), grade_id=cell_id)}
        nb.cells.append(test_cell)
        wanted.append((cell_id, fragment, ename[0] if ename else "AssertionError"))
    if trusted:
        execute_trusted(nb, source_dir)
    elif warm is None:
        execute(nb, source_dir, allow_errors=True)
    else:
        client = NotebookClient(nb, timeout=60, kernel_name="python3", allow_errors=True,
                                km=warm.km, resources={"metadata": {"path": str(source_dir)}})
        try:
            client.execute()
        finally:
            if client.kc is not None:
                client.kc.stop_channels()
            _shutdown(warm)
    found = errors(nb)
    for cell_id, fragment, ename in wanted:
        assert cell_id in found, f"{cell_id}: the wrong answer passed"
        assert found[cell_id]["ename"] == ename, (cell_id, found[cell_id])
        assert fragment in found[cell_id]["evalue"], (cell_id, found[cell_id]["evalue"])


# ------------------------------------------------------------------ end to end, sandboxed

_RELEASES: dict[str, tuple[Path, Path]] = {}
_RELEASE_DIR: list[Path] = []


def fresh_release(name: str) -> tuple[Path, Path]:
    """(release folder, gradebook) of a fresh release of `name` from this checkout's course,
    made once per session: test_autograder_release compares it with the committed exercises/
    and check_sandboxed_grading grades against it (nbgrader's generate_assignment takes
    seconds per assignment). Read-only for its users; removed when the session ends."""
    from autograder.pipeline.course import Course, release
    if name not in _RELEASES:
        if not _RELEASE_DIR:
            _RELEASE_DIR.append(Path(tempfile.mkdtemp(prefix="fresh-releases-")))
            atexit.register(shutil.rmtree, _RELEASE_DIR[0], ignore_errors=True)
        folder = _RELEASE_DIR[0] / name
        folder.mkdir()
        gradebook = folder / "gradebook.db"
        out = release(Course(ROOT), name, out_dir=folder / "release", db_url=f"sqlite:///{gradebook}")
        _RELEASES[name] = (out, gradebook)
    return _RELEASES[name]

def check_sandboxed_grading(name: str, source_dir: Path, test_points: dict[str, int],
                            manual_points: dict[str, int], tmp_path: Path,
                            forged: dict[str, tuple] | None = None) -> None:
    """A fresh course holding the assignment's source and a fresh release of it (with the
    gradebook that release recorded), submit the solution and the blank release, autograde
    both in the sandbox: the solution gets every test cell's points, the blank release none,
    and both are graded out of all points (test and manual). ``forged``: more submissions
    graded in the same batch, {who: (notebook, {test cell: points it must get})}."""
    from autograder.pipeline.course import Course
    from autograder.pipeline.grade import autograde
    course = Course(tmp_path)
    shutil.copytree(source_dir, course.source / name)
    released, gradebook = fresh_release(name)
    shutil.copytree(released, course.release / name)
    course.gradebook_path.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(gradebook, course.gradebook_path)
    for who, notebook in (("solution", source_dir / f"{name}.ipynb"),
                          ("blank", course.release / name / f"{name}.ipynb")):
        dest = course.submitted / who / name
        dest.mkdir(parents=True)
        shutil.copy(notebook, dest / f"{name}.ipynb")
    for who, (notebook, _) in (forged or {}).items():
        dest = course.submitted / who / name
        dest.mkdir(parents=True)
        nbformat.write(notebook, dest / f"{name}.ipynb")
    results = {r["student"]: r for r in autograde(course, name, workers=2, progress=False)}
    for who, (_, points) in (forged or {}).items():
        tests = {t["grade_id"]: t for t in results[who]["notebooks"][name]["tests"]}
        got = {gid: tests[gid]["points"] for gid in points}
        assert got == points, (who, {gid: tests[gid]["message"] for gid in points})
    for who, score in (("solution", sum(test_points.values())), ("blank", 0)):
        r = results[who]
        detail = json.dumps({k: r[k] for k in ("status", "score", "reasons", "flags", "notebooks")})
        assert r["status"] == "graded" and r["score"] == score, detail
        assert r["max_score"] == sum(test_points.values()) + sum(manual_points.values()), detail
        tests = {t["grade_id"]: t for t in r["notebooks"][name]["tests"]}
        assert set(test_points) <= set(tests)
        for gid, points in test_points.items():
            assert tests[gid]["points"] == (points if who == "solution" else 0), (who, gid, tests[gid])
