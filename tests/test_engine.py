"""The continuous-batching engine against its plain references.

Every request must produce exactly the tokens it produces alone (greedy, and seeded
sampling), whatever shares its batch, whatever the block size, token budget, policy, prefix
hits, chunking or preemptions; paged attention must equal a full recompute; and every block
must come back after any mix of finishes and cancels. The engine's pure-decode steps on
static buffers (what a CUDA graph replays on a GPU, run eagerly here) give the same tokens,
pad rows without touching real ones and keep their buffers' addresses.
"""
from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import random_prompt, sharp_model
from tinyserve.config import ModelConfig
from tinyserve.backends.cuda_graph import EngineGraphs
from tinyserve.engine import Engine, EngineConfig, generate_many
from tinyserve.generate import PromptError, generate, generate_ids, prefill
from tinyserve.kv_cache import KVCache
from tinyserve.paged import DecodeBuffers, DecodeLayout, PagedKVCache, RowSpec
from tinyserve.sampling import SamplingParams
from tinyserve.block_manager import BlockManager

CFG = ModelConfig(vocab_size=97, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=64)
LENGTHS = (3, 17, 33, 5, 40, 16, 8)


@pytest.fixture(scope="module")
def model():
    return sharp_model(CFG, 0)


@pytest.fixture(scope="module")
def prompts():
    return [random_prompt(CFG.vocab_size, n, seed=n) for n in LENGTHS]


@pytest.fixture(scope="module")
def alone(model, prompts):
    return [list(generate_ids(model, p, 20)) for p in prompts]


CONFIGS = {
    "small budget, chunked": EngineConfig(num_blocks=64, block_size=4, max_num_batched_tokens=8),
    "tight memory, preempts": EngineConfig(num_blocks=16, block_size=4, max_num_seqs=4,
                                           max_num_batched_tokens=16),
    "no chunking": EngineConfig(num_blocks=64, block_size=8, chunked_prefill=False,
                                max_num_batched_tokens=64),
    "static batches": EngineConfig(num_blocks=64, block_size=4, static=True, max_num_seqs=3),
    "block size 1": EngineConfig(num_blocks=400, block_size=1, max_num_batched_tokens=32),
    "shortest first": EngineConfig(num_blocks=64, block_size=4, policy="spf"),
    "size-aware": EngineConfig(num_blocks=64, block_size=4, policy="size-aware", max_num_seqs=4),
    # a prompt read one token a step beside a decode: one-token rows that do not sample
    "two tokens a step": EngineConfig(num_blocks=64, block_size=4, max_num_batched_tokens=2),
}
# The plain eager step, and pure-decode steps on static buffers (tinyserve.backends.cuda_graph.
# EngineGraphs, run eagerly here: the code a CUDA graph records): the same tokens.
GRAPH = pytest.mark.parametrize("graph", [False, True], ids=["eager", "static-decode"])


def _graph_ran(engine: Engine, graph: bool) -> bool:
    """The static-buffer step ran (graph) or was never built (eager)."""
    graphs = engine.executor.graphs
    return graphs.steps > 0 if graph else graphs is None


@GRAPH
@pytest.mark.parametrize("name", CONFIGS)
def test_batched_equals_alone(name, graph, model, prompts, alone) -> None:
    engine = Engine(model, replace(CONFIGS[name], path=("graph" if graph else "auto" if graph is None else "eager")))
    seqs = [engine.add_request(p, 20) for p in prompts]
    engine.run()
    assert [s.output_ids for s in seqs] == alone
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
    engine.blocks.check_invariants()
    if name == "tight memory, preempts":
        assert sum(s.preemptions for s in seqs) > 0     # the case this config exists for
    assert _graph_ran(engine, graph)


