"""The OpenAI-compatible server on a loopback port, driven by the official ``openai`` client
and by raw HTTP: correctness against the reference loop, streaming, usage, cancel storms,
overload, bad inputs and shutdown. Every test is bounded in time and stays on 127.0.0.1."""
from __future__ import annotations

import asyncio
import json
import random
import threading
import time

import httpx
import openai
import pytest

import tinyserve
from tinyserve.engine import EngineConfig
from tinyserve.generate import generate_ids
from tinyserve.serving.local_servers import local_server

PROMPT = ("<|ticket|>Ticket: HB-1 | Workspace: acme | Plan: Team | Channel: email\nFrom: Ana\n"
          "Subject: Refund for unused seats\n\nWe removed 3 seats last week. Can we get a refund?\n"
          "<|triage|>")


@pytest.fixture(scope="module")
def model():
    return tinyserve.load_model("target")


@pytest.fixture(scope="module")
def tok():
    return tinyserve.load_tokenizer()


def running_server(model, tok, **kwargs):
    """Our server in a thread on a free loopback port (stops, drained, at the end)."""
    return local_server("target", model=model, tokenizer=tok, **kwargs)


@pytest.fixture(scope="module")
def server(model, tok):
    with running_server(model, tok) as (url, app):
        yield url, app


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


def _reference(model, tok, prompt: str, n: int) -> str:
    ids = list(generate_ids(model, tok.encode(prompt), n, stop_ids=(tok.eos_id,)))
    return tok.decode(ids, skip_special=True)


def _kv_blocks_used(url: str) -> int:
    return httpx.get(f"{url}/health", timeout=10).json()["kv_blocks_used"]


def test_completion_equals_reference_greedy(server, model, tok) -> None:
    url, _ = server
    r = _client(url).completions.create(model="target", prompt=PROMPT, max_tokens=40,
                                        temperature=0)
    assert r.choices[0].text == _reference(model, tok, PROMPT, 40)
    assert r.usage.prompt_tokens == len(tok.encode(PROMPT))
    assert r.usage.completion_tokens == 40 and r.choices[0].finish_reason == "length"
    assert r.usage.total_tokens == r.usage.prompt_tokens + 40
    timings = r.model_extra["timings"]
    assert 0 <= timings["queue_ms"] <= timings["ttft_ms"] <= timings["e2e_ms"]


