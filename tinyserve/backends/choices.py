"""What each fast shape runs: the fastest of the ways this machine has, measured here, kept.

A step of the CPU fast path (a decode bucket, an engine decode step, one width of
speculation's passes) can run three ways: **compiled** (``torch.compile``, frozen weights),
**packed** (the same forward pass run eagerly over weights packed once for oneDNN, two rows or
more) or **eager** (the plain forward pass, the loops' reference). Which is fastest depends on
the CPU (its vector width, its BLAS, its caches), the model and the rows: a compiled step that
wins on one machine can lose to eager on another. So the fast path never assumes: once a shape
is compiled, :func:`choose` times every way in turns, as a loop runs them, and keeps the
fastest; eager is its floor. Where no compiler works (:mod:`~tinyserve.toolchain`)
the compiled way is not offered.

Every choice is kept on disk next to the fast path's kernels (:class:`ChoiceBook`, keyed by
the processor, the threads, the model's shape, the step's shape and the recipe), so a second
run reads it and does not compile a shape that lost. ``bench scale`` measures the fast step
against eager (``scale_fast_vs_eager_b1``), the way the loops run them.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
import hashlib
import json
import os
from pathlib import Path
from typing import Any
import warnings

import torch

from ..device import interleaved_seconds

__all__ = ["CHOICES_FILE", "CHOICE_RUNS", "WAYS", "ChoiceBook", "StepChoice", "choose",
           "shape_key"]

#: The ways a step can run, in the order a tie goes (the compiled step first: it is what
#: the fast path is for; eager last: the floor).
WAYS = ("compiled", "packed", "eager")

#: Runs of each way a choice is timed over, in turns (the fastest kept).
CHOICE_RUNS = 5

#: The file, in the fast path's kernel folder (one per torch version), that keeps choices.
CHOICES_FILE = "step_choices.json"


def read_kept(path: Path | None) -> dict[str, Any]:
    """The JSON object kept at ``path``; ``{}`` where there is none, or it is unreadable or not
    an object (a kept file is a saving, never a reason to fail)."""
    if path is None or not path.is_file():
        return {}
    try:
        kept = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return kept if isinstance(kept, dict) else {}


@dataclass(frozen=True)
class StepChoice:
    """What a step of ``rows`` rows runs (``kernel``, one of :data:`WAYS`), each timed way's
    seconds (the fastest of :data:`CHOICE_RUNS`), and ``why``: ``"timed"`` (just now),
    ``"kept"`` (read from an earlier run's :class:`ChoiceBook`), ``"no compiler"`` (the
    toolchain's answer), ``"compile failed"`` or ``"recipe"`` (the recipe forces it)."""
    rows: int
    kernel: str
    seconds: tuple[tuple[str, float], ...] = ()
    why: str = "timed"

    def __post_init__(self) -> None:
        if self.kernel not in WAYS:
            raise ValueError(f"kernel must be one of {', '.join(WAYS)}, not {self.kernel!r}")

    def run(self, ways: Mapping[str, Callable[[], Any]]) -> Any:
        """The step as chosen: ``ways[kernel]()``."""
        return ways[self.kernel]()

    @property
    def compiles(self) -> bool:
        """Whether this choice needs the compiled step."""
        return self.kernel == "compiled"

    def sentence(self) -> str:
        what = {"compiled": "compiled", "packed": "eager over weights packed once for oneDNN",
                "eager": "eager"}[self.kernel]
        timed = ", ".join(f"{name} {s * 1e3:.1f} ms" for name, s in self.seconds)
        how = {"timed": "timed in turns now", "kept": "timed in an earlier run, kept on disk",
               "no compiler": "no compiler here", "compile failed": "its compile failed",
               "recipe": "as the recipe says"}[self.why]
        return f"{what} ({how}" + (f": {timed}" if timed else "") + ")"

    def to_json(self) -> dict[str, Any]:
        return {"rows": self.rows, "kernel": self.kernel, "seconds": dict(self.seconds)}

    @classmethod
    def from_json(cls, entry: Mapping[str, Any]) -> "StepChoice":
        return cls(int(entry["rows"]), str(entry["kernel"]),
                   tuple((str(k), float(v)) for k, v in dict(entry["seconds"]).items()), "kept")


def choose(rows: int, ways: Mapping[str, Callable[[], Any]], device: torch.device,
           runs: int = CHOICE_RUNS) -> StepChoice:
    """Time each of ``ways`` (names from :data:`WAYS`) ``runs`` times in turns, after one
    untimed call each (it packs or loads anything lazy), and choose the fastest run's way;
    a tie goes to the earlier in :data:`WAYS`. Each call must leave the step's state as it
    found it (a decode step re-run on the same inputs writes the same keys to the same slots)."""
    order = [w for w in WAYS if w in ways]
    if len(order) == 1:
        return StepChoice(rows, order[0], why="recipe")
    seconds = interleaved_seconds({w: ways[w] for w in order}, device, runs)
    best = {w: min(seconds[w]) for w in order}
    kernel = min(order, key=lambda w: (best[w], order.index(w)))
    return StepChoice(rows, kernel, tuple((w, best[w]) for w in order))


def _processor() -> str:
    from .packed import _processor as name
    return name()


def shape_key(model: torch.nn.Module, what: str, recipe: Any) -> str:
    """The key a step's choice is kept under: the processor and threads (a choice is this
    machine's), the model's shape and dtype (not its weights: a choice depends on shapes),
    ``what`` (the step and its shape, in words) and the recipe (hashed)."""
    config = model.config
    int8 = any(b.dtype == torch.int8 for b in model.buffers())
    dtype = next(model.parameters()).dtype
    shape = (f"hidden {config.hidden_size}, MLP {config.intermediate_size}, "
             f"{config.num_hidden_layers} layers, heads {config.num_attention_heads}/"
             f"{config.num_key_value_heads}, vocab {config.vocab_size}, {dtype}"
             + (", int8" if int8 else ""))
    recipe_hash = hashlib.sha1(repr(recipe).encode()).hexdigest()[:10]
    return (f"{_processor()} | {torch.get_num_threads()} threads | {shape} | {what} | "
            f"recipe {recipe_hash}")


class ChoiceBook:
    """The choices kept in ``folder`` / :data:`CHOICES_FILE` (None: kept in memory only).
    A file that cannot be read is started over; one that cannot be written, a warning."""

    def __init__(self, folder: Path | None) -> None:
        self.path = None if folder is None else Path(folder) / CHOICES_FILE
        self._memory: dict[str, dict[str, Any]] = {}

    def _read(self) -> dict[str, Any]:
        return read_kept(self.path)

    def get(self, key: str) -> StepChoice | None:
        entry = self._memory.get(key) or self._read().get(key)
        if entry is None:
            return None
        try:
            return StepChoice.from_json(entry)
        except (KeyError, TypeError, ValueError):
            return None

    def put(self, key: str, choice: StepChoice) -> None:
        self._memory[key] = choice.to_json()
        if self.path is None:
            return
        from torch.utils._filelock import FileLock   # pytest workers share one folder
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with FileLock(str(self.path) + ".lock", timeout=30):
                kept = self._read()
                kept[key] = choice.to_json()
                scratch = self.path.with_suffix(f".{os.getpid()}.tmp")   # whole or not at all
                scratch.write_text(json.dumps(kept, indent=1, sort_keys=True))
                os.replace(scratch, self.path)
        except Exception as err:   # noqa: BLE001 - a folder we may not write: still chosen
            warnings.warn(f"could not keep the fast path's step choice in {self.path} ({err}); "
                          "the next run times it again", stacklevel=2)
