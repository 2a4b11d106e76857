"""The learner's mistakes as mutants: does each cost marks, at Validate too, and only its piece?

Single-point mutants (:mod:`autograder.mutation.mutants`) change an operator or a constant; learners make
other mistakes: a cache that is never read, a mask built by index, a residual dropped. This
module grades *semantic* mutants: named source edits of the solution, each a mistake a
learner makes (the corpus is :mod:`autograder.mutation.corpus`), and reports per mistake

- the **graded** score (every test, hidden ones included) and the test cells that lost points;
- the **Validate** score: the same mistake graded with the hidden tests removed, which is what
  the Validate button and ``python -m autograder check`` run (the trusted runner, the visible
  tests).

Three goals per mistake, each checked and reported: it loses graded marks (no wrong answer
with full marks); it loses marks at Validate too (none green at Validate that grading docks);
and it loses them only in its own piece's tests (one slip costs one piece).

``python -m autograder mutants ASSIGNMENT --semantic`` runs it.
"""
from __future__ import annotations

from pathlib import Path
import re
import shutil
import tempfile

import nbformat

from autograder.pipeline.course import Course, CourseError, release
from autograder.mutation.corpus import CORPUS, Mistake

HIDDEN = re.compile(r"### BEGIN HIDDEN TESTS.*?### END HIDDEN TESTS\n?", re.S)


def apply(mistake: Mistake, source: str) -> str:
    """The answer cell's source with the mistake made; each old text must occur exactly once
    (a corpus that no longer matches its solution fails loudly, not silently)."""
    for old, new in mistake.edits:
        found = source.count(old)
        if found != 1:
            raise CourseError(f"mistake {mistake.name!r}: {old!r} occurs {found} times in cell "
                              f"{mistake.cell!r} (expected once); update the corpus")
        source = source.replace(old, new)
    return source


def _answer_cells(source_dir: Path) -> dict[str, tuple[Path, str]]:
    out = {}
    for path in sorted(source_dir.glob("*.ipynb")):
        for cell in nbformat.read(path, as_version=4).cells:
            meta = cell.metadata.get("nbgrader", {})
            if cell.cell_type == "code" and meta.get("solution") and not meta.get("grade"):
                out[meta["grade_id"]] = (path, cell.source)
    return out


def mutated_sources(source_dir: Path, mistakes: list[Mistake]) -> list[dict[str, str]]:
    """For each mistake, {answer cell id: mutated source}: checked before anything is graded."""
    cells = _answer_cells(source_dir)
    out = []
    for m in mistakes:
        if m.cell not in cells:
            raise CourseError(f"mistake {m.name!r}: no answer cell {m.cell!r}; the answer cells "
                              f"are {', '.join(cells)}")
        out.append({m.cell: apply(m, cells[m.cell][1])})
    return out


def strip_hidden_tests(folder: Path) -> None:
    """Remove the hidden tests from every notebook in ``folder`` (in place): what a release
    keeps, so grading this source scores what Validate scores."""
    for path in folder.glob("*.ipynb"):
        nb = nbformat.read(path, as_version=4)
        for cell in nb.cells:
            if cell.metadata.get("nbgrader", {}).get("grade"):
                cell.source = HIDDEN.sub("", cell.source)
        nbformat.write(nb, path)


def _grade(source_dir: Path, name: str, variants: list[dict[str, str]], *, visible_only: bool,
           **grading) -> list[dict]:
    """Grade the solution (first) and each variant in a scratch course; results in order."""
    from autograder.pipeline.grade import autograde
    with tempfile.TemporaryDirectory(prefix="semantic-") as tmp:
        scratch = Course(Path(tmp))
        shutil.copytree(source_dir, scratch.source / name)
        if visible_only:
            strip_hidden_tests(scratch.source / name)
        release(scratch, name)
        for i, changes in enumerate([{}] + variants):
            dest = scratch.submitted / f"s{i:04d}" / name
            dest.mkdir(parents=True)
            for path in sorted((scratch.source / name).glob("*.ipynb")):
                nb = nbformat.read(path, as_version=4)
                for cell in nb.cells:
                    gid = cell.metadata.get("nbgrader", {}).get("grade_id")
                    if gid in changes:
                        cell.source = changes[gid]
                nbformat.write(nb, dest / path.name)
        results = {r["student"]: r for r in autograde(scratch, name, progress=False,
                                                      stop_at_failure=False, **grading)}
    return [results[f"s{i:04d}"] for i in range(len(variants) + 1)]


