"""A real server (uvicorn on a free loopback port, in a background thread) for the tests that drive it with real
clients: lm-eval, LangChain, the openai client."""
from __future__ import annotations

import contextlib
import socket
import threading
import time
from typing import Iterator

import httpx

from k3core.serve.args import ServerArgs
from k3core.serve.launch import Server, build_server

# Small enough that the warm-up (prompts up to twice the step budget) stays cheap on a 2-core CPU.
DEMO_ENGINE = dict(memory_bytes=64 << 20, chunked_prefill_tokens=64, page_size=16, max_running_requests=8,
                   cpu_threads=1)


@contextlib.contextmanager
def running_server(args: ServerArgs, ready_timeout_s: float = 120.0) -> Iterator[tuple[str, Server]]:
    """Start the server on `args` (its port is replaced by a free one), wait for /health, yield (base URL, server),
    and stop it afterwards."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    args.port = sock.getsockname()[1]
    server = build_server(args)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{args.port}"
    deadline = time.monotonic() + ready_timeout_s
    status = None
    while time.monotonic() < deadline and server.engine.error is None:
        try:
            status = httpx.get(base + "/health", timeout=2).status_code
            if status == 200:
                break
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    try:
        assert status == 200, f"the server did not become healthy (last status {status}, engine error " \
                              f"{server.engine.error})"
        yield base, server
    finally:
        server.shutdown()
        thread.join(20)
        sock.close()
    assert not thread.is_alive(), "the server thread did not stop"
