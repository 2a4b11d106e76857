"""The build_model exercise (chapters 0-1, build track part 1): the learner writes RMSNorm,
rotary embeddings, causal grouped-query attention, SwiGLU, the decoder block, the forward pass
over the shipped weights and a greedy loop. Checked here: a valid nbgrader source whose solution
passes every visible and hidden test, a blank release that earns nothing, messages that name the
classic mistakes, no points for a piece that calls or copies tinyserve, one wrong piece costing
only its own points, and sandboxed grading.

What the notebook stresses, and the visible case that holds it (issue 26): eps on near-zero
vectors (rms_norm), float32 results (the rope tables and every float piece: a float64 one is
named) and int tokens, a query at position 40 over 41 cached keys (the mask
compares positions), one token through forward and a one-token prompt (no .squeeze()), the
loop's two stops (the window, the end token), an rms_norm that leaves its input alone. A piece
whose earlier piece raises, gives NaN or the wrong shape is judged with build_checks' reference
pieces in its place.

Kernel runs take about 10-20 s each on 2 cores (the hidden tests load the shipped target).
"""
from __future__ import annotations

import pytest

from build_exercise_checks import (MODEL_POINTS, RIGHT_BLOCK, NAN, check_build_source, check_named_mistakes,  # noqa: F401
                                   check_one_slip_costs_one_piece, one_thread_kernels, slips_of,
                                   visible_only)
from exercise_checks import (check_sandboxed_grading, copy_notebook, errors,
                             execute, exercise_paths, meta, needs_sandbox, run_blank_release,
                             run_probe, source_fixture, with_answers)

NAME = "build_model"
SOURCE_DIR, SOURCE, RELEASED = exercise_paths(NAME)
source = source_fixture(SOURCE)


TEST_POINTS = MODEL_POINTS
ANSWER_CELLS = {"rms_norm", "rope", "attention", "swiglu", "block", "forward", "generate"}


# ------------------------------------------------------------------ the source notebook

def test_source_assignment_specifics(source):
    check_build_source(source, SOURCE_DIR, TEST_POINTS, ANSWER_CELLS, total=28)
    first = next(c for c in source.cells if c.cell_type == "code")
    assert "from autograder.testkit import check, check_close, check_equal" in first.source


PROBE = """
import json
print("PROBE " + json.dumps({"yours": yours, "reference": reference}))
"""


def test_solution_passes_every_test_and_writes_the_engines_reply(source):
    got = run_probe(source, SOURCE_DIR, PROBE)
    assert len(got["yours"]) == 40 and got["yours"] == got["reference"]


# ------------------------------------------------------------------ the blank release

def test_blank_release_earns_nothing_and_leaks_nothing(source):
    _, errs = run_blank_release(RELEASED, source, SOURCE_DIR)
    assert errs == {gid: "NotImplementedError" for gid in TEST_POINTS}


# ------------------------------------------------------------------ the classic mistakes, named

RMS = "def rms_norm(x, weight, eps):\n    return x * torch.rsqrt(x.pow(2).mean({dim}, keepdim=True){eps}) * weight"
TABLES = ("def rope_tables(positions, head_dim, theta):\n"
          "    i = torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32)\n"
          "    a = positions.float()[:, None] * theta ** (-i / head_dim)\n"
          "    a = {layout}\n"
          "    return a.cos(), a.sin()")
ROTARY_INTERLEAVED = ("def apply_rotary(x, cos, sin):\n"
                      "    even, odd = x[..., 0::2], x[..., 1::2]\n"
                      "    return x * cos + torch.stack([-odd, even], dim=-1).flatten(-2) * sin")
ATTN = ("def attention(q, k, v, qp, kp):\n"
        "    g = q.shape[0] // k.shape[0]\n"
        "    k, v = k.{rep}, v.{rep}\n"
        "    s = q @ k.transpose(-1, -2) / {scale}\n"
        "    {mask}\n"
        "    return torch.softmax(s, dim=-1) @ v")
GOOD_ATTN = dict(rep="repeat_interleave(g, dim=0)", scale="math.sqrt(q.shape[-1])",
                 mask="s = s.masked_fill(~(kp[None, :] <= qp[:, None]), float('-inf'))")

def _pasted_reference(name: str, as_name: str) -> str:
    """tinyserve's current source of `name`, renamed: what a learner who copies it submits."""
    import inspect
    import tinyserve.model
    return inspect.getsource(getattr(tinyserve.model, name)).replace(f"def {name}(", f"def {as_name}(", 1)


