"""The server under hostile or broken clients (k3-tiny on the CPU, engine on a thread of this process).

Every case a client can cause must end in the OpenAI error envelope with a 4xx, never a 500, and must leave the
other clients' requests untouched: innocent streams run beside the poison ones and must produce exactly the text
they produce alone. Limits are set low in this server so that each attack reaches its limit quickly.
"""
from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import httpx
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from k3core.serve.args import ServerArgs
from k3core.serve.launch import build_server
from k3core.serve.metrics import metric_sum, parse_metrics
from k3core.serve.responses import sse

# 1.5 s read timeouts and a 6 s slowloris bound: run alone, after the xdist workers (scripts/test.sh)
pytestmark = pytest.mark.serial

MODEL = "k3-tiny"
CONTEXT = 256
MAGIC = [311, 312, 313]          # a prompt starting with these ids makes the injected sampler fault fire
LIMITS = dict(max_choices_per_request=16, max_queued_requests=24, max_queued_tokens=4096, header_read_timeout=1.5,
              body_read_timeout=1.5, keep_alive_timeout=1.0, max_stream_buffer_events=16, default_max_tokens=4)


@pytest.fixture(scope="module")
def served():
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)    # inherited by accepted sockets: slow readers
    sock.bind(("127.0.0.1", 0))                                   # stall the server after a few KB
    port = sock.getsockname()[1]
    args = ServerArgs(model=MODEL, port=port, context_length=CONTEXT, seed=0, log_level="warning",
                      memory_bytes=32 << 20, cpu_threads=torch.get_num_threads(), engine_in_process=True,
                      page_size=16, checkpoint_interval=32, chunked_prefill_tokens=64, max_running_requests=16,
                      **LIMITS)
    srv = build_server(args)
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                break
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    else:
        pytest.fail(f"server did not become healthy (engine error {srv.engine.error})")
    _inject_sampler_fault(srv.engine.engine)
    yield base, srv, port
    srv.shutdown()
    thread.join(15)
    sock.close()


def _inject_sampler_fault(engine) -> None:
    """The sampler raises for any step holding a request whose prompt has MAGIC: an unknown poison."""
    sampler = engine.sampler
    original = sampler.sample

    def sample(logits, rows):
        if any(list(row.prompt_token_ids[:3]) == MAGIC for row in rows):
            raise RuntimeError("injected sampler fault")
        return original(logits, rows)
    sampler.sample = sample


