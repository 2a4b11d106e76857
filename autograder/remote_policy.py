"""A learner's admission policy, driven from the trusted side: the simulator runs in the
tests' process, the policy's decisions come from the learner's kernel, one request per step.

Why
    The scheduling tests grade a policy (a ``tinyserve.policies.Policy`` subclass the learner
    writes) by serving whole workloads with it in the simulator. The simulator, the metrics
    and the thresholds must run on the trusted side (``autograder.runner.channel``), but the policy
    is the learner's code and stays in the kernel, and its arguments (live ``Sequence``
    objects with generators, enums and traces) are not data. So each end keeps its own copy:

    - ``AskedPolicy`` (trusted side) is the policy the simulated engine gets. When the
      scheduler asks for the queue's order, it sends the kernel what changed since the last
      step (new requests' tokens, and each waiting or running request's counters) with the
      waiting and running requests' ids, and gets back the learner's order and, for that
      order, the learner's ``may_admit`` answers; ``may_admit`` then reads them back.
    - ``PolicyDriver`` (kernel side) keeps a mirror ``Sequence`` per request, calls the
      learner's ``order`` and ``may_admit`` on the mirrors, and answers with ids and booleans.

Why one request per step is enough
    The scheduler walks the policy's order and calls ``may_admit(seq, running, max_num_seqs)``
    for each request while slots and budget last; a request it may admit is admitted (or the
    walk stops: memory, budget). So ``running`` at each call is the running list at the
    step's start plus the requests admitted before it in the order, which the driver knows:
    it asks ``may_admit`` in that order, with that list, until the slots are full. The
    scheduler uses the answers up to where it stops. A step whose slots are already full
    admits nobody and costs no request at all.

Trust
    The driver runs in the learner's kernel and is not trusted: whatever it answers is the
    learner's policy (any sequence of decisions is one some policy makes), which the tests
    then measure with their own simulator. Ids it returns that are not waiting are dropped,
    repeats count once, and a request it gave no answer for is not admitted.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence as Seq

from tinyserve.policies import Policy
from tinyserve.sequence import Sequence, SeqStatus


def _signature(seq: Sequence) -> tuple:
    return (len(seq.prompt_ids), len(seq.output_ids), seq.num_computed, seq.status.value,
            seq.preemptions, seq.cached_tokens)


class AskedPolicy(Policy):
    """The trusted side's stand-in for the learner's policy (see the module's docstring).

    ``ask(new, changed, waiting_ids, running_ids, max_num_seqs)`` is the learner's
    ``PolicyDriver.ask`` (over the channel at grading); ``scheduler`` is set by the caller
    once the engine exists, so a step with no free slot is not asked about.
    """

    name = "yours"

    def __init__(self, ask: Callable) -> None:
        self.ask = ask
        self.scheduler = None
        self.requests = 0          # steps the learner's code was asked about
        self._known: dict[str, tuple] = {}
        self._answers: dict[str, bool] = {}

    def _changes(self, seqs: list[Sequence]) -> tuple[list, list]:
        new, changed = [], []
        for seq in seqs:
            sig, old = _signature(seq), self._known.get(seq.seq_id)
            if old is None:
                new.append([seq.seq_id, list(seq.prompt_ids), seq.max_tokens, seq.arrival,
                            list(seq.output_ids), *sig[2:]])
            elif old != sig:
                grown = sig[0] == old[0] and sig[1] >= old[1]
                changed.append([seq.seq_id, None if grown else list(seq.prompt_ids),
                                list(seq.output_ids[old[1]:] if grown else seq.output_ids),
                                *sig[2:]])
            self._known[seq.seq_id] = sig
        return new, changed

    def order(self, waiting: Iterable[Sequence]) -> list[Sequence]:
        waiting = list(waiting)
        self._answers = {}
        sched = self.scheduler
        running = list(sched.running) if sched is not None else []
        if not waiting or (sched is not None
                           and len(running) >= sched.config.max_num_seqs):
            return waiting                      # nobody can be admitted this step
        new, changed = self._changes(waiting + running)
        max_seqs = sched.config.max_num_seqs if sched is not None else len(waiting) + 1
        self.requests += 1
        got = self.ask(new, changed, [s.seq_id for s in waiting],
                       [s.seq_id for s in running], max_seqs)
        ids, admits = (got if type(got) in (list, tuple) and len(got) == 2 else ([], []))
        by_id = {s.seq_id: s for s in waiting}
        ordered = []
        for i, sid in enumerate(ids if type(ids) is list else []):
            seq = by_id.pop(sid, None) if type(sid) is str else None
            if seq is not None:
                ordered.append(seq)
                if type(admits) is list and i < len(admits):
                    self._answers[sid] = admits[i] is True
        return ordered

    def may_admit(self, seq: Sequence, running: Seq[Sequence], max_num_seqs: int) -> bool:
        return self._answers.get(seq.seq_id, False)


class PolicyDriver:
    """The kernel side: mirrors of the requests, and the learner's policy asked about them."""

    __slots__ = ("policy", "seqs")   # no attribute snapshot to send after each request

    def __init__(self, policy: object) -> None:
        self.policy = policy
        self.seqs: dict[str, Sequence] = {}

    def is_policy(self) -> bool:
        return isinstance(self.policy, Policy)

    def _update(self, new: list, changed: list) -> None:
        for sid, prompt, max_tokens, arrival, output, *counters in new:
            seq = Sequence(sid, list(prompt), max_tokens, arrival=arrival)
            seq.output_ids = list(output)
            self.seqs[sid] = seq
            changed.append([sid, None, [], *counters])
        for sid, prompt, output, computed, status, preemptions, cached in changed:
            seq = self.seqs[sid]
            if prompt is not None:
                seq.prompt_ids, seq.output_ids = list(prompt), list(output)
            else:
                seq.output_ids.extend(output)
            seq.num_computed, seq.status = computed, SeqStatus(status)
            seq.preemptions, seq.cached_tokens = preemptions, cached

    def ask(self, new: list, changed: list, waiting: list, running: list,
            max_num_seqs: int) -> list:
        """[the learner's order as ids, its may_admit answers along that order]."""
        self._update(new, list(changed))
        now = [self.seqs[sid] for sid in running]
        ordered = [seq.seq_id for seq in self.policy.order([self.seqs[s] for s in waiting])]
        admits: list[bool] = []
        seen = set(running)
        for sid in ordered:
            if len(now) >= max_num_seqs:
                break
            seq = self.seqs.get(sid)
            yes = bool(seq is not None and sid not in seen and
                       self.policy.may_admit(seq, list(now), max_num_seqs))
            seen.add(sid)
            admits.append(yes)
            if yes:
                now.append(seq)
        return [ordered, admits]

    def probe(self, prompts: list[int]) -> list:
        """The learner's order of requests with these prompt lengths (as indices), and
        whether ``may_admit`` of the second one, with nothing running, is a plain bool."""
        seqs = [Sequence(f"probe{i}", [7] * n, 4) for i, n in enumerate(prompts)]
        got = self.policy.order(list(seqs))
        index = {id(s): i for i, s in enumerate(seqs)}
        order = [index.get(id(s), -1) for s in got] if type(got) is list else None
        return [order, type(self.policy.may_admit(seqs[1], [], 8)) is bool]
