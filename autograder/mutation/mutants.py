"""How strong are an assignment's tests? Grade single-point mutants of its solution.

``python -m autograder mutants ASSIGNMENT`` changes the solution code in one place at a time
(a swapped operator or comparison, a nudged constant or axis, a call swapped for its classic
wrong twin such as ``repeat`` for ``repeat_interleave``), grades every mutant in the sandbox
like a student's submission, and reports the share that lose marks (the *mutation score*) and
the survivors, each with its cell, line and change. A survivor is a slip the tests would let
through, or a change that does not alter behaviour (an *equivalent* mutant); the instructor
tells which by reading the line.

Only code between ``### BEGIN SOLUTION`` and ``### END SOLUTION`` is mutated: that is what a
learner writes. Each mutant is spliced into the cell's source text at the changed node, so
the rest of the cell (comments, layout) stays as written. ``--sample N`` grades a seeded
random subset, for a quick estimate on a large assignment.

Each mutant's run stops at its first failed test (``stop_at_failure``): from there it has
lost marks whatever the later cells would show, so they are skipped. That holds only while
the unmutated solution passes every test, so the tool checks that first and refuses
otherwise; ``--full-runs`` grades every cell of every mutant (the same verdicts, slower;
it also scores a solution that fails some tests, against the marks it gets).
"""
from __future__ import annotations

import argparse
import ast
import json
import random
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import nbformat

from autograder.pipeline.course import Course, CourseError, release
from autograder.runner.execute import STOPPED

BEGIN, END = "### BEGIN SOLUTION", "### END SOLUTION"

# Operators and their classic wrong twins (one mutant per site).
BINOPS = {ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.Div, ast.Div: ast.Mult,
          ast.FloorDiv: ast.Div, ast.Pow: ast.Mult, ast.Mod: ast.FloorDiv,
          ast.MatMult: ast.Mult}
CMPOPS = {ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt,
          ast.Eq: ast.NotEq, ast.NotEq: ast.Eq, ast.In: ast.NotIn, ast.NotIn: ast.In}
# Calls (functions or methods, by name) and the twin a learner confuses them with.
TWINS = {"repeat_interleave": "repeat", "repeat": "repeat_interleave", "argmax": "argmin",
         "max": "min", "min": "max", "sum": "mean", "mean": "sum", "rsqrt": "sqrt",
         "sqrt": "rsqrt", "cos": "sin", "sin": "cos", "softmax": "log_softmax",
         "silu": "relu", "relu": "silu", "exp": "log", "log": "exp", "cat": "stack",
         "stack": "cat", "amax": "amin", "cumsum": "cumprod", "floor": "ceil", "ceil": "floor",
         "ones": "zeros", "zeros": "ones", "tril": "triu", "triu": "tril"}


@dataclass
class Mutant:
    notebook: str      # notebook name, without .ipynb
    cell: str          # grade_id of the answer cell
    line: int          # line in the cell, 1-based
    change: str        # "`a <= b` -> `a < b`"
    source: str        # the whole mutated cell


def _op_text(op: type) -> str:
    return ast.unparse(ast.BinOp(ast.Name("a"), op(), ast.Name("b")))[2:-2] if op in BINOPS \
        else ast.unparse(ast.Compare(ast.Name("a"), [op()], [ast.Name("b")]))[2:-2]


