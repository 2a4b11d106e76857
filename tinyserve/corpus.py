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

PRODUCT = "Tidewell"

#: The four document markers, in the order they appear. They are special tokens in
#: the tokenizer, so a model sees each as a single id.
MARKERS: tuple[str, str, str, str] = ("<|ticket|>", "<|triage|>", "<|reply|>", "<|end|>")

#: The fictional policy handbook Harbor cites: id -> one-line policy. The id prefix
#: names the category it governs (see :data:`CATEGORY_POLICIES`).
POLICIES: dict[str, str] = {
    "B-1": "invoices are issued on the renewal date and can be reissued with corrected billing details on request.",
    "B-2": "duplicate or erroneous charges are refunded in full after a billing specialist confirms them.",
    "B-3": "failed payments are retried for 7 days before a workspace moves to read-only.",
    "R-1": "annual plans can be refunded in full within 14 days of renewal.",
    "R-2": "unused seats are credited to the next invoice rather than refunded in cash.",
    "S-1": "seats can be added at any time and are prorated on the next invoice.",
    "S-2": "seat reductions take effect at the next renewal and only for seats that are not in use.",
    "P-1": "upgrades take effect immediately and are prorated for the rest of the term.",
    "P-2": "downgrades take effect at the end of the current billing period.",
    "I-1": "SSO is available on Business and Enterprise plans and is configured by workspace admins.",
    "I-2": "enforced SSO requires a break-glass admin; temporary bypasses are approved by an identity specialist.",
    "A-1": "password resets are self-service and support never sets a password for a user.",
    "A-2": "two-factor resets require identity confirmation from a workspace admin.",
    "K-1": "each API key is limited to 600 requests per minute and excess calls return error 429.",
    "K-2": "an exposed API key must be revoked at once and replaced by a workspace admin.",
    "K-3": "API errors of 500 and above are investigated by the platform team within one business day.",
    "E-1": "workspace exports are prepared for admins in CSV or JSON and download links last 7 days.",
    "E-2": "exports of private projects need the project owner's consent or an admin request.",
    "N-1": "integrations belong to the connecting user and must be reconnected when that user leaves.",
    "N-2": "outages inside a third-party service are tracked on our status page and cannot be fixed by support.",
    "U-1": "audit logs are available on Business and Enterprise plans and cover the last 365 days.",
    "U-2": "suspected account compromise is reviewed by Trust & Safety, who may end sessions after review.",
    "D-1": "deleted projects can be restored within 30 days once a data specialist approves.",
    "D-2": "workspace deletion must be requested by the owner and becomes permanent after 30 days.",
    "D-3": "retention can be set between 30 and 365 days on Business and Enterprise plans.",
    "O-1": "role changes are made by a workspace owner or admin; support can only propose them.",
    "O-2": "ownership transfers need written confirmation from the current owner or a verified company officer.",
    "T-1": "incidents are posted on status.tidewell.app and updated every 30 minutes until resolved.",
    "T-2": "performance reports are investigated with a request id or HAR file from the affected user.",
}

#: Which policies govern which category (a reply may only cite one of its own).
CATEGORY_POLICIES: dict[str, tuple[str, ...]] = {
    "billing": ("B-1", "B-2", "B-3"),
    "refund": ("R-1", "R-2"),
    "seats": ("S-1", "S-2"),
    "plan": ("P-1", "P-2"),
    "sso": ("I-1", "I-2"),
    "access": ("A-1", "A-2"),
    "api": ("K-1", "K-2", "K-3"),
    "export": ("E-1", "E-2"),
    "integrations": ("N-1", "N-2"),
    "security": ("U-1", "U-2"),
    "data": ("D-1", "D-2", "D-3"),
    "roles": ("O-1", "O-2"),
    "outage": ("T-1", "T-2"),
}

#: The team that owns each category.
CATEGORY_TEAMS: dict[str, str] = {
    "billing": "Billing",
    "refund": "Billing",
    "seats": "Accounts",
    "plan": "Accounts",
    "sso": "Identity",
    "access": "Identity",
    "api": "Platform",
    "export": "Data",
    "integrations": "Integrations",
    "security": "Trust & Safety",
    "data": "Data",
    "roles": "Accounts",
    "outage": "Reliability",
}

PRIORITIES: tuple[str, ...] = ("low", "normal", "high", "urgent")
PLANS: tuple[str, ...] = ("Free", "Starter", "Team", "Business", "Enterprise")
CHANNELS: tuple[str, ...] = ("email", "chat", "web form", "in-app")


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


# --------------------------------------------------------------------------- slots

_FIRST_NAMES = (
    "Dana", "Priya", "Marcus", "Elena", "Tomás", "Aisha", "Kenji", "Fatima", "Lukas",
    "Grace", "Omar", "Ingrid", "Mateo", "Chloé", "Ravi", "Sofia", "Daniel", "Mei",
    "Jonas", "Amara", "Noah", "Zoë", "Hannah", "Samuel", "Leila", "Björn", "Yuki",
    "Carlos", "Nadia", "Oliver", "Anaïs", "Tariq", "Emma", "Felix", "Rosa", "Arjun",
    "Claire", "Diego", "Sara", "Viktor", "Maya", "Kwame", "Lena", "Hugo", "Imani",
    "Pavel", "Julia", "Théo", "Nora", "Ahmed", "Beatriz", "Ethan", "Søren", "Lucia",
    "Kofi", "Isla", "Mikhail", "Ana", "Rahul", "Freya",
)
_WS_LEFT = (
    "northwind", "bluefin", "cedar", "harbor", "lumen", "quartz", "redwood", "silver",
    "tandem", "orbit", "maple", "summit", "pioneer", "atlas", "beacon", "copper",
    "delta", "ember", "falcon", "granite", "helix", "ivory", "juniper", "kestrel",
)
_WS_RIGHT = (
    "ops", "labs", "studio", "design", "eng", "marketing", "support", "finance",
    "hq", "team", "research", "growth", "legal", "data", "product", "sales",
)
_MONTHS = (
    "January", "February", "March", "April", "May", "June", "July", "August",
    "September", "October", "November", "December",
)
_IDPS = ("Okta", "Azure AD", "Google Workspace", "OneLogin", "JumpCloud", "Ping Identity")
_SSO_ERRORS = ("SAML-401", "SAML-403", "SAML-409", "SSO-112", "SSO-207", "SAML-500")
_INTEGRATIONS = ("Slack", "GitHub", "Jira", "Google Drive", "Zapier", "Salesforce",
                 "Microsoft Teams", "GitLab", "Figma", "HubSpot")
