"""The instructor's side of nbgrader's exchange: release, collect, return feedback.

On a class hub, students fetch and submit from JupyterLab's Assignments tab, which moves
folders through nbgrader's exchange (a shared directory, ``Exchange.root``)::

    ROOT/COURSE/outbound/ASSIGNMENT/            released notebooks        (instructor 0755)
    ROOT/COURSE/inbound/STUDENT+ASSIGNMENT+TIMESTAMP+RANDOM/   submissions (2733: no listing)
    ROOT/COURSE/feedback/HASH.html              returned feedback         (0711: by name only)

Release and feedback go through nbgrader's own exchange classes (ExchangeReleaseAssignment,
ExchangeReleaseFeedback), so the layout, permissions and the hash a student's
``fetch_feedback`` looks for are nbgrader's. Collection picks the latest submission per student
the way nbgrader's ExchangeCollect does, but copies it itself: the inbound folder is writable by
every student, so one student's junk entry (which stops ExchangeCollect for the whole class), a
symlink to the instructor's files, or a folder submitted in someone else's name must be refused
per submission, with a warning, rather than copied with the instructor's rights.
"""
from __future__ import annotations

import datetime as dt
import logging
import os
import pwd
import shutil
import stat
import sys
from dataclasses import dataclass, field
from pathlib import Path

import nbformat

from autograder.pipeline.collect import MAX_FILE_MB, MAX_STUDENT_MB, copy_capped, over_cap, write_notes
from autograder.pipeline.course import Course, CourseError, ensure_in_gradebook, release, safe_name
from autograder.submitted.shown import shown

DEFAULT_ROOT = "/usr/local/share/nbgrader/exchange"   # nbgrader's own default
DEFAULT_COURSE_ID = "tinyserve"
SECRET = "submission_secret.txt"
TIMESTAMP = "timestamp.txt"
# What nbgrader sets (exchange/default/*.py); anything looser lets students see each other.
ROOT_MODE = 0o777
INBOUND_NO_READ = 0o004      # others must not list inbound/ (it names every submission)
FEEDBACK_NO_READ = 0o004     # others must not list feedback/ (names are per-student hashes)

log = logging.getLogger("autograder.pipeline.exchange")


@dataclass(frozen=True)
class ExchangeSettings:
    root: Path
    course_id: str

    @property
    def course_dir(self) -> Path:
        return self.root / self.course_id

    @property
    def inbound(self) -> Path:
        return self.course_dir / "inbound"

    @property
    def outbound(self) -> Path:
        return self.course_dir / "outbound"

    @property
    def feedback(self) -> Path:
        return self.course_dir / "feedback"


@dataclass
class Collected:
    student: str
    timestamp: str                       # as nbgrader's submit wrote it
    late_by: dt.timedelta | None = None  # None: on time, or no due date
    notes: list[str] = field(default_factory=list)


# Configuration ------------------------------------------------------------------------------

def nbgrader_config(course: Course):  # -> traitlets.config.Config
    """nbgrader's configuration as nbgrader itself would load it for this course: every
    nbgrader_config.py on Jupyter's config path (the hub's role folders set Exchange.root
    there), then the course's own, which wins."""
    from jupyter_core.paths import jupyter_config_path
    from traitlets.config import Config
    from traitlets.config.loader import PyFileConfigLoader, ConfigFileNotFound

    cfg = Config()
    for folder in [*reversed(jupyter_config_path()), str(course.root)]:
        try:
            cfg.merge(PyFileConfigLoader("nbgrader_config.py", path=folder).load_config())
        except ConfigFileNotFound:
            continue
    return cfg


def settings(course: Course, root: str | os.PathLike | None = None) -> ExchangeSettings:
    cfg = nbgrader_config(course)
    if root is None:
        root = cfg.Exchange.get("root", DEFAULT_ROOT) if "Exchange" in cfg else DEFAULT_ROOT
    course_id = (cfg.CourseDirectory.get("course_id") if "CourseDirectory" in cfg else None) \
        or DEFAULT_COURSE_ID
    return ExchangeSettings(Path(root), course_id)


