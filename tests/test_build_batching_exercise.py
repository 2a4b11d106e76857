"""The build_batching exercise (chapter 3, build track): the learner writes static batching with
left padding (the padded ids, per-row positions, the mask, a greedy static batch) and a
continuous-batching loop over the slots of a KV cache; every row and every request is held
equal to its prompt run alone. Checked here: a valid source whose solution passes every visible
and hidden test (and whose measurement ran the learner's loop both ways), a blank release that
earns nothing, named mistakes, no points for a piece taken from tinyserve, each piece broken in
turn costing only its own points (graded and at Validate), and sandboxed grading.

What each part is for is held by a visible case: one batched forward per step (generate_static,
counted on the tests' side), a reused slot starts at 0 (prefill_slot), each slot decodes at its
own position (decode_slots), freed slots are refilled at once (serve's occupancy).
"""
from __future__ import annotations

import pytest

from build_exercise_checks import (BATCH_POINTS, NAN, check_build_source, check_named_mistakes,  # noqa: F401
                                   check_one_slip_costs_one_piece, one_thread_kernels, slips_of,
                                   visible_only)
from exercise_checks import (check_sandboxed_grading, exercise_paths, needs_sandbox,
                             run_blank_release, run_probe, source_fixture, with_answers)

NAME = "build_batching"
SOURCE_DIR, SOURCE, RELEASED = exercise_paths(NAME)
source = source_fixture(SOURCE)

TEST_POINTS = BATCH_POINTS
ANSWER_CELLS = {"pad_left", "padded_mask", "generate_static", "slots_answer", "serve"}


def test_source_assignment_specifics(source):
    check_build_source(source, SOURCE_DIR, TEST_POINTS, ANSWER_CELLS, total=20)
    # Predict first: the guess is committed in a cell above the measurement that records it.
    cells = [c.source for c in source.cells if c.cell_type == "code"]
    ui = next(i for i, s in enumerate(cells) if "gain.ui()" in s)
    assert any("gain.record(" in s for s in cells[ui + 1:])


PROBE = """
import json
print("PROBE " + json.dumps({m: [len(r[1]), sum(r[1]), [len(t) for t in r[0]]] for m, r in runs.items()}
                            | {"slots": SLOTS, "wanted": wanted}))
"""


def test_solution_passes_every_test_and_measures_both_schedules(source):
    got = run_probe(source, SOURCE_DIR, PROBE)
    static, continuous = got["static"], got["continuous"]
    # The same replies both ways, none longer than asked; each decode step adds one token per busy
    # slot and each request's first token comes from its prefill.
    assert static[2] == continuous[2]
    assert all(1 <= n <= w for n, w in zip(static[2], got["wanted"]))
    for steps, busy_slot_steps, lengths in (static, continuous):
        assert busy_slot_steps == sum(lengths) - len(lengths)
    # Continuous batching needs fewer steps for the same work: its slots are fuller.
    assert continuous[0] < static[0]


def test_blank_release_earns_nothing_and_leaks_nothing(source):
    _, errs = run_blank_release(RELEASED, source, SOURCE_DIR)
    assert errs == {gid: "NotImplementedError" for gid in TEST_POINTS}


PAD = ("def pad_left(prompts, pad_id, device):\n"
       "    T = max(len(p) for p in prompts)\n"
       "    ids = torch.tensor([{row} for p in prompts], device=device)\n"
       "    real = torch.tensor([[False] * (T - len(p)) + [True] * len(p) for p in prompts], device=device)\n"
       "    return ids, {positions}, real")
GOOD_PAD = dict(row="[pad_id] * (T - len(p)) + list(p)", positions="(real.cumsum(1) - 1).clamp(min=0)")
SLOT = ("def decode_slots(tokens, slots, weights, cfg, cache):\n"
        "    ids = torch.tensor(tokens, device=weights['model.embed_tokens.weight'].device)[:, None]\n"
        "    positions = torch.tensor([[{position}] for s in slots], device=ids.device)\n"
        "    return forward_slots(ids, positions, list(slots), weights, cfg, cache)[:, 0]")

