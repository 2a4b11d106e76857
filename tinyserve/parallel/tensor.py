"""Tensor parallelism: one model split across ranks by attention heads and MLP columns.

Every rank holds a slice of every layer and all ranks work on the same tokens at once:

- **attention, split by heads.** ``q_proj``, ``k_proj`` and ``v_proj`` are *column*-parallel:
  rank r keeps the output rows of its own heads. With grouped-query attention the split is by
  *groups*: the target's 8 query / 2 KV heads on 2 ranks give each rank 4 query heads and the
  1 KV head they read, so attention runs with no communication at all, and each rank caches
  only its own KV head. ``o_proj`` is *row*-parallel: rank r keeps the input columns that
  read its heads, so its output is a partial sum of the full ``o_proj(attn)``.
- **MLP, column then row.** ``gate_proj`` and ``up_proj`` are split by output columns (SiLU and
  the product act element-wise, so each rank can apply them to its own columns), then
  ``down_proj`` by input rows: again a partial sum.

Adding the partial sums is the one all-reduce after attention and the one after the MLP:
**two all-reduces per block**, each of ``batch x tokens x hidden`` numbers. Embedding, norms
and the LM head stay replicated (every rank computes them whole), so after each all-reduce
every rank holds the same hidden state and picks the same next token.

:func:`tp_forward_in_process` runs the same split in one process (the all-reduce is a plain
sum over the shards), which checks the math without any processes. Real ranks are started by
:func:`tinyserve.parallel.launch.launch`; :func:`tp_check_worker` is what each rank runs to check the
split against the model, and :mod:`tinyserve.parallel.timing` times it.
"""
from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ..config import ModelConfig
from ..generate import clock, prefill
from ..kv_cache import KVCache
from .launch import rank_device
from ..model import MLP, Attention, KVStore, TinyLlama, rope_cos_sin

AllReduce = Callable[[Tensor], Tensor]


# ---------------------------------------------------------------------------- the split

def check_split(cfg: ModelConfig, world_size: int) -> None:
    """Raise unless every rank can own whole heads, whole KV groups and equal MLP slices."""
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    for name, n in (("num_attention_heads", cfg.num_attention_heads),
                    ("num_key_value_heads", cfg.num_key_value_heads),
                    ("intermediate_size", cfg.intermediate_size)):
        if n % world_size:
            raise ValueError(
                f"{name}={n} does not split evenly over {world_size} ranks; tensor parallelism "
                f"here gives each rank whole KV groups, so use a world size that divides "
                f"num_key_value_heads={cfg.num_key_value_heads}, num_attention_heads="
                f"{cfg.num_attention_heads} and intermediate_size={cfg.intermediate_size}")


def _linear(weight: Tensor) -> nn.Linear:
    out_features, in_features = weight.shape
    layer = nn.Linear(in_features, out_features, bias=False, device=weight.device,
                      dtype=weight.dtype)
    layer.weight = nn.Parameter(weight.detach().clone(), requires_grad=False)
    return layer


def column_shard(layer: nn.Linear, rank: int, world_size: int) -> nn.Linear:
    """Rank's slice of the *outputs*: ``y[..., slice] = x @ W[slice].T`` needs no communication."""
    n = layer.out_features // world_size
    return _linear(layer.weight[rank * n:(rank + 1) * n])


def row_shard(layer: nn.Linear, rank: int, world_size: int) -> nn.Linear:
    """Rank's slice of the *inputs*: its output is a partial sum; the ranks' sum is ``x @ W.T``."""
    n = layer.in_features // world_size
    return _linear(layer.weight[:, rank * n:(rank + 1) * n])


def _shard_attention(attn: Attention, cfg: ModelConfig, rank: int, ws: int) -> Attention:
    # Reuse the model's Attention (same forward, same mask and cache calls) with fewer heads.
    # Heads are contiguous blocks of head_dim rows, and query heads h..h+n_rep-1 read KV head
    # h // n_rep, so contiguous slices keep every rank's query heads with their KV head.
    local = copy.copy(attn)
    local._modules = dict(attn._modules)
    local.n_heads, local.n_kv = cfg.num_attention_heads // ws, cfg.num_key_value_heads // ws
    local.q_proj = column_shard(attn.q_proj, rank, ws)
    local.k_proj = column_shard(attn.k_proj, rank, ws)
    local.v_proj = column_shard(attn.v_proj, rank, ws)
    local.o_proj = row_shard(attn.o_proj, rank, ws)
    return local


