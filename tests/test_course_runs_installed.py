"""The course's committed bench reports are found wherever the package came from: an installed
copy ships them (package data), the clone it was installed from holds them, or
``$TINYSERVE_RESULTS_DIR`` names a folder; only where none is does a chapter say "not here".

Offline, as tests/test_packaging.py installs: no build isolation, no index; the dependencies
come from this venv's site-packages, added after the new venv's own."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from wheels import copy_sources

ROOT = Path(__file__).resolve().parents[1]
PROBE = ("import tinyserve, tinyserve.paths as p; from tinyserve.workbook.course_runs import "
         "course_run, missing; r = course_run('scale'); print(tinyserve.__file__); "
         "print(p.results_folder()); print(r and r.get('suite')); print(missing('scale'))")


def _run(cmd: list[str], cwd: Path, **env: str) -> list[str]:
    clean = {k: v for k, v in os.environ.items()
             if k not in ("PYTHONPATH", "VIRTUAL_ENV", "TINYSERVE_RESULTS_DIR")}
    done = subprocess.run(cmd, cwd=cwd, env={**clean, **env}, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, f"{' '.join(cmd)}\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
    return done.stdout.splitlines()


def test_the_reports_ship_as_package_data() -> None:
    import tomllib
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert "results/*.json" in data["package-data"]["bench"]


@pytest.mark.slow
def test_course_runs_are_found_from_an_installed_copy_its_clone_or_a_named_folder(
        tmp_path: Path) -> None:
    clone = tmp_path / "clone"                    # what `git clone` left, installed from
    copy_sources(clone)
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], tmp_path)
    python = str(venv / "bin" / "python")
    site = Path(_run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                     tmp_path)[0])
    ours = next(p for p in map(Path, sys.path) if p.name == "site-packages" and p.is_dir())
    # The build needs setuptools, and only it: this venv's whole site-packages would show pip
    # this venv's own tinyserve, which it would then try to uninstall.
    tools = tmp_path / "build-tools"
    tools.mkdir()
    for found in (ours / "setuptools", ours / "_distutils_hack",
                  *ours.glob("setuptools-*.dist-info")):      # its commands: entry points
        (tools / found.name).symlink_to(found)
    (site / "course_deps.pth").write_text(f"{tools}\n")
    _run([sys.executable, "-m", "pip", "--disable-pip-version-check", "-q", "--python", python,
          "install", "--no-deps", "--no-index", "--no-build-isolation", str(clone)], tmp_path)
    (site / "course_deps.pth").write_text(f"{ours}\n")
    work = tmp_path / "work"
    work.mkdir()

    # 1. the installed copy's own reports (package data), away from any checkout
    where, folder, suite, _ = _run([python, "-c", PROBE], work)
    assert Path(where).is_relative_to(venv) and Path(folder) == site / "bench" / "results"
    assert suite == "scale"
    # 2. without them, the clone it was installed from (pip's direct_url.json)
    shutil.rmtree(site / "bench" / "results")
    _, folder, suite, _ = _run([python, "-c", PROBE], work)
    assert Path(folder) == clone / "bench" / "results" and suite == "scale"
    # 3. a folder the learner names wins
    named = tmp_path / "named"
    named.mkdir()
    (named / "scale.json").write_text(json.dumps({"suite": "scale-named"}))
    _, folder, suite, _ = _run([python, "-c", PROBE], work, TINYSERVE_RESULTS_DIR=str(named))
    assert Path(folder) == named and suite == "scale-named"
    # 4. none of them: the chapter says so and what to do
    shutil.rmtree(clone / "bench" / "results")
    _, folder, suite, said = _run([python, "-c", PROBE], work)
    assert folder == "None" and suite == "None"
    assert "not here" in said and "TINYSERVE_RESULTS_DIR" in said
