"""Predict first, then measure: a guess committed before the measurement that answers it.

Every chapter asks the learner to commit a number (a time, a ratio, a size) before the cell
that measures it. :class:`Prediction` holds that exchange: ``commit`` locks a guess (``skip``
declines to guess, explicitly); ``record`` takes the measured value from the measurement cell;
``revealed_text`` puts the two side by side with how far off the guess was. The measurement
cell runs its printing under ``with prediction.hold():``, which keeps the printout (and any
figure it draws) back until a guess is committed or skipped: run before that, the cell says
only that its answer is held, and the widget above shows the printout, the comparison and the
chapter's ``discussion`` of it the moment the learner commits. Cells further down that show
the answer another way (a plot) run under ``if prediction.shown():``.

It is the pattern of :class:`~tinyserve.workbook.lab.KVCacheLab` (chapter 2) for an answer that
a measurement, not a formula, produces. The logic is plain Python so a test, or a notebook
run headless by nbclient, drives it without a browser; :meth:`Prediction.ui` wraps it in
ipywidgets. Run headless, nobody commits, so ``record`` says there is nothing to compare and
the measurement cell prints only :attr:`Prediction.HELD`.
"""
from __future__ import annotations

import contextlib
import html
import io
import math
import sys
from collections.abc import Iterator
from typing import Any


