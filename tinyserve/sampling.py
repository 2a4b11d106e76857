"""Turning next-token logits into a token: greedy, temperature, top-k, top-p, seeded.

The order is the one vLLM and Hugging Face use: divide by the temperature, then cut the
candidates with top-k and top-p, then draw from what is left. Cutting sets a logit to
``-inf``, so the softmax gives it exactly zero probability and it can never be drawn.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


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

    def generator(self) -> torch.Generator | None:
        return torch.Generator().manual_seed(self.seed) if self.seed is not None else None


def greedy(logits: Tensor) -> Tensor:
    """The most likely token of each row (B, vocab) -> (B,)."""
    return logits.argmax(dim=-1)


def top_k_filter(logits: Tensor, k: int) -> Tensor:
    """Set every logit below the k-th largest of its row to -inf."""
    k = min(k, logits.shape[-1])
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]      # (B, 1)
    return logits.masked_fill(logits < kth, float("-inf"))


def top_p_filter(logits: Tensor, p: float) -> Tensor:
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
