"""Synthetic training corpus: fictional support tickets for Harbor.

Harbor is the workspace-scoped support assistant from the course project brief. It
answers tickets for **Tidewell**, an invented team collaboration / project tracking
product with workspaces, seats, billing plans, SSO, API keys, exports, integrations,
audit logs and data retention. Every document pairs a ticket with its reference
output: a triage line (category, priority, team) and a drafted reply that cites the
numbered policy governing that category.

Why synthetic and generated in code: the course must train a real model on 2 CPU
cores in minutes, with no downloads and no data files to license or ship. A seeded
``random.Random`` makes the corpus reproducible bit for bit, so the shipped tokenizer
and checkpoints can be rebuilt and checked by anyone.

Why this shape: the text is regular enough for a ~6M-parameter model to learn in a
few minutes (and for a ~10x smaller draft model to agree with it often, which is
what makes speculative decoding worth demonstrating), yet it is not a lookup table:
the model has to map body details to a category, priority and policy, and copy
names, numbers, dates and codes from the ticket into the reply.

Priority is a rule the model can learn: each scenario has a base priority, raised one
level on the Enterprise plan and one level when the customer says the problem blocks
them (capped at ``urgent``).

Consequential actions (refunds, deletions, restores, role and ownership changes,
bypasses) are never claimed as done: the reply flags them for a human specialist to
approve, as the brief requires until explicit permissions exist.

Size with the defaults of :func:`build_corpus` (seed 0) under the shipped 4096-token
byte-level BPE (``tinyserve/tokenizer.py``), as measured by
``python -m tinyserve.tokenizer``: 12,000 train documents, 2.56M tokens (10.5M
characters, 4.09 characters per token); 600 validation documents, 0.13M tokens.
Documents average ~214 tokens (median ~206, longest ~420, so every document fits a
512-token context); about one ticket in eight is a long, multi-paragraph one.
"""

from __future__ import annotations

import random
import string
from dataclasses import dataclass
from typing import Any

from .harbor_world import (
    PRODUCT,
    POLICIES,
    CATEGORY_POLICIES,
    CATEGORY_TEAMS,
    PRIORITIES,
    PLANS,
    CHANNELS,
    FIRST_NAMES,
    WS_LEFT,
    WS_RIGHT,
    fill_slots,
    SCENARIOS,
    GREETINGS,
    OPENERS,
    CLOSERS_CALM,
    CLOSERS_URGENT,
    BACKGROUND,
    REPLY_OPENERS,
    POLICY_LINES,
    STEP_INTROS,
    CLOSINGS,
    SIGNOFFS,
    ALWAYS_KNOWN,
)

__all__ = [
    "PRODUCT",
    "POLICIES",
    "CATEGORY_POLICIES",
    "CATEGORY_TEAMS",
    "PRIORITIES",
    "MARKERS",
    "Ticket",
    "generate_tickets",
    "render",
    "prompt_for",
    "triage_prompt_for",
    "build_corpus",
    "example_prompts",
]

#: The four document markers, in the order they appear. They are special tokens in
#: the tokenizer, so a model sees each as a single id.
MARKERS: tuple[str, str, str, str] = ("<|ticket|>", "<|triage|>", "<|reply|>", "<|end|>")



@dataclass(frozen=True)
class Ticket:
    """One support ticket and its reference output (triage + drafted reply).

    Frozen so tickets can be hashed, deduplicated and shared between the corpus,
    the tests and the serving demos without anyone mutating a fixture.
    """

    ticket_id: str
    workspace: str
    customer: str
    plan: str
    channel: str
    subject: str
    body: str
    category: str
    priority: str
    team: str
    policy_id: str
    reply: str



def _fields(template: str) -> set[str]:
    return {f for _, f, _, _ in string.Formatter().parse(template) if f}


