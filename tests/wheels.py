"""The package as a wheel, built the same way by every test that installs it elsewhere."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WHEEL_SOURCES = ("pyproject.toml", "README.md", "tinyserve", "autograder", "bench")


def copy_sources(dest: Path) -> None:
    """What a wheel is built from (``WHEEL_SOURCES``), copied into a new folder ``dest``, as
    `git clone` would leave it (no caches, no egg-info)."""
    dest.mkdir()
    for name in WHEEL_SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, dest / name,
                            ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        else:
            shutil.copy(ROOT / name, dest / name)


def build_wheel(tmp_path: Path) -> Path:
    """The tinyserve wheel, built from a copy of the checkout under ``tmp_path`` (building
    leaves no build/ or egg-info in the checkout). Offline: no build isolation, no index."""
    src = tmp_path / "src"
    copy_sources(src)
    cmd = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q", "wheel", "--no-deps",
           "--no-build-isolation", "--no-index", "-w", str(tmp_path / "dist"), str(src)]
    done = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{' '.join(cmd)} failed:\n{done.stdout}\n{done.stderr}"
    wheels = list((tmp_path / "dist").glob("tinyserve-*.whl"))
    assert len(wheels) == 1, f"expected one wheel, built {wheels}"
    return wheels[0]
