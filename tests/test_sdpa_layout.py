"""Every decoding path gives the same tokens when SDPA returns the memory-efficient kernel's
output layout (what CUDA returns for a masked or fp32 call; tests/sdpa_layout.py says why).

Each test decodes once with the kernels' own layout, then again with the efficient layout
imposed, and asserts the tokens are equal and that SDPA was really reached. On a CPU this is
the only way to see a ``.view`` that CUDA's layout breaks: before the fix, the grouped
attention in tinyserve/model.py crashed here in every path but the paged engine."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from conftest import random_prompt, sharp_model
from sdpa_layout import as_efficient_layout, efficient_layout
from tinyserve.config import ModelConfig
from tinyserve.engine import EngineConfig, generate_many
from tinyserve.generate import generate, generate_batch

# Grouped-query attention with more than one KV head and more than one query head per KV
# head: the grouped attention reshapes queries and output across both, where a layout
# assumption shows (with one KV head, or one query head each, any layout views alike).
CFG = ModelConfig(vocab_size=61, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=48)
DRAFT = ModelConfig(vocab_size=61, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=48)
TOKENS = 8


@pytest.fixture(scope="module")
def model():
    return sharp_model(CFG, seed=3)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return [random_prompt(CFG.vocab_size, n, seed=n) for n in (5, 11, 3)]


def same_tokens_under_efficient_layout(run: Callable[[], Any]) -> None:
    want = run()
    with efficient_layout() as fake:
        got = run()
    assert fake.calls > 0, "the path never called SDPA: the layout was not exercised"
    assert got == want


def test_the_imposed_layout_is_the_efficient_kernels() -> None:
    q, k, v = (torch.randn(2, 3, 5, 8) for _ in range(3))
    ours = F.scaled_dot_product_attention(q, k, v)
    with efficient_layout() as fake:
        theirs = F.scaled_dot_product_attention(q, k, v)
    assert fake.calls == 1 and F.scaled_dot_product_attention is not fake
    torch.testing.assert_close(theirs, ours, rtol=0, atol=0)
    # (B, H, M, K) seen over a (B, M, H, K) buffer: .view across heads and rows is illegal
    assert theirs.transpose(1, 2).is_contiguous() and not theirs.is_contiguous()
    with pytest.raises(RuntimeError, match="view size is not compatible"):
        theirs.view(2, 3 * 5, 8)
    assert theirs.reshape(2, 3 * 5, 8).equal(ours.reshape(2, 3 * 5, 8))
    assert as_efficient_layout(torch.ones(3, 4)).is_contiguous()   # not 4-D: as it was


def test_the_fixture_imposes_it(sdpa_efficient_layout) -> None:
    out = F.scaled_dot_product_attention(*(torch.randn(1, 2, 3, 4) for _ in range(3)))
    assert sdpa_efficient_layout.calls == 1 and not out.is_contiguous()


@pytest.mark.parametrize("graph,use_cache", [(False, True), (True, True), (False, False)],
                         ids=["eager-cache", "graph", "no-cache"])
def test_generate(model, prompts, graph: bool, use_cache: bool) -> None:
    same_tokens_under_efficient_layout(
        lambda: generate(model, prompts[1], TOKENS, path=("graph" if graph else "auto" if graph is None else "eager"), use_cache=use_cache).tokens)


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
def test_generate_batch(model, prompts, graph: bool) -> None:
    same_tokens_under_efficient_layout(lambda: generate_batch(model, prompts, TOKENS, path=("graph" if graph else "auto" if graph is None else "eager")))


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
def test_engine_paged_with_chunked_prefill(model, prompts, graph: bool) -> None:
    # 8 tokens a step: the 11-token prompt is prefilled in chunks, beside decode rows
    config = EngineConfig(num_blocks=32, block_size=4, max_num_seqs=3,
                          max_num_batched_tokens=8, chunked_prefill=True, path=("graph" if graph else "auto" if graph is None else "eager"))
    same_tokens_under_efficient_layout(lambda: generate_many(model, prompts, TOKENS, config))


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
def test_speculative_with_a_model_drafter(model, prompts, graph: bool) -> None:
    from tinyserve.speculative import ModelDrafter, speculative_generate
    draft = sharp_model(DRAFT, seed=4)
    same_tokens_under_efficient_layout(lambda: speculative_generate(
        model, ModelDrafter(draft, path=("graph" if graph else "auto" if graph is None else "eager")), prompts[0], TOKENS, k=3, path=("graph" if graph else "auto" if graph is None else "eager"))[0])


def test_speculative_with_the_replay_drafter(model, prompts) -> None:
    from tinyserve.draft_replay import ReplayDrafter, greedy_script
    from tinyserve.speculative import speculative_generate
    draft = sharp_model(DRAFT, seed=4)

    def run() -> list[int]:
        script = greedy_script(model, prompts[0], TOKENS)
        drafter = ReplayDrafter(draft, script, 0.7, seed=1)
        return speculative_generate(model, drafter, prompts[0], TOKENS, k=3)[0]
    same_tokens_under_efficient_layout(run)


def test_int8(model, prompts) -> None:
    from tinyserve.quant import quantize_model
    int8 = quantize_model(model)
    same_tokens_under_efficient_layout(lambda: generate(int8, prompts[1], TOKENS).tokens)


def test_compiled_decode(model, prompts) -> None:
    # backend="eager": traced by TorchDynamo (the .view is checked on fake tensors with the
    # traced strides), no code generation, seconds
    from tinyserve.backends.compiled import DECODERS
    from tinyserve.generate import generate_compiled

    def run() -> list[list[int]]:
        # A fresh decoder each run: its first step traces inside the course's raised
        # recompile limit (backends.compiled.compiling). A kept decoder would retrace on the
        # swapped SDPA outside it, and fail past TorchDynamo's default 8 entries once other
        # tests in this process have compiled the same method.
        DECODERS.drop(model)
        return generate_compiled(model, prompts, TOKENS, backend="eager")
    same_tokens_under_efficient_layout(run)
