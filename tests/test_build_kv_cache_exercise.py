"""The build_kv_cache exercise (chapter 2, build track part 2): the learner writes a
preallocated KV cache, the forward pass through it, prefill and decode_step with explicit
positions, and the cached greedy loop; every logit is held equal to a full recompute. Checked
here: a valid source whose solution passes every visible and hidden test (and whose timing cell
really used the learner's cache), a blank release that earns nothing, named mistakes, no points
for a cache taken from tinyserve, each piece broken in turn costing only its own points (graded
and at Validate), and sandboxed grading.

What each piece is for, and the test cell that holds it (issue 26), counted on a cache the tests
keep and lend (build_checks.ReferenceCache.positions_written) where the learner's code runs:
  KVCache          allocated once: cache.k / cache.v keep their shape and storage, and hold what
                   was written at its slot (test_cache_write: a torch.cat-grown or copied cache fails)
  forward_cached   attends over the cache, not this step alone (test_forward_cached)
  prefill          the prompt in ONE forward pass (test_prefill: one token at a time fails)
  decode_step      one token at position cache.length (test_decode_step)
  generate_cached  one prefill, then one decode step per token: each position fed once
                   (test_generate_cached: a forward recompute or a re-fed prompt fails)
"""
from __future__ import annotations

import pytest

from build_exercise_checks import (KV_POINTS, NAN, check_build_source, check_named_mistakes,  # noqa: F401
                                   check_one_slip_costs_one_piece, one_thread_kernels, slips_of,
                                   visible_only)
from exercise_checks import (check_sandboxed_grading, exercise_paths, needs_sandbox,
                             run_blank_release, run_probe, source_fixture)

NAME = "build_kv_cache"
SOURCE_DIR, SOURCE, RELEASED = exercise_paths(NAME)
source = source_fixture(SOURCE)

TEST_POINTS = KV_POINTS
ANSWER_CELLS = {"cache", "forward_cached", "prefill_decode", "generate"}


def test_source_assignment_specifics(source):
    check_build_source(source, SOURCE_DIR, TEST_POINTS, ANSWER_CELLS, total=20)


PROBE = """
import json
print("PROBE " + json.dumps({"steps": len(cached_ms), "nbytes": cache.k.nbytes + cache.v.nbytes,
                             "formula": cache_bytes(CFG, len(sequence), 4), "length": cache.length,
                             "sequence": len(sequence), "prompt": len(prompt)}))
"""


def test_solution_passes_every_test_and_times_the_learners_cache(source):
    got = run_probe(source, SOURCE_DIR, PROBE)
    # The timing loop decoded through the learner's own cache (every token but the last) and its
    # allocation equals the formula: 2 x 6 layers x 2 KV heads x 32 x 4 bytes per position.
    assert got["length"] == got["sequence"] - 1 and got["steps"] == got["sequence"] - got["prompt"] - 1
    assert got["nbytes"] == got["formula"] == 3072 * got["sequence"]


def test_blank_release_earns_nothing_and_leaks_nothing(source):
    _, errs = run_blank_release(RELEASED, source, SOURCE_DIR)
    assert errs == {gid: "NotImplementedError" for gid in TEST_POINTS}


CACHE = ("class KVCache:\n"
         "    def __init__(self, cfg, max_seq, device):\n"
         "        shape = (cfg['num_hidden_layers'], cfg['{heads}'], max_seq, cfg['head_dim'])\n"
         "        self.k, self.v = torch.zeros(shape, device=device), torch.zeros(shape, device=device)\n"
         "        self.length = 0\n"
         "    def write(self, layer, k, v, positions):\n"
         "        self.k[layer][:, positions] = k\n"
         "        self.v[layer][:, positions] = v\n"
         "        {advance}\n"
         "        n = int(positions.max()) + 1\n"
         "        return self.k[layer, :, :n], self.v[layer, :, :n]")
GOOD = dict(heads="num_key_value_heads", advance="self.length = max(self.length, int(positions.max()) + 1)")
DECODE = ("def decode_step(token, weights, cfg, cache):\n"
          "    position = torch.tensor([cache.length {shift}], device=DEVICE)\n"
          "    return forward_cached(torch.tensor([token], device=DEVICE), position, weights, cfg, cache)[-1]")

WRONG_FORWARD = ("_solution_forward = forward_cached\n"
                 "def forward_cached(ids, positions, weights, cfg, cache):\n"
                 "    return 2 * _solution_forward(ids, positions, weights, cfg, cache)")

