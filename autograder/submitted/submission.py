"""Reading a submitted notebook defensively and rebuilding the notebook that gets graded.

A submission is untrusted JSON. It may be invalid, carry another schema version, have deleted,
duplicated, edited or metadata-wiped cells. We never trust its test or locked cells: the graded
notebook takes every test and locked cell from the grader template (with hidden tests) and
only the *source* of answer cells and of the student's own extra cells from the submission.
"""
from __future__ import annotations

import copy
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import nbformat
from nbformat import NotebookNode

from autograder.submitted.shown import shown

MAX_NOTEBOOK_MB = 20
CELL_ID = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")


class Unreadable(Exception):
    """The submission cannot be graded at all; the message is the reason shown to people."""


@dataclass
class Merged:
    nb: NotebookNode
    notes: list[str] = field(default_factory=list)       # what was repaired, for the reason
    student_cells: list[tuple[str, str]] = field(default_factory=list)  # (label, source)


def nbgrader_meta(cell: dict) -> dict | None:
    meta = cell.get("metadata")
    if not isinstance(meta, dict):
        return None
    nbg = meta.get("nbgrader")
    if isinstance(nbg, dict) and isinstance(nbg.get("grade_id"), str) and nbg["grade_id"]:
        return nbg
    return None


def grade_id(cell: dict) -> str | None:
    nbg = nbgrader_meta(cell)
    return nbg["grade_id"] if nbg else None


def is_test(cell: dict) -> bool:
    nbg = nbgrader_meta(cell) or {}
    return bool(nbg.get("grade")) and not nbg.get("solution") and cell.get("cell_type") == "code"


def is_answer(cell: dict) -> bool:
    return bool((nbgrader_meta(cell) or {}).get("solution"))


def load(path: Path) -> tuple[NotebookNode, list[str]]:
    """Parse a submitted notebook, repairing what can be repaired; raise Unreadable if not."""
    notes: list[str] = []
    size_mb = path.stat().st_size / 2**20
    if size_mb > MAX_NOTEBOOK_MB:
        raise Unreadable(f"{path.name} is {size_mb:.0f} MB, over the {MAX_NOTEBOOK_MB} MB "
                         "limit (clear outputs and resubmit)")
    raw = path.read_bytes()
    try:
        data = json.loads(raw.decode("utf-8", errors="replace"))
    except json.JSONDecodeError as e:
        raise Unreadable(f"{path.name} is not valid JSON (line {e.lineno}, column {e.colno}: "
                         f"{e.msg}); the file was damaged, resubmit it from JupyterLab") from None
    except (RecursionError, ValueError, MemoryError):
        raise Unreadable(f"{path.name} is not a notebook JSON file (nested too deeply or "
                         "malformed); resubmit it from JupyterLab") from None
    # Format 3 keeps its cells under "worksheets", not "cells": ask about it first, or a
    # notebook an older Jupyter saved would read as "not a notebook".
    if isinstance(data, dict) and (data.get("nbformat") == 3 or "worksheets" in data):
        raise Unreadable(f"{path.name} uses notebook format 3; open and save it in JupyterLab")
    if not isinstance(data, dict) or not isinstance(data.get("cells"), list):
        raise Unreadable(f"{path.name} is JSON but not a notebook (no list of cells)")
    version = (data.get("nbformat"), data.get("nbformat_minor"))
    if version[0] != 4 or not isinstance(version[1], int) or not 0 <= version[1] <= 5:
        notes.append(f"notebook schema version {version[0]}.{version[1]} is not 4.x; "
                     "read as 4.5")
    cells = []
    repaired_ids = 0
    for i, raw_cell in enumerate(data["cells"]):
        if not isinstance(raw_cell, dict) or raw_cell.get("cell_type") not in (
                "code", "markdown", "raw"):
            notes.append(f"dropped malformed cell {i}")
            continue
        source = raw_cell.get("source", "")
        if isinstance(source, list):
            source = "".join(str(s) for s in source)
        if not isinstance(source, str):
            source = ""
        meta = raw_cell.get("metadata") if isinstance(raw_cell.get("metadata"), dict) else {}
        if raw_cell["cell_type"] == "code":
            cell = nbformat.v4.new_code_cell(source)  # outputs dropped: we run it ourselves
        elif raw_cell["cell_type"] == "markdown":
            cell = nbformat.v4.new_markdown_cell(source)
        else:
            cell = nbformat.v4.new_raw_cell(source)
        cell.metadata = nbformat.from_dict(_plain(meta))
        cell_id = raw_cell.get("id")
        if isinstance(cell_id, str) and CELL_ID.match(cell_id):
            cell.id = cell_id
        elif cell_id is not None:
            # nbformat allows letters, digits, - and _ (1-64 of them); any other id (a path,
            # a space, a lone surrogate) would fail validation when the graded copy is
            # written, so the cell gets a fresh id, and grading goes on.
            repaired_ids += 1
        cells.append(cell)
    if repaired_ids:
        notes.append(f"replaced {repaired_ids} cell id(s) that nbformat does not allow "
                     "(letters, digits, - and _ only)")
    nb = nbformat.v4.new_notebook(cells=cells)
    return nb, notes


