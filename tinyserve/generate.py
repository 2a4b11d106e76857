"""The plainest generation loop: re-run the whole sequence for every new token.

This is the reference every faster path (KV cache, batching, speculation) is checked
against. Its cost grows with the sequence on every step, which the KV-cache chapter measures.
"""
from __future__ import annotations

from collections.abc import Iterator

import torch

from .model import TinyLlama
from .sampling import sample


class PromptError(ValueError):
    """A prompt the model cannot take; the message says which limit and what to do."""


def check_prompt(prompt_ids: list[int], max_tokens: int, context_window: int) -> None:
    if not prompt_ids:
        raise PromptError("the prompt is empty; give at least one character of text.")
    if max_tokens < 1:
        raise PromptError(f"max_tokens must be at least 1, got {max_tokens}.")
    if len(prompt_ids) >= context_window:
        raise PromptError(
            f"the prompt is {len(prompt_ids)} tokens but the context window is "
            f"{context_window}; shorten the prompt to at most {context_window - 1} tokens.")


@torch.no_grad()
def generate_ids(model: TinyLlama, prompt_ids: list[int], max_tokens: int, *,
                 temperature: float = 0.0, seed: int | None = None,
                 stop_ids: tuple[int, ...] = ()) -> Iterator[int]:
    """Yield up to ``max_tokens`` new token ids, stopping early at any of ``stop_ids`` (the
    stop token is yielded) or at the end of the context window."""
    window = model.config.max_position_embeddings
    check_prompt(prompt_ids, max_tokens, window)
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    ids = torch.tensor([prompt_ids], device=model.device)
    for _ in range(min(max_tokens, window - len(prompt_ids))):
        logits = model(ids)[:, -1]                       # recompute everything, keep the last
        token = sample(logits, temperature, generator)   # (1,)
        yield int(token)
        if int(token) in stop_ids:
            return
        ids = torch.cat([ids, token[:, None]], dim=1)