def _idle(base: str, timeout: float = 20.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        values = parse_metrics(httpx.get(base + "/metrics", timeout=10).text)
        if metric_sum(values, "k3core_num_requests_running") + metric_sum(values, "k3core_num_requests_waiting") == 0:
            return values
        assert time.monotonic() < deadline, f"requests still held after {timeout} s"
        time.sleep(0.05)


def _envelope(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, (response.status_code, response.text[:300])
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


def _rss_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


# ---- validation ---------------------------------------------------------------------------------------------
POISON_BODIES = [   # (body, status, param): each refused by name, none reaches the engine
    ({"prompt": "x", "top_k": 2 ** 63}, 400, None),
    ({"prompt": "x", "top_k": 10 ** 6}, 400, "top_k"),
    ({"prompt": "x", "top_p": 1e-46}, 400, None),
    ({"prompt": "x", "temperature": 1e300}, 400, "temperature"),
    ({"prompt": "x", "n": 10 ** 4000}, 400, "n"),
    ({"prompt": "x", "seed": 2 ** 64}, 400, None),
    ({"prompt": "x", "logprobs": 21}, 400, "logprobs"),
    ({"prompt": "x", "max_tokens": 10 ** 30}, 400, "max_tokens"),
    ({"prompt": "x", "best_of": 3}, 400, "best_of"),
    ({"prompt": "x", "suffix": "tail"}, 400, "suffix"),
    ({"prompt": "x", "guided_json": {}}, 400, "guided_json"),
    ({"prompt": ["a"] * 600, "n": 64}, 400, "prompt"),
]
RAW_BODIES = [
    b"[" * 100_000 + b"]" * 100_000,
    b'{"model": "k3-tiny", "prompt": "x", "seed": ' + b"9" * 5000 + b"}",
    b'{"model": "k3-tiny", "prompt": "\\ud800"}',
    b'{"model": "k3-tiny", "prompt": "ok \\udc00 no"}',
    b'{"model": "k3-tiny", "prompt": "x", "temperature": NaN}',
    b'{"model": "k3-tiny", "prompt": "\xff\xfe"}',
    b'{"model": "k3-tiny", "prompt": [' + b'"a",' * 2_100_000 + b'"a"]}',     # 8 MB of one-character prompts
]


def _innocent_bodies() -> list[dict]:
    return [{"model": MODEL, "prompt": f"innocent stream {i} " + "y" * (5 * i), "max_tokens": 16, "temperature": 0,
             "ignore_eos": True, "stream": True} for i in range(3)]


async def _stream_text(client: httpx.AsyncClient, base: str, body: dict) -> str:
    text, done = "", False
    async with client.stream("POST", base + "/v1/completions", json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                text += chunk["choices"][0]["text"]
    assert done
    return text


def test_poison_requests_fail_alone_beside_innocent_streams(served):
    base, srv, _ = served
    alone = asyncio.run(_gather(base, [], _innocent_bodies()))[0]
    rss_before = _rss_bytes()
    texts, statuses = asyncio.run(_gather(base, POISON_BODIES, _innocent_bodies()))
    assert texts == alone, "an innocent stream changed because of a poison request beside it"
    for (body, status, param), (got_status, error) in zip(POISON_BODIES + [(None, None, None)] * len(RAW_BODIES)
                                                          + [(None, 500, None)], statuses):
        assert got_status == (status or 400), (body, got_status, error)
        assert error["message"], error
        if param is not None:
            assert error["param"] == param, (body, error)
    assert "injected sampler fault" in statuses[-1][1]["message"]      # the unknown poison: only it failed
    assert _rss_bytes() - rss_before < 400 << 20, "parsing the attack bodies took too much memory"
    _idle(base)
    assert srv.engine.engine.quarantine.num_failures >= 1 and not srv.engine.engine.quarantine.active


async def _gather(base: str, poison: list, innocent: list[dict]):
    async with httpx.AsyncClient(timeout=120) as client:
        streams = [asyncio.create_task(_stream_text(client, base, body)) for body in innocent]
        await asyncio.sleep(0.3 if poison else 0)            # the innocent streams are running
        statuses = []
        for body, _, _ in poison:
            response = await client.post(base + "/v1/completions", json={"model": MODEL, **body})
            statuses.append((response.status_code, response.json()["error"]))
        if poison:
            for raw in RAW_BODIES:
                response = await client.post(base + "/v1/completions", content=raw,
                                             headers={"content-type": "application/json"})
                statuses.append((response.status_code, response.json()["error"]))
            response = await client.post(base + "/v1/completions", json={
                "model": MODEL, "prompt": MAGIC + [5, 6], "max_tokens": 4})
            statuses.append((response.status_code, response.json()["error"]))
        return await asyncio.gather(*streams), statuses


JSON_LEAVES = st.none() | st.booleans() | st.integers(-2 ** 70, 2 ** 70) | st.floats(allow_nan=False, allow_infinity=False) | \
    st.text(max_size=12)
JSON_VALUES = st.recursive(JSON_LEAVES, lambda inner: st.lists(inner, max_size=4) |
                           st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)
FIELDS = ["prompt", "messages", "n", "temperature", "top_p", "top_k", "min_p", "stop", "seed", "logprobs",
          "top_logprobs", "logit_bias", "stream", "stream_options", "presence_penalty", "repetition_penalty",
          "min_tokens", "stop_token_ids", "best_of", "suffix", "tools", "tool_choice", "response_format",
          "chat_template_kwargs", "reasoning_effort", "user", "echo", "unknown_field"]


@st.composite
def _bodies(draw):
    body = {"model": draw(st.sampled_from([MODEL, MODEL, "other", 3]))}
    for name in draw(st.lists(st.sampled_from(FIELDS), max_size=6, unique=True)):
        body[name] = draw(JSON_VALUES)
    if draw(st.booleans()):
        body["prompt"] = draw(st.text(min_size=1, max_size=20))
    if draw(st.booleans()):
        body["messages"] = [{"role": draw(st.sampled_from(["user", "system", "tool", "bot"])),
                            "content": draw(JSON_VALUES)}]
    body["max_tokens"] = draw(st.sampled_from([1, 2, 3]) | JSON_VALUES)
    return body


def test_fuzzed_bodies_never_get_a_500(served):
    base, _, _ = served
    client = httpx.Client(timeout=60)

    @settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck), database=None,
              derandomize=True)
    @given(body=_bodies(), chat=st.booleans())
    def check(body, chat):
        if isinstance(body.get("max_tokens"), int) and body["max_tokens"] > 4:
            body["max_tokens"] = 4                   # valid bodies stay cheap to serve
        if isinstance(body.get("n"), int) and body["n"] > 4:
            body["n"] = 4
        response = client.post(base + ("/v1/chat/completions" if chat else "/v1/completions"), json=body)
        assert response.status_code in (200, 400, 404, 429), (body, response.status_code, response.text[:300])
        if response.status_code != 200:
            _envelope(response, response.status_code)

    check()
    client.close()
    _idle(base)


# ---- resources ----------------------------------------------------------------------------------------------
def test_a_flood_gets_429_with_retry_after_and_the_rest_is_served(served):
    base, _, _ = served

    async def main():
        async with httpx.AsyncClient(timeout=120) as client:
            body = {"model": MODEL, "prompt": "flood", "max_tokens": 4, "ignore_eos": True}
            return await asyncio.gather(*(client.post(base + "/v1/completions", json=body) for _ in range(40)))
    responses = asyncio.run(main())
    busy = [r for r in responses if r.status_code == 429]
    served_ok = [r for r in responses if r.status_code == 200]
    assert busy and served_ok and len(busy) + len(served_ok) == len(responses)
    assert all(r.headers["retry-after"] == "1" and r.json()["error"]["code"] == "server_busy" for r in busy)
    _idle(base)


def test_slowloris_connections_are_closed(served):
    _, _, port = served
    started = time.monotonic()
    headers = socket.create_connection(("127.0.0.1", port))
    headers.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
    body = socket.create_connection(("127.0.0.1", port))
    body.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 100\r\n\r\n{\"model\":")
    for sock in (headers, body):
        sock.settimeout(0.25)
    closed, answered = False, b""
    while time.monotonic() - started < 6 and not (closed and answered.endswith(b"}")):
        try:
            headers.sendall(b"X")                # one header byte at a time
            closed = closed or headers.recv(1) == b""
        except (socket.timeout, TimeoutError):
            pass
        except OSError:
            closed = True
        try:
            answered += body.recv(4096)
        except (socket.timeout, TimeoutError):
            pass
    assert closed, "a connection trickling its headers stayed open"
    assert answered.startswith(b"HTTP/1.1 408"), answered[:200]
    assert time.monotonic() - started < 6
    headers.close()
    body.close()
    dropped = socket.create_connection(("127.0.0.1", port))  # a client that leaves mid-upload costs nothing
    dropped.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{\"mo")
    dropped.close()


def test_a_stalled_stream_reader_is_aborted_and_freed(served):
    base, srv, port = served
    before = _idle(base)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    num_tokens = 60        # 16 choices with 20 logprobs each: the buffers between us fill within a few steps
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "nobody reads me"}], "n": 16,
                       "max_tokens": num_tokens, "ignore_eos": True, "stream": True, "logprobs": True,
                       "top_logprobs": 20}).encode()
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    deadline = time.monotonic() + 60
    engine = srv.engine
    while time.monotonic() < deadline:            # never read: the engine must let go of the request
        values = parse_metrics(httpx.get(base + "/metrics", timeout=10).text)
        aborted = metric_sum(values, "k3core_request_success_total", finish_reason="abort") - metric_sum(
            before, "k3core_request_success_total", finish_reason="abort")
        if aborted >= 16 and not engine._tracked:
            break
        time.sleep(0.1)
    else:
        pytest.fail("a stream nobody reads kept its request")
    finished = metric_sum(values, "k3core_request_success_total", finish_reason="length") - metric_sum(
        before, "k3core_request_success_total", finish_reason="length")
    assert finished == 0, "the reader was never stalled: every choice ran to its end"
    sock.close()
    _idle(base)


