"""The course directory: where nbgrader's source, release and working folders live.

The repository root is an nbgrader course. ``solutions/`` is the source directory (notebooks
with solutions and hidden tests), ``exercises/`` the release directory (what learners get), and
everything produced while grading (submissions, autograded copies, feedback, the gradebook,
its backups and our per-submission results) lives under the git-ignored ``grading/``.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import nbformat


# Student and assignment names become path components; anything else is refused.
SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.@+-]{0,99}$")

NBGRADER_CELL_KEYS = ("grade", "solution", "locked", "grade_id")


class CourseError(Exception):
    """A problem the instructor can fix; the message says what to do."""


def safe_name(name: str) -> bool:
    return bool(SAFE_NAME.match(name)) and ".." not in name


@dataclass(frozen=True)
class Course:
    root: Path

    @classmethod
    def find(cls, root: str | os.PathLike | None = None) -> "Course":
        if root is not None:
            return cls(Path(root).resolve())
        here = Path.cwd().resolve()
        for folder in (here, *here.parents):
            if (folder / "nbgrader_config.py").exists() and (folder / "solutions").is_dir():
                return cls(folder)
        raise CourseError("no course directory found (a folder with nbgrader_config.py and "
                          "solutions/); run from the repository root or pass --root")

    # Layout ---------------------------------------------------------------------------------
    @property
    def source(self) -> Path:
        return self.root / "solutions"

    @property
    def release(self) -> Path:
        return self.root / "exercises"

    @property
    def work(self) -> Path:
        return self.root / "grading"

    @property
    def submitted(self) -> Path:
        return self.work / "submitted"

    @property
    def autograded(self) -> Path:
        return self.work / "autograded"

    @property
    def feedback(self) -> Path:
        return self.work / "feedback"

    @property
    def results(self) -> Path:
        return self.work / "results"

    @property
    def backups(self) -> Path:
        return self.work / "backups"

    @property
    def gradebook_path(self) -> Path:
        return self.work / "gradebook.db"

    @property
    def db_url(self) -> str:
        return f"sqlite:///{self.gradebook_path}"

    def assignments(self) -> list[str]:
        if not self.source.is_dir():
            return []
        return sorted(p.name for p in self.source.iterdir()
                      if p.is_dir() and any(p.glob("*.ipynb")) and safe_name(p.name))

    def check_assignment(self, name: str) -> None:
        if name not in self.assignments():
            known = ", ".join(self.assignments()) or "none"
            raise CourseError(f"unknown assignment {name!r}; assignments in "
                              f"{self.source}: {known}")

    def notebooks(self, assignment: str) -> list[str]:
        """Notebook names (without .ipynb) of an assignment, from its source folder."""
        return sorted(p.stem for p in (self.source / assignment).glob("*.ipynb"))

    def support_files(self, assignment: str) -> list[Path]:
        """Released non-notebook files (data the notebook reads), relative to the folder."""
        folder = self.release / assignment
        if not folder.is_dir():
            return []
        return sorted(p.relative_to(folder) for p in folder.rglob("*")
                      if p.is_file() and p.suffix != ".ipynb"
                      and ".ipynb_checkpoints" not in p.parts)

    def nbgrader_args(self, *, db_url: str | None = None,
                      release_dir: str = "exercises") -> list[str]:
        """Command-line config that makes any nbgrader app see this layout."""
        return [f"--CourseDirectory.root={self.root}",
                "--CourseDirectory.source_directory=solutions",
                f"--CourseDirectory.release_directory={release_dir}",
                "--CourseDirectory.submitted_directory=grading/submitted",
                "--CourseDirectory.autograded_directory=grading/autograded",
                "--CourseDirectory.feedback_directory=grading/feedback",
                f"--CourseDirectory.db_url={db_url or self.db_url}",
                # Rubrics sit in mark-scheme regions of locked question cells (not task cells).
                "--ClearMarkScheme.enforce_metadata=False"]


# Release ------------------------------------------------------------------------------------

def run_nbgrader(course: Course, *args: str, db_url: str | None = None,
                 release_dir: str = "exercises") -> str:
    cmd = [sys.executable, "-m", "nbgrader", *args,
           *course.nbgrader_args(db_url=db_url, release_dir=release_dir)]
    # nbgrader runs the ``alembic`` script of its own environment, so that must be on PATH.
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    proc = subprocess.run(cmd, cwd=course.root, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-15:]
        raise CourseError(f"nbgrader {args[0]} failed:\n" + "\n".join(tail))
    return proc.stdout + proc.stderr


def release(course: Course, assignment: str, *, out_dir: Path | None = None,
            db_url: str | None = None) -> Path:
    """Generate the learner version of ``assignment`` (solutions and hidden tests removed).

    Writes to ``exercises/ASSIGNMENT`` (or ``out_dir/ASSIGNMENT``) and records the assignment's
    cells in the gradebook, which autograde needs. Output is deterministic, so the committed
    ``exercises/`` can be compared with a fresh release.
    """
    course.check_assignment(assignment)
    course.work.mkdir(parents=True, exist_ok=True)
    args = ["generate_assignment", assignment, "--force", "--create"]
    release_dir = str(Path(out_dir).resolve()) if out_dir is not None else "exercises"
    run_nbgrader(course, *args, db_url=db_url, release_dir=release_dir)
    target = (Path(out_dir) if out_dir is not None else course.release) / assignment
    for nb_path in target.glob("*.ipynb"):
        _normalise(nb_path)
    return target


def _normalise(path: Path) -> None:
    """Rewrite a notebook in one canonical form so releases are byte-for-byte reproducible."""
    nb = nbformat.read(path, as_version=4)
    nbformat.write(nb, path)


def ensure_in_gradebook(course: Course, assignment: str) -> None:
    """Make sure the gradebook knows the assignment's current cells and points.

    A fresh clone has no gradebook, and a source notebook edited since the last release has
    different cells; either way nbgrader records the assignment again (into a throwaway
    release folder, so exercises/ is untouched).
    """
    from nbgrader.api import Gradebook, MissingEntry

    want = {}
    for name in course.notebooks(assignment):
        nb = grader_template(course, assignment, name)
        want[name] = sorted((c.metadata["nbgrader"]["grade_id"],
                             float(c.metadata["nbgrader"].get("points", 0)))
                            for c in nb.cells
                            if c.get("metadata", {}).get("nbgrader", {}).get("grade"))
    if course.gradebook_path.exists():
        with Gradebook(course.db_url) as gb:
            try:
                a = gb.find_assignment(assignment)
                have = {n.name: sorted((g.name, float(g.max_score)) for g in n.grade_cells)
                        for n in a.notebooks}
                if have == want:
                    return
            except MissingEntry:
                pass
    with tempfile.TemporaryDirectory() as tmp:
        release(course, assignment, out_dir=Path(tmp))


# Grader template ----------------------------------------------------------------------------

def grader_template(course: Course, assignment: str, notebook: str) -> nbformat.NotebookNode:
    """The notebook autograde executes: solutions cleared, hidden tests kept, cells locked.

    Built with nbgrader's own preprocessors from the source notebook, the same way release
    builds the learner copy, minus the step that strips hidden tests.
    """
    from nbgrader.preprocessors import (ClearOutput, ClearSolutions, ComputeChecksums,
                                        LockCells)
    path = course.source / assignment / f"{notebook}.ipynb"
    nb = nbformat.read(path, as_version=4)
    resources: dict = {}
    for pp in (LockCells(), ClearSolutions(), ClearOutput(), ComputeChecksums()):
        nb, resources = pp.preprocess(nb, resources)
    return nb


def hidden_test_lines(course: Course, assignment: str) -> set[str]:
    """Source lines that appear only inside hidden-test or solution regions (for leak checks)."""
    secret: set[str] = set()
    public: set[str] = set()
    for nb_path in (course.source / assignment).glob("*.ipynb"):
        nb = nbformat.read(nb_path, as_version=4)
        for cell in nb.cells:
            inside = None
            for line in cell.source.splitlines():
                s = line.strip()
                if "### BEGIN HIDDEN TESTS" in s or "### BEGIN SOLUTION" in s:
                    inside = s
                    continue
                if "### END HIDDEN TESTS" in s or "### END SOLUTION" in s:
                    inside = None
                    continue
                (secret if inside else public).add(s)
    # Lines too short to identify anything (``return x``, ``pass``) or also public are ignored.
    return {s for s in secret - public if len(s) >= 24}


def write_json(path: Path, data: object) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
    os.replace(tmp, path)