_PROJECTS = ("Q3 Launch", "Website Redesign", "Onboarding v2", "Mobile App", "Hiring Plan",
             "Roadmap 2025", "Vendor Review", "Customer Portal", "Data Migration",
             "Brand Refresh", "Sprint Board", "Compliance Audit", "Partner Program")
_COUNTRIES = ("Brazil", "Romania", "Vietnam", "Nigeria", "Russia", "Indonesia", "Peru",
              "Ukraine", "Thailand", "Kazakhstan")
_ENDPOINTS = ("/v2/tasks", "/v2/projects", "/v2/comments", "/v2/members", "/v2/webhooks",
              "/v2/attachments", "/v2/search")
_HTTP_ERRORS = ("500", "502", "503", "504")
_PAGES = ("boards", "the task list", "the timeline view", "search", "the inbox",
          "the calendar view", "project dashboards")
_FORMATS = ("CSV", "JSON")
_ROLES = ("Admin", "Member", "Guest", "Billing Admin")
_RETENTION_DAYS = ("30", "60", "90", "180", "365")


def _slots(rng: random.Random, name: str, workspace: str, plan: str, ticket_id: str) -> dict[str, Any]:
    """Every slot a template might use, drawn once per ticket (cheap, and it keeps the
    random stream independent of which template happens to be chosen)."""
    others = [n for n in _FIRST_NAMES if n != name]
    other, other2 = rng.sample(others, 2)
    domain = workspace.replace("-", "") + ".com"
    month = rng.randrange(12)
    day = rng.randint(1, 28)
    month2 = (month + rng.randint(0, 2)) % 12
    day2 = rng.randint(1, 28)
    seats = rng.choice((5, 8, 10, 12, 15, 20, 25, 30, 40, 50, 60, 75, 100, 120, 150, 200))
    delta = rng.choice((2, 3, 5, 5, 10, 10, 15, 20, 25))
    per_seat = rng.choice((8, 12, 15, 19, 24))
    amount = seats * per_seat * rng.choice((1, 1, 12))
    plan_i = PLANS.index(plan)
    key_chars = "abcdefghjkmnpqrstuvwxyz23456789"
    return {
        "name": name,
        "workspace": workspace,
        "tid": ticket_id,
        "plan": plan,
        "plan_up": PLANS[min(plan_i + 1, len(PLANS) - 1)],
        "plan_down": PLANS[max(plan_i - 1, 0)],
        "other": other,
        "other2": other2,
        "other_email": f"{other.lower()}@{domain}",
        "invoice": f"INV-{rng.randint(10000, 99999)}",
        "amount": f"${amount:,}.00",
        "card": f"{rng.randint(0, 9999):04d}",
        "date": f"{_MONTHS[month]} {day}",
        "date2": f"{_MONTHS[month2]} {day2}",
        "seats": seats,
        "seats_up": seats + delta,
        "seats_down": max(seats - delta, 1),
        "delta": delta,
        "idp": rng.choice(_IDPS),
        "sso_error": rng.choice(_SSO_ERRORS),
        "integration": rng.choice(_INTEGRATIONS),
        "project": rng.choice(_PROJECTS),
        "country": rng.choice(_COUNTRIES),
        "endpoint": rng.choice(_ENDPOINTS),
        "http_error": rng.choice(_HTTP_ERRORS),
        "page": rng.choice(_PAGES),
        "format": rng.choice(_FORMATS),
        "export_id": f"EXP-{rng.randint(1000, 9999)}",
        "pct": rng.choice((12, 25, 40, 50, 63, 75, 88, 99)),
        "key": "tw_live_" + "".join(rng.choice(key_chars) for _ in range(6)),
        "rate": rng.choice((300, 450, 600, 650, 800, 1000, 1200)),
        "role": rng.choice(_ROLES),
        "days": rng.choice(_RETENTION_DAYS),
        "secs": rng.choice((8, 10, 12, 15, 20, 30, 45)),
        "time": f"{rng.randint(7, 18)}:{rng.choice(('00', '15', '30', '45'))}",
        "count": rng.choice((3, 5, 12, 40, 120, 300, 2000)),
        "year": rng.choice((2019, 2020, 2021, 2022, 2023)),
    }


# ----------------------------------------------------------------------- scenarios
# Each scenario: category, policy, base priority, plans it can occur on, and the text
# pieces. Every list is a set of alternatives; ``steps`` is an ordered list of which
# the reply keeps the first k (k random, at least ``min_steps``). A step may be a tuple
# of phrasings in order of preference: the first whose slots the ticket states is used,
# and topic/restate phrasings are drawn only among those the ticket grounds.

