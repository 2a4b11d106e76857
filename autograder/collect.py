"""Collect submissions from a folder or a zip laid out STUDENT/ASSIGNMENT/NOTEBOOK.ipynb.

LMS exports often wrap that layout in one or more extra folders, so we look for the
ASSIGNMENT folder at any depth and take the folder above it as the student. Paths are
checked (no ``..``, no absolute names, no links) and sizes capped, since a zip is as
untrusted as the notebooks in it.
"""
from __future__ import annotations

import shutil
import time
import zipfile
from pathlib import Path, PurePosixPath

from .course import Course, CourseError, safe_name

MAX_FILE_MB = 50
MAX_TOTAL_MB = 2000


def collect(course: Course, assignment: str, source: Path) -> tuple[list[str], list[str]]:
    """Copy submissions into grading/submitted/; return (students collected, warnings)."""
    course.check_assignment(assignment)
    source = Path(source)
    if not source.exists():
        raise CourseError(f"{source} does not exist")
    entries = list(_zip_entries(source) if source.is_file() else _folder_entries(source))
    by_student: dict[str, list[tuple[PurePosixPath, object]]] = {}
    warnings: list[str] = []
    for parts, opener, size in entries:
        if assignment not in parts[:-1]:
            continue
        i = len(parts) - 2 - list(reversed(parts[:-1])).index(assignment)
        if i < 1:
            continue
        student, rel = parts[i - 1], PurePosixPath(*parts[i + 1:])
        if not safe_name(student):
            warnings.append(f"skipped folder {student!r}: not a valid student id")
            continue
        if any(p in ("..", "") or p.startswith("/") for p in rel.parts) or "__MACOSX" in parts:
            continue
        if size > MAX_FILE_MB * 2**20:
            warnings.append(f"{student}: skipped {rel} ({size / 2**20:.0f} MB > {MAX_FILE_MB} MB)")
            continue
        by_student.setdefault(student, []).append((rel, opener))
    if not by_student:
        raise CourseError(f"no submissions for {assignment} found in {source}; expected "
                          f"STUDENT/{assignment}/NOTEBOOK.ipynb")
    total = 0
    for student, files in sorted(by_student.items()):
        dest = course.submitted / student / assignment
        if dest.exists():
            shutil.rmtree(dest)  # the latest collection replaces the previous one
        dest.mkdir(parents=True)
        for rel, opener in files:
            target = dest / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            with opener() as src, open(target, "wb") as out:  # type: ignore[operator]
                total += _copy_capped(src, out, MAX_FILE_MB * 2**20)
            if total > MAX_TOTAL_MB * 2**20:
                raise CourseError(f"collection larger than {MAX_TOTAL_MB} MB; stopped")
        _write_timestamp(dest)
    return sorted(by_student), warnings


def _write_timestamp(dest: Path) -> None:
    # nbgrader's convention: the collection time, outside the notebook folder's own files.
    stamp = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    (dest.parent / f".{dest.name}.timestamp").write_text(stamp + "\n")


def _copy_capped(src, out, cap: int) -> int:
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
