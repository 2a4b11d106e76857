"""The instructor's flow through nbgrader's exchange (autograder/pipeline/exchange.py), as one Unix user:
release into the exchange, a student's fetch and submit with nbgrader's own exchange classes,
collect (latest per student, late marked), return feedback where nbgrader's fetch_feedback
finds it; and each bad input's error. Real accounts and permissions: tests/test_hub.py.

About 30 s on 2 cores (one nbgrader release).
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import nbformat
import pytest

from autograder.cli import main as cli
from autograder.pipeline.course import Course, CourseError
from autograder.pipeline.exchange import (collect_from_exchange, release_to_exchange, return_feedback,
                                 settings)

ROOT = Path(__file__).resolve().parents[1]
NAME = "kv_cache_basics"
ANSWER = "return 2 * layers * tokens * kv_heads * head_dim * bytes_per_elem"


@pytest.fixture(scope="module")
def released(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Course, Path]]:
    """A course with kv_cache_basics released into a fresh exchange (shared: release is slow)."""
    base = Path(tempfile.mkdtemp(prefix="ex-"))  # short: nbgrader paths end up in messages
    course_dir = base / "course"
    (course_dir / "solutions").mkdir(parents=True)
    shutil.copy(ROOT / "nbgrader_config.py", course_dir)
    shutil.copytree(ROOT / "solutions" / NAME, course_dir / "solutions" / NAME)
    exchange = base / "exchange"
    exchange.mkdir()
    exchange.chmod(0o777)
    course = Course(course_dir)
    release_to_exchange(course, NAME, root=exchange)
    try:
        yield course, exchange
    finally:
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def fresh(released: tuple[Course, Path]) -> Iterator[tuple[Course, Path]]:
    """The released course with an empty inbound/ and no collected work (per test)."""
    course, exchange = released
    ex = settings(course, exchange)
    yield course, exchange
    for folder in (ex.inbound, ex.feedback):
        for entry in folder.iterdir() if folder.is_dir() else []:
            shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
    shutil.rmtree(course.work / "submitted", ignore_errors=True)
    shutil.rmtree(course.work / "exchange", ignore_errors=True)
    shutil.rmtree(course.work / "feedback", ignore_errors=True)


def nbgrader_step(cls, course: Course, exchange: Path, student: str, home: Path, **traits):
    """One of a student's steps (fetch, submit, fetch_feedback) with nbgrader's own classes,
    as the Assignments tab runs them, in the student's folder ``home``."""
    from nbgrader.auth import Authenticator
    from nbgrader.coursedir import CourseDirectory
    from traitlets.config import Config

    cfg = Config()
    cfg.CourseDirectory.course_id = "tinyserve"
    cfg.CourseDirectory.root = str(home)
    cfg.Exchange.root = str(exchange)
    cfg.Exchange.cache = str(home / ".nbgrader_cache")
    cfg.Exchange.assignment_dir = str(home)
    cd = CourseDirectory(config=cfg)
    cd.assignment_id = NAME
    cd.student_id = student
    old = os.getcwd()
    os.chdir(home)   # submit reads ./ASSIGNMENT
    try:
        cls(coursedir=cd, authenticator=Authenticator(config=cfg), config=cfg, **traits).start()
    finally:
        os.chdir(old)


def fetch_and_submit(course: Course, exchange: Path, student: str, home: Path,
                     answer: str | None = ANSWER) -> None:
    from nbgrader.exchange.default import ExchangeFetchAssignment, ExchangeSubmit
    home.mkdir(parents=True, exist_ok=True)
    if not (home / NAME).exists():
        nbgrader_step(ExchangeFetchAssignment, course, exchange, student, home)
    path = home / NAME / f"{NAME}.ipynb"
    nb = nbformat.read(path, as_version=4)
    if answer:
        cell = next(c for c in nb.cells if "def kv_bytes(" in c.source)
        cell.source = ("def kv_bytes(layers, tokens, kv_heads, head_dim, bytes_per_elem):\n"
                       f"    {answer}")
    nbformat.write(nb, path)
    nbgrader_step(ExchangeSubmit, course, exchange, student, home)


