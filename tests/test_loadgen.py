"""The load generator against our server on loopback (a few requests each), its figures from
hand-made timelines, the Harbor-shaped prompts, and the routing policies on the simulator.
Nothing here asserts a duration: client and server timings are only compared for order
(the client sends before the server receives, and sees the token after it is made)."""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

import tinyserve
from tinyserve.__main__ import main
from tinyserve.engine import EngineConfig
from tinyserve.generate import generate_ids
from tinyserve.loadgen.prompts import (HARBOR_TICKETS, Prompt, corpus_prompts, harbor_prompts,
                                    prompt_of_length)
from tinyserve.loadgen.generator import Result, knee, run_load, run_metrics
from tinyserve.metrics import SLO, summarize
from tinyserve.serving.local_servers import local_server
from tinyserve.serving.routing import ByShape, LeastLoaded, RoundRobin, make_router, simulate
from tinyserve.simulator import CostModel
from tinyserve.workload import Fixed, Mixture, Uniform, make_workload

METRIC_KEYS = {"p50_ttft_ms", "p99_ttft_ms", "p50_tpot_ms", "p99_itl_ms", "p99_e2el_ms",
               "request_throughput", "output_throughput", "goodput"}


@pytest.fixture(scope="module")
def tok():
    return tinyserve.load_tokenizer()


@pytest.fixture(scope="module")
def server(tok):
    model = tinyserve.load_model("target")
    with local_server(model=model, tokenizer=tok) as (url, app):
        yield url, model


def test_streamed_requests_match_the_server(server, tok) -> None:
    url, model = server
    prompts = corpus_prompts(4, max_tokens=8)
    results = run_load(url, "target", prompts, concurrency=2)
    assert [r.ok for r in results] == [True] * 4, [r.error for r in results]
    for p, r in zip(prompts, results):
        assert r.prompt_tokens == p.prompt_tokens == len(tok.encode(p.text))
        # one SSE chunk per token, and the usage chunk agrees
        assert r.output_tokens == len(r.chunk_times) == 8 and r.finish_reason == "length"
        ref = list(generate_ids(model, tok.encode(p.text), 8, stop_ids=(tok.eos_id,)))
        assert r.text == tok.decode(ref, skip_special=True)
        s = r.server_timings
        assert s is not None and 0 <= s["queue_ms"] <= s["ttft_ms"] <= s["e2e_ms"]
        # The client sends before the server's clock starts and reads after it stops.
        assert r.ttft * 1e3 >= s["ttft_ms"] and r.e2e * 1e3 >= s["e2e_ms"]
        assert r.chunk_times == sorted(r.chunk_times) and r.start < r.chunk_times[0]
    m = run_metrics(results, SLO())
    assert METRIC_KEYS <= set(m) and m["completed"] == 4 and m["failed"] == 0
    assert m["total_output_tokens"] == 32 and m["goodput"] == m["request_throughput"]
    assert run_metrics(results, SLO(ttft_ms=0.0))["goodput"] == 0.0


def test_refused_request_is_a_failure_with_the_servers_message(server, tok) -> None:
    url, _ = server
    long_text = tok.decode(prompt_of_length(600, 0, [tok.encode(p.text)
                                                     for p in corpus_prompts(8)]))
    prompts = [corpus_prompts(1, max_tokens=4)[0], Prompt(long_text, 600, 1)]
    results = run_load(url, "target", prompts)
    assert results[0].ok and not results[1].ok
    assert results[1].status == 400 and "context window is 512" in results[1].error
    m = run_metrics(results)
    assert m["completed"] == 1 and m["failed"] == 1 and m["slo_attainment"] == 0.5


def test_router_spreads_requests_over_urls(server) -> None:
    url, _ = server
    results = run_load([url, url], "target", corpus_prompts(4, max_tokens=2))
    assert [r.replica for r in results] == [0, 1, 0, 1] and all(r.ok for r in results)


def test_fixed_concurrency_of_one_never_overlaps(server) -> None:
    url, _ = server
    results = run_load(url, "target", corpus_prompts(3, max_tokens=2), concurrency=1)
    assert all(r.ok for r in results)
    assert all(b.start >= a.end for a, b in zip(results, results[1:]))


def test_the_clock_starts_when_the_request_is_sent(server) -> None:
    """Two requests through a pool of one connection: the second waits for the connection,
    and that wait is not its latency (its clock starts after the first's last chunk)."""
    import asyncio

    import httpx

    from tinyserve.loadgen.generator import send
    url, _ = server
    prompts = corpus_prompts(2, max_tokens=8)

    async def both() -> tuple[list, float]:
        async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=1)) as c:
            created = time.perf_counter()
            return list(await asyncio.gather(*(send(c, url, "target", p) for p in prompts))), created

    (first, second), created = asyncio.run(both())
    assert first.ok and second.ok
    assert created < first.start and second.start >= first.end


