"""The iteration-level scheduler: which sequences run in the next step, and how many tokens.

Every step it builds one batch under two limits, ``max_num_seqs`` running sequences and a
token budget ``max_num_batched_tokens``:

1. **Running sequences first**, oldest first, decodes before prefill chunks. A decode needs
   one token of budget and, at a block boundary, one new KV block. If no block is free, the
   most recently admitted running sequence is **preempted by recompute**: its blocks are freed and it goes back to the head
   of the queue; later it prefills its prompt *and* the tokens it had produced, and carries on.
   A prompt still in prefill continues with its next chunk.
2. **Then waiting requests**, in the policy's order, while slots, budget and blocks last.
   Admission reserves the blocks of the whole prompt (a request that cannot get them waits);
   decode blocks come one at a time. With **chunked prefill** a prompt longer than the
   budget left is split across steps, so decodes keep flowing while it is read; without it,
   a prompt is read in one step, and every running decode waits for that step.

A sequence that finishes, is cancelled or is preempted returns every block it holds.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from .block_manager import BlockManager
from .policies import Policy, make_policy
from .sequence import Sequence, SeqStatus


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 16                # running sequences (decode batch size limit)
    max_num_batched_tokens: int = 256     # tokens computed per step (prefill + decode)
    chunked_prefill: bool = True
    static: bool = False                  # static batching: admit only when the batch is empty

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be at least 1")


@dataclass
class ScheduledBatch:
    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.seqs)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(n for s, n in zip(self.seqs, self.num_new_tokens) if n > 1 or s.in_prefill)

    @property
    def attention_pairs(self) -> int:
        """Query-key pairs attention scores this step: each new token sees its whole context.
        Read before the step runs (it uses ``num_computed``)."""
        return sum(n * (s.num_computed + n) for s, n in zip(self.seqs, self.num_new_tokens))

    @property
    def decode_kv_tokens(self) -> int:
        """Cached tokens the step's decode rows (one new token each) read: the engine gathers
        them as one batch padded to the longest row, so rows x the longest context. Read
        before the step runs."""
        ctx = [s.num_computed + 1 for s, n in zip(self.seqs, self.num_new_tokens) if n == 1]
        return len(ctx) * max(ctx, default=0)

    @property
    def num_decodes(self) -> int:
        return sum(1 for s, n in zip(self.seqs, self.num_new_tokens) if n == 1 and not s.in_prefill)


class Scheduler:
    def __init__(self, config: SchedulerConfig, blocks: BlockManager,
                 policy: str | Policy = "fcfs", context_window: int | None = None) -> None:
        self.config = config
        self.blocks = blocks
        self.policy = make_policy(policy)
        self.context_window = context_window
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    # ---- queue ----------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        need = self.blocks.blocks_needed(len(seq.prompt_ids) + seq.max_tokens)
        if need > self.blocks.num_blocks:
            # It could never finish even alone: refuse now instead of preempting forever.
            raise ValueError(
                f"a request of {len(seq.prompt_ids)} prompt + {seq.max_tokens} output tokens "
                f"needs {need} KV blocks but the pool has {self.blocks.num_blocks}; lower "
                f"max_tokens or shorten the prompt")
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)

    def abort(self, seq: Sequence) -> None:
        """Cancel wherever it is; its blocks are free when this returns."""
        if seq in self.waiting:
            self.waiting.remove(seq)
        if seq in self.running:
            self.running.remove(seq)
            self.blocks.free(seq.seq_id)
        seq.status, seq.finish_reason = SeqStatus.FINISHED, seq.finish_reason or "abort"

    def finish(self, seq: Sequence, reason: str) -> None:
        self.running.remove(seq)
        self.blocks.free(seq.seq_id)
        seq.status, seq.finish_reason = SeqStatus.FINISHED, reason

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- one step -------------------------------------------------------------------------
    def _preempt(self, victim: Sequence, batch: ScheduledBatch) -> None:
        self.running.remove(victim)
        self.blocks.free(victim.seq_id)
        victim.status, victim.num_computed = SeqStatus.WAITING, 0
        victim.preemptions += 1
        self.waiting.appendleft(victim)   # first in line to come back
        batch.preempted.append(victim)

    def _chunk(self, seq: Sequence, budget: int) -> int:
        n = seq.num_uncomputed
        return min(n, budget) if self.config.chunked_prefill else n

    def schedule(self) -> ScheduledBatch:
        cfg, batch = self.config, ScheduledBatch()
        budget = cfg.max_num_batched_tokens
        # 1. Running sequences, oldest first: every decode before any prefill chunk, so a
        #    long prompt being read in chunks never takes a running decode's turn.
        ordered = sorted(self.running, key=lambda s: s.in_prefill)   # stable: age kept
        for seq in ordered:
            if seq not in self.running:       # preempted below to make room for an older one
                continue
            if budget <= 0:
                break
            n = self._chunk(seq, budget)
            if n > budget and batch.seqs:     # unchunked prompt: wait for a step of its own
                continue
            grow = seq.num_tokens - self.blocks.tables[seq.seq_id].num_tokens
            while grow and not self.blocks.can_append(seq.seq_id, grow):
                victim = self.running[-1]
                self._preempt(victim, batch)
                if victim is seq:
                    break
            if seq.status is not SeqStatus.RUNNING:
                continue
            if grow:
                self.blocks.append(seq.seq_id, grow)
            batch.seqs.append(seq)
            batch.num_new_tokens.append(n)
            budget -= n
        # 2. Waiting requests, in policy order; static batching admits only into an empty batch.
        if cfg.static and self.running:
            return batch
        for seq in self.policy.order(self.waiting):
            if len(self.running) >= cfg.max_num_seqs or budget <= 0:
                break
            if not self.policy.may_admit(seq, self.running, cfg.max_num_seqs):
                continue
            if not cfg.chunked_prefill and seq.num_uncomputed > budget and batch.seqs:
                break
            if not self.blocks.can_allocate(seq.token_ids):
                break                         # memory is the limit: keep the queue's order
            table = self.blocks.allocate(seq.seq_id, seq.token_ids)
            seq.num_computed = seq.cached_tokens = table.num_cached_tokens
            self.waiting.remove(seq)
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            n = self._chunk(seq, budget)
            batch.seqs.append(seq)
            batch.num_new_tokens.append(n)
            budget -= n
        return batch
