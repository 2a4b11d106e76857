"""Speculative decoding: a cheap drafter guesses k tokens, the target checks them in one pass.

Decode is one token per target pass, and at batch 1 a pass costs about the same for 1 token
as for a handful (it is dominated by reading weights and per-pass overhead, not arithmetic).
So: let a drafter propose ``d_1..d_k``, feed ``[last, d_1..d_k]`` to the target in one pass,
and read k + 1 next-token distributions at once. Keep the longest prefix of drafts the target
agrees with, then add one token from the target itself (the correction at the first
disagreement, or a bonus token when all k were accepted). Every pass yields 1 to k + 1 tokens.

It is lossless. Greedy: a draft is kept only if it *is* the target's argmax, so the output is
token for token the target's greedy output. Sampling (Leviathan et al. 2023, Chen et al.
2023): keep ``d_i`` with probability ``min(1, p(d_i) / q(d_i))`` (p target, q drafter); on the
first rejection draw from ``norm(max(0, p - q))``. The emitted token is then distributed
exactly as p, whatever q is; a good q only makes acceptance more frequent.

Two drafters share one interface: :class:`ModelDrafter` (a small model with its own KV
cache) and :class:`NGramDrafter` (prompt lookup: find the latest earlier occurrence of the
context's last n tokens and propose what followed it; no model, near-free).

Both caches keep one invariant: they hold every committed token *except the last*, whose
logits are computed by the next pass. Rejected drafts are dropped with ``KVCache.rewind``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import Tensor

from .backends.spec_graphs import StaticPasses, static_passes
from .backends.static import window_for
from .device import upload
from .generate import check_prompt, decode_step, eager_passes, extend, prefill
from .kv_cache import KVCache
from .model import TinyLlama
from .paths import cache_dir
from .sampling import SamplingParams, top_k_filter, top_p_filter
from .step_path import PathName, resolve

__all__ = ["Drafter", "ModelDrafter", "NGramDrafter", "SpecStats", "SpeculativeDecoder",
           "accept_greedy", "accept_sampled", "probs_for", "speculative_generate",
           "break_even_acceptance", "expected_tokens_per_pass", "predicted_speedup"]


# ------------------------------------------------------------------ the two formulas

def expected_tokens_per_pass(a: float, k: int) -> float:
    """Tokens per target pass when each draft is accepted independently with probability a:
    1 + a + a^2 + ... + a^k = (1 - a^(k+1)) / (1 - a). (k + 1 when a == 1.)"""
    if not 0 <= a <= 1 or k < 0:
        raise ValueError(f"need 0 <= a <= 1 and k >= 0, got a={a}, k={k}")
    return float(k + 1) if a == 1 else (1 - a ** (k + 1)) / (1 - a)


def predicted_speedup(a: float, k: int, draft_cost: float, verify_cost: float = 1.0) -> float:
    """Wall-time speed-up over plain decode: tokens per pass divided by the time of one
    speculative step, in units of one plain decode pass (k draft passes + one verify pass)."""
    return expected_tokens_per_pass(a, k) / (k * draft_cost + verify_cost)


def break_even_acceptance(k: int, draft_cost: float, verify_cost: float) -> float:
    """The per-draft acceptance a below which :func:`predicted_speedup` falls under 1 (1.0:
    it never pays at these costs). The speed-up rises with a, so a bisection finds it."""
    lo, hi = 0.0, 1.0
    if predicted_speedup(1.0, k, draft_cost, verify_cost) < 1:
        return 1.0
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if predicted_speedup(mid, k, draft_cost, verify_cost) < 1 else (lo, mid)
    return hi


# ------------------------------------------------------------------ verification

def accept_greedy(draft: list[int], target_argmax: list[int]) -> list[int]:
    """Greedy verification. ``target_argmax[i]`` is the target's choice after the context
    plus ``draft[:i]`` (len(draft) + 1 entries). Keep drafts while they match, then append
    the target's own token: the correction at the first mismatch, or the bonus token."""
    n = 0
    while n < len(draft) and draft[n] == target_argmax[n]:
        n += 1
    return draft[:n] + [target_argmax[n]]


