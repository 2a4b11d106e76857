"""The ``bench`` command's verbs besides running one suite: ``all`` (every CPU suite into
bench/results/), ``ledger`` (the README table rendered from them) and ``compare`` (two runs
of one suite, regressions marked)."""
from __future__ import annotations

import argparse
from pathlib import Path

from . import run_suite

VERBS = {
    "all": "every CPU suite in turn, one thread each, into bench/results/ (make bench)",
    "ledger": "the headline table rendered from bench/results/ (--write: into the READMEs)",
    "compare": "OLD NEW: each ratio's change between two reports, regressions marked (one "
               "ISA class of host; --across-hosts: any, with a warning)",
}


def _ledger(write: bool) -> int:
    from . import ledger
    if write:
        for path in ledger.write():
            print(f"wrote the ledger into {path.relative_to(ledger.ROOT)}")
        return 0
    print(ledger.render_ledger())
    return 0


def _compare(paths: list[str], across_hosts: bool = False) -> int:
    from .compare import load_report, render
    if len(paths) != 2:
        raise ValueError("bench compare takes two reports: OLD.json NEW.json (or "
                         "COMMIT:bench/results/SUITE.json for a stored one)")
    text, worse = render(load_report(paths[0]), load_report(paths[1]), across_hosts)
    print(text)
    return 1 if worse else 0


def run(args: argparse.Namespace) -> int:
    """Dispatch ``python -m tinyserve bench VERB_OR_SUITE ...``."""
    if args.suite == "all":
        from .run_all import CPU_SUITES, RESULTS, run_all
        suites = args.suites.split(",") if args.suites else list(CPU_SUITES)
        return run_all(suites, Path(args.out) if args.out else RESULTS, quick=args.quick)
    if args.suite == "ledger":
        return _ledger(args.write)
    if args.suite == "compare":
        return _compare(args.paths, getattr(args, "across_hosts", False))
    if args.paths or args.write or args.out or args.suites or getattr(args, "across_hosts", False):
        raise ValueError(f"bench {args.suite} takes --json, --quick and --compile only; PATHS, "
                         f"--write, --out, --suites and --across-hosts belong to: "
                         f"{', '.join(VERBS)}")
    run_suite(args.suite, json_path=args.json, quick=args.quick, compile=args.compile)
    return 0
