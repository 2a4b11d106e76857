"""The kernel holds no reference (issue 40): a build assignment is graded with the learner's
code, torch and data in the kernel, and everything that judges or counts on the trusted side.

Each hostile submission below earned marks on the design before (the kernel held tinyserve,
the read-only cells' reference pieces and the helpers the tests called in it); graded as
grading does (the trusted runner, build_model's read-only cells on its side only), each now
loses exactly the points of the pieces it did not write. The units after them hold the
mechanisms: what a read-only cell publishes, call backs scoped to their request and bounded in
size and time, the read-only cells' own deadline, and the source read as a review signal.
"""
from __future__ import annotations

import time

import pytest

from build_exercise_checks import (BATCH_POINTS, KV_POINTS, MODEL_POINTS,  # noqa: F401
                                   SPEC_POINTS, one_thread_kernels)  # autouse fixture
from exercise_checks import graded_points

NAME = "build_model"
POINTS = MODEL_POINTS

RIGHT_ATTENTION = (
    "def attention(q, k, v, qp, kp):\n"
    "    g = q.shape[0] // k.shape[0]\n"
    "    k, v = k.repeat_interleave(g, dim=0), v.repeat_interleave(g, dim=0)\n"
    "    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])\n"
    "    s = s.masked_fill(~(kp[None, :] <= qp[:, None]), float('-inf'))\n"
    "    return torch.softmax(s, dim=-1) @ v\n")
SDPA = ("torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(g, 0), "
        "v.repeat_interleave(g, 0), attn_mask=kp[None, :] <= qp[:, None])")

# Finding 1: the grader's own pieces, bound by the read-only cells, called as the learner's;
# finding 2: the namespace reached through __main__; finding 7: the grader's attention
# reference returned as the learner's; finding 3: the kernel's build_checks patched so the
# one-slip fallback answers with the reference, behind stubbed pieces.
GRADERS_PIECES = {
    "rms_norm": "def rms_norm(x, weight, eps):\n    return _piece_rms_norm(x, weight, eps)",
    "rope": "import __main__\n"
            "def rope_tables(positions, head_dim, theta):\n"
            "    return getattr(__main__, '_build_' + 'checks').piece_rope_tables(positions, head_dim, theta)\n"
            "def apply_rotary(x, cos, sin):\n"
            "    half = x.shape[-1] // 2\n"
            "    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin",
    "attention": "def attention(q, k, v, qp, kp, _ref=globals().get('_attention_variants')):\n"
                 "    return _ref(q, k, v, qp, kp)[0]",
    "block": "try:\n"
             "    import autograder.build_checks as _b\n"
             "    _b.call_with_pieces = lambda fn, pieces, args, *a, **k: (\n"
             "        (_b.piece_forward if fn.__name__ == 'forward' else _b.piece_decoder_block)(*args), [])\n"
             "except Exception:\n"
             "    pass\n"
             "def decoder_block(x, positions, w, cfg):\n    raise ValueError('stub')",
    "forward": "def forward(ids, positions, weights, cfg):\n    raise ValueError('stub')",
}
GRADERS_PIECES_POINTS = dict(POINTS, test_rms_norm=0, test_rope_tables=0, test_attention_causal=0,
                             test_attention_gqa=0, test_decoder_block=0, test_forward=0)

# Finding 2: the source read is not the code run (the banned attention bound first, a clean
# one under `if False:` last); finding 3: the in-place check's helper rebound by a `for`
# target; finding 6: a right answer after `from math import *` keeps its points.
SOURCE_NOT_RUN = {
    "rms_norm": "def rms_norm(x, weight, eps):\n"
                "    x.mul_(torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))\n"
                "    return x * weight\n"
                "for _kernel_changed_inputs in [lambda *args: []]:\n"
                "    pass",
    "attention": "def attention(q, k, v, qp, kp):\n"
                 "    g = q.shape[0] // k.shape[0]\n"
                 f"    return {SDPA}\n"
                 "if False:\n" + "".join("    " + line + "\n" for line in RIGHT_ATTENTION.splitlines()),
    "swiglu": "from math import *\n"
              "def swiglu_mlp(x, w_gate, w_up, w_down):\n"
              "    return prod([1.0]) * (torch.nn.functional.silu(x @ w_gate.T) * (x @ w_up.T)) @ w_down.T",
}
SOURCE_NOT_RUN_POINTS = dict(POINTS, test_rms_norm=0, test_attention_causal=0, test_attention_gqa=0)