def accept_greedy_logits(draft: list[int], target_logits: Tensor) -> list[int]:
    """``accept_greedy`` given the target's logits (len(draft) + 1, vocab) of the verifying pass."""
    if target_logits.dim() != 2 or target_logits.shape[0] != len(draft) + 1:
        raise ValueError(f"the verifying pass must score len(draft) + 1 = {len(draft) + 1} "
                         f"positions (the last context token, then each guess), got logits of "
                         f"shape {tuple(target_logits.shape)}: feed the target context[-1:] + draft")
    return accept_greedy(list(draft), target_logits.argmax(dim=-1).tolist())


def draft_greedy(model, context: list[int], k: int) -> list[int]:
    """k greedy guesses after ``context`` of a model that keeps its own cache (``length``: the
    positions it holds; ``feed(tokens)``: their logits): it is fed only what it lacks."""
    if k < 1:
        raise ValueError(f"k is the number of guesses to draft, 1 or more; got {k}")
    if model.length >= len(context):
        # Its cache must hold a prefix of the context and lack at least its last token, whose
        # logits give the first guess; more means rejected guesses were never rolled back.
        raise ValueError(f"the draft model's cache holds {model.length} positions but the "
                         f"context has {len(context)} tokens: roll it back to len(context) - 1 "
                         f"(rollback) after each step, before drafting again")
    logits = model.feed(list(context[model.length:]))
    guesses = [int(logits[-1].argmax())]
    while len(guesses) < k:
        guesses.append(int(model.feed(guesses[-1:])[-1].argmax()))
    return guesses


def accept_sampled(draft: list[int], p: Tensor, q: Tensor | None,
                   generator: torch.Generator | None = None) -> list[int]:
    """Rejection sampling. ``p`` (len(draft) + 1, V) target probabilities, ``q`` (len(draft), V)
    the drafter's (None: a deterministic drafter, q is one-hot on each draft). Returns the
    accepted drafts plus one token drawn from the residual or, if all passed, from p's last row."""
    k = len(draft)
    if k:
        idx = torch.tensor(draft)[:, None]
        p_d = p[:k].gather(1, idx).squeeze(1)
        q_d = torch.ones(k) if q is None else q.gather(1, idx).squeeze(1)
        u = torch.rand(k, generator=generator)
        # u < p/q  <=>  accept with probability min(1, p/q); q_d > 0 since d was drawn from q
        ok = (u * q_d < p_d).tolist()
        n = ok.index(False) if False in ok else k
    else:
        n = 0
    if n == k:
        return draft + [int(torch.multinomial(p[k], 1, generator=generator))]
    if q is None:
        residual = p[n].clone()
        residual[draft[n]] = 0.0
    else:
        residual = (p[n] - q[n]).clamp_min(0.0)
    if float(residual.sum()) <= 0:  # p == q exactly: rejection had probability 0; keep p
        residual = p[n]
    return draft[:n] + [int(torch.multinomial(residual, 1, generator=generator))]


def probs_for(logits: Tensor, sampling: SamplingParams) -> Tensor:
    """The distribution ``sampling.sample`` draws from, as probabilities on the CPU (rows, V):
    temperature, then top-k and top-p, then softmax."""
    scaled = logits.float().cpu() / sampling.temperature
    if sampling.top_k is not None:
        scaled = top_k_filter(scaled, sampling.top_k)
    if sampling.top_p is not None and sampling.top_p < 1:
        scaled = top_p_filter(scaled, sampling.top_p)
    return torch.softmax(scaled, dim=-1)


def _passes(model: TinyLlama, tokens: int, widths, fast: bool) -> StaticPasses:
    """Static passes of ``widths``: the fast path's (:mod:`tinyserve.backends.fast`: CUDA
    graphs, or each width compiled on a CPU) or the static buffers of ``graph``."""
    if fast:
        from .backends.fast import fast_passes
        return fast_passes(model, tokens, widths, cache=cache_dir())
    return static_passes(model, tokens, widths)