def _fmt(template: str, slots: dict[str, Any], used: set[str] | None = None) -> str:
    """Fill ``template``; record which slots the ticket text mentions in ``used``."""
    if used is not None:
        used |= _fields(template)
    text = template.format(product=PRODUCT, **slots)
    return text[0].upper() + text[1:] if text else text


def _grounded(template: str, known: set[str]) -> bool:
    return _fields(template) <= known


def _pick_grounded(rng: random.Random, alternatives: list[str], known: set[str]) -> str:
    """A random alternative that only uses details the ticket actually states, so the
    reference replies never teach the model to invent an invoice, date or vendor."""
    ok = [a for a in alternatives if _grounded(a, known)]
    if not ok:
        raise ValueError(f"no grounded alternative among {alternatives!r}")
    return rng.choice(ok)


def _make_ticket(rng: random.Random) -> Ticket:
    sc = rng.choice(SCENARIOS)
    plan = rng.choice(sc["plans"])
    name = rng.choice(FIRST_NAMES)
    workspace = f"{rng.choice(WS_LEFT)}-{rng.choice(WS_RIGHT)}"
    ticket_id = f"HB-{rng.randint(100000, 999999)}"
    channel = rng.choice(CHANNELS)
    s = fill_slots(rng, name, workspace, plan, ticket_id)
    used: set[str] = set(ALWAYS_KNOWN)

    blocked = rng.random() < 0.2
    level = PRIORITIES.index(sc["prio"]) + (plan == "Enterprise") + blocked
    priority = PRIORITIES[min(level, len(PRIORITIES) - 1)]

    # ---- body: 1-4 sentences, sometimes with background paragraphs (long tickets)
    subject = _fmt(rng.choice(sc["subjects"]), s, used)
    sentences = [_fmt(rng.choice(OPENERS), s), _fmt(rng.choice(sc["core"]), s, used)]
    if rng.random() < 0.5:
        sentences.append(_fmt(rng.choice(sc["detail"]), s, used))
    closer = rng.choice(CLOSERS_URGENT) if blocked else rng.choice(CLOSERS_CALM)
    sentences.append(closer)
    main = " ".join(x for x in sentences if x)
    paragraphs = [main]
    greeting = rng.choice(GREETINGS)
    if rng.random() < 0.12:  # a long, multi-paragraph ticket
        for _ in range(rng.randint(1, 3)):
            k = rng.randint(2, 4)
            paragraphs.append(" ".join(_fmt(b, s, used) for b in rng.sample(BACKGROUND, k)))
        rng.shuffle(paragraphs)
    if greeting:
        paragraphs.insert(0, greeting)
    if rng.random() < 0.3:
        paragraphs.append(rng.choice(["Thanks,", "Best,", "Cheers,", "Regards,"]) + "\n" + name)
    body = "\n\n".join(paragraphs)

    # ---- reply: only details the ticket states (``used``) may appear in it
    steps = sc["steps"]
    k = rng.randint(sc["min_steps"], len(steps))
    step_texts = []
    for st in steps[:k]:
        alts = (st,) if isinstance(st, str) else st
        chosen = next((a for a in alts if _grounded(a, used)), None)
        if chosen is None:
            raise ValueError(f"no grounded step among {alts!r}")
        step_texts.append(_fmt(chosen, s))
    step_lines = "\n".join(f"{i + 1}. {t}" for i, t in enumerate(step_texts))
    topic = _pick_grounded(rng, sc["topic"], used).format(product=PRODUCT, **s)
    reply = "\n\n".join([
        f"Hi {name},",
        _fmt(rng.choice(REPLY_OPENERS), dict(s, topic=topic)) + " "
        + _fmt(_pick_grounded(rng, sc["restate"], used), s),
        rng.choice(POLICY_LINES).format(pid=sc["pid"], policy=POLICIES[sc["pid"]]),
        rng.choice(STEP_INTROS) + "\n" + step_lines,
        _fmt(rng.choice(CLOSINGS), s),
        rng.choice(SIGNOFFS).format(product=PRODUCT),
    ])
    return Ticket(
        ticket_id=ticket_id,
        workspace=workspace,
        customer=name,
        plan=plan,
        channel=channel,
        subject=subject,
        body=body,
        category=sc["cat"],
        priority=priority,
        team=CATEGORY_TEAMS[sc["cat"]],
        policy_id=sc["pid"],
        reply=reply,
    )


