"""Set-up files agree with each other: pyproject, environment.yml, Makefile, CI entry."""
from __future__ import annotations

import re
import tomllib
from pathlib import Path

import yaml

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
    project_at = recipe.index("install -q -e .")
    assert torch_at < project_at, "torch must be installed before the project's dependencies"


def test_ci_entry_calls_the_readme_test_command() -> None:
    ci = (ROOT / ".ci" / "run").read_text()
    readme = (ROOT / "README.md").read_text()
    assert "make test" in ci
    assert "make test" in readme and "make lab" in readme
    assert readme.index("make lab") < 1500, "the README should open with the two commands"
