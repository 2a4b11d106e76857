"""The course's committed benchmark reports, read where a chapter cites them, each with the
machine that ran it named beside the learner's.

A chapter that compares the learner's run with the course's own (``bench/results/*.json``,
written by ``python -m tinyserve bench SUITE``) reads the figure from the report in a cell,
next to the run's date, commit and load, and never types it into the prose: a rerun that
moves the figure then moves the sentence with it (issue 38). Which machine ran it is
named too, next to the one the learner runs on (issue 50): an AVX2 laptop and the AVX-512
server that measured a report run different kernels. The reports are found wherever the
package came from (:func:`tinyserve.paths.results_folder`): a checkout, an installed copy
(they ship as package data), the clone it was installed from, or ``$TINYSERVE_RESULTS_DIR``;
where none is, :func:`course_run` says so instead of failing.
"""
from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ..paths import RESULTS_ENV, results_folder
from ..provenance import isa_class, machine_info, machine_summary, same_isa_class

#: Where the reports were found when this module was imported (None: nowhere).
RESULTS = results_folder()
#: ``course_run``'s default: look now (a variable set since import counts).
FIND = Path("<found at each call>")


def course_run(suite: str, results: Path | None = FIND) -> dict[str, Any] | None:
    """The stored report ``<results>/<suite>.json`` (by default the folder
    :func:`~tinyserve.paths.results_folder` finds), or None when there is none (or
    ``results`` is None): the chapter then prints :func:`missing` and quotes nothing."""
    if results is FIND:
        results = results_folder()
    path = results / f"{suite}.json" if results else None
    if path is None or not path.is_file():
        return None
    return json.loads(path.read_text(encoding="utf-8"))


def missing(suite: str) -> str:
    """What a chapter prints when the course's report for ``suite`` is not here."""
    return (f"The course's bench/results/{suite}.json is not here (not beside the package, "
            f"nor in the clone it was installed from; set {RESULTS_ENV} to a folder that holds "
            f"it): no figure measured on the course's benchmark machine to compare with this "
            f"one ({machine_summary()}).")


def provenance(report: dict[str, Any], here: dict[str, Any] | None = None) -> str:
    """Where a report comes from: date, commit, cores and how busy the machine was (``bench``
    records the 1-minute load before and after the run); then, a line each, the machine that
    ran it and ``here`` (default: this one, now), and a warning when their kernels differ."""
    machine, load = report.get("machine") or {}, report.get("load", {})
    busy = load.get("busy")
    state = "" if busy is None else (", busy" if busy else ", quiet")
    before = load.get("before")
    load_text = f", load {before:.1f}{state}" if isinstance(before, (int, float)) else state
    when = str(report.get("date", "?"))[:16].replace("T", " ")
    line = (f"bench {report.get('suite', '?')}, {when} UTC, "
            f"commit {str(report.get('git_commit', '?'))[:7]}, "
            f"{machine.get('cpu_count', '?')} cores, {machine.get('torch_threads', '?')} torch "
            f"thread(s){load_text}")
    return line + "\n" + machines(machine, machine_info() if here is None else here)


def machines(theirs: dict[str, Any], here: dict[str, Any]) -> str:
    """The committed run's machine and the learner's, a line each, and whether one can
    expect the same figures from both."""
    text = (f"  the course's run: {machine_summary(theirs)}\n"
            f"  this machine:     {machine_summary(here)}")
    same = same_isa_class(theirs, here)
    if same is False:
        text += (f"\n  different ISA classes ({isa_class(theirs)} there, {isa_class(here)} "
                 f"here): different kernels run, so expect different figures")
    return text


def span(values: Iterable[float], fmt: str = "{:.2f}") -> str:
    """The range of ``values`` as prose quotes it: ``"0.88-1.01"`` (``"-8.0 to -0.2"`` when a
    sign would read as a dash), or one figure when all agree to the format."""
    values = sorted(values)
    if not values:
        raise ValueError("span of no values")
    low, high = fmt.format(values[0]), fmt.format(values[-1])
    dash = " to " if values[0] < 0 or fmt.startswith("{:+") else "-"
    return low if low == high else f"{low}{dash}{high}"