def _variants(node: ast.AST) -> list[tuple[ast.AST, str]]:
    """Single-point changes of ``node`` itself, each with a short description."""
    out: list[tuple[ast.AST, str]] = []
    if isinstance(node, ast.BinOp) and type(node.op) in BINOPS:
        new = BINOPS[type(node.op)]
        out.append((ast.BinOp(node.left, new(), node.right),
                    f"`{_op_text(type(node.op))}` -> `{_op_text(new)}`"))
    elif isinstance(node, ast.Compare) and len(node.ops) == 1 and type(node.ops[0]) in CMPOPS:
        new = CMPOPS[type(node.ops[0])]
        out.append((ast.Compare(node.left, [new()], node.comparators),
                    f"`{_op_text(type(node.ops[0]))}` -> `{_op_text(new)}`"))
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.Not, ast.Invert)):
        if isinstance(node.op, ast.USub) and isinstance(node.operand, ast.Constant):
            value = node.operand.value
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                out.append((ast.Constant(-value + 1), f"`{-value}` -> `{-value + 1}`"))
        else:
            out.append((node.operand, f"`{ast.unparse(node)}` -> `{ast.unparse(node.operand)}`"))
    elif isinstance(node, ast.Constant) and type(node.value) in (int, float):
        value = node.value
        new_value = value + 1 if isinstance(value, int) else (value * 2 if value else 1.0)
        out.append((ast.Constant(new_value), f"`{value!r}` -> `{new_value!r}`"))
    elif isinstance(node, ast.BoolOp):
        new_op = ast.Or if isinstance(node.op, ast.And) else ast.And
        out.append((ast.BoolOp(new_op(), node.values),
                    f"`{type(node.op).__name__.lower()}` -> `{new_op.__name__.lower()}`"))
    elif isinstance(node, ast.Call):
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
        if name in TWINS:
            twin = TWINS[name]
            new_func = (ast.Attribute(func.value, twin, ast.Load()) if isinstance(func, ast.Attribute)
                        else ast.Name(twin, ast.Load()))
            out.append((ast.Call(new_func, node.args, node.keywords), f"`{name}(` -> `{twin}(`"))
    return out


def _solution_lines(source: str) -> set[int]:
    """1-based line numbers strictly between BEGIN and END SOLUTION markers."""
    lines, inside = set(), False
    for i, line in enumerate(source.splitlines(), start=1):
        if line.strip() == BEGIN:
            inside = True
        elif line.strip() == END:
            inside = False
        elif inside:
            lines.add(i)
    return lines


def _skipped(tree: ast.AST) -> set[int]:
    """ids of nodes never mutated: inside f-strings, docstrings and type annotations."""
    skip: set[int] = set()
    for node in ast.walk(tree):
        roots: list[ast.AST] = []
        if isinstance(node, ast.JoinedStr):
            roots.append(node)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            roots.extend(a.annotation for a in node.args.args + node.args.kwonlyargs if a.annotation)
            if node.returns:
                roots.append(node.returns)
        if isinstance(node, ast.AnnAssign):
            roots.append(node.annotation)
        for root in roots:
            skip.update(id(n) for n in ast.walk(root))
    return skip


def _splice(source: str, node: ast.AST, replacement: ast.AST) -> str:
    lines = source.splitlines(keepends=True)
    starts = [0]
    for line in lines:
        starts.append(starts[-1] + len(line))
    # ast offsets are in UTF-8 bytes; the solution code here is ASCII, checked by the caller.
    a = starts[node.lineno - 1] + node.col_offset            # type: ignore[attr-defined]
    b = starts[node.end_lineno - 1] + node.end_col_offset    # type: ignore[attr-defined]
    return source[:a] + "(" + ast.unparse(replacement) + ")" + source[b:]


def cell_mutants(source: str, notebook: str, cell: str) -> list[Mutant]:
    """Every single-point mutant of the solution code in one answer cell."""
    wanted = _solution_lines(source)
    if not wanted or not source.isascii():
        return []
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []
    skip = _skipped(tree)
    out = []
    for node in ast.walk(tree):
        if id(node) in skip or getattr(node, "lineno", None) not in wanted:
            continue
        for replacement, change in _variants(node):
            mutated = _splice(source, node, replacement)
            try:
                ast.parse(mutated)
            except SyntaxError:
                continue
            line = source.splitlines()[node.lineno - 1].strip()  # type: ignore[attr-defined]
            out.append(Mutant(notebook, cell, node.lineno, f"{change} in `{line}`", mutated))  # type: ignore[attr-defined]
    return out