FORWARD = ("def forward(ids, positions, weights, cfg):\n"
           "    E = weights['model.embed_tokens.weight']\n"
           "    x = E[ids]\n"
           "    for i in range(cfg['num_hidden_layers']):\n"
           "        x = decoder_block(x, positions, layer_weights(weights, i), cfg)\n"
           "    return {out}")
GENERATE_SQUEEZED = ("def generate_no_cache(prompt_ids, n, weights, cfg):\n"
                     "    ids, new = list(prompt_ids), []\n"
                     "    while len(new) < n and len(ids) < cfg['max_position_embeddings']:\n"
                     "        logits = forward(torch.tensor(ids, device=DEVICE), torch.arange(len(ids), device=DEVICE),\n"
                     "                         weights, cfg).squeeze()\n"
                     "        new.append(int(logits[-1].argmax()))\n"
                     "        ids.append(new[-1])\n"
                     "        if new[-1] == cfg['eos_token_id']:\n"
                     "            break\n"
                     "    return new")
# Slips that break (raise, NaN, float64) what every later piece calls: each costs its own piece.
ATTN_K_NOT_TRANSPOSED = ATTN.format(**GOOD_ATTN).replace("s = q @ k.transpose(-1, -2)", "s = q @ k")
ATTN_STRICT = ATTN.format(**dict(GOOD_ATTN, mask="s = s.masked_fill(~(kp[None, :] < qp[:, None]), float('-inf'))"))
TABLES_FLOAT64 = TABLES.format(layout="torch.cat([a, a], dim=-1)").replace("torch.float32", "torch.float64")
LATER = ("test_decoder_block", "test_forward", "test_generate")
BLOCK_NO_RESIDUAL = RIGHT_BLOCK.replace("    h = x + a.transpose", "    h = a.transpose")
RMS_RAISES = "def rms_norm(x, weight, eps):\n    raise ValueError('not yet')"
SWIGLU_NO_DOWN = "def swiglu_mlp(x, g, u, d):\n    return torch.nn.functional.silu(x @ g.T) * (x @ u.T)"
RMS_IN_PLACE = ("def rms_norm(x, weight, eps):\n"
                "    x.mul_(torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))\n"
                "    return x * weight")

# A float piece whose result comes back float64 (issue 26): a float64 constant or a computation
# "in double for precision"; and tokens that are floats, equal to the ints yet not token ids.
F64 = "returned torch.float64, expected torch.float32"
RMS_FLOAT64 = RMS.format(dim=-1, eps=" + eps").replace("x.pow(2)", "x.double().pow(2)")
ROTARY_FLOAT64 = ("def apply_rotary(x, cos, sin):\n"
                  "    x, half = x.double(), x.shape[-1] // 2\n"
                  "    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin")
ATTN_FLOAT64 = ATTN.format(**GOOD_ATTN).replace(  # scores "in double for precision"
    "    g = q.shape", "    q, k, v = q.double(), k.double(), v.double()\n    g = q.shape")
SWIGLU_FLOAT64 = ("def swiglu_mlp(x, g, u, d):\n"
                  "    x, g, u, d = (t.double() for t in (x, g, u, d))\n"
                  "    return (torch.nn.functional.silu(x @ g.T) * (x @ u.T)) @ d.T")
BLOCK_FLOAT64 = ("_solution_block = decoder_block\n"
                 "def decoder_block(x, positions, w, cfg):\n"
                 "    return _solution_block(x, positions, w, cfg).to(torch.float64)")
FORWARD_FLOAT64 = FORWARD.format(out="(rms_norm(x, weights['model.norm.weight'], cfg['rms_norm_eps']) @ E.T).double()")
GENERATE_FLOATS = ("_solution_generate = generate_no_cache\n"
                   "def generate_no_cache(p, n, w, c):\n"
                   "    return [float(t) for t in _solution_generate(p, n, w, c)]")

