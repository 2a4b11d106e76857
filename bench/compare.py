"""Two runs of one suite side by side: ``python -m tinyserve bench compare OLD NEW``.

Each ratio's change is printed; a ratio that moved against its goal's direction (or its
declared better direction, :mod:`bench.headlines`) by more than its noise band is marked
``worse``. OLD and NEW are report files, or ``COMMIT:bench/results/SUITE.json`` for a report
as a commit stored it. ``make bench`` runs this against the previous report before
overwriting it.

Two hosts of different ISA classes (AVX2, AVX-512, AMX, Arm) run different kernels, so their
ratios are not compared unless asked (``--across-hosts``, which still warns); a report that
does not record its host is compared with a warning that nobody can tell.
"""
from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tinyserve.provenance import host_key, isa_class, machine_summary, same_isa_class
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


class HostMismatch(ValueError):
    """Two reports from hosts of different ISA classes: their ratios are not comparable."""


def host_warnings(old: dict[str, Any], new: dict[str, Any],
                  across_hosts: bool = False) -> list[str]:
    """What to say about the two runs' hosts before their ratios; raises
    :class:`HostMismatch` when their ISA classes differ and ``across_hosts`` is not set."""
    a, b = old.get("machine"), new.get("machine")
    same = same_isa_class(a, b)
    hosts = (f"  old: {machine_summary(a) if isinstance(a, dict) else 'host not recorded'}\n"
             f"  new: {machine_summary(b) if isinstance(b, dict) else 'host not recorded'}")
    if same is False:
        why = (f"the old run's host is {isa_class(a)}, the new run's {isa_class(b)}: they run "
               f"different kernels, so their ratios are not comparable\n{hosts}")
        if not across_hosts:
            raise HostMismatch(f"REFUSED: different hosts. {why}\nRe-run both on one machine, "
                               f"or pass --across-hosts to compare anyway.")
        return [f"WARNING: ACROSS HOSTS (--across-hosts): {why}"]
    if same is None:
        which = [w for w, r in (("old", a), ("new", b)) if isa_class(r) in (None, "unknown")]
        return [f"WARNING: the {' and '.join(which)} run's host is not recorded (a report from "
                f"before issue 50, or an OS that would not say): nobody can tell whether "
                f"these ratios come from one kind of machine\n{hosts}"]
    if host_key(a) != host_key(b):
        return [f"note: two CPU models of one ISA class ({isa_class(a)}); ratios may still "
                f"differ with caches and memory\n{hosts}"]
    return []


def render(old: dict[str, Any], new: dict[str, Any],
           across_hosts: bool = False) -> tuple[str, int]:
    """The comparison as printed, and how many ratios moved the wrong way beyond noise;
    raises :class:`HostMismatch` across ISA classes unless ``across_hosts``."""
    suite = str(new.get("suite"))
    warnings = host_warnings(old, new, across_hosts)
    rows, worse = [], 0
    for c in changes(old, new):
        verdict = c.verdict(_center(suite, c.name))
        worse += verdict == "worse"
        rows.append([c.name, "-" if c.old is None else f"{c.old:.4g}",
                     "-" if c.new is None else f"{c.new:.4g}",
                     "-" if c.relative is None else f"{c.relative:+.1%}",
                     c.direction or "-", f"{c.band:.0%}", verdict])
    lines = [*warnings, f"bench {suite}: {_stamp(old)} -> {_stamp(new)}",
             table(["ratio", "old", "new", "change", "better", "noise band", "verdict"], rows)]
    for report, which in ((old, "old"), (new, "new")):
        if (report.get("load") or {}).get("busy"):
            lines.append(f"note: the {which} run was on a busy machine; its ratios are not "
                         f"comparable with a quiet run's")
        if report.get("quick"):
            lines.append(f"note: the {which} run is a --quick run; its figures mean nothing")
    lines.append(f"{worse} ratio(s) moved the wrong way by more than their noise band")
    lines += [w.splitlines()[0] for w in warnings if w.startswith("WARNING")]   # again, last
    return "\n".join(lines), worse


def _stamp(report: dict[str, Any]) -> str:
    commit = report.get("git_commit")
    short = Measured(commit, "current").short if commit else "no commit"
    return f"{short} {report.get('date', 'no date')}"