def _shard_mlp(mlp: MLP, rank: int, ws: int) -> MLP:
    local = copy.copy(mlp)
    local._modules = dict(mlp._modules)
    local.gate_proj = column_shard(mlp.gate_proj, rank, ws)
    local.up_proj = column_shard(mlp.up_proj, rank, ws)
    local.down_proj = row_shard(mlp.down_proj, rank, ws)
    return local


def prepare_positions(cfg: ModelConfig, input_ids: Tensor, positions: Tensor | None,
                      dtype: torch.dtype, cache: KVStore | None = None
                      ) -> tuple[Tensor, Tensor, Tensor, bool]:
    """The model's preamble (as :meth:`TinyLlama.forward`): positions, the context-window
    check, rotary cos/sin, and whether the positions are the plain 0..T-1 of an uncached pass.

    Positions known on the host are checked on the host: with ``positions=None`` they are
    0..T-1, or, with a cache that keeps its lengths (``step_positions``), the ones it says come
    next (it checks the window itself). Only explicit positions are read back from the device
    for the check (on a GPU, a synchronisation); a compiled step skips that read."""
    B, T = input_ids.shape[:2]
    limit = cfg.max_position_embeddings
    contiguous = positions is None and cache is None
    if positions is None and hasattr(cache, "step_positions"):
        positions = cache.step_positions(B, T)   # type: ignore[union-attr]
    elif positions is None:
        if T > limit:
            raise ValueError(_outside_window(T - 1, limit))
        positions = torch.arange(T, device=input_ids.device)
    elif T and not torch.compiler.is_compiling() and int(positions.max()) >= limit:
        raise ValueError(_outside_window(int(positions.max()), limit))
    if positions.dim() == 1:
        positions = positions.expand(B, T)
    cos, sin = rope_cos_sin(positions, cfg.head_dim, cfg.rope_theta, dtype)
    return positions, cos, sin, contiguous


def _outside_window(position: int, limit: int) -> str:
    return (f"position {position} is outside the context window of {limit} tokens; shorten "
            f"the prompt or lower max_tokens so prompt + output <= {limit}.")


def dist_all_reduce(t: Tensor) -> Tensor:
    """Sum ``t`` over every rank, in place; every rank gets the same sum."""
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


class CountingAllReduce:
    """An all-reduce that counts its calls and the seconds spent in them: tests check the
    count the split promises, the bench reports the share of forward time it takes."""

    def __init__(self, inner: AllReduce = dist_all_reduce) -> None:
        self.inner = inner
        self.reset()

    def reset(self) -> None:
        self.calls, self.seconds, self.elements = 0, 0.0, 0

    def __call__(self, t: Tensor) -> Tensor:
        start = clock(t.device)
        out = self.inner(t)
        self.seconds += clock(t.device) - start
        self.calls += 1
        self.elements += t.numel()
        return out


