"""Benchmark: parallel vs serial autograding of the same submissions, side by side.

    python -m autograder bench --json artifacts/grading_bench.json

Grades N copies of a correct submission of the mini assignment (tests/fixtures) twice, once
with one worker and once with ``workers`` (default: CPU count), in throwaway course folders,
and reports the ratio with the raw timings, the machine and the git commit.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from pathlib import Path

from tinyserve.provenance import git_commit, machine_info

from .course import Course, CourseError, release
from .grade import autograde


def bench(course: Course, out: Path, *, n: int = 30, workers: int | None = None,
          assignment: str | None = None) -> int:
    mini = course.root / "tests" / "fixtures" / "mini_assignment" / "mini"
    if assignment is None and not mini.is_dir():
        raise CourseError("bench needs tests/fixtures/mini_assignment or --assignment")
    workers = workers or os.cpu_count() or 2
    timings = {}
    with tempfile.TemporaryDirectory() as tmp:
        for label, w in (("serial", 1), ("parallel", workers)):
            root = Path(tmp) / label
            name = assignment or "mini"
            src = course.source / name if assignment else mini
            shutil.copytree(src, root / "solutions" / name)
            c = Course(root)
            release(c, name)
            solved = root / "solutions" / name
            for i in range(n):
                dest = c.submitted / f"s{i:03d}" / name
                shutil.copytree(solved, dest)
            start = time.perf_counter()
            results = autograde(c, name, workers=w, progress=False)
            timings[label] = {"seconds": time.perf_counter() - start, "workers": w,
                              "statuses": sorted({r["status"] for r in results}),
                              "per_submission_s": [r.get("seconds") for r in results]}
    report = {
        "suite": "grading",
        "ratios": {"parallel_grading_speedup":
                   timings["serial"]["seconds"] / timings["parallel"]["seconds"]},
        "timings": timings, "submissions": n, "machine": machine_info(),
        "git_commit": git_commit(course.root),
        "conditions": f"{n} copies of a solved {assignment or 'mini'} notebook, sandboxed; "
                      "serial = 1 worker, parallel = CPU count",
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    print(f"parallel_grading_speedup = {report['ratios']['parallel_grading_speedup']:.2f} "
          f"({timings['serial']['seconds']:.1f} s serial, {timings['parallel']['seconds']:.1f} s "
          f"with {workers} workers) -> {out}")
    return 0