def test_streaming_usage_matches_tokens_received(server, model, tok) -> None:
    url, _ = server
    chunks = list(_client(url).completions.create(
        model="target", prompt=PROMPT, max_tokens=30, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    tokens = [c for c in chunks if c.choices]              # one chunk per generated token
    usage = chunks[-1].usage
    assert usage.completion_tokens == len(tokens) == 30
    assert "".join(c.choices[0].text for c in tokens) == _reference(model, tok, PROMPT, 30)
    assert tokens[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in tokens[:-1])


def test_chat_sync_and_stream_agree(server) -> None:
    url, _ = server
    messages = [{"role": "user", "content": "Subject: Login fails\n\nI cannot log in since Monday."}]
    client = _client(url)
    whole = client.chat.completions.create(model="target", messages=messages, max_tokens=200,
                                           temperature=0)
    parts = list(client.chat.completions.create(model="target", messages=messages,
                                                max_tokens=200, temperature=0, stream=True))
    assert whole.choices[0].message.role == "assistant"
    assert "".join(p.choices[0].delta.content or "" for p in parts) == whole.choices[0].message.content
    assert whole.choices[0].finish_reason == parts[-1].choices[0].finish_reason == "stop"  # <|end|>
    assert whole.usage.completion_tokens == len(parts)
    assert whole.choices[0].message.content.startswith("category:")


def test_async_client_streams_concurrently(server, model, tok) -> None:
    url, _ = server
    prompts = [PROMPT.replace("3 seats", f"{n} seats") for n in (2, 5, 9, 12)]

    async def one(client: openai.AsyncOpenAI, prompt: str) -> str:
        stream = await client.completions.create(model="target", prompt=prompt, max_tokens=24,
                                                 temperature=0, stream=True)
        return "".join([c.choices[0].text async for c in stream if c.choices])

    async def main() -> list[str]:
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        try:
            return await asyncio.gather(*(one(client, p) for p in prompts))
        finally:
            await client.close()

    got = asyncio.run(main())
    assert got == [_reference(model, tok, p, 24) for p in prompts]   # batched == alone


def test_seeded_sampling_is_reproducible(server) -> None:
    url, _ = server
    c = _client(url)
    runs = [c.completions.create(model="target", prompt=PROMPT, max_tokens=20, temperature=1.0,
                                 seed=7, extra_body={"top_k": 50}).choices[0].text for _ in range(2)]
    other = c.completions.create(model="target", prompt=PROMPT, max_tokens=20, temperature=1.0,
                                 seed=8, extra_body={"top_k": 50}).choices[0].text
    assert runs[0] == runs[1] != other


def test_ignore_eos_runs_to_max_tokens(server) -> None:
    url, _ = server
    messages = [{"role": "user", "content": "Subject: Login fails\n\nI cannot log in."}]
    c = _client(url)
    natural = c.chat.completions.create(model="target", messages=messages, max_tokens=300,
                                        temperature=0)
    assert natural.choices[0].finish_reason == "stop"      # the reply ends with <|end|>
    n = natural.usage.completion_tokens + 20
    forced = c.chat.completions.create(model="target", messages=messages, max_tokens=n,
                                       temperature=0, extra_body={"ignore_eos": True})
    assert forced.usage.completion_tokens == n and forced.choices[0].finish_reason == "length"


def test_stop_strings_cut_the_text(server, model, tok) -> None:
    url, _ = server
    full = _reference(model, tok, PROMPT, 40)
    stop = full.split("\n")[1][:6]                          # something in the second line
    c = _client(url)
    r = c.completions.create(model="target", prompt=PROMPT, max_tokens=40, temperature=0,
                             stop=[stop])
    assert r.choices[0].text == full[:full.index(stop)] and r.choices[0].finish_reason == "stop"
    streamed = "".join(ch.choices[0].text for ch in c.completions.create(
        model="target", prompt=PROMPT, max_tokens=40, temperature=0, stop=[stop], stream=True)
        if ch.choices)
    assert streamed == r.choices[0].text


BAD = [
    ("not json", '{"model": "target", "prompt": ', 400, "not valid JSON"),
    ("unknown model", {"model": "gpt-9", "prompt": "hi"}, 404, "the model 'gpt-9' does not exist"),
    ("no prompt", {"model": "target"}, 422, "prompt: Field required"),
    ("temperature type", {"model": "target", "prompt": "hi", "temperature": "hot"}, 422,
     "temperature: Input should be a valid number"),
    ("temperature range", {"model": "target", "prompt": "hi", "temperature": 3}, 422,
     "temperature: Input should be less than or equal to 2"),
    ("max_tokens zero", {"model": "target", "prompt": "hi", "max_tokens": 0}, 422,
     "max_tokens: Input should be greater than or equal to 1"),
    ("too long", {"model": "target", "prompt": "hi", "max_tokens": 600}, 400,
     "context window is 512 tokens; the prompt has 2 tokens and max_tokens is 600"),
    ("empty prompt", {"model": "target", "prompt": ""}, 400, "the prompt is empty"),
    ("bad token id", {"model": "target", "prompt": [1, 99999]}, 400, "token ids must be in [0, 4096)"),
    ("n > 1", {"model": "target", "prompt": "hi", "n": 2}, 400,
     "the parameter 'n' is not supported by this server (got 2): send one request"),
    ("logprobs", {"model": "target", "prompt": "hi", "logprobs": 3}, 400,
     "the parameter 'logprobs' is not supported"),
    ("echo", {"model": "target", "prompt": "hi", "echo": True}, 400,
     "the parameter 'echo' is not supported"),
    ("best_of", {"model": "target", "prompt": "hi", "best_of": 3}, 400,
     "the parameter 'best_of' is not supported"),
    ("penalty", {"model": "target", "prompt": "hi", "presence_penalty": 0.5}, 400,
     "the parameter 'presence_penalty' is not supported"),
    ("long value capped", {"model": "target", "prompt": "hi", "suffix": "x" * 500}, 400,
     "(got 'xxxxxxxx"),
    ("too many stops", {"model": "target", "prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}, 400,
     "stop takes up to 4"),
]

USER = [{"role": "user", "content": "Subject: Login fails"}]
BAD_CHAT = [
    ("tools", {"model": "target", "messages": USER, "tools": [
        {"type": "function", "function": {"name": "lookup", "parameters": {}}}]}, 400,
     "the parameter 'tools' is not supported by this server"),
    ("tool_choice", {"model": "target", "messages": USER, "tool_choice": "auto"}, 400,
     "the parameter 'tool_choice' is not supported"),
    ("response_format", {"model": "target", "messages": USER,
                         "response_format": {"type": "json_object"}}, 400,
     "the parameter 'response_format' is not supported"),
    ("n > 1", {"model": "target", "messages": USER, "n": 3}, 400,
     "the parameter 'n' is not supported"),
    ("logprobs", {"model": "target", "messages": USER, "logprobs": True, "top_logprobs": 2}, 400,
     "the parameter 'logprobs' is not supported"),
    ("image part", {"model": "target", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]}, 400,
     "content parts of type 'image_url' are not supported; this model reads text only"),
    ("part without text", {"model": "target", "messages": [{"role": "user", "content": [
        {"type": "text"}]}]}, 400, "parts of type 'text' with a 'text' string"),
    ("max_completion_tokens too long", {"model": "target", "messages": USER,
                                        "max_completion_tokens": 600}, 400,
     "max_completion_tokens is 600"),
    ("max_completion_tokens zero", {"model": "target", "messages": USER,
                                    "max_completion_tokens": 0}, 422,
     "max_completion_tokens: Input should be greater than or equal to 1"),
    ("tool role", {"model": "target", "messages": [{"role": "tool", "content": "42"}]}, 422,
     "messages.0.role"),
]


def _post(url: str, path: str, body: str | dict) -> httpx.Response:
    content = body if isinstance(body, str) else json.dumps(body)
    return httpx.post(f"{url}{path}", content=content,
                      headers={"content-type": "application/json"}, timeout=30)


@pytest.mark.parametrize("name,body,status,message", BAD, ids=[b[0] for b in BAD])
def test_bad_inputs_get_their_status_and_message(server, name, body, status, message) -> None:
    r = _post(server[0], "/v1/completions", body)
    assert r.status_code == status, r.text
    assert message in r.json()["error"]["message"]
    if status == 400 and "parameter" in message:
        assert r.json()["error"]["param"] == message.split("'")[1]
        assert len(r.json()["error"]["message"]) < 300      # the echoed value is capped


@pytest.mark.parametrize("name,body,status,message", BAD_CHAT, ids=[b[0] for b in BAD_CHAT])
def test_bad_chat_inputs_get_their_status_and_message(server, name, body, status, message) -> None:
    r = _post(server[0], "/v1/chat/completions", body)
    assert r.status_code == status, r.text
    assert message in r.json()["error"]["message"]


def test_chat_content_as_text_parts_equals_a_string(server) -> None:
    client = _client(server[0])
    kwargs = dict(model="target", max_tokens=24, temperature=0)
    plain = client.chat.completions.create(messages=[
        {"role": "system", "content": "Plan: Team"},
        {"role": "user", "content": "Subject: Login fails\nI cannot log in."}], **kwargs)
    parts = client.chat.completions.create(messages=[
        {"role": "developer", "content": [{"type": "text", "text": "Plan: Team"}]},
        {"role": "user", "content": [{"type": "text", "text": "Subject: Login fails"},
                                     {"type": "text", "text": "I cannot log in."}]}], **kwargs)
    assert parts.choices[0].message.content == plain.choices[0].message.content
    assert parts.usage.prompt_tokens == plain.usage.prompt_tokens


def test_max_completion_tokens_is_honoured_and_preferred(server) -> None:
    client = _client(server[0])
    r = client.chat.completions.create(model="target", messages=USER, temperature=0,
                                       max_completion_tokens=5, max_tokens=50)
    assert r.usage.completion_tokens == 5 and r.choices[0].finish_reason == "length"


def test_parameters_at_their_unused_values_are_accepted(server) -> None:
    r = _client(server[0]).chat.completions.create(
        model="target", messages=USER, max_tokens=3, temperature=0, n=1, logprobs=False,
        response_format={"type": "text"}, presence_penalty=0, user="learner-1",
        metadata={"course": "ch9"})
    assert r.usage.completion_tokens == 3


def test_chat_must_end_with_a_user_message(server) -> None:
    url, _ = server
    r = httpx.post(f"{url}/v1/chat/completions", timeout=30, json={
        "model": "target", "messages": [{"role": "assistant", "content": "hello"}]})
    assert r.status_code == 422 and "last message must come from the user" in r.text


def test_models_health_and_metrics(server) -> None:
    url, _ = server
    # a completion of its own, so the labelled counter exists whichever tests ran before
    _client(url).completions.create(model="target", prompt=PROMPT, max_tokens=2)
    models = _client(url).models.list()
    assert [m.id for m in models.data] == ["target"]
    assert httpx.get(f"{url}/health", timeout=10).json()["status"] == "ok"
    text = httpx.get(f"{url}/metrics", timeout=10).text
    for name in ("tinyserve_requests_total", "tinyserve_time_to_first_token_seconds_bucket",
                 "tinyserve_inter_token_latency_seconds_count", "tinyserve_queue_time_seconds",
                 "tinyserve_num_requests_running", "tinyserve_num_requests_waiting",
                 "tinyserve_kv_blocks_used", "tinyserve_prefix_cache_hit_rate"):
        assert name in text, name
    assert 'tinyserve_requests_total{endpoint="/v1/completions",status="200"}' in text


def _requests_counted(url: str, endpoint: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(sample.value for family in text_string_to_metric_families(text)
               for sample in family.samples
               if sample.name == "tinyserve_requests_total"
               and sample.labels == {"endpoint": endpoint, "status": "200"})


@pytest.mark.parametrize("max_tokens, finish", [(3, "length"), (400, "stop")])
def test_streamed_and_whole_replies_finish_and_count_alike(server, max_tokens, finish) -> None:
    url, _ = server
    client = _client(url)
    before = _requests_counted(url, "/v1/chat/completions")
    kwargs = dict(model="target", max_tokens=max_tokens, temperature=0,
                  messages=[{"role": "user", "content": "Subject: Login fails"}])
    whole = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert whole.choices[0].finish_reason == finish and reasons == [finish]
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content
    assert _requests_counted(url, "/v1/chat/completions") == before + 2


def test_cancel_storm_frees_every_block(server) -> None:
    url, _ = server
    rng = random.Random(0)

    async def open_and_drop(client: httpx.AsyncClient, i: int) -> None:
        body = {"model": "target", "prompt": PROMPT + f" #{i}", "max_tokens": 200,
                "temperature": 0, "stream": True}
        keep = rng.randint(0, 12)                          # chunks to read before leaving
        async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
            n = 0
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    n += 1
                    if n > keep:
                        break                              # drop the connection mid-stream

    async def main() -> None:
        async with httpx.AsyncClient(timeout=60) as client:
            await asyncio.gather(*(open_and_drop(client, i) for i in range(24)))

    asyncio.run(main())
    deadline = time.time() + 20
    while _kv_blocks_used(url) and time.time() < deadline:
        time.sleep(0.05)
    assert _kv_blocks_used(url) == 0
    health = httpx.get(f"{url}/health", timeout=10).json()
    assert health["running"] == 0 and health["waiting"] == 0
    r = _client(url).completions.create(model="target", prompt=PROMPT, max_tokens=5, temperature=0)
    assert r.usage.completion_tokens == 5                 # and it still answers


def test_overload_gets_429_and_admitted_requests_complete(model, tok) -> None:
    config = EngineConfig(num_blocks=256, block_size=16, max_num_seqs=2, max_num_batched_tokens=128)
    with running_server(model, tok, engine_config=config, max_waiting=2) as (url, _):
        async def one(client: httpx.AsyncClient, i: int) -> httpx.Response:
            return await client.post(f"{url}/v1/completions", json={
                "model": "target", "prompt": PROMPT + f" #{i}", "max_tokens": 40, "temperature": 0})

        async def main() -> list[httpx.Response]:
            async with httpx.AsyncClient(timeout=120) as client:
                return await asyncio.gather(*(one(client, i) for i in range(16)))

        responses = asyncio.run(main())
        codes = [r.status_code for r in responses]
        # The queue holds 2: requests arriving together beyond that are told to come back.
        assert set(codes) == {200, 429} and codes.count(200) >= 2
        for r in responses:
            if r.status_code == 429:
                assert int(r.headers["Retry-After"]) >= 1
                assert "limit 2" in r.json()["error"]["message"]
            else:
                assert r.json()["usage"]["completion_tokens"] == 40   # nothing lost
        assert _kv_blocks_used(url) == 0


def test_queue_deadline_gets_429(model, tok) -> None:
    config = EngineConfig(num_blocks=256, block_size=16, max_num_seqs=1, max_num_batched_tokens=128)
    with running_server(model, tok, engine_config=config, queue_timeout_s=0.2) as (url, _):
        async def main() -> tuple[int, httpx.Response]:
            async with httpx.AsyncClient(timeout=120) as client:
                # One slot: a long request holds it for ~400 decode steps (over 0.4 s even on
                # a fast machine), and the late one can only wait past its 0.2 s deadline.
                body = {"model": "target", "prompt": PROMPT, "max_tokens": 400,
                        "temperature": 0, "stream": True, "ignore_eos": True}
                async with client.stream("POST", f"{url}/v1/completions", json=body) as long:
                    lines = long.aiter_lines()
                    while not (await lines.__anext__()).startswith("data: "):
                        pass                                 # the long one is running now
                    late = await client.post(f"{url}/v1/completions", json={
                        "model": "target", "prompt": PROMPT, "max_tokens": 5, "temperature": 0})
                    chunks = 1 + sum([line.startswith("data: {") async for line in lines])
                return chunks, late

        chunks, late = asyncio.run(main())
        assert chunks == 400                                 # the running request was untouched
        assert late.status_code == 429 and "deadline 0.2 s" in late.json()["error"]["message"]
        assert int(late.headers["Retry-After"]) >= 1


def test_shutdown_drains_in_flight_requests(model, tok) -> None:
    result: dict[str, httpx.Response] = {}
    with running_server(model, tok) as (url, app):
        def call() -> None:
            result["r"] = httpx.post(f"{url}/v1/completions", timeout=60, json={
                "model": "target", "prompt": PROMPT, "max_tokens": 60, "temperature": 0})
        t = threading.Thread(target=call)
        t.start()
        deadline = time.time() + 10
        while not app.state.server.engine.engine.num_running and time.time() < deadline:
            time.sleep(0.01)
    t.join(timeout=60)                                     # the server stopped after draining
    assert result["r"].status_code == 200
    assert result["r"].json()["usage"]["completion_tokens"] == 60


def test_a_finished_requests_listeners_run_before_its_last_token_arrives(model) -> None:
    """A client that has read its last token finds the server's trace of the request
    recorded (chapter 9 reads it right away): a slow listener makes the other order fail."""
    from tinyserve.engine import Engine
    from tinyserve.serving.async_engine import AsyncEngine
    seen = []

    def slow(req, event, trace) -> None:
        time.sleep(0.2)
        seen.append((req.seq_id, trace))

    async def main() -> list:
        engine = AsyncEngine(Engine(model, EngineConfig(num_blocks=32, block_size=4)))
        engine.listeners.append(slow)
        try:
            stream = engine.submit([1, 2, 3], 4)
            tokens = [event async for event in stream]
            return [tokens[-1].finished, len(seen), seen[0][1].token_times == []]
        finally:
            await engine.shutdown(1.0)
    assert asyncio.run(main()) == [True, 1, False]
