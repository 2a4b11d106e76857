"""The predict-first KV-cache lab: guess the memory, commit, and only then see the answer.

A guess made after the answer is on screen teaches nothing, so the calculator hides its
result until the learner has typed a guess (in GB) and pressed *Commit*. Changing any input
afterwards hides the answer again: a new case deserves a new prediction.

Besides grouped-query attention (the default), a case can cap each layer at a sliding window
or cache a compressed latent per token (multi-head latent attention, MLA); the answer to an
MLA case also gives the GQA figure for the same shape, so the two designs sit side by side.

The logic lives in :class:`KVCacheLab`, a plain class with no widgets in it, so a test (or a
reader without a browser) can drive it: ``set_guess``, ``commit``, ``revealed_text``.
:meth:`KVCacheLab.ui` wraps the same object in ipywidgets for JupyterLab. After a commit the widget
also draws the case's cache against the tokens held, with the guess on the same axes
(:func:`growth_chart_png`).
"""
from __future__ import annotations

import io
from dataclasses import dataclass, replace
from typing import Any

from .capacity import GB, GiB, kv_bytes_mla, kv_bytes_per_sequence, kv_bytes_sliding_window
from .predict import parse_guess

# Bytes of one cached number, by the name a model card uses.
DTYPE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2, "fp8": 1, "int8": 1}