#: The paths speculation takes (:mod:`tinyserve.step_path`; its passes are never
#: ``"compiled"`` on their own: ``"fast"`` compiles them where that is faster).
SPEC_PATHS = ("auto", "eager", "graph", "fast")


def _static(path: str, device: torch.device, where: str) -> tuple[bool, bool]:
    """(static passes?, fast passes?) for ``path``: ``"auto"`` is static on CUDA (graphs),
    ``"graph"`` on any device (on a CPU run eagerly), ``"fast"`` always (the graphs on CUDA,
    on a CPU each width's fastest way)."""
    how = resolve(path, device, allowed=SPEC_PATHS, where=where)
    return how.graph or how.fast, how.fast


# ------------------------------------------------------------------ drafters

class Drafter(Protocol):
    """Proposes up to k tokens after ``context`` (every committed token, prompt first)."""

    def start(self, prompt_ids: list[int], max_total: int) -> None: ...

    def propose(self, context: list[int], k: int, sampling: SamplingParams,
                generator: torch.Generator | None) -> tuple[list[int], Tensor | None]:
        """Draft tokens (at most k) and their proposal distributions (len, V) on the CPU, or
        None when the drafter is deterministic (its proposal is one-hot)."""
        ...

    def commit(self, n_committed: int) -> None:
        """The first ``n_committed`` tokens of the context are now final; forget the rest."""
        ...


class ModelDrafter:
    """A small model sharing the target's tokenizer, with its own KV cache.

    It runs on the plain decode path's step code (:func:`~tinyserve.generate.extend` and
    :func:`~tinyserve.generate.decode_step`, in inference mode), so a draft pass costs
    what the cost model's measured draft pass costs. ``path`` (:data:`SPEC_PATHS`):
    ``"auto"`` (on CUDA) or ``"graph"`` runs the same passes on static buffers
    (:mod:`tinyserve.backends.spec_graphs`), replayed as CUDA graphs of widths 1 and 2 (the
    catch-up), eagerly on a CPU; ``"fast"``: the fastest path here
    (:mod:`tinyserve.backends.fast`): the graphs on CUDA, on a CPU each width's fastest way;
    the same tokens as eager."""

    #: Pass widths on static buffers: one-token draft steps and the catch-up of 1 or 2.
    WIDTHS = (1, 2)

    def __init__(self, model: TinyLlama, *, path: PathName = "auto") -> None:
        self.model = model
        self.graph, self.fast = _static(path, model.device, "ModelDrafter")
        self.cache: KVCache | None = None
        self.passes: StaticPasses | None = None

    def release(self) -> None:
        """Hand the draft's static buffers back (:meth:`SpeculativeDecoder.release` calls it)."""
        if self.passes is not None:
            self.passes.release()
            self.passes = None

    def start(self, prompt_ids: list[int], max_total: int) -> None:
        if self.graph:
            self.release()
            self.passes = _passes(self.model, max_total, self.WIDTHS, self.fast)
            self.passes.reset()
            if len(prompt_ids) > 1:
                ids = upload(prompt_ids[:-1], self.model.device)[None]
                with eager_passes(self.model, self.fast, ids):
                    self.passes.prefill(ids)
            return
        self.cache = KVCache.for_model(self.model, 1, max_total)
        if len(prompt_ids) > 1:  # hold all but the last token, like the target's cache
            ids = torch.tensor([prompt_ids[:-1]], device=self.model.device)
            # Nothing is read from this pass: score one position, not the whole prompt.
            prefill(self.model, ids, self.cache, logits_at=torch.tensor([0], device=ids.device))

    def _held(self) -> int:
        """Positions the draft's cache holds (the host's count)."""
        if self.passes is not None:
            return self.passes.length
        assert self.cache is not None, "call start() first"
        return self.cache.lengths[0]

    def _catch_up(self, tokens: Tensor) -> Tensor:
        """The draft model over ``tokens`` (1, w) after what its cache holds: the last
        position's logits (1, V)."""
        if self.passes is None:
            return extend(self.model, tokens, None, self.cache)[:, -1]
        for i in range(0, tokens.shape[1] - 2, 2):   # longer than the widths: in pieces
            self.passes.feed(tokens[:, i:i + 2])
        return self.passes.feed(tokens[:, -(tokens.shape[1] % 2 or 2):])[-1:]

    def _step(self, token: Tensor) -> Tensor:
        """One draft step: ``token`` (1,) fed after what the cache holds, plain decoding's
        step (or its static-buffer twin); its logits (1, V)."""
        if self.passes is None:
            return decode_step(self.model, token, None, self.cache)
        return self.passes.feed(token)

    def propose(self, context: list[int], k: int, sampling: SamplingParams,
                generator: torch.Generator | None) -> tuple[list[int], Tensor | None]:
        if k == 0:
            return [], None
        device, have = self.model.device, self._held()
        # Catch up on committed tokens the cache lacks: 1, or 2 after a fully accepted step.
        # Positions from the cache's host length (``positions=None``): nothing read back.
        logits = self._catch_up(upload(context[have:], device)[None])  # (1, V)
        greedy = sampling.temperature == 0
        drafts: list[Tensor] = []
        probs: list[Tensor] = []
        for i in range(k):
            if greedy:
                token = logits.argmax(-1)                                # (1,), on the device
                drafts.append(token)
            else:   # q to the host (the seeded reference draw), the guess drawn there
                q = probs_for(logits, sampling)
                probs.append(q[0])
                drafts.append(torch.multinomial(q, 1, generator=generator)[:, 0])
                token = drafts[-1].to(device)
            if i < k - 1:  # the last guess is never fed: the verify pass scores it
                logits = self._step(token)                   # at len(context) + i
        tokens = torch.cat(drafts).tolist()          # greedy: the one device read of the draft
        return tokens, (None if greedy else torch.stack(probs))

    def commit(self, n_committed: int) -> None:
        keep = n_committed - 1
        if keep < self._held():  # after a fully accepted step there is nothing to drop
            if self.passes is not None:
                self.passes.rewind(keep)     # the host's count: the masks follow positions
            else:
                self.cache.rewind([keep])    # type: ignore[union-attr]


