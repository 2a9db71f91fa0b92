"""A real `specjax.server` app served by uvicorn on 127.0.0.1 (a free port) in a background thread."""
from __future__ import annotations

import http.client
import socket
import threading
import time

import uvicorn


class ServerThread:
    def __init__(self, app, start_timeout: float = 60.0):
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + start_timeout
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(15)


def wait_for(pred, timeout: float = 120.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.05)


def wait_idle(llm, timeout: float = 120.0) -> None:
    """Until the AsyncLLM's engine holds no request, slot or page (stats written by its thread)."""
    s = llm.stats
    wait_for(lambda: s.running == s.waiting == s.kv_pages_used == 0 and llm._inbox.empty()
             and not llm.engine.has_unfinished(), timeout, "the engine to be idle")


def http_get(port: int, path: str) -> tuple[int, str]:
    """(status, body) of GET path on 127.0.0.1:port."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, resp.read().decode()
    finally:
        conn.close()