def _lost(result: dict) -> dict[str, float]:
    """Points lost per autograded test cell."""
    return {t["grade_id"]: t["max_points"] - t["points"]
            for nb in result.get("notebooks", {}).values() for t in nb.get("tests", [])
            if t["kind"] != "manual" and t["points"] < t["max_points"]}


def semantic_report(course: Course, name: str, *, mistakes: list[Mistake] | None = None,
                    workers: int | None = None, unsafe: bool = False,
                    cell_timeout: float = 60, timeout: float = 900) -> dict:
    """Grade every mistake of ``name``'s corpus (or ``mistakes``) with all tests and with the
    visible ones; returns {"assignment", "max_score", "mistakes": [...], "goals": {...}}."""
    course.check_assignment(name)
    if mistakes is None:
        if name not in CORPUS:
            raise CourseError(f"no semantic mistakes for {name!r}; the corpus covers "
                              f"{', '.join(CORPUS)}")
        mistakes = CORPUS[name]
    source_dir = course.source / name
    variants = mutated_sources(source_dir, mistakes)
    grading = dict(workers=workers, unsafe=unsafe, cell_timeout=cell_timeout,
                   total_timeout=timeout)
    graded = _grade(source_dir, name, variants, visible_only=False, **grading)
    validated = _grade(source_dir, name, variants, visible_only=True, **grading)
    for label, base in (("graded", graded[0]), ("Validate", validated[0])):
        if base["status"] != "graded" or _lost(base):
            raise CourseError(f"{name}: the solution does not get full marks when {label} "
                              f"({base['status']}; lost {_lost(base)}); fix it first")
    rows = []
    for m, g, v in zip(mistakes, graded[1:], validated[1:]):
        lost = _lost(g) if g["status"] == "graded" else {}
        v_lost = _lost(v) if v["status"] == "graded" else {}
        rows.append({
            "mistake": m.name, "cell": m.cell, "pieces": list(m.pieces),
            "graded": g["score"] if g["status"] == "graded" else None,
            "validate": v["score"] if v["status"] == "graded" else None,
            "status": g["status"], "validate_status": v["status"],
            "lost": sorted(lost), "validate_lost": sorted(v_lost),
            "loses_marks": g["status"] != "graded" or bool(lost),
            "caught_at_validate": v["status"] != "graded" or bool(v_lost),
            "only_its_piece": set(lost) <= set(m.pieces),
            "why": "; ".join(g.get("reasons", []) + g.get("flags", []))[:300],
            "validate_why": "; ".join(v.get("reasons", []) + v.get("flags", []))[:300],
        })
    goals = {"no_full_marks": all(r["loses_marks"] for r in rows),
             "caught_at_validate": all(r["caught_at_validate"] for r in rows),
             "one_piece_each": all(r["only_its_piece"] for r in rows)}
    return {"assignment": name, "max_score": graded[0]["max_score"], "mistakes": rows,
            "goals": goals}


def print_report(report: dict, write=print) -> None:
    rows = report["mistakes"]
    write(f"{report['assignment']}: {len(rows)} learner mistakes, graded with all tests and "
          f"with the visible ones (Validate), out of {report['max_score']:g}")
    for r in rows:
        graded = "not graded" if r["graded"] is None else f"{r['graded']:g}"
        validate = "not graded" if r["validate"] is None else f"{r['validate']:g}"
        marks = [] if r["loses_marks"] else ["FULL MARKS"]
        marks += [] if r["caught_at_validate"] else ["green at Validate"]
        marks += [] if r["only_its_piece"] else [f"costs {', '.join(sorted(set(r['lost']) - set(r['pieces'])))}"]
        write(f"  {'ok ' if not marks else 'BAD'} {r['mistake']}: graded {graded}, Validate "
              f"{validate}, lost in {', '.join(r['lost']) or '-'}"
              + (f"  <- {'; '.join(marks)}" if marks else ""))
    met = report["goals"]
    write("goals: " + ", ".join(f"{k} {'met' if v else 'NOT met'}" for k, v in met.items()))