class NGramDrafter:
    """Prompt lookup: match the context's last ``n`` tokens (n from ``max_n`` down to
    ``min_n``) against earlier text and propose the tokens that followed the latest match.

    An index maps each n-gram to where its latest occurrence ended, extended as the context
    grows, so a proposal costs a few dict look-ups instead of a scan. Optional ``corpus``
    token lists (e.g. earlier replies) are indexed too; the context's own matches win.
    """

    def __init__(self, max_n: int = 4, min_n: int = 2,
                 corpus: list[list[int]] | None = None) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.max_n, self.min_n = max_n, min_n
        self.corpus_index: dict[tuple[int, ...], tuple[list[int], int]] = {}
        for doc in corpus or []:
            self._index(doc, 0, self.corpus_index)
        self.index: dict[tuple[int, ...], tuple[list[int], int]] = {}
        self.indexed = 0  # context positions whose following token has been indexed

    def _index(self, seq: list[int], start: int,
               index: dict[tuple[int, ...], tuple[list[int], int]]) -> None:
        # Every n-gram ending just before position j (j < len(seq)) points at j.
        for j in range(max(start, 1), len(seq)):
            for n in range(self.min_n, min(self.max_n, j) + 1):
                index[tuple(seq[j - n:j])] = (seq, j)

    def start(self, prompt_ids: list[int], max_total: int) -> None:
        self.index, self.indexed = {}, 0

    def propose(self, context: list[int], k: int, sampling: SamplingParams,
                generator: torch.Generator | None) -> tuple[list[int], Tensor | None]:
        if k == 0:
            return [], None
        self._index(context, self.indexed, self.index)
        self.indexed = len(context)
        for n in range(min(self.max_n, len(context)), self.min_n - 1, -1):
            key = tuple(context[-n:])
            for index in (self.index, self.corpus_index):
                hit = index.get(key)
                if hit is not None:
                    seq, j = hit
                    return list(seq[j:j + k]), None
        return [], None

    def commit(self, n_committed: int) -> None:
        # The index only ever covers committed tokens (propose indexes the context it is given).
        self.indexed = min(self.indexed, n_committed)


