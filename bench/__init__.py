"""Benchmark suites: ``python -m tinyserve bench SUITE [--json PATH] [--quick]``.

Each suite measures an optimisation side by side with its plain reference *in the same run*
and reports ratios (greater than 1 means the optimised path is faster), next to the raw
medians, the machine, the commit and the load around the run. Tests run every suite with
``--quick`` and check the report's shape, never its timings.

Layout: the suites are the files of ``bench/suites/``, one per file, found by name (``bench
NAME`` runs ``bench/suites/NAME.py``; what several share sits there in ``_``-files); the harness
that runs them and reads their results sits here at the top. Only ``tinyserve/__main__.py``
(the ``bench`` verb) imports ``bench``.

Around the suites (:mod:`bench.cli`): ``bench all`` runs every CPU suite into
bench/results/ (:mod:`bench.run_all`, ``make bench``), ``bench ledger`` renders the README's
table from those reports (:mod:`bench.ledger`, declared in :mod:`bench.headlines`), and
``bench compare`` marks the ratios that moved the wrong way (:mod:`bench.compare`).
"""
from __future__ import annotations

import ast
import importlib
import sys
import tokenize
from pathlib import Path
from typing import Any

from .machine_load import busy_warning, load_average, stamp

#: One suite per file: ``python -m tinyserve bench NAME`` runs ``bench/suites/NAME.py`` (its
#: ``run(json_path, quick)``). Files starting with ``_`` hold what several suites share.
SUITES_DIR = Path(__file__).resolve().parent / "suites"


def suite_names() -> list[str]:
    """Every suite, by its file's name in bench/suites/ (no table to keep)."""
    return sorted(p.stem for p in SUITES_DIR.glob("*.py") if not p.name.startswith("_"))


def summary(name: str) -> str:
    """A suite's one-line description: the first paragraph of its module docstring, read
    without importing it (a suite imports torch; the CLI's help must start quickly)."""
    with tokenize.open(SUITES_DIR / f"{name}.py") as f:
        first = next(t for t in tokenize.generate_tokens(f.readline)
                     if t.type not in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE))
    doc = ast.literal_eval(first.string) if first.type == tokenize.STRING else ""
    return " ".join(doc.strip().split("\n\n", 1)[0].replace("``", "").split())


def setting(name: str, key: str, default: Any) -> Any:
    """A suite's module-level setting (``COMPILABLE``, ``OWN_THREADS``, ``BENCH_ALL``), a
    literal read from its source without importing it."""
    tree = ast.parse((SUITES_DIR / f"{name}.py").read_text())
    for node in tree.body:
        if (isinstance(node, ast.Assign) and len(node.targets) == 1
                and isinstance(node.targets[0], ast.Name) and node.targets[0].id == key):
            return ast.literal_eval(node.value)
    return default


#: Each suite's description, by name (the CLI's help lists these).
SUITES = {name: summary(name) for name in suite_names()}


def run_suite(name: str, json_path: str | None = None, quick: bool = False,
              compile: bool = False) -> dict[str, Any]:
    if name not in SUITES:
        raise ValueError(f"unknown bench suite {name!r}; choose one of: {', '.join(SUITES)}")
    # One torch thread per process (the house rule): ratios taken side by side on a shared
    # machine mean something only if neither side can borrow a core the other lacks.
    # The parallel suite sets its own threads in each rank.
    import torch
    if compile and not setting(name, "COMPILABLE", False):
        compilable = [s for s in SUITES if setting(s, "COMPILABLE", False)]
        raise ValueError(f"bench {name} has no --compile variant; it exists for: "
                         f"{', '.join(compilable)} (bench decode always times both)")
    module = importlib.import_module(f"bench.suites.{name}")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    before = load_average()
    try:
        if compile:
            data = module.run(json_path=json_path, quick=quick, compile=True)
        else:
            data = module.run(json_path=json_path, quick=quick)
    finally:
        torch.set_num_threads(threads)   # a caller (a test session) keeps its own setting
    return stamp_report(data, name, before, json_path,
                        own_threads=getattr(module, "OWN_THREADS", 1))


def stamp_report(data: dict[str, Any], name: str, load_before: float,
                 json_path: str | None, own_threads: int = 1) -> dict[str, Any]:
    """Add what the ledger needs to judge a run (the load around it, whether the tree was
    clean) to a suite's report, warn if the machine was busy, and rewrite its JSON."""
    from .common import write_json   # here: bench.common imports torch; `import bench` must not
    data["load"] = stamp(load_before, load_average(), own_threads=own_threads)
    commit = data.get("git_commit") or ""
    data["clean"] = bool(commit) and not commit.endswith("-dirty")
    warning = busy_warning(data["load"], f"bench {name}")
    if warning:
        print(warning, file=sys.stderr, flush=True)
    write_json(data, json_path, announce=False)   # the suite announced the file already
    return data
