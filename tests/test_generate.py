"""Clocked generation: the trace's timestamps are complete and ordered, the streamed tokens
are the trace's tokens, stopping rules hold, and the batched loop equals one row at a time."""
from __future__ import annotations

import pytest
import torch

from tinyserve.config import ModelConfig
from tinyserve.generate import (PromptError, generate, generate_batch, generate_ids,
                                generate_stream)
from tinyserve.metrics import RequestTrace
from tinyserve.model import TinyLlama

from conftest import random_prompt, sharp_model
from tinyserve.sampling import SamplingParams

SMALL = ModelConfig(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=32)


@pytest.fixture(scope="module")
def model() -> TinyLlama:
    return sharp_model(SMALL, seed=1)


def _prompt(n: int, seed: int) -> list[int]:
    return random_prompt(SMALL.vocab_size, n, seed)


@pytest.mark.parametrize("use_cache", [True, False])
def test_trace_records_every_stage_in_order(model: TinyLlama, use_cache: bool) -> None:
    trace = RequestTrace(prompt_tokens=0, arrival=0.0)
    streamed = list(generate_stream(model, _prompt(6, 0), 9, use_cache=use_cache, trace=trace))
    assert streamed == trace.tokens and trace.output_tokens == 9
    assert trace.prompt_tokens == 6 and trace.use_cache is use_cache
    assert trace.finish_reason == "length"
    stamps = [trace.arrival, trace.admitted, trace.prefill_start, trace.prefill_end,
              *trace.token_times, trace.finish]
    assert all(s is not None for s in stamps)
    assert stamps == sorted(stamps)  # monotonic clock: each stage after the one before


def test_tokens_are_yielded_before_the_request_finishes(model: TinyLlama) -> None:
    trace = RequestTrace(prompt_tokens=0, arrival=0.0)
    stream = generate_stream(model, _prompt(4, 1), 5, trace=trace)
    first = next(stream)
    assert trace.tokens == [first] and trace.finish is None  # streamed, not batched at the end
    rest = list(stream)
    assert trace.tokens == [first, *rest] and trace.finish is not None


def test_stop_token_ends_the_request_and_is_yielded(model: TinyLlama) -> None:
    prompt = _prompt(5, 2)
    free = list(generate_ids(model, prompt, 12))
    stop = free[3]
    expected = free[:free.index(stop) + 1]
    trace = generate(model, prompt, 12, stop_ids=(stop,))
    assert trace.tokens == expected and trace.finish_reason == "stop"


def test_generation_stops_at_the_window(model: TinyLlama) -> None:
    prompt = _prompt(28, 3)
    trace = generate(model, prompt, 50)
    assert trace.output_tokens == SMALL.max_position_embeddings - 28
    assert trace.finish_reason == "window"


def test_seeded_sampling_is_reproducible_and_same_with_or_without_cache(model: TinyLlama) -> None:
    params = SamplingParams(temperature=1.0, top_k=20, top_p=0.9, seed=11)
    prompt = _prompt(7, 4)
    a = generate(model, prompt, 15, sampling=params).tokens
    b = generate(model, prompt, 15, sampling=params).tokens
    c = generate(model, prompt, 15, sampling=params, use_cache=False).tokens
    assert a == b == c


@pytest.mark.parametrize("use_cache", [True, False])
def test_batch_of_different_lengths_equals_each_prompt_alone(model: TinyLlama,
                                                             use_cache: bool) -> None:
    prompts = [_prompt(n, 10 + n) for n in (2, 11, 6, 6)]
    batched = generate_batch(model, prompts, 10, use_cache=use_cache)
    assert batched == [list(generate_ids(model, p, 10)) for p in prompts]


def test_batch_rows_stop_independently(model: TinyLlama) -> None:
    prompts = [_prompt(n, 20 + n) for n in (3, 8)]
    alone = [list(generate_ids(model, p, 10)) for p in prompts]
    stop = alone[0][2]
    out = generate_batch(model, prompts, 10, stop_ids=(stop,))
    for row, full in zip(out, alone):
        cut = full.index(stop) + 1 if stop in full else len(full)
        assert row == full[:cut]


def test_bad_prompts_raise_prompt_errors(model: TinyLlama) -> None:
    with pytest.raises(PromptError, match="empty"):
        generate(model, [], 3)
    with pytest.raises(PromptError, match="context window is 32"):
        generate(model, _prompt(32, 5), 3)
    with pytest.raises(PromptError, match="context window is 32"):
        generate_batch(model, [_prompt(3, 5), _prompt(40, 5)], 3)


def test_cli_stream_and_no_cache_print_the_same_text(capsys: pytest.CaptureFixture[str]) -> None:
    from tinyserve.__main__ import main
    outs = []
    for extra in ([], ["--stream"], ["--no-cache"]):
        code = main(["generate", "--prompt", "<|ticket|>Subject: refund", "--max-tokens", "12",
                     *extra])
        out, err = capsys.readouterr()
        assert code == 0 and "TTFT" in err and "ITL p50" in err and "tok/s" in err
        outs.append(out)
    assert outs[0] == outs[1] == outs[2]


def test_cli_rejects_bad_top_p_with_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    from tinyserve.__main__ import main
    code = main(["generate", "--prompt", "hi", "--top-p", "2"])
    err = capsys.readouterr().err
    assert code == 2 and "top_p must be in (0, 1]" in err and "Traceback" not in err