@GRAPH
def test_requests_joining_mid_flight_equal_alone(graph, model, prompts, alone) -> None:
    engine = Engine(model, EngineConfig(num_blocks=64, block_size=4, max_num_batched_tokens=16,
                                        path=("graph" if graph else "auto" if graph is None else "eager")))
    seqs, pending = [], list(prompts)
    while pending or engine.has_unfinished():
        if pending:                                      # one new request every step
            seqs.append(engine.add_request(pending.pop(0), 20))
        engine.step()
    assert [s.output_ids for s in seqs] == alone
    assert _graph_ran(engine, graph)


@GRAPH
def test_prefix_hit_equals_miss(graph, model) -> None:
    system = random_prompt(CFG.vocab_size, 24, seed=99)
    users = [system + random_prompt(CFG.vocab_size, n, seed=100 + n) for n in (3, 9, 14)]
    want = [list(generate_ids(model, p, 12)) for p in users]
    engine = Engine(model, EngineConfig(num_blocks=64, block_size=4, path=("graph" if graph else "auto" if graph is None else "eager")))
    first = engine.add_request(users[0], 12)
    engine.run()                                         # warms the cache with the system prompt
    rest = [engine.add_request(p, 12) for p in users[1:]]
    engine.run()
    assert [s.output_ids for s in [first, *rest]] == want
    assert first.cached_tokens == 0
    assert all(s.cached_tokens == 24 for s in rest)      # 6 full blocks of the system prompt
    assert engine.blocks.prefix_hit_rate > 0
    assert _graph_ran(engine, graph)


@GRAPH
def test_seeded_sampling_equals_alone(graph, model, prompts) -> None:
    params = [SamplingParams(temperature=0.9, top_k=20, seed=s) for s in range(len(prompts))]
    want = [generate(model, p, 15, sampling=sp).tokens for p, sp in zip(prompts, params)]
    engine = Engine(model, EngineConfig(num_blocks=64, block_size=4, max_num_batched_tokens=12,
                                        path=("graph" if graph else "auto" if graph is None else "eager")))
    seqs = [engine.add_request(p, 15, sampling=sp) for p, sp in zip(prompts, params)]
    engine.run()
    assert [s.output_ids for s in seqs] == want
    assert _graph_ran(engine, graph)


def test_stop_tokens_and_window(model, prompts, alone) -> None:
    stop = alone[1][4]
    engine = Engine(model, EngineConfig(num_blocks=64, block_size=4))
    stopped = engine.add_request(prompts[1], 20, stop_ids=[stop])
    long = engine.add_request(prompts[4], 50)            # 40 + 50 > 64: ends at the window
    engine.run()
    assert stopped.output_ids == alone[1][:alone[1].index(stop) + 1]
    assert stopped.finish_reason == "stop"
    assert long.finish_reason == "window" and long.num_tokens == CFG.max_position_embeddings
    assert long.output_ids == list(generate_ids(model, prompts[4], 50))


def test_timestamps_are_ordered(model, prompts) -> None:
    engine = Engine(model, EngineConfig(num_blocks=64, block_size=4, max_num_batched_tokens=8))
    seqs = [engine.add_request(p, 5) for p in prompts]
    engine.run()
    for s in seqs:
        t = s.trace
        assert t.arrival <= t.admitted <= t.prefill_start <= t.prefill_end <= t.token_times[0]
        assert t.token_times == sorted(t.token_times) and t.finish == t.token_times[-1]
        assert len(t.token_times) == len(s.output_ids) == 5


