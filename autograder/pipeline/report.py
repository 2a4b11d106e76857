"""Feedback for students and the grade export for instructors.

Feedback is built from the result records and the gradebook, never from the autograded
notebook: it lists each graded cell by name with its points and, for failures, the assertion
message (which says what was expected). No test source, hidden or visible, and no traceback
reaches a student. Under each answer graded by hand it shows that answer's mark scheme, taken
from the grader's copy (the source notebook; release cuts mark-scheme regions, so learners
first see a rubric here, after grading), escaped like every other text on the page.
"""
from __future__ import annotations

import csv
import html
import re
from pathlib import Path

from autograder.pipeline.course import Course
from autograder.submitted.shown import shown
from autograder.pipeline.grade import load_results

_MARK_SCHEME = re.compile(r"### BEGIN MARK SCHEME[ \t]*\n?(.*?)### END MARK SCHEME", re.S)
MARK_SCHEME_CAP = 4000   # characters: a rubric is a few hundred; the cap only bounds the page
EXPORT_COLUMNS = ["student", "assignment", "score", "max_score", "status", "reason"]


def gradebook_scores(course: Course, assignment: str) -> dict[str, dict]:
    """Per student: total score (manual grades included), max score, per-cell scores."""
    from nbgrader.api import Gradebook, MissingEntry

    out: dict[str, dict] = {}
    if not course.gradebook_path.exists():
        return out
    with Gradebook(course.db_url) as gb:
        try:
            a = gb.find_assignment(assignment)
        except MissingEntry:
            return out
        for sub in a.submissions:
            cells: dict[str, dict] = {}
            for nb in sub.notebooks:
                for g in nb.grades:
                    cells[g.name] = {"score": g.score, "max": g.max_score,
                                     "manual": g.manual_score is not None,
                                     "needs_manual_grade": g.needs_manual_grade}
                for c in nb.comments:
                    if c.comment and c.name in cells:
                        cells[c.name]["comment"] = c.comment
            out[sub.student.id] = {"score": sub.score, "max_score": sub.max_score,
                                   "cells": cells,
                                   "pending": sum(1 for x in cells.values()
                                                  if x["needs_manual_grade"])}
    return out


def export(course: Course, assignments: list[str], out: Path) -> int:
    """Write the grades CSV; one row per (student, assignment) collected or graded."""
    rows = []
    for assignment in assignments:
        results = load_results(course, assignment)
        scores = gradebook_scores(course, assignment)
        students = set(results) | set(scores)
        if course.submitted.is_dir():
            students |= {p.name for p in course.submitted.iterdir() if (p / assignment).is_dir()}
        for student in sorted(students):
            r = results.get(student)
            s = scores.get(student)
            if r is None:
                rows.append([student, assignment, 0, s["max_score"] if s else "", "failed",
                             "collected but not autograded yet"])
                continue
            score = s["score"] if s else r["score"]
            max_score = s["max_score"] if s else r["max_score"]
            reason = "; ".join(r.get("flags", []) + r.get("reasons", []))
            if s and s["pending"]:
                reason = "; ".join(x for x in (f"{s['pending']} answer(s) await manual "
                                               "grading", reason) if x)
            rows.append([student, assignment, _num(score), _num(max_score), r["status"],
                         reason])
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(EXPORT_COLUMNS)
        # Reasons hold grade ids, file names and messages the student chose: no control
        # character (an ANSI escape, a bidi override) reaches a terminal or spreadsheet.
        w.writerows([[shown(x) if isinstance(x, str) else x for x in row] for row in rows])
    return len(rows)


def _num(x) -> float | str:
    return "" if x is None else round(float(x), 4)


def mark_schemes(source_nb) -> dict[str, str]:
    """grade_id of each answer graded by hand -> its mark scheme in the grader's copy: the
    mark-scheme region of the cell above the answer (where the course puts rubrics, see
    tests/exercise_checks.py) or of the answer cell itself."""
    out: dict[str, str] = {}
    cells = source_nb.cells
    for i, cell in enumerate(cells):
        m = cell.get("metadata", {}).get("nbgrader", {})
        if not (m.get("grade") and m.get("solution")):
            continue
        for near in (cell, cells[i - 1]) if i else (cell,):
            found = _MARK_SCHEME.findall(near.source)
            if found:
                out[m["grade_id"]] = "\n".join(t.strip() for t in found)[:MARK_SCHEME_CAP]
                break
    return out


def _schemes_of(course: Course, assignment: str, nb_name: str) -> dict[str, str]:
    import nbformat
    path = course.source / assignment / f"{nb_name}.ipynb"
    return mark_schemes(nbformat.read(path, as_version=4)) if path.is_file() else {}