# What each piece is for, not only its values (issue 26): the cache is written in place, the
# prompt goes in one pass, the loop decodes through the cache. Each of these gives the right
# values and kept full marks before.
CACHE_GROWN = ("class KVCache:\n"
               "    def __init__(self, cfg, max_seq, device):\n"
               "        shape = (cfg['num_hidden_layers'], cfg['num_key_value_heads'], max_seq, cfg['head_dim'])\n"
               "        self.k, self.v = torch.zeros(shape, device=device), torch.zeros(shape, device=device)\n"
               "        self.length, self._k, self._v = 0, {}, {}\n"
               "    def write(self, layer, k, v, positions):\n"
               "        if layer in self._k:\n"
               "            k, v = torch.cat([self._k[layer], k], 1), torch.cat([self._v[layer], v], 1)\n"
               "        self._k[layer], self._v[layer] = k, v\n"
               "        self.length = k.shape[1]\n"
               "        return k, v")
CACHE_COPIED = CACHE.format(**dict(GOOD, advance="self.k, self.v = self.k.clone(), self.v.clone()\n"
                                                 "        self.length = max(self.length, int(positions.max()) + 1)"))
PREFILL_PER_TOKEN = ("def prefill(prompt_ids, weights, cfg, cache):\n"
                     "    return torch.cat([forward_cached(torch.tensor([t], device=DEVICE), torch.tensor([i], device=DEVICE),\n"
                     "                                     weights, cfg, cache) for i, t in enumerate(prompt_ids)])")
GENERATE_RECOMPUTES = ("def generate_cached(prompt_ids, n, weights, cfg, cache):\n"
                       "    ids, new = list(prompt_ids), []\n"
                       "    while len(new) < n and len(ids) < cfg['max_position_embeddings']:\n"
                       "        token = int(forward(torch.tensor(ids, device=DEVICE), torch.arange(len(ids), device=DEVICE),\n"
                       "                            weights, cfg)[-1].argmax())\n"
                       "        new.append(token)\n"
                       "        ids.append(token)\n"
                       "        if token == cfg['eos_token_id']:\n"
                       "            break\n"
                       "    return new")
GENERATE_REFEEDS = GENERATE_RECOMPUTES.replace(
    "forward(torch.tensor(ids, device=DEVICE), torch.arange(len(ids), device=DEVICE),\n"
    "                            weights, cfg)", "prefill(ids, weights, cfg, cache)")

BYTES = ("def cache_bytes(cfg, tokens, bytes_per_elem):\n"
         "    return {value}")
GENERATE_UNSTOPPED = ("def generate_cached(prompt_ids, n, weights, cfg, cache):\n"
                      "    new = []\n"
                      "    logits = prefill(prompt_ids, weights, cfg, cache)[-1]\n"
                      "    while True:\n"
                      "        new.append(int(logits.argmax()))\n"
                      "        if {stop}len(new) == n:\n"
                      "            return new\n"
                      "        logits = decode_step(new[-1], weights, cfg, cache)")
# Key positions read before the write: the cache's length is the old one, so the mask does not
# fit the keys (the slip raises). Parts 4 and 5 keep their points: judged on the reference.
# Issue 53 (8): the keys' positions taken from the queries' (`positions`): right in a prefill
# and a single-token step, wrong for several new tokens after cached ones.
FORWARD_QUERY_POSITIONS = (
    "def forward_cached(ids, positions, weights, cfg, cache):\n"
    "    x = embed(ids, weights)\n"
    "    for i in range(cfg['num_hidden_layers']):\n"
    "        w = layer_weights(weights, i)\n"
    "        q, k, v = layer_qkv(x, positions, w, cfg)\n"
    "        keys, values = cache.write(i, k, v, positions)\n"
    "        x = layer_out(x, attention(q, keys, values, positions, positions), w, cfg)\n"
    "    return logits_of(x, weights, cfg)")
FORWARD_EARLY_POSITIONS = (
    "def forward_cached(ids, positions, weights, cfg, cache):\n"
    "    x = embed(ids, weights)\n"
    "    for i in range(cfg['num_hidden_layers']):\n"
    "        w = layer_weights(weights, i)\n"
    "        q, k, v = layer_qkv(x, positions, w, cfg)\n"
    "        k_positions = torch.arange(cache.length, device=DEVICE)\n"
    "        keys, values = cache.write(i, k, v, positions)\n"
    "        x = layer_out(x, attention(q, keys, values, positions, k_positions), w, cfg)\n"
    "    return logits_of(x, weights, cfg)")