MISTAKES = [
    ("test_pad_left", PAD.format(**dict(GOOD_PAD, row="list(p) + [pad_id] * (T - len(p))")), "right padding"),
    ("test_pad_left", PAD.format(**dict(GOOD_PAD, positions="torch.arange(T, device=device).expand(len(prompts), T)")),
     "positions counted from the padded start"),
    # Issue 53 (8): the width from the first prompt, not the longest; `real` read from the ids
    # (a real token equal to the pad id then reads as padding). Validate names both.
    ("test_pad_left", PAD.format(**GOOD_PAD).replace("T = max(len(p) for p in prompts)", "T = len(prompts[0])"),
     "the width is the LONGEST prompt's length"),
    ("test_pad_left", PAD.format(**GOOD_PAD).replace(
        "real = torch.tensor([[False] * (T - len(p)) + [True] * len(p) for p in prompts], device=device)",
        "real = ids != pad_id"), "real is read from the ids"),
    ("test_padded_mask",
     "def padded_mask(real):\n"
     "    T = real.shape[1]\n"
     "    return torch.ones(T, T, dtype=torch.bool, device=real.device).tril().expand(real.shape[0], T, T)",
     "pad keys are not masked"),
    ("test_padded_mask",
     "def padded_mask(real):\n"
     "    T = real.shape[1]\n"
     "    return torch.ones(T, T, dtype=torch.bool, device=real.device).tril() & real[:, None, :]",
     "a pad's row masks every key"),
    ("test_generate_static",
     "_solution_static = generate_static\n"
     "def generate_static(prompts, n, weights, cfg):\n"
     "    return [p + r for p, r in zip(prompts, _solution_static(prompts, n, weights, cfg))]",
     "returns the prompt too"),
    ("test_prefill_slot",
     "def prefill_slot(prompt, slot, weights, cfg, cache):\n"
     "    ids = torch.tensor([prompt], device=weights['model.embed_tokens.weight'].device)\n"
     "    return forward_slots(ids, torch.arange(len(prompt), device=ids.device)[None], [slot], weights, cfg,"
     " cache)[0, -1]",
     "still counts the"),
    ("test_decode_slots", SLOT.format(position="cache.lengths[s] + 1"), "decode position off by one"),
    # Named causes at Validate (issue 38, finding 22): a length counted twice, positions that
    # never advance, a mask off by one.
    ("test_decode_slots", SLOT.format(position="cache.lengths[s]").replace(
        "    return forward_slots(ids, positions, list(slots), weights, cfg, cache)[:, 0]",
        "    out = forward_slots(ids, positions, list(slots), weights, cfg, cache)[:, 0]\n"
        "    for s in slots:\n        cache.lengths[s] += 1\n    return out"), "went up by 2"),
    ("test_decode_slots", "_first = {}\n" + SLOT.format(position="_first.setdefault(s, cache.lengths[s])"),
     "did not advance"),
    ("test_padded_mask",
     "def padded_mask(real):\n"
     "    T = real.shape[1]\n"
     "    return torch.ones(T, T, dtype=torch.bool, device=real.device).tril(-1) & real[:, None, :]",
     "reads its own key too"),
    ("test_decode_slots", SLOT.format(position="max(cache.lengths)"), "every row decoded at the same position"),
    ("test_serve",  # EOS ignored: Validate now sees it (issue 40)
     "_solution_serve = serve\n"
     "def serve(requests, weights, cfg, cache, static=False):\n"
     "    return _solution_serve(requests, weights, dict(cfg, eos_token_id=-1), cache, static)",
     "ends at its end token"),
    ("test_serve",
     "_solution_serve = serve\n"
     "def serve(requests, weights, cfg, cache, static=False):\n"
     "    return _solution_serve(requests, weights, cfg, cache, True)",
     "that is static batching"),
    ("test_generate_static",
     "_solution_static = generate_static\n"
     "def generate_static(prompts, n, weights, cfg):\n"
     "    return [_solution_static([p], n, weights, cfg)[0] for p in prompts]",
     "one prompt at a time"),
    # A later part runs on tinyserve's earlier pieces: a wrong earlier piece (whose own test
    # fails, above) leaves the later part's points alone. None: the test cell must pass.
    ("test_generate_static", PAD.format(**dict(GOOD_PAD, row="list(p) + [pad_id] * (T - len(p))")) + "\n"
     "def padded_mask(real):\n    return torch.ones(*real.shape, real.shape[1], dtype=torch.bool, device=real.device)",
     None),
    ("test_serve", SLOT.format(position="cache.lengths[s] + 1") + "\n"
     "def prefill_slot(prompt, slot, weights, cfg, cache):\n    raise RuntimeError('not yet')", None),
    ("test_generate_static",
     "def generate_static(prompts, n, weights, cfg):\n"
     "    from tinyserve.generate import generate_batch\n"
     "    model = tinyserve.load_model('target', device=weights['model.embed_tokens.weight'].device)\n"
     "    return generate_batch(model, prompts, n, stop_ids=(cfg['eos_token_id'],))",
     "no points for this piece"),
]


