"""Build-track verdicts rest on what the grader observes, never on what the kernel reports
(issue 53). The kernel is the learner's: what it says about the learner's code is a claim. A
verdict rests only on (a) values the learner's code returned for inputs the tests chose,
compared on the trusted side, and (b) what the trusted side itself observed: calls into lent
objects, and the contents of lent storage read back by the trusted side.

Each hostile submission below earned the marks of pieces it did not write on the code before
issue 53 (graded as grading does: the trusted runner, the read-only cells on its side only);
each now loses exactly those pieces. Each control is a right answer in another style (a
callable object, a ``@torch.no_grad()``-decorated function) beside a slip in an earlier piece:
it keeps every point of the pieces it got right. The tests after them hold the rest: the
banned-call reading (2), names bound through any wrapper (5), the grader's own failures (7, one
graded run whose publish times out) and the call back's bound (6).

By mechanism of the issue (the cases of ``CASES`` and the tests below):
1. composition checks never call a piece again: model_late_zeros, model_nan_stubs,
   kv_late_zeros_and_cloned_cache;
2. banned calls under another spelling: model_late_zeros, model_nan_stubs,
   test_torchs_attention_under_another_spelling_costs_the_piece (control: the learner's own);
3. evidence never the kernel's account: model_in_place_forged, model_nan_stubs,
   kv_late_zeros_and_cloned_cache, batching_for_show (pad_left);
4. counted work the kernel cannot redo privately, stored data read back: kv_private_recompute,
   kv_reads_for_show, batching_for_show;
5. callable objects and decorated functions: batching_styles_control, model_styles_control,
   speculative_styles_control, test_names_bind_into_the_code_that_runs_however_it_is_wrapped;
6. call backs bounded before they run: test_a_call_back_past_the_tests_own_inputs_is_refused_...;
7. the grader's failures: test_a_publish_that_times_out_..., test_the_worker_fails_...;
8. Validate's named checks: tests/test_build_kv_cache_exercise.py (FORWARD_QUERY_POSITIONS) and
   tests/test_build_batching_exercise.py (pad_left's width and real mask), visible tests only.
"""
from __future__ import annotations

import json

import pytest

from build_exercise_checks import (BATCH_POINTS, KV_POINTS, MODEL_POINTS,  # noqa: F401
                                   RIGHT_BLOCK, SPEC_POINTS, one_thread_kernels)  # autouse fixture
from exercise_checks import exercise_paths, graded_points


# Mechanism 3: the learner's cell wraps the kernel's call function (reached through
# sys.modules, sys imported under another name) so "the arguments after the call" come back
# as they were sent: an in-place piece then "left its input alone".
FORGE_ARGS_BACK = (
    "import sys as _s\n"
    "_agent = _s.modules['autograder.kernel.agent']\n"
    "_real_call_with = _agent._call_with\n"
    "def _forged_call_with(target, req):\n"
    "    sent = _agent._decoder.decode(req.get('args', []))\n"
    "    out = _real_call_with(target, req)\n"
    "    return [out[0], sent] if req.get('args_back') is True else out\n"
    "_agent._call_with = _forged_call_with\n")

RMS = "    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight\n"
RMS_IN_PLACE = ("def rms_norm(x, weight, eps):\n"
                "    x.mul_(torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))\n"
                "    return x * weight\n")

# Mechanism 1: pieces right while their own tests run that answer zeros once a later part has
# been called: the block and the forward pass rebuilt from them equal an unwritten block
# (`x.clone()`) and a forward of zeros. Mechanism 4 (banned calls) rides along: attention
# through getattr with a computed name.
LATE_ZEROS = {
    "rms_norm": "_LATE = [False]\n"
                "def rms_norm(x, weight, eps):\n"
                "    if _LATE[0]:\n"
                "        return torch.zeros_like(x)\n" + RMS,
    "attention": "import torch.nn.functional as _Fn\n"
                 "def attention(q, k, v, qp, kp):\n"
                 "    g = q.shape[0] // k.shape[0]\n"
                 "    return getattr(_Fn, 'scaled_dot_product' + '_attention')(\n"
                 "        q, k.repeat_interleave(g, 0), v.repeat_interleave(g, 0), attn_mask=kp[None, :] <= qp[:, None])",
    "block": "def decoder_block(x, positions, w, cfg):\n"
             "    _LATE[0] = True\n"
             "    return x.clone()",
    "forward": "def forward(ids, positions, weights, cfg):\n"
               "    _LATE[0] = True\n"
               "    return torch.zeros(len(ids), cfg['vocab_size'], device=ids.device)",
}
LATE_ZEROS_POINTS = dict(MODEL_POINTS, test_attention_causal=0, test_attention_gqa=0, test_decoder_block=0,
                         test_forward=0)

