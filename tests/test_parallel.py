"""Tensor and pipeline parallelism equal the single-process model.

The split math is checked in one process first (shards summed by hand, stages chained by
hand), which is fast. Then real ranks run with torch.distributed (gloo, 2 processes): one
launch per scheme does every check at once, since starting the ranks (two fresh interpreters
importing torch) is most of the cost, about 3-4 s on 2 cores.
"""
from __future__ import annotations

import multiprocessing
import os
import time
from pathlib import Path

import pytest
import torch

import tinyserve
from conftest import random_prompt, sharp_model
from host_reads import count_reads
from tinyserve.config import PRESETS, ModelConfig
from tinyserve.generate import generate
from tinyserve.parallel.launch import RankError, launch
from tinyserve.parallel.tensor import (CountingAllReduce, column_shard, row_shard, shard_model,
                                tp_check_worker, tp_forward_in_process)
from tinyserve.kv_cache import CacheFullError, KVCache
from tinyserve.parallel.timing import (parallel_read_bandwidth, phase_runners,
                                       tp_decode_speedup)
from tinyserve.parallel.pipeline import (Stage, bubble_formula, ideal_timelines, measured_bubble,
                                pp_check_worker, split_micro_batches, stage_bounds)

# 8 query / 4 KV heads, so 1, 2 and 4 ranks all own whole KV groups.
SMALL = ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                    num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=64)


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def small() -> tinyserve.TinyLlama:
    return sharp_model(SMALL, seed=0)


@pytest.fixture(scope="module")
def target() -> tinyserve.TinyLlama:
    return tinyserve.load_model("target", device="cpu")


# ---------------------------------------------------------------- the split, in one process

def test_column_then_row_shards_sum_to_the_unsplit_pair() -> None:
    torch.manual_seed(0)
    up, down = torch.nn.Linear(16, 24, bias=False), torch.nn.Linear(24, 16, bias=False)
    x = torch.randn(3, 16)
    want = down(torch.relu(up(x)))
    parts = [row_shard(down, r, 4)(torch.relu(column_shard(up, r, 4)(x))) for r in range(4)]
    assert parts[0].shape == want.shape  # each rank's output is full size, a partial sum
    close(sum(parts), want)
    assert not torch.allclose(parts[0], want, atol=1e-3)  # one part alone is not the answer


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_tensor_parallel_split_equals_the_model(small, world_size: int) -> None:
    ids = torch.tensor([random_prompt(SMALL.vocab_size, 20, seed=1),
                        random_prompt(SMALL.vocab_size, 20, seed=2)])
    with torch.no_grad():
        want = small(ids)
        got, reductions = tp_forward_in_process(small, world_size, ids)
    close(got, want)
    assert reductions == 2 * SMALL.num_hidden_layers  # one after attention, one after the MLP


def test_counted_all_reduces_per_forward(small) -> None:
    counter = CountingAllReduce(inner=lambda t: t)  # one rank: the sum of one part is itself
    shard = shard_model(small, 0, 1, counter)
    ids = torch.tensor([random_prompt(SMALL.vocab_size, 7)])
    with torch.no_grad():
        close(shard(ids), small(ids))
    assert counter.calls == 2 * SMALL.num_hidden_layers
    assert counter.elements == counter.calls * 7 * SMALL.hidden_size  # batch x tokens x hidden


