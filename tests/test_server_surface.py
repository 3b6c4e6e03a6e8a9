"""The server's surface around generation: Prometheus metrics (k3core's names and vLLM's), the model card routes,
the access log, and LangChain's ChatOpenAI as a client. One k3-demo server (engine on a thread) serves the module.
"""
from __future__ import annotations

import logging
import time

import httpx
import openai
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from k3core.serve.access_log import AccessLogMiddleware
from k3core.serve.app import create_app
from k3core.serve.args import ServerArgs, parse_args
from k3core.serve.engine_thread import EngineThread
from k3core.serve.launch import build_server
from k3core.serve.metrics import ServerMetrics, metric_sum, parse_metrics
from tests.server_helpers import DEMO_ENGINE, running_server

MODEL = "k3-demo"
API_KEY = "surface-key"
CONTEXT = 2048
ACCESS = "k3core.serve.access"


@pytest.fixture(scope="module")
def server():
    args = ServerArgs(model=MODEL, api_key=API_KEY, context_length=CONTEXT, log_level="warning",
                      engine_in_process=True, seed=0, **DEMO_ENGINE)
    with running_server(args) as (base, _):
        yield base


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


def scrape(base: str) -> dict[str, float]:
    return parse_metrics(httpx.get(base + "/metrics", timeout=10).text)


def moved(after: dict, before: dict, name: str, **labels: str) -> float:
    return metric_sum(after, name, **labels) - metric_sum(before, name, **labels)


def wait_idle(base: str, timeout: float = 10.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        values = scrape(base)
        if metric_sum(values, "vllm:num_requests_running") == 0 and \
                metric_sum(values, "vllm:num_requests_waiting") == 0:
            return values
        assert time.monotonic() < deadline, "requests still running"
        time.sleep(0.02)


def access_lines(caplog, needle: str, timeout: float = 5.0) -> list[str]:
    """The access-log messages containing `needle`; the line is written just after the last byte is sent, so a
    client may read its response a moment before the line exists."""
    deadline = time.monotonic() + timeout
    while True:
        lines = [r.getMessage() for r in caplog.records if r.name == ACCESS and needle in r.getMessage()]
        if lines or time.monotonic() > deadline:
            return lines
        time.sleep(0.02)


# ---- metrics ------------------------------------------------------------------------------------------------
VLLM_SERIES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
               "vllm:gpu_cache_usage_perc", "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
               "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:request_success_total",
               "vllm:num_preemptions_total", "vllm:time_to_first_token_seconds_bucket",
               "vllm:inter_token_latency_seconds_bucket", "vllm:time_per_output_token_seconds_bucket",
               "vllm:e2e_request_latency_seconds_bucket", "vllm:request_queue_time_seconds_bucket",
               "vllm:request_prompt_tokens_bucket", "vllm:request_generation_tokens_bucket")


def test_metrics_carry_both_name_families_and_move_with_a_request(server, client):
    text = httpx.get(server + "/metrics").text
    for name in VLLM_SERIES:
        assert f'{name}{{' in text and f'model_name="{MODEL}"' in text, name
    assert 'vllm:request_success_total{engine="0",finished_reason="stop",model_name="k3-demo"}' in text
    # vLLM's buckets, so that a board's histogram_quantile reads the same edges
    assert 'vllm:time_to_first_token_seconds_bucket{engine="0",le="2560.0"' in text
    assert 'vllm:request_prompt_tokens_bucket{engine="0",le="2000.0"' in text       # 1-2-5 up to the context
    assert 'le="5000.0"' not in text.split("vllm:request_prompt_tokens_bucket", 1)[1].split("# HELP", 1)[0]

    before = wait_idle(server)
    out = client.completions.create(model=MODEL, prompt="def add(a, b):\n", max_tokens=9, temperature=0,
                                    extra_body={"ignore_eos": True})
    after = wait_idle(server)
    prompt, completion = out.usage.prompt_tokens, out.usage.completion_tokens
    assert completion == 9
    for family in ("vllm:", "k3core_"):
        assert moved(after, before, family + "prompt_tokens_total") == prompt
        assert moved(after, before, family + "generation_tokens_total") == completion
    assert moved(after, before, "vllm:request_success_total", finished_reason="length") == 1
    assert moved(after, before, "k3core_request_success_total", finish_reason="length") == 1
    for histogram in ("time_to_first_token_seconds", "e2e_request_latency_seconds"):
        assert moved(after, before, f"vllm:{histogram}_count") == 1
        assert moved(after, before, f"k3core_{histogram}_count") == 1
    assert moved(after, before, "vllm:request_queue_time_seconds_count") == 1
    queue = moved(after, before, "vllm:request_queue_time_seconds_sum")
    assert 0 <= queue <= moved(after, before, "vllm:e2e_request_latency_seconds_sum")
    assert moved(after, before, "vllm:request_prompt_tokens_sum") == prompt
    assert moved(after, before, "vllm:request_generation_tokens_sum") == completion
    # one latency per token after the first; both vLLM names carry the same observations
    assert moved(after, before, "vllm:inter_token_latency_seconds_count") == completion - 1
    assert moved(after, before, "vllm:time_per_output_token_seconds_sum") == \
        moved(after, before, "vllm:inter_token_latency_seconds_sum")


