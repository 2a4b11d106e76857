"""Graphs captured up front, and static decoders kept in a bounded cache (issue 36, item 4).

The engine captures every (bucket, window) decode graph when its executor is made, largest
first, before any request; never on a request's first decode step of a shape. On a CPU the
executor goes through the same warm-up with an eager stand-in per shape (EagerReplay), so
the captures, their order and their place before the first decode step are counted here.
Static decoders (graph, speculative, compiled) live in an LRU of stated size."""
from __future__ import annotations

import gc
import weakref
from types import SimpleNamespace

import pytest
import torch

from conftest import random_prompt, sharp_model
from tinyserve.backends import cuda_graph
from tinyserve.config import ModelConfig
from tinyserve.backends.cuda_graph import EagerReplay, EngineGraphs, graph_decoder
from tinyserve.backends.decoder_cache import DecoderCache
from tinyserve.engine import Engine, EngineConfig

CFG = ModelConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=96)
# max_num_seqs 4: buckets 1, 2, 4; windows 64 and 96 positions: 16 and 24 blocks of 4.
CONFIG = EngineConfig(num_blocks=96, block_size=4, max_num_seqs=4, max_num_batched_tokens=16,
                      path="graph")
SHAPES = [(4, 24), (4, 16), (2, 24), (2, 16), (1, 24), (1, 16)]


@pytest.fixture(scope="module")
def model():
    return sharp_model(CFG, seed=3)


def test_every_capture_comes_before_the_first_decode_step(model, monkeypatch) -> None:
    """Captures are counted and ordered against the engine's decode steps: every shape
    once, largest first, all at start-up; none while the requests stream (whose windows
    cross from 64 to 96 positions mid-run); the eager engine's tokens."""
    events: list[tuple] = []
    capture, step = EngineGraphs._capture, EngineGraphs.step

    def counted_capture(self, rows, blocks):
        events.append(("capture", rows, blocks))
        return capture(self, rows, blocks)

    def counted_step(self, token_ids, positions, tables):
        events.append(("decode", len(positions), max(positions) + 1))
        return step(self, token_ids, positions, tables)
    monkeypatch.setattr(EngineGraphs, "_capture", counted_capture)
    monkeypatch.setattr(EngineGraphs, "step", counted_step)

    engine = Engine(model, CONFIG)
    graphs = engine.executor.graphs
    assert graphs.shapes() == SHAPES
    assert events == [("capture", *s) for s in SHAPES]          # at start-up, largest first
    assert all(isinstance(graphs.graphs[s], EagerReplay) for s in SHAPES)
    prompts = [random_prompt(CFG.vocab_size, n, seed=n) for n in (5, 30, 12)]
    seqs = [engine.add_request(p, 50) for p in prompts]
    engine.run()
    decodes = [i for i, e in enumerate(events) if e[0] == "decode"]
    captures = [i for i, e in enumerate(events) if e[0] == "capture"]
    assert decodes and max(captures) < min(decodes)
    assert {e[2] > 64 for e in events if e[0] == "decode"} == {False, True}  # both windows
    assert graphs.captures == len(SHAPES)
    graphs.warmup()                                             # again: nothing to capture
    assert graphs.captures == len(SHAPES)
    plain = Engine(model, EngineConfig(**{**CONFIG.__dict__, "path": "eager"}))
    want = [plain.add_request(p, 50) for p in prompts]
    plain.run()
    assert [s.output_ids for s in seqs] == [s.output_ids for s in want]


def test_the_plain_engine_captures_nothing(model) -> None:
    engine = Engine(model, EngineConfig(num_blocks=8, block_size=4))
    assert engine.executor.graphs is None


def test_a_capture_is_recorded_in_thread_local_error_mode(monkeypatch) -> None:
    """The async server steps its engine on its own thread: a capture must not be broken
    by another thread's CUDA calls. torch.cuda faked: the arguments record passes."""
    seen: dict = {}

    class Graph:
        def __init__(self, graph, **kwargs):
            seen.update(kwargs)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False
    stream = SimpleNamespace(wait_stream=lambda other: None)
    fake = {"Stream": lambda device: stream, "stream": lambda s: Graph(None),
            "current_stream": lambda device: stream, "CUDAGraph": lambda: "graph",
            "graph": Graph, "synchronize": lambda device: None,
            "graph_pool_handle": lambda: "pool"}
    for name, value in fake.items():
        monkeypatch.setattr(torch.cuda, name, value)
    monkeypatch.setattr(cuda_graph, "_POOLS", {})
    calls = []
    graph, out = cuda_graph.record(lambda: calls.append(1) or torch.ones(1), torch.device("cpu"))
    assert graph == "graph" and len(calls) == 3                  # two warm-ups, one capture
    assert seen == {"pool": "pool", "capture_error_mode": "thread_local"}


# ------------------------------------------------------------------ the bounded cache

class Decoder:
    def __init__(self, name: str) -> None:
        self.name, self.in_use = name, False


def test_the_cache_keeps_at_most_its_limit_least_recently_used_out() -> None:
    cache: DecoderCache[Decoder] = DecoderCache(2)
    model = torch.nn.Linear(1, 1)
    a = cache.get(model, "a", lambda: Decoder("a"))
    b = cache.get(model, "b", lambda: Decoder("b"))
    assert cache.get(model, "a", lambda: Decoder("new")) is a     # a: now the most recent
    gone = weakref.ref(b)
    del b
    cache.get(model, "c", lambda: Decoder("c"))                   # b, least recent, dropped
    gc.collect()
    assert [d.name for d in cache.decoders()] == ["a", "c"] and gone() is None
    busy = cache.get(model, "a", lambda: Decoder("x"))
    busy.in_use = True                                            # streaming: never dropped
    other = cache.get(model, "a", lambda: Decoder("a2"))          # a busy: a second one
    assert other is not busy and other.name == "a2"
    assert [d.name for d in cache.decoders()] == ["a", "a2"] and len(cache) == 2
    cache.get(model, "d", lambda: Decoder("d"))
    assert [d.name for d in cache.decoders()] == ["a", "d"]       # a2 idle: dropped
    other_model = torch.nn.Linear(1, 1)
    assert cache.get(other_model, "d", lambda: Decoder("d'")).name == "d'"   # per model
    shared = DecoderCache(1)
    busy_shared = shared.get(model, "k", lambda: Decoder("s"), exclusive=False)
    busy_shared.in_use = True
    assert shared.get(model, "k", lambda: Decoder("t"), exclusive=False) is busy_shared
    with pytest.raises(ValueError, match="at least one"):
        DecoderCache(0)


def test_graph_decoders_are_bounded_and_their_model_is_freed(monkeypatch) -> None:
    """The graph decoders of a model no longer used go once newer ones fill the cache,
    and the model with them (a WeakKeyDictionary keyed by the model never freed it: its
    decoders hold it)."""
    monkeypatch.setattr(cuda_graph, "_DECODERS", DecoderCache(2))
    old = sharp_model(CFG, seed=4)
    graph_decoder(old, 1, tokens=40).release()
    gone = weakref.ref(old)
    del old
    gc.collect()
    assert gone() is not None                                     # kept: it may be reused
    new = sharp_model(CFG, seed=5)
    for batch in (1, 2):
        graph_decoder(new, batch, tokens=40).release()
    gc.collect()
    assert gone() is None and len(cuda_graph._DECODERS) == 2