# ------------------------------------------------------------------ the decoding loop

@dataclass
class SpecStats:
    """One request's record: how many drafts were proposed and accepted, and passes."""

    proposed: int = 0        # draft tokens sent to the target for checking
    accepted: int = 0        # of those, kept
    rejected: int = 0        # passes that rejected a draft (the drafts after it go unchecked)
    target_passes: int = 0   # verification passes (prefill not counted)
    emitted: list[int] = field(default_factory=list)  # tokens emitted by each pass

    @property
    def acceptance_rate(self) -> float:
        """Accepted / proposed drafts: the "draft acceptance rate" servers report."""
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def acceptance_prob(self) -> float:
        """Accepted / checked drafts: the chance a draft is kept given the ones before it
        were, the ``a`` of :func:`expected_tokens_per_pass`. Drafts behind a rejection are
        never really checked, so the rate above understates this for k > 1."""
        checked = self.accepted + self.rejected
        return self.accepted / checked if checked else 0.0

    @property
    def tokens_per_pass(self) -> float:
        return sum(self.emitted) / self.target_passes if self.target_passes else 0.0


class SpeculativeDecoder:
    """Batch-1 speculative decoding, step by step (``speculative_generate`` drives it).

    ``path`` (:data:`SPEC_PATHS`): ``"auto"`` (on CUDA) or ``"graph"`` runs the target's
    passes on static buffers (:mod:`tinyserve.backends.spec_graphs`), the verify pass replayed
    as one CUDA graph per width (k + 1, or fewer when fewer drafts come), eagerly on a CPU;
    ``"fast"``: the fastest path here for the verify passes (widths 1..k + 1;
    :mod:`tinyserve.backends.fast`): the graphs on CUDA, on a CPU each width's fastest way;
    the drafter's own ``path`` covers the draft steps. Call :meth:`release` when done
    (``speculative_generate`` does)."""

    def __init__(self, target: TinyLlama, drafter: Drafter, k: int,
                 sampling: SamplingParams = SamplingParams(), *,
                 path: PathName = "auto") -> None:
        if k < 1:
            raise ValueError(f"k (draft tokens per step) must be at least 1, got {k}")
        self.target, self.drafter, self.k, self.sampling = target, drafter, k, sampling
        self.graph, self.fast = _static(path, target.device, "SpeculativeDecoder")
        self.generator = sampling.generator()
        self.stats = SpecStats()
        self.context: list[int] = []
        self.cache: KVCache | None = None
        self.passes: StaticPasses | None = None

    @torch.no_grad()  # the model passes run in inference mode; this covers any drafter
    def prefill(self, prompt_ids: list[int], max_total: int) -> int:
        """Run the prompt, sample the first token; both caches then hold the prompt."""
        device = self.target.device
        self.drafter.start(prompt_ids, max_total)
        ids = upload(prompt_ids, device)[None]
        if self.graph:
            self._release_target()
            # Verify passes of 1 to k + 1 tokens: fewer drafts come at the budget's end
            # (and from an n-gram drafter), each width its own graph.
            self.passes = _passes(self.target, max_total, range(1, self.k + 2), self.fast)
            self.passes.reset()
            with eager_passes(self.target, self.fast, ids):
                logits = self.passes.prefill(ids)
        else:
            self.cache = KVCache.for_model(self.target, 1, max_total)
            # Plain decoding's prefill: the vocabulary is scored at the last position only.
            last = torch.tensor([len(prompt_ids) - 1], device=device)
            logits = prefill(self.target, ids, self.cache, logits_at=last)[0]
        first = self._pick(logits, [], None)[0]
        self.context = list(prompt_ids) + [first]
        return first

    def _pick(self, logits: Tensor, draft: list[int], q: Tensor | None) -> list[int]:
        if self.sampling.temperature == 0:
            return accept_greedy(draft, logits.argmax(-1).tolist())
        return accept_sampled(draft, probs_for(logits, self.sampling), q, self.generator)

    def release(self) -> None:
        """Hand the static buffers (graph path) back for another request: the target's, and
        the drafter's where it holds any (a drafter made per request would otherwise keep its
        pass set marked in use, and the kept sets would crowd out the target's)."""
        self._release_target()
        let_go = getattr(self.drafter, "release", None)
        if let_go is not None:
            let_go()

    def _release_target(self) -> None:
        if self.passes is not None:
            self.passes.release()
            self.passes = None

    @torch.no_grad()
    def step(self, k: int) -> list[int]:
        """Draft up to k tokens, verify them in one target pass; return the new tokens."""
        assert self.cache is not None or self.passes is not None, "call prefill() first"
        if k > self.k and self.passes is not None:   # its verify widths stop at k + 1
            raise ValueError(f"this decoder's static buffers verify at most k={self.k} "
                             f"drafts a step, got {k}: make it with a larger k")
        draft, q = self.drafter.propose(self.context, k, self.sampling, self.generator)
        # Right after the cache's len(context) - 1 tokens; positions from its host length.
        feed = upload(self.context[-1:] + draft, self.target.device)[None]
        if self.passes is not None:
            logits = self.passes.feed(feed)                         # (len(draft) + 1, V)
        else:
            logits = extend(self.target, feed, None, self.cache)[0]
        new = self._pick(logits, draft, q)
        self.stats.proposed += len(draft)
        self.stats.accepted += len(new) - 1
        self.stats.rejected += len(new) - 1 < len(draft)
        self.stats.target_passes += 1
        self.context += new
        # Keep all but the last committed token: drop the rejected drafts' keys and values
        # (none when every draft was accepted: the bonus token is the one not yet fed).
        if len(new) <= len(draft):
            if self.passes is not None:
                self.passes.rewind(len(self.context) - 1)   # the host's count only
            else:
                self.cache.rewind([len(self.context) - 1])  # type: ignore[union-attr]
        self.drafter.commit(len(self.context))
        return new


