"""The OpenAI-compatible server, driven by the real `openai` client against k3-tiny on a free loopback port.

One server (in-process, uvicorn in a background thread) serves the whole module; it is shut down at the end.
Greedy outputs are compared with the offline `LLM.generate` of the same random weights, so a server that mixes
up streams, drops tokens or mis-slices text fails, not just one that crashes.
"""
from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import httpx
import openai
import pytest
import torch

from k3core import LLM, SamplingParams
from k3core.serve.args import DEFAULT_MODEL, ServerArgs, parse_args
from k3core.serve.launch import build_server
from k3core.serve.metrics import metric_sum, parse_metrics

API_KEY = "test-key"
MODEL = "k3-tiny"
CONTEXT = 320                 # small, so that the "prompt too long" case is cheap
MAX_BODY = 256 * 1024
SEED = 0
ENGINE = dict(page_size=16, checkpoint_interval=32, chunked_prefill_tokens=256, max_running_requests=64)


@pytest.fixture(scope="module")
def server():
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    args = ServerArgs(model=MODEL, port=port, api_key=API_KEY, context_length=CONTEXT, max_body_bytes=MAX_BODY,
                      seed=SEED, log_level="warning", memory_bytes=64 << 20,
                      cpu_threads=torch.get_num_threads(),     # leave the process-wide setting as the suite has it
                      **ENGINE)
    srv = build_server(args)
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    status = None
    while time.monotonic() < deadline:
        try:
            status = httpx.get(base + "/health", timeout=2).status_code
            if status == 200:
                break
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    assert status == 200, f"server did not become healthy (last status {status}, engine error {srv.engine.error})"
    yield base
    srv.shutdown()
    thread.join(15)
    sock.close()
    assert not thread.is_alive(), "the server thread did not stop"


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def offline():
    """The same random weights, run offline: the reference for greedy outputs."""
    return LLM(MODEL, backend="auto", device="cpu", dtype="float32", seed=SEED, prefix_cache=False,
               **{k: v for k, v in ENGINE.items() if k != "checkpoint_interval"})


def headers():
    return {"Authorization": f"Bearer {API_KEY}"}


def metrics(base: str) -> dict[str, float]:
    return parse_metrics(httpx.get(base + "/metrics", timeout=10).text)


def wait_idle(base: str, timeout: float = 10.0) -> dict[str, float]:
    """Aborts reach the engine thread asynchronously: poll until no request runs or waits."""
    deadline = time.monotonic() + timeout
    while True:
        values = metrics(base)
        if metric_sum(values, "k3core_num_requests_running") == 0 and \
                metric_sum(values, "k3core_num_requests_waiting") == 0:
            return values
        assert time.monotonic() < deadline, f"requests still running after {timeout}s: {values}"
        time.sleep(0.02)


def greedy_text(offline, prompt: str, max_tokens: int) -> str:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return offline.generate([prompt], params)[0].text


# ---- arguments ------------------------------------------------------------------------------------------
def test_flags_override_yaml(tmp_path):
    config = tmp_path / "serve.yaml"
    config.write_text("port: 31000\nmemory-fraction: 0.25\ndisable-prefix-cache: true\npage_size: 32\n"
                      "checkpoint-interval: 64\n")
    args = parse_args(["--config", str(config), "--port", "31001", "--page-size", "16"])
    assert (args.port, args.memory_fraction, args.disable_prefix_cache, args.page_size) == (31001, 0.25, True, 16)
    assert args.model == DEFAULT_MODEL and args.host == "127.0.0.1"
    config.write_text("no-such-flag: 1\n")
    with pytest.raises(SystemExit):
        parse_args(["--config", str(config)])


def test_health_is_503_until_the_engine_is_warm():
    from fastapi.testclient import TestClient

    from k3core.serve.app import create_app
    from k3core.serve.engine_thread import EngineThread
    from k3core.serve.metrics import ServerMetrics
    args = ServerArgs(model=MODEL)
    metrics_ = ServerMetrics(args.model_name)
    cold = EngineThread(lambda: None, metrics_)             # never started: stays cold
    with TestClient(create_app(args, cold, metrics_)) as http:
        assert http.get("/health").status_code == 503
        reply = http.post("/v1/completions", json={"model": MODEL, "prompt": "x"})
        assert reply.status_code == 503 and reply.json()["error"]["code"] == "engine_not_ready"
        assert "k3core_engine_ready" in http.get("/metrics").text


# ---- completions and chat -------------------------------------------------------------------------------
def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(server + "/health").json() == {"status": "ok"}