def test_request_timeout_aborts_with_504(served):
    base, srv, _ = served
    srv.args.request_timeout = 0.5
    try:
        response = httpx.post(base + "/v1/completions", json={"model": MODEL, "prompt": "long", "max_tokens": 200,
                                                              "ignore_eos": True}, timeout=60)
    finally:
        srv.args.request_timeout = None
    assert _envelope(response, 504)["code"] == "request_timeout"
    _idle(base)


def test_sse_events_stay_one_line_and_cached_tokens_can_be_hidden():
    from k3core.serve.generation import Usage
    event = sse({"text": "a\x85b\u2028c\u2029d"})
    assert event.count("\n") == 2 and len(event.rstrip("\n").splitlines()) == 1
    assert json.loads(event[len("data: "):])["text"] == "a\x85b\u2028c\u2029d"
    assert "prompt_tokens_details" not in Usage(3, 2, None).body()
    assert Usage(3, 2, 1).body()["prompt_tokens_details"] == {"cached_tokens": 1}


def test_unknown_fields_are_ignored_with_one_warning(served, caplog):
    base, _, _ = served
    with caplog.at_level("WARNING", logger="k3core.serve"):
        response = httpx.post(base + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 1,
                                                              "frobnicate": 1, "user": "u-1"}, timeout=60)
    assert response.status_code == 200
    warnings = [r.getMessage() for r in caplog.records if "ignored unknown request fields" in r.getMessage()]
    assert warnings == ["ignored unknown request fields: frobnicate"]