_S: list[dict[str, Any]] = [
    # ---------------------------------------------------------------- billing
    dict(
        cat="billing", pid="B-1", prio="low", plans=PLANS[1:],
        subjects=["Invoice {invoice} needs correcting", "Wrong details on invoice {invoice}",
                  "Can you reissue invoice {invoice}?"],
        core=["Invoice {invoice} from {date} lists our old company address.",
              "Our finance team needs invoice {invoice} reissued with our VAT number on it.",
              "Invoice {invoice} is addressed to {other} but should go to our accounts team.",
              "The company name on invoice {invoice} ({amount}) is misspelled."],
        detail=["Our auditors need the corrected copy by {date2}.",
                "Please send the new copy to {other_email}.",
                "Nothing else on the invoice is wrong."],
        topic=["invoice {invoice}", "the details on invoice {invoice}"],
        restate=["I understand invoice {invoice} needs corrected billing details before your finance team can file it.",
                 "You need invoice {invoice} reissued with the right company details."],
        steps=["I've asked the billing team to reissue {invoice} with the corrected details.",
               "The new copy will appear under Settings > Billing > Invoices within one business day.",
               "Make sure the billing details there are current so the next invoice is right too."],
        min_steps=1,
    ),
    dict(
        cat="billing", pid="B-2", prio="high", plans=PLANS[1:],
        subjects=["Charged twice this month", "Duplicate charge on invoice {invoice}",
                  "Double payment for {workspace}"],
        core=["We were charged twice for invoice {invoice} on {date}.",
              "Our card ending {card} shows two charges of {amount} on {date}.",
              "The {amount} charge for invoice {invoice} went through twice.",
              "I see a second payment of {amount} on {date} that doesn't match any invoice."],
        detail=["Only one invoice appears in the billing page.",
                "Our bank confirmed both charges settled.",
                "Can you refund the extra one?"],
        topic=["the duplicate charge", "the double charge on invoice {invoice}"],
        restate=["I understand the {amount} charge for invoice {invoice} was taken twice on {date}.",
                 "You were charged twice for invoice {invoice} ({amount}) on {date}.",
                 "I understand you were charged twice for the same payment."],
        steps=[("I've flagged a refund of the duplicate {amount} charge for a billing specialist to approve.",
                "I've flagged a refund of the duplicate charge for a billing specialist to approve."),
               "Once approved, the refund usually lands in 5-10 business days.",
               "You don't need to do anything else; I'll update ticket {tid} when it's confirmed."],
        min_steps=1,
    ),
    dict(
        cat="billing", pid="B-3", prio="high", plans=PLANS[1:],
        subjects=["Payment failed", "Card declined for {workspace}", "Workspace going read-only?"],
        core=["Our card ending {card} was declined and we got an email saying {workspace} will go read-only.",
              "The renewal payment of {amount} failed on {date}.",
              "We got a payment failed notice for invoice {invoice}.",
              "Billing says our payment didn't go through on {date} and I'm not sure why."],
        detail=["We have a new card ready.", "Our bank says nothing was blocked on their side.",
                "{other} in finance changed banks last month."],
        topic=["the failed payment", "the declined card"],
        restate=["I understand the payment for {workspace} failed and you want to avoid the workspace going read-only.",
                 "The renewal charge for {workspace} was declined on {date}."],
        steps=["Update the card under Settings > Billing > Payment method.",
               "The next retry runs automatically within 24 hours of the update.",
               "Your workspace stays fully usable during the 7-day retry window."],
        min_steps=2,
    ),
    # ---------------------------------------------------------------- refund
    dict(
        cat="refund", pid="R-1", prio="normal", plans=PLANS[1:],
        subjects=["Refund for annual renewal", "We didn't mean to renew",
                  "Refund request for {workspace}"],
        core=["We didn't mean to renew {workspace} for another year and the renewal on {date} charged {amount}.",
              "Our annual plan renewed on {date} for {amount} but we are moving to another tool.",
              "Please refund the annual renewal of {amount} from {date}.",
              "The team forgot to cancel before the renewal on {date} and we were billed {amount}."],
        detail=["Nobody has used the workspace since.", "We already exported our data.",
                "{other} approved this on our side."],
        topic=["the annual renewal refund", "your renewal on {date}"],
        restate=["I understand {workspace} renewed on {date} for {amount} and you'd like that refunded.",
                 "You'd like a refund of the {amount} annual renewal charged on {date}."],
        steps=["I've flagged a full refund of {amount} for a billing specialist to approve.",
               "Once approved, {workspace} moves to the Free plan and keeps its data.",
               "You'll get a confirmation email when the refund is issued."],
        min_steps=1,
    ),
    dict(
        cat="refund", pid="R-2", prio="low", plans=PLANS[2:],
        subjects=["Money back for unused seats", "Refund for {delta} seats",
                  "Credit for removed seats"],
        core=["We removed {delta} seats last week and want money back for them.",
              "We paid for {seats} seats but only use {seats_down}; can we get a refund for the rest?",
              "Can we get a refund for the {delta} seats we never used since {date}?"],
        detail=["Those people left the company.", "We won't need them again this year.",
                "Our invoice was {invoice}."],
        topic=["the unused seats", "a refund for unused seats"],
        restate=["I understand you're paying for {delta} seats you no longer use and want money back.",
                 "You'd like to recover the cost of {delta} unused seats.",
                 "I understand you're paying for seats you no longer use and want money back."],
        steps=[("I've asked billing to calculate a credit for the {delta} unused seats for a specialist to approve.",
                "I've asked billing to calculate a credit for the unused seats for a specialist to approve."),
               "The approved credit will show on your next invoice.",
               "Remove the seats under Settings > Members > Seats so they aren't billed again."],
        min_steps=1,
    ),
    # ---------------------------------------------------------------- seats
    dict(
        cat="seats", pid="S-1", prio="normal", plans=PLANS[1:],
        subjects=["Need more seats", "Adding {delta} seats", "Seat limit reached"],
        core=["We need to go from {seats} to {seats_up} seats.",
              "Our team is growing and we need {delta} more seats by {date}.",
              "We hit our seat limit of {seats} and can't invite {other}.",
              "How do we add {delta} seats to {workspace}?"],
        detail=["New hires start on {date2}.", "Please tell me how it affects the invoice.",
                "{other} from HR is waiting on this."],
        topic=["adding seats", "your seat limit"],
        restate=["I understand {workspace} needs to grow from {seats} to {seats_up} seats.",
                 "You need {delta} more seats on {workspace}.",
                 "I understand {workspace} needs more seats."],
        steps=["An admin can add seats under Settings > Members > Seats.",
               "The extra seats are prorated on your next invoice.",
               "Invites sent after that will go through right away."],
        min_steps=1,
    ),
    dict(
        cat="seats", pid="S-2", prio="low", plans=PLANS[1:],
        subjects=["Reduce our seats", "Fewer seats please", "Lower seat count for {workspace}"],
        core=["We have {seats} seats but only {seats_down} people still use {product}.",
              "Please reduce our seats from {seats} to {seats_down}.",
              "We want to drop {delta} seats before our next renewal."],
        detail=["Some of the team moved to another department.", "Our renewal is on {date}.",
                "The extra seats are empty."],
        topic=["reducing seats", "your seat count"],
        restate=["I understand you want {workspace} to go from {seats} to {seats_down} seats.",
                 "You'd like to drop {delta} seats you no longer need."],
        steps=["Deactivate the members you no longer need under Settings > Members.",
               ("I've flagged a seat reduction to {seats_down} for an account specialist to approve at renewal.",
                "I've flagged the seat reduction for an account specialist to approve at renewal."),
               "Until then the current seat count stays on your plan."],
        min_steps=2,
    ),
    # ---------------------------------------------------------------- plan
    dict(
        cat="plan", pid="P-1", prio="normal", plans=PLANS[:4],
        subjects=["Upgrade to {plan_up}", "Moving to the {plan_up} plan", "How to upgrade?"],
        core=["We want to upgrade from {plan} to {plan_up}.",
              "How much would it cost to move {workspace} to {plan_up} this month?",
              "We need {plan_up} features and want to switch today.",
              "Can we upgrade to {plan_up} in the middle of our term?"],
        detail=["We mostly need more automation runs.", "{other} needs it for a client demo on {date}.",
                "Please make sure nothing is lost."],
        topic=["upgrading to {plan_up}", "the move to {plan_up}"],
        restate=["I understand you'd like to move {workspace} from {plan} to {plan_up}.",
                 "You want {plan_up} features on {workspace} right away."],
        steps=["You can upgrade under Settings > Plan; the change is immediate.",
               "The price difference is prorated on your next invoice.",
               "All your projects and settings carry over unchanged."],
        min_steps=1,
    ),
    dict(
        cat="plan", pid="P-2", prio="low", plans=PLANS[2:],
        subjects=["Downgrade to {plan_down}", "Switch us to {plan_down}", "Cheaper plan"],
        core=["Please downgrade us from {plan} to {plan_down}.",
              "We don't use the {plan} features anymore and want {plan_down}.",
              "Budget cuts mean we have to move {workspace} to {plan_down} by {date}."],
        detail=["We understand some features will go away.", "Our finance lead {other} asked for this.",
                "We still want to keep all our projects."],
        topic=["downgrading to {plan_down}", "the move to {plan_down}"],
        restate=["I understand you want to move {workspace} from {plan} to {plan_down}.",
                 "You'd like {workspace} on the {plan_down} plan."],
        steps=["I've flagged the downgrade to {plan_down} for an account specialist to approve.",
               "{plan} features stay available until the end of the current period.",
               "Your projects are kept; only plan features change."],
        min_steps=1,
    ),
    # ---------------------------------------------------------------- sso
    dict(
        cat="sso", pid="I-1", prio="high", plans=PLANS[3:],
        subjects=["SSO error {sso_error}", "SAML login failing with {idp}", "Can't set up SSO"],
        core=["SAML login fails with error {sso_error} from {idp}.",
              "We are setting up SSO with {idp} and every test login returns {sso_error}.",
              "Since {date} our {idp} login shows error {sso_error}.",
              "Users get {sso_error} when they sign in through {idp}."],
        detail=["Password login still works for admins.", "{other} rotated the certificate last week.",
                "We followed the setup guide twice."],
        topic=["the SSO error", "the {idp} login problem"],
        restate=["I understand SAML sign-in through {idp} is failing with {sso_error}.",
                 "Your {idp} sign-in returns {sso_error}."],
        steps=["Check that the ACS URL in {idp} matches the one under Settings > Security > SSO.",
               "Download the current certificate from {idp} and upload it again.",
               "If {sso_error} persists, reply with a SAML trace and I'll escalate to the identity team."],
        min_steps=2,
    ),
    dict(
        cat="sso", pid="I-2", prio="urgent", plans=PLANS[3:],
        subjects=["Locked out after enforcing SSO", "Nobody can log in", "SSO lockout for {workspace}"],
        core=["We enforced SSO and now nobody can log in because the {idp} certificate expired.",
              "After turning on SSO enforcement, all of {workspace} is locked out.",
              "Our {idp} tenant is down and SSO is enforced, so no one can sign in."],
        detail=["We have no admin with a password login.", "{count} people are blocked.",
                "We tried the recovery link without luck."],
        topic=["the SSO lockout", "being locked out of {workspace}"],
        restate=["I understand SSO is enforced on {workspace} and no one can sign in through {idp}.",
                 "Your whole workspace is locked out behind {idp}.",
                 "I understand SSO is enforced on {workspace} and nobody can sign in."],
        steps=["I've flagged a temporary SSO bypass for {workspace} for an identity specialist to approve.",
               ("Once approved, your break-glass admin can sign in and fix {idp}.",
                "Once approved, your break-glass admin can sign in and fix the identity provider settings."),
               "Then turn enforcement back on under Settings > Security > SSO."],
        min_steps=2,
    ),
    # ---------------------------------------------------------------- access
    dict(
        cat="access", pid="A-1", prio="normal", plans=PLANS,
        subjects=["Password reset not arriving", "{other} can't log in", "Reset email missing"],
        core=["{other} can't log in and the password reset email never arrives.",
              "I requested a password reset three times today and got nothing.",
              "Can you set a new password for {other_email}?",
              "{other} is locked out after too many password attempts."],
        detail=["We checked spam already.", "It worked for {other2} yesterday.",
                "They need access before {date}."],
        topic=["the password reset", "getting back into {workspace}"],
        restate=["I understand the password reset email for {workspace} isn't arriving.",
                 "You need a password reset to get back into {workspace}."],
        steps=["Check spam for mail from no-reply@tidewell.app and allow that address.",
               "Reset links expire after one hour, so request a fresh one from the login page.",
               "If nothing arrives in 15 minutes, reply here and I'll check the mail logs."],
        min_steps=2,
    ),
    dict(
        cat="access", pid="A-2", prio="high", plans=PLANS,
        subjects=["Lost my phone, can't pass 2FA", "Two-factor reset needed", "2FA locked out"],
        core=["I lost my phone and can't get past two-factor.",
              "My authenticator app was wiped and I can't sign in to {workspace}.",
              "{other} got a new phone and is stuck at the two-factor step.",
              "Our backup codes are gone and two-factor blocks me from {workspace}."],
        detail=["I still know my password.", "I need to approve invoices by {date}.",
                "{other2} is our admin and can vouch for me."],
        topic=["the two-factor reset", "getting past two-factor"],
        restate=["I understand you're stuck at the two-factor step for {workspace}.",
                 "You need a two-factor reset to get back into {workspace}."],
        steps=["Ask a workspace admin to confirm your identity from Settings > Members.",
               "I've flagged the two-factor reset for an identity specialist to approve once that confirmation arrives.",
               "After the reset, set up two-factor again and save new backup codes."],
        min_steps=2,
    ),
    # ---------------------------------------------------------------- api
    dict(
        cat="api", pid="K-1", prio="normal", plans=PLANS[2:],
        subjects=["Getting 429 errors", "API rate limit", "Too many requests from our sync job"],
        core=["Our integration started getting 429 errors at around {rate} requests per minute.",
              "The nightly sync hits error 429 after about {count} calls.",
              "Can you raise our API rate limit? We need {rate} requests per minute.",
              "Calls to {endpoint} return 429 since {date}."],
        detail=["It only happens during the nightly sync.", "We use a single key for everything.",
                "{other} wrote the script and is out this week."],
        topic=["the 429 errors", "your API rate limit"],
        restate=["I understand your calls to the API are hitting 429 errors at about {rate} requests per minute.",
                 "Your API traffic is being rate limited with error 429."],
        steps=["Add retries with backoff and honor the Retry-After header.",
               "Spread calls across the minute; batch endpoints count as one request.",
               "If you still need more, an Enterprise plan can raise the limit."],
        min_steps=1,
    ),
    dict(
        cat="api", pid="K-2", prio="urgent", plans=PLANS[2:],
        subjects=["Leaked API key", "API key exposed on GitHub", "Key {key} is public"],
        core=["We accidentally pushed API key {key} to a public repo on {date}.",
              "Our key {key} was pasted into a public chat by mistake.",
              "A contractor shared key {key} in a public gist."],
        detail=["We don't know if anyone used it.", "{other} noticed it an hour ago.",
                "The key has admin scope."],
        topic=["the exposed key {key}", "the leaked API key"],
        restate=["I understand API key {key} was exposed publicly on {date}.",
                 "Key {key} for {workspace} is public and needs to be stopped."],
        steps=["Revoke {key} under Settings > API keys right away.",
               "Create a new key and update your deployments.",
               ("Review the audit log for calls made with {key} since {date}.",
                "Review the audit log for calls made with {key}.")],
        min_steps=2,
    ),
    dict(
        cat="api", pid="K-3", prio="high", plans=PLANS[2:],
        subjects=["API returns {http_error}", "Server errors on {endpoint}", "API down for us?"],
        core=["We get error {http_error} on {endpoint} since {date}.",
              "About one in ten calls to {endpoint} fail with {http_error}.",
              "Our deploy pipeline breaks because {endpoint} keeps returning {http_error}."],
        detail=["Nothing changed in our code.", "The status page shows everything green.",
                "Retrying sometimes works."],
        topic=["the {http_error} errors", "the errors on {endpoint}"],
        restate=["I understand {endpoint} has been returning {http_error} since {date}.",
                 "Calls to {endpoint} are failing with {http_error}."],
        steps=["I've escalated this to the platform team under ticket {tid}.",
               "Send a request id from the response headers so they can trace a failing call.",
               "Meanwhile, retry failed calls with backoff."],
        min_steps=1,
    ),
    # ---------------------------------------------------------------- export
    dict(
        cat="export", pid="E-1", prio="normal", plans=PLANS,
        subjects=["Export stuck", "Export {export_id} not finishing", "Where is my export?"],
        core=["Export {export_id} has been stuck at {pct}% since {date}.",
              "I started a {format} export of {workspace} yesterday and never got the link.",
              "The download link for export {export_id} says it expired.",
              "Our {format} export of {project} stops at {pct}%."],
        detail=["We need it for a board meeting on {date2}.", "It's about {count} projects.",
                "I tried twice."],
        topic=["export {export_id}", "your {format} export"],
        restate=["I understand export {export_id} for {workspace} hasn't completed.",
                 "Your {format} export of {workspace} isn't reaching you."],
        steps=[("I've asked the data team to restart export {export_id}.",
                "I've asked the data team to restart your export."),
               "You'll get an email with a download link when it's ready; the link lasts 7 days.",
               "Large workspaces can take a few hours, so please don't start a second export."],
        min_steps=1,
    ),
    dict(
        cat="export", pid="E-2", prio="low", plans=PLANS,
        subjects=["Export someone else's project", "Need data from {other}'s private project",
                  "Export private project {project}"],
        core=["{other} left and we need an export of their private project {project}.",
              "Can I export {project}? It's private and owned by {other}.",
              "Legal asked for a copy of {other}'s private project {project}."],
        detail=["{other} is on leave until {date}.", "We need it in {format}.",
                "I am not an admin myself."],
        topic=["exporting {project}", "the private project export"],
        restate=["I understand you need an export of {project}, a private project owned by {other}.",
                 "You'd like a copy of {other}'s private project {project}."],
        steps=["Ask {other} to share {project} with you, or have a workspace admin request the export.",
               "Admins can export it under Settings > Export > Projects.",
               ("The {format} file link will last 7 days.", "The file link will last 7 days.")],
        min_steps=1,
    ),
    # ---------------------------------------------------------------- integrations
    dict(
        cat="integrations", pid="N-1", prio="normal", plans=PLANS[1:],
        subjects=["{integration} stopped syncing", "{integration} integration broken",
                  "No updates from {integration}"],
        core=["{integration} stopped syncing after {other} left the company.",
              "Since {date} nothing from {integration} shows up in {project}.",
              "Our {integration} connection shows as disconnected.",
              "Tasks no longer update from {integration} since {other} was removed."],
        detail=["{other} set it up originally.", "We have {count} tasks linked to it.",
                "Reconnecting asks for a login we don't have."],
        topic=["the {integration} sync", "the {integration} integration"],
        restate=["I understand {integration} stopped syncing with {workspace}.",
                 "Your {integration} connection stopped updating {project}."],
        steps=["Have a current admin reconnect {integration} under Settings > Integrations.",
               "Past items backfill within an hour of reconnecting.",
               "Use a shared service account so this doesn't happen again."],
        min_steps=1,
    ),
    dict(
        cat="integrations", pid="N-2", prio="low", plans=PLANS[1:],
        subjects=["{integration} notifications delayed", "{integration} errors",
                  "Slow updates from {integration}"],
        core=["{integration} notifications arrive hours late since {date}.",
              "The {integration} app shows an error when we link tasks.",
              "Messages to {integration} fail now and then."],
        detail=["{integration} has an incident on their own status page.", "It worked fine last week.",
                "Only some of us see it."],
        topic=["the {integration} delays", "the {integration} errors"],
        restate=["I understand {integration} updates are delayed or failing for {workspace}.",
                 "Your {integration} notifications are late."],
        steps=["Check the {integration} status page for an open incident.",
               "Once their incident is resolved, queued updates are delivered automatically.",
               "If it continues after that, reply here with an example task link."],
        min_steps=1,
    ),
    # ---------------------------------------------------------------- security
    dict(
        cat="security", pid="U-1", prio="normal", plans=PLANS[3:],
        subjects=["Audit log request", "Need audit logs for {project}", "Who changed {project}?"],
        core=["We need audit logs for {project} between {date} and {date2}.",
              "Someone deleted tasks in {project} on {date} and we need to know who.",
              "Our compliance team asked for an audit log export for {workspace}.",
              "Can you tell us who changed permissions on {project}?"],
        detail=["This is for our yearly audit.", "{other} thinks it was an automation.",
                "We need it by {date2}."],
        topic=["the audit log request", "the changes in {project}"],
        restate=["I understand you need audit log records for {project} around {date}.",
                 "You need to see who changed {project}.",
                 "I understand you need audit log records for {workspace}."],
        steps=[("Open Settings > Security > Audit log and filter by {project} and date.",
                "Open Settings > Security > Audit log and filter by project and date."),
               "Use the export button there for a CSV copy.",
               "For events older than 365 days, reply here and I'll ask Trust & Safety."],
        min_steps=1,
    ),
    dict(
        cat="security", pid="U-2", prio="urgent", plans=PLANS,
        subjects=["Suspicious login", "Logins from {country}", "Was my account hacked?"],
        core=["I see logins from {country} on {date} that weren't me.",
              "{other} got a login alert from {country} but was at home.",
              "Someone changed my email settings on {date} and it wasn't me.",
              "There are sessions from {country} on my account."],
        detail=["I use the same password elsewhere.", "Nothing looks deleted yet.",
                "I'm an admin in {workspace}."],
        topic=["the suspicious login", "the logins from {country}"],
        restate=["I understand there was account activity on {date} that you don't recognize.",
                 "You see sign-ins from {country} that weren't you."],
        steps=["Reset your password and sign out of all sessions under Profile > Security now.",
               "I've flagged a session review of your account for a Trust & Safety specialist to approve.",
               "Turn on two-factor if it isn't on already."],
        min_steps=2,
    ),
    # ---------------------------------------------------------------- data
    dict(
        cat="data", pid="D-1", prio="high", plans=PLANS,
        subjects=["Deleted project by mistake", "Restore {project}", "Recover deleted project"],
        core=["We deleted project {project} by mistake on {date}.",
              "{other} deleted {project} while cleaning up and we need it back.",
              "Can you restore {project}? It was deleted on {date}.",
              "{count} tasks disappeared when {project} was deleted."],
        detail=["It had our whole launch plan.", "Nobody noticed until today.",
                "We need the comments too."],
        topic=["restoring {project}", "the deleted project {project}"],
        restate=["I understand {project} was deleted on {date} and you need it back.",
                 "You'd like {project} restored after it was deleted by mistake."],
        steps=["I've flagged a restore of {project} for a data specialist to approve.",
               "Restores bring back tasks and comments; integrations need reconnecting.",
               "I'll update ticket {tid} when the restore is done."],
        min_steps=1,
    ),
    dict(
        cat="data", pid="D-2", prio="normal", plans=PLANS,
        subjects=["Delete our workspace", "Close {workspace} and remove data", "Account deletion"],
        core=["Please delete our workspace {workspace} and all data.",
              "We are shutting down and need {workspace} removed.",
              "We'd like every record in {workspace} deleted by {date}."],
        detail=["We have already exported what we need.", "I am the workspace owner.",
                "{other} in legal asked for written confirmation."],
        topic=["deleting {workspace}", "the deletion request"],
        restate=["I understand you want {workspace} and its data deleted.",
                 "You'd like {workspace} closed and removed."],
        steps=["I've flagged the deletion request for a data specialist to approve after confirming you are the owner.",
               "Export anything you need first from Settings > Export.",
               "After deletion there is a 30-day window before it becomes permanent."],
        min_steps=1,
    ),
    dict(
        cat="data", pid="D-3", prio="low", plans=PLANS[3:],
        subjects=["Retention settings", "Keep data for {days} days", "Change data retention"],
        core=["Can we set retention to {days} days for {workspace}?",
              "Our policy says chat data must be deleted after {days} days.",
              "How do we change how long comments are kept?"],
        detail=["It's for a new client contract.", "{other} from legal needs this by {date}.",
                "We are on the {plan} plan."],
        topic=["retention settings", "keeping data for {days} days"],
        restate=["I understand you want {workspace} to keep data for {days} days.",
                 "You need a {days}-day retention period.",
                 "I understand you want to change how long {workspace} keeps data."],
        steps=["An admin can set retention under Settings > Security > Data retention.",
               "Items older than the new period are removed within 24 hours of saving.",
               "Export anything you must keep before you change it."],
        min_steps=1,
    ),
    # ---------------------------------------------------------------- roles
    dict(
        cat="roles", pid="O-1", prio="normal", plans=PLANS,
        subjects=["Make {other} an {role}", "Role change request", "Change {other}'s role"],
        core=["Please make {other} an {role} in {workspace}.",
              "Our only admin is away; can you change {other} to {role}?",
              "{other} needs the {role} role to manage projects.",
              "Can support switch {other_email} to {role}?"],
        detail=["They start managing the team on {date}.", "I'm a member, not an admin.",
                "{other2} approved it in chat."],
        topic=["the role change for {other}", "changing {other}'s role", "the role change"],
        restate=["I understand you'd like {other} to become {role} in {workspace}.",
                 "You need {other} moved to the {role} role.",
                 "I understand you'd like {other_email} moved to the {role} role."],
        steps=[("I've flagged the change of {other} to {role} for an account specialist to approve, pending an admin's confirmation.",
                "I've flagged the change of {other_email} to {role} for an account specialist to approve, pending an admin's confirmation."),
               "A workspace admin can also make the change under Settings > Members.",
               "I'll update ticket {tid} once it's confirmed."],
        min_steps=1,
    ),
    dict(
        cat="roles", pid="O-2", prio="high", plans=PLANS,
        subjects=["Transfer workspace ownership", "Owner left the company", "New owner for {workspace}"],
        core=["Our owner {other} left the company; please transfer ownership to me.",
              "{other} owned {workspace} and no longer works here.",
              "We need to change the owner of {workspace} from {other} to {other2}."],
        detail=["Nobody else can change billing.", "Our renewal is on {date}.",
                "We can send a letter from our CEO."],
        topic=["the ownership transfer", "the new owner for {workspace}"],
        restate=["I understand {workspace} needs a new owner now that {other} has left.",
                 "You'd like ownership of {workspace} moved away from {other}."],
        steps=["Send written confirmation from {other} or a verified company officer.",
               "I've flagged the transfer for an account specialist to approve once that arrives.",
               "Until then, admins keep their current access."],
        min_steps=2,
    ),
    # ---------------------------------------------------------------- outage
    dict(
        cat="outage", pid="T-1", prio="high", plans=PLANS,
        subjects=["{page} not loading", "Tidewell down?", "Error {http_error} everywhere"],
        core=["{page} won't load since {time} today; we get error {http_error}.",
              "Nobody in {workspace} can open {page}; we get a {http_error} page.",
              "Is {product} down? {page} is blank for everyone since {time}.",
              "We see error {http_error} on {page} across the whole team."],
        detail=["Other sites work fine.", "It happens on every browser.", "{count} people are affected."],
        topic=["{page} not loading", "the errors on {page}"],
        restate=["I understand {page} has been failing with {http_error} since {time}.",
                 "Your team can't open {page} right now."],
        steps=["We're tracking this as an active incident on status.tidewell.app.",
               "I've linked ticket {tid} to the incident so you're notified when it's resolved.",
               "No data is lost; changes made before the error are saved."],
        min_steps=1,
    ),
    dict(
        cat="outage", pid="T-2", prio="normal", plans=PLANS,
        subjects=["{page} very slow", "Slow performance", "{page} takes {secs} seconds"],
        core=["{page} takes about {secs} seconds to load in {workspace}.",
              "Since {date}, {page} is very slow for our team.",
              "Opening {project} takes {secs} seconds every time."],
        detail=["The project has {count} tasks.", "It's fine on mobile.", "{other} sees the same."],
        topic=["the slow {page}", "performance in {workspace}"],
        restate=["I understand {page} is taking around {secs} seconds to load.",
                 "You're seeing slow loading of {page}.",
                 "I understand {workspace} is loading slowly for your team."],
        steps=["Send a request id or a HAR file from a slow page load.",
               "I'll pass it to the reliability team under ticket {tid}.",
               "Archiving finished projects can help in the meantime."],
        min_steps=1,
    ),
]

