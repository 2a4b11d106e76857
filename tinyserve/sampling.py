"""Turning next-token logits into a token: greedy or temperature sampling, seeded."""
from __future__ import annotations

import torch
from torch import Tensor


def sample(logits: Tensor, temperature: float = 0.0,
           generator: torch.Generator | None = None) -> Tensor:
    """Pick one token per row of ``logits`` (B, vocab) -> (B,).

    ``temperature == 0`` is greedy (argmax). Otherwise logits are divided by the temperature
    and a token is drawn from the softmax with ``generator``, so a fixed seed reproduces the
    run. Sampling happens on the CPU generator's stream for device independence.
    """
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 means greedy), got {temperature}")
    if temperature == 0:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits.float().cpu() / temperature, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1).to(logits.device)