def test_completion_matches_offline_greedy(client, offline):
    prompt = "The quick brown fox"
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert out.choices[0].text == greedy_text(offline, prompt, 12)
    assert out.choices[0].finish_reason == "length"
    assert out.usage.prompt_tokens == len(prompt.encode())      # byte-level tokenizer: one token per byte
    assert out.usage.completion_tokens == 12
    assert out.usage.total_tokens == out.usage.prompt_tokens + 12


def test_streamed_completion_equals_whole(client, offline):
    prompt = "Streaming: ünïcödé €"
    stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0, stream=True,
                                       stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == greedy_text(offline, prompt, 20)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
    assert chunks[-1].usage.prompt_tokens == len(prompt.encode())


def test_stream_ends_with_done(server):
    body = {"model": MODEL, "prompt": "abc", "max_tokens": 3, "stream": True}
    with httpx.stream("POST", server + "/v1/completions", json=body, headers=headers(), timeout=30) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line for line in response.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    assert all(json.loads(e[6:])["object"] == "text_completion" for e in events[:-1])


def test_chat_whole_and_streamed_agree(client, offline):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=10,
                                           temperature=0, extra_body={"ignore_eos": True})
    prompt_ids = offline.tokenizer.apply_chat_template(messages)
    expected = offline.generate([prompt_ids], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))[0]
    assert whole.choices[0].message.role == "assistant"
    assert whole.choices[0].message.content == expected.text
    assert whole.usage.prompt_tokens == len(prompt_ids)
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0,
                                            stream=True, extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected.text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_repeated_long_prompt_reports_cached_tokens(client):
    prompt = "A long shared system prompt. " * 8             # 232 bytes: several checkpoints of 32 tokens
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    second = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached < second.usage.prompt_tokens
    assert first.choices[0].text == second.choices[0].text      # a cache hit must not change the greedy output


def test_stop_string_cuts_text(client, offline):
    prompt = "stop test"
    full = greedy_text(offline, prompt, 24)
    visible = [ch for ch in full[3:] if ch.isprintable() and ch != "\ufffd"]
    if not visible:
        pytest.skip("the greedy output of these random weights has no printable character to stop on")
    stop = visible[0]
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0, stop=[stop],
                                    extra_body={"ignore_eos": True})
    assert out.choices[0].text == full[:full.index(stop)]
    assert out.choices[0].finish_reason == "stop"
    streamed = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0, stop=stop,
                                         stream=True, extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in streamed) == full[:full.index(stop)]


def test_n_and_seed(client):
    kwargs = dict(model=MODEL, prompt="sample me", max_tokens=16, temperature=1.0, n=3, seed=1234,
                  extra_body={"ignore_eos": True, "top_k": 50, "min_p": 0.01})
    first = client.completions.create(**kwargs)
    second = client.completions.create(**kwargs)
    assert sorted(c.index for c in first.choices) == [0, 1, 2]
    assert [c.text for c in first.choices] == [c.text for c in second.choices]   # a seed makes sampling repeatable
    assert first.usage.completion_tokens == 48 and first.usage.prompt_tokens == len(b"sample me")


def test_logprobs(client, server):
    out = client.completions.create(model=MODEL, prompt="logprobs", max_tokens=5, temperature=0, logprobs=3,
                                    extra_body={"ignore_eos": True})
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert chosen <= 0 and len(top) <= 3
        assert abs(chosen - max(top.values())) < 1e-5           # greedy: the chosen token is the most likely
    # both from an empty cache (a cached prefix would run the last prompt token in a batch of one row, whose
    # float32 sums may differ in the last bit from the whole prompt's): this compares streaming with whole only
    assert httpx.post(server + "/flush_cache", headers=headers()).status_code == 200
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=4,
                                          temperature=0, logprobs=True, top_logprobs=2,
                                          extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content
    assert len(content) == 4
    assert httpx.post(server + "/flush_cache", headers=headers()).status_code == 200
    streamed = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                              max_tokens=4, temperature=0, logprobs=True, top_logprobs=2,
                                              stream=True, extra_body={"ignore_eos": True})
    streamed_content = [item for chunk in streamed if chunk.choices and chunk.choices[0].logprobs
                        for item in chunk.choices[0].logprobs.content]
    assert [(i.token, i.logprob) for i in streamed_content] == [(i.token, i.logprob) for i in content]
    for item in content:
        assert len(item.top_logprobs) == 2
        assert item.top_logprobs[0].logprob >= item.top_logprobs[1].logprob
        assert abs(item.logprob - item.top_logprobs[0].logprob) < 1e-5


# ---- errors ---------------------------------------------------------------------------------------------
def _error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