def parse_guess(guess: float | str | None, unit: str, *, example: str = "2 or 0.5",
                at_least: float | None = None) -> tuple[float | None, str]:
    """(value, message): a positive finite number (with ``at_least``, one at least that), or
    None and what to type instead. Text may carry spaces and thousands commas ("1,000");
    empty text is no guess yet (no message). The one parser of every predict-first box
    (:class:`Prediction`, the KV-cache and roofline labs)."""
    if isinstance(guess, str):
        guess = guess.strip().replace(",", "") or None
    if guess is None:
        return None, ""
    try:
        value = float(guess)
    except (TypeError, ValueError):
        return None, f"{guess!r} is not a number; type a value in {unit} such as {example}."
    if not (math.isfinite(value) and value > 0):
        return None, f"a guess must be a positive number of {unit}, got {guess!r}."
    if at_least is not None and value < at_least:
        return None, f"a guess in {unit} is at least {at_least:g}, got {guess!r}."
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
    """A question, a committed (or skipped) guess, and the measurement that answers it."""

    HIDDEN = "Answer hidden: type your guess, press Commit, then run the measurement below."
    NO_GUESS = ("No guess was committed above, so there is nothing to compare. Commit one, "
                "then run this cell again: a prediction made after the answer teaches little.")
    HELD = ("Answer held back: commit a guess in the box above (or press Skip there to see it "
            "without one). The result then appears in that box; running this cell again prints "
            "it here too.")
    HELD_PLOT = "This cell shows the same answer: it draws once you commit a guess (or skip) above."

    def __init__(self, question: str, unit: str, discussion: str = "") -> None:
        self.question = question
        self.unit = unit
        self.discussion = discussion.strip()   # what to read once the answer is out
        self.guess: float | None = None
        self.committed = False
        self.skipped = False
        self.measured: float | None = None
        self.past = False                      # the answer lies past ``measured``, not at it
        self._held: dict[str, str] = {}        # the measurement cells' printouts, by label
        self.message = ""
        self._ui: Any = None

    @property
    def revealed(self) -> bool:
        """True once a guess is committed or the learner chose to skip guessing."""
        return self.committed or self.skipped

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

    def skip(self) -> None:
        """Decline to guess, explicitly: the answer is shown without a comparison."""
        if not self.committed:
            self.skipped, self.message = True, "Skipped: no guess to compare."
        self._refresh()

    def record(self, measured: float) -> str:
        """Called by the measurement cell: store the value, return what to print under it."""
        value = float(measured)
        if not math.isfinite(value) or value <= 0:
            raise ValueError(f"a measurement must be a positive finite number, got {measured!r}")
        self.measured, self.past = value, False
        self._refresh()
        return self.revealed_text() if self.revealed else self.NO_GUESS

    def record_past(self, last: float) -> str:
        """For a measurement whose answer lies beyond the range it timed (a knee past the
        largest batch timed): store ``last``, the edge, and grade a guess against it as a lower
        limit, not as the answer (:meth:`revealed_text` says "past the ... timed")."""
        text = self.record(last)
        self.past = True
        self._refresh()
        return self.revealed_text() if self.revealed else text

    @property
    def held(self) -> str:
        """Every held printout, in the order the cells first ran."""
        return "".join(self._held.values())

    @contextlib.contextmanager
    def hold(self, label: str = "") -> Iterator["Prediction"]:
        """Run a measurement cell's printing inside this block: the printout, and any figure
        drawn in it, come out only once a guess is committed or skipped, followed by the
        comparison and the discussion; before that the cell prints :attr:`HELD` and the widget
        keeps the printout until the commit. When several cells lead to one answer, give each
        its own `label`: a cell run again replaces its own printout, not the others'."""
        figures = _figure_numbers()
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            yield self
        self._held[label] = out.getvalue()
        if self.revealed:
            sys.stdout.write(self._held[label])
            if self.measured is not None:
                print(self.revealed_text())
            if self.discussion and self.measured is not None:
                print("\n" + self.discussion)
        else:
            _close_figures_since(figures)
            print(self.without_widgets())
            print(self.HELD)
        self._refresh()

    def without_widgets(self) -> str:
        """How to commit or skip in a front end that shows no widgets, naming this
        prediction's variable in the notebook (``prediction`` when none names it)."""
        import __main__
        name = next((k for k, v in vars(__main__).items() if v is self and not k.startswith("_")),
                    "prediction")
        return (f"(No box above? A front end without widgets: run `{name}.commit(YOUR_GUESS)` "
                f"or `{name}.skip()` in a cell, then this cell again.)")

    def shown(self) -> bool:
        """For a later cell that shows the answer another way (a plot): True once revealed;
        before that it prints :attr:`HELD_PLOT` and the cell should draw nothing."""
        if not self.revealed:
            print(self.HELD_PLOT)
        return self.revealed

    def revealed_text(self) -> str:
        """The guess and the measurement side by side; only a hint before a commit or skip."""
        measured = None if self.measured is None else (
            f"measured: past the {self.measured:,.4g} {self.unit} timed" if self.past
            else f"measured {self.measured:,.4g} {self.unit}")
        if self.skipped and not self.committed:
            return (f"No guess (skipped) | {measured}" if measured
                    else "Skipped: run the measurement below to see its result.")
        if not self.committed:
            return self.HIDDEN
        mine = f"your guess {self.guess:,.4g} {self.unit}"
        if measured is None:
            return f"Committed: {mine}. Now run the measurement below."
        if self.past:
            verdict = ("consistent: above the range timed" if self.guess > self.measured else
                       f"too low: the answer lies past {self.measured:,.4g} {self.unit}")
            return f"{mine} | {measured} | {verdict}"
        return f"{mine} | {measured} | {how_far(self.guess, self.measured)}"

    # --- ipywidgets front end -------------------------------------------------------------
    def ui(self) -> Any:
        """The question as ipywidgets: a text box, Commit and Skip buttons and the (hidden)
        answer, which shows the measurement's held printout and the discussion once out."""
        if self._ui is None:
            import ipywidgets as w

            box = w.Text(placeholder="e.g. 2", description=f"guess ({self.unit})",
                         style={"description_width": "120px"})
            button = w.Button(description="Commit guess", button_style="primary")
            skip = w.Button(description="Skip (show the answer)")
            status, answer = w.HTML(), w.HTML()
            box.observe(lambda change: self.set_guess(change["new"]), names="value")
            button.on_click(lambda _b: self.commit())
            skip.on_click(lambda _b: self.skip())
            self._ui = {"guess": box, "commit": button, "skip": skip, "status": status,
                        "answer": answer,
                        "box": w.VBox([w.HTML(f"<b>Predict first.</b> {html.escape(self.question)}"),
                                       box, w.HBox([button, skip]), status, answer])}
            self._refresh()
        return self._ui["box"]

    def answer_text(self) -> str:
        """What the widget's answer area shows: the hint, or once revealed the comparison, the
        measurement's printout (if it has run) and the discussion."""
        if not self.revealed:
            return self.HIDDEN
        parts = [self.revealed_text()]
        if self.held:
            parts.append(self.held.rstrip())
        if self.discussion and self.measured is not None:
            parts.append(self.discussion)
        return "\n\n".join(parts)

    def _refresh(self) -> None:
        if self._ui is None:
            return
        self._ui["guess"].disabled = self._ui["commit"].disabled = self.committed
        self._ui["skip"].disabled = self.revealed
        self._ui["status"].value = f"<i>{html.escape(self.message)}</i>" if self.message else ""
        self._ui["answer"].value = f"<pre>{html.escape(self.answer_text())}</pre>"


def _figure_numbers() -> set[int]:
    plt = sys.modules.get("matplotlib.pyplot")
    return set(plt.get_fignums()) if plt else set()


def _close_figures_since(before: set[int]) -> None:
    """Close the figures a held block drew, so the notebook does not display them."""
    plt = sys.modules.get("matplotlib.pyplot")
    if plt:
        for number in set(plt.get_fignums()) - before:
            plt.close(number)