# Finding 2: a module-level container filled by a subscript assignment, never followed.
CONTAINER = {
    "attention": "_impl = {}\n"
                 "_impl['attend'] = torch.nn.functional.scaled_dot_product_attention\n"
                 "def attention(q, k, v, qp, kp):\n"
                 "    g = q.shape[0] // k.shape[0]\n"
                 "    return _impl['attend'](q, k.repeat_interleave(g, 0), v.repeat_interleave(g, 0),\n"
                 "                           attn_mask=kp[None, :] <= qp[:, None])",
}
CONTAINER_POINTS = dict(POINTS, test_attention_causal=0, test_attention_gqa=0)


# build_kv_cache. Finding 4: a loop that recomputes every step with the given forward while
# writing zeros at the right positions, one pass each (the lent cache saw the right writes);
# finding 7: a forward_cached that keeps the ids it was fed and recomputes them instead of
# reading the cache; finding 1: the grader's reference prefill called as the learner's;
# finding 6: a right cache_bytes after `from math import *` keeps its points.
KV_HOSTILE = {
    "cache": "from math import *\n"
             "def cache_bytes(cfg, tokens, bytes_per_elem):\n"
             "    return int(prod([2, cfg['num_hidden_layers'], tokens, cfg['num_key_value_heads'],\n"
             "                     cfg['head_dim'], bytes_per_elem]))\n"
             "class KVCache:\n"
             "    def __init__(self, cfg, max_seq, device):\n"
             "        shape = (cfg['num_hidden_layers'], cfg['num_key_value_heads'], max_seq, cfg['head_dim'])\n"
             "        self.k, self.v, self.length = torch.zeros(shape, device=device), torch.zeros(shape, device=device), 0\n"
             "    def write(self, layer, k, v, positions):\n"
             "        self.k[layer][:, positions], self.v[layer][:, positions] = k, v\n"
             "        self.length = max(self.length, int(positions.max()) + 1)\n"
             "        return self.k[layer, :, :self.length], self.v[layer, :, :self.length]",
    "forward_cached": "_FED = []\n"
                      "def forward_cached(ids, positions, weights, cfg, cache):\n"
                      "    if int(positions[0]) == 0:\n"
                      "        _FED.clear()\n"
                      "    _FED.extend(ids.tolist())\n"
                      "    x = embed(ids, weights)\n"
                      "    for i in range(cfg['num_hidden_layers']):\n"
                      "        q, k, v = layer_qkv(x, positions, layer_weights(weights, i), cfg)\n"
                      "        cache.write(i, k, v, positions)\n"
                      "    every = torch.tensor(_FED, device=ids.device)\n"
                      "    return forward(every, torch.arange(len(_FED), device=ids.device), weights, cfg)[-len(ids):]",
    "prefill_decode": "def prefill(prompt_ids, weights, cfg, cache):\n"
                      "    return _build_checks.piece_prefill(prompt_ids, weights, cfg, cache)\n"
                      "def decode_step(token, weights, cfg, cache):\n"
                      "    device = weights['model.embed_tokens.weight'].device\n"
                      "    return forward_cached(torch.tensor([token], device=device),\n"
                      "                          torch.tensor([cache.length], device=device), weights, cfg, cache)[-1]",
    "generate": "def generate_cached(prompt_ids, n, weights, cfg, cache):\n"
                "    device = weights['model.embed_tokens.weight'].device\n"
                "    ids, new, kv = list(prompt_ids), [], (cfg['num_key_value_heads'], cfg['head_dim'])\n"
                "    zeros = lambda t: torch.zeros(kv[0], t, kv[1], device=device)\n"
                "    for i in range(cfg['num_hidden_layers']):\n"
                "        cache.write(i, zeros(len(ids)), zeros(len(ids)), torch.arange(len(ids), device=device))\n"
                "    while True:\n"
                "        t = int(forward(torch.tensor(ids, device=device), torch.arange(len(ids), device=device),\n"
                "                        weights, cfg)[-1].argmax())\n"
                "        new.append(t)\n"
                "        ids.append(t)\n"
                "        if t == cfg['eos_token_id'] or len(new) == n or len(ids) == cfg['max_position_embeddings']:\n"
                "            return new\n"
                "        for i in range(cfg['num_hidden_layers']):\n"
                "            cache.write(i, zeros(1), zeros(1), torch.tensor([len(ids) - 1], device=device))",
}
KV_HOSTILE_POINTS = dict(KV_POINTS, test_forward_cached=0, test_prefill=0, test_generate_cached=0)