def _coursedir(course: Course, ex: ExchangeSettings, assignment: str, student: str = "*"):
    """nbgrader's CourseDirectory with this course's layout (as Course.nbgrader_args)."""
    from nbgrader.coursedir import CourseDirectory
    from traitlets.config import Config

    cfg = Config()
    cfg.CourseDirectory.root = str(course.root)
    cfg.CourseDirectory.course_id = ex.course_id
    cfg.CourseDirectory.source_directory = "solutions"
    cfg.CourseDirectory.release_directory = "exercises"
    cfg.CourseDirectory.submitted_directory = "grading/submitted"
    cfg.CourseDirectory.autograded_directory = "grading/autograded"
    cfg.CourseDirectory.feedback_directory = "grading/feedback"
    cfg.CourseDirectory.db_url = course.db_url
    cd = CourseDirectory(config=cfg)
    cd.assignment_id = assignment
    cd.student_id = student
    return cd, cfg


def _run_exchange(cls, course: Course, ex: ExchangeSettings, assignment: str,
                  student: str = "*", **traits) -> None:
    """Run one of nbgrader's exchange steps; its failure message becomes a CourseError."""
    from nbgrader.exchange import ExchangeError

    cd, cfg = _coursedir(course, ex, assignment, student)
    cfg.Exchange.root = str(ex.root)
    step = cls(coursedir=cd, config=cfg, **traits)
    step.log = log
    try:
        step.start()
    except ExchangeError as err:
        raise CourseError(f"nbgrader's exchange refused: {err}") from None


# Permissions --------------------------------------------------------------------------------

def check_permissions(ex: ExchangeSettings) -> None:
    """Refuse an exchange whose permissions would let students reach each other's work."""
    root = ex.root
    if not root.is_dir() or root.is_symlink():
        raise CourseError(
            f"no exchange at {root}: create it as root with `mkdir -p {root} && chmod 0777 "
            f"{root}` (make hub does), or pass --exchange / set Exchange.root in "
            "nbgrader_config.py")
    mode = stat.S_IMODE(root.stat().st_mode)
    if mode & ROOT_MODE != ROOT_MODE:
        raise CourseError(f"exchange {root} has mode {mode:o}; nbgrader needs it writable by "
                          f"everyone: chmod 0777 {root}")
    for folder, bit, fix in ((ex.inbound, INBOUND_NO_READ, "2733"),
                             (ex.feedback, FEEDBACK_NO_READ, "0711")):
        if folder.is_dir():
            fmode = stat.S_IMODE(folder.stat().st_mode)
            if fmode & bit:
                raise CourseError(
                    f"{folder} has mode {fmode:o}: every student can list it and so read "
                    f"the others' work; chmod {fix} {folder} (nbgrader's own mode)")


# Release ------------------------------------------------------------------------------------

def release_to_exchange(course: Course, assignment: str, *, root=None,
                        due: str | None = None) -> Path:
    """Regenerate exercises/ASSIGNMENT and put it in the exchange's outbound folder.

    ``due`` (e.g. "2026-12-08 17:00 UTC") goes into the gradebook, as nbgrader keeps it;
    collect then marks later submissions late."""
    from nbgrader.exchange.default import ExchangeReleaseAssignment

    course.check_assignment(assignment)
    when = _parse_due(due) if due is not None else None
    ex = settings(course, root)
    check_permissions(ex)
    release(course, assignment)
    if when is not None:
        from nbgrader.api import Gradebook
        with Gradebook(course.db_url) as gb:
            gb.update_or_create_assignment(assignment, duedate=when)
    _run_exchange(ExchangeReleaseAssignment, course, ex, assignment, force=True)
    return ex.outbound / assignment


def _parse_due(due: str) -> dt.datetime:
    from nbgrader.utils import parse_utc
    try:
        return parse_utc(due)
    except (ValueError, OverflowError):
        raise CourseError(f"--due {due!r} is not a date; write e.g. '2026-12-08 17:00 UTC'") \
            from None


def due_date(course: Course, assignment: str) -> dt.datetime | None:
    from nbgrader.api import Gradebook, MissingEntry
    ensure_in_gradebook(course, assignment)
    with Gradebook(course.db_url) as gb:
        try:
            return gb.find_assignment(assignment).duedate
        except MissingEntry:
            return None


# Collect ------------------------------------------------------------------------------------

def released(ex: ExchangeSettings) -> list[str]:
    if not ex.outbound.is_dir():
        return []
    return sorted(p.name for p in ex.outbound.iterdir() if p.is_dir())


