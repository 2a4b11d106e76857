"""The landing page (what `make lab` opens) lists every chapter and every graded exercise,
and every link on it opens a file that exists."""
from __future__ import annotations

import re
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "START_HERE.ipynb"


def _text() -> str:
    nb = nbformat.read(PAGE, as_version=4)
    assert all(c.cell_type == "markdown" for c in nb.cells), "the landing page runs no code"
    return "\n".join(c.source for c in nb.cells)


def test_every_link_resolves() -> None:
    links = re.findall(r"\]\(([^)#]+)\)", _text())
    assert links
    missing = [link for link in links if not (ROOT / link).exists()]
    assert not missing, f"START_HERE.ipynb links to files that do not exist: {missing}"


def test_every_chapter_and_exercise_is_listed() -> None:
    text = _text()
    chapters = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "course").glob("*.ipynb"))
    exercises = sorted(p.relative_to(ROOT).as_posix()
                       for p in (ROOT / "exercises").glob("*/*.ipynb"))
    assert [c for c in chapters if f"({c})" not in text] == []
    assert [e for e in exercises if f"({e})" not in text] == []


# --- the four-hour path and the deep path's times ---------------------------------------------

from tinyserve.workbook.study_time import estimate, stated_minutes  # noqa: E402


def _source_of(link: str) -> Path:
    """The notebook a link's time is estimated from: a chapter, or an exercise's source."""
    return ROOT / (link if link.startswith("course/") else "solutions/" + link.split("/", 1)[1])


def test_deep_path_times_are_the_estimates() -> None:
    rows = re.findall(r"\]\(((?:course|exercises)/[^)]+\.ipynb)\)(?: \|[^|\n]*)? \| (\d+) min \|",
                      _text())
    listed = {link for link, _ in rows}
    assert len(listed) == len(list((ROOT / "course").glob("*.ipynb"))) + \
        len(list((ROOT / "exercises").glob("*/*.ipynb")))
    wrong = {link: (int(m), estimate(_source_of(link)).minutes) for link, m in rows
             if int(m) != estimate(_source_of(link)).minutes}
    assert not wrong, f"START_HERE times (listed, estimated) are stale: {wrong}"


def test_every_notebook_states_its_estimated_time_at_the_top() -> None:
    for path in sorted((ROOT / "course").glob("*.ipynb")) + sorted(ROOT.glob("solutions/*/*.ipynb")):
        assert stated_minutes(path) == estimate(path).minutes, \
            f"{path.relative_to(ROOT)}: states {stated_minutes(path)} min, estimate {estimate(path).minutes}"
    for path in sorted(ROOT.glob("exercises/*/*.ipynb")):
        source = ROOT / "solutions" / path.parent.name / path.name
        assert stated_minutes(path) == stated_minutes(source), path


def test_the_four_hour_path_adds_up_to_the_outline() -> None:
    path = _text().split("## The four-hour path", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"^\| \d\. [^|]+\| (\d+) min \|", path, re.M)
    assert [int(b) for b in blocks] == [30, 140, 50, 20]


def test_quoted_totals_follow_the_tables() -> None:
    text = _text()
    chapters = sum(estimate(p).minutes for p in (ROOT / "course").glob("*.ipynb"))
    exercises = sum(estimate(p).minutes for p in ROOT.glob("solutions/*/*.ipynb"))
    assert f"The chapters take about {chapters} min together" in text
    assert f"The exercises take about {exercises} min together" in text
    assert f"about {round((chapters + exercises) / 60)} hours" in text
