"""Predict first: at what batch size does a decode step stop being memory-bound?

The same pattern as the KV-cache calculator (:mod:`tinyserve.workbook.lab`): the learner
types a guess, commits it, and only then sees the answer, here the batch at which the
compute bound of a decode step overtakes its memory bound (:func:`~tinyserve.roofline.
crossover_batch`) for a machine's bandwidth and FLOP rate. The logic is a plain class a test
can drive (``set_guess``, ``commit``, ``revealed_text``); :meth:`RooflineLab.ui` wraps it in
ipywidgets.

Below the lab, the helpers the chapters use to hold a *measured* step against the same
roofline (chapters 1 and 6b put the shipped model, which fits in a cache, and the
bandwidth-scale model of :mod:`tinyserve.scale`, which does not, side by side):
:func:`regime` names what bounds a step from its measured time and its two floors, the one
rule every chapter's computed sentence follows (:func:`describe_regime` puts it in a sentence;
:func:`kernel_probe_seconds` times a step's kernels alone, which tells a kernel below the roof
from dispatch);
:func:`cache_bytes` is the cache a model must outgrow; :func:`prefill_cost` and
:func:`prefill_seconds` put prefill on the roofline next to a decode step;
:func:`plot_roofline` draws the roof with measured points on it; :func:`quiet_profiler` keeps
the PyTorch profiler's native log lines out of a chapter's output.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
import math
import os
import sys
import tempfile
from typing import Any

import torch
from torch import Tensor

from ..config import ModelConfig
from ..device import timings
from ..roofline import DecodeCost, bounds_seconds, crossover_batch, parameter_count
from .predict import parse_guess


@contextmanager
def quiet_profiler(drop: str = "USDT:") -> Iterator[None]:
    """Around ``torch.profiler.profile``: the profiler's own native log lines (Kineto writes
    ``USDT: ... profiler_start`` and ``profiler_stop`` to the process's stderr, which a
    notebook shows in red) are dropped; any other native stderr line is passed on. Python's
    own ``sys.stderr`` (warnings, tracebacks) is untouched."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as caught:
        os.dup2(caught.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            caught.seek(0)
            kept = [line for line in caught.read().decode(errors="replace").splitlines(True)
                    if not line.startswith(drop)]
            if kept:
                sys.stderr.write("".join(kept))


@dataclass(frozen=True)
class RooflineCase:
    """A model on a machine: what the crossover depends on."""
    name: str
    config: ModelConfig
    bytes_per_weight: float        # 4 fp32, 2 bf16, 1 int8
    bandwidth: float               # bytes/s
    flop_rate: float               # FLOP/s
    context: int = 128             # cached tokens per row

    @property
    def weight_bytes(self) -> float:
        return parameter_count(self.config) * self.bytes_per_weight

    def crossover(self) -> float:
        return crossover_batch(self.config, self.weight_bytes, self.bytes_per_weight,
                               self.context, self.bandwidth, self.flop_rate)


class RooflineLab:
    """The prediction's state: a case, a guess (a batch size) and whether it is committed."""

    HIDDEN = "Answer hidden: type the batch size you expect and press Commit."

    def __init__(self, case: RooflineCase) -> None:
        self.case = case
        self.guess: float | None = None
        self.committed = False
        self.message = ""
        self._ui: Any = None

    def set_guess(self, guess: float | str | None) -> None:
        """Record a guess (a batch size such as "8" or 200); locked once committed."""
        if self.committed:
            self.message = "Your guess is committed; make a new lab to predict again."
            return
        self.guess, self.message = parse_guess(guess, "rows", example="4 or 300", at_least=1)

    def commit(self) -> bool:
        """Lock in the guess and reveal the answer; refused (False) while there is no guess."""
        if self.guess is None:
            self.message = self.message or "Type a guess first; then commit."
            return False
        self.committed, self.message = True, ""
        return True

    #: What a later cell prints instead of drawing the answer (the bounds' crossing).
    HELD_PLOT = ("The compute bound, and where it crosses the memory bound, is the answer to the "
                 "prediction above: it is drawn once you commit a guess there (no widgets? run "
                 "`{name}.set_guess(N)` and `{name}.commit()` in a cell), then run this cell again.")

    def shown(self, name: str = "lab") -> bool:
        """For a later cell that draws or prints the crossover: True once committed; before
        that it prints :attr:`HELD_PLOT` and the cell leaves the answer out."""
        if not self.committed:
            print(self.HELD_PLOT.format(name=name))
        return self.committed

    def revealed_text(self) -> str:
        if not self.committed:
            return self.HIDDEN
        c = self.case
        answer = c.crossover()
        lines = [
            f"{c.name}: {parameter_count(c.config) / 1e6:,.1f} M weights x {c.bytes_per_weight:g} "
            f"bytes = {c.weight_bytes / 1e6:,.1f} MB read per step, whatever the batch",
            f"memory bound at batch 1: {c.weight_bytes / c.bandwidth * 1e3:,.3f} ms "
            f"(at {c.bandwidth / 1e9:,.1f} GB/s)",
            f"each row adds {c.config.flops_per_token(c.context) / 1e6:,.1f} MFLOP: "
            f"{c.config.flops_per_token(c.context) / c.flop_rate * 1e3:,.4f} ms at "
            f"{c.flop_rate / 1e12:,.3g} TFLOP/s",
            "compute overtakes memory at batch ~ "
            + ("never (each row's KV reads outweigh its FLOPs)" if math.isinf(answer)
               else f"{answer:,.0f}  (~ FLOP/s / bandwidth x bytes per weight / 2)"),
        ]
        assert self.guess is not None
        if not math.isinf(answer):
            ratio = self.guess / answer
            if 1 / 2 <= ratio <= 2:
                lines.append(f"Your guess, {self.guess:g}: within 2x. Well done.")
            else:
                word = "high" if ratio > 1 else "low"
                lines.append(f"Your guess, {self.guess:g}: {max(ratio, 1 / ratio):,.1f}x too "
                             f"{word}. Which of bandwidth and FLOP rate did you misjudge?")
        return "\n".join(lines)

    def ui(self) -> Any:
        """The prediction as ipywidgets (built once; every control calls the methods above)."""
        if self._ui is None:
            import html

            import ipywidgets as w
            guess = w.Text(placeholder="e.g. 16", description="batch size")
            button = w.Button(description="Commit guess", button_style="primary")
            status, answer = w.HTML(), w.HTML()

            def refresh() -> None:
                guess.disabled = button.disabled = self.committed
                status.value = f"<i>{html.escape(self.message)}</i>" if self.message else ""
                answer.value = f"<pre>{html.escape(self.revealed_text())}</pre>"

            guess.observe(lambda change: (self.set_guess(change["new"]), refresh()), names="value")
            button.on_click(lambda _b: (self.commit(), refresh()))
            self._ui = w.VBox([w.HTML(f"<b>Predict first.</b> {html.escape(self.case.name)}: "
                                      "from which batch size on is a decode step "
                                      "compute-bound rather than memory-bound?"),
                               guess, button, status, answer])
            refresh()
        return self._ui


# --- a measured step against the roofline -------------------------------------------------

#: A step within this factor of its roofline (the larger floor) is *at* that floor; a slower
#: one is bound by neither bytes nor FLOPs at the machine's measured rates (an MBU of 0.5 or
#: more counts as memory-bound). The one threshold of every chapter's regime sentence. It
#: holds the no-overlap sum as well: the sum is at most twice the max.
NEAR = 2.0
#: A step far off its roofline is *kernel-bound* when the probe of its kernels alone
#: (:func:`kernel_probe_seconds`) accounts for at least this share of the gap; otherwise the
#: gap is outside the kernels (Python, dispatch, launches): *overhead-bound*.
KERNEL_SHARE = 0.5
#: The regime names, in the rule's order.
REGIMES = ("memory-bound", "compute-bound", "kernel-bound", "overhead-bound")


@dataclass(frozen=True)
class Regime:
    """What limits a measured step: ``name`` is one of :data:`REGIMES`; ``reason`` says why,
    from the numbers. It prints as its name, so a table cell can format it directly
    (``f"{regime(...):15s}"``)."""
    name: str
    reason: str
    of_roofline: float        # measured time / roofline (1.0 = at the bound)

    def __str__(self) -> str:
        return self.name

    def __format__(self, spec: str) -> str:
        return format(self.name, spec)


def regime(measured_s: float, memory_s: float, compute_s: float, near: float = NEAR,
           kernel_s: float | None = None) -> Regime:
    """Name the regime of a step measured in ``measured_s`` whose memory floor (bytes /
    bandwidth) is ``memory_s`` and compute floor (FLOPs / FLOP rate) is ``compute_s``: the
    one rule for the whole course.

    Within ``near`` x of the larger floor (the roofline), the step is bound by that resource.
    Further off, neither its bytes nor its FLOPs at the machine's best rates set the time,
    and the roofline's two causes are told apart (Williams et al., CACM 2009: a kernel below
    the roof is a ceiling problem; overhead is time outside the kernels' useful work):
    ``kernel_s``, the step's kernels timed alone (:func:`kernel_probe_seconds`), explains at
    least :data:`KERNEL_SHARE` of the gap: **kernel-bound** (below the roof); it explains
    less: **overhead-bound** (Python, dispatch, kernel launches). With no probe the rule
    cannot tell the two apart and says so; it names the step overhead-bound only when the
    probe shows the kernels fast. The floor convention: a floor is never negative, and the
    memory floor is 0 when the bytes fit in the last-level cache (reads that need not reach
    memory, :func:`tinyserve.workbook.scale_sweeps.step_floors`); not both floors are 0."""
    if not (measured_s > 0 and memory_s >= 0 and compute_s >= 0 and max(memory_s, compute_s) > 0):
        raise ValueError("the time must be positive seconds and the floors non-negative, one "
                         f"of them positive; got {measured_s!r}, {memory_s!r}, {compute_s!r}")
    if kernel_s is not None and not kernel_s > 0:
        raise ValueError(f"kernel_s is the step's kernels timed alone, positive seconds; got "
                         f"{kernel_s!r}")
    memory = memory_s >= compute_s
    roof = max(memory_s, compute_s)
    ratio = measured_s / roof
    floor = "the time to read its bytes" if memory else "the time of its FLOPs"
    if ratio > near:
        return _off_the_roof(measured_s, roof, ratio, floor, near, kernel_s)
    if memory:
        return Regime("memory-bound",
                      f"{ratio:.1f}x {floor}, which take {memory_s / compute_s:.1f}x as long as "
                      "its FLOPs: it waits for bytes", ratio)
    other = ("its bytes fit in the last-level cache" if memory_s == 0 else
             f"which take {compute_s / memory_s:.1f}x as long as reading its bytes")
    return Regime("compute-bound", f"{ratio:.1f}x {floor}, {other}: it waits for arithmetic",
                  ratio)


def _off_the_roof(measured_s: float, roof: float, ratio: float, floor: str, near: float,
                  kernel_s: float | None) -> Regime:
    """The rule past ``near`` x the roofline: kernel-bound or overhead-bound, by the probe."""
    head = f"{ratio:.1f}x {floor}, more than {near:g}x"
    if kernel_s is None:
        return Regime("overhead-bound",
                      f"{head}: not its bytes or FLOPs at this machine's best rates; no probe of "
                      "its kernels ran, so a kernel below the roof is not told apart from "
                      "per-operation costs (Python, dispatch, kernel launches)", ratio)
    share = (kernel_s - roof) / (measured_s - roof)
    alone = f"its kernels alone take {kernel_s / roof:.1f}x it"
    if share >= KERNEL_SHARE:
        return Regime("kernel-bound",
                      f"{head}; {alone}, {min(share, 1.0):.0%} of the gap: below the roof, "
                      "the kernel itself runs slower than the machine's best rates", ratio)
    return Regime("overhead-bound",
                  f"{head}; {alone}, {max(share, 0.0):.0%} of the gap: the rest is outside the "
                  "kernels (Python, dispatch, kernel launches)", ratio)


@torch.no_grad()
def kernel_probe_seconds(model: torch.nn.Module, rows: int, repeats: int = 3) -> float:
    """The step's matrix products alone: every ``nn.Linear`` weight of ``model`` multiplied
    by ``rows`` rows, one ``F.linear`` call each, back to back (each weight read once, as a
    step reads it), the fastest of ``repeats`` after a warm-up. No attention, norms or Python
    between layers: what :func:`regime` holds against the gap above the roofline, to tell a
    kernel below the roof (kernel-bound) from dispatch (overhead-bound)."""
    import torch.nn.functional as F
    weights = [m.weight for m in model.modules() if type(m) is torch.nn.Linear]
    if not weights:
        raise ValueError("the model has no nn.Linear weights to probe (int8 layers are "
                         "probed through their own kernel, not here)")
    g = torch.Generator().manual_seed(0)
    inputs = {w.shape[1]: torch.randn(rows, w.shape[1], generator=g).to(w.device, w.dtype)
              for w in weights}

    def run() -> None:
        for w in weights:
            F.linear(inputs[w.shape[1]], w)
    return min(timings(run, weights[0].device, repeats))


def describe_regime(measured_s: float, memory_s: float, compute_s: float,
                    near: float = NEAR, kernel_s: float | None = None) -> str:
    """:func:`regime` in a sentence: its name, then its reason in parentheses, e.g.
    "memory-bound (1.4x the time to read its bytes, which take 9.0x as long as its FLOPs: it
    waits for bytes)"."""
    r = regime(measured_s, memory_s, compute_s, near, kernel_s)
    return f"{r.name} ({r.reason})"


def regime_of(cost: DecodeCost, measured_s: float, bandwidth: float, flop_rate: float,
              near: float = NEAR, kernel_s: float | None = None) -> Regime:
    """:func:`regime` of a step that moves ``cost.bytes`` and does ``cost.flops`` (a decode
    step from :func:`~tinyserve.roofline.decode_cost`, or a prefill from :func:`prefill_cost`)
    in ``measured_s``, on a machine that reads ``bandwidth`` bytes/s and does ``flop_rate``;
    ``kernel_s`` its kernels' probe (:func:`kernel_probe_seconds`), if one ran."""
    bounds = bounds_seconds(cost, bandwidth, flop_rate)
    return regime(measured_s, bounds["memory_s"], bounds["compute_s"], near, kernel_s)


def cache_bytes(device: torch.device | str) -> tuple[int, str]:
    """The cache a model's weights must outgrow before every step reads them from memory:
    a GPU's L2, or the CPU's last-level cache (:func:`tinyserve.scale.last_level_cache_bytes`).
    Returns (bytes, a name for it)."""
    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).L2_cache_size), "the GPU's L2 cache"
    from ..scale import last_level_cache_bytes
    size, source = last_level_cache_bytes()
    return size, "the CPU's last-level cache" + (" (a guess: the OS did not say)"
                                                 if source == "fallback" else "")