def _plain(value: object, depth: int = 0) -> object:
    """JSON-only copy with a depth limit (metadata is attacker-controlled)."""
    if depth > 8:
        return None
    if isinstance(value, dict):
        return {str(k): _plain(v, depth + 1) for k, v in list(value.items())[:100]}
    if isinstance(value, list):
        return [_plain(v, depth + 1) for v in value[:100]]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return None


def merge(template: NotebookNode, release: NotebookNode, student: NotebookNode) -> Merged:
    """The notebook to grade: template's tests and locked cells, the student's answers."""
    out = Merged(nb=copy.deepcopy(template))
    found = _match(template, student)
    cells, placed, edited = _substitute(template, release, student, found.matched, out)
    restored = _restore(template, cells, placed)
    out.nb.cells = cells
    out.notes.extend(_notes(restored, edited, found))
    return out


@dataclass
class _Matches:
    matched: dict[int, int] = field(default_factory=dict)   # student index -> template index
    duplicates: list[str] = field(default_factory=list)
    unknown: list[str] = field(default_factory=list)
    rewired: list[str] = field(default_factory=list)


def _match(template: NotebookNode, student: NotebookNode) -> _Matches:
    """Student cells to template cells: by grade_id, else by the nbformat cell id (survives
    wiped metadata). Later duplicates of a grade_id become plain cells."""
    tmpl_cells = template.cells
    tmpl_ids = {grade_id(c): i for i, c in enumerate(tmpl_cells) if grade_id(c)}
    by_cell_id = {c.get("id"): i for i, c in enumerate(tmpl_cells) if c.get("id")}
    found, taken = _Matches(), set()
    for si, cell in enumerate(student.cells):
        gid = grade_id(cell)
        ti = None
        if gid is not None:
            if gid not in tmpl_ids:
                found.unknown.append(gid)
            elif tmpl_ids[gid] in taken:
                found.duplicates.append(gid)
            else:
                ti = tmpl_ids[gid]
        elif cell.get("id") in by_cell_id and grade_id(tmpl_cells[by_cell_id[cell.get("id")]]):
            cand = by_cell_id[cell.get("id")]
            if cand not in taken and tmpl_cells[cand].cell_type == cell.cell_type:
                ti = cand
                found.rewired.append(grade_id(tmpl_cells[cand]))
        if ti is not None:
            found.matched[si] = ti
            taken.add(ti)
    return found


def _substitute(template, release, student, matched: dict[int, int], out: Merged):
    """Walk the student's order, putting the template's (trusted) cell where one matched and
    the student's source only into answer cells; returns (cells, placed, edited ids)."""
    release_src = {grade_id(c): c.source for c in release.cells if grade_id(c)}
    cells: list[NotebookNode] = []
    placed: dict[int, int] = {}         # template index -> position in cells
    edited: list[str] = []
    for si, cell in enumerate(student.cells):
        ti = matched.get(si)
        if ti is None:
            plain = copy.deepcopy(cell)
            plain.metadata.pop("nbgrader", None)
            cells.append(plain)
            if plain.cell_type == "code" and plain.source.strip():
                out.student_cells.append((f"cell {si}", plain.source))
            continue
        tcell = copy.deepcopy(template.cells[ti])
        gid = grade_id(tcell)
        if is_answer(tcell):
            tcell.source = cell.source
            if tcell.cell_type == "code":
                out.student_cells.append((gid, cell.source))
        elif cell.source.strip() not in (release_src.get(gid, "").strip(),
                                         tcell.source.strip()):
            edited.append(gid)
        placed[ti] = len(cells)
        cells.append(tcell)
    return cells, placed, edited


def _restore(template: NotebookNode, cells: list, placed: dict[int, int]) -> list[str]:
    """Put back graded cells the student deleted, right after their template predecessor."""
    restored = []
    for ti, tcell in enumerate(template.cells):
        gid = grade_id(tcell)
        if not gid or ti in placed:
            continue
        before = [placed[p] for p in range(ti) if p in placed]
        pos = (max(before) + 1) if before else _first_graded_position(placed)
        for t in placed:
            if placed[t] >= pos:
                placed[t] += 1
        cells.insert(pos, copy.deepcopy(tcell))
        placed[ti] = pos
        restored.append(gid)
    return restored


def _notes(restored: list[str], edited: list[str], found: _Matches) -> list[str]:
    notes = []
    if restored:
        notes.append("restored deleted cells: " + ", ".join(restored))
    if edited:
        notes.append("edited read-only cells replaced by the originals: " + ", ".join(edited))
    # Duplicate and unknown ids are the student's text: escaped (see course.shown).
    if found.duplicates:
        notes.append("duplicate cell ids (later copies graded as plain code): "
                     + ", ".join(shown(g) for g in sorted(set(found.duplicates))))
    if found.unknown:
        notes.append("unknown nbgrader cell ids ignored: "
                     + ", ".join(shown(g) for g in sorted(set(found.unknown))))
    if found.rewired:
        notes.append("restored wiped grading metadata of: " + ", ".join(found.rewired))
    return notes


def _first_graded_position(placed: dict[int, int]) -> int:
    return min(placed.values()) if placed else 0