# Customer-side framing, independent of the scenario.
_GREETINGS = ["", "", "", "Hi,", "Hello,", "Hi team,", "Hello support,", "Hey there,"]
_OPENERS = ["", "", "", "", "Quick question.", "Hoping you can help.", "We need some help.",
            "Not sure who to ask about this."]
_CLOSERS_CALM = ["", "", "", "Thanks!", "Thanks in advance.", "Any help is appreciated.",
                 "Let me know what you need from us."]
_CLOSERS_URGENT = ["This is blocking our whole team.", "This is blocking us right now.",
                   "We are blocked until this is fixed.", "This blocks our launch."]
_BACKGROUND = [
    "Some background: we have been on {product} since {year} and use it for {project}.",
    "For context, {workspace} has {seats} seats and most of the team works in {project}.",
    "We moved from spreadsheets to {product} in {year} and it has mostly been smooth.",
    "{other} usually handles admin work but is out until {date2}.",
    "We also use {integration} with {product}, in case that matters.",
    "Our team is spread over three time zones, so replies by email work best.",
    "I checked the help center first but could not find this case.",
    "Last time we had an issue, {other2} from your team helped us quickly.",
    "We are on the {plan} plan and renew on {date2}.",
    "Nothing else has changed in our setup recently as far as I know.",
]
_REPLY_OPENERS = ["Thanks for reaching out about {topic}.", "Thanks for writing in about {topic}.",
                  "Sorry for the trouble with {topic}.", "Thanks for the details on {topic}."]
