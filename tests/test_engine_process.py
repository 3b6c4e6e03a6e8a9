"""The engine in its own process: the server's answers equal the offline engine's, and an engine process that dies
turns /health to 503 and ends the requests in flight with an error instead of hanging them."""
from __future__ import annotations

import os
import signal
import socket
import threading
import time

import httpx
import pytest
from k3core import LLM, SamplingParams
from k3core.serve.args import ServerArgs
from k3core.serve.engine_process import EngineProcess
from k3core.serve.launch import build_server

# engine processes killed and timed (< 10 s to the error): run alone, after the xdist workers (scripts/test.sh)
pytestmark = pytest.mark.serial

MODEL = "k3-tiny"
ENGINE = dict(page_size=16, checkpoint_interval=32, chunked_prefill_tokens=64, max_running_requests=8)


def _serve(**extra):
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    args = ServerArgs(model=MODEL, port=port, seed=0, log_level="warning", cpu_threads=1,
                      **{"memory_bytes": 32 << 20, **ENGINE, **extra})
    srv = build_server(args)
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and srv.engine.error is None:
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                break
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    return srv, thread, sock, base


def test_engine_process_serves_like_the_offline_engine_and_its_death_is_reported():
    srv, thread, sock, base = _serve()
    try:
        assert isinstance(srv.engine, EngineProcess) and srv.engine.pid != os.getpid()
        assert httpx.get(base + "/health").status_code == 200
        prompt = [5, 17, 99, 3, 250, 41, 8]
        body = dict(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, ignore_eos=True)
        served = httpx.post(base + "/v1/completions", json=body, timeout=60).json()
        offline = LLM(MODEL, seed=0, prefix_cache=False, **{k: v for k, v in ENGINE.items()
                                                           if k != "checkpoint_interval"})
        want = offline.generate([prompt], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]
        assert served["choices"][0]["text"] == want.text
        assert served["usage"]["completion_tokens"] == 12
        assert httpx.post(base + "/flush_cache", timeout=30).status_code == 200
        assert "k3core_engine_ready" in httpx.get(base + "/metrics").text

        # A long stream in flight when the engine process is killed: it ends with an error, promptly.
        long = dict(body, max_tokens=4000, stream=True)
        lines, started = [], threading.Event()

        def consume():
            with httpx.stream("POST", base + "/v1/completions", json=long, timeout=60) as response:
                for line in response.iter_lines():
                    if line:
                        lines.append(line)
                        started.set()

        reader = threading.Thread(target=consume, daemon=True)
        reader.start()
        assert started.wait(60), "the stream never started"
        os.kill(srv.engine.pid, signal.SIGKILL)
        killed = time.monotonic()
        reader.join(30)
        assert not reader.is_alive(), "a request in flight hung after the engine process died"
        assert time.monotonic() - killed < 10
        assert any("engine process exited" in line for line in lines), lines[-3:]
        health = httpx.get(base + "/health")
        assert health.status_code == 503 and "engine process exited" in health.text
        after = httpx.post(base + "/v1/completions", json=body, timeout=10)
        assert after.status_code >= 500 and "engine process exited" in after.text
    finally:
        srv.shutdown()
        thread.join(15)
        sock.close()
    assert not thread.is_alive()


def test_a_bad_model_reports_the_engine_start_error():
    srv, thread, sock, base = _serve(memory_bytes=1)        # no pool fits: the engine cannot start
    try:
        srv.engine.ready.wait(120)
        assert srv.engine.error is not None and "memory" in srv.engine.error.lower()
    finally:
        srv.shutdown()
        thread.join(15)
        sock.close()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_a_stopped_server_leaves_no_socket_directory(tmp_path, sig):
    """`python -m k3core.serve` stopped as a supervisor stops it (SIGTERM: uvicorn shuts down and re-raises the
    signal, so the server's own clean-up never runs) or kills it: the engine's socket directory is removed all the
    same, and the engine process leaves without a traceback, instead of both piling up with every restart."""
    import subprocess
    import sys

    from k3core.parallel.launch import free_port
    port = free_port()
    log = tmp_path / "server.log"
    command = [sys.executable, "-m", "k3core.serve", "--model", MODEL, "--port", str(port), "--cpu-threads", "1",
               "--memory-bytes", str(32 << 20), "--chunked-prefill-tokens", "64", "--log-level", "warning"]
    with open(log, "w") as out:
        server = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                  env=dict(os.environ, TMPDIR=str(tmp_path)))
    try:
        deadline = time.monotonic() + 150
        while True:
            assert server.poll() is None and time.monotonic() < deadline, log.read_text()
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        made = list(tmp_path.glob("k3core-engine-*"))
        assert len(made) == 1, made
        engine = [int(p) for p in os.listdir("/proc") if p.isdigit() and _parent(int(p)) == server.pid]
        assert engine, "the server has no child process"
        os.kill(server.pid, sig)
        server.wait(timeout=30)
        deadline = time.monotonic() + 5
        while made[0].exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not made[0].exists(), f"{made[0]} outlived the server ({sig.name}):\n{log.read_text()}"
        deadline = time.monotonic() + 30                           # the orphan's grace before it leaves anyway
        while any(_alive(pid) for pid in engine) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(_alive(pid) for pid in engine), "the engine process outlived the server"
        assert "Traceback" not in log.read_text(), log.read_text()          # its threads leave quietly too
    finally:
        try:
            os.killpg(server.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        server.wait(timeout=30)


def _parent(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return int(stat.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
