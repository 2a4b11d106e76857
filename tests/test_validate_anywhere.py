"""Validate (``python -m autograder check`` and the Lab's button) finds the notebook from any
working folder, by path or by the exercise's name, and never runs a setup cell: an install
cell pasted at the top of an exercise (README "On a hosted notebook") is skipped and named in
the report, so it neither clones a nested copy of the course nor reinstalls the package."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from autograder.pipeline.check import find_notebook, kernel_env
from autograder.submitted.setup_cells import setup_cells, setup_lines, skip_setup_cells

ROOT = Path(__file__).resolve().parents[1]
EXERCISE = "harbor_capacity"
README = (ROOT / "README.md").read_text()
#: What a setup cell would leave behind if it ran: a marker file and a nested clone.
SETUP = ('import pathlib, subprocess, sys\n'
         'pathlib.Path("SETUP_RAN").write_text("ran")\n'
         'subprocess.run(["git", "clone", "-q", "--depth", "1", "file:///nonexistent", '
         '"tinyserve"])\n'
         'subprocess.run([sys.executable, "-m", "pip", "install", "-q", "./tinyserve"])\n')


@pytest.mark.parametrize("source", [
    "!git clone -q --depth 1 URL tinyserve\n%pip install -q ./tinyserve",
    "%pip install -q ./tinyserve", "%conda install numpy", "files = !ls", "%%bash\necho hi",
    "%%capture\n%pip install -q x", SETUP,
    "from subprocess import check_call\ncheck_call(['pip', 'install', 'x'])",
    "import os\nos.system('git clone URL')",
])
def test_a_setup_cell_is_recognised(source: str) -> None:
    assert setup_lines(source), source


@pytest.mark.parametrize("source", [
    "x = 1\nprint(x)", "%timeit sum(range(10))", "%%time\ny = 2", "import subprocess",
    "import os\nos.system('ls')", "def f(pip):\n    return pip.run()", "%matplotlib inline",
    "def broken(:",
])
def test_ordinary_code_is_no_setup_cell(source: str) -> None:
    assert not setup_lines(source), source


def test_skipping_keeps_answers_and_cell_numbers() -> None:
    answer = {"cell_type": "code", "metadata": {"nbgrader": {"grade_id": "a", "solution": True}},
              "source": "def f():\n    !pip install x\n    return 1"}
    test = {"cell_type": "code", "metadata": {"nbgrader": {"grade_id": "t", "grade": True}},
            "source": "!echo the instructor's test"}
    nb = {"cells": [{"cell_type": "code", "metadata": {}, "source": SETUP}, answer, test,
                    {"cell_type": "markdown", "metadata": {}, "source": "!not code"}]}
    assert [c.index for c in setup_cells(nb)] == [0]
    notes = skip_setup_cells(nb)
    assert len(nb["cells"]) == 4 and nb["cells"][0]["source"].startswith("# Validate skipped")
    assert "cell 1 not run: a setup cell (`subprocess.run([\"git\", \"clone\"" in notes[0]
    assert nb["cells"][1]["source"] == "def f():\n    pass\n    return 1"
    compile(nb["cells"][1]["source"], "answer", "exec")
    assert nb["cells"][2]["source"] == "!echo the instructor's test"   # tests are not ours
    assert len(notes) == 2 and "`!pip install x`" in notes[1]


def test_the_notebook_is_found_by_path_or_by_name_from_any_folder(tmp_path: Path) -> None:
    work = tmp_path / "work"
    shutil.copytree(ROOT / "exercises" / EXERCISE, work / EXERCISE)
    mine = (work / EXERCISE / f"{EXERCISE}.ipynb").resolve()
    assert find_notebook(f"{EXERCISE}.ipynb", work / EXERCISE) == mine   # its own folder
    assert find_notebook(EXERCISE, work / EXERCISE) == mine
    assert find_notebook(EXERCISE, work) == mine                         # by name, above it
    (tmp_path / "elsewhere").mkdir()
    assert find_notebook(f"../work/{EXERCISE}/{EXERCISE}.ipynb", tmp_path / "elsewhere") == mine
    # a path that is not there is an error, not the course's notebook of the same name
    assert isinstance(find_notebook(f"../nowhere/{EXERCISE}.ipynb", tmp_path / "elsewhere"), str)
    # the course's own copy, by name or by the Learner guide's old path, from a folder that
    # holds none: found in the course this package belongs to
    course = (ROOT / "exercises" / EXERCISE / f"{EXERCISE}.ipynb").resolve()
    assert find_notebook(EXERCISE, tmp_path) == course
    assert find_notebook(f"exercises/{EXERCISE}/{EXERCISE}.ipynb", tmp_path) == course
    missing = find_notebook("no_such_exercise", tmp_path)
    assert isinstance(missing, str) and "no such notebook" in missing
    assert "check harbor_capacity" in missing


def test_the_kernel_is_told_to_keep_the_debuggers_warning_quiet() -> None:
    env = kernel_env()
    assert env["PYDEVD_DISABLE_FILE_VALIDATION"] == "1" and env["PATH"] == os.environ["PATH"]


def test_the_checking_process_keeps_it_quiet_before_it_looks_for_the_kernel(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """On ipykernel 6 (a hosted service's stack) the kernel spec's lookup imports ipykernel,
    and with it debugpy, in the checking process itself: the warning came from this side."""
    from autograder.pipeline import check
    monkeypatch.delenv("PYDEVD_DISABLE_FILE_VALIDATION", raising=False)
    seen: list = []

    def run_notebook(*args, **kwargs):
        seen.append(os.environ.get("PYDEVD_DISABLE_FILE_VALIDATION"))
        raise KeyboardInterrupt                       # stop before any kernel starts
    monkeypatch.setattr(check, "run_notebook", run_notebook)
    with pytest.raises(KeyboardInterrupt):
        check.self_check(ROOT / "exercises" / EXERCISE / f"{EXERCISE}.ipynb", write=lambda _: None)
    assert seen == ["1"]


def with_setup_cell(folder: Path) -> Path:
    """A copy of the exercise in ``folder``, with the setup cell first, as a learner on a
    hosted notebook pastes it."""
    shutil.copytree(ROOT / "exercises" / EXERCISE, folder / EXERCISE)
    path = folder / EXERCISE / f"{EXERCISE}.ipynb"
    nb = json.loads(path.read_text())
    nb["cells"].insert(0, {"cell_type": "code", "execution_count": None, "id": "setup",
                           "metadata": {}, "outputs": [], "source": SETUP})
    path.write_text(json.dumps(nb))
    return path


@pytest.mark.slow
@pytest.mark.parametrize("where, spec", [
    ("notebook", f"{EXERCISE}.ipynb"),                    # the notebook's own folder
    ("above", EXERCISE),                                  # the exercise's name
    ("elsewhere", f"../above/{EXERCISE}/{EXERCISE}.ipynb"),   # a path from somewhere else
])
def test_check_runs_from_three_folders_and_never_runs_the_setup_cell(
        tmp_path: Path, where: str, spec: str) -> None:
    path = with_setup_cell(tmp_path / "above")
    cwd = {"notebook": path.parent, "above": tmp_path / "above",
           "elsewhere": tmp_path / "elsewhere"}[where]
    cwd.mkdir(exist_ok=True)
    done = subprocess.run([sys.executable, "-m", "autograder", "check", spec], cwd=cwd,
                          capture_output=True, text=True, timeout=300)
    out = done.stdout + done.stderr
    assert done.returncode == 1 and "Visible tests: 0 / 27 points passed." in out, out[-2000:]
    assert f"file: {path.resolve()}" in out
    assert "note: cell 1 not run: a setup cell (`subprocess.run([\"git\", \"clone\"" in out
    assert not (path.parent / "SETUP_RAN").exists() and not (path.parent / "tinyserve").exists()
    assert "Debugger warning" not in out and "frozen modules" not in out


@pytest.mark.slow
def test_the_lab_button_skips_the_setup_cell_and_says_so(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    from traitlets.config import Config
    from autograder.validate import TrustedValidator
    path = with_setup_cell(tmp_path)
    monkeypatch.chdir(path.parent)            # nbgrader validates inside the notebook's folder
    seen: list = []
    validator = TrustedValidator(config=Config({"Validator": {"validate_all": True}}))
    original = validator._preprocess
    validator._preprocess = lambda nb: seen.append(original(nb)) or seen[-1]
    results = validator.validate(str(path))
    assert results.get("failed"), results           # the blank release fails its tests
    assert not (path.parent / "SETUP_RAN").exists() and not (path.parent / "tinyserve").exists()
    first = seen[0].cells[0]
    assert first.source.startswith("# Validate skipped this setup cell")
    assert "Validate never runs install or shell cells" in first.outputs[0]["text"]


def test_one_validate_spelling_in_the_readme_the_learner_guide_and_every_intro() -> None:
    """`python -m autograder check NAME`, by the exercise's name, everywhere a learner reads
    how to validate; no spelling that only works from one folder."""
    command = "python -m autograder check "
    spelled = {line.split(command, 1)[1].split("`")[0].split()[0]
               for line in README.splitlines() if command in line}
    assert spelled and all("/" not in s and not s.endswith(".ipynb") for s in spelled), spelled
    guide = README.split("### Learner guide", 1)[1]
    assert f"{command}{EXERCISE}" in guide
    for path in sorted((ROOT / "exercises").glob("*/*.ipynb")):
        intro = "".join(json.loads(path.read_text())["cells"][0]["source"])
        assert f"`{command}{path.stem}`" in intro, path
        assert "never runs setup or install cells" in intro, path