# build_batching. Finding 4: one counted batched call for show, then one prompt at a time
# through an alias taken earlier; item 5: a pad_left that pads the caller's lists in place
# (the notebook's Run All failed it, Validate did not), one forward_slots call per slot.
BATCH_HOSTILE = {
    "pad_left": "def pad_left(prompts, pad_id, device):\n"
                "    T = max(len(p) for p in prompts)\n"
                "    real = torch.tensor([[False] * (T - len(p)) + [True] * len(p) for p in prompts], device=device)\n"
                "    for p in prompts:\n"
                "        p[:0] = [pad_id] * (T - len(p))\n"
                "    return torch.tensor(prompts, device=device), (real.cumsum(1) - 1).clamp(min=0), real",
    "generate_static": "_fp = forward_padded\n"
                       "def generate_static(prompts, n, weights, cfg):\n"
                       "    device = weights['model.embed_tokens.weight'].device\n"
                       "    ids, pos, real = pad_left([list(p) for p in prompts], cfg['pad_token_id'], device)\n"
                       "    forward_padded(ids, pos, padded_mask(real), weights, cfg)\n"
                       "    out = []\n"
                       "    for p in prompts:\n"
                       "        seq, new = list(p), []\n"
                       "        while len(new) < n:\n"
                       "            T = len(seq)\n"
                       "            mask = torch.ones(1, T, T, dtype=torch.bool, device=device).tril()\n"
                       "            logits = _fp(torch.tensor([seq], device=device), torch.arange(T, device=device)[None],\n"
                       "                         mask, weights, cfg)\n"
                       "            new.append(int(logits[0, -1].argmax()))\n"
                       "            seq.append(new[-1])\n"
                       "            if new[-1] == cfg['eos_token_id']:\n"
                       "                break\n"
                       "        out.append(new)\n"
                       "    return out",
    "slots_answer": "def prefill_slot(prompt, slot, weights, cfg, cache):\n"
                    "    cache.lengths[slot] = 0\n"
                    "    ids = torch.tensor([prompt], device=weights['model.embed_tokens.weight'].device)\n"
                    "    return forward_slots(ids, torch.arange(len(prompt), device=ids.device)[None], [slot],\n"
                    "                         weights, cfg, cache)[0, -1]\n"
                    "def decode_slots(tokens, slots, weights, cfg, cache):\n"
                    "    device = weights['model.embed_tokens.weight'].device\n"
                    "    return torch.cat([forward_slots(torch.tensor([[t]], device=device),\n"
                    "                                    torch.tensor([[cache.lengths[s]]], device=device), [s],\n"
                    "                                    weights, cfg, cache)[:, 0] for t, s in zip(tokens, slots)])",
}
BATCH_HOSTILE_POINTS = dict(BATCH_POINTS, test_pad_left=0, test_generate_static=0, test_decode_slots=0)


