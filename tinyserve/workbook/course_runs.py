"""The course machine's benchmark reports, read where a chapter cites them.

A chapter that compares the learner's run with the course's own (``bench/results/*.json``,
written by ``python -m tinyserve bench SUITE``) reads the figure from the report in a cell,
next to the run's date, commit and load, and never types it into the prose: a rerun that
moves the figure then moves the sentence with it (issue 38). The reports live in the
repository, not in the installed package, so outside a checkout there is nothing to read and
:func:`course_run` says so instead of failing.
"""
from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ..paths import CHECKOUT

#: Where ``bench`` writes its reports, in a checkout.
RESULTS = CHECKOUT / "bench" / "results" if CHECKOUT else None


def course_run(suite: str, results: Path | None = RESULTS) -> dict[str, Any] | None:
    """The stored report ``bench/results/<suite>.json``, or None outside a checkout (or when
    the file is missing): the chapter then prints :func:`missing` and quotes nothing."""
    path = results / f"{suite}.json" if results else None
    if path is None or not path.is_file():
        return None
    return json.loads(path.read_text(encoding="utf-8"))


def missing(suite: str) -> str:
    """What a chapter prints when the course's report for ``suite`` is not here."""
    return (f"The course's bench/results/{suite}.json is not here (outside a checkout of the "
            f"repository): no figure of the course machine to compare with.")


def provenance(report: dict[str, Any]) -> str:
    """One line on where a report comes from: date, commit, cores and how busy the machine
    was (``bench`` records the 1-minute load before and after the run)."""
    machine, load = report.get("machine", {}), report.get("load", {})
    busy = load.get("busy")
    state = "" if busy is None else (", busy" if busy else ", quiet")
    before = load.get("before")
    load_text = f", load {before:.1f}{state}" if isinstance(before, (int, float)) else state
    when = str(report.get("date", "?"))[:16].replace("T", " ")
    return (f"bench {report.get('suite', '?')}, {when} UTC, "
            f"commit {str(report.get('git_commit', '?'))[:7]}, "
            f"{machine.get('cpu_count', '?')} cores, {machine.get('torch_threads', '?')} torch "
            f"thread(s){load_text}")


def span(values: Iterable[float], fmt: str = "{:.2f}") -> str:
    """The range of ``values`` as prose quotes it: ``"0.88-1.01"`` (``"-8.0 to -0.2"`` when a
    sign would read as a dash), or one figure when all agree to the format."""
    values = sorted(values)
    if not values:
        raise ValueError("span of no values")
    low, high = fmt.format(values[0]), fmt.format(values[-1])
    dash = " to " if values[0] < 0 or fmt.startswith("{:+") else "-"
    return low if low == high else f"{low}{dash}{high}"
