"""Where a figure came from: the machine and the git commit, recorded with every report
(training, benchmark suites, the grading benchmark) so a number can be traced back."""
from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path
from typing import Any

import torch

from .paths import CHECKOUT



def machine_info() -> dict[str, Any]:
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }
    try:  # the oracle the hf suite compares against, when installed
        import transformers
        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    return info


def git_commit(cwd: Path | None = CHECKOUT) -> str | None:
    """HEAD of the repository, with ``-dirty`` when tracked files differ from it; None outside
    a git checkout (an installed package has none: never report an enclosing repository's).

    Reports under bench/results/ do not count: ``make bench`` writes them one suite after
    another, and the code every later suite runs is still exactly HEAD's."""
    if cwd is None:
        return None
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True,
                              text=True, check=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--",
                                ".", ":(exclude)bench/results"],
                               cwd=cwd, capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("-dirty" if dirty else "")
