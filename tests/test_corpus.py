"""The Harbor ticket corpus: deterministic, held-out validation, well-formed documents,
and reference replies that cite the right policy and only restate what the ticket says."""
from __future__ import annotations

import re

import pytest

from tinyserve.corpus import (
    CATEGORY_POLICIES,
    CATEGORY_TEAMS,
    MARKERS,
    POLICIES,
    PRIORITIES,
    Ticket,
    build_corpus,
    example_prompts,
    generate_tickets,
    prompt_for,
    render,
    triage_prompt_for,
)

N = 1500


@pytest.fixture(scope="module")
def tickets() -> list[Ticket]:
    return generate_tickets(N, seed=0)


@pytest.fixture(scope="module")
def corpus() -> tuple[list[str], list[str]]:
    return build_corpus(seed=0)


def test_same_seed_same_tickets() -> None:
    assert generate_tickets(200, seed=3) == generate_tickets(200, seed=3)


def test_different_seeds_differ() -> None:
    a, b = generate_tickets(200, seed=3), generate_tickets(200, seed=4)
    assert a != b
    assert len({t.body for t in a} & {t.body for t in b}) < 20


def test_longer_run_extends_shorter() -> None:
    assert generate_tickets(300, seed=5)[:100] == generate_tickets(100, seed=5)


def test_ticket_is_frozen(tickets: list[Ticket]) -> None:
    with pytest.raises(AttributeError):
        tickets[0].customer = "Mallory"  # type: ignore[misc]


def test_build_corpus_is_deterministic(corpus: tuple[list[str], list[str]]) -> None:
    train, val = build_corpus(seed=0, n_train=300, n_val=50)
    assert train == corpus[0][:300]
    assert (train, val) == build_corpus(seed=0, n_train=300, n_val=50)


def test_default_sizes(corpus: tuple[list[str], list[str]]) -> None:
    train, val = corpus
    assert len(train) == 12_000 and len(val) == 600


def test_train_and_val_are_disjoint(corpus: tuple[list[str], list[str]]) -> None:
    train, val = corpus
    tid = re.compile(r"Ticket: (HB-\d+)")
    train_ids = {tid.search(d).group(1) for d in train}  # type: ignore[union-attr]
    val_ids = {tid.search(d).group(1) for d in val}  # type: ignore[union-attr]
    assert len(val_ids) == len(val)
    assert not train_ids & val_ids

    def body(doc: str) -> str:
        return doc.split("\n\n", 1)[1].split(MARKERS[1])[0]

    assert not {body(d) for d in train} & {body(d) for d in val}
    assert not set(train) & set(val)


def test_markers_in_order_once_each(corpus: tuple[list[str], list[str]]) -> None:
    train, val = corpus
    for doc in train[:2000] + val:
        assert doc.startswith(MARKERS[0]) and doc.endswith(MARKERS[3])
        positions = [doc.find(m) for m in MARKERS]
        assert positions == sorted(positions) and -1 not in positions
        assert all(doc.count(m) == 1 for m in MARKERS)
        assert "<|pad|>" not in doc and "<|bos|>" not in doc


def test_prompt_is_prefix_of_render(tickets: list[Ticket]) -> None:
    for t in tickets[:300]:
        doc, prompt = render(t), prompt_for(t)
        assert doc.startswith(prompt)
        assert prompt.endswith(MARKERS[2])
        assert render(t, with_output=False) == prompt
        assert prompt.startswith(triage_prompt_for(t))
        assert doc[len(prompt):] == t.reply + "\n" + MARKERS[3]
        assert t.reply not in prompt


def test_triage_fields_are_consistent(tickets: list[Ticket]) -> None:
    for t in tickets:
        assert t.team == CATEGORY_TEAMS[t.category]
        assert t.priority in PRIORITIES
        assert f"category: {t.category} | priority: {t.priority} | team: {t.team}" in prompt_for(t)
        if t.plan == "Enterprise":  # the Enterprise bump means no Enterprise ticket is low
            assert t.priority != "low"


def test_corpus_has_variety(tickets: list[Ticket]) -> None:
    assert 10 <= len({t.category for t in tickets}) <= 15
    assert {t.priority for t in tickets} == set(PRIORITIES)
    assert {t.policy_id for t in tickets} == set(POLICIES)
    assert len({t.subject for t in tickets}) > 300
    assert len({t.body for t in tickets}) > 0.98 * len(tickets)
    long = [t for t in tickets if t.body.count("\n\n") >= 2 and len(t.body) > 500]
    assert 0.03 * len(tickets) < len(long) < 0.3 * len(tickets)


def test_policy_handbook_is_partitioned_by_category() -> None:
    cited = [p for ps in CATEGORY_POLICIES.values() for p in ps]
    assert sorted(cited) == sorted(POLICIES)  # each policy governs exactly one category
    assert set(CATEGORY_POLICIES) == set(CATEGORY_TEAMS)


def test_reply_cites_a_policy_of_its_own_category(tickets: list[Ticket]) -> None:
    for t in tickets:
        cited = re.findall(r"Policy ([A-Z]-\d+)", t.reply)
        assert cited == [t.policy_id]
        assert t.policy_id in POLICIES
        assert t.policy_id in CATEGORY_POLICIES[t.category]
        assert POLICIES[t.policy_id] in t.reply


def test_reply_greets_customer_and_has_steps(tickets: list[Ticket]) -> None:
    for t in tickets:
        assert t.reply.startswith(f"Hi {t.customer},")
        steps = re.findall(r"^(\d)\. ", t.reply, flags=re.M)
        assert 1 <= len(steps) <= 3 and steps == [str(i + 1) for i in range(len(steps))]
        assert "Harbor" in t.reply.splitlines()[-1]


def test_reply_only_uses_details_from_the_ticket(tickets: list[Ticket]) -> None:
    """Ids, codes, dates and names in a reply must be copied from the ticket, never invented."""
    details = re.compile(
        r"INV-\d+|EXP-\d+|HB-\d+|tw_live_\w+|SAML-\d+|SSO-\d+|\$[\d,]+\.\d\d"
        r"|(?:January|February|March|April|May|June|July|August|September|October|November|December) \d+"
    )
    for t in tickets:
        prompt = prompt_for(t)
        for d in details.findall(t.reply):
            assert d in prompt, (d, t.ticket_id)


def test_consequential_actions_are_proposed_not_done(tickets: list[Ticket]) -> None:
    done = re.compile(r"\bI(?:'ve| have) (?:refunded|deleted|restored|changed|transferred|removed|reset)\b")
    for t in tickets:
        assert not done.search(t.reply)
        if t.policy_id in {"B-2", "R-1", "D-1", "D-2", "O-1", "O-2", "I-2"}:
            assert "to approve" in t.reply


def test_example_prompts() -> None:
    prompts = example_prompts()
    assert len(prompts) == 3 and prompts == example_prompts()
    assert all(p.startswith(MARKERS[0]) and p.endswith(MARKERS[2]) for p in prompts)
    assert example_prompts(k=5, seed=9)[:2] == example_prompts(k=2, seed=9)