def latest_submissions(ex: ExchangeSettings, assignment: str
                       ) -> tuple[dict[str, tuple[dt.datetime, str, Path]], list[str]]:
    """Each student's latest submission of ``assignment`` in inbound/ (nbgrader's naming:
    STUDENT+ASSIGNMENT+TIMESTAMP[+RANDOM]); malformed entries are skipped with a warning."""
    from nbgrader.utils import parse_utc

    latest: dict[str, tuple[dt.datetime, str, Path]] = {}
    warnings: list[str] = []
    for entry in sorted(ex.inbound.iterdir()):
        parts = entry.name.rsplit("+", 3) if entry.name.count("+") >= 3 \
            else entry.name.rsplit("+", 2)
        if len(parts) < 3 or parts[1] != assignment:
            continue
        student, stamp = parts[0], parts[2]
        shown = repr(entry.name[:80])
        if not safe_name(student):
            warnings.append(f"skipped {shown}: not a valid student id")
            continue
        try:
            when = parse_utc(stamp)
        except (ValueError, OverflowError):
            warnings.append(f"skipped {shown}: its timestamp is not a date")
            continue
        if student not in latest or when > latest[student][0]:
            latest[student] = (when, stamp, entry)
    return latest, warnings


def collect_from_exchange(course: Course, assignment: str, *, root=None,
                          students: list[str] | None = None, check_owner: bool = True
                          ) -> tuple[list[Collected], list[str]]:
    """Copy each student's latest submission into grading/submitted/STUDENT/ASSIGNMENT.

    Returns (collected, warnings). A submission that is not the claimed student's own (by
    its Unix owner), holds a link or a special file, or has no readable notebook is skipped
    with a warning naming the student and why."""
    course.check_assignment(assignment)
    ex = settings(course, root)
    check_permissions(ex)
    if assignment not in released(ex):
        known = ", ".join(released(ex)) or "none"
        raise CourseError(f"{assignment} is not in the exchange {ex.course_dir} (released: "
                          f"{known}); run `python -m autograder release-exchange {assignment}`")
    latest, warnings = latest_submissions(ex, assignment)
    for student in students or []:
        if student not in latest:
            who = ", ".join(sorted(latest)) or "nobody yet"
            raise CourseError(f"{student} has no submission of {assignment} in "
                              f"{ex.inbound} (submitted: {who})")
    if not latest:
        raise CourseError(f"no submissions of {assignment} in {ex.inbound} yet")
    due = due_date(course, assignment)
    collected: list[Collected] = []
    for student in sorted(students or latest):
        when, stamp, src = latest[student]
        problem = _refuse(src, student, check_owner)
        if problem:
            warnings.append(f"{student}: {problem}; not collected")
            continue
        warnings.extend(f"{student}: {note}"
                        for note in _copy_submission(course, assignment, student, src))
        late = when - due if due is not None and when > due else None
        collected.append(Collected(student, stamp, late))
    return collected, warnings


def _refuse(src: Path, student: str, check_owner: bool) -> str | None:
    """Why this submission folder must not be collected, or None."""
    st = src.lstat()
    if not stat.S_ISDIR(st.st_mode):
        return "the submission is not a folder"
    if check_owner:
        owner = _user_name(st.st_uid)
        if owner != student:
            return (f"submitted in {student}'s name by {owner} (pass --no-check-owner when one "
                    "account owns every submission)")
    total = 0
    notebooks = 0
    for dirpath, dirnames, filenames in os.walk(src):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            mode = path.lstat().st_mode
            rel = path.relative_to(src)
            if stat.S_ISLNK(mode):
                return f"it holds a link ({str(rel)[:80]!r})"
            if not (stat.S_ISDIR(mode) or stat.S_ISREG(mode)):
                return f"it holds a special file ({str(rel)[:80]!r})"
            if stat.S_ISREG(mode):
                total += path.lstat().st_size
        if total > MAX_STUDENT_MB * 2**20:
            return f"it is larger than {MAX_STUDENT_MB} MB"
    for nb in sorted(src.glob("*.ipynb")):
        try:
            nbformat.read(nb, as_version=4)
        except Exception as err:  # nbformat raises several kinds for a broken file
            return f"{nb.name[:80]!r} is not a notebook ({type(err).__name__})"
        notebooks += 1
    if not notebooks:
        return "the submission has no notebook (.ipynb)"
    return None