def test_prefix_cache_and_kv_usage_read_as_vllm_counts_them(server, client):
    before = wait_idle(server)
    prompt = "import os\nimport sys\n\n\ndef main(argv):\n    parser = argparse.ArgumentParser()\n" * 3
    for _ in range(2):
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    after = wait_idle(server)
    hits, queries = moved(after, before, "vllm:prefix_cache_hits_total"), \
        moved(after, before, "vllm:prefix_cache_queries_total")
    assert 0 < hits <= queries                        # in tokens: the second request reused the first's prefix
    assert hits == moved(after, before, "k3core_prefix_cache_hit_tokens_total")
    assert queries == moved(after, before, "k3core_prefix_cache_queried_tokens_total")
    # idle: the pool holds the cached prefix, but no request holds anything, and cached prefixes are evictable
    assert metric_sum(after, "k3core_pool_bytes", kind="mla") > 0
    assert metric_sum(after, "vllm:kv_cache_usage_perc") == 0
    assert metric_sum(after, "vllm:gpu_cache_usage_perc") == 0


def test_kv_usage_counts_what_running_requests_hold(server):
    """While a long stream runs, its slot and pages are held: usage rises above 0 and stays at most 1."""
    body = dict(model=MODEL, prompt="class Stack:\n", max_tokens=400, temperature=0, ignore_eos=True, stream=True)
    headers = {"Authorization": f"Bearer {API_KEY}"}
    usage = []
    with httpx.stream("POST", server + "/v1/completions", json=body, headers=headers, timeout=120) as response:
        for index, line in enumerate(response.iter_lines()):
            if index == 5:
                usage.append(metric_sum(scrape(server), "vllm:kv_cache_usage_perc"))
                break
    wait_idle(server)
    assert 0 < usage[0] <= 1


def test_every_server_has_its_own_registry():
    first, second = ServerMetrics("a"), ServerMetrics("b")
    first.observe_first_token(0.5, 7)
    assert metric_sum(parse_metrics(first.render()), "vllm:prompt_tokens_total") == 7
    assert metric_sum(parse_metrics(second.render()), "vllm:prompt_tokens_total") == 0
    assert 'model_name="b"' in second.render() and 'model_name="a"' not in second.render()


# ---- model cards --------------------------------------------------------------------------------------------
def test_model_retrieve_and_list_carry_max_model_len(server, client):
    card = client.models.retrieve(MODEL)
    assert card.id == MODEL and card.object == "model" and card.owned_by == "k3core"
    assert card.model_extra["max_model_len"] == CONTEXT
    [listed] = client.models.list().data
    assert listed.model_dump() == card.model_dump()
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("gpt-4o")
    assert missing.value.body["code"] == "model_not_found" and "k3-demo" in missing.value.body["message"]
    reply = httpx.get(server + f"/v1/models/{MODEL}")                       # no key
    assert reply.status_code == 401 and reply.json()["error"]["code"] == "invalid_api_key"


# ---- access log ---------------------------------------------------------------------------------------------
def test_access_log_has_a_line_per_request_with_tokens_and_latency(server, client, caplog):
    caplog.set_level(logging.INFO, logger=ACCESS)
    out = client.completions.create(model=MODEL, prompt="def f(x):\n", max_tokens=5, temperature=0,
                                    extra_body={"ignore_eos": True})
    [line] = access_lines(caplog, '"POST /v1/completions" 200')
    assert f"prompt_tokens={out.usage.prompt_tokens} completion_tokens=5 latency_ms=" in line
    assert line.startswith("127.0.0.1:")
    # a stream is logged when it ends, with the tokens of the whole stream
    caplog.clear()
    chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=7, temperature=0, stream=True))
    assert chunks
    [line] = access_lines(caplog, '"POST /v1/chat/completions" 200')
    assert "completion_tokens=7" in line
    client.models.list()
    assert access_lines(caplog, '"GET /v1/models" 200 latency_ms=')