_POLICY_LINES = ["Per Policy {pid}, {policy}", "Under Policy {pid}, {policy}",
                 "Policy {pid} applies here: {policy}"]
_STEP_INTROS = ["Next steps:", "Here's what happens next:", "What to do next:"]
_CLOSINGS = ["I'll keep ticket {tid} open until this is resolved.",
             "Reply to this ticket ({tid}) if anything changes.",
             "Let me know if you have any questions."]
_SIGNOFFS = ["Best,\nHarbor, {product} Support", "Thanks,\nHarbor, {product} Support",
             "Kind regards,\nHarbor, {product} Support"]


_ALWAYS_KNOWN = frozenset({"name", "workspace", "tid", "plan", "product"})


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
    sc = rng.choice(_S)
    plan = rng.choice(sc["plans"])
    name = rng.choice(_FIRST_NAMES)
    workspace = f"{rng.choice(_WS_LEFT)}-{rng.choice(_WS_RIGHT)}"
    ticket_id = f"HB-{rng.randint(100000, 999999)}"
    channel = rng.choice(CHANNELS)
    s = _slots(rng, name, workspace, plan, ticket_id)
    used: set[str] = set(_ALWAYS_KNOWN)

    blocked = rng.random() < 0.2
    level = PRIORITIES.index(sc["prio"]) + (plan == "Enterprise") + blocked
    priority = PRIORITIES[min(level, len(PRIORITIES) - 1)]

    # ---- body: 1-4 sentences, sometimes with background paragraphs (long tickets)
    subject = _fmt(rng.choice(sc["subjects"]), s, used)
    sentences = [_fmt(rng.choice(_OPENERS), s), _fmt(rng.choice(sc["core"]), s, used)]
    if rng.random() < 0.5:
        sentences.append(_fmt(rng.choice(sc["detail"]), s, used))
    closer = rng.choice(_CLOSERS_URGENT) if blocked else rng.choice(_CLOSERS_CALM)
    sentences.append(closer)
    main = " ".join(x for x in sentences if x)
    paragraphs = [main]
    greeting = rng.choice(_GREETINGS)
    if rng.random() < 0.12:  # a long, multi-paragraph ticket
        for _ in range(rng.randint(1, 3)):
            k = rng.randint(2, 4)
            paragraphs.append(" ".join(_fmt(b, s, used) for b in rng.sample(_BACKGROUND, k)))
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
        _fmt(rng.choice(_REPLY_OPENERS), dict(s, topic=topic)) + " "
        + _fmt(_pick_grounded(rng, sc["restate"], used), s),
        rng.choice(_POLICY_LINES).format(pid=sc["pid"], policy=POLICIES[sc["pid"]]),
        rng.choice(_STEP_INTROS) + "\n" + step_lines,
        _fmt(rng.choice(_CLOSINGS), s),
        rng.choice(_SIGNOFFS).format(product=PRODUCT),
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