def test_chat_endpoint_times_tokens_as_completions_do(server) -> None:
    """The same prompt as one chat message: the server's template adds prompt tokens (the
    usage chunk says how many), and every chunk is a token, timed from the send."""
    url, _ = server
    prompt = corpus_prompts(1, max_tokens=6)[0]
    (done,) = run_load(url, "target", [prompt], endpoint="chat", ignore_eos=True)
    assert done.ok and done.output_tokens == len(done.chunk_times) == 6
    assert done.prompt_tokens > prompt.prompt_tokens and done.finish_reason == "length"
    assert done.start < done.chunk_times[0] and done.server_timings is not None
    with pytest.raises(ValueError, match="endpoint must be one of completions, chat"):
        run_load(url, "target", [prompt], endpoint="responses")


def test_control_chunks_are_not_tokens() -> None:
    """A role-only first chunk carries no token; an empty text does (a partial character);
    an empty finish-only last chunk is a token only when the usage counts one more token than
    the chunks so far (transformers serve sends it after its tokens, a server may also put a
    stop token there)."""
    import asyncio

    import httpx

    from tinyserve.loadgen.generator import _token_text, send
    assert _token_text({"delta": {"role": "assistant"}}, chat=True) is None
    assert _token_text({"delta": {"role": "assistant", "content": ""}}, chat=True) is None
    assert _token_text({"delta": {"role": "assistant", "content": "Hi"}}, chat=True) == "Hi"
    assert _token_text({"delta": {"content": ""}}, chat=True) == ""
    assert _token_text({"text": ""}, chat=False) == ""

    def stream(usage_tokens: int) -> bytes:
        chunks = [{"choices": [{"delta": {"role": "assistant"}}]},
                  {"choices": [{"delta": {"content": "a"}}]},
                  {"choices": [{"delta": {"content": "b"}}]},
                  {"choices": [{"delta": {}, "finish_reason": "stop"}],
                   "usage": {"completion_tokens": usage_tokens, "prompt_tokens": 3}}]
        return b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks) + \
            b"data: [DONE]\n\n"

    async def one(usage_tokens: int):
        transport = httpx.MockTransport(lambda request: httpx.Response(
            200, content=stream(usage_tokens), headers={"content-type": "text/event-stream"}))
        async with httpx.AsyncClient(transport=transport) as client:
            return await send(client, "http://peer", "m", Prompt("x", 1, 3), endpoint="chat")

    after_tokens, stop_token = asyncio.run(one(2)), asyncio.run(one(3))
    assert after_tokens.ok and len(after_tokens.chunk_times) == after_tokens.output_tokens == 2
    assert stop_token.ok and len(stop_token.chunk_times) == stop_token.output_tokens == 3
    assert after_tokens.text == stop_token.text == "ab" and stop_token.finish_reason == "stop"


def test_cli_writes_the_metrics_object(server, tmp_path: Path) -> None:
    url, _ = server
    out = tmp_path / "lg.json"
    assert main(["loadgen", "--url", url, "--dataset", "tickets", "--num-requests", "3",
                 "--max-tokens", "4", "--rate", "50", "100", "--slo-ttft-ms", "60000",
                 "--price-per-hour", "2", "--json", str(out), "--plot",
                 str(tmp_path / "lg.png")]) == 0
    data = json.loads(out.read_text())
    assert METRIC_KEYS <= set(data["metrics"]) and len(data["points"]) == 2
    assert data["metrics"]["cost_per_m_output_tokens"] > 0
    assert (tmp_path / "lg.png").stat().st_size > 0


def test_bad_arguments_name_the_limit(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ValueError, match="concurrency must be at least 1"):
        run_load("http://127.0.0.1:9", "target", corpus_prompts(1), concurrency=0)
    with pytest.raises(ValueError, match="no prompts"):
        run_load("http://127.0.0.1:9", "target", [])
    assert main(["loadgen", "--num-requests", "0"]) == 2
    assert "--num-requests must be at least 1" in capsys.readouterr().err
    assert main(["loadgen", "--dataset", "uniform", "--prompt-len", "50", "10"]) == 2
    assert "--prompt-len takes LOW HIGH with 1 <= LOW <= HIGH" in capsys.readouterr().err


def test_uniform_ticket_prompts_have_the_asked_lengths(tok) -> None:
    from tinyserve.loadgen.prompts import ticket_prompts
    prompts = ticket_prompts(6, Uniform(20, 300), Fixed(64), seed=1)
    for p in prompts:
        assert 18 <= p.prompt_tokens <= 302 and p.text.endswith("<|reply|>")
        assert p.max_tokens == min(64, 512 - p.prompt_tokens)
    long_ = ticket_prompts(1, Fixed(500), Fixed(64))[0]
    assert long_.max_tokens == 12             # lowered so that prompt + cap fits the window


def _result(start: float, chunks: list[float], prompt: int = 10) -> Result:
    return Result(prompt, start, chunks, chunks[-1], len(chunks), ok=True)


