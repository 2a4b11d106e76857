"""A yardstick: greedy decoding of our model in one plain function, no modules, no cache class.

It reads the same weights as :class:`~tinyserve.model.TinyLlama` and must produce the same
tokens (``bench hf`` asserts it), but it knows every row shares one position, so it needs no
mask, no position bookkeeping and no checks. What is left is the work a decode step cannot
avoid: about 15 tensor operations per layer. The gap between this loop and the engine's own
loop is the price of the engine's generality (Python and dispatch), not of the arithmetic.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from tinyserve.model import TinyLlama


@torch.inference_mode()
def plain_greedy(model: TinyLlama, prompts: list[list[int]], n_new: int) -> list[list[int]]:
    """``n_new`` greedy tokens for each prompt; every prompt must have the same length."""
    if len({len(p) for p in prompts}) != 1:
        raise ValueError("plain_greedy takes prompts of one length (it has no padding mask)")
    cfg, dev = model.config, model.device
    H, KV, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    eps, n_rep = cfg.rms_norm_eps, cfg.num_attention_heads // cfg.num_key_value_heads
    layers = [(l.input_layernorm.weight, l.post_attention_layernorm.weight,
               torch.cat([l.self_attn.q_proj.weight, l.self_attn.k_proj.weight,
                          l.self_attn.v_proj.weight]), l.self_attn.o_proj.weight,
               torch.cat([l.mlp.gate_proj.weight, l.mlp.up_proj.weight]), l.mlp.down_proj.weight)
              for l in model.model.layers]
    emb, final_norm, head = (model.model.embed_tokens.weight, model.model.norm.weight,
                             model.lm_head.weight)
    inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, D, 2, device=dev).float() / D)
    angles = torch.arange(cfg.max_position_embeddings, device=dev).float()[:, None] * inv_freq
    cos = torch.cat([angles, angles], -1).cos().to(emb.dtype)            # (window, D)
    sin = torch.cat([-angles.sin(), angles.sin()], -1).to(emb.dtype)      # sign folded in
    ids = torch.tensor(prompts, device=dev)
    B, T = ids.shape
    k_cache = torch.zeros(len(layers), B, KV, T + n_new, D, device=dev, dtype=emb.dtype)
    v_cache = torch.zeros_like(k_cache)

    def forward(x: Tensor, start: int) -> Tensor:           # x (B, t, hidden), positions start..
        t = x.shape[1]
        c, s = cos[start:start + t], sin[start:start + t]
        for i, (n1, n2, w_qkv, w_o, w_gu, w_down) in enumerate(layers):
            q, k, v = F.linear(F.rms_norm(x, (x.shape[-1],), n1, eps), w_qkv).split(
                [H * D, KV * D, KV * D], -1)
            q = q.view(B, t, H, D).transpose(1, 2)
            k = k.view(B, t, KV, D).transpose(1, 2)
            q, k = q * c + q.roll(D // 2, -1) * s, k * c + k.roll(D // 2, -1) * s
            k_cache[i, :, :, start:start + t] = k
            v_cache[i, :, :, start:start + t] = v.view(B, t, KV, D).transpose(1, 2)
            keys, values = k_cache[i, :, :, :start + t], v_cache[i, :, :, :start + t]
            out = F.scaled_dot_product_attention(q, keys, values, is_causal=t > 1,
                                                 enable_gqa=n_rep > 1)
            x = x + F.linear(out.transpose(1, 2).reshape(B, t, H * D), w_o)
            gate, up = F.linear(F.rms_norm(x, (x.shape[-1],), n2, eps), w_gu).chunk(2, -1)
            x = x + F.linear(F.silu(gate) * up, w_down)
        return F.linear(F.rms_norm(x[:, -1], (x.shape[-1],), final_norm, eps), head)

    token = forward(emb[ids], 0).argmax(-1)
    out = [token]
    for step in range(n_new - 1):
        token = forward(emb[token][:, None], T + step).argmax(-1)
        out.append(token)
    return torch.stack(out, 1).tolist()