# (test cell, code a learner might write in its place, a fragment the failure must contain;
# None: with this earlier piece wrong, the test cell must pass)
MISTAKES = [
    ("test_rms_norm", RMS.format(dim=-1, eps=""), "WITHOUT eps"),
    ("test_rms_norm", RMS.format(dim=0, eps=" + eps"), "wrong axis"),
    ("test_rms_norm", RMS.format(dim=-1, eps=" + 1e-5"), "eps = 1e-05 written into the function"),
    ("test_rope_tables", TABLES_FLOAT64, "build them in float32"),
    ("test_attention_causal", ATTN.format(**dict(GOOD_ATTN, mask=(
        "s = s.masked_fill(~(torch.arange(s.shape[-1], device=s.device)[None, :] "
        "<= torch.arange(s.shape[-2], device=s.device)[:, None]), float('-inf'))"))), "compares indices, not positions"),
    ("test_forward", FORWARD.format(out="(rms_norm(x, weights['model.norm.weight'], cfg['rms_norm_eps']) @ E.T).squeeze()"),
     "dimension of size 1 was dropped"),
    ("test_forward", FORWARD.format(out="rms_norm(x, weights['model.norm.weight'], cfg['rms_norm_eps']) @ E.T")
     .replace("decoder_block(x, positions,", "decoder_block(x, torch.arange(len(ids), device=ids.device),"),
     "ignores the positions it is given"),
    ("test_attention_causal", ATTN.format(**dict(GOOD_ATTN, mask=(
        "s = s.masked_fill(~(torch.arange(s.shape[-1], device=s.device)[None, :] <= "
        "torch.arange(s.shape[-2], device=s.device)[:, None] + (s.shape[-1] - s.shape[-2])), float('-inf'))"))),
     "offset to the last keys"),
    ("test_generate", GENERATE_SQUEEZED, "a .squeeze() drops it"),
    ("test_generate", GENERATE_SQUEEZED.replace(".squeeze()", "").replace(
        "        if new[-1] == cfg['eos_token_id']:\n            break\n", ""), "keeps going after the end token"),
    ("test_generate", GENERATE_SQUEEZED.replace(".squeeze()", "").replace(
        " and len(ids) < cfg['max_position_embeddings']", ""), "keeps going past the context window"),
    *((later, wrong, None) for wrong in (ATTN_K_NOT_TRANSPOSED, ATTN_STRICT, TABLES_FLOAT64) for later in LATER),
    # Each piece broken in turn (it raises, or returns the wrong shape): the pieces after it keep
    # their points, judged with the reference in its place.
    ("test_swiglu", SWIGLU_NO_DOWN, "expected a tensor of shape (3, 8)"),
    *((later, wrong, None) for wrong in (RMS_RAISES, SWIGLU_NO_DOWN) for later in LATER),
    *((later, "def decoder_block(x, positions, w, cfg):\n    raise ValueError('not yet')", None)
      for later in LATER[1:]),
    ("test_generate", "def forward(ids, positions, weights, cfg):\n    raise ValueError('not yet')", None),
    ("test_rms_norm", RMS_IN_PLACE, "changed its input in place"),
    # Slips no message named before (issue 26): each now names its cause.
    ("test_attention_causal", ATTN.format(**GOOD_ATTN).replace("dim=-1", "dim=-2"), "softmax over the queries"),
    ("test_attention_causal", ATTN.format(**dict(GOOD_ATTN, mask="s = s.masked_fill(~(kp[None, :] <= qp[:, None]), 0.0)")),
     "masked scores set to 0"),
    ("test_decoder_block", BLOCK_NO_RESIDUAL, "the attention's residual is missing"),
    ("test_decoder_block", BLOCK_NO_RESIDUAL.replace("    h = a.transpose", "    h = x + a.transpose").replace(
        "    T, H, K, d = x.shape[0]", "    cfg = dict(cfg, rms_norm_eps=1e-5)\n    T, H, K, d = x.shape[0]"),
     "written into the block"),
    ("test_forward", FORWARD.format(out="rms_norm(rms_norm(x, weights['model.norm.weight'], cfg['rms_norm_eps']), "
                                        "weights['model.norm.weight'], cfg['rms_norm_eps']) @ E.T"), "applied twice"),
    ("test_decoder_block", RMS_IN_PLACE, None),
    ("test_rope_tables", TABLES.format(layout="a.repeat_interleave(2, dim=-1)"), "interleaved"),
    ("test_apply_rotary", ROTARY_INTERLEAVED, "interleaved layout"),
    ("test_attention_causal", ATTN.format(**dict(GOOD_ATTN, mask="pass")), "no causal mask"),
    ("test_attention_causal",
     ATTN.format(**dict(GOOD_ATTN, mask="s = s.masked_fill(~(kp[None, :] < qp[:, None]), float('-inf'))")),
     "its own key too"),
    ("test_attention_causal", ATTN.format(**dict(GOOD_ATTN, scale="q.shape[-1]")), "scaled by head_dim"),
    ("test_attention_gqa", ATTN.format(**dict(GOOD_ATTN, rep="repeat(g, 1, 1)")), "repeat_interleave"),
    ("test_swiglu", "def swiglu_mlp(x, g, u, d):\n    return ((x @ g.T) * torch.nn.functional.silu(x @ u.T)) @ d.T",
     "silu is applied to the up projection"),
    ("test_forward", FORWARD.format(out="x @ E.T"), "final RMSNorm"),
    ("test_generate",
     "_solution_generate = generate_no_cache\n"
     "def generate_no_cache(p, n, w, c):\n    return list(p) + _solution_generate(p, n, w, c)",
     "returns the prompt too"),
    # A float64 result or float tokens: the dtype or type is named before any value is compared.
    ("test_rms_norm", RMS_FLOAT64, F64),
    ("test_apply_rotary", ROTARY_FLOAT64, F64),
    ("test_attention_causal", ATTN_FLOAT64, F64),
    ("test_attention_gqa", ATTN_FLOAT64, F64),
    ("test_swiglu", SWIGLU_FLOAT64, F64),
    ("test_decoder_block", BLOCK_FLOAT64, F64),
    ("test_forward", FORWARD_FLOAT64, F64),
    ("test_generate", GENERATE_FLOATS, "got a list holding float"),
    # Calling or copying the reference earns nothing for the piece, with the reason.
    ("test_rms_norm",
     "from tinyserve.model import RMSNorm\n"
     "def rms_norm(x, weight, eps):\n"
     "    norm = RMSNorm(x.shape[-1], eps).to(x.device)\n"
     "    norm.weight.data.copy_(weight)\n"
     "    return norm(x).detach()", "no points for this piece"),
    ("test_apply_rotary", "from tinyserve.model import apply_rope\n"
                          "apply_rotary = lambda x, cos, sin: apply_rope(x[None], cos[None], sin[None])[0]",
     "tinyserve"),
    ("test_attention_causal",
     "def attention(q, k, v, qp, kp):\n"
     "    g = q.shape[0] // k.shape[0]\n"
     "    return torch.nn.functional.scaled_dot_product_attention(\n"
     "        q, k.repeat_interleave(g, 0), v.repeat_interleave(g, 0), attn_mask=kp[None, :] <= qp[:, None])",
     "scaled_dot_product_attention"),
    ("test_rope_tables",  # tinyserve's own function pasted in under the piece's name
     _pasted_reference("rope_cos_sin", "rope_tables"), "copied from tinyserve"),
    ("test_swiglu",  # hidden from the code, caught when tinyserve is made unavailable
     "def swiglu_mlp(x, g, u, d):\n"
     "    ref = __import__('tiny' + 'serve.model').model\n"
     "    return (ref.F.silu(x @ g.T) * (x @ u.T)) @ d.T", "stops working when tinyserve is unavailable"),
]


