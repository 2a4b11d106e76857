"""Regenerate ``harbor_project/fixtures/tickets.jsonl``, Harbor's fictional ticket set.

The committed JSONL file is the fixture; this script only documents how it was made and
reproduces it byte for byte::

    python harbor_project/tools/make_tickets.py            # rewrite the file
    python harbor_project/tools/make_tickets.py --check    # exit 1 if the file differs

Everything is drawn from ``random.Random(SEED)``. Lengths follow a heavy-tailed mix chosen so
that the averages land near the brief's 1,500 input and 200 output tokens per request:
most tickets are short, a few are medium, and a handful carry a pasted log or export that
pushes them to about 15.5k prompt tokens (one is past any 16,384-token context on purpose).
"""
from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

SEED = 20261004
N_TICKETS = 200
OUT = Path(__file__).resolve().parents[1] / "fixtures" / "tickets.jsonl"
# The load generator replays the same tickets from tinyserve's package data (tinyserve.paths).
PACKAGE_COPY = Path(__file__).resolve().parents[2] / "tinyserve" / "assets" / "harbor" / "tickets.jsonl"

WORKSPACES = ["ws-lantern", "ws-pier", "ws-tidewater", "ws-gull", "ws-breakwater", "ws-ferry"]

# Fictional subjects per category; nothing here refers to a real product or customer.
SUBJECTS = {
    "billing": ["Charged twice for the March plan", "Invoice shows the wrong seat count",
                "Refund for an unused annual upgrade", "Card declined after address change",
                "Need a copy of last year's receipts"],
    "access": ["Cannot invite a teammate to the workspace", "Login loop after password reset",
               "Lost the second-factor device", "Guest sees channels they should not",
               "Admin role missing after plan change"],
    "bug": ["Search returns archived tickets only", "Attachments fail above 10 MB",
            "Draft reply disappears on refresh", "Wrong time zone on scheduled replies",
            "Sidebar counts never update"],
    "how-to": ["How do saved replies work?", "Set business hours per team",
               "Route tickets by tag to a queue", "Merge two duplicate contacts",
               "Change the language of auto-replies"],
    "integration": ["Webhook retries flood our endpoint", "Calendar sync stopped on Monday",
                    "Chat widget blank on our site", "CRM field mapping drops phone numbers",
                    "Email forwarding bounces with 550"],
    "data-export": ["Export of all tickets for an audit", "CSV export cuts off at 5,000 rows",
                    "Need conversation history for one contact", "Scheduled export is empty",
                    "Delete a former employee's data"],
}
CATEGORY_WEIGHTS = {"billing": 22, "access": 20, "bug": 20, "how-to": 18, "integration": 12,
                    "data-export": 8}
LONG_SUBJECTS = ["Pasted sync log for the last 48 hours", "Full thread export attached for review",
                 "Audit log dump: who changed routing rules", "Long email chain forwarded from legal",
                 "Entire webhook payload history pasted in"]


def _clamp(x: float, lo: int, hi: int) -> int:
    return int(min(hi, max(lo, round(x))))


def make_tickets(rng: random.Random) -> list[dict]:
    categories = list(CATEGORY_WEIGHTS)
    weights = [CATEGORY_WEIGHTS[c] for c in categories]
    # Positions of the long tickets: four near 16k tokens, one past a 16,384-token context.
    long_slots = sorted(rng.sample(range(N_TICKETS), 5))
    tickets = []
    for i in range(N_TICKETS):
        category = rng.choices(categories, weights)[0]
        if i in long_slots:
            k = long_slots.index(i)
            prompt = 19_200 if k == 2 else rng.randint(15_200, 15_800)
            output = rng.randint(180, 280)
            subject = LONG_SUBJECTS[k]
            category = "data-export" if k % 2 == 0 else "integration"
        elif rng.random() < 0.06:                       # medium: a few screenshots' worth of text
            prompt = rng.randint(3_500, 7_500)
            output = _clamp(rng.gauss(320, 60), 120, 512)
            subject = rng.choice(SUBJECTS[category])
        else:                                           # the bulk: short-to-typical tickets
            prompt = _clamp(rng.lognormvariate(6.64, 0.45), 250, 3_400)
            output = _clamp(rng.lognormvariate(5.21, 0.35), 40, 480)
            subject = rng.choice(SUBJECTS[category])
        tickets.append({
            "id": f"HT-{i + 1:04d}",
            "workspace": rng.choice(WORKSPACES),
            "category": category,
            "prompt_tokens": prompt,
            "output_tokens": output,
            "subject": subject,
        })
    return tickets


def render(tickets: list[dict]) -> str:
    return "".join(json.dumps(t, ensure_ascii=True) + "\n" for t in tickets)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare with the committed file")
    args = parser.parse_args()
    text = render(make_tickets(random.Random(SEED)))
    if args.check:
        same = all(p.exists() and p.read_text() == text for p in (OUT, PACKAGE_COPY))
        print("tickets.jsonl is up to date" if same else "tickets.jsonl differs from the generator")
        return 0 if same else 1
    for path in (OUT, PACKAGE_COPY):
        path.write_text(text)
        print(f"wrote {path} ({N_TICKETS} tickets, seed {SEED})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