def test_target_shard_holds_its_query_heads_and_their_kv_head(target) -> None:
    cfg = target.config
    shard = shard_model(target, 1, 2)
    attn, full = shard.layers[0].self_attn, target.model.layers[0].self_attn
    d = cfg.head_dim
    assert (attn.n_heads, attn.n_kv) == (4, 1)
    # Rank 1: query heads 4-7, which read KV head 1 (head h reads KV head h // 4).
    assert torch.equal(attn.q_proj.weight, full.q_proj.weight[4 * d:8 * d])
    assert torch.equal(attn.k_proj.weight, full.k_proj.weight[d:2 * d])
    assert torch.equal(attn.v_proj.weight, full.v_proj.weight[d:2 * d])
    assert torch.equal(attn.o_proj.weight, full.o_proj.weight[:, 4 * d:8 * d])
    mlp, full_mlp = shard.layers[0].mlp, target.model.layers[0].mlp
    half = cfg.intermediate_size // 2
    assert torch.equal(mlp.down_proj.weight, full_mlp.down_proj.weight[:, half:])
    assert shard.new_cache(1, 64).nbytes * 2 == tinyserve.kv_cache.KVCache(cfg, 1, 64).nbytes
    # Each rank stores half of every block's matmuls; embedding (tied to the LM head) and
    # norms are replicated.
    h, kv, L = cfg.hidden_size, cfg.num_key_value_heads * d, cfg.num_hidden_layers
    matmuls = 2 * h * h + 2 * h * kv + 3 * h * cfg.intermediate_size
    assert shard.lm_head.weight is shard.embed_tokens.weight
    assert sum(p.numel() for p in shard.parameters()) == \
        cfg.vocab_size * h + L * (matmuls // 2 + 2 * h) + h


def test_a_split_that_breaks_a_kv_group_names_the_limit(target) -> None:
    with pytest.raises(ValueError, match="num_key_value_heads=2"):
        shard_model(target, 0, 3)
    with pytest.raises(ValueError, match="num_key_value_heads=1"):
        shard_model(sharp_model(PRESETS["draft"], seed=0), 0, 2)


# ---------------------------------------------------------------- pipeline, in one process

def test_stage_bounds() -> None:
    assert stage_bounds(6, 2) == [(0, 3), (3, 6)]
    assert stage_bounds(7, 3) == [(0, 3), (3, 5), (5, 7)]
    assert stage_bounds(6, 2, split=[4, 2]) == [(0, 4), (4, 6)]
    with pytest.raises(ValueError, match="between 1 and 6 stages"):
        stage_bounds(6, 7)
    with pytest.raises(ValueError, match="add up to the model's 6 layers"):
        stage_bounds(6, 2, split=[3, 2])


def test_ideal_schedule_bubble_is_the_formula() -> None:
    for p, m in [(2, 1), (2, 4), (4, 8), (3, 5)]:
        assert measured_bubble(ideal_timelines(p, m, step=0.01)) == pytest.approx(
            (p - 1) / (m + p - 1))
        assert bubble_formula(p, m) == pytest.approx((p - 1) / (m + p - 1))
    assert bubble_formula(2, 1) == 0.5 and bubble_formula(1, 3) == 0.0


def test_micro_batches_must_divide_the_batch() -> None:
    ids = torch.zeros(6, 4, dtype=torch.long)
    assert [c.shape[0] for c in split_micro_batches(ids, 3)] == [2, 2, 2]
    with pytest.raises(ValueError, match="divides 6"):
        split_micro_batches(ids, 4)


def test_stages_chained_by_hand_equal_the_model(small) -> None:
    stages = [Stage(small, s, 3) for s in range(3)]
    ids = torch.tensor([random_prompt(SMALL.vocab_size, 9)])
    with torch.no_grad():
        x = ids
        for stage in stages:
            x = stage(x)
        close(x, small(ids))
        # With per-stage caches: prefill 8 tokens, then decode the 9th.
        caches = [s.new_cache(1, 9) for s in stages]
        pos = torch.arange(9)[None]
        x, y = ids[:, :8], ids[:, 8:]
        for stage, cache in zip(stages, caches):
            x = stage(x, pos[:, :8], cache)
        for stage, cache in zip(stages, caches):
            y = stage(y, pos[:, 8:], cache)
    close(y[:, -1], small(ids)[:, -1])


def test_a_shards_cached_step_reads_nothing_back(small) -> None:
    """Issue 24: with ``positions=None`` a shard takes its positions from the cache's lengths,
    known on the host: no value read back in a prefill or a decode step (the old preamble read
    ``positions.max()`` every step), and the logits of the explicit-positions path and of the
    model."""
    shard = shard_model(small, 0, 1, all_reduce=lambda t: t)   # one rank: sums are the parts
    fast, slow = shard.new_cache(1, 16), shard.new_cache(1, 16)
    whole = KVCache.for_model(small, 1, 16)
    for ids in [torch.tensor([random_prompt(SMALL.vocab_size, 5, seed=1)]), torch.tensor([[7]]),
                torch.tensor([[9]])]:
        positions = torch.arange(ids.shape[1]) + slow.lengths[0]
        with torch.inference_mode():
            want = shard(ids, positions, slow)
            model_logits = small(ids, None, whole)
        got, reads = count_reads(shard, ids, None, fast)
        assert reads.count == 0, reads.where
        close(got, want)
        close(got, model_logits)


def test_the_timed_decode_step_reads_nothing_back(small) -> None:
    """What the benches time is a step without host reads, on the model and on a shard."""
    ids = torch.tensor([random_prompt(SMALL.vocab_size, 9, seed=2)])
    shard = shard_model(small, 0, 1, all_reduce=lambda t: t)
    for model, cache in ((small, KVCache.for_model(small, 1, 9)), (shard, shard.new_cache(1, 9))):
        runs = phase_runners(model, cache, ids)
        runs["prefill"]()
        _, reads = count_reads(runs["decode"])
        assert reads.count == 0, reads.where
        assert cache.lengths == [8]                # rewound: every repeat decodes at one spot


def test_a_shard_keeps_the_window_check_and_its_message(small) -> None:
    shard = shard_model(small, 0, 2, all_reduce=lambda t: t)  # the checks come first anyway
    window = SMALL.max_position_embeddings
    too_long = torch.zeros(1, window + 1, dtype=torch.long)
    with pytest.raises(ValueError, match=f"position {window} is outside the context window"):
        shard(too_long)                                        # known on the host: no read
    with pytest.raises(ValueError, match=f"position {window} is outside the context window"):
        shard(torch.zeros(1, 1, dtype=torch.long), torch.tensor([window]))   # explicit: read
    cache = shard.new_cache(1, window)
    with torch.inference_mode():
        shard(torch.zeros(1, window, dtype=torch.long), None, cache)
    with pytest.raises(CacheFullError, match="outside the context window"):
        shard(torch.zeros(1, 1, dtype=torch.long), None, cache)


def test_the_scale_model_split_equals_the_model() -> None:
    """The bandwidth-scale configuration (one layer: ~210 MB) splits like the small one."""
    model = tinyserve.load_model("bandwidth", device="cpu", layers=1)
    ids = torch.tensor([random_prompt(model.config.vocab_size, 8, seed=2)])
    with torch.no_grad():
        want = model(ids)
        got, sums = tp_forward_in_process(model, 2, ids)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert sums == 2
    del model

# ---------------------------------------------------------------- real ranks (gloo, 2 processes)

PROMPT_TOKENS, NEW_TOKENS = 12, 12


@pytest.fixture(scope="module")
def tp_ranks(target):
    ids = torch.tensor([random_prompt(4096, 16, seed=3), random_prompt(4096, 16, seed=4)])
    prompt = random_prompt(4096, PROMPT_TOKENS, seed=5)
    return ids, prompt, launch(tp_check_worker, 2, target, ids, prompt, NEW_TOKENS, timeout_s=60)


def test_tensor_parallel_ranks_equal_the_model(target, tp_ranks) -> None:
    ids, _, ranks = tp_ranks
    with torch.no_grad():
        want = target(ids)
    for r in ranks:
        close(r["logits"], want)
    assert torch.equal(ranks[0]["logits"], ranks[1]["logits"])  # the all-reduce agrees


def test_tensor_parallel_all_reduces_and_cache_per_rank(target, tp_ranks) -> None:
    _, _, ranks = tp_ranks
    for r in ranks:
        assert r["all_reduces_per_forward"] == 2 * target.config.num_hidden_layers == 12
        assert (r["q_heads"], r["cache_kv_heads"]) == (4, 1)


def test_tensor_parallel_greedy_tokens_with_cache(target, tp_ranks) -> None:
    _, prompt, ranks = tp_ranks
    want = generate(target, prompt, NEW_TOKENS).tokens
    assert [r["tokens"] for r in ranks] == [want, want]


@pytest.fixture(scope="module")
def pp_ranks(small):
    ids = torch.tensor([random_prompt(SMALL.vocab_size, 10, seed=s) for s in range(4)])
    prompt = random_prompt(SMALL.vocab_size, PROMPT_TOKENS, seed=6)
    return ids, prompt, launch(pp_check_worker, 2, small, ids, 2, prompt, NEW_TOKENS,
                               timeout_s=60)


def test_pipeline_ranks_equal_the_model(small, pp_ranks) -> None:
    ids, prompt, (first, last) = pp_ranks
    assert (first["layers"], last["layers"]) == ((0, 2), (2, 3))
    assert first["logits"] is None
    with torch.no_grad():
        close(last["logits"], small(ids))
    want = generate(small, prompt, NEW_TOKENS).tokens
    assert first["tokens"] == last["tokens"] == want
    # Two micro-batches: each stage ran two computations, the second stage after the first.
    assert len(first["timeline"]) == len(last["timeline"]) == 2
    assert last["timeline"][0][0] >= first["timeline"][0][1]


def test_parallel_read_bandwidth_reports_one_and_two_processes() -> None:
    """The report's shape, not its figures (tests never time): one buffer per process."""
    got = parallel_read_bandwidth(2, nbytes=4 * 2**20, repeats=2, timeout_s=120)
    assert (got.processes, got.nbytes, got.way) == (2, 4 * 2**20, "matvec")
    assert got.single > 0 and all(b > 0 for b in got.per_process) and got.aggregate > 0
    assert got.speedup == pytest.approx(got.aggregate / got.single)
    with pytest.raises(ValueError, match="way must be 'matvec' or 'sum'"):
        parallel_read_bandwidth(way="copy")


def test_tp_decode_speedup_reports_both_sides() -> None:
    """The scale worker's report at the draft preset, one layer (built in each rank)."""
    got = tp_decode_speedup(2, preset="bandwidth-draft", layers=1, context=8, repeats=3,
                            timeout_s=120)
    assert len(got.single_s) == len(got.split_s) == 3 and got.world_size == 2
    assert got.speedup == pytest.approx(min(got.single_s) / min(got.split_s))
    assert 0 <= got.allreduce_share <= 1
    assert got.whole_bytes / 2 < got.shard_bytes < got.whole_bytes  # half, plus what is whole

# ---------------------------------------------------------------- the launcher's guard rails

def failing_worker(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError("rank 1 gave up")
    torch.distributed.recv(torch.zeros(1), src=1)  # would wait for ever without the guard


def sleeping_worker(rank: int, world_size: int, folder: str) -> None:
    (Path(folder) / f"rank{rank}.pid").write_text(str(os.getpid()))
    time.sleep(600)


def test_a_failing_rank_stops_the_launch_with_its_error() -> None:
    with pytest.raises(RankError, match="(?s)rank1 failed first.*rank 1 gave up"):
        launch(failing_worker, 2, timeout_s=30)


def test_a_hung_launch_times_out_and_stops_its_ranks(tmp_path: Path) -> None:
    with pytest.raises(TimeoutError, match="did not finish within 5 s"):
        launch(sleeping_worker, 2, str(tmp_path), timeout_s=5)
    assert not multiprocessing.active_children()   # every rank killed and reaped
    # On a loaded machine a rank may still be starting at the deadline: check the pids there are.
    pids = [int(f.read_text()) for f in tmp_path.glob("rank*.pid")]
    for pid in pids:                       # killed and reaped, not left sleeping
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_workers_must_be_importable() -> None:
    def local(rank: int, world_size: int) -> None: ...
    with pytest.raises(ValueError, match="define the worker in a .py module"):
        launch(local, 2)