def test_field_policy_per_endpoint():
    from k3core.serve.protocol import APIError, parse_chat, parse_completion
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    completion = {"model": MODEL, "prompt": "hi"}
    for parse, base in ((parse_completion, completion), (parse_chat, chat)):
        assert parse({**base, "user": "u-1", "best_of": 1, "store": False, "zeta": 1, "alpha": 2}).ignored == (
            "alpha", "zeta")
        refused = [("best_of", 2), ("suffix", "x"), ("use_beam_search", True), ("guided_regex", "a+"),
                   ("functions", []), ("store", True)]
        # each endpoint honours one of these (completions: echo; chat: parallel_tool_calls) and refuses the other
        refused.append(("parallel_tool_calls", False) if parse is parse_completion else ("echo", True))
        for name, value in refused:
            with pytest.raises(APIError) as excinfo:
                parse({**base, name: value})
            assert (excinfo.value.status, excinfo.value.param) == (400, name)
    assert parse_chat({**chat, "messages_extra": 1, "prompt": "x"}).ignored == ("messages_extra", "prompt")
    assert parse_completion({**completion, "messages": []}).ignored == ("messages",)


def test_body_parser_refuses_what_it_cannot_serve():
    from k3core.serve.body import parse_json
    from k3core.serve.protocol import APIError
    assert parse_json(b'{"a": ["\\ud83d\\ude00", 1.5, -2]}') == {"a": ["\U0001F600", 1.5, -2]}   # a pair is fine
    for raw in RAW_BODIES + [b"Infinity", b"{", b'"\\udc00\\ud800"']:
        with pytest.raises(APIError) as excinfo:
            parse_json(raw)
        assert excinfo.value.status == 400 and excinfo.value.message