BYTES_FP16 = BYTES.format(value="2 * cfg['num_hidden_layers'] * tokens * cfg['num_key_value_heads'] * cfg['head_dim'] * 2")
BYTES_FLOAT = BYTES.format(value="2.0 * cfg['num_hidden_layers'] * tokens * cfg['num_key_value_heads'] * cfg['head_dim'] * bytes_per_elem")

MISTAKES = [
    ("test_cache_bytes", BYTES_FP16, "element size is fixed at 2 bytes"),
    ("test_cache_bytes", BYTES_FLOAT, "a number of bytes is an int"),
    ("test_cache_alloc", BYTES_FP16, None),  # a wrong formula costs part 1a, not the allocation
    ("test_cache_alloc", BYTES_FLOAT, None),
    ("test_generate_cached", GENERATE_UNSTOPPED.format(stop="len(prompt_ids) + len(new) == cfg['max_position_embeddings'] or "),
     "keeps going after the end token"),
    ("test_generate_cached", GENERATE_UNSTOPPED.format(stop="new[-1] == cfg['eos_token_id'] or "),
     "past the context window"),
    ("test_prefill", FORWARD_EARLY_POSITIONS, None),
    ("test_decode_step", FORWARD_EARLY_POSITIONS, None),
    ("test_generate_cached", FORWARD_EARLY_POSITIONS, None),
    ("test_generate_cached", "def prefill(prompt_ids, weights, cfg, cache):\n    raise ValueError('not yet')", None),
    ("test_generate_cached", "def decode_step(token, weights, cfg, cache):\n"
                             "    return torch.full((cfg['vocab_size'],), float('nan'))", None),
    ("test_cache_write", CACHE_GROWN, "nothing was written into cache.k"),
    ("test_cache_write", CACHE_COPIED, "write replaced cache.k with a new tensor"),
    ("test_forward_cached", FORWARD_QUERY_POSITIONS, "not this step's `positions`"),
    ("test_prefill", PREFILL_PER_TOKEN, "in ONE pass"),
    ("test_generate_cached", GENERATE_RECOMPUTES, "never wrote the cache it was given"),
    ("test_generate_cached", GENERATE_REFEEDS, "were fed again"),
    ("test_cache_bytes", "def cache_bytes(cfg, t, b):\n"
                         "    return cfg['num_hidden_layers'] * t * cfg['num_key_value_heads'] * cfg['head_dim'] * b",
     "factor 2"),
    ("test_cache_bytes", "def cache_bytes(cfg, t, b):\n"
                         "    return 2 * cfg['num_hidden_layers'] * t * cfg['num_attention_heads'] * cfg['head_dim'] * b",
     "query heads"),
    ("test_cache_alloc", CACHE.format(**dict(GOOD, heads="num_attention_heads")), "sized by the query heads"),
    ("test_cache_write", CACHE.format(**dict(GOOD, advance="pass")), "length was not advanced"),
    ("test_forward_cached",
     "def forward_cached(ids, positions, weights, cfg, cache):\n"
     "    x = embed(ids, weights)\n"
     "    for i in range(cfg['num_hidden_layers']):\n"
     "        w = layer_weights(weights, i)\n"
     "        q, k, v = layer_qkv(x, positions, w, cfg)\n"
     "        cache.write(i, k, v, positions)\n"
     "        x = layer_out(x, attention(q, k, v, positions, positions), w, cfg)\n"
     "    return logits_of(x, weights, cfg)", "ALONE"),
    ("test_decode_step", DECODE.format(shift="+ 1"), "decode position off by one"),
    ("test_decode_step", DECODE.format(shift="- 1"), "overwrote position"),
    ("test_generate_cached",
     "_solution_generate = generate_cached\n"
     "def generate_cached(p, n, w, c, cache):\n    return list(p) + _solution_generate(p, n, w, c, cache)",
     "returns the prompt too"),
    # A later part judged on the learner's own earlier one: a prefill or decode step that calls
    # a wrong forward_cached right, a loop over a wrong decode_step, keeps its points (None:
    # the test cell must pass); the earlier part's own test fails.
    ("test_forward_cached", WRONG_FORWARD, "differs"),
    ("test_prefill", WRONG_FORWARD, None),
    ("test_decode_step", WRONG_FORWARD, None),
    ("test_generate_cached", "_solution_decode = decode_step\n"
                             "def decode_step(token, weights, cfg, cache):\n"
                             "    return -_solution_decode(token, weights, cfg, cache)", None),
    ("test_cache_alloc",
     "from tinyserve.kv_cache import KVCache as _Theirs\n"
     "class KVCache:\n"
     "    def __init__(self, cfg, max_seq, device):\n"
     "        c = _Theirs(tinyserve.ModelConfig(**{k: v for k, v in cfg.items() if k != 'head_dim'}), 1, max_seq)\n"
     "        self.k, self.v, self.length = c.k[:, 0], c.v[:, 0], 0",
     "no points for this piece"),
]


