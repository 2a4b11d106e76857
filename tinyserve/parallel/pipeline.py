"""Pipeline parallelism: the layers split into stages on different ranks, micro-batches
flowing through them.

Stage s holds a contiguous run of layers (the first stage also the embedding, the last the
final norm and the LM head). A batch is cut into m micro-batches. Stage s receives
micro-batch i's hidden states from stage s - 1, runs its layers and sends the result on to
stage s + 1, then starts on micro-batch i + 1 while the next stage works on i. Only
activations cross between ranks (micro-batch x tokens x hidden numbers at each boundary) and
no weight is split, so every layer computes exactly what it computes in the plain model.

The price is the **bubble**. Stage s waits s stage-steps for its first input, and once it has
sent its last micro-batch it idles while the later stages finish. With p equal stages and m
micro-batches a pass takes m + p - 1 stage-steps and each stage is busy for m of them, so
the idle share is (p - 1) / (m + p - 1): more micro-batches shrink it, and batch-1 decode
(one micro-batch) keeps only one of the p stages busy at a time.
"""
from __future__ import annotations

import copy
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ..config import ModelConfig
from ..generate import clock
from ..kv_cache import KVCache
from .launch import rank_device
from ..model import TinyLlama
from .tensor import prepare_positions

Timeline = list[tuple[float, float]]  # one (start, end) clock reading per micro-batch


def stage_bounds(num_layers: int, stages: int,
                 split: list[int] | None = None) -> list[tuple[int, int]]:
    """[first, last + 1) layer of each stage; an even split unless ``split`` gives the counts."""
    if split is None:
        if not 1 <= stages <= num_layers:
            raise ValueError(f"cannot make {stages} stages out of {num_layers} layers; use "
                             f"between 1 and {num_layers} stages (each needs a layer)")
        base, extra = divmod(num_layers, stages)
        split = [base + (s < extra) for s in range(stages)]
    if len(split) != stages or sum(split) != num_layers or min(split) < 1:
        raise ValueError(f"split {split} must give each of the {stages} stages at least one "
                         f"layer and add up to the model's {num_layers} layers")
    bounds, first = [], 0
    for n in split:
        bounds.append((first, first + n))
        first += n
    return bounds


def bubble_formula(stages: int, micro_batches: int) -> float:
    """Idle share of p equal stages running m micro-batches: (p - 1) / (m + p - 1)."""
    return (stages - 1) / (micro_batches + stages - 1)


def measured_bubble(timelines: list[Timeline]) -> float:
    """Idle share of the stages (one timeline per stage) between the first compute start and
    the last compute end: 1 - busy / (stages x span). Waiting on a send or receive counts as
    idle, so communication shows up here as a larger bubble."""
    starts = [s for tl in timelines for s, _ in tl]
    ends = [e for tl in timelines for _, e in tl]
    span = max(ends) - min(starts)
    busy = sum(e - s for tl in timelines for s, e in tl)
    return 1.0 - busy / (len(timelines) * span)


def ideal_timelines(stages: int, micro_batches: int, step: float = 1.0) -> list[Timeline]:
    """The textbook schedule: stage s runs micro-batch i during [s + i, s + i + 1) steps."""
    return [[((s + i) * step, (s + i + 1) * step) for i in range(micro_batches)]
            for s in range(stages)]