def test_classic_mistakes_get_messages_that_name_them(source):
    """Each wrong answer runs against the real test cell (hidden tests included) in one kernel;
    the solution runs first, so each mistake is the only thing wrong in its cell."""
    check_named_mistakes(source, SOURCE_DIR, ANSWER_CELLS, MISTAKES, graded_cells_only=True)


# Found only by calling the piece again with tinyserve hidden, which the hidden tests do.
HIDDEN_ONLY = {"stops working when tinyserve is unavailable"}


def test_validate_names_the_same_mistakes(source):
    """Validate tells the truth (issue 26): with the hidden tests left out, each named mistake
    still fails its test cell with its message, and each earlier slip still spares the later
    pieces, so a green Validate is not docked at grading for a mistake the notebook warns about."""
    check_named_mistakes(visible_only(source), SOURCE_DIR, ANSWER_CELLS,
                         [m for m in MISTAKES if m[2] not in HIDDEN_ONLY], graded_cells_only=True)


@pytest.mark.parametrize("cell, wrong, failing", [
    ("rms_norm", RMS.format(dim=-1, eps=""), {"test_rms_norm"}),
    ("attention", ATTN.format(**dict(GOOD_ATTN, rep="repeat(g, 1, 1)")), {"test_attention_gqa"}),
])
def test_one_wrong_piece_costs_only_its_own_points(source, cell, wrong, failing):
    """The block, forward and generate tests judge a later piece again with the reference in
    place of the learner's earlier pieces (never by calling those again, issue 53), so a slip in
    a piece below them fails that piece's test only."""
    nb = copy_notebook(source)
    nb.cells = [c for c in nb.cells if c.cell_type == "markdown" or meta(c)]  # no payoff cell
    target = next(c for c in nb.cells if meta(c).get("grade_id") == cell)
    target.source = wrong
    execute(nb, SOURCE_DIR, allow_errors=True)
    assert set(errors(nb)) == failing