def generate_tickets(n: int, seed: int) -> list[Ticket]:
    """``n`` tickets from one seeded stream: the same (n, seed) always gives the same
    tickets, and a longer run extends a shorter one (ticket i depends only on the seed
    and the tickets before it), so corpora of different sizes stay comparable."""
    rng = random.Random(seed)
    return [_make_ticket(rng) for _ in range(n)]


def _header(t: Ticket) -> str:
    return (
        f"{MARKERS[0]}Ticket: {t.ticket_id} | Workspace: {t.workspace} | Plan: {t.plan} | Channel: {t.channel}\n"
        f"From: {t.customer}\nSubject: {t.subject}\n\n{t.body}\n"
    )


def _triage(t: Ticket) -> str:
    return f"category: {t.category} | priority: {t.priority} | team: {t.team}"


def triage_prompt_for(ticket: Ticket) -> str:
    """The ticket up to and including ``<|triage|>``: what a model sees when asked to
    triage (and then draft) on its own; used to evaluate triage accuracy."""
    return _header(ticket) + MARKERS[1]


def prompt_for(ticket: Ticket) -> str:
    """The ticket plus its triage line, ending right after ``<|reply|>``: the prompt a
    serving demo sends so the model drafts only the reply. A prefix of :func:`render`."""
    return triage_prompt_for(ticket) + _triage(ticket) + "\n" + MARKERS[2]


def render(ticket: Ticket, *, with_output: bool = True) -> str:
    """The training document for ``ticket``. With ``with_output=False`` it is the
    prompt only (identical to :func:`prompt_for`), so callers can hold out the reply."""
    prompt = prompt_for(ticket)
    if not with_output:
        return prompt
    return prompt + ticket.reply + "\n" + MARKERS[3]


def _val_seed(seed: int) -> int:
    # A different derivation from the train stream, so the two never share a sequence.
    return (seed + 1) * 1_000_003 + 7_919


def split_tickets(seed: int = 0, n_train: int = 12_000,
                  n_val: int = 600) -> tuple[list[Ticket], list[Ticket]]:
    """Train and validation tickets. Validation tickets come from a separately
    derived random stream and any ticket whose id or body also occurs in train is
    skipped, so validation loss measures generalisation rather than recall."""
    train_t = generate_tickets(n_train, seed)
    seen_ids = {t.ticket_id for t in train_t}
    seen_bodies = {t.body for t in train_t}
    rng = random.Random(_val_seed(seed))
    val_t: list[Ticket] = []
    while len(val_t) < n_val:
        t = _make_ticket(rng)
        if t.ticket_id in seen_ids or t.body in seen_bodies:
            continue
        seen_ids.add(t.ticket_id)
        seen_bodies.add(t.body)
        val_t.append(t)
    return train_t, val_t


def build_corpus(seed: int = 0, n_train: int = 12_000, n_val: int = 600) -> tuple[list[str], list[str]]:
    """Train and validation documents (see :func:`split_tickets`)."""
    train_t, val_t = split_tickets(seed, n_train, n_val)
    return [render(t) for t in train_t], [render(t) for t in val_t]


def example_prompts(k: int = 3, seed: int = 1234) -> list[str]:
    """``k`` reply prompts (see :func:`prompt_for`) for demos and smoke tests; the
    default seed is not one :func:`build_corpus` uses for training by default."""
    return [prompt_for(t) for t in generate_tickets(k, seed)]


if __name__ == "__main__":
    for t in generate_tickets(3, seed=7):
        print(render(t))
        print()
