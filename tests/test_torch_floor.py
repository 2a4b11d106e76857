"""The torch floor: declared once (tinyserve.TORCH_FLOOR, pyproject.toml, environment.yml),
said clearly at import when torch is older, and every decoding path smoked (tests/smoke_paths.py,
which ``make torch-floor`` runs on the oldest torch the index has at or above the floor)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import tinyserve
from smoke_paths import PATHS, declared_floor, lowest_torch, smoke

ROOT = Path(__file__).resolve().parents[1]


def test_the_declared_floor_is_the_packages() -> None:
    assert declared_floor((ROOT / "pyproject.toml").read_text()) == tinyserve.TORCH_FLOOR
    assert tinyserve.TORCH_FLOOR >= (2, 5), "F.rms_norm is 2.4+, SDPA's enable_gqa 2.5+"
    floor = ".".join(map(str, tinyserve.TORCH_FLOOR))
    assert f"- torch>={floor}\n" in (ROOT / "environment.yml").read_text()
    makefile = (ROOT / "Makefile").read_text()
    assert "torch-floor:" in makefile and "tests/smoke_paths.py --lowest-torch" in makefile


@pytest.mark.parametrize("version", ["2.5.0", "2.5.1+cu121", "2.13.0+cpu", "2.5.0a0+git1234",
                                     "2.6.0.dev20241001", "3.0.0", "10.1"])
def test_torch_at_or_above_the_floor_passes(version: str) -> None:
    tinyserve.check_torch_version(version)


@pytest.mark.parametrize("version", ["2.4.1", "2.3.0+cpu", "1.13.1", "2.4.0a0+nv24.05"])
def test_older_torch_is_refused_naming_the_floor_and_the_fix(version: str) -> None:
    with pytest.raises(ImportError) as err:
        tinyserve.check_torch_version(version)
    text = str(err.value)
    assert f"torch {version}" in text and "torch >= 2.5" in text
    assert 'pip install "torch>=2.5"' in text


def test_import_tinyserve_with_an_older_torch_says_so() -> None:
    """What a learner with torch 2.4 sees: one clear line at ``import tinyserve``, not a
    traceback from the first generate."""
    code = "import torch; torch.__version__ = '2.4.1'; import tinyserve"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: tinyserve needs torch >= 2.5, but this environment "
                           "has torch 2.4.1"), done.stderr[-2000:]


def test_the_lowest_torch_is_found_in_pips_answer() -> None:
    answer = ("torch (2.15.0)\nAvailable versions: 2.15.0, 2.13.0+cpu, 2.13.0, 2.6.0, 2.5.1, "
              "2.5.0, 2.5.0rc1, 2.4.1, 2.0.0\n")
    assert lowest_torch(answer, (2, 5)) == "2.5.0"
    assert lowest_torch(answer, (2, 13)) == "2.13.0"
    with pytest.raises(ValueError, match="no torch at or above"):
        lowest_torch(answer, (3, 0))
    with pytest.raises(ValueError, match="Available versions"):
        lowest_torch("ERROR: No matching distribution found for torch", (2, 5))


def test_the_smoke_runs_every_path_on_this_torch() -> None:
    """The smoke ``make torch-floor`` runs, here on this venv's torch: so it cannot rot."""
    lines: list[str] = []
    assert smoke(lines.append) == [], "\n".join(lines)
    assert len(lines) == 2 + PATHS          # the versions, the reference, one line a path
    names = "\n".join(lines)
    for path in ("generate path='graph'", "generate_batch path='graph'", "engine, chunked prefill",
                 "speculative, path='graph'", "int8"):
        assert path in names
