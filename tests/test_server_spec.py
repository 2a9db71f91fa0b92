"""`specjax serve` as a user starts it (a subprocess on 127.0.0.1, speculation on by default with the
shipped EAGLE-3 head), driven by the `openai` client: greedy float32 outputs equal plain LLM.chat's
(lossless speculation through the whole HTTP stack), a disconnect frees its pages (seen in /metrics),
tau is reported, SIGTERM shuts it down gracefully. Every wait is bounded. (Constrained speculative
decoding is covered by the engine tests; the server's constraint handling by tests/test_server.py.)"""
from __future__ import annotations

import concurrent.futures as cf
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import openai
import pytest

from specjax import LLM, SamplingParams
from server_utils import http_get as _get, wait_for

REPO = Path(__file__).resolve().parent.parent
MAX_TOKENS = 8
CONVS = [[{"role": "user", "content": f"Name a fact about the number {i}."}] for i in range(4)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _metrics(port) -> dict[str, float]:
    status, text = _get(port, "/metrics")
    assert status == 200
    return {ln.split(" ")[0]: float(ln.split(" ")[1]) for ln in text.splitlines() if not ln.startswith("#")}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    port = _free_port()
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, "-m", "specjax.cli", "serve", "--dtype", "float32", "--max-batch", "4",
                                 "--max-seq-len", "256", "--port", str(port), "--log-level", "warning"],
                                stdout=f, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    llm = LLM(dtype="float32", max_batch=4, max_seq_len=256)  # the plain reference, while the server loads
    refs = [o.text for o in llm.chat(CONVS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))]
    del llm

    def up():
        assert proc.poll() is None, f"specjax serve exited:\n{log.read_text()[-3000:]}"
        try:
            return _get(port, "/health")[0] == 200
        except OSError:
            return False
    wait_for(up, 600, "specjax serve to answer /health")
    yield dict(port=port, refs=refs, proc=proc, log=log)
    if proc.poll() is None:
        proc.kill()
        proc.wait(30)


def client(port) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=300)


def test_speculative_streams_equal_plain_generate(server):
    assert "speculative, shipped EAGLE-3 head" in server["log"].read_text()
    model = client(server["port"]).models.list().data[0].id

    def run(i):
        text, n = "", 0
        for ch in client(server["port"]).chat.completions.create(model=model, messages=CONVS[i], stream=True,
                                                                  max_tokens=MAX_TOKENS, temperature=0):
            n += 1
            assert n < 100, "unbounded stream"
            text += ch.choices[0].delta.content or ""
        return text

    with cf.ThreadPoolExecutor(len(CONVS)) as pool:
        assert list(pool.map(run, range(len(CONVS)), timeout=600)) == server["refs"]
    m = _metrics(server["port"])
    assert m["specjax_speculative"] == 1 and m["specjax_spec_steps_total"] > 0
    from specjax.assets import DEFAULT_HEAD_DIR
    from specjax.checkpoint import head_spec_defaults
    num_steps = head_spec_defaults(DEFAULT_HEAD_DIR, 4)[0]["num_steps"]  # the server's tree (--max-batch 4)
    assert 1 <= m["specjax_spec_tau"] <= num_steps + 1  # tokens per step


def test_speculative_disconnect_frees_its_pages(server):
    port = server["port"]
    model = client(port).models.list().data[0].id
    cancelled = _metrics(port).get('specjax_requests_finished_total{finish_reason="cancelled"}', 0)
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    conn.request("POST", "/v1/chat/completions", json.dumps({
        "model": model, "messages": CONVS[0], "max_tokens": 200, "stream": True, "ignore_eos": True}),
        {"Content-Type": "application/json"})
    resp = conn.getresponse()
    for _ in range(6):  # role event, first tokens
        assert resp.readline()
    wait_for(lambda: _metrics(port)["specjax_kv_pages_used"] > 0, 60, "the request to hold pages")
    conn.close()
    wait_for(lambda: (m := _metrics(port))["specjax_requests_running"] == m["specjax_kv_pages_used"] == 0
             and m.get('specjax_requests_finished_total{finish_reason="cancelled"}', 0) == cancelled + 1,
             120, "the disconnected request to free its slot and pages")


def test_sigterm_shuts_down(server):
    proc = server["proc"]
    proc.send_signal(signal.SIGTERM)
    # uvicorn shuts down gracefully, then re-raises the signal: the exit status says SIGTERM
    assert proc.wait(60) in (0, -signal.SIGTERM)
    log = server["log"].read_text()
    assert "specjax serve: engine stopped" in log and "Traceback" not in log, log[-3000:]