def test_classic_mistakes_get_messages_that_name_them_and_later_parts_stand_alone(source):
    check_named_mistakes(source, SOURCE_DIR, ANSWER_CELLS, MISTAKES, graded_cells_only=True)


def test_validate_names_the_same_mistakes(source):
    """Validate tells the truth (issue 26): with the hidden tests left out, each named mistake
    still fails its test cell with its message (and each earlier slip still spares the later
    parts)."""
    check_named_mistakes(visible_only(source), SOURCE_DIR, ANSWER_CELLS, MISTAKES, graded_cells_only=True)


# ------------------------------------------------------------------ one slip costs one piece

# Every piece broken in turn, each way a learner's can break (it raises, returns NaN, a tensor
# of the wrong shape, a number or list of the wrong type or length): only its own test cells
# lose points; a later part that fails with it is judged again on build_checks' reference.
WRITE = ("_solution_KVCache = KVCache\n"
         "class KVCache(_solution_KVCache):\n"
         "    def write(self, layer, k, v, positions):\n"
         "        {body}")
WRITE_RETURNS = "return tuple({result} for t in super().write(layer, k, v, positions))"
SLIPS = [
    *slips_of([("cache_bytes", {"test_cache_bytes"}, {"NaN": "float('nan')", "type": "float(out)"})]),
    ("KVCache", "__init__ raises", "class KVCache:\n    def __init__(self, cfg, max_seq, device):\n"
                                   "        raise RuntimeError('KVCache is not finished')",
     {"test_cache_alloc", "test_cache_write"}),
    ("KVCache", "write raises", WRITE.format(body="raise RuntimeError('write is not finished')"), {"test_cache_write"}),
    ("KVCache", "write NaN", WRITE.format(body=WRITE_RETURNS.format(result="torch.full_like(t, float('nan'))")),
     {"test_cache_write"}),
    ("KVCache", "write shape", WRITE.format(body=WRITE_RETURNS.format(result="t[None]")), {"test_cache_write"}),
    *slips_of([
        ("forward_cached", {"test_forward_cached"}, {"NaN": NAN, "shape": "out[-1]"}),
        ("prefill", {"test_prefill"}, {"NaN": NAN, "shape": "out[-1]"}),
        ("decode_step", {"test_decode_step"}, {"NaN": NAN, "shape": "out[None]"}),
        ("generate_cached", {"test_generate_cached"}, {"length": "out[:-1]", "type": "[float(t) for t in out]"}),
    ]),
]


@pytest.mark.parametrize("mode", ["graded", "validate"])
def test_one_slip_costs_one_piece(source, mode):
    """Graded as grading does (hidden tests included) and as Validate does (visible only)."""
    check_one_slip_costs_one_piece(source, SOURCE_DIR, TEST_POINTS, ANSWER_CELLS, SLIPS, mode)


@needs_sandbox
def test_sandboxed_grading_gives_full_marks_and_zero(source, tmp_path):
    check_sandboxed_grading(NAME, SOURCE_DIR, TEST_POINTS, {}, tmp_path)


def test_a_cache_copied_at_every_write_leaves_the_first_allocation_unwritten():
    """storage() keeps the tensors __init__ allocated and reads their contents later (issue 53:
    no address is asked of the kernel, which could answer anything): a cache cloned at every
    write leaves them as they were, a cache filled in place holds its writes in them."""
    import torch

    from autograder import build_checks

    class Cache:
        pass

    for in_place in (False, True):
        cache = Cache()
        cache.k, cache.v = torch.zeros(2, 3, 16, 4), torch.zeros(2, 3, 16, 4)
        held = build_checks.storage(cache)
        for position in range(2):
            if not in_place:
                cache.k, cache.v = cache.k.clone(), cache.v.clone()
            cache.k[:, :, position], cache.v[:, :, position] = 1.0, 2.0
        k, v = held.contents()
        assert (torch.equal(k, cache.k) and torch.equal(v, cache.v)) is in_place
        assert bool(k.abs().sum() == 0) is not in_place