def speculative_generate(target: TinyLlama, drafter: Drafter, prompt_ids: list[int],
                         max_tokens: int, *, k: int = 4,
                         sampling: SamplingParams = SamplingParams(),
                         stop_ids: tuple[int, ...] = (),
                         path: PathName = "auto") -> tuple[list[int], SpecStats]:
    """Up to ``max_tokens`` new tokens (stopping after a stop token, or at the context window,
    like ``generate``) and the request's :class:`SpecStats`. ``path``: how the target's
    passes run (:class:`SpeculativeDecoder`); the drafter chooses its own
    (:class:`ModelDrafter`'s ``path``)."""
    window = target.config.max_position_embeddings
    check_prompt(prompt_ids, max_tokens, window)
    steps = min(max_tokens, window - len(prompt_ids))
    dec = SpeculativeDecoder(target, drafter, k, sampling, path=path)
    try:
        out = [dec.prefill(prompt_ids, len(prompt_ids) + steps)]
        while out[-1] not in stop_ids and len(out) < steps:
            # A step emits up to k + 1 tokens: never draft past the budget (or the window).
            new = dec.step(min(k, steps - len(out) - 1))
            stop = next((i for i, t in enumerate(new) if t in stop_ids), len(new) - 1)
            out += new[:stop + 1]  # nothing after a stop token (the budget is never overrun)
            dec.stats.emitted.append(stop + 1)
    finally:
        dec.release()
    return out, dec.stats