# build_speculative. Finding 1: the loop as plain greedy on a private target built with the
# grader's _model_from_spec (12/12 before), or on the read-only cell's TARGET_MODEL: neither is
# in the kernel; the lent target is the only model reachable.
SPEC_HOSTILE = {
    "speculative": "def speculative_greedy(prompt_ids, max_new_tokens, k, target, draft_model):\n"
                   "    model = globals().get('_model_from_spec', lambda *a: TARGET_MODEL)(('target',), DEVICE)\n"
                   "    ids = list(prompt_ids)\n"
                   "    for _ in range(max_new_tokens):\n"
                   "        ids.append(int(model(torch.tensor([ids], device=DEVICE))[0, -1].argmax()))\n"
                   "    return ids[len(prompt_ids):]",
}
SPEC_HOSTILE_POINTS = dict(SPEC_POINTS, test_speculative_greedy=0)


@pytest.mark.parametrize("name, answers, points", [
    (NAME, GRADERS_PIECES, GRADERS_PIECES_POINTS),
    (NAME, SOURCE_NOT_RUN, SOURCE_NOT_RUN_POINTS),
    (NAME, CONTAINER, CONTAINER_POINTS),
    ("build_kv_cache", KV_HOSTILE, KV_HOSTILE_POINTS),
    ("build_batching", BATCH_HOSTILE, BATCH_HOSTILE_POINTS),
    ("build_speculative", SPEC_HOSTILE, SPEC_HOSTILE_POINTS),
], ids=["graders_pieces", "source_not_run", "container", "kv_cache_recompute", "batching_uncounted",
        "speculative_private_target"])
def test_hostile_submissions_earn_only_what_they_wrote(name, answers, points):
    full = {NAME: POINTS, "build_kv_cache": KV_POINTS, "build_batching": BATCH_POINTS,
            "build_speculative": SPEC_POINTS}[name]
    assert graded_points(name, answers, dict(full)) == points


# ------------------------------------------------------------------ the mechanisms

def test_a_read_only_cell_publishes_libraries_data_and_plain_helpers_and_withholds_the_rest():
    import math

    import torch

    import autograder.build_checks as build_checks
    import tinyserve
    from autograder.runner.publish import publication

    source = ("def layer_weights(weights, i):\n    return {k: v for k, v in weights.items()}\n"
              "def given(x):\n    return _secret(x)\n")
    ns: dict = {"__name__": "__autograder_tests__"}
    exec(source, ns)
    bound = {"torch": torch, "math": math, "Tensor": torch.Tensor, "tinyserve": tinyserve,
             "CFG": {"hidden_size": 8}, "W": torch.zeros(3), "layer_weights": ns["layer_weights"],
             "given": ns["given"], "piece": build_checks.piece_rms_norm, "_RMSNorm": object()}
    out = publication(bound, source, "__autograder_tests__")
    assert out["imports"] == {"torch": ["torch", ""], "math": ["math", ""], "Tensor": ["torch", "Tensor"]}
    assert set(out["withheld"]) == {"tinyserve", "piece"}
    assert set(out["sources"]) == {"layer_weights"} and "def layer_weights" in out["sources"]["layer_weights"]
    assert out["lent"] == [ns["given"]] and set(out["values"]) == {"CFG", "W", "given"}
    assert "_RMSNorm" not in str(out)


def test_only_a_template_that_declares_it_withholds_the_reference():
    from autograder.runner.publish import DECLARATION, needs_no_reference
    assert needs_no_reference(["import torch", DECLARATION])
    assert not needs_no_reference(["import torch\n# " + DECLARATION, "import autograder.build_checks"])


def _channel(replies):
    from autograder.runner.channel import Channel
    sent = []

    def exchange(text, timeout):
        sent.append((text, timeout))
        return replies.pop(0) if text is not None else None
    return Channel(exchange), sent


def test_a_lent_object_answers_only_the_request_that_carried_it():
    import json
    calls = []
    ch, sent = _channel([])
    piece = ch.lend(lambda x: calls.append(x) or x, ("__call__",), ())
    ch._encode_request("call", {"ref": 1, "args": [piece], "kwargs": {}}, 1)   # carried here
    ok = json.loads(ch._call_back({"cb": [1, "__call__", [3], None]}))
    ch._encode_request("call", {"ref": 1, "args": [], "kwargs": {}}, 2)        # not carried
    refused = json.loads(ch._call_back({"cb": [1, "__call__", [4], None]}))
    assert ok == {"ok": 3} and calls == [3]
    assert refused["error"][0] == "RuntimeError" and "earlier call" in refused["error"][1]