def assignment_mutants(source_dir: Path) -> list[Mutant]:
    """All mutants of every answer cell of every notebook in an assignment's source folder."""
    out = []
    for path in sorted(source_dir.glob("*.ipynb")):
        nb = nbformat.read(path, as_version=4)
        for cell in nb.cells:
            meta = cell.metadata.get("nbgrader", {})
            if cell.cell_type == "code" and meta.get("solution") and not meta.get("grade"):
                out.extend(cell_mutants(cell.source, path.stem, meta["grade_id"]))
    return out


def _write_submission(course: Course, name: str, student: str, source_dir: Path,
                      mutant: Mutant | None) -> None:
    dest = course.submitted / student / name
    dest.mkdir(parents=True)
    for path in sorted(source_dir.glob("*.ipynb")):
        nb = nbformat.read(path, as_version=4)
        if mutant is not None and path.stem == mutant.notebook:
            for cell in nb.cells:
                if cell.metadata.get("nbgrader", {}).get("grade_id") == mutant.cell:
                    cell.source = mutant.source
        nbformat.write(nb, dest / path.name)


def mutation_score(course: Course, name: str, *, sample: int | None = None, seed: int = 0,
                   workers: int | None = None, unsafe: bool = False,
                   cell_timeout: float = 60, timeout: float = 600,
                   full_runs: bool = False, cells: list[str] | None = None) -> dict:
    """Grade the solution and each mutant of ``name`` in a scratch copy of the course; returns
    {"assignment", "mutants", "killed", "score", "survivors": [...], "baseline",
    "stopped_early", "not_graded"}: how many mutant runs ended at their first failed test,
    and the mutants killed without a grade (failed or flagged runs), with why. ``cells``:
    only the mutants of these answer cells (grade ids), e.g. to re-check one cell's fix."""
    from autograder.pipeline.grade import autograde
    course.check_assignment(name)
    source_dir = course.source / name
    mutants = assignment_mutants(source_dir)
    if cells:
        unknown = sorted(set(cells) - {m.cell for m in mutants})
        if unknown:
            raise CourseError(f"{name}: no mutants in cell(s) {', '.join(unknown)[:200]}; the "
                              f"answer cells with mutants are "
                              f"{', '.join(sorted({m.cell for m in mutants}))[:300]}")
        mutants = [m for m in mutants if m.cell in cells]
    total = len(mutants)
    if sample is not None and sample < total:
        mutants = random.Random(seed).sample(mutants, sample)
    if not mutants:
        raise CourseError(f"{name}: no code between {BEGIN!r} and {END!r} to mutate")
    with tempfile.TemporaryDirectory(prefix="mutants-") as tmp:
        scratch = Course(Path(tmp))
        shutil.copytree(source_dir, scratch.source / name)
        release(scratch, name)
        _write_submission(scratch, name, "baseline", source_dir, None)
        for i, mutant in enumerate(mutants):
            _write_submission(scratch, name, f"m{i:04d}", source_dir, mutant)
        results = {r["student"]: r for r in autograde(
            scratch, name, workers=workers, unsafe=unsafe, cell_timeout=cell_timeout,
            total_timeout=timeout, progress=False, stop_at_failure=not full_runs)}
    base = results["baseline"]
    if base["status"] != "graded":
        raise CourseError(f"{name}: the unmutated solution was not graded ({base['status']}: "
                          f"{'; '.join(base['reasons'] + base['flags'])[:300]}); fix it first")
    failed = [t["grade_id"] for t in _tests(base) if t["kind"] != "manual" and not t["passed"]]
    if failed and not full_runs:
        raise CourseError(f"{name}: the unmutated solution fails {', '.join(failed)[:300]}; "
                          "stopping each mutant at its first failed test needs a solution that "
                          "passes every test: fix it, or pass --full-runs")
    survivors = [asdict(m) | {"score": results[f"m{i:04d}"]["score"]}
                 for i, m in enumerate(mutants)
                 if results[f"m{i:04d}"]["status"] == "graded"
                 and results[f"m{i:04d}"]["score"] >= base["score"]]
    for s in survivors:
        s.pop("source")
    killed = len(mutants) - len(survivors)
    stopped = sum(any(t["message"] == f"not run: {STOPPED}" for t in _tests(results[f"m{i:04d}"]))
                  for i in range(len(mutants)))
    # Killed without a grade (the run failed or was flagged): listed, so a grader fault
    # cannot pass for a strong test unseen.
    not_graded = [{"cell": m.cell, "line": m.line, "change": m.change,
                   "status": results[f"m{i:04d}"]["status"],
                   "why": "; ".join(results[f"m{i:04d}"]["reasons"]
                                    + results[f"m{i:04d}"]["flags"])[:300]}
                  for i, m in enumerate(mutants) if results[f"m{i:04d}"]["status"] != "graded"]
    return {"assignment": name, "mutants": len(mutants), "of": total, "killed": killed,
            "score": killed / len(mutants), "baseline": base["score"], "survivors": survivors,
            "stopped_early": stopped, "not_graded": not_graded}