# Mechanism 1: one early piece answering NaN makes every rebuilt block all NaN, which a
# one-line NaN stub matched (equal_nan). Mechanism 4: attention through an import binding the
# banned name under another name. Mechanism 3: an in-place rms_norm with forged arguments.
NAN_STUBS = {
    "rms_norm": FORGE_ARGS_BACK + RMS_IN_PLACE.replace("    return x * weight\n",
                                                       "    return x * weight * float('nan')\n"),
    "attention": "from torch.nn.functional import scaled_dot_product_attention as _attend\n"
                 "def attention(q, k, v, qp, kp):\n"
                 "    g = q.shape[0] // k.shape[0]\n"
                 "    return _attend(q, k.repeat_interleave(g, 0), v.repeat_interleave(g, 0),\n"
                 "                   attn_mask=kp[None, :] <= qp[:, None])",
    "block": "def decoder_block(x, positions, w, cfg):\n    return torch.full_like(x, float('nan'))",
    "forward": "def forward(ids, positions, weights, cfg):\n"
               "    return torch.full((len(ids), cfg['vocab_size']), float('nan'), device=ids.device)",
}
NAN_STUBS_POINTS = dict(MODEL_POINTS, test_rms_norm=0, test_attention_causal=0, test_attention_gqa=0, test_decoder_block=0,
                        test_forward=0)

# Mechanism 3: an in-place rms_norm whose forged "arguments after the call" say it left x alone.
IN_PLACE_FORGED = {"rms_norm": FORGE_ARGS_BACK + RMS_IN_PLACE}
IN_PLACE_FORGED_POINTS = dict(MODEL_POINTS, test_rms_norm=0)


# build_kv_cache. Mechanism 1: a forward_cached that turns into "zeros at the right positions"
# once a stub prefill or decode step has run: the stubs equalled the rebuilt calls. Mechanism
# 3: a cache cloned on every write whose `k`/`v` properties copy into the first allocation.
_ZEROS_AT = ("def _zeros_at(positions, cfg, cache, T):\n"
             "    z = torch.zeros(cfg['num_key_value_heads'], len(positions), cfg['head_dim'], device=positions.device)\n"
             "    for i in range(cfg['num_hidden_layers']):\n"
             "        cache.write(i, z, z, positions)\n"
             "    return torch.zeros(T, cfg['vocab_size'], device=positions.device)\n")
KV_LATE = {
    "cache": "def cache_bytes(cfg, tokens, bytes_per_elem):\n"
             "    return 2 * cfg['num_hidden_layers'] * tokens * cfg['num_key_value_heads'] * cfg['head_dim'] * bytes_per_elem\n"
             "class KVCache:\n"
             "    def __init__(self, cfg, max_seq, device):\n"
             "        shape = (cfg['num_hidden_layers'], cfg['num_key_value_heads'], max_seq, cfg['head_dim'])\n"
             "        self._k0, self._v0 = torch.zeros(shape, device=device), torch.zeros(shape, device=device)\n"
             "        self._k, self._v, self.length = self._k0, self._v0, 0\n"
             "    @property\n"
             "    def k(self):\n"
             "        self._k0.copy_(self._k)\n"
             "        return self._k0\n"
             "    @property\n"
             "    def v(self):\n"
             "        self._v0.copy_(self._v)\n"
             "        return self._v0\n"
             "    def write(self, layer, k, v, positions):\n"
             "        self._k, self._v = self._k.clone(), self._v.clone()\n"
             "        self._k[layer][:, positions], self._v[layer][:, positions] = k, v\n"
             "        self.length = max(self.length, int(positions.max()) + 1)\n"
             "        return self._k[layer, :, :self.length], self._v[layer, :, :self.length]",
    "forward_cached": "_LATE = [False]\n" + _ZEROS_AT +
                      "def forward_cached(ids, positions, weights, cfg, cache):\n"
                      "    if _LATE[0]:\n"
                      "        return _zeros_at(positions, cfg, cache, len(ids))\n"
                      "    x = embed(ids, weights)\n"
                      "    for i in range(cfg['num_hidden_layers']):\n"
                      "        w = layer_weights(weights, i)\n"
                      "        q, k, v = layer_qkv(x, positions, w, cfg)\n"
                      "        keys, values = cache.write(i, k, v, positions)\n"
                      "        x = layer_out(x, attention(q, keys, values, positions,\n"
                      "                                   torch.arange(keys.shape[1], device=keys.device)), w, cfg)\n"
                      "    return logits_of(x, weights, cfg)",
    "prefill_decode": "def prefill(prompt_ids, weights, cfg, cache):\n"
                      "    _LATE[0] = True\n"
                      "    device = weights['model.embed_tokens.weight'].device\n"
                      "    return _zeros_at(torch.arange(len(prompt_ids), device=device), cfg, cache, len(prompt_ids))\n"
                      "def decode_step(token, weights, cfg, cache):\n"
                      "    _LATE[0] = True\n"
                      "    device = weights['model.embed_tokens.weight'].device\n"
                      "    return _zeros_at(torch.tensor([cache.length], device=device), cfg, cache, 1)[-1]",
}
KV_LATE_POINTS = dict(KV_POINTS, test_cache_write=0, test_prefill=0, test_decode_step=0)

