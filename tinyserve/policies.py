"""Queue policies: which waiting request the scheduler tries to admit next.

A policy does two things: it orders the waiting queue, and it may hold a request back even
when memory and the token budget would let it in. The scheduler stops at the first request
in that order that does not fit (it does not skip ahead), so order is also a promise about
fairness: FCFS never lets a later request overtake an earlier one.

- :class:`FCFS`: arrival order. Fair, simple, and the baseline; a long prompt at the head
  makes everyone behind it wait for its prefill (head-of-line blocking).
- :class:`ShortestPromptFirst`: the shortest prompt first. Minimises mean TTFT when prompts
  are all that differ, and can starve long prompts under steady load.
- :class:`SizeAware`: short (interactive) prompts first, and long prompts limited to a share
  of the running slots, so a burst of long documents can never take every slot and every
  step's token budget away from chat traffic. The long ones still run, never starve: they
  keep their reserved share.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence as Seq

from .sequence import Sequence


class Policy:
    name = "base"

    def order(self, waiting: Iterable[Sequence]) -> list[Sequence]:
        return list(waiting)

    def may_admit(self, seq: Sequence, running: Seq[Sequence], max_num_seqs: int) -> bool:
        return True

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class FCFS(Policy):
    name = "fcfs"


class ShortestPromptFirst(Policy):
    name = "spf"

    def order(self, waiting: Iterable[Sequence]) -> list[Sequence]:
        # Stable sort: equal lengths keep arrival order. A preempted request keeps its place
        # through its (longer) recompute length, so it is not punished twice.
        return sorted(waiting, key=lambda s: s.num_uncomputed)


class SizeAware(Policy):
    """Prompts of at least ``long_prompt`` tokens are *long*: they queue behind every short
    one and may hold at most ``long_share`` of ``max_num_seqs`` running slots (at least 1)."""

    name = "size-aware"

    def __init__(self, long_prompt: int = 256, long_share: float = 0.25) -> None:
        if long_prompt < 1 or not 0 < long_share <= 1:
            raise ValueError("long_prompt must be >= 1 and long_share in (0, 1]")
        self.long_prompt, self.long_share = long_prompt, long_share

    def is_long(self, seq: Sequence) -> bool:
        return len(seq.prompt_ids) >= self.long_prompt

    def order(self, waiting: Iterable[Sequence]) -> list[Sequence]:
        return sorted(waiting, key=self.is_long)   # stable: arrival order within each class

    def may_admit(self, seq: Sequence, running: Seq[Sequence], max_num_seqs: int) -> bool:
        if not self.is_long(seq):
            return True
        limit = max(1, int(self.long_share * max_num_seqs))
        return sum(self.is_long(s) for s in running) < limit

    def __repr__(self) -> str:
        return f"SizeAware(long_prompt={self.long_prompt}, long_share={self.long_share})"


POLICIES = {"fcfs": FCFS, "spf": ShortestPromptFirst, "size-aware": SizeAware}


def make_policy(policy: str | Policy) -> Policy:
    if isinstance(policy, Policy):
        return policy
    if policy not in POLICIES:
        raise ValueError(f"unknown queue policy {policy!r}; choose one of: {', '.join(POLICIES)}")
    return POLICIES[policy]()
