"""Predict first, then measure: a guess committed before the measurement that answers it.

Every chapter asks the learner to commit a number (a time, a ratio, a size) before the cell
that measures it. :class:`Prediction` holds that exchange: ``commit`` locks a guess;
``record`` takes the measured value from the measurement cell; ``revealed_text`` puts the two
side by side with how far off the guess was, and only once a guess is committed.

It is the pattern of :class:`~tinyserve.workbook.lab.KVCacheLab` (chapter 2) for an answer that
a measurement, not a formula, produces. The logic is plain Python so a test, or a notebook
run headless by nbclient, drives it without a browser; :meth:`Prediction.ui` wraps it in
ipywidgets. Run headless, nobody commits, so ``record`` says there is nothing to compare and
the measurement cell's own printout stands alone.
"""
from __future__ import annotations

import html
import math
from typing import Any


def parse_guess(guess: float | str | None, unit: str) -> tuple[float | None, str]:
    """(value, message): a positive finite number, or None and what to type instead."""
    if isinstance(guess, str):
        guess = guess.strip().replace(",", "") or None
    if guess is None:
        return None, ""
    try:
        value = float(guess)
    except (TypeError, ValueError):
        return None, f"{guess!r} is not a number; type a value in {unit} such as 2 or 0.5."
    if not (math.isfinite(value) and value > 0):
        return None, f"a guess must be a positive number of {unit}, got {guess!r}."
    return value, ""


def how_far(guess: float, answer: float) -> str:
    """How far a guess was from the answer, as a factor ("within 1.5x", "3.2x too high")."""
    ratio = guess / answer
    if 1 / 1.5 <= ratio <= 1.5:
        return "within 1.5x: well judged"
    factor = max(ratio, 1 / ratio)
    scale = "same order of magnitude" if factor < 10 else "off by more than 10x"
    return f"{factor:,.1f}x too {'high' if ratio > 1 else 'low'} ({scale})"


class Prediction:
    """A question, a committed guess, and the measurement that answers it."""

    HIDDEN = "Answer hidden: type your guess, press Commit, then run the measurement below."
    NO_GUESS = ("No guess was committed above, so there is nothing to compare. Commit one, "
                "then run this cell again: a prediction made after the answer teaches little.")

    def __init__(self, question: str, unit: str) -> None:
        self.question = question
        self.unit = unit
        self.guess: float | None = None
        self.committed = False
        self.measured: float | None = None
        self.message = ""
        self._ui: Any = None

    def set_guess(self, guess: float | str | None) -> None:
        """Record a guess (number or text); refused once committed, which locks it."""
        if self.committed:
            self.message = "Your guess is committed and locked."
        else:
            self.guess, self.message = parse_guess(guess, self.unit)
        self._refresh()

    def commit(self, guess: float | str | None = None) -> bool:
        """Lock the guess (or the one given here); refused (False) while there is none."""
        if guess is not None:
            self.set_guess(guess)
        if self.committed:
            return True
        if self.guess is None:
            self.message = self.message or f"Type a guess in {self.unit} first; then commit."
            self._refresh()
            return False
        self.committed, self.message = True, ""
        self._refresh()
        return True

    def record(self, measured: float) -> str:
        """Called by the measurement cell: store the value, return what to print under it."""
        value = float(measured)
        if not math.isfinite(value) or value <= 0:
            raise ValueError(f"a measurement must be a positive finite number, got {measured!r}")
        self.measured = value
        self._refresh()
        return self.revealed_text() if self.committed else self.NO_GUESS

    def revealed_text(self) -> str:
        """The guess and the measurement side by side; only a hint before a commit."""
        if not self.committed:
            return self.HIDDEN
        mine = f"your guess {self.guess:,.4g} {self.unit}"
        if self.measured is None:
            return f"Committed: {mine}. Now run the measurement below."
        return (f"{mine} | measured {self.measured:,.4g} {self.unit} | "
                f"{how_far(self.guess, self.measured)}")

    # --- ipywidgets front end -------------------------------------------------------------
    def ui(self) -> Any:
        """The question as ipywidgets: a text box, a Commit button and the (hidden) answer."""
        if self._ui is None:
            import ipywidgets as w

            box = w.Text(placeholder="e.g. 2", description=f"guess ({self.unit})",
                         style={"description_width": "120px"})
            button = w.Button(description="Commit guess", button_style="primary")
            status, answer = w.HTML(), w.HTML()
            box.observe(lambda change: self.set_guess(change["new"]), names="value")
            button.on_click(lambda _b: self.commit())
            self._ui = {"guess": box, "commit": button, "status": status, "answer": answer,
                        "box": w.VBox([w.HTML(f"<b>Predict first.</b> {html.escape(self.question)}"),
                                       box, button, status, answer])}
            self._refresh()
        return self._ui["box"]

    def _refresh(self) -> None:
        if self._ui is None:
            return
        self._ui["guess"].disabled = self._ui["commit"].disabled = self.committed
        self._ui["status"].value = f"<i>{html.escape(self.message)}</i>" if self.message else ""
        self._ui["answer"].value = f"<pre>{html.escape(self.revealed_text())}</pre>"
