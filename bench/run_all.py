"""``make bench`` / ``python -m tinyserve bench all``: every CPU suite, one after another,
each in its own process with one thread, into ``bench/results/``.

Each suite writes to a scratch folder first; the new report is compared with the one it
replaces (:mod:`bench.compare`; not when their hosts' ISA classes differ, the compare's own
rule), then its files (JSON, the printed tables as ``.txt``, any plot) are moved over the
old ones. A progress line per suite says how long it took and how busy the machine was.
"""
from __future__ import annotations

import datetime as dt
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from . import SUITES, setting
from .compare import HostMismatch, load_report, render
from .machine_load import busy_threshold, load_average

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"

#: Every suite that needs only this checkout and a CPU: each file of bench/suites/ but those
#: that say ``BENCH_ALL = False`` (peers: it needs `make peers` and runs on its own).
CPU_SUITES = tuple(s for s in SUITES if setting(s, "BENCH_ALL", True))

#: One thread per process for every math library torch may call, set before the process
#: starts (OpenMP reads it once): the house rule for side-by-side ratios.
ONE_THREAD = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}


def check_suites(suites: list[str]) -> None:
    unknown = [s for s in suites if s not in SUITES]
    if unknown:
        raise ValueError(f"unknown bench suite(s) {', '.join(unknown)}; choose from: "
                         f"{', '.join(SUITES)}")


def run_one(suite: str, scratch: Path, quick: bool) -> subprocess.CompletedProcess[str]:
    """The suite in a fresh one-thread process; its printed tables go to ``SUITE.txt``."""
    command = [sys.executable, "-m", "tinyserve", "bench", suite,
               "--json", str(scratch / f"{suite}.json"), *(["--quick"] if quick else [])]
    with open(scratch / f"{suite}.txt", "w") as printed:
        return subprocess.run(command, cwd=ROOT, env={**os.environ, **ONE_THREAD}, text=True,
                              stdout=printed, stderr=subprocess.PIPE)


def replace_results(suite: str, scratch: Path, out: Path) -> None:
    """Compare the new report with the one it replaces (unless their hosts run different
    kernels: then say so loudly), then move the new files in."""
    old = out / f"{suite}.json"
    if old.exists():
        try:
            text = render(load_report(str(old)), load_report(str(scratch / f"{suite}.json")))[0]
        except HostMismatch as err:
            text = (f"bench {suite}: not compared with the report it replaces. {err} (A "
                    f"committed old report stays in git: bench compare COMMIT:PATH NEW.)")
        print(text, flush=True)
    out.mkdir(parents=True, exist_ok=True)
    for path in sorted(scratch.iterdir()):
        shutil.move(str(path), str(out / path.name))


def warn_if_untraceable() -> None:
    """Figures of uncommitted code cannot be traced to a commit: say so before the run."""
    from tinyserve.provenance import git_commit
    commit = git_commit()
    if commit is None or commit.endswith("-dirty"):
        print("warning: tracked files have uncommitted changes (or there is no git): the "
              "reports will record a dirty tree, which no commit reproduces; commit first "
              "for figures the ledger can trace", flush=True)


def run_all(suites: list[str], out: Path = RESULTS, quick: bool = False) -> int:
    """Run ``suites`` in turn into ``out``; 0 if every one succeeded, 1 otherwise."""
    check_suites(suites)
    if quick and out.resolve() == RESULTS.resolve():
        raise ValueError("--quick figures mean nothing and must not replace bench/results/; "
                         "give --out DIR (a scratch folder)")
    warn_if_untraceable()
    threshold = busy_threshold()
    if load_average() > threshold:
        print(f"warning: the machine is busy (load {load_average():.1f}, busy above "
              f"{threshold:.1f}); ratios from a busy machine are not comparable with a quiet "
              f"run's. Stop other work and re-run, or read them as such.", flush=True)
    failed = []
    for i, suite in enumerate(suites, 1):
        start = time.monotonic()
        print(f"[{i}/{len(suites)}] bench {suite}: started {dt.datetime.now():%H:%M:%S}, "
              f"load {load_average():.1f}", flush=True)
        with tempfile.TemporaryDirectory(prefix=f"bench-{suite}-") as tmp:
            proc = run_one(suite, Path(tmp), quick)
            if proc.returncode != 0:
                failed.append(suite)
                print(f"[{i}/{len(suites)}] bench {suite} FAILED (exit {proc.returncode}); "
                      f"its previous results are kept:\n{proc.stderr[-2000:]}", flush=True)
                continue
            if proc.stderr.strip():
                print(proc.stderr.strip(), flush=True)   # the busy warning, if any
            replace_results(suite, Path(tmp), out)
        load = load_report(str(out / f"{suite}.json")).get("load", {})
        print(f"[{i}/{len(suites)}] bench {suite}: done in {time.monotonic() - start:.0f} s, "
              f"load {load.get('before', 0):.1f} -> {load.get('after', 0):.1f}"
              f"{' (busy: not comparable)' if load.get('busy') else ''}", flush=True)
    if failed:
        print(f"failed: {', '.join(failed)}", flush=True)
    return 1 if failed else 0
