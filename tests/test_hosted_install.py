"""README "On a hosted notebook": one ``pip install`` of the plain package beside a service's
own torch and Jupyter replaces neither, and chapter 0 runs.

A hosted notebook (Colab, Kaggle, a university's JupyterHub) comes with torch and a Jupyter
server of its own. The test builds that in a fresh venv (no system site-packages): torch
first, then a Jupyter server, widgets and jsonschema of other versions than the project's
venv holds (jsonschema above the grading extra's cap). Then it installs the package from a
wheel of this checkout, from the package index, as the README's cell does, and asserts that
every package already there kept its version, that no Lab or grading package came along,
and that chapter 0's first code cells run on the installed copy.

It needs the package index, so it runs in CI and where ``TINYSERVE_INDEX_TESTS=1`` is set
(torch comes from the index too: on a machine without a local wheel, PyPI's torch for
x86-64 Linux is a CUDA build of several GB). About a minute and a half here.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from wheels import build_wheel

ROOT = Path(__file__).resolve().parents[1]
#: The service's own packages: a Jupyter server and widgets of other versions than this
#: venv's (the Lab extra's), and jsonschema above the grading extra's cap.
HOSTED = ("jupyter-server==2.14.2", "ipywidgets==8.1.5", "jsonschema==4.25.1")
#: What the plain package must never bring: the Lab's and the grading's extras.
NOT_BROUGHT = ("jupyterlab", "nbgrader", "notebook", "nbconvert", "jupyterhub")
CHAPTER_0 = ROOT / "course" / "00_request_lifecycle.ipynb"

pytestmark = [
    pytest.mark.index, pytest.mark.slow,
    pytest.mark.skipif(not (os.environ.get("CI") or os.environ.get("TINYSERVE_INDEX_TESTS")),
                       reason="installs from the package index (torch included): runs in CI, "
                              "or set TINYSERVE_INDEX_TESTS=1"),
]


def _run(cmd: list[str], cwd: Path) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(MPLBACKEND="Agg", OMP_NUM_THREADS="1", PIP_DISABLE_PIP_VERSION_CHECK="1")
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{' '.join(cmd)}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


def _installed(python: Path, cwd: Path) -> dict[str, str]:
    listed = json.loads(_run([str(python), "-m", "pip", "list", "--format=json"], cwd))
    return {p["name"].lower().replace("_", "-"): p["version"] for p in listed}


def chapter_0_first_cells(through: str = "[finished:") -> str:
    """Chapter 0's code cells up to the one that prints ``through``, as one script (IPython's
    magics dropped; the hosted install cell included: on the installed copy it does nothing)."""
    nb = json.loads(CHAPTER_0.read_text())
    code = ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code"]
    last = next((i for i, source in enumerate(code) if through in source), None)
    assert last is not None, f"no code cell of {CHAPTER_0.name} prints {through!r}"
    cells = code[:last + 1]
    lines = [line for c in cells for line in c.splitlines()
             if not line.lstrip().startswith(("%", "!"))]
    return "\n".join(lines) + "\n"


def test_the_plain_package_keeps_the_hosts_torch_and_jupyter_and_runs_chapter_0(
        tmp_path: Path) -> None:
    wheel = build_wheel(tmp_path)

    # The service's image: a fresh venv, its torch, then its Jupyter server and widgets.
    venv = tmp_path / "hosted"
    _run([sys.executable, "-m", "venv", str(venv)], tmp_path)
    python = venv / "bin" / "python"
    pip = [str(python), "-m", "pip", "install", "-q", "--no-compile"]   # no .pyc: faster
    torch_release = torch.__version__.split("+")[0]
    _run([*pip, f"torch=={torch_release}"], tmp_path)
    _run([*pip, *HOSTED], tmp_path)
    before = _installed(python, tmp_path)
    assert before["torch"].split("+")[0] == torch_release
    assert before["jupyter-server"] == "2.14.2" and before["ipywidgets"] == "8.1.5"

    # The README's cell: the plain package, nothing pinned beside it.
    _run([*pip, str(wheel)], tmp_path)
    after = _installed(python, tmp_path)
    replaced = {name: (v, after.get(name)) for name, v in before.items() if after.get(name) != v}
    assert not replaced, f"the install replaced the host's packages: {replaced}"
    brought = sorted(set(NOT_BROUGHT) & (set(after) - set(before)))
    assert not brought, f"the plain package brought the Lab's or the grading's {brought}"
    assert "tinyserve" in after

    # Chapter 0's first cells on the installed copy (run outside the checkout).
    work = tmp_path / "work"
    work.mkdir()
    (work / "chapter0.py").write_text(chapter_0_first_cells())
    out = _run([str(python), "chapter0.py"], work)
    assert "already installed" in out, out          # the install cell, run on an installed copy
    assert "parameters" in out and "running on cpu" in out, out
    assert "prompt tokens" in out and "[finished:" in out, out
    where = _run([str(python), "-c", "import tinyserve; print(tinyserve.__file__)"], work)
    assert Path(where.strip()).is_relative_to(venv), where