def test_classic_mistakes_get_messages_that_name_them_and_later_parts_stand_alone(source):
    check_named_mistakes(source, SOURCE_DIR, ANSWER_CELLS, MISTAKES, graded_cells_only=True)


def test_validate_names_the_same_mistakes(source):
    """Validate tells the truth (issue 26): with the hidden tests left out, each named mistake
    still fails its test cell with its message (and each earlier slip still spares the later
    parts)."""
    check_named_mistakes(visible_only(source), SOURCE_DIR, ANSWER_CELLS, MISTAKES, graded_cells_only=True)


@needs_sandbox
def test_sandboxed_grading_gives_full_marks_and_zero(source, tmp_path):
    # One prompt at a time, with the batch sizes reported by a patched call_with_pieces in
    # the kernel: when the kernel counted forward_padded's calls this earned generate_static's
    # points (issue 25); the tests count them on their side now.
    forged = with_answers(source, {"generate_static": FORGED_ONE_BY_ONE})
    points = {"test_generate_static": 0, "test_pad_left": 3, "test_padded_mask": 3}
    check_sandboxed_grading(NAME, SOURCE_DIR, TEST_POINTS, {}, tmp_path,
                            forged={"forged_batches": (forged, points)})


FORGED_ONE_BY_ONE = """def generate_static(prompts, max_new_tokens, weights, cfg):
    out = []
    for p in prompts:
        seq, new = list(p), []
        while len(new) < max_new_tokens:
            T = len(seq)
            device = weights["model.embed_tokens.weight"].device
            mask = torch.ones(1, T, T, dtype=torch.bool, device=device).tril()
            logits = forward_padded(torch.tensor([seq], device=device),
                                    torch.arange(T, device=device)[None], mask, weights, cfg)
            new.append(int(logits[0, -1].argmax()))
            seq.append(new[-1])
            if new[-1] == cfg["eos_token_id"]:
                break
        out.append(new)
    return out


import autograder.build_checks as _b
_real = _b.call_with_pieces


def _reports_one_batch(fn, pieces, args, count=None, lent=None):
    got, _ = _real(fn, pieces, args, None, lent)
    return got, [len(args[0])]


_b.call_with_pieces = _reports_one_batch
for _with_pieces in [_reports_one_batch]:   # the name the tests used to fetch from the kernel
    pass"""


# ------------------------------------------------------------------ one slip costs one piece

# Every piece broken in turn, each way a learner's can break (it raises, returns NaN logits, a
# tensor of the wrong shape or dtype, a list of the wrong type or length): only its own test
# cell loses points, the later parts being run on tinyserve's pieces in its place.
SLIPS = slips_of([
    ("pad_left", {"test_pad_left"}, {"shape": "tuple(t[:, None] for t in out)", "dtype": "tuple(t.float() for t in out)"}),
    ("padded_mask", {"test_padded_mask"}, {"shape": "out[:, 0]", "dtype": "out.float()"}),
    ("generate_static", {"test_generate_static"}, {"length": "out[:-1]", "type": "[torch.tensor(r) for r in out]"}),
    ("prefill_slot", {"test_prefill_slot"}, {"NaN": NAN, "shape": "out[None]"}),
    ("decode_slots", {"test_decode_slots"}, {"NaN": NAN, "shape": "out.T"}),
    ("serve", {"test_serve"}, {"length": "(out[0][:-1], out[1])", "type": "(out[0], tuple(out[1]))"}),
])


@pytest.mark.parametrize("mode", ["graded", "validate"])
def test_one_slip_costs_one_piece(source, mode):
    """Graded as grading does (hidden tests included) and as Validate does (visible only)."""
    check_one_slip_costs_one_piece(source, SOURCE_DIR, TEST_POINTS, ANSWER_CELLS, SLIPS, mode)
