"""The engine at the wall: continuous batching on the scale model, measured on the engine's own
decode steps (chapters 5 and 9, and ``bench scale``).

:func:`serve_at_once` sends ``concurrency`` requests to a fresh :class:`~tinyserve.engine.Engine`
in the same instant and times the whole run: output tokens per second, and the median of its
pure-decode steps (every row one token: the steps that batching makes cheap). With
``path="fast"`` the engine's decode steps run on its fast path (:mod:`tinyserve.backends.fast`:
the fastest way timed here on a CPU, CUDA graphs on a GPU), their shape made ready first (:meth:`Engine.prepare`, a progress
line), so no compile is timed; a short warm-up request runs before the clock starts either way.

The ratio of two runs (4 requests against 1) is continuous batching's bargain at the memory
wall: a decode step reads the weights once for every row it carries, so where a step costs
about the same with 4 rows as with 1, 4 requests get nearly 4x the tokens per second. On the
eager path each few-row matrix product pays a per-call copy of its operands and each row's
arithmetic at the library's own rate, below the ceiling on some CPUs (chapter 3), so a 4-row
step costs more and the gain is smaller: the kernel lesson beside the physics one.
"""
from __future__ import annotations

from dataclasses import dataclass
import statistics

import torch

from ..engine import Engine, EngineConfig
from ..model import TinyLlama

__all__ = ["EngineRun", "prepare_at_once", "serve_at_once"]


@dataclass(frozen=True)
class EngineRun:
    """One run of :func:`serve_at_once`: ``concurrency`` requests of ``prompt`` tokens each
    making ``tokens`` tokens; ``seconds`` from the first step to the last token."""
    concurrency: int
    path: str                     # the engine's path (tinyserve.step_path): "fast" or "eager"
    prompt: int
    tokens: int
    seconds: float
    decode_step_s: float          # median pure-decode step (all rows one token)
    prepare_s: float              # what making the fast step ready took (0: held or eager)

    @property
    def tokens_per_s(self) -> float:
        return self.concurrency * self.tokens / self.seconds

    def describe(self) -> str:
        return (f"{self.path:5s} {self.concurrency:2d} at once: {self.tokens_per_s:7.1f} output tok/s, "
                f"decode step {self.decode_step_s * 1e3:6.1f} ms")


def _engine(model: TinyLlama, concurrency: int, prompt: int, tokens: int,
            path: str) -> Engine:
    """The engine :func:`serve_at_once` runs: sized for ``concurrency`` requests of
    ``prompt + tokens`` positions (so a fast one finds the steps :func:`prepare_at_once`
    compiled for the same sizes), prefix caching off (every prompt is new anyway)."""
    if concurrency < 1 or prompt < 1 or tokens < 2:
        raise ValueError(f"need at least 1 request, 1 prompt token and 2 new tokens, got "
                         f"{concurrency}, {prompt}, {tokens}")
    block = 16
    config = EngineConfig(num_blocks=concurrency * -(-(prompt + tokens) // block) + 4,
                          block_size=block, max_num_seqs=concurrency,
                          max_num_batched_tokens=max(256, concurrency * prompt), path=path,
                          enable_prefix_caching=False)
    return Engine(model, config, record_steps=True)


def prepare_at_once(model: TinyLlama, concurrency: int, *, prompt: int = 32, tokens: int = 32,
                    progress: bool = True) -> float:
    """Compile (on a GPU: capture) the fast decode step :func:`serve_at_once` will run for
    these sizes, with a progress line; the seconds it took (0 when already held). A chapter
    calls it in a cell of its own: a first compile takes tens of seconds."""
    engine = _engine(model, concurrency, prompt, tokens, "fast")
    return sum(c.seconds for c in engine.prepare(rows=(concurrency,), tokens=prompt + tokens,
                                                 progress=progress))


@torch.no_grad()
def serve_at_once(model: TinyLlama, concurrency: int, *, prompt: int = 32, tokens: int = 32,
                  path: str = "eager", seed: int = 0, progress: bool = True) -> EngineRun:
    """Serve ``concurrency`` random prompts of ``prompt`` tokens, ``tokens`` new tokens each
    (no stop token: every request runs to its cap), all queued before the first step; time
    the run. ``path``: the engine's (:mod:`tinyserve.step_path`); ``"fast"`` prepares its
    decode step for ``concurrency`` rows at the window of ``prompt + tokens`` positions first
    (:func:`prepare_at_once`)."""
    engine = _engine(model, concurrency, prompt, tokens, path)
    costs = engine.prepare(rows=(concurrency,), tokens=prompt + tokens,
                           progress=progress) if engine.config.fast else []
    g = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    engine.add_request(torch.randint(4, vocab, (8,), generator=g).tolist(), 2)   # warm-up
    engine.run()
    first = len(engine.step_log)
    for _ in range(concurrency):
        engine.add_request(torch.randint(4, vocab, (prompt,), generator=g).tolist(), tokens)
    start = engine.now()
    engine.run()
    seconds = engine.now() - start
    steps = [r.seconds for r in engine.step_log[first:] if r.num_tokens == r.num_rows]
    return EngineRun(concurrency, path, prompt, tokens, seconds, statistics.median(steps),
                     sum(c.seconds for c in costs))