def prefill_cost(model: torch.nn.Module, tokens: int) -> DecodeCost:
    """Bytes and FLOPs of one prefill of a ``tokens``-token prompt: the weights read once,
    the prompt's keys and values written once, and each token's FLOPs at its own position
    (on average half the prompt back)."""
    from ..quant import weight_bytes
    cfg = model.config
    kv = 2 * cfg.num_hidden_layers * tokens * cfg.num_key_value_heads * cfg.head_dim
    return DecodeCost(int(weight_bytes(model)), int(kv * model.dtype.itemsize),
                      float(tokens * cfg.flops_per_token(tokens // 2)))


@torch.no_grad()
def prefill_seconds(model: torch.nn.Module, prompts: Tensor, repeats: int = 3) -> float:
    """Seconds of one prefill of ``prompts`` (B, T) into a fresh cache: the fastest of
    ``repeats`` after one warm-up (other programs only ever slow a run down)."""
    from ..generate import prefill
    from ..kv_cache import KVCache
    B, T = prompts.shape
    fresh: list[KVCache] = []                  # the cache of the next run, made untimed

    def new_cache() -> None:
        fresh[:] = [KVCache.for_model(model, B, T)]
    return min(timings(lambda: prefill(model, prompts, fresh[0]), prompts.device, repeats,
                       setup=new_cache))


def roofline_point(cost: DecodeCost, measured_s: float) -> tuple[float, float]:
    """Where a measured step sits on a roofline plot: (FLOPs per byte it reads, FLOP/s it
    reached)."""
    return cost.flops / cost.bytes, cost.flops / measured_s


def plot_roofline(ax, bandwidth: float, flop_rate: float,
                  points: dict[str, list[tuple[float, float, str]]]) -> None:
    """Draw the roofline (attainable FLOP/s = min(FLOP rate, intensity x bandwidth)) on a
    matplotlib ``ax`` with log axes, and each labelled series of (intensity, FLOP/s, note)
    points on it; the note (e.g. "B=4") is written next to its point."""
    xs = [x for series in points.values() for x, _, _ in series]
    ridge = flop_rate / bandwidth
    lo, hi = min([*xs, ridge]) / 4, max([*xs, ridge]) * 4
    grid = [lo * (hi / lo) ** (i / 100) for i in range(101)]
    ax.plot(grid, [min(flop_rate, x * bandwidth) / 1e9 for x in grid], "-", color="black",
            lw=2, label=f"roofline: {bandwidth / 1e9:,.1f} GB/s, {flop_rate / 1e9:,.1f} GFLOP/s")
    ax.axvline(ridge, color="grey", ls=":", lw=1, label=f"ridge: {ridge:,.1f} FLOP/byte")
    for (label, series), marker in zip(points.items(), "osD^v"):
        line, = ax.plot([x for x, _, _ in series], [y / 1e9 for _, y, _ in series], marker,
                        ls="--", label=label)
        for x, y, note in series:
            ax.annotate(note, (x, y / 1e9), textcoords="offset points", xytext=(4, -11),
                        fontsize=8, color=line.get_color())
    ax.set_xscale("log")
    ax.set_yscale("log")
    from matplotlib.ticker import FuncFormatter, NullFormatter
    for axis in (ax.xaxis, ax.yaxis):             # plain numbers, not powers of ten
        axis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:g}"))
        axis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("arithmetic intensity (FLOP per byte read)")
    ax.set_ylabel("attained FLOP rate (GFLOP/s)")
    ax.grid(alpha=0.3, which="both")