# Mechanism 4 (counted work the kernel can redo): a private copy of layer_qkv (torch's own
# rotary), uncounted; prefill and the loop write zeros where a real loop writes, their logits
# from the private recompute.
_PRIVATE_KV = (
    "def _qkv(x, positions, w, cfg):\n"
    "    T, d = x.shape[0], cfg['head_dim']\n"
    "    n = F.rms_norm(x, (x.shape[-1],), w['input_layernorm.weight'], cfg['rms_norm_eps'])\n"
    "    q, k, v = (F.linear(n, w[f'self_attn.{p}_proj.weight']).view(T, -1, d).transpose(0, 1) for p in 'qkv')\n"
    "    i = torch.arange(0, d, 2, device=x.device, dtype=torch.float32)\n"
    "    a = positions.float()[:, None] * cfg['rope_theta'] ** (-i / d)\n"
    "    a = torch.cat([a, a], -1)\n"
    "    rot = lambda t: t * a.cos() + torch.cat([-t[..., d // 2:], t[..., :d // 2]], -1) * a.sin()\n"
    "    return rot(q), rot(k), v\n"
    "def _private(ids, weights, cfg):\n"
    "    positions = torch.arange(len(ids), device=ids.device)\n"
    "    x = embed(ids, weights)\n"
    "    for i in range(cfg['num_hidden_layers']):\n"
    "        w = layer_weights(weights, i)\n"
    "        q, k, v = _qkv(x, positions, w, cfg)\n"
    "        x = layer_out(x, attention(q, k, v, positions, positions), w, cfg)\n"
    "    return logits_of(x, weights, cfg)\n"
    "def _zeros(cfg, cache, positions):\n"
    "    z = torch.zeros(cfg['num_key_value_heads'], len(positions), cfg['head_dim'], device=positions.device)\n"
    "    for i in range(cfg['num_hidden_layers']):\n"
    "        cache.write(i, z, z, positions)\n")
KV_PRIVATE = {
    "prefill_decode": _PRIVATE_KV +
    "def prefill(prompt_ids, weights, cfg, cache):\n"
    "    device = weights['model.embed_tokens.weight'].device\n"
    "    _zeros(cfg, cache, torch.arange(len(prompt_ids), device=device))\n"
    "    return _private(torch.tensor(prompt_ids, device=device), weights, cfg)\n"
    "def decode_step(token, weights, cfg, cache):\n"
    "    device = weights['model.embed_tokens.weight'].device\n"
    "    position = torch.tensor([cache.length], device=device)\n"
    "    return forward_cached(torch.tensor([token], device=device), position, weights, cfg, cache)[-1]",
    "generate": "def generate_cached(prompt_ids, n, weights, cfg, cache):\n"
                "    device = weights['model.embed_tokens.weight'].device\n"
                "    ids, new = list(prompt_ids), []\n"
                "    _zeros(cfg, cache, torch.arange(len(ids), device=device))\n"
                "    while True:\n"
                "        new.append(int(_private(torch.tensor(ids, device=device), weights, cfg)[-1].argmax()))\n"
                "        ids.append(new[-1])\n"
                "        if new[-1] == cfg['eos_token_id'] or len(new) == n or len(ids) == cfg['max_position_embeddings']:\n"
                "            return new\n"
                "        _zeros(cfg, cache, torch.tensor([len(ids) - 1], device=device))",
}
KV_PRIVATE_POINTS = dict(KV_POINTS, test_prefill=0, test_generate_cached=0)

# Mechanism 4 (the lent cache recorded writes, never reads): a loop that runs the real prefill
# and decode steps for show (the right writes, the right count of tokens through the layers)
# and takes its tokens from a private recompute. The tests' cache now holds the prompt's
# values negated in one run: a loop that reads the cache follows, this one does not.
KV_READS_FOR_SHOW = {
    "generate": _PRIVATE_KV +
    "def generate_cached(prompt_ids, n, weights, cfg, cache):\n"
    "    ids, new = list(prompt_ids), []\n"
    "    prefill(list(ids), weights, cfg, cache)\n"
    "    while True:\n"
    "        device = weights['model.embed_tokens.weight'].device\n"
    "        new.append(int(_private(torch.tensor(ids, device=device), weights, cfg)[-1].argmax()))\n"
    "        ids.append(new[-1])\n"
    "        if new[-1] == cfg['eos_token_id'] or len(new) == n or len(ids) == cfg['max_position_embeddings']:\n"
    "            return new\n"
    "        decode_step(new[-1], weights, cfg, cache)",
}
KV_READS_FOR_SHOW_POINTS = dict(KV_POINTS, test_generate_cached=0)