def test_a_call_back_is_bounded_in_size_and_in_time(monkeypatch):
    import json

    import torch

    import autograder.runner.channel as channel
    from autograder.runner.channel import GraderOverran
    monkeypatch.setattr(channel, "CALL_BACK_ELEMENTS", 10)
    ch, _ = _channel([])
    ch.lend(lambda t: t.sum(), ("__call__",), (), published=True)
    ch.lend(lambda s: time.sleep(s), ("__call__",), (), published=True)
    big = torch.zeros(11)
    ch.deadline = time.monotonic() + 30
    too_big = json.loads(ch._call_back({"cb": [1, "__call__", ch._encoder.encode([big]), None]}))
    assert too_big["error"][0] == "ValueError" and "limit" in too_big["error"][1]
    ch.deadline = time.monotonic() + 0.3
    start = time.monotonic()
    with pytest.raises(GraderOverran):   # the grader's own work: never the learner's error
        ch._call_back({"cb": [2, "__call__", [5.0], None]})
    assert time.monotonic() - start < 3


def test_a_read_only_cells_requests_have_the_cells_deadline():
    import nbformat

    from autograder.runner.trusted import TrustedRunner
    seen = []

    def exchange(text, timeout):
        seen.append(timeout)
        return None if text is None else '{"id":1,"ok":null}'
    runner = TrustedRunner(exchange, cwd=".")
    cell = nbformat.v4.new_code_cell("_KERNEL_HOLDS = 'no reference'\nCFG = {'a': 1}")
    assert runner.run_setup(cell, "setup", timeout=7, publish=True) == ""
    assert seen and 0 < seen[0] <= 7


def test_the_source_is_a_review_signal_and_a_right_answer_is_never_docked():
    from autograder.submitted.own_source import banned_in_candidates, problems, review_notes
    star = ["from math import *\ndef cache_bytes(cfg, tokens, b):\n    return int(prod([2, tokens, b]))"]
    assert problems(star, "cache_bytes", ("cache_bytes",), {}) == []
    twice = ["def attention(q):\n    return sdpa(q)\nif False:\n    def attention(q):\n        return q"]
    assert banned_in_candidates(twice, "attention", ("sdpa",)) == ["uses sdpa"]
    assert len(review_notes(twice, "attention")) == 2
    redone = ["def attention(q):\n    return sdpa(q)", "def attention(q):\n    return q"]
    assert banned_in_candidates(redone, "attention", ("sdpa",)) == []


def test_the_sandbox_of_a_build_assignment_mounts_no_reference(tmp_path):
    from pathlib import Path

    from autograder.runner.sandbox import KERNEL_FILES, SandboxSpec, bwrap_argv, bwrap_path, readonly_roots
    roots = readonly_roots(reference=False)
    import autograder
    import tinyserve
    assert not any(r.startswith(str(Path(tinyserve.__file__).parent)) for r in roots)
    package = Path(autograder.__file__).parent
    assert {str(Path(r).relative_to(package)) for r in roots if r.startswith(str(package))} \
        == set(KERNEL_FILES)
    if bwrap_path() is not None:
        argv = " ".join(bwrap_argv(SandboxSpec(run_dir=str(tmp_path / "run"), reference=False), ["true"]))
        assert "build_checks.py" not in argv and "own_source" not in argv


def test_a_trusted_test_finds_its_runner_by_module_name():
    """kernel_helpers and build_checks find the running trusted runner through
    sys.modules["autograder.runner.trusted"]: if that lookup found nothing at grading, helpers would
    run as in a plain notebook run (the learner's objects taken as the tests' own)."""
    import nbformat

    from autograder.runner.trusted import TrustedRunner
    runner = TrustedRunner(lambda text, timeout: None, cwd=".")
    cell = nbformat.v4.new_code_cell(
        "from autograder.kernel_helpers import trusted_runner\n"
        "assert trusted_runner() is not None, 'no trusted runner found by module name'")
    assert runner.run_test(cell, "probe", timeout=10).status == "ok"