def test_release_collect_and_return_feedback_round_trip(fresh, tmp_path: Path) -> None:
    from nbgrader.exchange.default import ExchangeFetchFeedback
    course, exchange = fresh
    ex = settings(course, exchange)
    assert (ex.outbound / NAME / f"{NAME}.ipynb").is_file()
    assert "BEGIN SOLUTION" not in (ex.outbound / NAME / f"{NAME}.ipynb").read_text()
    # nbgrader's modes: inbound writable, not listable; outbound readable.
    assert (ex.inbound.stat().st_mode & 0o777) == 0o733
    assert (ex.outbound.stat().st_mode & 0o777) == 0o755

    fetch_and_submit(course, exchange, "ada", tmp_path / "ada", answer="return 0")
    fetch_and_submit(course, exchange, "ada", tmp_path / "ada")          # the latest counts
    fetch_and_submit(course, exchange, "bob", tmp_path / "bob")
    collected, warnings = collect_from_exchange(course, NAME, root=exchange, check_owner=False)
    assert [c.student for c in collected] == ["ada", "bob"] and warnings == []
    graded = (course.submitted / "ada" / NAME / f"{NAME}.ipynb").read_text()
    assert ANSWER in graded and "return 0" not in graded
    # nbgrader's timestamp stays with the submission; the feedback key does not.
    stamp = (course.submitted / "ada" / NAME / "timestamp.txt").read_text()
    assert stamp == collected[0].timestamp
    assert not (course.submitted / "ada" / NAME / "submission_secret.txt").exists()

    # The instructor's feedback page goes back where the student's Fetch Feedback looks.
    page = course.feedback / "ada" / NAME / f"{NAME}.html"
    page.parent.mkdir(parents=True)
    page.write_text("<html><body>Score: 16.0 / 22.0</body></html>")
    returned, warnings = return_feedback(course, NAME, root=exchange)
    assert returned == ["ada"] and warnings == []
    nbgrader_step(ExchangeFetchFeedback, course, exchange, "ada", tmp_path / "ada")
    fetched = list((tmp_path / "ada" / NAME / "feedback").glob(f"*/{NAME}.html"))
    assert len(fetched) == 1 and "Score: 16.0 / 22.0" in fetched[0].read_text()
    # Nothing for bob (no page yet), and the feedback folder cannot be listed.
    assert not (tmp_path / "bob" / NAME / "feedback").exists()
    assert (ex.feedback.stat().st_mode & 0o777) == 0o711


def test_late_submissions_are_marked_with_nbgraders_timestamp(fresh, tmp_path: Path,
                                                              capsys) -> None:
    course, exchange = fresh
    fetch_and_submit(course, exchange, "ada", tmp_path / "ada")
    # The due date is ada's submission time (in the gradebook, where nbgrader keeps it):
    # bob's, later, is late.
    from nbgrader.api import Gradebook
    from nbgrader.utils import parse_utc
    ada_stamp = (next(settings(course, exchange).inbound.iterdir()) / "timestamp.txt").read_text()
    with Gradebook(course.db_url) as gb:
        gb.update_or_create_assignment(NAME, duedate=parse_utc(ada_stamp))
    fetch_and_submit(course, exchange, "bob", tmp_path / "bob")
    try:
        assert cli(["--root", str(course.root), "collect", NAME, "--from-exchange",
                    "--exchange", str(exchange), "--no-check-owner"]) == 0
    finally:
        with Gradebook(course.db_url) as gb:
            gb.update_or_create_assignment(NAME, duedate=None)
    out = capsys.readouterr().out
    ada = next(line for line in out.splitlines() if line.startswith("ada "))
    bob = next(line for line in out.splitlines() if line.startswith("bob "))
    assert "LATE" not in ada and ada_stamp in ada
    assert "LATE by 0 h 00 min" in bob
    assert "collected 2 submission(s)" in out


def test_bad_inputs_get_clear_errors(fresh, tmp_path: Path) -> None:
    course, exchange = fresh
    # An assignment never released to the exchange (but known to the course).
    shutil.copytree(course.source / NAME, course.source / "other_assignment")
    try:
        with pytest.raises(CourseError, match=r"other_assignment is not in the exchange .*"
                                              r"released: kv_cache_basics.*release-exchange"):
            collect_from_exchange(course, "other_assignment", root=exchange, check_owner=False)
    finally:
        shutil.rmtree(course.source / "other_assignment")
    # Nobody has submitted yet; then a named student without a submission.
    with pytest.raises(CourseError, match="no submissions of kv_cache_basics"):
        collect_from_exchange(course, NAME, root=exchange, check_owner=False)
    fetch_and_submit(course, exchange, "ada", tmp_path / "ada")
    with pytest.raises(CourseError, match=r"cy has no submission of kv_cache_basics .*"
                                          r"submitted: ada"):
        collect_from_exchange(course, NAME, root=exchange, students=["cy"], check_owner=False)
    # No feedback to return yet.
    with pytest.raises(CourseError, match="no feedback for kv_cache_basics.*autograder feedback"):
        return_feedback(course, NAME, root=exchange)