def _user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"


def _copy_submission(course: Course, assignment: str, student: str, src: Path) -> list[str]:
    """Copy one submission into place; returns what was left out (files over the cap)."""
    dest = course.submitted / student / assignment
    if dest.exists():
        shutil.rmtree(dest)   # the latest submission replaces the previous one
    dest.mkdir(parents=True)
    private = course.work / "exchange" / student / assignment
    private.mkdir(parents=True, exist_ok=True)
    left_out: list[str] = []
    for dirpath, dirnames, filenames in os.walk(src):
        dirnames[:] = [d for d in dirnames if d != ".ipynb_checkpoints"]
        for name in filenames:
            path = Path(dirpath) / name
            rel = path.relative_to(src)
            note = over_cap(rel, path.lstat().st_size)
            if note:   # left out, and said in the student's grades (as collect does)
                left_out.append(note)
                continue
            # The secret is the key to the student's feedback: keep it out of the graded
            # folder; the timestamp stays there, where nbgrader's tools look for it.
            target = private / name if rel == Path(SECRET) else dest / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
            with os.fdopen(fd, "rb") as f, open(target, "wb") as out:
                copy_capped(f, out, MAX_FILE_MB * 2**20)
    if (dest / TIMESTAMP).exists():
        shutil.copy(dest / TIMESTAMP, private / TIMESTAMP)
    write_notes(dest, left_out)
    return left_out


# Return feedback ----------------------------------------------------------------------------

def return_feedback(course: Course, assignment: str, *, root=None,
                    students: list[str] | None = None) -> tuple[list[str], list[str]]:
    """Put grading/feedback/STUDENT/ASSIGNMENT/*.html where the student's fetch_feedback
    (the Assignments tab's "Fetch Feedback") finds it. Returns (students, warnings)."""
    from nbgrader.exchange.default import ExchangeReleaseFeedback

    course.check_assignment(assignment)
    ex = settings(course, root)
    check_permissions(ex)
    have = sorted(p.parent.name for p in course.feedback.glob(f"*/{assignment}")
                  if any(p.glob("*.html")))
    if not have:
        raise CourseError(f"no feedback for {assignment} under {course.feedback}; run "
                          f"`python -m autograder feedback {assignment}` first")
    returned, warnings = [], []
    for student in students or have:
        if student not in have:
            raise CourseError(f"no feedback page for {student} on {assignment}")
        private = course.work / "exchange" / student / assignment
        if not (private / SECRET).is_file():
            warnings.append(f"{student}: the submission did not come through the exchange "
                            "(collect --from-exchange); feedback not returned")
            continue
        folder = course.feedback / student / assignment
        for name in (SECRET, TIMESTAMP):
            shutil.copy(private / name, folder / name)
        _run_exchange(ExchangeReleaseFeedback, course, ex, assignment, student)
        returned.append(student)
    return returned, warnings


# Command-line reports (autograder/cli.py) ---------------------------------------------------

def report_collected(course: Course, args) -> int:
    if args.source is not None:
        raise CourseError("give SOURCE or --from-exchange, not both")
    collected, warnings = collect_from_exchange(
        course, args.assignment, root=args.exchange, students=args.student,
        check_owner=not args.no_check_owner)
    for w in warnings:
        print(f"warning: {shown(w)}", file=sys.stderr)
    for c in collected:
        late = f"  LATE by {_duration(c.late_by)}" if c.late_by else ""
        print(f"{c.student:<20} submitted {c.timestamp}{late}")
    print(f"collected {len(collected)} submission(s) of {args.assignment} from the exchange")
    return 0 if collected else 1


def report_returned(course: Course, args) -> int:
    returned, warnings = return_feedback(course, args.assignment, root=args.exchange)
    for w in warnings:
        print(f"warning: {shown(w)}", file=sys.stderr)
    print(f"returned feedback to {len(returned)} student(s) through the exchange: "
          + ", ".join(returned))
    return 0


def _duration(delta: dt.timedelta) -> str:
    minutes = int(delta.total_seconds() // 60)
    days, minutes = divmod(minutes, 24 * 60)
    return (f"{days} d " if days else "") + f"{minutes // 60} h {minutes % 60:02d} min"
