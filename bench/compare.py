"""Two runs of one suite side by side: ``python -m tinyserve bench compare OLD NEW``.

Each ratio's change is printed; a ratio that moved against its goal's direction (or its
declared better direction, :mod:`bench.headlines`) by more than its noise band is marked
``worse``. OLD and NEW are report files, or ``COMMIT:bench/results/SUITE.json`` for a report
as a commit stored it. ``make bench`` runs this against the previous report before
overwriting it.
"""
from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tinyserve.tables import table

from .headlines import BY_SUITE, DEFAULT_BAND, Better, Headline, headline
from .staleness import Measured

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Change:
    name: str
    old: float | None
    new: float | None
    band: float
    direction: Better | None

    @property
    def relative(self) -> float | None:
        """(new - old) / |old|; for ``closer``, how much farther from the goal's centre the
        ratio got, relative to the centre."""
        if self.old is None or self.new is None:
            return None
        return (self.new - self.old) / (abs(self.old) or 1.0)

    def verdict(self, center: float = 1.0) -> str:
        """``worse`` / ``better`` beyond the noise band, ``noise`` within it."""
        if self.relative is None or self.direction is None or self.old is None or self.new is None:
            return "-"
        if self.direction == "closer":
            gain = (abs(self.old - center) - abs(self.new - center)) / (abs(center) or 1.0)
        else:
            gain = self.relative if self.direction == "higher" else -self.relative
        return "worse" if gain < -self.band else "better" if gain > self.band else "noise"


def load_report(spec: str, root: Path = ROOT) -> dict[str, Any]:
    """A report from a file, or from git for ``COMMIT:PATH``."""
    path = Path(spec)
    if not path.exists() and ":" in spec:
        out = subprocess.run(["git", "show", spec], cwd=root, capture_output=True, text=True,
                             timeout=30)
        if out.returncode != 0:
            raise ValueError(f"cannot read {spec} from git ({out.stderr.strip()}); give a file "
                             f"or COMMIT:bench/results/SUITE.json")
        return json.loads(out.stdout)
    if not path.exists():
        raise FileNotFoundError(f"no report at {spec}; give a file or COMMIT:PATH")
    return json.loads(path.read_text())


def _declared(suite: str) -> list[Headline]:
    entry = BY_SUITE.get(suite)
    return list(entry.headlines) if entry else []


def changes(old: dict[str, Any], new: dict[str, Any]) -> list[Change]:
    """Every ratio of either report (the suite's headlines first), old against new."""
    suite = new.get("suite")
    if old.get("suite") != suite:
        raise ValueError(f"the reports are of different suites ({old.get('suite')} and "
                         f"{suite}); compare two runs of one suite")
    found: list[Change] = []
    for h in _declared(str(suite)):
        found.append(Change(h.name, h.read(old), h.read(new), h.band, h.direction))
    named = {c.name for c in found}
    others = sorted((set(old.get("ratios", {})) | set(new.get("ratios", {}))) - named)
    for name in others:
        o, n = old.get("ratios", {}).get(name), new.get("ratios", {}).get(name)
        found.append(Change(name, None if o is None else float(o), None if n is None else float(n),
                            DEFAULT_BAND, None))   # not a headline: no declared direction
    return found


def _center(suite: str, name: str) -> float:
    h = headline(suite, name)
    return h.goal.center if h and h.goal else 1.0


def render(old: dict[str, Any], new: dict[str, Any]) -> tuple[str, int]:
    """The comparison as printed, and how many ratios moved the wrong way beyond noise."""
    suite = str(new.get("suite"))
    rows, worse = [], 0
    for c in changes(old, new):
        verdict = c.verdict(_center(suite, c.name))
        worse += verdict == "worse"
        rows.append([c.name, "-" if c.old is None else f"{c.old:.4g}",
                     "-" if c.new is None else f"{c.new:.4g}",
                     "-" if c.relative is None else f"{c.relative:+.1%}",
                     c.direction or "-", f"{c.band:.0%}", verdict])
    lines = [f"bench {suite}: {_stamp(old)} -> {_stamp(new)}",
             table(["ratio", "old", "new", "change", "better", "noise band", "verdict"], rows)]
    for report, which in ((old, "old"), (new, "new")):
        if (report.get("load") or {}).get("busy"):
            lines.append(f"note: the {which} run was on a busy machine; its ratios are not "
                         f"comparable with a quiet run's")
        if report.get("quick"):
            lines.append(f"note: the {which} run is a --quick run; its figures mean nothing")
    lines.append(f"{worse} ratio(s) moved the wrong way by more than their noise band")
    return "\n".join(lines), worse


def _stamp(report: dict[str, Any]) -> str:
    commit = report.get("git_commit")
    short = Measured(commit, "current").short if commit else "no commit"
    return f"{short} {report.get('date', 'no date')}"