def test_access_log_gives_the_reason_of_every_error(server, client, caplog):
    caplog.set_level(logging.INFO, logger=ACCESS)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="x", max_tokens=5, extra_body={"top_p": 7})
    [reason] = access_lines(caplog, '"POST /v1/completions" 400:')
    assert "top_p" in reason
    assert [r.levelno for r in caplog.records if r.getMessage() == reason] == [logging.WARNING]
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x", max_tokens=5)
    assert "the model 'nope' does not exist" in access_lines(caplog, '"POST /v1/completions" 404:')[0]
    httpx.get(server + "/v1/models")
    assert "invalid API key" in access_lines(caplog, '"GET /v1/models" 401:')[0]
    httpx.get(server + "/no/such/route")
    assert "no route GET /no/such/route" in access_lines(caplog, '"GET /no/such/route" 404:')[0]


def test_disable_log_requests_keeps_only_the_error_lines(caplog):
    args = parse_args(["--disable-log-requests"])
    assert args.disable_log_requests
    metrics = ServerMetrics(args.model_name)
    cold = EngineThread(lambda: None, metrics)                 # never started: every generation route answers 503
    caplog.set_level(logging.INFO, logger=ACCESS)
    with TestClient(create_app(args, cold, metrics)) as http:
        assert http.get("/v1/models").status_code == 200
        assert http.post("/v1/completions", json={"model": MODEL, "prompt": "x"}).status_code == 503
        assert http.get("/health").status_code == 503
    records = [r for r in caplog.records if r.name == ACCESS]
    assert [(r.levelno, r.getMessage().split('" ')[1][:4]) for r in records] == \
        [(logging.ERROR, "503:"), (logging.INFO, "503:")]            # /health's 503 is a probe, not an error
    assert "still warming up" in records[0].getMessage()


def test_an_uncaught_exception_is_logged_as_a_500_with_its_message(caplog):
    app = FastAPI()
    app.add_middleware(AccessLogMiddleware)

    @app.get("/boom")
    async def boom():
        raise RuntimeError("the table is gone")

    caplog.set_level(logging.INFO, logger=ACCESS)
    with TestClient(app, raise_server_exceptions=False) as http:
        assert http.get("/boom").status_code == 500
    messages = [r.getMessage() for r in caplog.records if r.name == ACCESS]
    assert len(messages) == 2 and '"GET /boom" 500 latency_ms=' in messages[0]
    assert messages[1].endswith('"GET /boom" 500: internal server error (RuntimeError: the table is gone)')


def test_uvicorns_own_access_log_is_off():
    server = build_server(ServerArgs(model=MODEL, engine_in_process=True))
    assert server.uvicorn_server.config.access_log is False


# ---- LangChain ----------------------------------------------------------------------------------------------
def test_langchain_chat_openai_invoke_and_bind_tools(server, client):
    import langchain_openai                  # 5 s to import: paid only by this test
    chat = langchain_openai.ChatOpenAI(base_url=server + "/v1", api_key=API_KEY, model=MODEL, temperature=0,
                                       max_tokens=12, max_retries=0, timeout=120)
    messages = [{"role": "user", "content": "Write a function that adds two numbers."}]
    direct = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=12)
    reply = chat.invoke(messages)
    assert reply.content == direct.choices[0].message.content
    assert reply.response_metadata["model_name"] == MODEL
    assert reply.usage_metadata["output_tokens"] == direct.usage.completion_tokens

    tools = [{"type": "function", "function": {"name": "add", "description": "Add two integers.", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "required": ["a", "b"]}}}]
    with_tools = chat.bind_tools(tools)
    reply = with_tools.invoke(messages)
    direct = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=12,
                                            tools=tools)
    assert reply.content == (direct.choices[0].message.content or "")
    assert [call["name"] for call in reply.tool_calls] == \
        [call.function.name for call in direct.choices[0].message.tool_calls or []]


def test_langchain_with_structured_output_validates(server):
    """LangChain's `with_structured_output` (response_format json_schema, strict) against the grammar-constrained
    server: the reply parses into the pydantic model, greedy and sampled."""
    import typing

    import langchain_openai
    import pydantic

    class Point(pydantic.BaseModel):       # bounded fields: a random-ish model cannot run past max_tokens in one
        color: typing.Literal["red", "green", "blue"]
        visible: bool

    for temperature in (0.0, 1.0):
        chat = langchain_openai.ChatOpenAI(base_url=server + "/v1", api_key=API_KEY, model=MODEL,
                                           temperature=temperature, seed=3, max_tokens=160, max_retries=0,
                                           timeout=120, reasoning_effort="none")
        point = chat.with_structured_output(Point, method="json_schema", strict=True).invoke(
            [{"role": "user", "content": "Give a point with a label."}])
        assert isinstance(point, Point)