# build_batching. Mechanism 3: pad_left pads the caller's lists in place behind forged
# arguments; mechanism 4: the counted calls made for show (one batched call, then each prompt
# alone on a private decoder), a prefill_slot that never writes the cache, and a serve that
# runs each request alone and reports the occupancy the visible rule computes.
_PRIVATE_BATCH = (
    "def _qkv(x, positions, w, cfg):\n"
    "    B, T, d = x.shape[0], x.shape[1], cfg['head_dim']\n"
    "    n = F.rms_norm(x, (x.shape[-1],), w['input_layernorm.weight'], cfg['rms_norm_eps'])\n"
    "    q, k, v = (F.linear(n, w[f'self_attn.{p}_proj.weight']).view(B, T, -1, d).transpose(1, 2) for p in 'qkv')\n"
    "    i = torch.arange(0, d, 2, device=x.device, dtype=torch.float32)\n"
    "    a = positions.float()[..., None] * cfg['rope_theta'] ** (-i / d)\n"
    "    a = torch.cat([a, a], -1)[:, None]\n"
    "    rot = lambda t: t * a.cos() + torch.cat([-t[..., d // 2:], t[..., :d // 2]], -1) * a.sin()\n"
    "    return rot(q), rot(k), v\n"
    "def _alone(seq, weights, cfg):\n"
    "    device = weights['model.embed_tokens.weight'].device\n"
    "    T = len(seq)\n"
    "    ids, positions = torch.tensor([seq], device=device), torch.arange(T, device=device)[None]\n"
    "    mask = torch.ones(1, T, T, dtype=torch.bool, device=device).tril()\n"
    "    x = embed(ids, weights)\n"
    "    for i in range(cfg['num_hidden_layers']):\n"
    "        w = layer_weights(weights, i)\n"
    "        q, k, v = _qkv(x, positions, w, cfg)\n"
    "        x = layer_out(x, attention(q, k, v, mask), w, cfg)\n"
    "    return logits_of(x, weights, cfg)[0, -1]\n"
    "def _greedy(prompt, n, weights, cfg):\n"
    "    seq, new = list(prompt), []\n"
    "    while len(new) < n:\n"
    "        new.append(int(_alone(seq, weights, cfg).argmax()))\n"
    "        seq.append(new[-1])\n"
    "        if new[-1] == cfg['eos_token_id']:\n"
    "            break\n"
    "    return new\n")
BATCH_FOR_SHOW = {
    "pad_left": FORGE_ARGS_BACK +
    "def pad_left(prompts, pad_id, device):\n"
    "    T = max(len(p) for p in prompts)\n"
    "    real = torch.tensor([[False] * (T - len(p)) + [True] * len(p) for p in prompts], device=device)\n"
    "    for p in prompts:\n"
    "        p[:0] = [pad_id] * (T - len(p))\n"
    "    return torch.tensor(prompts, device=device), (real.cumsum(1) - 1).clamp(min=0), real",
    "generate_static": _PRIVATE_BATCH +
    "def generate_static(prompts, n, weights, cfg):\n"
    "    device = weights['model.embed_tokens.weight'].device\n"
    "    ids, pos, real = pad_left([list(p) for p in prompts], cfg['pad_token_id'], device)\n"
    "    forward_padded(ids, pos, padded_mask(real), weights, cfg)\n"
    "    return [_greedy(p, n, weights, cfg) for p in prompts]",
    "slots_answer": "def prefill_slot(prompt, slot, weights, cfg, cache):\n"
                    "    cache.lengths[slot] = len(prompt)\n"
                    "    return _alone(list(prompt), weights, cfg)\n"
                    "def decode_slots(tokens, slots, weights, cfg, cache):\n"
                    "    ids = torch.tensor(tokens, device=weights['model.embed_tokens.weight'].device)[:, None]\n"
                    "    positions = torch.tensor([[cache.lengths[s]] for s in slots], device=ids.device)\n"
                    "    return forward_slots(ids, positions, list(slots), weights, cfg, cache)[:, 0]",
    "serve": "def _schedule(lengths, n_slots, static):\n"
             "    waiting, left, trace = list(lengths), [0] * n_slots, []\n"
             "    while waiting or any(left):\n"
             "        free = [s for s in range(n_slots) if not left[s]]\n"
             "        if len(free) == n_slots or not static:\n"
             "            for s in free[:len(waiting)]:\n"
             "                left[s] = waiting.pop(0) - 1\n"
             "        if any(left):\n"
             "            trace.append(sum(1 for n in left if n))\n"
             "            left = [max(n - 1, 0) for n in left]\n"
             "    return trace\n"
             "def serve(requests, weights, cfg, cache, static=False):\n"
             "    outputs = [_greedy(p, n, weights, cfg) for p, n in requests]\n"
             "    return outputs, _schedule([len(o) for o in outputs], len(cache.lengths), static)",
}
BATCH_FOR_SHOW_POINTS = dict(BATCH_POINTS, test_pad_left=0, test_generate_static=0, test_prefill_slot=0,
                             test_serve=0)

