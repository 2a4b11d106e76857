"""Collect submissions from a folder or a zip laid out STUDENT/ASSIGNMENT/NOTEBOOK.ipynb.

LMS exports often wrap that layout in one or more extra folders, so we look for the
ASSIGNMENT folder at any depth and take the folder above it as the student. Paths are
checked (no ``..``, no absolute names, no links) and sizes capped, since a zip is as
untrusted as the notebooks in it. A file over the cap is left out, not the student: the
collection records why (``collect_notes``), and grading reports it in the student's grades.
"""
from __future__ import annotations

import json
import shutil
import time
import zipfile
import zlib
from pathlib import Path, PurePosixPath

from autograder.pipeline.course import Course, CourseError, safe_name
from autograder.submitted.shown import shown

MAX_FILE_MB = 50
MAX_STUDENT_MB = 200


def collect(course: Course, assignment: str, source: Path) -> tuple[list[str], list[str]]:
    """Copy submissions into grading/submitted/; return (students collected, warnings).

    Each student's upload is handled alone: a bad entry (a zip whose headers lie about
    sizes, a file and a folder of the same name, a name too long for the file system) costs
    that student's collection, with a warning saying why, never anyone else's.
    """
    course.check_assignment(assignment)
    source = Path(source)
    if not source.exists():
        raise CourseError(f"{source} does not exist")
    entries = list(_zip_entries(source) if source.is_file() else _folder_entries(source))
    by_student, warnings, skipped = _group(entries, assignment)
    if not by_student:
        raise CourseError(f"no submissions for {assignment} found in {source}; expected "
                          f"STUDENT/{assignment}/NOTEBOOK.ipynb")
    collected = []
    for student, files in sorted(by_student.items()):
        problem = _collect_one(course.submitted / student / assignment, files,
                               skipped.get(student, []))
        if problem:
            warnings.append(f"{student}: not collected ({problem}); the previous collection, "
                            "if any, is kept")
        else:
            collected.append(student)
    return collected, warnings


def _group(entries, assignment: str
           ) -> tuple[dict[str, list], list[str], dict[str, list[str]]]:
    """Files per student, warnings, and per student the files left out (over the size cap),
    said for the student. The student is the folder above the *outermost* folder named like
    the assignment, so a nested copy inside one upload (ben/mini/ann/mini/...) stays ben's
    and cannot replace ann's; a student found under two different paths keeps the shallower
    one, and the other is reported."""
    by_student: dict[str, list[tuple[PurePosixPath, object, int]]] = {}
    skipped: dict[str, list[str]] = {}
    where: dict[str, tuple[str, ...]] = {}
    warnings: list[str] = []
    for parts, opener, size in entries:
        if assignment not in parts[:-1] or "__MACOSX" in parts:
            continue
        i = parts.index(assignment)
        if i < 1:
            continue
        student, prefix, rel = parts[i - 1], tuple(parts[:i]), PurePosixPath(*parts[i + 1:])
        if not safe_name(student):
            warnings.append(f"skipped folder '{shown(student[:80])}': not a valid student id")
            continue
        if any(p in ("..", "") or p.startswith("/") for p in rel.parts):
            continue
        if student in where and where[student] != prefix:
            keep = min(where[student], prefix, key=lambda p: (len(p), p))
            drop = prefix if keep == where[student] else where[student]
            warnings.append(f"{student}: also found under {shown('/'.join(drop))[:200]}; "
                            f"collected from {shown('/'.join(keep))[:200]} only")
            if keep != where[student]:
                by_student[student], skipped[student], where[student] = [], [], keep
            if prefix != keep:
                continue
        where[student] = prefix
        files = by_student.setdefault(student, [])  # collected even if every file is skipped,
        note = over_cap(rel, size)                  # so grading says why, in the grades
        if note:
            warnings.append(f"{student}: skipped {shown(rel)[:200]} "
                            f"({size / 2**20:.0f} MB > {MAX_FILE_MB} MB)")
            skipped.setdefault(student, []).append(note)
            continue
        files.append((rel, opener, size))
    return by_student, list(dict.fromkeys(warnings)), skipped