def feedback(course: Course, assignment: str, students: list[str] | None = None) -> list[Path]:
    """Write grading/feedback/STUDENT/ASSIGNMENT/NOTEBOOK.html for each graded student."""
    results = load_results(course, assignment)
    scores = gradebook_scores(course, assignment)
    written = []
    schemes: dict[str, dict[str, str]] = {}
    for student, r in sorted(results.items()):
        if students and student not in students:
            continue
        folder = course.feedback / student / assignment
        folder.mkdir(parents=True, exist_ok=True)
        for nb_name, nb in _pages(course, assignment, r).items():
            if nb_name not in schemes:
                schemes[nb_name] = _schemes_of(course, assignment, nb_name)
            page = render(student, assignment, nb_name, r, nb, scores.get(student, {}),
                          schemes[nb_name])
            path = folder / f"{nb_name}.html"
            path.write_text(shown(page, lines=True), encoding="utf-8")
            written.append(path)
    return written


def _pages(course: Course, assignment: str, r: dict) -> dict[str, dict]:
    """The notebooks of a record to write pages for. A job that failed before any notebook
    was graded (the worker crashed, or was stopped) still gets a page per notebook, with no
    tests and the reasons: the student learns what happened instead of finding nothing."""
    graded = r.get("notebooks") or {}
    if graded:
        return graded
    return {name: {"tests": []} for name in course.notebooks(assignment)}


def render(student: str, assignment: str, nb_name: str, r: dict, nb: dict, gb: dict,
           schemes: dict[str, str] | None = None) -> str:
    """The feedback page; ``schemes`` maps a hand-graded answer to its mark scheme."""
    e = html.escape
    schemes = schemes or {}
    cells = gb.get("cells", {})
    rows = []
    total = max_total = 0.0
    for t in nb.get("tests", []):
        g = cells.get(t["grade_id"], {})
        points = g.get("score") if g.get("score") is not None else t["points"]
        total += points or 0
        max_total += t["max_points"]
        if t["kind"] == "manual":
            if g.get("manual"):
                result, msg = "graded", g.get("comment", "")
            else:
                result, msg = ("pending", "awaiting manual grading") if t["needs_manual_grade"] \
                    else ("missing", t["message"])
        else:
            result = "pass" if t["passed"] else "fail"
            msg = "" if t["passed"] else t["message"]
        rows.append(f"<tr class='{result}'><td>{e(t['grade_id'])}</td><td>{e(t['kind'])}</td>"
                    f"<td>{_num(points)} / {_num(t['max_points'])}</td><td>{result}</td>"
                    f"<td>{e(msg)}</td></tr>")
        if t["kind"] == "manual" and t["grade_id"] in schemes:
            rows.append(f"<tr class='scheme'><td></td><td colspan='4'><b>Mark scheme</b>"
                        f"<pre>{e(schemes[t['grade_id']])}</pre></td></tr>")
    notes = [n for n in r.get("reasons", []) if not n.startswith("kernel log")]
    pending = sum(t["max_points"] for t in nb.get("tests", []) if t["kind"] == "manual"
                  and t["needs_manual_grade"] and not cells.get(t["grade_id"], {}).get("manual"))
    provisional = (f" (provisional: answers awaiting manual grading: {_num(pending):g} "
                   f"point{'s' if pending != 1 else ''})" if pending else "")
    title = assignment if nb_name == assignment else f"{assignment} / {nb_name}"
    score_line = (f"Score: <b>{_num(total)} / {_num(max_total)}</b>{e(provisional)}."
                  if nb.get("tests") else "Not graded: see the notes.")
    status = {"graded": "Graded", "flagged": "Held for review by your instructor",
              "failed": "Could not be graded"}[r["status"]]
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{e(title)}: {e(student)}</title>
<style>body{{font-family:sans-serif;max-width:60em;margin:2em auto}}
td,th{{border-bottom:1px solid #ddd;padding:.3em .6em;text-align:left;vertical-align:top}}
.pass td:nth-child(4){{color:#080}} .fail td:nth-child(4){{color:#b00}}
.scheme pre{{white-space:pre-wrap;margin:.3em 0}}</style></head><body>
<h1>{e(title)}</h1>
<p>Student: <b>{e(student)}</b>. Status: <b>{e(status)}</b>.
{score_line}</p>
{"<p>Notes: " + e("; ".join(notes)) + "</p>" if notes else ""}
<table><tr><th>Test</th><th>Kind</th><th>Points</th><th>Result</th><th>Message</th></tr>
{chr(10).join(rows)}
</table></body></html>
"""
