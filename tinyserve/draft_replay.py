"""A drafter for *timing* speculative decoding at scale: real draft passes, scripted agreement.

The bandwidth-scale models (:mod:`tinyserve.scale`) have seeded random weights, so a random
draft and a random target never agree: a :class:`~tinyserve.speculative.ModelDrafter` over
them has acceptance ~0, and speculative decoding at scale would only ever be timed at its
worst case. The acceptance rate is a property of a *trained* pair (chapter 8 measures the
shipped one); the cost of a step is a property of the *sizes* (the scale models). This
drafter joins the two:

- **The costs are real.** :meth:`ReplayDrafter.propose` runs ``ModelDrafter.propose`` of the
  draft model itself: the same catch-up pass, the same k - 1 decode steps, the same host
  sync, on the same KV cache, rolled back the same way. The target's verify pass, the
  acceptance test and the rewinds are :class:`~tinyserve.speculative.SpeculativeDecoder`'s,
  untouched.
- **Only the agreement is set.** The tokens proposed are not the draft's argmax but a
  script: the target's own greedy continuation of the prompt (computed beforehand, off the
  clock, by :func:`greedy_script`), each proposed token swapped for a wrong one with
  probability ``1 - a`` (a seeded, independent draw per proposal). Greedy verification
  keeps a guess exactly when it is the target's argmax, so each checked guess is kept with
  probability ``a``: the independent-acceptance model of
  :func:`~tinyserve.speculative.expected_tokens_per_pass`, at a chosen ``a``.

The output is still the target's greedy output (greedy acceptance is lossless whatever is
proposed). What is not real: the draft's cache holds the draft's own guesses where the
committed text has the script's tokens. Nothing reads those values but the draft's next
passes, whose outputs are thrown away, and a pass costs the same whatever the token values
(dense matmuls, no data-dependent work), so the timing is unchanged.

Greedy only (temperature 0): under sampling, acceptance depends on the two distributions,
which a script cannot set. The script must be the target's greedy output *as the verify
pass computes it*: in fp32 a pass of k + 1 tokens and k + 1 passes of one token agree on
every argmax in practice; in bf16 a near-tie can flip, the committed text leaves the
script, and the drafter raises (or, with ``strict=False``, records where and goes on, its
later guesses then rejected: read the acceptance from ``SpecStats``).
"""
from __future__ import annotations

import random

import torch
from torch import Tensor

from .generate import generate
from .model import TinyLlama
from .sampling import SamplingParams
from .speculative import ModelDrafter

__all__ = ["ReplayDrafter", "ScriptDiverged", "greedy_script"]


class ScriptDiverged(RuntimeError):
    """The committed text left the script: the target's verify pass chose another token."""


def greedy_script(target: TinyLlama, prompt_ids: list[int], max_tokens: int) -> list[int]:
    """The target's plain greedy continuation of ``prompt_ids`` (``max_tokens`` tokens, or
    fewer at the context window): what a perfect drafter would propose."""
    return generate(target, prompt_ids, max_tokens, sampling=SamplingParams()).tokens


class ReplayDrafter:
    """Proposes the script's tokens, each kept right with probability ``a``, after paying for
    a real :class:`~tinyserve.speculative.ModelDrafter` pass of ``draft``.

    ``script``: :func:`greedy_script` of the same target and prompt, at least as long as the
    run (``max_tokens``). ``a``: the per-token acceptance to set, in [0, 1]. ``seed`` fixes
    which proposals are wrong. ``strict``: raise :class:`ScriptDiverged` when the committed
    text leaves the script (else record the position in ``diverged_at`` and go on).
    ``path``: how the draft passes run, as :class:`~tinyserve.speculative.ModelDrafter`'s
    (:mod:`tinyserve.step_path`: CUDA graphs by default on a GPU, ``"fast"`` the fast path).
    """

    def __init__(self, draft: TinyLlama, script: list[int], a: float, *, seed: int = 0,
                 strict: bool = True, path: str = "auto") -> None:
        if not 0 <= a <= 1:
            raise ValueError(f"a is a probability of acceptance, in [0, 1]; got {a}")
        if not script:
            raise ValueError("the script is empty: build it with greedy_script(target, "
                             "prompt_ids, max_tokens)")
        self.inner = ModelDrafter(draft, path=path)  # type: ignore[arg-type]
        self.script, self.a, self.seed, self.strict = list(script), a, seed, strict
        self.vocab = draft.config.vocab_size
        self.rng = random.Random(seed)
        self.prompt_len = 0
        self.checked = 0          # committed tokens already compared with the script
        self.diverged_at: int | None = None

    def release(self) -> None:
        """Hand the draft passes' static buffers back (as :class:`ModelDrafter`'s)."""
        self.inner.release()

    def start(self, prompt_ids: list[int], max_total: int) -> None:
        self.inner.start(prompt_ids, max_total)
        self.rng = random.Random(self.seed)
        self.prompt_len, self.checked, self.diverged_at = len(prompt_ids), 0, None

    def _check(self, context: list[int]) -> None:
        out = context[self.prompt_len:]
        for i in range(self.checked, len(out)):
            if self.diverged_at is None and (i >= len(self.script) or out[i] != self.script[i]):
                self.diverged_at = i
                if self.strict:
                    raise ScriptDiverged(
                        f"output token {i} is {out[i]}, the script says "
                        f"{self.script[i] if i < len(self.script) else '(nothing: too short)'}"
                        f": the verify pass's argmax differs from plain greedy decoding's "
                        f"(a near-tie in low precision) or the script is not this prompt's; "
                        f"run in fp32, use fewer tokens, or pass strict=False")
        self.checked = len(out)

    def propose(self, context: list[int], k: int, sampling: SamplingParams,
                generator: torch.Generator | None) -> tuple[list[int], Tensor | None]:
        if sampling.temperature != 0:
            raise ValueError(f"ReplayDrafter sets acceptance under greedy verification only "
                             f"(temperature 0), got temperature {sampling.temperature}: "
                             f"under sampling acceptance depends on both distributions")
        self._check(context)
        drafted, _ = self.inner.propose(context, k, sampling, generator)  # the real cost
        start = len(context) - self.prompt_len
        if start + len(drafted) > len(self.script):
            raise ValueError(f"the script has {len(self.script)} tokens but the run asks for "
                             f"guesses up to output token {start + len(drafted)}: build it "
                             f"with greedy_script(..., max_tokens) for this run's max_tokens")
        proposal = []
        for i in range(len(drafted)):
            right = self.script[start + i]
            keep = self.rng.random() < self.a
            proposal.append(right if keep else (right + 1 + self.rng.randrange(self.vocab - 1))
                            % self.vocab)
        return proposal, None

    def commit(self, n_committed: int) -> None:
        self.inner.commit(n_committed)
