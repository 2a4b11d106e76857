"""``bench scale``'s record of what each fast shape runs on this machine (issue 50).

On a CPU every step shape of the fast path (a decode bucket, an engine decode step, a verify
or draft width) runs the fastest of its ways, timed in turns when the shape is first run
(:mod:`tinyserve.backends.choices`). Which way won is this machine's answer, not the
course's: the report lists every shape the suite prepared with its choice
(``measurements["fast_choices"]``), so a note can say what the fast path chose on each host.

The suite times those choices itself: :func:`fresh_cache` points the persistent cache at a
new folder for the run, so no choice kept by an earlier run (or by the tests) is read back.
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence
import contextlib
import os
import tempfile
from pathlib import Path
from typing import Any

__all__ = ["batch1", "choice_entry", "choices_text", "engine_choices", "fresh_cache",
           "model_choices", "unique"]


def choice_entry(part: str, model: str, shape: str, choice: Any) -> dict[str, Any]:
    """One shape's :class:`~tinyserve.backends.choices.StepChoice` as the report keeps it:
    which part of the suite prepared it, whose shape (``model``: "target" or "draft"), the
    shape in words, the way it runs, each timed way's seconds and why (timed now, kept...)."""
    return {"part": part, "model": model, "shape": shape, "rows": choice.rows,
            "kernel": choice.kernel, "seconds": dict(choice.seconds), "why": choice.why,
            "sentence": choice.sentence()}


def model_choices(model: Any, part: str, name: str) -> list[dict[str, Any]]:
    """The choices of every fast shape of ``model`` this process holds: its decode buckets
    (:class:`~tinyserve.backends.fast.FastDecoder`) and its pass widths (speculation's
    :class:`~tinyserve.backends.fast.CompiledPasses`). Read before :func:`forget_compiled`
    drops them. None on CUDA (graphs: nothing is chosen)."""
    from tinyserve.backends import fast
    from tinyserve.backends.compiled import DECODERS
    out = []
    for d in DECODERS.decoders(model):
        if isinstance(d, fast.FastDecoder) and d.choice is not None:
            shape = f"decode {d.cache.batch_size} rows x window {d.cache.max_seq}"
            out.append(choice_entry(part, name, shape, d.choice))
    for passes in fast._PASSES.decoders(model):
        for w, choice in sorted(getattr(passes, "choices", {}).items()):
            out.append(choice_entry(part, name, f"pass width {w} x window {passes.window}",
                                    choice))
    return out


def engine_choices(engine: Any, part: str = "engine", name: str = "target") -> list[dict[str, Any]]:
    """The choice of each decode shape of ``engine`` (``EngineConfig(path="fast")`` on a CPU:
    one :class:`~tinyserve.backends.fast.CompiledStep` per batch bucket x blocks) that has run."""
    graphs = getattr(getattr(engine, "executor", None), "graphs", None)
    steps = {} if graphs is None else graphs.graphs
    return [choice_entry(part, name, f"engine decode {rows} rows x {blocks} blocks",
                         step.choice)
            for (rows, blocks), step in sorted(steps.items())
            if getattr(step, "choice", None) is not None]


def unique(choices: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each (part, model, shape, way) once, the first kept (the one timed, where a later
    set of the same shape read it back from disk: speculation makes a new set of passes
    while an earlier one is still marked in use)."""
    seen: set[tuple[str, ...]] = set()
    out = []
    for c in choices:
        key = (c["part"], c["model"], c["shape"], c["kernel"])
        if key not in seen:
            seen.add(key)
            out.append(c)
    return out


def batch1(choices: Sequence[dict[str, Any]], part: str, prefix: str) -> dict[str, Any] | None:
    """The one-row shape of ``part`` whose words start with ``prefix`` ("decode", "engine
    decode"), if the suite recorded one."""
    return next((c for c in choices if c["part"] == part and c["rows"] == 1
                 and c["shape"].startswith(prefix)), None)


def choices_text(choices: Sequence[dict[str, Any]]) -> list[str]:
    """A line per shape for the printed summary: part, model, shape, what it runs and why."""
    return [f"{c['part']}, {c['model']} {c['shape']}: {c['sentence']}" for c in choices]


@contextlib.contextmanager
def fresh_cache() -> Iterator[Path]:
    """The fast path's persistent cache (``TINYSERVE_CACHE_DIR``, and inductor's folder
    under it) in a new empty folder while held, both variables put back after: every shape's
    choice (and the eager passes' measurement) is then timed in this run, on this load, not
    read from an earlier run's folder. A fresh process's repeat (:mod:`._prepare_repeat`)
    has folders of its own."""
    saved = {k: os.environ.get(k) for k in ("TINYSERVE_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR")}
    with tempfile.TemporaryDirectory(prefix="tinyserve-bench-scale-") as folder:
        os.environ["TINYSERVE_CACHE_DIR"] = folder
        os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)   # inductor_cache() sets it anew
        _clear_inductor_caches()
        try:
            yield Path(folder)
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
            _clear_inductor_caches()


def _clear_inductor_caches() -> None:
    """Forget the paths inductor remembers in this process (its folder changes here), as
    ``torch._inductor``'s own temporary cache folder does."""
    with contextlib.suppress(Exception):
        from torch._inductor.utils import clear_caches
        clear_caches()
