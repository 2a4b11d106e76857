"""Is a stored result still a measurement of this code? It is stale when a source path its
suite declares (:mod:`bench.headlines`) differs between the commit it was measured at and
the working tree, beyond comments and docstrings.

The working tree, not HEAD: whoever changes a timed module and re-renders the ledger before
committing gets the ledger the commit will have; in CI's fresh clone the two are the same.
"""
from __future__ import annotations

import ast
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

State = Literal["current", "stale", "unknown"]


@dataclass(frozen=True)
class Measured:
    """Where a report was measured: its commit as recorded (``-dirty`` when the tree had
    uncommitted changes) and whether its sources changed since."""
    commit: str
    state: State

    @property
    def short(self) -> str:
        sha, dirty, _ = self.commit.partition("-dirty")
        return sha[:7] + ("-dirty" if dirty else "")


def _git(repo: Path, *args: str) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True,
                              timeout=30)
    except OSError as err:   # no git here: no commit can be checked (rows read "unknown")
        return subprocess.CompletedProcess(["git", *args], 127, "", str(err))


def measured(commit: str, sources: tuple[str, ...], repo: Path) -> Measured:
    """``commit`` (as a report records it) against the working tree of ``repo``: stale if
    any of ``sources`` changed, unknown if git does not have the commit (a rewritten or
    shallow history: then no one can tell)."""
    sha = commit.removesuffix("-dirty")
    if _git(repo, "cat-file", "-e", f"{sha}^{{commit}}").returncode != 0:
        return Measured(commit, "unknown")
    diff = _git(repo, "diff", "--name-only", sha, "--", *sources)
    if diff.returncode != 0:
        raise RuntimeError(f"git diff {sha} -- {' '.join(sources)} failed: {diff.stderr.strip()}")
    changed = [p for p in diff.stdout.splitlines() if not _same_code(repo, sha, p)]
    return Measured(commit, "stale" if changed else "current")


def _same_code(repo: Path, sha: str, path: str) -> bool:
    """Whether a Python file differs from ``sha`` in comments and docstrings only (the same
    syntax tree): a reworded comment does not make a timing stale."""
    if not path.endswith(".py") or not (repo / path).exists():
        return False
    then = _git(repo, "show", f"{sha}:{path}")
    if then.returncode != 0:
        return False   # the file is new since the commit
    try:
        return _code(then.stdout) == _code((repo / path).read_text())
    except SyntaxError:
        return False


def _code(source: str) -> str:
    """The syntax tree without docstrings (comments are not in it)."""
    tree = ast.parse(source)
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (isinstance(body, list) and body and isinstance(body[0], ast.Expr)
                and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str)):
            node.body = body[1:] or [ast.Pass()]   # type: ignore[attr-defined]
    return ast.dump(tree)


def is_shallow(repo: Path) -> bool:
    """A shallow clone lacks the commits older results were measured at."""
    out = _git(repo, "rev-parse", "--is-shallow-repository")
    return out.returncode != 0 or out.stdout.strip() != "false"
