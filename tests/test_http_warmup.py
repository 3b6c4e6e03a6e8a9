"""The server warms its own HTTP path before /health turns 200, without a trace in the request metrics or the
prefix cache; the engine's step mix is exported; the engine process sends one message per loop iteration."""
from __future__ import annotations

import socket
import threading
import time

import httpx
import msgspec
import pytest

from k3core import LLM, SamplingParams
from k3core.serve.args import ServerArgs
from k3core.serve.engine_process import Batch, Event, Flushed, FromEngine, Observe, Publish
from k3core.serve.http_warmup import WARMUP_HEADER, HttpWarmup, connect_url
from k3core.serve.launch import build_server
from k3core.serve.metrics import EngineSnapshot, metric_sum, parse_metrics
from k3core.step_counts import StepCounts

MODEL = "k3-tiny"
ENGINE = dict(page_size=16, checkpoint_interval=32, chunked_prefill_tokens=64, max_running_requests=8)


def _start(**extra):
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    args = ServerArgs(model=MODEL, port=sock.getsockname()[1], seed=0, log_level="warning", cpu_threads=1,
                      memory_bytes=32 << 20, **ENGINE, **extra)
    server = build_server(args)
    health: list[int] = []

    def poll():                      # /health as a readiness probe sees it, from the moment the port is open
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                health.append(httpx.get(f"http://127.0.0.1:{args.port}/health", timeout=2).status_code)
                if health[-1] == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.02)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    poll()
    return server, thread, sock, f"http://127.0.0.1:{args.port}", health


@pytest.fixture(scope="module")
def warmed():
    server, thread, sock, base, health = _start(api_key="k", engine_in_process=True)
    yield server, base, health
    server.shutdown()
    thread.join(20)
    sock.close()


def test_health_turns_200_only_after_the_warmup_requests(warmed):
    server, base, health = warmed
    assert health and health[-1] == 200
    assert server.warmup is not None and server.warmup.done.is_set()
    # the warm-up ran through the real routes: the engine stepped for it, yet nothing of it shows
    values = parse_metrics(httpx.get(base + "/metrics").text)
    for name in ("k3core_request_success_total", "k3core_prompt_tokens_total", "k3core_generation_tokens_total",
                 "k3core_time_to_first_token_seconds_count", "vllm:request_success_total",
                 "k3core_prefix_cache_queried_tokens_total", "k3core_engine_decode_rows_total",
                 "k3core_engine_prefill_tokens_total"):
        assert metric_sum(values, name) == 0, name
    assert metric_sum(values, "k3core_engine_steps_total") > 0          # the warm-ups' steps did run
    assert metric_sum(values, "k3core_pool_slots") == 0, "the warm-up left checkpoints in the prefix cache"


def test_a_forged_warmup_header_is_counted_like_any_request(warmed):
    server, base, _ = warmed
    before = parse_metrics(httpx.get(base + "/metrics").text)
    body = {"model": MODEL, "prompt": [5, 6, 7, 8], "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    reply = httpx.post(base + "/v1/completions", json=body, timeout=60,
                       headers={"Authorization": "Bearer k", WARMUP_HEADER: "not-the-secret"})
    assert reply.status_code == 200
    after = parse_metrics(httpx.get(base + "/metrics").text)

    def grew(name, **labels):
        return metric_sum(after, name, **labels) - metric_sum(before, name, **labels)
    assert grew("k3core_request_success_total") == 1 and grew("k3core_generation_tokens_total") == 3
    # the step mix of that request: its prompt in prefill steps, its 2 tokens after the first in decode rows
    assert grew("k3core_engine_prefill_tokens_total") == 4 and grew("k3core_engine_decode_rows_total") == 2
    assert grew("k3core_engine_steps_by_kind_total", kind="prefill") >= 1
    assert grew("k3core_engine_steps_by_kind_total", kind="decode") == 2


def test_without_http_warmup_health_needs_only_the_engine():
    server, thread, sock, base, health = _start(no_http_warmup=True)
    try:
        assert health[-1] == 200 and server.warmup is None
    finally:
        server.shutdown()
        thread.join(20)
        sock.close()