def _tests(result: dict) -> list[dict]:
    return [t for nb in result.get("notebooks", {}).values() for t in nb.get("tests", [])]


def add_parser(sub: argparse._SubParsersAction) -> None:
    """The ``mutants`` subcommand (kept here so the CLI gains one line)."""
    m = sub.add_parser("mutants", help="grade single-point mutants of a solution: how strong "
                                       "are the tests?")
    m.add_argument("assignment")
    m.add_argument("--sample", type=int, default=None, help="grade a seeded random N mutants")
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--cells", default=None,
                   help="only the mutants of these answer cells (comma-separated grade ids)")
    m.add_argument("--workers", type=int, default=None, help="parallel workers (default: CPUs)")
    m.add_argument("--cell-timeout", type=float, default=60)
    m.add_argument("--unsafe", action="store_true",
                   help="grade without the bubblewrap sandbox (the solution is trusted code)")
    m.add_argument("--full-runs", action="store_true",
                   help="grade every cell of every mutant instead of stopping at its first "
                        "failed test (same verdicts, slower)")
    m.add_argument("--semantic", action="store_true",
                   help="grade the learner-mistake corpus instead (autograder.mutation.corpus): "
                        "graded and Validate scores, and which pieces lose points")
    m.add_argument("--json", type=Path, default=None, help="also write the report here")
    m.set_defaults(handler=run)


def run(course: Course, args: argparse.Namespace) -> int:
    if args.semantic:
        from autograder.mutation.semantic import print_report, semantic_report
        report = semantic_report(course, args.assignment, workers=args.workers,
                                 unsafe=args.unsafe, cell_timeout=args.cell_timeout)
        print_report(report)
        if args.json:
            args.json.write_text(json.dumps(report, indent=1) + "\n")
        return 0 if all(report["goals"].values()) else 1
    if args.sample is not None and args.sample < 1:
        raise CourseError(f"--sample must be at least 1, got {args.sample}")
    report = mutation_score(course, args.assignment, sample=args.sample, seed=args.seed,
                            workers=args.workers, unsafe=args.unsafe,
                            cell_timeout=args.cell_timeout, full_runs=args.full_runs,
                            cells=args.cells.split(",") if args.cells else None)
    sampled = f" (a sample of {report['of']})" if report["mutants"] < report["of"] else ""
    print(f"{report['assignment']}: {report['killed']}/{report['mutants']} mutants{sampled} "
          f"lose marks: mutation score {report['score']:.2f}")
    for s in report["survivors"]:
        print(f"  survived  {s['notebook']}/{s['cell']} line {s['line']}: {s['change']}")
    for s in report["not_graded"]:
        print(f"  {s['status']} (counted as killed)  {s['cell']} line {s['line']}: "
              f"{s['change']}: {s['why']}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    return 0
