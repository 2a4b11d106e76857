"""README "On a hosted notebook": the one install cell, which every chapter carries first, is
idempotent and works from any working folder.

The cell is taken from the README as it stands and run, as a learner's kernel runs it, with a
throwaway venv's Python (no tinyserve in it) and ``COURSE_URL`` pointed at a local git repository
shaped like the course (its ``pyproject.toml`` and ``tinyserve/paths.py``, built by a backend in
the repository itself, so the install needs no package index). Run twice from the folder above
the clone, the second run clones nothing, installs nothing and says only ``already
installed``; run from a notebook's folder inside the clone, it installs that clone and makes no
second copy.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
CHAPTERS = sorted((ROOT / "course").glob("*.ipynb")) + [ROOT / "START_HERE.ipynb"]

#: A build backend inside the repository (``backend-path``): writes the wheel by hand, so a
#: build needs nothing from an index.
BACKEND = '''
import base64, hashlib, pathlib, zipfile
NAME, VERSION = "tinyserve", "0.0.1"

def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    root = pathlib.Path(__file__).parent
    dist = f"{NAME}-{VERSION}.dist-info"
    files = {p.relative_to(root).as_posix(): p.read_bytes() for p in (root / NAME).rglob("*.py")}
    files[f"{dist}/METADATA"] = f"Metadata-Version: 2.1\\nName: {NAME}\\nVersion: {VERSION}\\n".encode()
    files[f"{dist}/WHEEL"] = b"Wheel-Version: 1.0\\nGenerator: test\\nRoot-Is-Purelib: true\\nTag: py3-none-any\\n"
    digest = lambda d: base64.urlsafe_b64encode(hashlib.sha256(d).digest()).rstrip(b"=").decode()
    record = [f"{n},sha256={digest(d)},{len(d)}" for n, d in files.items()] + [f"{dist}/RECORD,,"]
    files[f"{dist}/RECORD"] = ("\\n".join(record) + "\\n").encode()
    name = f"{NAME}-{VERSION}-py3-none-any.whl"
    with zipfile.ZipFile(pathlib.Path(wheel_directory) / name, "w") as wheel:
        for n, d in files.items():
            wheel.writestr(n, d)
    return name
'''


def readme_cell() -> str:
    """The README's install cell, as printed there."""
    block = README.split("## On a hosted notebook", 1)[1].split("```python\n", 1)[1]
    return block.split("```", 1)[0]


def test_every_chapter_starts_with_the_readmes_cell_marked_hosted_only(tmp_path: Path) -> None:
    cell = readme_cell()
    assert cell.startswith("# Hosted notebooks only")
    for path in CHAPTERS:
        cells = json.loads(path.read_text())["cells"]
        code = next(c for c in cells if c["cell_type"] == "code")
        assert "".join(code["source"]) == cell.rstrip("\n"), f"{path.name}: not the README's cell"
        assert code["metadata"].get("tags") == ["hosted-only"], path.name
    # not counted in a chapter's working time (tinyserve.workbook.study_time)
    from tinyserve.workbook.study_time import estimate
    chapter = json.loads(CHAPTERS[0].read_text())
    first = next(c for c in chapter["cells"] if c["cell_type"] == "code")
    first["metadata"]["tags"] = []
    counted = tmp_path / CHAPTERS[0].name
    counted.write_text(json.dumps(chapter))
    assert estimate(counted).running == estimate(CHAPTERS[0]).running + 1


def test_validate_would_skip_it() -> None:
    from autograder.submitted.setup_cells import setup_lines
    assert setup_lines(readme_cell())


