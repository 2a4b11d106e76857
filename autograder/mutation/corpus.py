"""The learner mistakes that :mod:`autograder.mutation.semantic` grades, per build assignment.

Each is a named edit of the solution's answer cell, the mistake as a learner makes it (from
the notebooks' own warnings and from trying the assignments as a new learner would), and the
test cells allowed to lose points for it: its own piece's. Instructor-side only: it contains
solution code, so it never goes into a release.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Mistake:
    """One learner mistake: ``edits`` (old text, new text) applied to answer cell ``cell``;
    ``pieces``: the test cells allowed to lose points for it (its own piece's tests)."""
    name: str
    cell: str
    edits: tuple[tuple[str, str], ...]
    pieces: tuple[str, ...]


M = Mistake

EPS = 'x.pow(2).mean(dim=-1, keepdim=True) + eps)'
MASK = "visible = k_positions[None, :] <= q_positions[:, None]"
ATTN = ("test_attention_causal", "test_attention_gqa")

BUILD_MODEL = [
    M("RMSNorm without eps", "rms_norm", ((EPS, 'x.pow(2).mean(dim=-1, keepdim=True))'),),
      ("test_rms_norm",)),
    M("RMSNorm with eps hard-coded", "rms_norm",
      ((EPS, 'x.pow(2).mean(dim=-1, keepdim=True) + 1e-5)'),), ("test_rms_norm",)),
    M("rope tables in float64", "rope", (("dtype=torch.float32", "dtype=torch.float64"),),
      ("test_rope_tables",)),
    M("rotary pairs interleaved instead of half-split", "rope",
      (("torch.cat([-x[..., half:], x[..., :half]], dim=-1)",
        "torch.stack([-x[..., 1::2], x[..., ::2]], dim=-1).flatten(-2)"),),
      ("test_apply_rotary",)),
    M("mask by index, not by position", "attention",
      ((MASK, "visible = torch.ones(q.shape[1], k.shape[1], dtype=torch.bool, "
              "device=q.device).tril()"),), ATTN),
    M("strict < in the causal mask", "attention",
      ((MASK, "visible = k_positions[None, :] < q_positions[:, None]"),), ATTN),
    M("no 1/sqrt(d) scale", "attention", ((" / math.sqrt(q.shape[-1])", ""),), ATTN),
    M("softmax over the query axis", "attention",
      (("torch.softmax(scores, dim=-1)", "torch.softmax(scores, dim=-2)"),), ATTN),
    M("KV heads tiled with repeat, not repeat_interleave", "attention",
      (("k = k.repeat_interleave(group, dim=0)", "k = k.repeat(group, 1, 1)"),
       ("v = v.repeat_interleave(group, dim=0)", "v = v.repeat(group, 1, 1)")),
      ("test_attention_gqa",)),
    M("gate and up swapped in SwiGLU", "swiglu",
      (("silu(x @ w_gate.T) * (x @ w_up.T)", "silu(x @ w_up.T) * (x @ w_gate.T)"),),
      ("test_swiglu",)),
    M("attention residual dropped", "block", (("h = x + a.transpose", "h = a.transpose"),),
      ("test_decoder_block",)),
    M("final norm applied twice", "forward",
      (('return rms_norm(x, weights["model.norm.weight"], cfg["rms_norm_eps"]) @ embed.T',
        'x = rms_norm(x, weights["model.norm.weight"], cfg["rms_norm_eps"])\n'
        '    return rms_norm(x, weights["model.norm.weight"], cfg["rms_norm_eps"]) @ embed.T'),),
      ("test_forward",)),
    M("no stop at the end token", "generate",
      (('        if token == cfg["eos_token_id"]:\n            break\n', ""),),
      ("test_generate",)),
    M("no stop at the context window", "generate",
      (('while len(new) < max_new_tokens and len(ids) < cfg["max_position_embeddings"]:',
        "while len(new) < max_new_tokens:"),), ("test_generate",)),
    # A float64 result ("in double for precision", a float64 constant) and float tokens.
    M("RMSNorm computed in float64", "rms_norm", ((EPS, 'x.double().pow(2).mean(dim=-1, keepdim=True) + eps)'),),
      ("test_rms_norm",)),
    M("rotary applied in float64", "rope",
      (("return x * cos + rotated_half * sin", "return x.double() * cos + rotated_half * sin"),),
      ("test_apply_rotary",)),
    M("attention computed in float64", "attention",
      (("    group = q.shape[0] // k.shape[0]\n",
        "    q, k, v = q.double(), k.double(), v.double()\n    group = q.shape[0] // k.shape[0]\n"),), ATTN),
    M("SwiGLU computed in float64", "swiglu",
      (("    return (torch.nn.functional.silu(",
        "    x, w_gate, w_up, w_down = (t.double() for t in (x, w_gate, w_up, w_down))\n"
        "    return (torch.nn.functional.silu("),), ("test_swiglu",)),
    M("decoder block returns float64", "block", (("    return h + swiglu_mlp(", "    return h.double() + swiglu_mlp("),),
      ("test_decoder_block",)),
    M("logits in float64", "forward",
      (('return rms_norm(x, weights["model.norm.weight"], cfg["rms_norm_eps"]) @ embed.T',
        'return (rms_norm(x, weights["model.norm.weight"], cfg["rms_norm_eps"]) @ embed.T).double()'),),
      ("test_forward",)),
    M("tokens returned as floats", "generate", (("new.append(token)", "new.append(float(token))"),),
      ("test_generate",)),
]

BUILD_KV_CACHE = [
    M("cache_bytes without the factor 2 (keys and values)", "cache",
      (('(2 * cfg["num_hidden_layers"]', '(cfg["num_hidden_layers"]'),), ("test_cache_bytes",)),
    M("cache_bytes ignores bytes_per_elem", "cache",
      (("            * bytes_per_elem)", "            * 4)"),), ("test_cache_bytes",)),
    M("cache stored in float16", "cache",
      (("self.k = torch.zeros(shape, device=device)",
        "self.k = torch.zeros(shape, device=device, dtype=torch.float16)"),
       ("self.v = torch.zeros(shape, device=device)",
        "self.v = torch.zeros(shape, device=device, dtype=torch.float16)")),
      ("test_cache_alloc",)),
    M("write copies the cache (nothing preallocated survives)", "cache",
      (("        self.k[layer][:, positions] = k\n",
        "        self.k = self.k.clone()\n        self.k[layer][:, positions] = k\n"),),
      ("test_cache_write",)),
    M("write returns every slot, written or not", "cache",
      (("return self.k[layer, :, :self.length], self.v[layer, :, :self.length]",
        "return self.k[layer], self.v[layer]"),), ("test_cache_write",)),
    M("query positions by index, not by position", "forward_cached",
      (("attention(q, keys, values, positions, k_positions)",
        "attention(q, keys, values, torch.arange(len(positions), device=keys.device), "
        "k_positions)"),), ("test_forward_cached",)),
    M("prefill one token at a time", "prefill_decode",
      (("    return forward_cached(ids, torch.arange(len(prompt_ids), device=device), weights, "
        "cfg, cache)",
        "    return torch.cat([forward_cached(ids[t:t + 1], torch.arange(t, t + 1, "
        "device=device), weights, cfg, cache) for t in range(len(prompt_ids))])"),),
      ("test_prefill",)),
    M("decode step one position early", "prefill_decode",
      (("torch.tensor([cache.length], device=device)",
        "torch.tensor([cache.length - 1], device=device)"),), ("test_decode_step",)),
    M("generate_cached recomputes everything (the cache unused)", "generate",
      (("        logits = decode_step(new[-1], weights, cfg, cache)",
        "        fresh = KVCache(cfg, cfg['max_position_embeddings'], "
        "weights['model.embed_tokens.weight'].device)\n"
        "        logits = prefill(list(prompt_ids) + new, weights, cfg, fresh)[-1]"),),
      ("test_generate_cached",)),
    M("generate_cached does not stop at the end token", "generate",
      (('(new[-1] == cfg["eos_token_id"] or len(new)', "(len(new)"),),
      ("test_generate_cached",)),
]

BUILD_BATCHING = [
    M("pads on the right", "pad_left",
      (("[pad_id] * (T - len(p)) + list(p)", "list(p) + [pad_id] * (T - len(p))"),
       ("[False] * (T - len(p)) + [True] * len(p)", "[True] * len(p) + [False] * (T - len(p))")),
      ("test_pad_left",)),
    M("positions by index, pads counted", "pad_left",
      (("positions = (real.cumsum(dim=1) - 1).clamp(min=0)",
        "positions = torch.arange(T, device=real.device).expand(len(prompts), T)"),),
      ("test_pad_left",)),
    M("mask ignores the padding", "padded_mask",
      (("(causal & real[:, None, :])", "causal[None].expand(real.shape[0], T, T)"),),
      ("test_padded_mask",)),
    M("a pad row reads nothing", "padded_mask",
      ((" | torch.eye(T, dtype=torch.bool, device=real.device)", ""),), ("test_padded_mask",)),
    M("static batch stops at the first finished row", "generate_static",
      (("while not all(done):", "while not any(done):"),), ("test_generate_static",)),
    M("static batch keeps tokens after a row's end", "generate_static",
      (("            if not done[b]:\n", "            if True:\n"),), ("test_generate_static",)),
    M("prefill_slot keeps the previous request's length", "slots_answer",
      (("    cache.lengths[slot] = 0                                     # the previous request is gone\n",
        ""),), ("test_prefill_slot",)),
    M("decode_slots one position early", "slots_answer",
      (("[[cache.lengths[s]] for s in slots]", "[[cache.lengths[s] - 1] for s in slots]"),),
      ("test_decode_slots",)),
    M("continuous batching never refills a freed slot early", "serve",
      (("if len(free) == len(slot_of) or not static:", "if len(free) == len(slot_of):"),),
      ("test_serve",)),
]

BUILD_SPECULATIVE = [
    M("draft re-feeds the whole context", "draft",
      (("    logits = draft_model.feed(context[draft_model.length:])",
        "    draft_model.rollback(0)\n    logits = draft_model.feed(context)"),), ("test_draft",)),
    M("accept_greedy compares with the next row", "accept_greedy",
      (("guesses[n] == choices[n]:", "guesses[n] == choices[n + 1]:"),),
      ("test_accept_greedy",)),
    M("verify pass without the last context token", "speculative",
      (("target.feed(context[-1:] + guesses)", "target.feed(guesses)"),),
      ("test_speculative_greedy",)),
    M("no rollback of the target's rejected guesses", "speculative",
      (("        target.rollback(len(context) - 1)\n", ""),), ("test_speculative_greedy",)),
    M("speculative_greedy overruns the budget", "speculative",
      (("return out[:max_new_tokens]", "return out"),), ("test_speculative_greedy",)),
    M("acceptance ratio inverted (q / p)", "accept_sampled",
      (("float(p[i, d]) / float(q[i, d])", "float(q[i, d]) / float(p[i, d])"),),
      ("test_accept_sampled",)),
    M("residual without the clamp at zero", "accept_sampled",
      (("(p[i] - q[i]).clamp_min(0.0)", "(p[i] - q[i]).abs()"),), ("test_accept_sampled",)),
    M("rejected token resampled from p, not the residual", "accept_sampled",
      (("residual / residual.sum()", "p[i]"),), ("test_accept_sampled",)),
    M("no bonus token when every guess is kept", "accept_sampled",
      (("    return guesses + [int(torch.multinomial(p[len(guesses)], 1, generator=generator))]",
        "    return guesses"),), ("test_accept_sampled",)),
]

CORPUS: dict[str, list[M]] = {
    "build_model": BUILD_MODEL,
    "build_kv_cache": BUILD_KV_CACHE,
    "build_batching": BUILD_BATCHING,
    "build_speculative": BUILD_SPECULATIVE,
}