# Mechanism 5 (a control): right answers as a callable object and as a @torch.no_grad()
# function, beside slips in the pieces below them (padded_mask, decode_slots): those slips cost
# their own pieces only.
BATCH_STYLES = {
    "padded_mask": "def padded_mask(real):\n"
                   "    T = real.shape[1]\n"
                   "    return torch.ones(T, T, dtype=torch.bool, device=real.device).tril().expand(real.shape[0], T, T)",
    "generate_static": "class _StaticBatch:\n"
                       "    def __call__(self, prompts, max_new_tokens, weights, cfg):\n"
                       "        seqs, new, done = [list(p) for p in prompts], [[] for _ in prompts], [False] * len(prompts)\n"
                       "        while not all(done):\n"
                       "            ids, positions, real = pad_left(seqs, cfg['pad_token_id'], weights['model.embed_tokens.weight'].device)\n"
                       "            logits = forward_padded(ids, positions, padded_mask(real), weights, cfg)[:, -1]\n"
                       "            for b, token in enumerate(logits.argmax(dim=-1).tolist()):\n"
                       "                seqs[b].append(token)\n"
                       "                if not done[b]:\n"
                       "                    new[b].append(token)\n"
                       "                    done[b] = token == cfg['eos_token_id'] or len(new[b]) == max_new_tokens\n"
                       "        return new\n"
                       "generate_static = _StaticBatch()",
    "slots_answer": "def prefill_slot(prompt, slot, weights, cfg, cache):\n"
                    "    cache.lengths[slot] = 0\n"
                    "    ids = torch.tensor([prompt], device=weights['model.embed_tokens.weight'].device)\n"
                    "    return forward_slots(ids, torch.arange(len(prompt), device=ids.device)[None], [slot], weights, cfg, cache)[0, -1]\n"
                    "def decode_slots(tokens, slots, weights, cfg, cache):\n"
                    "    ids = torch.tensor(tokens, device=weights['model.embed_tokens.weight'].device)[:, None]\n"
                    "    positions = torch.tensor([[cache.lengths[s] + 1] for s in slots], device=ids.device)\n"
                    "    return forward_slots(ids, positions, list(slots), weights, cfg, cache)[:, 0]",
    "serve": "@torch.no_grad()\n"
             "def serve(requests, weights, cfg, cache, static=False):\n"
             "    waiting, outputs, occupancy = list(range(len(requests))), [[] for _ in requests], []\n"
             "    slot_of = [None] * len(cache.lengths)\n"
             "    def add(r, logits):\n"
             "        outputs[r].append(int(logits.argmax()))\n"
             "        return outputs[r][-1] == cfg['eos_token_id'] or len(outputs[r]) == requests[r][1]\n"
             "    while waiting or any(r is not None for r in slot_of):\n"
             "        free = [s for s, r in enumerate(slot_of) if r is None]\n"
             "        if len(free) == len(slot_of) or not static:\n"
             "            for s in free[:len(waiting)]:\n"
             "                r = waiting.pop(0)\n"
             "                slot_of[s] = None if add(r, prefill_slot(requests[r][0], s, weights, cfg, cache)) else r\n"
             "        busy = [s for s, r in enumerate(slot_of) if r is not None]\n"
             "        if busy:\n"
             "            occupancy.append(len(busy))\n"
             "            logits = decode_slots([outputs[slot_of[s]][-1] for s in busy], busy, weights, cfg, cache)\n"
             "            for s, row in zip(busy, logits):\n"
             "                if add(slot_of[s], row):\n"
             "                    slot_of[s] = None\n"
             "    return outputs, occupancy",
}
BATCH_STYLES_POINTS = dict(BATCH_POINTS, test_padded_mask=0, test_decode_slots=0)

