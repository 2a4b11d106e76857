"""Set-up files agree with each other (pyproject, environment.yml, Makefile, CI entry), and
the package installs from a wheel and runs outside the checkout."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

from wheels import build_wheel

ROOT = Path(__file__).resolve().parents[1]


def _normalise(spec: str) -> str:
    name, rest = re.match(r"\s*([A-Za-z0-9_.\-]+)\s*(.*)", spec).groups()  # type: ignore[union-attr]
    return name.lower().replace("_", "-") + rest.replace(" ", "")


def pyproject_requirements() -> set[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    specs = list(project["dependencies"])
    for extra in project.get("optional-dependencies", {}).values():
        specs += extra
    return {_normalise(s) for s in specs}


def conda_requirements() -> set[str]:
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    pip_lists = [d["pip"] for d in env["dependencies"] if isinstance(d, dict) and "pip" in d]
    assert len(pip_lists) == 1, "environment.yml should have exactly one pip: section"
    return {_normalise(s) for s in pip_lists[0]}


def test_environment_yml_mirrors_pyproject() -> None:
    ours, conda = pyproject_requirements(), conda_requirements()
    assert ours == conda, (
        f"environment.yml and pyproject.toml drifted apart: only in pyproject "
        f"{sorted(ours - conda)}, only in environment.yml {sorted(conda - ours)}")


def test_environment_yml_python_matches_requires_python() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    pythons = [d for d in env["dependencies"] if isinstance(d, str) and d.startswith("python")]
    assert pythons == ["python" + project["requires-python"]]


def test_makefile_pins_torch_before_installing_the_project() -> None:
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^TORCH_SPEC\s*\?=\s*torch==2\.13\.0$", makefile, re.M), \
        "TORCH_SPEC must default to torch==2.13.0 and stay overridable (?=)"
    recipe = makefile.split("$(VENV)/.stamp-base:")[1].split("\n\n")[0]
    torch_at = recipe.index('"$(TORCH_SPEC)"')
    # the runtime plus the Lab's and the grading's extras: `make lab` needs all three
    project_at = recipe.index('install -q -e ".[lab,grading]"')
    assert torch_at < project_at, "torch must be installed before the project's dependencies"


def test_the_runtime_leaves_the_notebook_server_to_its_host() -> None:
    """The plain package (what a hosted notebook installs, README "On a hosted notebook")
    brings no Jupyter, grading or widget package, and no cap on one: those would replace the
    service's own. They are the extras `make lab` installs."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    runtime = {_normalise(s).split(">")[0].split("=")[0].split("<")[0]
               for s in project["dependencies"]}
    hosted = {"jupyterlab", "notebook", "jupyter-server", "nbgrader", "ipywidgets",
              "jsonschema", "nbformat", "nbclient", "nbconvert", "ipykernel", "jupyter-client"}
    assert not runtime & hosted, f"the runtime would replace the host's {sorted(runtime & hosted)}"
    extras = project["optional-dependencies"]
    assert {"jupyterlab", "ipywidgets"} <= {_normalise(s).split(">")[0] for s in extras["lab"]}
    assert {"nbgrader", "nbclient"} <= {_normalise(s).split(">")[0] for s in extras["grading"]}


def test_ci_entry_calls_the_readme_test_command() -> None:
    ci = (ROOT / ".ci" / "run").read_text()
    readme = (ROOT / "README.md").read_text()
    assert "make test" in ci
    assert "make test" in readme and "make lab" in readme
    assert readme.index("make lab") < 1500, "the README should open with the two commands"




@pytest.mark.slow
def test_the_wheel_installs_outside_the_checkout_and_runs(tmp_path: Path) -> None:
    """Built into a wheel and installed in a fresh venv away from the checkout, the package
    finds its weights, tokenizer and Harbor tickets (package data) and its CLI runs. Offline:
    no build isolation, no index; the dependencies come from this venv's site-packages, added
    after the new venv's own (so the installed copy, not the checkout, is what gets imported)."""
    wheel = build_wheel(tmp_path)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]

    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], tmp_path)
    python = venv / "bin" / "python"
    _run([*pip, "--python", str(python), "install", "--no-deps", "--no-index", str(wheel)],
         tmp_path)
    site = _run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                tmp_path).strip()
    ours = next(p for p in map(Path, sys.path) if p.name == "site-packages" and p.is_dir())
    (Path(site) / "course_deps.pth").write_text(f"{ours}\n")

    where = _run([str(python), "-c", "import tinyserve, tinyserve.provenance as p; "
                  "print(tinyserve.__file__); print(p.git_commit())"], tmp_path).split()
    assert Path(where[0]).is_relative_to(venv), f"imported {where[0]}, not the installed wheel"
    assert where[1] == "None", "an installed package reports no git commit"
    out = _run([str(venv / "bin" / "tinyserve"), "generate", "--prompt", "<|ticket|>Subject: Login",
                "--max-tokens", "4"], tmp_path, stderr=True)
    assert "TTFT" in out, out
    assert "--rate" in _run([str(python), "-m", "tinyserve", "loadgen", "--help"], tmp_path)
    tickets = _run([str(python), "-c", "from tinyserve.loadgen.prompts import harbor_prompts; "
                    "print(len(harbor_prompts(5)))"], tmp_path)
    assert tickets.strip() == "5"


def _run(cmd: list[str], cwd: Path, stderr: bool = False) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout + (proc.stderr if stderr else "")


def test_package_copy_of_the_harbor_tickets_matches_the_project_file() -> None:
    from tinyserve.paths import HARBOR_TICKETS
    assert HARBOR_TICKETS.read_bytes() == (ROOT / "harbor_project/fixtures/tickets.jsonl").read_bytes(), (
        "the load generator's Harbor tickets drifted from harbor_project/fixtures/tickets.jsonl: "
        "run `python harbor_project/tools/make_tickets.py`")