def test_errors_use_the_openai_envelope(server, client):
    url = server + "/v1/completions"
    _error(httpx.post(url, content=b"{not json", headers=headers()), 400)
    assert _error(httpx.post(url, json={"model": MODEL, "prompt": "x", "max_tokens": "9"}, headers=headers()),
                  400)["param"] == "max_tokens"
    assert _error(httpx.post(url, json={"model": MODEL, "prompt": 7}, headers=headers()), 400)["param"] == "prompt"
    _error(httpx.post(server + "/v1/chat/completions", json={"model": MODEL, "messages": "hi"}, headers=headers()),
           400)
    with pytest.raises(openai.BadRequestError) as excinfo:
        client.completions.create(model=MODEL, prompt="x" * (CONTEXT + 5), max_tokens=1)
    assert (f"This model's maximum context length is {CONTEXT} tokens. However, your request has "
            f"{CONTEXT + 5} input tokens.") in str(excinfo.value)
    with pytest.raises(openai.BadRequestError) as excinfo:
        client.completions.create(model=MODEL, prompt="hello", max_tokens=CONTEXT)
    assert excinfo.value.body["param"] == "max_tokens"
    with pytest.raises(openai.NotFoundError) as excinfo:
        client.completions.create(model="gpt-5", prompt="hello", max_tokens=1)
    assert excinfo.value.body["code"] == "model_not_found"
    bad_key = openai.OpenAI(base_url=server + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad_key.completions.create(model=MODEL, prompt="hello", max_tokens=1)
    _error(httpx.post(url, json={"model": MODEL, "prompt": "x" * (2 * MAX_BODY)}, headers=headers()), 413)
    _error(httpx.get(server + "/v1/nothing-here", headers=headers()), 404)
    # ... and the server still serves
    assert client.completions.create(model=MODEL, prompt="still here", max_tokens=2).usage.completion_tokens >= 1


# ---- concurrency, disconnects, memory -------------------------------------------------------------------
def test_32_concurrent_streams_interleave(server, offline):
    prompts = [f"stream number {i}: " + "x" * i for i in range(32)]
    num_tokens = 12
    arrivals: list[tuple[int, float]] = []

    async def one(aclient: openai.AsyncOpenAI, i: int) -> str:
        stream = await aclient.completions.create(model=MODEL, prompt=prompts[i], max_tokens=num_tokens,
                                                  temperature=0, stream=True, extra_body={"ignore_eos": True})
        text = ""
        async for chunk in stream:
            arrivals.append((i, time.monotonic()))
            text += chunk.choices[0].text
        return text

    async def main() -> list[str]:
        async with openai.AsyncOpenAI(base_url=server + "/v1", api_key=API_KEY, max_retries=0, timeout=60) as ac:
            return await asyncio.gather(*(one(ac, i) for i in range(32)))

    before = metrics(server)
    texts = asyncio.run(main())
    expected = offline.generate(prompts, SamplingParams(max_tokens=num_tokens, temperature=0.0, ignore_eos=True))
    assert texts == [e.text for e in expected]
    # interleaving: some stream got its first chunk before another stream had its last one
    first = {i: min(t for j, t in arrivals if j == i) for i in range(32)}
    last = {i: max(t for j, t in arrivals if j == i) for i in range(32)}
    assert sum(first[i] < last[j] for i in range(32) for j in range(32) if i != j) > 32
    after = wait_idle(server)
    generated = metric_sum(after, "k3core_generation_tokens_total") - metric_sum(before,
                                                                                 "k3core_generation_tokens_total")
    assert generated == 32 * num_tokens


def test_disconnect_mid_stream_aborts_and_frees(server):
    before = metrics(server)
    body = {"model": MODEL, "prompt": "a stream nobody finishes reading", "max_tokens": 250, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", server + "/v1/completions", json=body, headers=headers(), timeout=30) as response:
        lines = response.iter_lines()
        received = [next(lines) for _ in range(6)]         # 3 events and their blank separators
    assert sum(line.startswith("data: ") for line in received) >= 2
    after = wait_idle(server)
    aborted = metric_sum(after, "k3core_request_success_total", finish_reason="abort") - \
        metric_sum(before, "k3core_request_success_total", finish_reason="abort")
    assert aborted == 1
    assert metric_sum(after, "k3core_generation_tokens_total") - \
        metric_sum(before, "k3core_generation_tokens_total") < 250
    assert httpx.post(server + "/flush_cache", headers=headers()).json() == {"success": True}
    values = metrics(server)
    assert metric_sum(values, "k3core_pool_bytes", kind="kda") == 0
    assert metric_sum(values, "k3core_pool_bytes", kind="mla") == 0
    assert metric_sum(values, "k3core_pool_bytes", kind="free") == metric_sum(values, "k3core_pool_capacity_bytes")


def test_disconnect_while_waiting_for_a_whole_response_aborts(server):
    before = metrics(server)
    body = {"model": MODEL, "prompt": "a patient client that leaves", "max_tokens": 280, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server + "/v1/completions", json=body, headers=headers(), timeout=httpx.Timeout(30, read=0.3))
    after = wait_idle(server)
    aborted = metric_sum(after, "k3core_request_success_total", finish_reason="abort") - \
        metric_sum(before, "k3core_request_success_total", finish_reason="abort")
    assert aborted == 1


def test_abort_request_endpoint(server):
    body = {"model": MODEL, "prompt": "abort me", "max_tokens": 250, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", server + "/v1/completions", json=body, headers=headers(), timeout=30) as response:
        events = (json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {"))
        rid = next(events)["id"]
        reply = httpx.post(server + "/abort_request", json={"rid": rid}, headers=headers())
        assert reply.status_code == 200, reply.text
        reasons = [e["choices"][0]["finish_reason"] for e in events if e["choices"]]
    assert reasons[-1] == "abort"
    wait_idle(server)
    assert httpx.post(server + "/abort_request", json={"rid": rid}, headers=headers()).status_code == 404


def test_metrics_exposes_the_required_series(server):
    text = httpx.get(server + "/metrics").text
    for name in ("k3core_num_requests_running", "k3core_num_requests_waiting", "k3core_prompt_tokens_total",
                 "k3core_generation_tokens_total", "k3core_time_to_first_token_seconds_bucket",
                 "k3core_inter_token_latency_seconds_bucket", "k3core_e2e_request_latency_seconds_count",
                 "k3core_prefix_cache_queried_tokens_total", "k3core_prefix_cache_hit_tokens_total",
                 'kind="kda"', 'kind="mla"', 'kind="free"'):
        assert name in text, name
    values = parse_metrics(text)
    assert metric_sum(values, "k3core_prefix_cache_hit_tokens_total") > 0          # from the repeated prompt test
    assert metric_sum(values, "k3core_prefix_cache_hit_tokens_total") <= \
        metric_sum(values, "k3core_prefix_cache_queried_tokens_total")


def test_penalties_min_tokens_logit_bias_and_many_stops_are_honoured(server, offline):
    """Sampling controls reach the device sampler: the server's tokens equal the offline engine's with the same
    SamplingParams, and each control changes the output (so none is silently dropped)."""
    prompt = "penalties"
    base = dict(model=MODEL, prompt=prompt, max_tokens=12, temperature=0.9, seed=5, ignore_eos=True)
    # a bias that makes 'x' (byte 120) likely, then penalties that push back each time it repeats
    lean = dict(logit_bias={"120": 12})
    controls = dict(presence_penalty=1.5, frequency_penalty=2.0, repetition_penalty=1.4, min_tokens=4, **lean)
    body = httpx.post(server + "/v1/completions", json=dict(base, **controls), headers=headers(), timeout=60).json()
    params = SamplingParams(max_tokens=12, temperature=0.9, seed=5, ignore_eos=True,
                            **{**controls, "logit_bias": {120: 12.0}})
    want = offline.generate([prompt], params)[0]
    assert body["choices"][0]["text"] == want.text
    leaning = offline.generate([prompt], SamplingParams(max_tokens=12, temperature=0.9, seed=5, ignore_eos=True,
                                                        logit_bias={120: 12.0}))[0]
    assert want.token_ids.count(120) < leaning.token_ids.count(120), "the penalties changed nothing"
    forced = httpx.post(server + "/v1/completions", json=dict(base, logit_bias={"120": 100}), headers=headers(),
                        timeout=60).json()
    assert forced["choices"][0]["text"] == "x" * 12                # byte 120 is 'x'
    stops = [f"never{i}" for i in range(30)] + ["x"]
    stopped = httpx.post(server + "/v1/completions", json=dict(base, logit_bias={"120": 100}, stop=stops),
                         headers=headers(), timeout=60).json()
    assert stopped["choices"][0]["text"] == "" and stopped["choices"][0]["finish_reason"] == "stop"
    top = httpx.post(server + "/v1/completions", json=dict(base, max_tokens=2, logprobs=20), headers=headers(),
                     timeout=60).json()
    for position in top["choices"][0]["logprobs"]["top_logprobs"]:
        assert len(position) >= 20
    for bad in (dict(presence_penalty=3), dict(logit_bias={"x": 1}), dict(logit_bias={"5": 101}),
                dict(repetition_penalty=0), dict(min_tokens=-1), dict(stop=["a"] * 300)):
        response = httpx.post(server + "/v1/completions", json=dict(base, **bad), headers=headers(), timeout=60)
        assert response.status_code == 400 and next(iter(bad)) in response.text, (bad, response.text)
