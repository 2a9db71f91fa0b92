"""Security and limits of `specjax serve` not covered by tests/test_server.py, on the tiny random model
(the checks do not depend on the model): the default bind address and the warning for an exposed
server without a key, the API key on every route but /health (missing and wrong), a body over the
limit sent without Content-Length (chunked) and one declaring a huge Content-Length (refused before
the body arrives), a model name that looks like a path, and a pathological regex that fails alone."""
from __future__ import annotations

import concurrent.futures as cf
import http.client
import json
import random
import time

import pytest
from server_utils import ServerThread
from tiny_dir import make_tiny_model_dir

from specjax import LLM, cli
from specjax.async_llm import AsyncLLM
from specjax.server import ServerConfig, build_app

KEY = "k-123"
NAME = "tiny"
BODY_LIMIT = 2048


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny") / "model", num_layers=2)


@pytest.fixture(scope="module")
def engine(model_dir):
    engine = AsyncLLM(LLM(model_dir, dtype="float32", max_batch=2, max_seq_len=32), grammar_timeout=2.0)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def srv(engine):
    """API key and a small body limit."""
    server = ServerThread(build_app(engine, ServerConfig(model_name=NAME, api_key=KEY, max_body_bytes=BODY_LIMIT)))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def open_srv(engine):
    """The defaults: no key, a body limit of 1 MiB."""
    server = ServerThread(build_app(engine, ServerConfig(model_name=NAME)))
    yield server
    server.stop()


def _request(port, method, path, body=None, headers=None, timeout=60):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request(method, path, body, headers or {})
        resp = conn.getresponse()
        return resp.status, resp.read().decode()
    finally:
        conn.close()


def _auth(key=KEY) -> dict:
    return {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}


class _Stop(Exception):
    pass


def test_default_bind_is_loopback_and_an_exposed_server_without_key_warns(model_dir, monkeypatch, capsys):
    args = cli.build_parser().parse_args(["serve"])
    assert args.host == "127.0.0.1"

    def stop(*_, **__):  # the warning comes before the model loads: stop there
        raise _Stop
    monkeypatch.setattr(cli, "llm_from_args", stop)
    monkeypatch.delenv("SPECJAX_API_KEY", raising=False)
    base = ["serve", "--model", str(model_dir), "--no-speculate", "--port", "0"]
    for extra, warns in ((["--host", "0.0.0.0"], True), (["--host", "0.0.0.0", "--api-key", "x"], False),
                         ([], False), (["--host", "::1"], False), (["--host", "localhost"], False)):
        with pytest.raises(_Stop):
            cli.main(base + extra)
        err = capsys.readouterr().err
        assert ("without --api-key: anyone who can reach it may use it" in err) == warns, (extra, err)


ROUTES = [("GET", "/v1/models", None), ("GET", f"/v1/models/{NAME}", None), ("GET", "/metrics", None),
          ("POST", "/v1/completions", {"model": NAME, "prompt": "w5 w6", "max_tokens": 2, "temperature": 0}),
          ("POST", "/v1/chat/completions", {"model": NAME, "messages": [{"role": "user", "content": "w5"}],
                                            "max_tokens": 2, "temperature": 0}),
          ("GET", "/no/such/route", None)]


def test_api_key_on_every_route_but_health(srv):
    for method, path, body in ROUTES:
        data = None if body is None else json.dumps(body)
        for headers in ({"Content-Type": "application/json"}, _auth("wrong"), _auth(KEY + "x"), _auth(KEY[:-1]),
                        {"Authorization": KEY}):
            status, text = _request(srv.port, method, path, data, headers)
            assert status == 401 and "API key" in text, (method, path, headers, status)
        status, _ = _request(srv.port, method, path, data, _auth())
        assert status == (404 if path == "/no/such/route" else 200), (method, path, status)
    assert _request(srv.port, "GET", "/health")[0] == 200


def test_body_over_the_limit_without_content_length_gets_413(srv):
    chunk = json.dumps({"model": NAME, "prompt": "w5 " * 1000}).encode()  # 3 KB in pieces of 1 KB
    assert len(chunk) > BODY_LIMIT

    def pieces():
        for i in range(0, len(chunk), 1000):
            yield chunk[i:i + 1000]
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=60)
    conn.request("POST", "/v1/completions", pieces(), _auth(), encode_chunked=True)
    resp = conn.getresponse()
    assert resp.status == 413 and f"{BODY_LIMIT} bytes".encode() in resp.read()
    conn.close()
    ok = json.dumps({"model": NAME, "prompt": "w5 w6", "max_tokens": 2})
    assert len(ok) < BODY_LIMIT and _request(srv.port, "POST", "/v1/completions", ok, _auth())[0] == 200


def test_declared_huge_body_is_refused_before_it_arrives(srv):
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=15)
    conn.putrequest("POST", "/v1/completions")
    for k, v in _auth().items():
        conn.putheader(k, v)
    conn.putheader("Content-Length", str(10 ** 9))
    conn.endheaders()  # and no body: the server must answer from the header alone
    resp = conn.getresponse()
    assert resp.status == 413 and f"{BODY_LIMIT} bytes".encode() in resp.read()
    conn.close()


def test_model_names_are_never_paths(srv):
    for path in ("/v1/models/etc/passwd", "/v1/models/..%2F..%2Fetc%2Fpasswd", "/v1/models/%2Fetc%2Fpasswd"):
        status, text = _request(srv.port, "GET", path, None, _auth())
        assert status == 404 and "unknown model" in text, (path, status, text)
    body = json.dumps({"model": "/etc/passwd", "prompt": "w5", "max_tokens": 2})
    status, text = _request(srv.port, "POST", "/v1/completions", body, _auth())
    assert status == 400 and "unknown model '/etc/passwd'" in text


def pathological_regex() -> str:
    """An alternation of 100 000 words (900 KB, under the 1 MiB body limit): compiling it takes far
    longer than 2 s whatever the vocabulary (the time grows faster than its length)."""
    rng = random.Random(0)
    return "(" + "|".join("".join(rng.choice("abcdefghij") for _ in range(8)) for _ in range(100_000)) + ")"


def test_pathological_regex_fails_alone(open_srv):
    port = open_srv.port
    bad = json.dumps({"model": NAME, "prompt": "w5", "max_tokens": 4, "regex": pathological_regex()})
    good = json.dumps({"model": NAME, "prompt": "w5 w6", "max_tokens": 3, "temperature": 0})
    headers = {"Content-Type": "application/json"}
    with cf.ThreadPoolExecutor(1) as pool:
        t0 = time.monotonic()
        fut = pool.submit(_request, port, "POST", "/v1/completions", bad, headers, 120)
        status, text = _request(port, "POST", "/v1/completions", good, headers)
        assert status == 200 and json.loads(text)["usage"]["completion_tokens"] == 3
        status, text = fut.result(timeout=120)
    assert status == 400 and "longer than 2 s" in text, text[:300]
    assert time.monotonic() - t0 < 60  # (the worker's restart after a timeout: tests/test_server.py)
