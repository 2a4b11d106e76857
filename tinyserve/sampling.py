"""Turning next-token logits into a token: greedy, temperature, top-k, top-p, seeded.

The order is the one vLLM and Hugging Face use: divide by the temperature, then cut the
candidates with top-k and top-p, then draw from what is left. Cutting sets a logit to
``-inf``, so the softmax gives it exactly zero probability and it can never be drawn.

Two ways to draw. :func:`sample` is the reference: one set of parameters, the draw on the
CPU, so a seed gives the same tokens on any device. :func:`sample_rows` is what a serving
step uses: every row with its own parameters and generator, on the logits' device, in one
batch, and nothing read back: the caller reads the step's tokens once.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from .device import upload


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each token. The defaults are greedy decoding."""

    temperature: float = 0.0   # 0 = greedy (argmax); higher = flatter distribution
    top_k: int | None = None   # keep the k most likely tokens (ties at the cut kept)
    top_p: float | None = None  # keep the most likely tokens until their mass reaches p
    seed: int | None = None    # fixes the random stream, so a run is reproducible

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 means greedy), got {self.temperature}")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k must be at least 1, got {self.top_k}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    def generator(self, device: torch.device | str = "cpu") -> torch.Generator | None:
        """A generator seeded with ``seed`` (None when unseeded), on ``device``: a draw
        needs its generator on the device its numbers are made on."""
        if self.seed is None:
            return None
        return torch.Generator(device).manual_seed(self.seed)


def greedy(logits: Tensor) -> Tensor:
    """The most likely token of each row (B, vocab) -> (B,)."""
    return logits.argmax(dim=-1)


def top_k_filter(logits: Tensor, k: int) -> Tensor:
    """Set every logit below the k-th largest of its row to -inf."""
    k = min(k, logits.shape[-1])
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]      # (B, 1)
    return logits.masked_fill(logits < kth, float("-inf"))


def top_p_filter(logits: Tensor, p: float | Tensor) -> Tensor:
    """Nucleus filter: keep token i when the probability mass of the tokens *more likely*
    than i is below ``p``; set the rest to -inf.

    That keeps the smallest set of top tokens whose mass reaches ``p`` (the most likely token
    always survives), and tokens tied with the last one kept survive too, so the result does
    not depend on how the sort breaks ties.
    """
    probs = torch.softmax(logits.float(), dim=-1)
    sorted_probs, _ = probs.sort(dim=-1, descending=True)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs   # mass strictly ahead in order
    kept = mass_before < p
    kept[..., 0] = True
    # The smallest kept probability is the cut; everything at least that likely stays.
    n_kept = kept.sum(dim=-1, keepdim=True)
    cut = sorted_probs.gather(-1, n_kept - 1)                  # (B, 1)
    return logits.masked_fill(probs < cut, float("-inf"))


def sample(logits: Tensor, temperature: float = 0.0, generator: torch.Generator | None = None,
           *, top_k: int | None = None, top_p: float | None = None) -> Tensor:
    """Pick one token per row of ``logits`` (B, vocab) -> (B,).

    ``temperature == 0`` is greedy (argmax; top-k and top-p cannot change the argmax).
    Otherwise logits are divided by the temperature, filtered by top-k and top-p, and a
    token is drawn from the softmax with ``generator``, so a fixed seed reproduces the run.
    The draw happens on the CPU generator's stream, so a seed gives the same tokens on any
    device.
    """
    SamplingParams(temperature, top_k, top_p)  # validates, with messages naming the limit
    if temperature == 0:
        return greedy(logits)
    scaled = logits.float().cpu() / temperature
    if top_k is not None:
        scaled = top_k_filter(scaled, top_k)
    if top_p is not None and top_p < 1:
        scaled = top_p_filter(scaled, top_p)
    probs = torch.softmax(scaled, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1).to(logits.device)


def sample_with(logits: Tensor, params: SamplingParams,
                generator: torch.Generator | None = None) -> Tensor:
    """``sample`` driven by a :class:`SamplingParams`."""
    return sample(logits, params.temperature, generator, top_k=params.top_k, top_p=params.top_p)


def sample_rows(logits: Tensor, params: Sequence[SamplingParams],
                generators: Sequence[torch.Generator | None]) -> Tensor:
    """One token per row of ``logits`` (R, vocab) -> (R,), row r drawn with ``params[r]``
    and ``generators[r]`` (each on the logits' device, or None for the default one), on that
    device, without reading anything back.

    The draw is ``torch.multinomial``'s own for one sample: ``argmax(p / E)`` with
    ``E ~ Exp(1)`` drawn per vocabulary entry (the exponential race: the index of the first
    of V exponential clocks of rates ``p_i`` to ring, which is index i with probability
    ``p_i``). Drawn here, each row's noise comes from its own generator, so a seeded
    request's tokens do not depend on its batch, and with a CPU generator they equal
    :func:`sample`'s exactly. ``multinomial`` itself also reads its probabilities back to
    check them (a synchronisation per call on a GPU); this does not.
    """
    greedy = logits.argmax(dim=-1)
    hot = [r for r, p in enumerate(params) if p.temperature > 0]
    if not hot:
        return greedy
    vocab = logits.shape[-1]
    # Per-row settings in one small copy: temperature (0: greedy, the row's draw is
    # discarded), top-k (the vocabulary when off) and top-p (+inf when off: nothing cut).
    settings = upload([[p.temperature,
                        float(min(p.top_k, vocab)) if p.top_k is not None else vocab,
                        p.top_p if p.top_p is not None and p.top_p < 1 else math.inf]
                       for p in params], logits.device, torch.float32)
    temperature, top_k, top_p = settings[:, :1], settings[:, 1:2], settings[:, 2:]
    scaled = logits.float() / torch.where(temperature > 0, temperature, 1.0)
    if any(p.top_k is not None for p in params):
        most = min(max(p.top_k or 1 for p in params), vocab)
        ranked = torch.topk(scaled, most, dim=-1).values             # (R, most)
        kth = ranked.gather(-1, (top_k.long().clamp(max=most) - 1))   # (R, 1)
        kth = torch.where(top_k < vocab, kth, float("-inf"))         # rows without top-k
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if any(p.top_p is not None and p.top_p < 1 for p in params):
        scaled = top_p_filter(scaled, top_p)
    probs = torch.softmax(scaled, dim=-1)
    race = torch.ones_like(probs)
    for r in hot:
        race[r].exponential_(generator=generators[r])
    drawn = (probs / race).argmax(dim=-1)
    return drawn if len(hot) == len(params) else torch.where(temperature[:, 0] > 0, drawn, greedy)