@dataclass(frozen=True)
class KVCase:
    """One sizing question: KV memory for ``concurrency`` sequences of ``tokens`` each."""
    layers: int = 80
    kv_heads: int = 8
    head_dim: int = 128
    dtype: str = "fp16"
    tokens: int = 4096
    concurrency: int = 1
    window: int = 0        # sliding-window attention in every layer; 0 = every token is kept
    latent_dim: int = 0    # multi-head latent attention (MLA): latent numbers cached; 0 = GQA
    rope_dim: int = 0      # MLA's rotary key numbers cached next to the latent (MLA only)

    def __post_init__(self) -> None:
        for name in ("layers", "kv_heads", "head_dim", "tokens", "concurrency"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a whole number >= 1, got {value!r}")
        if not isinstance(self.window, int) or self.window < 0:
            raise ValueError(f"window must be a whole number >= 0 (0 = no window), "
                             f"got {self.window!r}")
        for name in ("latent_dim", "rope_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be a whole number >= 0 (0 = no latent cache), "
                                 f"got {value!r}")
        if self.latent_dim and self.window:
            raise ValueError("choose a sliding window or a latent (MLA) cache, not both: the "
                             "lab sizes one design at a time (set window or latent_dim to 0)")
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"unknown dtype {self.dtype!r}; use one of {', '.join(DTYPE_BYTES)}")

    @property
    def bytes_per_element(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def kept_tokens(self) -> int:
        """Tokens each layer keeps: all of them, or at most the sliding window."""
        return min(self.tokens, self.window) if self.window else self.tokens

    @property
    def bytes_per_sequence(self) -> int:
        if self.latent_dim:
            return kv_bytes_mla(self.layers, self.tokens, self.latent_dim, self.rope_dim,
                                self.dtype)
        if self.window:
            return kv_bytes_sliding_window(self.layers, self.tokens, self.kv_heads,
                                           self.head_dim, self.dtype, self.window)
        return kv_bytes_per_sequence(self.layers, self.tokens, self.kv_heads, self.head_dim,
                                     self.dtype)

    @property
    def gqa_bytes_per_sequence(self) -> int:
        """The same sequence with every token's keys and values cached per KV head (GQA)."""
        return kv_bytes_per_sequence(self.layers, self.tokens, self.kv_heads, self.head_dim,
                                     self.dtype)

    @property
    def total_bytes(self) -> int:
        # Contiguous caches share nothing, so concurrency multiplies (no prefix sharing).
        return self.concurrency * self.bytes_per_sequence


class KVCacheLab:
    """The calculator's state: a case, a guess, and whether the guess has been committed."""

    HIDDEN = "Answer hidden: type your guess in GB and press Commit."

    def __init__(self, **case: Any) -> None:
        self.case = KVCase(**case)
        self.guess_gb: float | None = None
        self.committed = False
        self.message = ""          # feedback on the last action (bad guess, case changed)
        self._ui: Any = None

    # --- actions -------------------------------------------------------------------------
    def set_case(self, **changes: Any) -> bool:
        """Change inputs; a changed case hides the answer until a new guess is committed.
        An impossible case is refused (False) with the reason in ``message``."""
        try:
            new = replace(self.case, **changes)
        except ValueError as e:
            self.message = str(e)
            return False
        if new != self.case:
            self.case = new
            if self.committed:
                self.committed = False
                self.guess_gb = None
                self.message = "The case changed: predict again, then commit."
        return True

    def set_guess(self, guess: float | str | None) -> None:
        """Record a guess in GB (a number or text such as "1.5" or "2e-1"); not yet committed.

        A committed guess is locked: editing it after seeing the answer would defeat the
        point. Change an input to get a fresh case and a fresh guess."""
        if self.committed:
            self.message = "Your guess is committed; change an input to predict a new case."
            return
        self.guess_gb, self.message = parse_guess(guess, "GB", example="0.5 or 20")

    def commit(self) -> bool:
        """Lock in the guess and reveal the answer; refused (False) while there is no guess."""
        if self.guess_gb is None:
            self.message = self.message or "Type a guess in GB first; then commit."
            return False
        self.committed = True
        self.message = ""
        return True

    # --- what the learner sees -----------------------------------------------------------
    def revealed_text(self) -> str:
        """The answer, the formula and a verdict on the guess; only a hint before commit."""
        if not self.committed:
            return self.HIDDEN
        c, total = self.case, self.case.total_bytes
        lines = self._latent_lines() if c.latent_dim else self._gqa_lines()
        lines += [f"         = {total:,} bytes",
                  f"         = {total / GB:,.3f} GB (10^9 bytes) = {total / GiB:,.3f} GiB "
                  f"(2^30 bytes)"]
        if c.window:
            lines.append(f"sliding window {c.window:,}: each layer keeps min({c.tokens:,}, "
                         f"{c.window:,}) = {c.kept_tokens:,} tokens")
        if c.concurrency > 1:
            per = c.bytes_per_sequence
            lines.append(f"per sequence: {per:,} bytes = {per / GB:,.3f} GB = "
                         f"{per / GiB:,.3f} GiB")
        if c.latent_dim:
            gqa = c.concurrency * c.gqa_bytes_per_sequence
            lines.append(f"next to GQA with {c.kv_heads} KV heads of {c.head_dim}: "
                         f"{gqa / GB:,.3f} GB, {gqa / total:,.2f}x the latent cache")
        lines.append(self.verdict())
        return "\n".join(lines)

    def _gqa_lines(self) -> list[str]:
        c = self.case
        kept = "tokens kept" if c.window else "tokens"
        many = c.concurrency > 1
        return [f"KV bytes = 2 (K and V) x layers x {kept} x KV heads x head dim x bytes/element"
                + (" x concurrency" if many else ""),
                f"         = 2 x {c.layers} x {c.kept_tokens:,} x {c.kv_heads} x {c.head_dim} "
                f"x {c.bytes_per_element}" + (f" x {c.concurrency}" if many else "")]

    def _latent_lines(self) -> list[str]:
        # MLA caches one latent (plus a rotary key part) per token and layer, shared by every
        # head: no factor 2 for K and V and no head count (capacity.kv_bytes_mla).
        c = self.case
        many = c.concurrency > 1
        return [f"KV bytes = layers x tokens x (latent dim + rotary dim) x bytes/element"
                + (" x concurrency" if many else "") + "   (MLA: no K/V pair, no heads)",
                f"         = {c.layers} x {c.tokens:,} x ({c.latent_dim} + {c.rope_dim}) x "
                f"{c.bytes_per_element}" + (f" x {c.concurrency}" if many else "")]

    def verdict(self) -> str:
        """How far the committed guess was from the answer, as a factor."""
        assert self.guess_gb is not None
        answer_gb = self.case.total_bytes / GB
        ratio = self.guess_gb / answer_gb
        if 1 / 1.5 <= ratio <= 1.5:
            return f"Your guess, {self.guess_gb:g} GB: within 1.5x of the answer. Well done."
        word = "high" if ratio > 1 else "low"
        factor = max(ratio, 1 / ratio)
        scale = "same order of magnitude" if factor < 10 else "off by more than 10x"
        return (f"Your guess, {self.guess_gb:g} GB: {factor:,.1f}x too {word} ({scale}). "
                "Which factor of the formula did you misjudge?")

    # --- ipywidgets front end ------------------------------------------------------------
    def ui(self) -> Any:
        """The calculator as ipywidgets (built once; every control calls the methods above)."""
        if self._ui is None:
            self._ui = _LabWidgets(self)
        return self._ui.box


def growth_chart_png(case: KVCase, guess_gb: float | None = None) -> bytes:
    """A PNG of the case's KV memory against the tokens each sequence holds, in GB.

    The line is straight through zero (every token adds the same bytes; with a sliding window
    it turns flat at the window), the case is a dot on
    it, and a committed guess is a dashed level, so a learner sees which way and how far the
    guess missed. Uses matplotlib's object API (no pyplot state, no display backend)."""
    from matplotlib.figure import Figure

    answer_gb = case.total_bytes / GB
    per_token_gb = answer_gb / case.kept_tokens
    xs = [0, 2 * case.tokens]
    if case.window and case.window < xs[1]:   # a window flattens the line past its size
        xs.insert(1, case.window)
    fig = Figure(figsize=(5.6, 3.0), dpi=90)
    ax = fig.add_subplot()
    ax.plot(xs, [per_token_gb * (min(x, case.window) if case.window else x) for x in xs], "-",
            color="tab:blue",
            label=f"{case.layers} layers, {case.kv_heads} KV heads, {case.dtype}"
                  + (f", {case.concurrency} sequences" if case.concurrency > 1 else "")
                  + (f", window {case.window:,}" if case.window else "")
                  + (f", MLA latent {case.latent_dim} + {case.rope_dim}" if case.latent_dim
                     else ""))
    ax.plot([case.tokens], [answer_gb], "o", color="tab:blue")
    ax.annotate(f"this case: {answer_gb:,.3f} GB", (case.tokens, answer_gb),
                textcoords="offset points", xytext=(-8, 8), ha="right")
    top = 1.1 * per_token_gb * (min(xs[-1], case.window) if case.window else xs[-1])
    if guess_gb is not None:
        if guess_gb <= 10 * answer_gb:
            top = max(top, 1.15 * guess_gb)
            ax.axhline(guess_gb, color="tab:orange", linestyle="--",
                       label=f"your guess: {guess_gb:g} GB")
        else:   # a level far above would squash the line flat; say it in words instead
            ax.plot([], [], " ", label=f"your guess, {guess_gb:g} GB, is off the chart")
    ax.set_ylim(0, top)
    ax.set_xlim(0, xs[-1])
    ax.set_xlabel("tokens held per sequence")
    ax.set_ylabel("KV cache (GB, 10^9 bytes)")
    ax.set_title("KV memory grows linearly with the tokens held"
                 + (", up to the window" if case.window else ""))
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", fontsize="small")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


class _LabWidgets:
    """Controls bound to a :class:`KVCacheLab`; holds no state of its own."""

    def __init__(self, lab: KVCacheLab) -> None:
        import ipywidgets as w

        self.lab = lab
        c = lab.case
        wide = {"style": {"description_width": "150px"}, "layout": w.Layout(width="420px")}
        self.inputs = {
            "layers": w.BoundedIntText(c.layers, min=1, max=1024, description="layers", **wide),
            "kv_heads": w.BoundedIntText(c.kv_heads, min=1, max=1024, description="KV heads",
                                         **wide),
            "head_dim": w.BoundedIntText(c.head_dim, min=1, max=4096, description="head dim",
                                         **wide),
            "dtype": w.Dropdown(options=list(DTYPE_BYTES), value=c.dtype,
                                description="element type", **wide),
            "tokens": w.BoundedIntText(c.tokens, min=1, max=10**8, description="tokens cached",
                                       **wide),
            "concurrency": w.BoundedIntText(c.concurrency, min=1, max=10**6,
                                            description="sequences at once", **wide),
            "window": w.BoundedIntText(c.window, min=0, max=10**8,
                                       description="sliding window (0 = none)", **wide),
            "latent_dim": w.BoundedIntText(c.latent_dim, min=0, max=65536,
                                           description="MLA latent dim (0 = none)", **wide),
            "rope_dim": w.BoundedIntText(c.rope_dim, min=0, max=65536,
                                         description="MLA rotary dim", **wide),
        }
        self.guess = w.Text(placeholder="e.g. 0.5", description="your guess (GB)", **wide)
        self.commit_button = w.Button(description="Commit guess", button_style="primary")
        self.status = w.HTML()
        self.answer = w.HTML()
        self.chart = w.Image(format="png", layout=w.Layout(display="none", width="504px"))
        for name, control in self.inputs.items():
            control.observe(lambda change, name=name: self._on_input(name, change["new"]),
                            names="value")
        self.guess.observe(lambda change: self._on_guess(change["new"]), names="value")
        self.commit_button.on_click(lambda _button: self._on_commit())
        self.box = w.VBox([
            w.HTML("<b>Predict first.</b> Roughly how many GB of KV cache does this case need? "
                   "Type a guess, commit it, then see the answer."),
            *self.inputs.values(), self.guess, self.commit_button, self.status, self.answer,
            self.chart])
        self.refresh()

    def _on_input(self, name: str, value: Any) -> None:
        if not self.lab.set_case(**{name: value}):
            message = self.lab.message
            self.inputs[name].value = getattr(self.lab.case, name)   # back to the valid case
            self.lab.message = message
        self.refresh()

    def _on_guess(self, text: str) -> None:
        self.lab.set_guess(text)
        self.refresh()

    def _on_commit(self) -> None:
        self.lab.commit()
        self.refresh()

    def refresh(self) -> None:
        import html

        lab = self.lab
        if (self.guess.value and lab.guess_gb is None and not lab.committed
                and lab.message.startswith("The case changed")):
            message = lab.message
            self.guess.value = ""  # the old guess belonged to the old case (re-enters refresh)
            lab.message = message
        self.guess.disabled = lab.committed
        self.commit_button.disabled = lab.committed
        self.status.value = f"<i>{html.escape(lab.message)}</i>" if lab.message else ""
        self.answer.value = f"<pre>{html.escape(lab.revealed_text())}</pre>"
        # The chart is part of the answer: drawn on commit, hidden with it when the case changes.
        if lab.committed:
            self.chart.value = growth_chart_png(lab.case, lab.guess_gb)
            self.chart.layout.display = None
        else:
            self.chart.layout.display = "none"
            self.chart.value = b""