@pytest.fixture(scope="module")
def course(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A git repository shaped like the course (what the cell looks for), committed."""
    repo = tmp_path_factory.mktemp("origin") / "course"
    (repo / "tinyserve").mkdir(parents=True)
    (repo / "course").mkdir()
    (repo / "tinyserve" / "__init__.py").write_text("")
    (repo / "tinyserve" / "paths.py").write_text("COURSE = True\n")
    (repo / "course" / "01_chapter.ipynb").write_text("{}")
    (repo / "_backend.py").write_text(BACKEND)
    (repo / "pyproject.toml").write_text('[build-system]\nrequires = []\n'
                                         'build-backend = "_backend"\nbackend-path = ["."]\n')
    for cmd in (["git", "init", "-q"], ["git", "add", "."],
                ["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "c"]):
        subprocess.run(cmd, cwd=repo, check=True, capture_output=True)
    return repo


def fresh_venv(where: Path) -> Path:
    """A venv with pip and nothing else (no tinyserve): a learner's kernel before the cell."""
    subprocess.run([sys.executable, "-m", "venv", str(where)], check=True, capture_output=True,
                   timeout=300)
    return where / "bin" / "python"


def run_cell(python: Path, cwd: Path, url: str) -> str:
    source = readme_cell().replace("<the course's repository URL>", url)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(PIP_NO_INDEX="1", PIP_DISABLE_PIP_VERSION_CHECK="1", GIT_TERMINAL_PROMPT="0")
    done = subprocess.run([str(python), "-c", source], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0 and not done.stderr, done.stdout + done.stderr
    return done.stdout


def installed_record(python: Path) -> Path:
    """The venv's tinyserve-*.dist-info (asked from /, where no source tree is on the path)."""
    found = subprocess.run([str(python), "-c", "import importlib.metadata as m; "
                            "print(m.distribution('tinyserve')._path)"], cwd="/",
                           capture_output=True, text=True, check=True).stdout.strip()
    assert found.endswith(".dist-info") and "site-packages" in found, found
    return Path(found)


@pytest.mark.slow
def test_run_twice_from_above_the_clone(course: Path, tmp_path: Path) -> None:
    python, work = fresh_venv(tmp_path / "venv"), tmp_path / "content"
    work.mkdir()
    first = run_cell(python, work, course.as_uri())
    assert first.strip() == f"tinyserve installed from {work / 'tinyserve'}", first
    record = installed_record(python)
    stamp = record.stat().st_mtime_ns
    second = run_cell(python, work, course.as_uri())
    assert second == "tinyserve is already installed: nothing to do\n"
    assert record.stat().st_mtime_ns == stamp                       # not reinstalled
    assert sorted(p.name for p in work.iterdir()) == ["tinyserve"]  # one clone, no other
    # the installed copy, run from elsewhere, is the package (not the clone's source tree)
    out = subprocess.run([str(python), "-c", "import tinyserve.paths as p; print(p.__file__)"],
                         cwd=tmp_path, capture_output=True, text=True, check=True).stdout
    assert "site-packages" in out


@pytest.mark.slow
def test_run_from_a_notebooks_folder_inside_the_clone(course: Path, tmp_path: Path) -> None:
    clone = tmp_path / "content" / "tinyserve"
    subprocess.run(["git", "clone", "-q", course.as_uri(), str(clone)], check=True,
                   capture_output=True)
    python, chapters = fresh_venv(tmp_path / "venv"), clone / "course"
    # an unreachable URL: the cell must not clone when it runs inside a clone
    first = run_cell(python, chapters, "file:///nonexistent/course")
    assert first.strip() == f"tinyserve installed from {clone}", first
    assert sorted(p.name for p in chapters.iterdir()) == ["01_chapter.ipynb"]
    direct = json.loads((installed_record(python) / "direct_url.json").read_text())
    assert direct["url"] == clone.as_uri()
    assert run_cell(python, chapters, "file:///nonexistent/course") == \
        "tinyserve is already installed: nothing to do\n"


def test_the_readme_says_what_the_cell_does_and_what_pips_line_means() -> None:
    hosted = README.split("## On a hosted notebook", 1)[1].split("\n## ", 1)[0]
    assert "tinyserve is already installed: nothing to do" in hosted
    assert re.search(r"pip's dependency resolver[^.]*\.\.\.`? line", hosted)
    assert "TINYSERVE_CACHE_DIR" in hosted and "%env TINYSERVE_CACHE_DIR=" in hosted