def over_cap(rel: PurePosixPath, size: int) -> str | None:
    """What the student reads about a file left out for its size (None: under the cap)."""
    if size <= MAX_FILE_MB * 2**20:
        return None
    return (f"{shown(rel)[:200]} was not collected: it is {size / 2**20:.0f} MB, over the "
            f"{MAX_FILE_MB} MB limit per file; clear its outputs (Edit > Clear All Outputs), "
            "save, and submit again")


def notes_path(dest: Path) -> Path:
    """Where collect leaves what it left out of one collection, for grading to report: beside
    the folder, like the timestamp, so the folder holds only what the student submitted."""
    return dest.parent / f".{dest.name}.not-collected.json"


def collect_notes(dest: Path) -> list[str]:
    """What collect left out of the collection at ``dest`` (empty when nothing)."""
    try:
        notes = json.loads(notes_path(dest).read_text())
    except (OSError, ValueError):
        return []
    return [str(n) for n in notes] if isinstance(notes, list) else []


def write_notes(dest: Path, notes: list[str]) -> None:
    """Record what was left out of the collection at ``dest`` (see collect_notes)."""
    path = notes_path(dest)
    if notes:
        path.write_text(json.dumps(notes))
    else:
        path.unlink(missing_ok=True)   # a later good collection leaves no stale note


def _collect_one(dest: Path, files: list, notes: list[str]) -> str:
    """Copy one student's files into place and record ``notes`` (files left out) beside
    them; '' on success, else the reason it failed."""
    partial = dest.with_name(dest.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    total = 0
    try:
        partial.mkdir(parents=True)
        for rel, opener, _ in files:
            target = partial / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            with opener() as src, open(target, "wb") as out:  # type: ignore[operator]
                total += copy_capped(src, out, MAX_FILE_MB * 2**20)
            if total > MAX_STUDENT_MB * 2**20:
                raise CourseError(f"upload larger than {MAX_STUDENT_MB} MB")
    except (CourseError, OSError, zipfile.BadZipFile, zlib.error, EOFError,
            NotImplementedError, RuntimeError, ValueError) as e:
        shutil.rmtree(partial, ignore_errors=True)
        return f"{type(e).__name__}: {str(e)[:200]}"
    if dest.exists():
        shutil.rmtree(dest)  # the latest good collection replaces the previous one
    partial.rename(dest)
    _write_timestamp(dest)
    write_notes(dest, notes)
    return ""


def _write_timestamp(dest: Path) -> None:
    # nbgrader's convention: the collection time, outside the notebook folder's own files.
    stamp = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    (dest.parent / f".{dest.name}.timestamp").write_text(stamp + "\n")


def copy_capped(src, out, cap: int) -> int:
    """Copy the open file ``src`` into ``out`` in 1 MiB chunks and return the bytes copied,
    failing once they pass ``cap``; pipeline.exchange copies learners' files with it too."""
    n = 0
    while chunk := src.read(1 << 20):
        n += len(chunk)
        if n > cap:
            raise CourseError(f"a file grew past {cap // 2**20} MB while extracting")
        out.write(chunk)
    return n


def _folder_entries(root: Path):
    for path in sorted(root.rglob("*")):
        if path.is_symlink() or not path.is_file():
            continue
        rel = path.relative_to(root)
        yield rel.parts, (lambda p=path: open(p, "rb")), path.stat().st_size


def _zip_entries(path: Path):
    try:
        zf = zipfile.ZipFile(path)
    except zipfile.BadZipFile:
        raise CourseError(f"{path} is neither a folder nor a zip file") from None
    for info in zf.infolist():
        if info.is_dir():
            continue
        parts = PurePosixPath(info.filename.replace("\\", "/")).parts
        if not parts or parts[0] == "/" or ".." in parts:
            continue
        if (info.external_attr >> 16) & 0o170000 == 0o120000:  # symlink entry
            continue
        yield parts, (lambda i=info: zf.open(i)), info.file_size