def test_figures_from_a_known_timeline() -> None:
    # Two requests: TTFT 0.1 and 0.3 s; gaps 0.05 (x3) and 0.2 s.
    a = _result(0.0, [0.1, 0.15, 0.2, 0.25])
    b = _result(0.5, [0.8, 1.0])
    failed = Result(10, 0.2, end=0.3, error="429")
    m = run_metrics([a, b, failed], SLO(ttft_ms=200), price_per_hour=3.6, input_weight=0.5)
    assert m["completed"] == 2 and m["failed"] == 1
    assert m["duration_s"] == pytest.approx(1.0)
    assert m["mean_ttft_ms"] == pytest.approx(200) and m["p50_ttft_ms"] == pytest.approx(200)
    assert m["p50_tpot_ms"] == pytest.approx((50 + 200) / 2)
    assert m["p50_itl_ms"] == pytest.approx(50) and m["p99_itl_ms"] == pytest.approx(
        50 + 0.97 * 150)
    assert m["p99_e2el_ms"] == pytest.approx(250 + 0.99 * 250)
    assert m["request_throughput"] == pytest.approx(2.0)
    assert m["output_throughput"] == pytest.approx(6.0)
    assert m["goodput"] == pytest.approx(1.0) and m["slo_attainment"] == pytest.approx(1 / 3)
    # $3.60/h for a 1 s run = $0.001; weighted tokens 0.5*20 + 6 = 16.
    assert m["cost_per_m_output_tokens"] == pytest.approx(0.001 / 16 * 1e6)
    assert m["cost_per_m_input_tokens"] == pytest.approx(0.5 * 0.001 / 16 * 1e6)
    with pytest.raises(RuntimeError, match="no request completed"):
        run_metrics([failed])


def test_knee_is_the_most_goodput_at_the_lowest_rate() -> None:
    pts = [{"rate": r, "metrics": {"goodput": g}} for r, g in
           ((1, 1.0), (2, 1.97), (4, 2.0), (8, 1.2))]
    assert knee(pts) == 1   # 1.97 is within 2% of the best: the cheaper point wins


def test_harbor_prompts_keep_the_fixture_shape(tok) -> None:
    prompts = harbor_prompts(80)
    rows = [json.loads(line) for line in HARBOR_TICKETS.read_text().splitlines()][:80]
    assert [p.tag for p in prompts] == [r["id"] for r in rows]
    for p, r in zip(prompts, rows):
        want = max(8, round(r["prompt_tokens"] * 512 / 16384))
        assert abs(p.prompt_tokens - want) <= 2, (r["id"], p.prompt_tokens, want)
        assert p.text.endswith("<|reply|>")    # the model answers with a reply
    too_long = [p.tag for p in prompts if p.prompt_tokens + p.max_tokens > 512]
    assert too_long == ["HT-0078"]             # as in Harbor, one ticket cannot fit


def test_policies_pick_as_described() -> None:
    rr = RoundRobin()
    assert [rr(10, [5, 0, 0]) for _ in range(4)] == [0, 1, 2, 0]
    assert LeastLoaded()(10, [3, 1, 1]) == 1
    shape = ByShape(long_prompt=256, long_replicas=1)
    assert shape(300, [9, 0, 0]) == 0 and shape(20, [0, 4, 2]) == 2
    with pytest.raises(ValueError, match="needs at least one more"):
        shape(20, [0])
    with pytest.raises(ValueError, match="unknown routing policy"):
        make_router("random")


def test_shape_routing_lowers_short_p99_ttft_on_the_simulator() -> None:
    specs = make_workload(200, 8.0, Mixture((Uniform(8, 48), Fixed(448)), (0.8, 0.2)),
                          Uniform(16, 48), seed=5)
    config = EngineConfig(num_blocks=2048, block_size=16, max_num_seqs=16,
                          max_num_batched_tokens=256)
    # A fixed fit (the shipped one of November 2026): the story must not move when the
    # shipped fit is recalibrated to a faster engine.
    cost = CostModel(step=2.380e-3, token=2.247e-4, row=4.189e-4, pair=3.206e-7)
    p99 = {}
    for name in ("round-robin", "shape"):
        seqs, where = simulate(specs, make_router(name), 2, config, cost)
        assert all(s.finish_reason == "length" for s in seqs) and len(seqs) == len(specs)
        short = [s.trace for sp, s in zip(specs, seqs) if sp.prompt_len < 256]
        long_ = [s.trace for sp, s in zip(specs, seqs) if sp.prompt_len >= 256]
        p99[name] = (summarize(short)["p99_ttft_ms"], summarize(long_)["p99_ttft_ms"])
        if name == "shape":   # every long prompt on replica 0, every short one on replica 1
            assert all(w == (sp.prompt_len >= 256) ^ 1 for sp, w in zip(specs, where))
        else:
            assert where == [i % 2 for i in range(len(specs))]
    assert p99["shape"][0] < p99["round-robin"][0] / 2    # short requests: far lower tail
    assert p99["shape"][1] > p99["round-robin"][1]        # long ones pay: one replica for all
    again, _ = simulate(specs, make_router("shape"), 2, config, cost)   # deterministic
    assert [s.trace.token_times for s in again] == [s.trace.token_times for s in seqs]