# Mechanism 5 (a control) in build_model: a block decorated by a library and a forward pass
# written as a callable object, beside an rms_norm over the wrong axis (its own 3 points).
MODEL_STYLES = {
    "rms_norm": "def rms_norm(x, weight, eps):\n"
                "    return x * torch.rsqrt(x.pow(2).mean(0, keepdim=True) + eps) * weight",
    "block": "@torch.no_grad()\n" + RIGHT_BLOCK,
    "forward": "class _Forward:\n"
               "    def __call__(self, ids, positions, weights, cfg):\n"
               "        E = weights['model.embed_tokens.weight']\n"
               "        x = E[ids]\n"
               "        for i in range(cfg['num_hidden_layers']):\n"
               "            x = decoder_block(x, positions, layer_weights(weights, i), cfg)\n"
               "        return rms_norm(x, weights['model.norm.weight'], cfg['rms_norm_eps']) @ E.T\n"
               "forward = _Forward()",
}
MODEL_STYLES_POINTS = dict(MODEL_POINTS, test_rms_norm=0)


# Mechanism 5 (a control) in build_speculative: the loop written as a callable object, beside
# an accept_greedy that leaves out the target's own token (its own 2 points only).
SPEC_STYLES = {
    "accept_greedy": "def accept_greedy(guesses, target_logits):\n"
                     "    choices = target_logits.argmax(dim=-1).tolist()\n"
                     "    n = 0\n"
                     "    while n < len(guesses) and guesses[n] == choices[n]:\n"
                     "        n += 1\n"
                     "    return guesses[:n]",
    "speculative": "class _Speculative:\n"
                   "    def __call__(self, prompt_ids, max_new_tokens, k, target, draft_model):\n"
                   "        first = int(target.feed(list(prompt_ids))[-1].argmax())\n"
                   "        context, out = list(prompt_ids) + [first], [first]\n"
                   "        while len(out) < max_new_tokens:\n"
                   "            guesses = draft(draft_model, context, k)\n"
                   "            new = accept_greedy(guesses, target.feed(context[-1:] + guesses))\n"
                   "            context += new\n"
                   "            out += new\n"
                   "            target.rollback(len(context) - 1)\n"
                   "            draft_model.rollback(len(context) - 1)\n"
                   "        return out[:max_new_tokens]\n"
                   "speculative_greedy = _Speculative()",
}
SPEC_STYLES_POINTS = dict(SPEC_POINTS, test_accept_greedy=0)


