"""Autograde: run workers in parallel, and record every result from one coordinator.

Each submission is graded by its own worker process (``autograder.pipeline.worker``) with a hard
wall-clock limit; at most ``workers`` run at once. Only this coordinator opens the gradebook,
and it writes each result as it arrives, so no two writers ever race and a crash part-way
keeps every grade recorded so far. The gradebook is backed up before every run.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from autograder.pipeline.course import Course, CourseError, ensure_in_gradebook, safe_name, write_json
from autograder.runner.sandbox import sandbox_available
from autograder.pipeline.worker import Job

KEEP_BACKUPS = 30
# The worker enforces the notebook time limit itself; the coordinator's backstop kills it this
# long after that limit (start-up, several notebooks, writing the result).
BACKSTOP_GRACE_S = 120
# The worker runs the tests (trusted side) as the kernel runs the answers: on the CPU, one
# thread each, so references and answers are computed alike and workers do not oversubscribe.
WORKER_ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TINYSERVE_DEVICE": "cpu"}


def backup_gradebook(course: Course) -> Path | None:
    """Copy the gradebook (consistently, via SQLite's backup API) into grading/backups/."""
    if not course.gradebook_path.exists():
        return None
    course.backups.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    target = course.backups / f"gradebook-{stamp}-{os.getpid()}.db"
    src = sqlite3.connect(course.gradebook_path)
    dst = sqlite3.connect(target)
    with dst:
        src.backup(dst)
    src.close()
    dst.close()
    for old in sorted(course.backups.glob("gradebook-*.db"))[:-KEEP_BACKUPS]:
        old.unlink()
    return target


def submitted_students(course: Course, assignment: str) -> list[str]:
    if not course.submitted.is_dir():
        return []
    return sorted(p.name for p in course.submitted.iterdir()
                  if (p / assignment).is_dir() and safe_name(p.name))


def autograde(course: Course, assignment: str, *, students: list[str] | None = None,
              workers: int | None = None, unsafe: bool = False, cell_timeout: float = 60,
              total_timeout: float = 600, limits: dict | None = None,
              progress: bool = True, record: bool = True,
              tests_in: str = "trusted", stop_at_failure: bool = False) -> list[dict]:
    """Grade every collected submission of ``assignment``; return the result records.

    ``stop_at_failure`` ends each run at its first failed test (later cells "not run"):
    only for the mutants tool, which needs to know whether a mutant loses marks, not how many.

    ``tests_in="kernel"`` runs the test cells in the student's kernel, the design this
    grader replaced; only the tests use it, to show which attacks that design fell for.
    """
    course.check_assignment(assignment)
    if not unsafe:
        ok, why = sandbox_available()
        if not ok:
            raise CourseError(f"refusing to run untrusted submissions without a sandbox: {why}. "
                              "Pass --unsafe to grade without isolation (trusted code only).")
    if not (course.release / assignment).is_dir():
        raise CourseError(f"{assignment} has not been released; run `python -m autograder "
                          f"release {assignment}` first")
    students = students if students is not None else submitted_students(course, assignment)
    if not students:
        raise CourseError(f"no submissions collected for {assignment} in {course.submitted}")
    workers = max(1, workers or os.cpu_count() or 1)
    jobs = [Job(root=str(course.root), assignment=assignment, student=s,
                unsafe=unsafe, cell_timeout=cell_timeout, total_timeout=total_timeout,
                tests_in=tests_in, stop_at_failure=stop_at_failure,
                **({"limits": limits} if limits else {})) for s in students]
    with coordinator_lock(course):
        if record:
            ensure_in_gradebook(course, assignment)
            backup_gradebook(course)
        return run_jobs(jobs, workers, progress=progress,
                        on_result=(lambda r: record_result(course, r)) if record else None)


@contextlib.contextmanager
def coordinator_lock(course: Course):
    """One autograde per course at a time: a second would be a second gradebook writer."""
    course.work.mkdir(parents=True, exist_ok=True)
    with open(course.work / ".autograde.lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise CourseError("another autograde is running on this course; wait for it "
                              "to finish (grading/.autograde.lock)") from None
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def run_jobs(jobs: list[Job], workers: int, *, progress: bool = True,
             on_result=None) -> list[dict]:
    """Run worker processes, ``workers`` at a time; call ``on_result`` as each finishes."""
    from tqdm import tqdm

    tmp = Path(tempfile.mkdtemp(prefix="autograde-"))
    pending = list(enumerate(jobs))
    running: dict[int, tuple[subprocess.Popen, Job, Path, float, int]] = {}
    free_slots = list(range(workers))
    results: list[dict | None] = [None] * len(jobs)
    bar = tqdm(total=len(jobs), desc="autograde", unit="sub", disable=not progress,
               file=sys.stderr)
    try:
        while pending or running:
            while pending and free_slots:
                i, job = pending.pop(0)
                job.slot = free_slots.pop(0)
                job_path, out_path = tmp / f"{i}.job.json", tmp / f"{i}.result.json"
                job_path.write_text(json.dumps(asdict(job)))
                proc = subprocess.Popen(
                    worker_command(job_path, out_path),
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                    start_new_session=True, env=WORKER_ENV)
                deadline = time.monotonic() + job.total_timeout + BACKSTOP_GRACE_S
                running[i] = (proc, job, out_path, deadline, job.slot)
            time.sleep(0.05)
            for i, (proc, job, out_path, deadline, slot) in list(running.items()):
                if proc.poll() is None and time.monotonic() < deadline:
                    continue
                stopped = proc.poll() is None
                if stopped:
                    _kill_group(proc)
                result = _read_result(out_path, job, proc, stopped)
                results[i] = result
                del running[i]
                free_slots.append(slot)
                if on_result is not None:
                    on_result(result)
                bar.update(1)
                bar.set_postfix_str(f"{job.student}: {result['status']}")
    finally:
        for proc, *_ in running.values():
            _kill_group(proc)
        bar.close()
        shutil.rmtree(tmp, ignore_errors=True)
    return [r for r in results if r is not None]


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, 9)
    except OSError:
        pass
    proc.wait()