def test_bad_requests_are_refused_with_the_limit(model) -> None:
    engine = Engine(model, EngineConfig(num_blocks=4, block_size=4))
    with pytest.raises(PromptError, match="context window is 64"):
        engine.add_request(list(range(64)), 4)
    with pytest.raises(PromptError, match="needs 5 KV blocks but the pool has 4"):
        engine.add_request(list(range(10)), 10)
    with pytest.raises(PromptError, match="empty"):
        engine.add_request([], 4)
    assert not engine.has_unfinished()


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 10_000))
def test_cancel_anywhere_returns_every_block(model, prompts, alone, seed: int) -> None:
    rng = random.Random(seed)
    engine = Engine(model, EngineConfig(num_blocks=20, block_size=4, max_num_seqs=4,
                                        max_num_batched_tokens=rng.choice([4, 8, 32])))
    seqs = [engine.add_request(p, 20) for p in prompts]
    cancelled = set()
    while engine.has_unfinished():
        engine.step()
        engine.blocks.check_invariants()
        live = [s for s in seqs if not s.finished]
        if live and rng.random() < 0.2:
            victim = rng.choice(live)
            engine.abort(victim.seq_id)
            cancelled.add(victim.seq_id)
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
    for s, want in zip(seqs, alone):
        if s.seq_id not in cancelled:
            assert s.output_ids == want
        else:
            assert s.finish_reason == "abort" and s.output_ids == want[:len(s.output_ids)]


def test_generate_many(model, prompts, alone) -> None:
    assert generate_many(model, prompts, 20, EngineConfig(num_blocks=64, block_size=4)) == alone


# ---- paged attention itself ---------------------------------------------------------------