def split_micro_batches(ids: Tensor, micro_batches: int) -> list[Tensor]:
    """Cut a batch (B, T) into ``micro_batches`` equal pieces along the batch."""
    B = ids.shape[0]
    if micro_batches < 1 or B % micro_batches:
        raise ValueError(f"a batch of {B} rows does not cut into {micro_batches} equal "
                         f"micro-batches; pick a count that divides {B}")
    return list(ids.split(B // micro_batches))


class StageCache:
    """A KV cache for one stage's layers. The layers keep their model-wide numbers (layer 3
    is still ``layer=3`` in attention); this cache counts its own layers from 0."""

    def __init__(self, cfg: ModelConfig, first_layer: int, num_layers: int, batch_size: int,
                 max_seq: int | None, device: torch.device, dtype: torch.dtype) -> None:
        self.first_layer = first_layer
        self.cache = KVCache(replace(cfg, num_hidden_layers=num_layers), batch_size, max_seq,
                             device=device, dtype=dtype)

    def update(self, layer: int, k: Tensor, v: Tensor,
               positions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        return self.cache.update(layer - self.first_layer, k, v, positions)


class Stage(nn.Module):
    """Stage ``stage`` of ``stages``: a copy of its layers (the model is not changed)."""

    def __init__(self, model: TinyLlama, stage: int, stages: int,
                 split: list[int] | None = None) -> None:
        super().__init__()
        self.config = model.config
        self.first_layer, self.end_layer = stage_bounds(model.config.num_hidden_layers, stages,
                                                        split)[stage]
        self.is_first, self.is_last = stage == 0, stage == stages - 1
        self.embed_tokens = copy.deepcopy(model.model.embed_tokens)  # for shapes on every stage
        self.layers = nn.ModuleList(copy.deepcopy(model.model.layers[i])
                                    for i in range(self.first_layer, self.end_layer))
        self.norm = copy.deepcopy(model.model.norm) if self.is_last else None
        self.lm_head = copy.deepcopy(model.lm_head) if self.is_last else None
        if not self.is_first:  # only the first stage reads tokens; keep one scalar for dtype
            self.embed_tokens = nn.Embedding(1, 1, dtype=self.embed_tokens.weight.dtype)
        self.requires_grad_(False)
        self.eval()

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    def new_cache(self, batch_size: int = 1, max_seq: int | None = None) -> StageCache:
        return StageCache(self.config, self.first_layer, len(self.layers), batch_size, max_seq,
                          self.device, self.dtype)

    def forward(self, x: Tensor, positions: Tensor | None = None,
                cache: StageCache | None = None) -> Tensor:
        """Token ids (B, T) on the first stage, hidden states (B, T, hidden) on the others;
        returns hidden states, or float32 logits (B, T, vocab) on the last stage."""
        positions, cos, sin, contiguous = prepare_positions(self.config, x, positions, self.dtype)
        if self.is_first:
            x = self.embed_tokens(x)
        for layer in self.layers:
            x = layer(x, positions, cos, sin, cache, contiguous)
        if self.is_last:
            assert self.norm is not None and self.lm_head is not None
            return self.lm_head(self.norm(x)).float()
        return x


@torch.no_grad()
def pipeline_forward(stage: Stage, micro_batches: list[Tensor], positions: Tensor | None = None,
                     caches: list[StageCache] | None = None) -> tuple[list[Tensor], Timeline]:
    """Run this rank's stage over each micro-batch in turn (the forward half of GPipe).

    ``micro_batches`` are token ids, the same on every rank: the first stage embeds them, the
    others only need their shapes to receive the hidden states. Returns the logits of each
    micro-batch on the last stage (an empty list elsewhere) and this rank's timeline.
    """
    rank = dist.get_rank()
    device, hidden = stage.device, stage.config.hidden_size
    outputs, timeline, sends = [], [], []
    for i, ids in enumerate(micro_batches):
        if stage.is_first:
            x = ids.to(device)
        else:
            x = torch.empty(*ids.shape, hidden, device=device, dtype=stage.dtype)
            dist.recv(x, src=rank - 1)
        start = clock(device)
        out = stage(x, positions, caches[i] if caches else None)
        timeline.append((start, clock(device)))
        if stage.is_last:
            outputs.append(out)
        else:  # send without waiting, so this stage can start the next micro-batch at once
            sends.append((dist.isend(out.contiguous(), dst=rank + 1), out))
    for work, _ in sends:
        work.wait()
    return outputs, timeline


@torch.no_grad()
def pipeline_greedy(stage: Stage, prompt_ids: list[int], max_tokens: int) -> list[int]:
    """Greedy generation through the pipeline, each stage caching its own layers' keys and
    values. The last stage picks each token and broadcasts it: the first stage embeds it."""
    last = dist.get_world_size() - 1
    device, n = stage.device, len(prompt_ids)
    cache = stage.new_cache(1, n + max_tokens)
    ids = torch.tensor([prompt_ids], device=device)
    outputs, _ = pipeline_forward(stage, [ids], torch.arange(n, device=device)[None], [cache])
    tokens: list[int] = []
    for step in range(max_tokens):
        token = (outputs[0][:, -1].argmax(-1) if stage.is_last
                 else torch.zeros(1, dtype=torch.long, device=device))
        dist.broadcast(token, src=last)
        tokens.append(int(token))
        if step < max_tokens - 1:
            position = torch.tensor([[n + step]], device=device)
            outputs, _ = pipeline_forward(stage, [token[:, None]], position, [cache])
    return tokens


@torch.no_grad()
def pp_check_worker(rank: int, stages: int, model: TinyLlama, input_ids: Tensor,
                    micro_batches: int, prompt_ids: list[int], max_tokens: int) -> dict[str, Any]:
    """One stage: a micro-batched forward over ``input_ids``, then greedy generation."""
    stage = Stage(model, rank, stages).to(rank_device(rank))
    outputs, timeline = pipeline_forward(stage, split_micro_batches(input_ids, micro_batches))
    tokens = pipeline_greedy(stage, prompt_ids, max_tokens)
    return {"logits": torch.cat(outputs).cpu() if outputs else None, "timeline": timeline,
            "tokens": tokens, "layers": (stage.first_layer, stage.end_layer)}