def worker_command(job_path: Path, out_path: Path) -> list[str]:
    return [sys.executable, "-m", "autograder.pipeline.worker", str(job_path), str(out_path)]


def _read_result(path: Path, job: Job, proc: subprocess.Popen, stopped: bool = False) -> dict:
    """The worker's record, or, when it left none, a failed one saying what happened (the
    feedback page and the grades show it: report.feedback writes a page for it too)."""
    if not stopped:
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            pass
    return {"student": job.student, "assignment": job.assignment, "status": "failed",
            "score": 0.0, "max_score": 0.0, "flags": [], "notebooks": {},
            "reasons": [_why_no_result(job, proc.returncode, stopped)]}


def _why_no_result(job: Job, code: int | None, stopped: bool) -> str:
    """Why a worker left no result, for the student and the instructor."""
    import signal
    again = ("the submission was not graded; your instructor can grade it again "
             f"(`python -m autograder autograde {job.assignment} --student {job.student}`)")
    if stopped:
        limit = job.total_timeout + BACKSTOP_GRACE_S
        return (f"grading was stopped after {limit:g} s by the grader's backstop (the limit "
                f"per notebook is {job.total_timeout:g} s): {again}")
    if code is not None and code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        hint = {"SIGKILL": " (out of memory?)", "SIGXCPU": " (its CPU time limit)"}.get(name, "")
        return f"the grader process was killed by {name}{hint} without a result: {again}"
    return f"the grader process stopped without a result (exit code {code}): {again}"


def record_result(course: Course, result: dict) -> None:
    """Write one result to the gradebook and to grading/results/ (coordinator only)."""
    import warnings

    from nbgrader.api import Gradebook, MissingEntry

    student, assignment = result["student"], result["assignment"]
    with warnings.catch_warnings(), Gradebook(course.db_url) as gb:
        warnings.simplefilter("ignore")  # nbgrader's own SQLAlchemy session warnings
        gb.update_or_create_student(student)
        try:
            gb.find_submission(assignment, student)
        except MissingEntry:
            gb.add_submission(assignment, student)
        for nb_name in course.notebooks(assignment):
            nb_result = result.get("notebooks", {}).get(nb_name, {})
            by_id = {t["grade_id"]: t for t in nb_result.get("tests", [])}
            sub_nb = gb.find_submission_notebook(nb_name, assignment, student)
            for grade in sub_nb.grades:
                t = by_id.get(grade.name)
                # Auto scores are replaced on every run; manual scores a person entered stay.
                if t is None or t["kind"] == "manual":
                    grade.auto_score = None if t and t["needs_manual_grade"] else 0.0
                    grade.needs_manual_grade = bool(t and t["needs_manual_grade"]
                                                    and grade.manual_score is None)
                else:
                    grade.auto_score = t["points"]
                    grade.needs_manual_grade = False
            sub_nb.flagged = result["status"] == "flagged"
        gb.db.commit()
    write_json(course.results / assignment / f"{student}.json", result)


def load_results(course: Course, assignment: str) -> dict[str, dict]:
    folder = course.results / assignment
    if not folder.is_dir():
        return {}
    out = {}
    for path in sorted(folder.glob("*.json")):
        try:
            out[path.stem] = json.loads(path.read_text())
        except ValueError:
            continue
    return out