def test_health_is_503_while_the_http_path_warms_up():
    from fastapi.testclient import TestClient

    from k3core.serve.app import create_app
    from k3core.serve.engine_thread import EngineThread
    from k3core.serve.metrics import ServerMetrics
    args = ServerArgs(model=MODEL, seed=0, memory_bytes=32 << 20, cpu_threads=1, **ENGINE)
    metrics = ServerMetrics(args.model_name)
    from k3core.serve.launch import _build_llm
    import functools
    engine = EngineThread(functools.partial(_build_llm, args), metrics)
    engine.start()
    assert engine.ready.wait(120) and engine.error is None
    warmup = HttpWarmup()
    try:
        with TestClient(create_app(args, engine, metrics, warmup)) as http:
            reply = http.get("/health")
            assert reply.status_code == 503 and "warming up its HTTP path" in reply.json()["error"]["message"]
            # the routes themselves serve (the warm-up requests go through them)
            body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
            assert http.post("/v1/completions", json=body, headers={WARMUP_HEADER: warmup.token}).status_code == 200
            warmup.done.set()
            assert http.get("/health").status_code == 200
    finally:
        engine.stop()


def test_connect_url_reaches_wildcard_binds():
    assert connect_url("0.0.0.0", 8000) == "http://127.0.0.1:8000"
    assert connect_url("::", 8000) == "http://[::1]:8000"
    assert connect_url("10.1.2.3", 80) == "http://10.1.2.3:80"


def test_step_counts_classify_prefill_mixed_and_decode_steps():
    llm = LLM(MODEL, seed=0, memory_bytes=32 << 20, prefix_cache=False, **{k: v for k, v in ENGINE.items()
                                                                         if k != "checkpoint_interval"})
    engine = llm.engine
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    a = engine.add_request(list(range(3, 103)), params)          # 100 tokens: two chunks of the 64-token budget
    engine.step()
    engine.step()                                                # its prompt is in; its first token sampled
    b = engine.add_request(list(range(3, 13)), params)           # prefill beside a's decode: a mixed step
    engine.run_until_done([a, b])
    counts = engine.step_counts
    assert counts.prefill_tokens == 110
    assert counts.decode_rows == 2 * 4                            # each request's tokens after its first
    assert counts.prefill == 2 and counts.mixed == 1 and counts.decode > 0
    assert counts.as_dict()["mean_decode_rows"] == pytest.approx(8 / (counts.mixed + counts.decode))
    later = counts.copy()
    assert later.since(counts) == StepCounts()


def test_a_batch_message_carries_events_metrics_and_flushes_in_order():
    """The engine process's per-iteration Batch round-trips through msgpack with every message kind in order."""
    messages = [Event("r1", [5], [], False, None, 0, None, "x"), Observe("observe_tokens", [1, 0.01]),
                Publish(EngineSnapshot(num_running=1, num_decode_rows=3, idle_seconds=0.5)), Flushed(7, True)]
    data = msgspec.msgpack.encode(Batch(messages))
    back = msgspec.msgpack.Decoder(FromEngine).decode(data)
    assert isinstance(back, Batch) and back.messages == messages


def test_the_warmup_rehearses_mixed_steps_and_a_cached_prefix():
    """The engine's warm-up ends with a serving mix (k3core.serve.engine_thread.EngineThread._rehearse): prompts
    admitted beside decodes, several to a chunk, and a prompt whose prefix the cache holds. The kernel
    specialisations a first workload met on the H200 came from that packing; check the warm-up produces it."""
    import functools

    from k3core.serve.engine_thread import EngineThread
    from k3core.serve.launch import _build_llm
    from k3core.serve.metrics import ServerMetrics
    args = ServerArgs(model=MODEL, seed=0, memory_bytes=32 << 20, cpu_threads=1, **ENGINE)
    engine = EngineThread(functools.partial(_build_llm, args), ServerMetrics(args.model_name))
    engine.start()
    try:
        assert engine.ready.wait(120) and engine.error is None
        counts = engine.engine.step_counts                 # cumulative: the warm-up's own steps
        assert counts.mixed >= 2, counts
        assert engine.engine.cache.stats.hit_tokens > 0, "the rehearsal's repeated prompt found no cached prefix"
        assert engine.metrics.snapshot.num_mixed_steps == 0      # what /metrics counts starts after the warm-up
    finally:
        engine.stop()


def test_engine_flags_reach_the_engine_options_and_threads_default_by_device():
    import os

    from k3core.serve.args import GPU_ENGINE_CPU_THREADS, parse_args
    options = parse_args(["--disable-mixed-step-split", "--no-http-warmup"]).engine_options()
    assert options["split_mixed_steps"] is False and parse_args([]).engine_options()["split_mixed_steps"] is True
    # beside a GPU the engine's torch intra-op pool is one thread (more only spin); on the CPU all cores but one
    assert ServerArgs(model=MODEL, device="cuda").resolved_cpu_threads() == GPU_ENGINE_CPU_THREADS == 1
    assert ServerArgs(model=MODEL, device="cpu").resolved_cpu_threads() == max(1, (os.cpu_count() or 2) - 1)
    assert ServerArgs(model=MODEL, device="cuda", cpu_threads=3).resolved_cpu_threads() == 3
