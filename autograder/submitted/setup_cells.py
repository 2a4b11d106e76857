"""A notebook's setup cells: what installs or fetches the course, never run to check it.

On a hosted notebook a learner puts the README's install cell at the top of a notebook: it
clones the course and installs the package. Run again by Validate it would install again,
take half a minute and, from the exercise's folder, leave a nested copy of the course there;
in grading's sandbox, with no network, it would fail. So Validate (``python -m autograder
check`` and the Lab's button) skips it, and says so.

A setup cell is a code cell that is no graded answer or test and that runs a shell command
(``!cmd``, ``%%bash``, ``%%sh``, ``%%script``, ``%system``, ``%sx``), a package manager's
magic (``%pip``, ``%conda``, ``%mamba``, ``%micromamba``, ``%uv``), or starts a package manager
or git from Python (``subprocess``, ``os.system``). It is skipped whole: its other lines may
need what the skipped ones install. A graded answer keeps its code; only its shell-escape and
package-manager lines become ``pass`` (indentation kept, so the cell still parses).
"""
from __future__ import annotations

import ast
from dataclasses import dataclass

from autograder.submitted.scan import to_python
from autograder.submitted.shown import shown
from autograder.submitted.submission import is_answer, is_test

#: IPython line magics that install packages or run the shell.
SETUP_LINE_MAGICS = frozenset({"pip", "conda", "mamba", "micromamba", "uv", "system", "sx"})
#: IPython cell magics whose body is a shell script.
SHELL_CELL_MAGICS = frozenset({"bash", "sh", "script", "system", "sx"})
#: Commands that install or fetch, when a Python call starts them.
SETUP_COMMANDS = frozenset({"pip", "pip3", "git", "conda", "mamba", "micromamba", "uv", "apt",
                            "apt-get", "curl", "wget"})
#: What a skipped cell is replaced with, so the cell numbers in the report stay the same.
SKIPPED = "# Validate skipped this setup cell (it installs or runs the shell): {what}"
NOTE = ("cell {n} not run: a setup cell ({what}); Validate never runs install or shell cells "
        "(the course must already be installed, as it is once that cell has run)")


@dataclass(frozen=True)
class SetupCell:
    """Cell ``index`` of a notebook is a setup cell; ``what``: its first setup line, shortened."""
    index: int
    what: str


def setup_lines(source: str) -> list[int]:
    """The 1-based lines of ``source`` (a cell, IPython syntax) that install or run the shell.
    A cell magic counts as its first line; unparsable code has none (it fails when run)."""
    try:
        tree = ast.parse(to_python(source))
    except SyntaxError:
        return []
    return sorted({node.lineno for node in ast.walk(tree) if _is_setup_call(node)})


def setup_cells(nb) -> list[SetupCell]:
    """The setup cells of ``nb`` (a NotebookNode or its dict), in order."""
    found = []
    for index, cell in enumerate(nb["cells"]):
        if cell.get("cell_type") != "code" or is_test(cell) or is_answer(cell):
            continue
        lines = setup_lines(_source(cell))
        if lines:
            found.append(SetupCell(index, _shorten(_source(cell).splitlines()[lines[0] - 1])))
    return found


def skip_setup_cells(nb) -> list[str]:
    """Replace every setup cell's code in ``nb`` (in memory) with a comment saying it was
    skipped, and every shell-escape or package-manager line of a graded answer with ``pass``;
    return one note per change, for the report (student text escaped and capped)."""
    notes = []
    for cell in setup_cells(nb):
        nb["cells"][cell.index]["source"] = SKIPPED.format(what=cell.what)
        notes.append(NOTE.format(n=cell.index + 1, what=cell.what))
    for index, cell in enumerate(nb["cells"]):
        if cell.get("cell_type") == "code" and is_answer(cell) and not is_test(cell):
            kept, dropped = _without_magic_lines(_source(cell))
            if dropped:
                cell["source"] = kept
                notes.append(f"cell {index + 1}: {len(dropped)} shell or install line(s) not run "
                             f"({dropped[0]}); Validate never runs them")
    return notes


def _source(cell) -> str:
    source = cell.get("source", "")
    return "".join(source) if isinstance(source, list) else str(source)


def _shorten(line: str, limit: int = 60) -> str:
    return "`" + shown(line.strip())[:limit] + ("...`" if len(line.strip()) > limit else "`")


def _without_magic_lines(source: str) -> tuple[str, list[str]]:
    """``source`` with each ``!`` line and package-manager magic line made ``pass``."""
    out, dropped = [], []
    for line in source.splitlines():
        bare = line.lstrip()
        word = bare[1:].split(" ", 1)[0] if bare.startswith("%") else ""
        if bare.startswith("!") or word in SETUP_LINE_MAGICS:
            out.append(line[:len(line) - len(bare)] + "pass")
            dropped.append(_shorten(bare))
        else:
            out.append(line)
    return "\n".join(out), dropped


#: Functions that start a process, called by a bare name (``from subprocess import run``).
STARTERS = frozenset({"run", "call", "check_call", "check_output", "Popen", "system", "popen"})


def _is_setup_call(node: ast.AST) -> bool:
    if not isinstance(node, ast.Call):
        return False
    if isinstance(node.func, ast.Name):
        return node.func.id in STARTERS and bool(SETUP_COMMANDS & _words(node))
    if not isinstance(node.func, ast.Attribute):
        return False
    attr, owner = node.func.attr, node.func.value
    if _is_get_ipython(owner):
        if attr in ("system", "getoutput"):
            return True                                   # !cmd, !!cmd, x = !cmd
        name = _first_string(node)
        if attr == "run_line_magic":
            return name in SETUP_LINE_MAGICS
        if attr == "run_cell_magic":
            body = node.args[2].value if len(node.args) > 2 and isinstance(
                node.args[2], ast.Constant) and isinstance(node.args[2].value, str) else ""
            return name in SHELL_CELL_MAGICS or bool(body and setup_lines(body))
        return False
    if attr in STARTERS:           # subprocess.run, os.system, sp.check_call, ...
        return bool(SETUP_COMMANDS & _words(node))
    return False


def _is_get_ipython(node: ast.AST) -> bool:
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
            and node.func.id == "get_ipython")


def _first_string(node: ast.Call) -> str:
    first = node.args[0] if node.args else None
    return first.value if isinstance(first, ast.Constant) and isinstance(first.value, str) else ""


def _words(node: ast.Call) -> set[str]:
    """Every word of every string constant in the call's arguments."""
    words: set[str] = set()
    for arg in [*node.args, *(k.value for k in node.keywords)]:
        for sub in ast.walk(arg):
            if isinstance(sub, ast.Constant) and isinstance(sub.value, str):
                words.update(w.rsplit("/", 1)[-1] for w in sub.value.split())
    return words
