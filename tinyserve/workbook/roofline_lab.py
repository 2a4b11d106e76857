"""Predict first: at what batch size does a decode step stop being memory-bound?

The same pattern as the KV-cache calculator (:mod:`tinyserve.workbook.lab`): the learner
types a guess, commits it, and only then sees the answer, here the batch at which the
compute bound of a decode step overtakes its memory bound (:func:`~tinyserve.roofline.
crossover_batch`) for a machine's bandwidth and FLOP rate. The logic is a plain class a test
can drive (``set_guess``, ``commit``, ``revealed_text``); :meth:`RooflineLab.ui` wraps it in
ipywidgets.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ..config import ModelConfig
from ..roofline import crossover_batch, parameter_count


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
        if isinstance(guess, str):
            guess = guess.strip().replace(",", "") or None
        try:
            value = None if guess is None else float(guess)
        except ValueError:
            self.guess, self.message = None, f"{guess!r} is not a number; type a batch size such as 4 or 300."
            return
        if value is not None and not (math.isfinite(value) and value >= 1):
            self.guess, self.message = None, f"a batch size is at least 1, got {guess!r}."
            return
        self.guess, self.message = value, ""

    def commit(self) -> bool:
        """Lock in the guess and reveal the answer; refused (False) while there is no guess."""
        if self.guess is None:
            self.message = self.message or "Type a guess first; then commit."
            return False
        self.committed, self.message = True, ""
        return True

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
