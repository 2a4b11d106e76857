"""Benchmark: parallel vs serial autograding of the same submissions, side by side.

    python -m autograder bench --json artifacts/grading_bench.json

Grades N copies of a correct submission of the mini assignment (tests/fixtures) three times,
in throwaway course folders: with one worker and with ``workers`` (default: CPU count), and
once more with one worker through the old design (test cells in the student's kernel, kept
for comparison), and reports the ratios (parallel speed-up; per-submission cost of the
trusted runner over the old design) with the raw timings, the machine and the git commit.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from pathlib import Path

from tinyserve.provenance import git_commit, machine_info

from autograder.pipeline.course import Course, CourseError, release
from autograder.pipeline.grade import autograde


def _mean(xs: list) -> float:
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else float("nan")


def bench(course: Course, out: Path, *, n: int = 30, workers: int | None = None,
          assignment: str | None = None) -> int:
    mini = course.root / "tests" / "fixtures" / "mini_assignment" / "mini"
    if assignment is None and not mini.is_dir():
        raise CourseError("bench needs tests/fixtures/mini_assignment or --assignment")
    workers = workers or os.cpu_count() or 2
    timings = {}
    name = assignment or "mini"
    with tempfile.TemporaryDirectory() as tmp:
        # One release (nbgrader takes seconds per release; it is not what is timed), copied
        # with its gradebook into each run's own course folder.
        released = Path(tmp) / "released"
        shutil.copytree(course.source / name if assignment else mini,
                        released / "solutions" / name)
        release(Course(released), name)
        runs = (("serial", 1, "trusted"), ("serial_tests_in_kernel", 1, "kernel"),
                ("parallel", workers, "trusted"))
        for label, w, tests_in in runs:
            root = Path(tmp) / label
            shutil.copytree(released, root, symlinks=True)
            c = Course(root)
            solved = root / "solutions" / name
            for i in range(n):
                dest = c.submitted / f"s{i:03d}" / name
                shutil.copytree(solved, dest)
            start = time.perf_counter()
            results = autograde(c, name, workers=w, progress=False, tests_in=tests_in)
            timings[label] = {"seconds": time.perf_counter() - start, "workers": w,
                              "tests_in": tests_in,
                              "statuses": sorted({r["status"] for r in results}),
                              "per_submission_s": [r.get("seconds") for r in results]}
    report = {
        "suite": "grading",
        "ratios": {"parallel_grading_speedup":
                   timings["serial"]["seconds"] / timings["parallel"]["seconds"],
                   "trusted_over_in_kernel_per_submission":
                   _mean(timings["serial"]["per_submission_s"])
                   / _mean(timings["serial_tests_in_kernel"]["per_submission_s"])},
        "timings": timings, "submissions": n, "machine": machine_info(),
        "git_commit": git_commit(course.root),
        "conditions": f"{n} copies of a solved {assignment or 'mini'} notebook, sandboxed; "
                      "serial = 1 worker, parallel = CPU count; per-submission cost = the "
                      "worker's own seconds per submission, trusted runner vs tests in the "
                      "kernel, both serial",
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    print(f"trusted_over_in_kernel_per_submission = "
          f"{report['ratios']['trusted_over_in_kernel_per_submission']:.2f}")
    print(f"parallel_grading_speedup = {report['ratios']['parallel_grading_speedup']:.2f} "
          f"({timings['serial']['seconds']:.1f} s serial, {timings['parallel']['seconds']:.1f} s "
          f"with {workers} workers) -> {out}")
    return 0