# Every piece broken in turn, each way a learner's can break (it raises, returns NaN, a tensor
# of the wrong shape or dtype, a list of the wrong type or length): only its own test cells
# lose points, the later pieces being judged with the reference in its place. A dtype is
# slipped where the notebook states one: float32 for every float piece, ints for the tokens.
PAIR_NAN = "tuple(torch.full_like(t, float('nan')) for t in out)"
SLIPS = slips_of([
    ("rms_norm", {"test_rms_norm"}, {"NaN": NAN, "shape": "out[None]", "dtype": "out.double()"}),
    ("rope_tables", {"test_rope_tables"}, {"NaN": PAIR_NAN, "shape": "tuple(t[:, None] for t in out)",
                                           "dtype": "tuple(t.double() for t in out)"}),
    ("apply_rotary", {"test_apply_rotary"}, {"NaN": NAN, "shape": "out[None]", "dtype": "out.double()"}),
    ("attention", {"test_attention_causal", "test_attention_gqa"},
     {"NaN": NAN, "shape": "out.transpose(0, 1)", "dtype": "out.double()"}),
    ("swiglu_mlp", {"test_swiglu"}, {"NaN": NAN, "shape": "out[None]", "dtype": "out.double()"}),
    ("decoder_block", {"test_decoder_block"}, {"NaN": NAN, "shape": "out[None]", "dtype": "out.double()"}),
    ("forward", {"test_forward"}, {"NaN": NAN, "shape": "out.squeeze()", "dtype": "out.double()"}),
    ("generate_no_cache", {"test_generate"}, {"length": "out[:-1]", "type": "tuple(out)",
                                              "floats": "[float(t) for t in out]"}),
])


@pytest.mark.parametrize("mode", ["graded", "validate"])
def test_one_slip_costs_one_piece(source, mode):
    """Graded as grading does (hidden tests included) and as Validate does (visible only)."""
    check_one_slip_costs_one_piece(source, SOURCE_DIR, TEST_POINTS, ANSWER_CELLS, SLIPS, mode)


# ------------------------------------------------------------------ end to end, sandboxed

# Evidence the learner's kernel could forge (issue 25): `_own_work` rebound there (a `for`
# target, which the static scan does not follow), and tinyserve's attention captured in a
# default argument, which a reading of the function's code (names and closures) misses. Both
# earned the pieces' points when the verdict came from the kernel.
FORGED = {
    "rms_norm": "from tinyserve.model import RMSNorm\n"
                "def rms_norm(x, weight, eps):\n"
                "    norm = RMSNorm(x.shape[-1], eps).to(x.device)\n"
                "    norm.weight.data.copy_(weight)\n"
                "    return norm(x).detach()\n"
                "for _own_work in [lambda *args, **kwargs: []]:\n"
                "    pass",
    "attention": "def attention(q, k, v, qp, kp, _sdpa=torch.nn.functional.scaled_dot_product_attention):\n"
                 "    g = q.shape[0] // k.shape[0]\n"
                 "    return _sdpa(q, k.repeat_interleave(g, 0), v.repeat_interleave(g, 0),\n"
                 "                 attn_mask=kp[None, :] <= qp[:, None])",
}


@needs_sandbox
def test_sandboxed_grading_gives_full_marks_and_zero(source, tmp_path):
    forged = with_answers(source, FORGED)
    points = {"test_rms_norm": 0, "test_attention_causal": 0, "test_attention_gqa": 0,
              "test_swiglu": 2, "test_decoder_block": 4}
    check_sandboxed_grading(NAME, SOURCE_DIR, TEST_POINTS, {}, tmp_path,
                            forged={"forged_evidence": (forged, points)})