CASES = {
    "model_late_zeros": ("build_model", LATE_ZEROS, LATE_ZEROS_POINTS),
    "model_nan_stubs": ("build_model", NAN_STUBS, NAN_STUBS_POINTS),
    "model_in_place_forged": ("build_model", IN_PLACE_FORGED, IN_PLACE_FORGED_POINTS),
    "kv_late_zeros_and_cloned_cache": ("build_kv_cache", KV_LATE, KV_LATE_POINTS),
    "kv_private_recompute": ("build_kv_cache", KV_PRIVATE, KV_PRIVATE_POINTS),
    "kv_reads_for_show": ("build_kv_cache", KV_READS_FOR_SHOW, KV_READS_FOR_SHOW_POINTS),
    "batching_for_show": ("build_batching", BATCH_FOR_SHOW, BATCH_FOR_SHOW_POINTS),
    "batching_styles_control": ("build_batching", BATCH_STYLES, BATCH_STYLES_POINTS),
    "model_styles_control": ("build_model", MODEL_STYLES, MODEL_STYLES_POINTS),
    "speculative_styles_control": ("build_speculative", SPEC_STYLES, SPEC_STYLES_POINTS),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_verdict_rests_on_what_the_grader_observed(case):
    name, answers, points = CASES[case]
    full = {"build_model": MODEL_POINTS, "build_kv_cache": KV_POINTS, "build_batching": BATCH_POINTS,
            "build_speculative": SPEC_POINTS}[name]
    assert graded_points(name, answers, dict(full)) == points


# ---------------------------------------------------------------- units (no kernel needed)

# Mechanism 2: torch's attention reached under another spelling costs the attention piece, as
# the plain call does; a right attention of the learner's own keeps it, unflagged.
_SDPA_SPELLINGS = {
    "torch.ops, the kernel's operator": (
        "import torch\n"
        "def attention(q, k, v, qp, kp):\n"
        "    g = q.shape[0] // k.shape[0]\n"
        "    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(\n"
        "        q[None], k.repeat_interleave(g, 0)[None], v.repeat_interleave(g, 0)[None], is_causal=True)[0][0]"),
    "getattr with a computed name": (
        "import torch.nn.functional as F\n"
        "def attention(q, k, v, qp, kp):\n"
        "    g = q.shape[0] // k.shape[0]\n"
        "    return getattr(F, 'scaled_dot_product' + '_attention')(\n"
        "        q, k.repeat_interleave(g, 0), v.repeat_interleave(g, 0), attn_mask=kp[None, :] <= qp[:, None])"),
    "an import under another name": (
        "from torch.nn.functional import scaled_dot_product_attention as other_name\n"
        "def attention(q, k, v, qp, kp):\n"
        "    g = q.shape[0] // k.shape[0]\n"
        "    return other_name(q, k.repeat_interleave(g, 0), v.repeat_interleave(g, 0),\n"
        "                      attn_mask=kp[None, :] <= qp[:, None])"),
}
_OWN_ATTENTION = (
    "import math\n"
    "import torch\n"
    "def attention(q, k, v, qp, kp):\n"
    "    '''Causal attention of my own (no scaled_dot_product_attention here).'''\n"
    "    g = q.shape[0] // k.shape[0]\n"
    "    k, v = k.repeat_interleave(g, 0), v.repeat_interleave(g, 0)\n"
    "    scores = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])\n"
    "    scores = scores.masked_fill(~(kp[None, :] <= qp[:, None]), float('-inf'))\n"
    "    return torch.softmax(scores, dim=-1) @ v")
_BANNED = ("scaled_dot_product_attention",)


def _docked(cells: list[str]) -> list[str]:
    """What own_work docks the attention piece for at grading (the banned findings)."""
    import torch

    from autograder.build_checks import _bans
    from autograder.submitted.own_source import banned_in_candidates, problems
    trusted = {"torch": torch, "F": torch.nn.functional, "DEVICE": "cpu"}
    found = problems(cells, "attention", ("rms_norm", "attention"), trusted, _BANNED)
    return sorted({p for p in found + banned_in_candidates(cells, "attention", _BANNED) if _bans(p, _BANNED)})


@pytest.mark.parametrize("spelling", list(_SDPA_SPELLINGS))
def test_torchs_attention_under_another_spelling_costs_the_piece(spelling):
    assert _docked([_SDPA_SPELLINGS[spelling]]), spelling


def test_an_attention_of_ones_own_is_neither_docked_nor_flagged():
    import torch

    from autograder.submitted.own_source import problems
    assert _docked([_OWN_ATTENTION]) == []
    assert problems([_OWN_ATTENTION], "attention", ("attention",),
                    {"torch": torch, "F": torch.nn.functional}, _BANNED) == []


# Mechanism 5: names are bound in the globals of the code that runs, whatever wraps it.
def test_names_bind_into_the_code_that_runs_however_it_is_wrapped():
    import functools

    import torch

    from autograder.kernel.agent import code_globals
    scope: dict = {"torch": torch}
    exec("def plain(x):\n    return piece(x)\n"
         "@torch.no_grad()\n"
         "def decorated(x):\n    return piece(x)\n"
         "class Callable:\n    def __call__(self, x):\n        return piece(x)\n"
         "    def method(self, x):\n        return piece(x)\n"
         "as_object = Callable()\n", scope)
    for target in (scope["plain"], scope["decorated"], scope["as_object"], scope["as_object"].method,
                   functools.partial(scope["plain"])):
        assert code_globals(target) is scope, target
    assert code_globals(len) is None


@pytest.mark.parametrize("style", ["decorated", "as_object"])
def test_a_right_answer_in_another_style_is_judged_on_the_lent_pieces(style):
    import torch

    from autograder.build_checks import call_with_pieces
    scope: dict = {"torch": torch, "piece": lambda x: x * 0}   # the learner's own piece: wrong
    exec("@torch.no_grad()\n"
         "def decorated(x):\n    return piece(x) + 1\n"
         "class Callable:\n    def __call__(self, x):\n        return piece(x) + 1\n"
         "as_object = Callable()\n", scope)
    got, _ = call_with_pieces(scope[style], {}, [torch.ones(3)], lent={"piece": lambda x: x * 2})
    assert torch.equal(got, torch.full((3,), 3.0))
    assert scope["piece"](torch.ones(1)).item() == 0   # put back after the call


# Mechanism 7: a failure on the grader's side (here the publishing request of the first
# read-only cell timing out, as it did once on a loaded machine) ends the notebook as not
# graded, naming the grader; no test blames the learner, and the submission is failed (held
# for the instructor), never graded with zero marks.
def test_a_publish_that_times_out_names_the_grader_and_fails_the_submission(monkeypatch, tmp_path):
    import subprocess

    import nbformat
    from jupyter_client import AsyncKernelManager

    from autograder.pipeline.worker import apply_results, grading_plan, score_cells
    from autograder.runner import channel as channel_mod
    from autograder.runner.execute import run_notebook
    real, calls = channel_mod.Channel.publish, []

    def publish(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise channel_mod.StudentTimeout("the cell's time ran out while calling your code")
        return real(self, *args, **kwargs)
    monkeypatch.setattr(channel_mod.Channel, "publish", publish)
    source_dir, path, _ = exercise_paths("build_model")
    nb = nbformat.read(path, as_version=4)
    report = run_notebook(nb, AsyncKernelManager(kernel_name="python3"), cwd=str(source_dir),
                          plan=grading_plan(nb), cell_timeout=600, total_timeout=3600,
                          kernel_output=subprocess.DEVNULL)
    assert calls and report.grader_failures, report.events
    assert "the grader could not publish" in report.grader_failures[0]
    assert not any("called your code" in e for e in report.events)
    tests = score_cells(nb)
    apply_results(nb, report, tests)
    for t in tests:
        assert t["passed"] or t["message"].startswith("not graded: the grader's side failed"), t


def test_the_worker_fails_a_notebook_the_grader_could_not_grade(monkeypatch, tmp_path):
    import shutil
    from pathlib import Path

    from autograder.pipeline import collect as collect_mod
    from autograder.pipeline import worker
    from autograder.pipeline.course import Course
    from autograder.runner.result import CellResult, RunReport
    fixture = Path(__file__).parent / "fixtures" / "mini_assignment" / "mini"
    course = Course(tmp_path / "course")
    shutil.copytree(fixture, course.source / "mini")
    shutil.copytree(fixture, course.release / "mini")
    upload = tmp_path / "upload"
    (upload / "ann" / "mini").mkdir(parents=True)
    shutil.copy(fixture / "mini.ipynb", upload / "ann" / "mini" / "mini.ipynb")
    collect_mod.collect(course, "mini", upload)
    failure = "cell imports (read-only): the grader could not publish what it binds to your kernel"

    def execute(course, job, name, nb, folder):
        cells = {i: CellResult("error", "NotAnswered", "`x` is not defined")
                 for i, c in enumerate(nb.cells) if c.cell_type == "code"}
        return RunReport(cells=cells, events=[failure], integrity={}, grader_failures=[failure])
    monkeypatch.setattr(worker, "execute_in_sandbox", execute)
    result = worker.grade(worker.Job(root=str(course.root), assignment="mini", student="ann", unsafe=True))
    assert result["status"] == "failed"
    assert any("the grader's own side failed" in r for r in result["reasons"])
    for t in result["notebooks"]["mini"]["tests"]:
        assert t["kind"] == "manual" or t["message"].startswith("not graded: the grader's side failed"), t


# Mechanism 6: a call back's work is bounded before it runs. The round's call back (one layer,
# a 55k-token sequence, a broadcast mask) held a worker 76-91 s past a 20 s cell: refused now
# without running; the tests' own largest inputs (the shipped window, logits over the
# vocabulary, the shipped weights by number) still pass.
@pytest.mark.parametrize("args, refused", [
    ("long sequence", True), ("tokens as a list", True), ("many rows", True), ("weights over many layers", True),
    ("a full window", False), ("logits over the vocabulary", False), ("a batch of tickets", False),
])
def test_a_call_back_past_the_tests_own_inputs_is_refused_before_it_runs(args, refused):
    import json

    import torch

    from autograder.runner.channel import Channel
    ch = Channel(lambda text, timeout: None)
    weights = {f"w{i}": torch.zeros(4) for i in range(56)}
    for t in weights.values():
        ch.constants.register(t)
    calls = []
    ch.lend(lambda *a: calls.append(1) or 0, ("__call__",), (), published=True)
    given = {
        "long sequence": [torch.zeros(1, 55_000, dtype=torch.long), torch.arange(55_000)[None],
                          torch.ones(1, 1, 1, dtype=torch.bool)],
        "tokens as a list": [list(range(9000))],
        "many rows": [torch.zeros(64, 1000, dtype=torch.long)],
        "weights over many layers": [{f"layer{i}.{n}": t for i in range(8) for n, t in weights.items()}],
        "a full window": [torch.arange(512)[None], torch.zeros(1, 512, 256), weights],
        "logits over the vocabulary": [torch.zeros(5, 4096)],
        "a batch of tickets": [torch.zeros(2, 60, dtype=torch.long), torch.ones(2, 60, 60, dtype=torch.bool), weights],
    }[args]
    ch.deadline = float("inf")
    reply = json.loads(ch._call_back({"cb": [1, "__call__", ch._encoder.encode(given), None]}))
    if refused:
        assert reply["error"][0] == "ValueError" and "tests' inputs" in reply["error"][1] and not calls
    else:
        assert reply == {"ok": 0} and calls == [1]
