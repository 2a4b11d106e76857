"""One request inside the engine: its tokens, how far its KV has been computed, its trace.

The engine treats prefill and decode as the same thing seen at different sizes: a sequence
has ``num_tokens`` tokens (prompt + output so far) of which ``num_computed`` have their keys
and values in the cache. A step computes the next ``n`` of them; when that reaches the end of
the sequence, the last position's logits give a new token. A fresh prompt has many tokens to
compute (prefill, possibly in chunks), a running sequence exactly one (decode), and a
sequence preempted by recompute starts again from zero with its outputs so far appended to
its prompt.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from .metrics import RequestTrace
from .sampling import SamplingParams


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    seq_id: str
    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingParams = SamplingParams()
    stop_ids: tuple[int, ...] = ()
    arrival: float = 0.0
    output_ids: list[int] = field(default_factory=list)
    status: SeqStatus = SeqStatus.WAITING
    num_computed: int = 0
    finish_reason: str | None = None    # "stop", "length", "window" or "abort"
    preemptions: int = 0
    cached_tokens: int = 0              # prompt tokens served by the prefix cache (last admit)
    trace: RequestTrace = field(init=False)
    generator: torch.Generator | None = field(init=False)

    def __post_init__(self) -> None:
        self.trace = RequestTrace(prompt_tokens=len(self.prompt_ids), arrival=self.arrival)
        # One generator per request: its samples do not depend on who shares the batch.
        self.generator = self.sampling.generator()

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed

    @property
    def in_prefill(self) -> bool:
        """More than one token to compute: a prompt (or a recompute) not yet through."""
        return self.num_uncomputed > 1

    @property
    def finished(self) -> bool:
        return self.status is SeqStatus.FINISHED

    def __repr__(self) -> str:
        return (f"Sequence({self.seq_id!r}, {self.status.value}, prompt={len(self.prompt_ids)}, "
                f"out={len(self.output_ids)}/{self.max_tokens}, computed={self.num_computed})")