class TPShard(nn.Module):
    """One rank's part of the model: its heads and MLP columns of every layer, the replicated
    embedding, norms and LM head. Called like the model: ``shard(ids, positions, cache)``."""

    def __init__(self, model: TinyLlama, rank: int, world_size: int,
                 all_reduce: AllReduce = dist_all_reduce) -> None:
        super().__init__()
        cfg = model.config
        check_split(cfg, world_size)
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in 0..{world_size - 1}, got {rank}")
        self.config, self.rank, self.world_size, self.all_reduce = cfg, rank, world_size, all_reduce
        self.embed_tokens = copy.deepcopy(model.model.embed_tokens)
        self.norm = copy.deepcopy(model.model.norm)
        self.lm_head = _linear(model.lm_head.weight)
        if cfg.tie_word_embeddings:  # keep one matrix for reading and scoring tokens
            self.lm_head.weight = self.embed_tokens.weight
        self.layers = nn.ModuleList()
        for layer in model.model.layers:
            block = nn.Module()
            block.input_layernorm = copy.deepcopy(layer.input_layernorm)
            block.self_attn = _shard_attention(layer.self_attn, cfg, rank, world_size)
            block.post_attention_layernorm = copy.deepcopy(layer.post_attention_layernorm)
            block.mlp = _shard_mlp(layer.mlp, rank, world_size)
            self.layers.append(block)
        self.requires_grad_(False)
        self.eval()

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def local_config(self) -> ModelConfig:
        """The shape of this rank's attention: its query and KV heads, same head_dim."""
        ws, cfg = self.world_size, self.config
        return replace(cfg, hidden_size=cfg.hidden_size // ws,
                       num_attention_heads=cfg.num_attention_heads // ws,
                       num_key_value_heads=cfg.num_key_value_heads // ws)

    def new_cache(self, batch_size: int = 1, max_seq: int | None = None) -> KVCache:
        """A KV cache for this rank's KV heads only (1/world_size of the full cache)."""
        return KVCache(self.local_config, batch_size, max_seq, device=self.device, dtype=self.dtype)

    def attention_partial(self, i: int, x: Tensor, positions: Tensor, cos: Tensor, sin: Tensor,
                          cache: KVStore | None, contiguous: bool) -> Tensor:
        """Block i's attention on this rank's heads: a partial sum of the full output."""
        block = self.layers[i]
        return block.self_attn(block.input_layernorm(x), positions, cos, sin, cache, contiguous)

    def mlp_partial(self, i: int, x: Tensor) -> Tensor:
        """Block i's MLP on this rank's columns: a partial sum of the full output."""
        block = self.layers[i]
        return block.mlp(block.post_attention_layernorm(x))

    def forward(self, input_ids: Tensor, positions: Tensor | None = None,
                cache: KVStore | None = None, logits_at: Tensor | None = None) -> Tensor:
        positions, cos, sin, contiguous = prepare_positions(self.config, input_ids, positions,
                                                            self.dtype, cache)
        x = self.embed_tokens(input_ids)
        for i in range(len(self.layers)):
            x = x + self.all_reduce(self.attention_partial(i, x, positions, cos, sin, cache,
                                                           contiguous))
            x = x + self.all_reduce(self.mlp_partial(i, x))
        if logits_at is not None:        # as TinyLlama.forward: only the positions asked for
            x = x[:, logits_at]
        return self.lm_head(self.norm(x)).float()


def shard_model(model: TinyLlama, rank: int, world_size: int,
                all_reduce: AllReduce = dist_all_reduce) -> TPShard:
    """Rank ``rank``'s tensor-parallel shard of ``model`` (the model is not changed)."""
    return TPShard(model, rank, world_size, all_reduce)


@torch.no_grad()
def tp_forward_in_process(model: TinyLlama, world_size: int, input_ids: Tensor,
                          positions: Tensor | None = None) -> tuple[Tensor, int]:
    """Run every shard in this process, the all-reduce replaced by a sum over shards.

    Returns the logits and the number of sums (all-reduces) the forward pass needed. Equal
    logits prove the split math; a real run only moves the sums between processes.
    """
    shards = [shard_model(model, r, world_size) for r in range(world_size)]
    first = shards[0]  # replicated parts: any shard's copy will do
    positions, cos, sin, contiguous = prepare_positions(model.config, input_ids, positions,
                                                        first.dtype)
    x, reductions = first.embed_tokens(input_ids), 0
    for i in range(len(first.layers)):
        x = x + sum(s.attention_partial(i, x, positions, cos, sin, None, contiguous)
                    for s in shards)
        x = x + sum(s.mlp_partial(i, x) for s in shards)
        reductions += 2
    return first.lm_head(first.norm(x)).float(), reductions


# ---------------------------------------------------------------------------- what each rank runs

@torch.no_grad()
def greedy_tokens(model: torch.nn.Module, cache: KVCache, prompt_ids: list[int],
                  max_tokens: int) -> list[int]:
    """Greedy generation through any model-like callable and its cache (a shard included).

    Each step's position comes from the cache's lengths (``positions=None``), known on the
    host: the one value a step reads back is its token."""
    device = cache.k.device
    logits = prefill(model, torch.tensor([prompt_ids], device=device), cache)[:, -1]
    tokens: list[int] = []
    for step in range(max_tokens):
        token = logits.argmax(-1)                            # (1,)
        tokens.append(int(token))
        if step < max_tokens - 1:
            with torch.inference_mode():
                logits = model(token[:, None], None, cache)[:, -1]
    return tokens


@torch.no_grad()
def tp_check_worker(rank: int, world_size: int, model: TinyLlama, input_ids: Tensor,
                    prompt_ids: list[int], max_tokens: int) -> dict[str, Any]:
    """One rank: shard the model, run one forward pass over ``input_ids`` counting the
    all-reduces, then generate greedily with a KV cache of this rank's KV heads only."""
    device = rank_device(rank)
    counter = CountingAllReduce()
    shard = shard_model(model, rank, world_size, counter).to(device)
    logits = shard(input_ids.to(device))
    per_forward = counter.calls
    cache = shard.new_cache(1, len(prompt_ids) + max_tokens)
    tokens = greedy_tokens(shard, cache, prompt_ids, max_tokens)
    return {"logits": logits.cpu(), "all_reduces_per_forward": per_forward, "tokens": tokens,
            "cache_kv_heads": cache.k.shape[2], "cache_bytes": cache.nbytes,
            "q_heads": shard.layers[0].self_attn.n_heads}