def _plant(exchange: Path, name: str, files: dict[str, str]) -> Path:
    folder = exchange / "tinyserve" / "inbound" / name
    folder.mkdir()
    for rel, text in files.items():
        (folder / rel).write_text(text)
    return folder


def test_hostile_or_broken_submissions_are_skipped_with_a_reason(fresh, tmp_path: Path) -> None:
    course, exchange = fresh
    fetch_and_submit(course, exchange, "ada", tmp_path / "ada")
    stamp = "2026-12-01 00:00:00.000000 UTC"
    _plant(exchange, f"bob+{NAME}+{stamp}+x1", {f"{NAME}.ipynb": "this is not json"})
    _plant(exchange, f"cy+{NAME}+{stamp}+x2", {"answers.txt": "42"})
    linked = _plant(exchange, f"dee+{NAME}+{stamp}+x3", {f"{NAME}.ipynb": json.dumps(
        nbformat.v4.new_notebook())})
    (linked / "data.csv").symlink_to(course.root / "nbgrader_config.py")
    _plant(exchange, f"eve+{NAME}+not-a-date+x4", {})        # junk: must not stop the class
    _plant(exchange, f"..+{NAME}+{stamp}+x5", {})
    collected, warnings = collect_from_exchange(course, NAME, root=exchange, check_owner=False)
    assert [c.student for c in collected] == ["ada"]
    text = "\n".join(warnings)
    assert f"bob: '{NAME}.ipynb' is not a notebook" in text
    assert "cy: the submission has no notebook (.ipynb); not collected" in text
    assert "dee: it holds a link ('data.csv'); not collected" in text
    assert "its timestamp is not a date" in text and "not a valid student id" in text
    assert not (course.submitted / "dee").exists()
    # With the owner check on (the default), a folder owned by another account is refused:
    # here every folder belongs to the test's user, not to the student it names.
    collected, warnings = collect_from_exchange(course, NAME, root=exchange)
    assert collected == [] and any("ada: submitted in ada's name by" in w for w in warnings)


def test_an_exchange_with_wrong_permissions_is_refused(fresh) -> None:
    course, exchange = fresh
    ex = settings(course, exchange)
    for path, mode, fix in ((exchange, 0o755, "chmod 0777"), (ex.inbound, 0o777, "chmod 2733"),
                            (ex.feedback, 0o755, "chmod 0711")):
        path.mkdir(exist_ok=True)
        before = path.stat().st_mode & 0o7777
        path.chmod(mode)
        try:
            with pytest.raises(CourseError, match=fix):
                collect_from_exchange(course, NAME, root=exchange, check_owner=False)
        finally:
            path.chmod(before)
    with pytest.raises(CourseError, match=r"no exchange at .*/missing.*chmod 0777"):
        collect_from_exchange(course, NAME, root=exchange.parent / "missing")


def test_the_cli_keeps_the_zip_flow_and_names_flag_mixups(fresh, capsys) -> None:
    course, exchange = fresh
    root = ["--root", str(course.root)]
    assert cli([*root, "collect", NAME]) == 2
    assert "collect needs SOURCE (a folder or zip), or --from-exchange" in capsys.readouterr().err
    assert cli([*root, "collect", NAME, "some.zip", "--from-exchange"]) == 2
    assert "give SOURCE or --from-exchange, not both" in capsys.readouterr().err
    assert cli([*root, "collect", NAME, "x.zip", "--student", "ada"]) == 2
    assert "go with --from-exchange" in capsys.readouterr().err
    assert cli([*root, "release-exchange", NAME, "--exchange", str(exchange),
                "--due", "someday"]) == 2
    assert "--due 'someday' is not a date" in capsys.readouterr().err
