"""A compile says what it does and about how long it takes here before it starts, and shows
its elapsed time while it runs.

One ``torch.compile`` of a decode step is a single call that returns only when done: seconds to
minutes on two cores, and no counter of shapes can move during it. So :func:`waiting` prints,
before it starts, what it compiles and an estimate for this machine, then runs a tqdm bar that
a background thread refreshes every second with the elapsed time (against the estimate, when
there is one). The estimate comes from a kept measurement (:class:`CompileTimes`: the last
time the same compile took on this processor and thread count, kept in the kernel folder the
caller passes, under the cache folder that ``TINYSERVE_CACHE_DIR`` names) or, for the shapes after the first of a batch, from the
first shape's time (:func:`prepare <tinyserve.backends.fast.prepare>`). A wait inside another
(a decoder compiling inside ``prepare``) shows nothing more: the outer one speaks for both.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
import json
import os
from pathlib import Path
import threading
import time
from typing import Any, TextIO

from .choices import read_kept

__all__ = ["COMPILE_TIMES_FILE", "CompileTimes", "Wait", "estimate_line", "in_notebook",
           "model_of", "shown", "waiting"]

#: The file, in the cache folder, that keeps how long each compile took on this machine.
COMPILE_TIMES_FILE = "compile_seconds.json"
_ACTIVE = threading.local()


def in_notebook() -> bool:
    """Whether this runs in a Jupyter kernel (where a compile shows its wait by default)."""
    import sys
    return "ipykernel" in sys.modules


@contextmanager
def shown(flag: bool) -> Iterator[None]:
    """While held, compiles show their waits (``True``) or do not (``False``) wherever this
    runs: :func:`~tinyserve.backends.fast.prepare` passes its ``progress`` through it."""
    held = getattr(_ACTIVE, "show", None)
    _ACTIVE.show = flag
    try:
        yield
    finally:
        _ACTIVE.show = held


class CompileTimes:
    """Seconds each compile took here, kept in ``folder`` / :data:`COMPILE_TIMES_FILE`
    (the kernel folder the loops pass down; None: kept in this process only), keyed by the
    caller's key (which names the machine: :func:`tinyserve.backends.choices.shape_key`).
    Unreadable or unwritable: ignored (an estimate is a courtesy, never a reason to fail)."""

    def __init__(self, folder: Path | None = None) -> None:
        self.path = None if folder is None else Path(folder) / COMPILE_TIMES_FILE

    def _read(self) -> dict[str, Any]:
        return read_kept(self.path)

    #: The last compile measured in this process, per model (:func:`model_of` its key): the
    #: estimate for the model's next shape when that shape's own time is not kept (a
    #: chapter's later shapes, from its first). Another model's time says little: a small
    #: model compiles in seconds where the scale model takes minutes.
    latest: dict[str, float] = {}

    def get(self, key: str) -> float | None:
        value = self._read().get(key)
        return float(value) if isinstance(value, (int, float)) and value > 0 else None

    def estimate(self, key: str) -> tuple[float | None, str]:
        """(seconds, where that figure comes from) for the compile kept under ``key``."""
        kept = self.get(key)
        if kept is not None:
            return kept, "its last compile here, kept in the cache folder; less if its kernels are kept too"
        model = model_of(key)
        if model in CompileTimes.latest:
            return CompileTimes.latest[model], "this model's last compile in this run"
        same = [float(v) for k, v in self._read().items()
                if model_of(k) == model and isinstance(v, (int, float)) and v > 0]
        if same:
            return max(same), "this model's longest kept compile of another shape"
        return None, ""

    def put(self, key: str, seconds: float) -> None:
        CompileTimes.latest = {**CompileTimes.latest, model_of(key): float(seconds)}
        if self.path is None:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            kept = self._read()
            kept[key] = round(float(seconds), 2)
            scratch = self.path.with_suffix(f".{os.getpid()}.tmp")    # whole or not at all
            scratch.write_text(json.dumps(kept, indent=1, sort_keys=True))
            os.replace(scratch, self.path)
        except OSError:
            pass


def model_of(key: str) -> str:
    """The machine and model part of a compile's key (:func:`~tinyserve.backends.choices.
    shape_key`: processor | threads | model shape | step | recipe): all but the step's."""
    parts = key.split(" | ")
    return " | ".join(parts[:3] + parts[4:]) if len(parts) == 5 else key


def estimate_line(what: str, estimate: float | None, source: str) -> str:
    """The line printed before a compile: what, and about how long here, and from what."""
    if estimate is None:
        return (f"{what}: the first compile of its kind on this machine, so no estimate yet "
                f"(tens of seconds to a few minutes on two cores); its time is kept for the next")
    return f"{what}: about {estimate:.0f} s on this machine ({source})"


class Wait:
    """The display of one wait: a tqdm bar of elapsed seconds (out of the estimate, when
    there is one), advanced by :meth:`tick` (a background thread calls it every
    ``interval`` seconds; a test calls it with a fake ``clock``)."""

    def __init__(self, what: str, estimate: float | None, *, clock: Callable[[], float],
                 out: TextIO | None, interval: float) -> None:
        from tqdm.auto import tqdm
        self.clock, self.interval, self.start = clock, interval, clock()
        self.ticked = threading.Event()
        self.bar = tqdm(total=round(estimate) if estimate else None, desc=what, unit="s",
                        file=out, leave=False, dynamic_ncols=True,
                        bar_format="{desc}: {n:.0f} s{postfix}" if not estimate else
                        "{desc}: {n:.0f} of ~{total:.0f} s |{bar}|{postfix}")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="compile-wait", daemon=True)

    def elapsed(self) -> float:
        return self.clock() - self.start

    def tick(self) -> None:
        """Show the elapsed time now (past the estimate, the bar stays full and says so)."""
        elapsed = self.elapsed()
        total = self.bar.total
        self.bar.n = min(elapsed, total) if total else elapsed
        self.bar.set_postfix_str(f" {elapsed:.0f} s elapsed" + (
            ", longer than the estimate (a busy machine?)" if total and elapsed > total else ""),
            refresh=False)
        self.bar.refresh()
        self.ticked.set()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.tick()

    def begin(self) -> "Wait":
        self._thread.start()
        return self

    def end(self) -> float:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        elapsed = self.elapsed()
        self.bar.close()
        return elapsed


@contextmanager
def waiting(what: str, estimate: float | None = None, source: str = "", *,
            show: bool | None = None, say: Callable[[str], None] | None = None,
            clock: Callable[[], float] = time.monotonic, out: TextIO | None = None,
            interval: float = 1.0) -> Iterator[Wait | None]:
    """Around one long call: print :func:`estimate_line` (through ``say``, default print),
    then keep a :class:`Wait` moving until the call returns. ``show``: default, in a
    notebook only (:func:`in_notebook`); nested in another wait: nothing (yields None)."""
    if show is None:
        held = getattr(_ACTIVE, "show", None)
        show = in_notebook() if held is None else held
    if not show or getattr(_ACTIVE, "wait", None) is not None:
        yield None
        return
    (say or (lambda text: print(text, flush=True)))(estimate_line(what, estimate, source))
    wait = Wait(what, estimate, clock=clock, out=out, interval=interval).begin()
    _ACTIVE.wait = wait
    try:
        yield wait
    finally:
        _ACTIVE.wait = None
        wait.end()