def _paged_forward(model, ids, block_size, chunks, seed):
    """Run ``ids`` through the paged cache in the given chunk sizes, on shuffled blocks."""
    n_blocks = -(-len(ids) // block_size)
    order = list(range(3 * n_blocks))
    random.Random(seed).shuffle(order)
    table = order[:n_blocks]                             # non-contiguous, out of order
    cache = PagedKVCache(model.config, 3 * n_blocks, block_size)
    slots = [table[p // block_size] * block_size + p % block_size for p in range(len(ids))]
    out, start = [], 0
    for n in chunks:
        cache.prepare([RowSpec(slots[start:start + n], slots[:start + n], start)])
        logits = model(torch.tensor([ids[start:start + n]]),
                       torch.arange(start, start + n)[None], cache)
        out.append(logits[0])
        start += n
    return torch.cat(out)


@pytest.mark.parametrize("block_size,chunks", [(4, [30]), (4, [7, 1, 1, 13, 8]), (16, [1] * 30),
                                               (5, [16, 14])])
def test_paged_equals_recompute(model, block_size, chunks) -> None:
    ids = random_prompt(CFG.vocab_size, 30, seed=7)
    full = model(torch.tensor([ids]))[0]
    paged = _paged_forward(model, ids, block_size, chunks, seed=block_size)
    torch.testing.assert_close(paged, full, atol=1e-5, rtol=1e-5)


def test_mixed_step_equals_separate(model) -> None:
    """One step holding a prefill chunk and two decodes equals the three run on their own."""
    bm = BlockManager(32, 4, enable_prefix_caching=False)
    cache = PagedKVCache(model.config, 32, 4)
    a, b, c = (random_prompt(CFG.vocab_size, n, seed=n) for n in (9, 6, 12))
    for name, toks in (("a", a), ("b", b)):             # a and b already hold all but one token
        bm.allocate(name, toks)
        slots = [bm.slot(name, p) for p in range(len(toks) - 1)]
        cache.prepare([RowSpec(slots, slots, 0)])
        model(torch.tensor([toks[:-1]]), torch.arange(len(toks) - 1)[None], cache)
    bm.allocate("c", c)
    rows, ids, pos = [], [], []
    for name, toks, start in (("a", a, len(a) - 1), ("c", c, 0), ("b", b, len(b) - 1)):
        slots = [bm.slot(name, p) for p in range(len(toks))]
        rows.append(RowSpec(slots[start:], slots, start))
        ids += toks[start:]
        pos += range(start, len(toks))
    cache.prepare(rows)
    logits = model(torch.tensor([ids]), torch.tensor([pos]), cache)[0]
    want = torch.stack([model(torch.tensor([t]))[0, -1] for t in (a, c, b)])
    got = logits[torch.tensor([0, len(c), len(c) + 1])]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_logits_at_selects_positions(model) -> None:
    ids = torch.tensor([random_prompt(CFG.vocab_size, 12, seed=3)])
    at = torch.tensor([0, 5, 11])
    torch.testing.assert_close(model(ids, logits_at=at), model(ids)[:, at])


def test_logits_at_runs_the_last_mlp_on_the_kept_rows_and_caches_every_position(model) -> None:
    # The saving llama.cpp also makes: past the last layer's attention only the rows whose
    # logits are asked for go on. The cache must still hold every position, the logits must
    # be the full pass's, and the last MLP (only it) must see the kept rows alone.
    ids = torch.tensor([random_prompt(CFG.vocab_size, 12, seed=4)])
    rows: list[int] = []
    hooks = [layer.mlp.register_forward_hook(lambda _m, args, _out: rows.append(args[0].shape[1]))
             for layer in model.model.layers]
    try:
        kept, full = KVCache.for_model(model, 1, 12), KVCache.for_model(model, 1, 12)
        last = torch.tensor([11])
        got = prefill(model, ids, kept, logits_at=last)
        want = prefill(model, ids, full)[:, last]
    finally:
        for hook in hooks:
            hook.remove()
    torch.testing.assert_close(got, want)
    n = CFG.num_hidden_layers
    assert rows[:n] == [12] * (n - 1) + [1]          # the pass with logits_at
    assert rows[n:] == [12] * n                      # the full pass
    torch.testing.assert_close(kept.k, full.k)
    torch.testing.assert_close(kept.v, full.v)


def test_decode_rows_gathered_by_block_equal_gathered_by_slot(model) -> None:
    # Rows that carry their block table are gathered a block at a time (the engine's path);
    # the logits must be those of the slot-by-slot gather, rows of different lengths.
    bm = BlockManager(32, 4, enable_prefix_caching=False)
    prompts = [random_prompt(CFG.vocab_size, n, seed=n) for n in (9, 6, 13)]
    by_slot, by_block = PagedKVCache(model.config, 32, 4), PagedKVCache(model.config, 32, 4)
    for i, toks in enumerate(prompts):
        bm.allocate(f"r{i}", toks)
        slots = [bm.slot(f"r{i}", p) for p in range(len(toks) - 1)]
        for cache in (by_slot, by_block):
            cache.prepare([RowSpec(slots, slots, 0)])
            model(torch.tensor([toks[:-1]]), torch.arange(len(toks) - 1)[None], cache)
    out = []
    for cache, tables in ((by_slot, False), (by_block, True)):
        rows = []
        for i, toks in enumerate(prompts):
            slots = [bm.slot(f"r{i}", p) for p in range(len(toks))]
            rows.append(RowSpec(slots[-1:], slots, len(toks) - 1,
                                bm.tables[f"r{i}"].blocks if tables else None))
        assert cache.prepare(rows).decode_by_block is tables
        out.append(model(torch.tensor([[t[-1] for t in prompts]]),
                         torch.tensor([[len(t) - 1 for t in prompts]]), cache)[0])
    torch.testing.assert_close(out[1], out[0], rtol=1e-5, atol=1e-5)


def _prefill_rows(model, bm, cache, prompts):
    """Write all but the last token of each prompt into ``cache`` (slots listed)."""
    for i, toks in enumerate(prompts):
        bm.allocate(f"r{i}", toks)
        slots = [bm.slot(f"r{i}", p) for p in range(len(toks) - 1)]
        cache.prepare([RowSpec(slots, slots, 0)])
        model(torch.tensor([toks[:-1]]), torch.arange(len(toks) - 1)[None], cache)


@pytest.mark.parametrize("lengths", [(9, 6, 13), (8, 8, 8)])
def test_rows_given_by_block_table_equal_rows_given_by_slot(model, lengths) -> None:
    # The engine's step: decode rows first (read as a slice; rows of one length need no
    # mask), then a prefill chunk, each row given only its new slots and its block table.
    # The reference lists every context slot, gathered slot by slot.
    bm = BlockManager(48, 4, enable_prefix_caching=False)
    decodes = [random_prompt(CFG.vocab_size, n, seed=n) for n in lengths]
    chunk = random_prompt(CFG.vocab_size, 11, seed=5)
    caches = PagedKVCache(model.config, 48, 4), PagedKVCache(model.config, 48, 4)
    for cache in caches:
        _prefill_rows(model, BlockManager(48, 4, enable_prefix_caching=False), cache, decodes)
    _prefill_rows(model, bm, PagedKVCache(model.config, 48, 4), decodes)   # same tables
    bm.allocate("c", chunk)
    ids = [t[-1] for t in decodes] + chunk[:7]
    pos = [len(t) - 1 for t in decodes] + list(range(7))
    out = []
    for cache, by_table in zip(caches, (False, True)):
        rows = []
        for name, n, start in [(f"r{i}", len(t), len(t) - 1) for i, t in enumerate(decodes)] + [
                ("c", 7, 0)]:
            slots = [bm.slot(name, p) for p in range(n)]
            rows.append(RowSpec(slots[start:], None if by_table else slots, start,
                                bm.tables[name].blocks if by_table else None))
        lay = cache.prepare(rows)
        assert lay.decode_by_block is by_table and lay.decode_prefix
        # No mask where every row sees the whole padded width: one length (whole blocks).
        assert (lay.decode_mask is None) is (len(set(lengths)) == 1 and lengths[0] % 4 == 0)
        out.append(model(torch.tensor([ids]), torch.tensor([pos]), cache)[0])
    torch.testing.assert_close(out[1], out[0], rtol=1e-5, atol=1e-5)
    want = torch.stack([model(torch.tensor([t]))[0, -1] for t in decodes])
    torch.testing.assert_close(out[1][:len(decodes)], want, rtol=1e-5, atol=1e-5)


def test_a_row_without_slots_needs_its_block_table(model) -> None:
    cache = PagedKVCache(model.config, 8, 4)
    with pytest.raises(ValueError, match="needs its block_table"):
        cache.prepare([RowSpec([5], None, 1)])


# ---- pure-decode steps on static buffers (backends.cuda_graph.EngineGraphs) --------------

def _decode_args(bm, prompts):
    """Each prompt's last token at its position, and its block table."""
    return ([t[-1] for t in prompts], [len(t) - 1 for t in prompts],
            [bm.tables[f"r{i}"].blocks for i in range(len(prompts))])


def _scratch_cache(model, lengths, num_blocks=40):
    bm = BlockManager(num_blocks, 4, enable_prefix_caching=False)
    cache = PagedKVCache(model.config, num_blocks, 4, scratch=True)
    prompts = [random_prompt(CFG.vocab_size, n, seed=n) for n in lengths]
    with torch.no_grad():
        _prefill_rows(model, bm, cache, prompts)
    return cache, bm, prompts


def test_static_steps_pad_rows_to_a_bucket_and_contexts_to_a_window() -> None:
    from tinyserve.model import TinyLlama
    cfg = replace(CFG, max_position_embeddings=160)
    model, cache = TinyLlama(cfg), PagedKVCache(cfg, 32, 4, scratch=True)
    graphs = EngineGraphs(model, cache, max_rows=6)
    assert graphs.max_rows == 8 and graphs.max_blocks == 40 and not graphs.capture
    # rows to a bucket (1, 2, 4, 8); the longest context to a power of two from 64, in blocks
    assert [graphs.shape(n, 10)[0] for n in (1, 2, 3, 4, 5, 8)] == [1, 2, 4, 4, 8, 8]
    assert [graphs.shape(1, n)[1] for n in (1, 64, 65, 128, 129, 160)] == [16, 16, 32, 32, 40, 40]
    with pytest.raises(ValueError, match="1 to 8 rows"):
        graphs.step([1] * 9, [0] * 9, [[0]] * 9)
    assert EngineGraphs(model, cache, max_rows=20).shape(17, 1) == (32, 16)
    with pytest.raises(ValueError, match="scratch=True"):
        EngineGraphs(model, PagedKVCache(cfg, 32, 4), max_rows=4)
    with pytest.raises(ValueError, match="need a CUDA device"):
        EngineGraphs(model, cache, 4, capture=True)


def test_padding_rows_see_only_the_scratch_block() -> None:
    cache = PagedKVCache(CFG, 8, 4, scratch=True)           # blocks 0-7, scratch block 8
    assert cache.scratch_block == 8 and cache.bytes_per_block * 9 == cache.nbytes
    buffers = DecodeBuffers(cache, max_rows=4, max_blocks=5)
    buffers.fill([11, 12, 13], [5, 0, 8], [[3, 1], [6], [2, 0, 7]], rows=4)
    assert buffers.packed.tolist() == [
        [11, 5, 1 * 4 + 1, 6, 3, 1, 8, 8, 8],   # token, position, write slot, length, table
        [12, 0, 6 * 4 + 0, 1, 6, 8, 8, 8, 8],
        [13, 8, 7 * 4 + 0, 9, 2, 0, 7, 8, 8],
        [CFG.pad_token_id, 0, 8 * 4, 1, 8, 8, 8, 8, 8],           # a padding row
    ]
    with pytest.raises(ValueError, match="position 20 needs 6 blocks"):
        buffers.fill([1], [20], [[0] * 6], rows=1)


def test_padding_rows_never_change_a_real_row(model) -> None:
    """Three real rows padded to a bucket of 4, and to 8 (five padding rows): each real
    row's logits are the eager step's and recompute's; the step writes the real rows' new
    slots and the scratch block, nothing else."""
    out = []
    for bucket in (4, 8):
        cache, bm, prompts = _scratch_cache(model, (9, 6, 13))
        graphs = EngineGraphs(model, cache, max_rows=8)
        before = torch.stack(cache.k), torch.stack(cache.v)   # (layers, slots, ...)
        ids, positions, tables = _decode_args(bm, prompts)
        if bucket == 4:                                  # the smallest that holds 3 rows
            assert graphs.shape(3, 13) == (4, 16)
            out.append(graphs.step(ids, positions, tables).clone())
        else:                                            # a larger bucket, by hand
            graphs.buffers.fill(ids, positions, tables, bucket)
            with torch.no_grad():
                out.append(graphs._forward(bucket, 16)[:3].clone())
        written = torch.zeros(cache.k[0].shape[0], dtype=torch.bool)
        written[[bm.slot(f"r{i}", p) for i, p in enumerate(positions)]] = True
        written[cache.scratch_block * 4:] = True
        for now, then in zip((torch.stack(cache.k), torch.stack(cache.v)), before):
            assert torch.equal(now[:, ~written], then[:, ~written])
            assert not torch.equal(now[:, written], then[:, written])
    torch.testing.assert_close(out[1], out[0], rtol=1e-6, atol=1e-6)
    cache, bm, prompts = _scratch_cache(model, (9, 6, 13))
    ids, positions, tables = _decode_args(bm, prompts)
    cache.prepare([RowSpec([bm.slot(f"r{i}", p)], None, p, tables[i])
                   for i, p in enumerate(positions)])
    with torch.no_grad():
        eager = model(torch.tensor([ids]), None, cache)[0]
        want = torch.stack([model(torch.tensor([t]))[0, -1] for t in prompts])
    torch.testing.assert_close(out[0], eager, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out[0], want, rtol=1e-5, atol=1e-5)


def test_every_static_step_goes_through_the_same_buffers(model, prompts) -> None:
    """A graph replays fixed addresses: the static inputs, the gather buffer, the logits
    and the pool keep theirs for a whole run (nothing allocated per step for them)."""
    engine = Engine(model, EngineConfig(num_blocks=64, block_size=4, max_num_seqs=4,
                                        max_num_batched_tokens=12, path="graph"))
    graphs, cache = engine.executor.graphs, engine.executor.cache

    def addresses():
        b = graphs.buffers
        return [t.data_ptr() for t in (b.packed, b.gathered, graphs.logits, *cache.k, *cache.v)]
    first, buckets = addresses(), set()
    for p in prompts:
        engine.add_request(p, 12)
    while engine.has_unfinished():
        engine.step()
        lay = cache.layout
        if isinstance(lay, DecodeLayout):
            buckets.add(lay.num_tokens)
            assert lay.workspace.data_ptr() == graphs.buffers.gathered.data_ptr()
            assert lay.positions.data_ptr() == graphs.buffers.positions.data_ptr()
        assert addresses() == first
    assert len(buckets) > 1 and graphs.steps > 0


def test_a_static_step_reads_nothing_and_an_engine_step_reads_once(model, prompts) -> None:
    from host_reads import HostReads, count_reads
    cache, bm, rows = _scratch_cache(model, (9, 6, 13))
    graphs = EngineGraphs(model, cache, max_rows=4)
    with torch.no_grad():
        _, reads = count_reads(graphs.step, *_decode_args(bm, rows))
    assert reads.count == 0, reads.where
    engine = Engine(model, EngineConfig(num_blocks=64, block_size=4, path="graph"))
    engine.add_request(prompts[0], 10)
    engine.add_request(prompts[1], 10, sampling=SamplingParams(temperature=0.8, top_k=10, seed=1))
    while engine.has_unfinished():
        with torch.no_grad(), HostReads() as reads:
            events = engine.step()
        assert reads.count == (1 if events else 0), reads.where
    assert engine.executor.graphs.steps > 0


def test_the_plain_engine_stays_the_default_on_the_cpu(model) -> None:
    engine = Engine(model, EngineConfig(num_blocks=8, block_size=4))
    assert engine.executor.graphs is None and engine.executor.cache.scratch_block is None


# ---- the captured graphs (CUDA only) ------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("name", ["small budget, chunked", "tight memory, preempts"])
def test_on_cuda_the_engines_graphs_give_the_eager_tokens(name, prompts) -> None:
    """The default on CUDA: graphs captured, the eager engine's tokens, and the graphs
    replayed, not captured again, for the next requests. (How long a capture takes is
    measured, not asserted: `make gpu-check` reports it.)"""
    gpu = sharp_model(CFG, 0).to("cuda")
    want = generate_many(gpu, prompts, 20, replace(CONFIGS[name], path="eager"))
    engine = Engine(gpu, CONFIGS[name])
    seqs = [engine.add_request(p, 20) for p in prompts]
    engine.run()
    graphs = engine.executor.graphs
    assert graphs is not None and graphs.capture and graphs.graphs
    assert [s.output_ids for s in seqs] == want
    captured = dict(graphs.capture_seconds)
    again = [engine.add_request(p, 20) for p in prompts]
    engine.run()
    assert [s.output_ids for s in again] == want
    assert all(graphs.capture_seconds[k] == v for k, v in captured.items())


@pytest.mark.gpu
def test_on_cuda_a_replayed_step_reads_once_and_follows_moved_weights(prompts) -> None:
    from host_reads import HostReads
    gpu = sharp_model(CFG, 0).to("cuda")
    engine = Engine(gpu, EngineConfig(num_blocks=64, block_size=4))
    engine.add_request(prompts[0], 8)
    while engine.has_unfinished():
        with torch.no_grad(), HostReads() as reads:
            events = engine.step()
        assert reads.count == (1 if events else 0), reads.where
    assert engine.executor.graphs.graphs
    with torch.no_grad():
        gpu.model.layers[0].mlp.up_proj.weight.mul_(0.5)   # its stacked copy is rebuilt
    config = EngineConfig(num_blocks=64, block_size=4, path="eager")
    want = generate_many(gpu, prompts[:1], 8, config)[0]
    seq = engine.add_request(prompts[0], 8)
    engine.run()
    assert seq.output_ids == want
