"""The benchmark ledger, rendered from ``bench/results/``: one row per headline ratio
(:mod:`bench.headlines`) with its value, goal, whether it is met, and the commit, date and
load of the run it comes from. ``python -m tinyserve bench ledger --write`` writes it
between the ``bench-ledger`` markers of README.md and bench/results/README.md (the latter
also gets a line per stored report); a test fails when either differs from the rendering.

The rendering is a function of the stored reports and git history only (no clock, no
machine), so it reads the same in CI's fresh clone as where it was written.
"""
from __future__ import annotations

import datetime as dt
import json
from dataclasses import astuple, dataclass
from pathlib import Path
from typing import Any

from tinyserve.provenance import NOT_RECORDED, host_key, machine_summary
from tinyserve.workbook.markers import section, write_section

from .headlines import SUITES, Headline, SuiteHeadlines
from .staleness import Measured, measured

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path("bench/results")   # relative to the repository root
LEDGER, RUNS = "bench-ledger", "bench-runs"
HEADERS = ("suite", "ratio", "value", "goal", "met", "commit", "date", "load", "host")


@dataclass(frozen=True)
class Row:
    suite: str
    ratio: str
    value: str
    goal: str
    met: str
    commit: str
    date: str
    load: str
    host: str


def read_report(path: Path) -> dict[str, Any] | None:
    """A stored report, or None when there is no file."""
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not valid JSON ({err}); restore it from git or re-run "
                         f"its suite") from None


def why_not_rendered(report: dict[str, Any] | None, file: str) -> str | None:
    """Why a report gives no rows (figures without provenance are never quoted)."""
    if report is None:
        return f"{file} is missing"
    if report.get("quick"):
        return f"{file} is a --quick run (tiny models: its figures mean nothing)"
    if not report.get("git_commit"):
        return f"{file} has no commit"
    return None


def when(report: dict[str, Any]) -> str:
    """The run's date to the minute (UTC), or ``n/a``."""
    try:
        return dt.datetime.fromisoformat(report["date"]).strftime("%Y-%m-%d %H:%M")
    except (KeyError, TypeError, ValueError):
        return "n/a"


def load_cell(report: dict[str, Any]) -> str:
    """The 1-minute load average before / after the run, ``busy`` past the threshold it was
    judged by (:mod:`bench.machine_load`); ``n/a`` for runs that did not record it."""
    load = report.get("load")
    if not load:
        return "n/a"
    cell = f"{load['before']:.1f} / {load['after']:.1f}"
    return cell + ", busy" if load.get("busy") else cell


class HostLabels:
    """A short label per host for a table's cells (its CPU model and ISA class, numbered
    when two different machine blocks share one), and a legend giving each in full once."""

    def __init__(self) -> None:
        self.labels: dict[str, str] = {}   # full summary -> label, in order of appearance

    def label(self, report: dict[str, Any]) -> str:
        machine = report.get("machine")
        key = host_key(machine)
        if key is None:
            return NOT_RECORDED
        summary = machine_summary(machine)
        if summary not in self.labels:
            same = sum(label.split(" (")[0] == key for label in self.labels.values())
            self.labels[summary] = key if same == 0 else f"{key} ({same + 1})"
        return self.labels[summary]

    def legend(self) -> str:
        hosts = "; ".join(f"*{label}*: {summary}" for summary, label in self.labels.items())
        return f"Hosts: {hosts}." if hosts else ""


def commit_cell(where: Measured) -> str:
    return where.short if where.state == "current" else f"{where.short}, {where.state}"


def headline_row(entry: SuiteHeadlines, h: Headline, report: dict[str, Any],
                 where: Measured, host: str = NOT_RECORDED) -> Row | None:
    value = h.read(report)
    if value is None:
        return None
    return Row(entry.suite, f"`{h.name}`", h.fmt.format(value), h.goal_cell(),
               h.met_cell(value), commit_cell(where), when(report), load_cell(report), host)


def ledger_rows(root: Path = ROOT,
                hosts: HostLabels | None = None) -> tuple[list[Row], list[str]]:
    """Every headline row of the stored reports, and a note for each one left out; ``hosts``
    collects the rows' hosts for the legend."""
    hosts = HostLabels() if hosts is None else hosts
    rows: list[Row] = []
    notes: list[str] = []
    for entry in SUITES:
        report = read_report(root / RESULTS / entry.result_file)
        why = why_not_rendered(report, entry.result_file)
        if why is not None or report is None:
            notes.append(str(why))
            continue
        where = measured(report["git_commit"], entry.sources, root)
        for h in entry.headlines:
            row = headline_row(entry, h, report, where, hosts.label(report))
            if row is None:
                notes.append(f"`{h.name}` is not in {entry.result_file}")
            else:
                rows.append(row)
    return rows, notes


def markdown_table(headers: tuple[str, ...], rows: list[tuple[str, ...]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


LEGEND = ("Rendered by `python -m tinyserve bench ledger --write` from `bench/results/` "
          "(never edit by hand). *stale*: the code the suite times (its sources in "
          "`bench/headlines.py`) changed since that commit, so the figure is of older code; "
          "*unknown*: git here lacks that commit. Load: 1-minute load average before / after "
          "the run; *busy* runs are not comparable with quiet ones. Host: the CPU model and "
          "ISA class of the machine that ran it (each in full below): ratios from hosts of "
          "different ISA classes run different kernels and are not comparable; *not "
          "recorded*: the report predates the machine block naming its CPU (issue 50), so "
          "its host is unknown until its suite is re-run.")


def render_ledger(root: Path = ROOT) -> str:
    hosts = HostLabels()
    rows, notes = ledger_rows(root, hosts)
    text = markdown_table(HEADERS, [astuple(r) for r in rows]) + "\n\n" + LEGEND
    if hosts.legend():
        text += "\n\n" + hosts.legend()
    if notes:
        text += "\n\nNot rendered: " + "; ".join(notes) + "."
    return text


def render_runs(root: Path = ROOT) -> str:
    """One line per stored report under bench/results/: suite, commit, date, load, host."""
    hosts = HostLabels()
    rows = []
    for path in sorted((root / RESULTS).rglob("*.json")):
        report = read_report(path) or {}
        commit = report.get("git_commit")
        rows.append((f"`{path.relative_to(root / RESULTS)}`", str(report.get("suite", "-")),
                     Measured(commit, "current").short if commit else "none", when(report),
                     load_cell(report), "yes" if report.get("quick") else "no",
                     hosts.label(report)))
    table = markdown_table(("file", "suite", "commit", "date", "load", "quick", "host"), rows)
    return table + ("\n\n" + hosts.legend() if hosts.legend() else "")


def sections(root: Path = ROOT) -> list[tuple[Path, str, str]]:
    """(file, marker name, rendered text) of every generated section."""
    ledger = render_ledger(root)
    return [(root / "README.md", LEDGER, ledger),
            (root / RESULTS / "README.md", LEDGER, ledger),
            (root / RESULTS / "README.md", RUNS, render_runs(root))]


def write(root: Path = ROOT) -> list[Path]:
    """Write every generated section; returns the files written."""
    done = []
    for path, name, text in sections(root):
        write_section(path, name, text)
        done.append(path)
    return sorted(set(done))


def differences(root: Path = ROOT) -> list[str]:
    """``file (marker)`` of each generated section that differs from its rendering."""
    return [f"{path.relative_to(root)} ({name})" for path, name, text in sections(root)
            if section(path, name) != text.strip()]
