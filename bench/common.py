"""What every suite shares: timers that are honest on CUDA (one function's median, several
functions taken in turns, which live in :mod:`tinyserve.device` beside its one timing loop and
clock, since the fast path times its own choices with them), the
machine and commit stamp, the JSON report (the plain-text table is ``tinyserve.tables.table``)."""
from __future__ import annotations

import datetime as _dt
import json
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from tinyserve.config import ModelConfig
from tinyserve.device import clock, sync, timings  # noqa: F401 - sync: the suites import it here
# One in-turns timer for the suites and the fast path's own choices (tinyserve.device).
from tinyserve.device import in_turns, interleaved_seconds  # noqa: F401
from tinyserve.model import TinyLlama
from tinyserve.provenance import git_commit, machine_info
from tinyserve.tables import table  # noqa: F401  (the suites print with it; it lives in tinyserve)

#: ``--quick`` runs every suite on this tiny random model: seconds, and figures that mean nothing.
QUICK_CONFIG = ModelConfig(vocab_size=128, hidden_size=32, intermediate_size=64,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           max_position_embeddings=64)


def load_bench_model(quick: bool, device: torch.device | str = "cpu",
                     quick_config: ModelConfig = QUICK_CONFIG) -> tuple[TinyLlama, str]:
    """The shipped target in fp32, or with ``quick`` a seeded random model whose weights are
    scaled 3x (away from the near-uniform init, so greedy decoding has no near-ties that
    float noise could flip). Returns the model and a label for the report."""
    if quick:
        torch.manual_seed(0)
        model = TinyLlama(quick_config).eval()
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(3)
        return model.to(device), "random tiny (quick)"
    from tinyserve.checkpoint import load_model
    return load_model("target", device=device, dtype=torch.float32).eval(), "target"


def cold_compiles(run: Callable[[str | None, bool], dict[str, Any]], json_path: str | None,
                  quick: bool) -> dict[str, Any]:
    """``run(json_path, quick)`` with inductor's on-disk caches off (a full run only): its
    compile seconds are what a first user waits, where a cache left by an earlier run would
    turn each compile into a reload. Patched for this run only, not the rest of the process."""
    import torch._inductor.config as inductor_config
    with inductor_config.patch(force_disable_caches=not quick):
        return run(json_path, quick)


def median_seconds(fn: Callable[[], Any], device: torch.device, repeats: int = 5,
                   warmup: int = 1) -> float:
    """Median wall time of ``fn()`` over ``repeats`` runs after ``warmup`` untimed ones
    (:func:`tinyserve.device.timings`). The median, not the mean: one run disturbed by another
    process should not move the figure."""
    return statistics.median(timings(fn, device, repeats, warmup=warmup))


def median_ratio(numerator: list[float], denominator: list[float]) -> float:
    """The median over rounds of numerator / denominator (same-round pairs)."""
    return statistics.median(a / b for a, b in zip(numerator, denominator, strict=True))


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


def write_json(data: dict[str, Any], path: str | None, announce: bool = True) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(data, indent=2) + "\n")
        if announce:
            print(f"wrote {path}")
