"""``python -m autograder``: the instructor's commands and the learner's self-check.

    release ASSIGNMENT            solutions/ -> exercises/ (and the gradebook)
    release-exchange ASSIGNMENT   ... and put it in nbgrader's exchange (a class hub)
    collect ASSIGNMENT SOURCE     SOURCE = folder or zip laid out STUDENT/ASSIGNMENT/*.ipynb
    collect ASSIGNMENT --from-exchange   each student's latest submission from the exchange
    autograde ASSIGNMENT          sandboxed, parallel; backs up the gradebook first
    feedback ASSIGNMENT           grading/feedback/STUDENT/ASSIGNMENT/*.html
    feedback ASSIGNMENT --return  ... and hand it to the students through the exchange
    export [ASSIGNMENT ...]       grades CSV
    check NOTEBOOK                learner self-check against the visible tests (a path, or
                                  an exercise's name: check harbor_capacity; from any folder)
    bench --json PATH             parallel vs serial grading speed-up
    mutants ASSIGNMENT            mutation score: the share of solution mutants that lose marks
    mutants ASSIGNMENT --semantic the learner-mistake corpus: graded and Validate scores, pieces
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from autograder.pipeline.course import Course, CourseError
from autograder.submitted.shown import shown


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m autograder", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--root", help="course directory (default: found from the current folder)")
    sub = p.add_subparsers(dest="cmd", required=True)

    r = sub.add_parser("release", help="generate exercises/ from solutions/")
    r.add_argument("assignments", nargs="*", help="default: all")

    x = sub.add_parser("release-exchange", help="release, then put it in nbgrader's exchange")
    x.add_argument("assignment")
    x.add_argument("--due", help="due date for the gradebook, e.g. '2026-12-08 17:00 UTC'")
    x.add_argument("--exchange", help="exchange root (default: Exchange.root from nbgrader config)")

    c = sub.add_parser("collect", help="copy submissions into grading/submitted/")
    c.add_argument("assignment")
    c.add_argument("source", type=Path, nargs="?", help="folder or zip (not with --from-exchange)")
    c.add_argument("--from-exchange", action="store_true",
                   help="each student's latest submission from nbgrader's exchange")
    c.add_argument("--exchange", help="exchange root (default: Exchange.root from nbgrader config)")
    c.add_argument("--student", action="append", help="only these students (repeatable)")
    c.add_argument("--no-check-owner", action="store_true",
                   help="accept submissions not owned by the student's Unix account")

    a = sub.add_parser("autograde", help="grade collected submissions in the sandbox")
    a.add_argument("assignment")
    a.add_argument("--student", action="append", help="only these students (repeatable)")
    a.add_argument("--workers", type=int, default=None, help="parallel workers (default: CPUs)")
    a.add_argument("--cell-timeout", type=float, default=60)
    a.add_argument("--timeout", type=float, default=600, help="wall-clock limit per notebook")
    a.add_argument("--memory-mb", type=int, default=None)
    a.add_argument("--unsafe", action="store_true",
                   help="grade without the bubblewrap sandbox (trusted submissions only)")
    a.add_argument("--no-progress", action="store_true")

    f = sub.add_parser("feedback", help="write per-student feedback pages")
    f.add_argument("assignment")
    f.add_argument("--return", dest="return_", action="store_true",
                   help="put each page where the student's Fetch Feedback finds it")
    f.add_argument("--exchange", help="exchange root (default: Exchange.root from nbgrader config)")

    e = sub.add_parser("export", help="write the grades CSV")
    e.add_argument("assignments", nargs="*", help="default: all")
    e.add_argument("--out", type=Path, default=None, help="default: grading/grades.csv")

    k = sub.add_parser("check", help="self-check a notebook against its visible tests")
    k.add_argument("notebook", help="the notebook: a path, or an exercise's name "
                   "(harbor_capacity), from any folder; its setup cells are not run")
    k.add_argument("--cell-timeout", type=float, default=120)

    b = sub.add_parser("bench", help="measure parallel grading speed-up")
    b.add_argument("--json", type=Path, required=True)
    b.add_argument("--submissions", type=int, default=30)
    b.add_argument("--workers", type=int, default=None)
    b.add_argument("--assignment", default=None)

    __import__("autograder.mutation.mutants").mutation.mutants.add_parser(sub)

    args = p.parse_args(argv)
    try:
        return _run(args)
    except CourseError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


def summary_line(res: dict) -> str:
    """One student's line of autograde's summary; the why (flags and reasons, which hold
    file names, grade ids and messages the student chose) printed escaped."""
    why = "; ".join(res["flags"] + res["reasons"]) if res["status"] != "graded" else ""
    return (f"{res['student']:<20} {res['status']:<8} {res['score']:g}/{res['max_score']:g}"
            + (f"  {shown(why)[:200]}" if why else ""))


def _run(args) -> int:
    if args.cmd == "check":
        from autograder.pipeline.check import self_check
        return self_check(args.notebook, cell_timeout=args.cell_timeout)
    course = Course.find(args.root)
    if getattr(args, "handler", None):
        return args.handler(course, args)
    if args.cmd == "release":
        from autograder.pipeline.course import release
        for name in args.assignments or course.assignments():
            print(f"released {name} -> {release(course, name).relative_to(course.root)}")
        return 0
    if args.cmd == "release-exchange":
        from autograder.pipeline.exchange import release_to_exchange
        where = release_to_exchange(course, args.assignment, root=args.exchange, due=args.due)
        print(f"released {args.assignment} -> {where}")
        return 0
    if args.cmd == "collect" and args.from_exchange:
        from autograder.pipeline.exchange import report_collected
        return report_collected(course, args)
    if args.cmd == "collect":
        if args.source is None:
            raise CourseError("collect needs SOURCE (a folder or zip), or --from-exchange")
        if args.student or args.exchange or args.no_check_owner:
            raise CourseError("--student, --exchange and --no-check-owner go with --from-exchange")
        from autograder.pipeline.collect import collect
        students, warnings = collect(course, args.assignment, args.source)
        for w in warnings:
            print(f"warning: {shown(w)}", file=sys.stderr)
        print(f"collected {len(students)} submission(s) of {args.assignment}: "
              + ", ".join(students))
        return 0
    if args.cmd == "autograde":
        from autograder.pipeline.grade import autograde
        from autograder.runner.sandbox import Limits
        from dataclasses import asdict
        limits = asdict(Limits())
        if args.memory_mb:
            limits["memory_mb"] = args.memory_mb
        results = autograde(course, args.assignment, students=args.student,
                            workers=args.workers, unsafe=args.unsafe,
                            cell_timeout=args.cell_timeout, total_timeout=args.timeout,
                            limits=limits, progress=not args.no_progress)
        for res in results:
            print(summary_line(res))
        return 0
    if args.cmd == "feedback":
        from autograder.pipeline.report import feedback
        paths = feedback(course, args.assignment)
        print(f"wrote {len(paths)} feedback page(s) under {course.feedback.relative_to(course.root)}")
        if args.return_:
            from autograder.pipeline.exchange import report_returned
            return report_returned(course, args)
        return 0
    if args.cmd == "export":
        from autograder.pipeline.report import export
        out = args.out or course.work / "grades.csv"
        n = export(course, args.assignments or course.assignments(), out)
        print(f"wrote {n} row(s) to {out}")
        return 0
    if args.cmd == "bench":
        from autograder.pipeline.bench import bench
        return bench(course, args.json, n=args.submissions, workers=args.workers,
                     assignment=args.assignment)
    raise AssertionError(args.cmd)
