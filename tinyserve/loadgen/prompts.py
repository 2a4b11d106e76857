"""Prompts for the load generator: support tickets cut or padded to the lengths a workload asks.

The shipped model was trained on support tickets, so every prompt here is ticket text that
ends with ``<|reply|>``: the model answers with a natural reply and stops at ``<|end|>``.
A prompt of a given length is the tail of "earlier tickets in the same thread, then this
ticket": longer prompts quote more history, shorter ones keep only the end of the ticket.

**Harbor-shaped** traffic replays Harbor's tickets (``paths.HARBOR_TICKETS``, package data
identical to ``harbor_project/fixtures/tickets.jsonl``; 200 tickets,
sized for a 16,384-token context) on our 512-token model: prompt lengths are scaled by
``window / 16384``, so the ratio of each prompt to the context is Harbor's (most tickets are
short, a few fill the window, and HT-0078 does not fit at all and gets a 400, as it would
there). Output caps are scaled by a separate ``output_scale`` (default 1/4), because
Harbor's replies scaled by 1/32 would be 3-15 tokens: too few to measure decode.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..paths import HARBOR_TICKETS
from ..workload import Lengths

HARBOR_CONTEXT = 16_384


@dataclass(frozen=True)
class Prompt:
    text: str
    prompt_tokens: int     # by our tokenizer (a server with another tokenizer counts its own)
    max_tokens: int        # the cap sent; the real output length comes back in the usage
    tag: str = ""          # e.g. the Harbor ticket id or "long"


def _ticket_pool(seed: int, k: int = 64) -> list[list[int]]:
    from ..corpus import example_prompts
    from ..tokenizer import load_tokenizer
    tok = load_tokenizer()
    return [tok.encode(p) for p in example_prompts(k, seed=seed)]


def prompt_of_length(n_tokens: int, index: int, pool: list[list[int]]) -> list[int]:
    """Token ids of a ``n_tokens`` prompt ending with ticket ``index``'s ``<|reply|>``: the
    ticket's last tokens, after as many earlier tickets of the pool as needed (a quoted
    thread)."""
    if n_tokens < 1:
        raise ValueError(f"a prompt needs at least 1 token, got {n_tokens}")
    ids = list(pool[index % len(pool)])
    j = index + 1
    while len(ids) < n_tokens:
        ids = pool[j % len(pool)] + ids
        j += 1
    return ids[-n_tokens:]


def _prompts(prompt_lens: np.ndarray, max_tokens: np.ndarray, seed: int,
             tags: list[str] | None = None) -> list[Prompt]:
    from ..tokenizer import load_tokenizer
    tok = load_tokenizer()
    pool = _ticket_pool(seed)
    out = []
    for i, (p, m) in enumerate(zip(prompt_lens, max_tokens)):
        ids = prompt_of_length(int(p), i, pool)
        # Sent as text (any server can take it); decoding then re-encoding a cut can merge a
        # token or two, so the length is recounted.
        text = tok.decode(ids)
        out.append(Prompt(text, len(tok.encode(text)), int(m), tags[i] if tags else ""))
    return out


def ticket_prompts(n: int, prompt: Lengths, output: Lengths, seed: int = 0,
                   window: int = 512) -> list[Prompt]:
    """``n`` ticket prompts with lengths from ``prompt`` and output caps from ``output``;
    a cap is lowered so that prompt + cap fits ``window``."""
    rng = np.random.default_rng(seed)
    p = np.minimum(prompt.sample(rng, n), window - 1)
    o = np.maximum(1, np.minimum(output.sample(rng, n), window - p))
    return _prompts(p, o, seed)


def corpus_prompts(n: int, max_tokens: int = 64, seed: int = 1234) -> list[Prompt]:
    """``n`` whole held-out tickets as they come (about 75-90 tokens each)."""
    from ..corpus import example_prompts
    from ..tokenizer import load_tokenizer
    tok = load_tokenizer()
    return [Prompt(t, len(tok.encode(t)), max_tokens) for t in example_prompts(n, seed=seed)]


def harbor_prompts(n: int | None = None, window: int = 512, output_scale: float = 0.25,
                   path: Path = HARBOR_TICKETS, seed: int = 0) -> list[Prompt]:
    """The Harbor tickets in arrival order (the first ``n``; all 200 by default), scaled onto
    a ``window``-token model (see the module docstring). A ticket too long for the window keeps
    its scaled length, so the server refuses it as Harbor's would."""
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    rows = rows[:n] if n is not None else rows
    scale = window / HARBOR_CONTEXT
    p = np.array([max(8, round(r["prompt_tokens"] * scale)) for r in rows])
    o = np.array([max(2, round(r["output_tokens"] * output_scale)) for r in rows])
    o = np.where(p + o > window, np.maximum(1, window - p), o)
    return _prompts(p, o, seed, [r["id"] for r in rows])
