"""What every suite shares: a median timer that is honest on CUDA, the machine and commit
stamp, the JSON report and a plain-text table."""
from __future__ import annotations

import datetime as _dt
import json
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from tinyserve.provenance import git_commit, machine_info



def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_seconds(fn: Callable[[], Any], device: torch.device, repeats: int = 5,
                   warmup: int = 1) -> float:
    """Median wall time of ``fn()`` over ``repeats`` runs after ``warmup`` untimed ones.

    The median, not the mean: one run disturbed by another process should not move the
    figure. The device is synchronised before and after, so queued CUDA work is counted.
    """
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def report(suite: str, ratios: dict[str, float], measurements: dict[str, Any],
           conditions: dict[str, Any], quick: bool) -> dict[str, Any]:
    return {
        "suite": suite,
        "ratios": {k: round(float(v), 4) for k, v in ratios.items()},
        "measurements": measurements,
        "conditions": conditions,
        "quick": quick,
        "machine": machine_info(),
        "git_commit": git_commit(),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }


def write_json(data: dict[str, Any], path: str | None) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(data, indent=2) + "\n")
        print(f"wrote {path}")


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A fixed-width text table; floats with 3 significant decimals."""
    cells = [[f"{c:.3f}" if isinstance(c, float) else str(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h)
              for i, h in enumerate(headers)]
    line = lambda r: "  ".join(c.rjust(w) for c, w in zip(r, widths))  # noqa: E731
    return "\n".join([line(headers), line(["-" * w for w in widths]), *map(line, cells)])
