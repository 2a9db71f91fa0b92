"""`specjax.server` over HTTP on 127.0.0.1, driven by the official `openai` client: the default model in
float32, plain decoding (tests/test_server_spec.py: speculative, and the `specjax serve` command).

Outputs are compared with LLM.generate / LLM.chat on the same LLM, run before the server starts (greedy,
float32: batching and arrival order do not change them). Every loop and wait is bounded.
"""
from __future__ import annotations

import asyncio
import concurrent.futures as cf
import http.client
import json
import time

import jsonschema
import openai
import pytest

from specjax import LLM, SamplingParams
from specjax.async_llm import TTFT_BUCKETS, AsyncLLM, RequestError
from specjax.server import ServerConfig, build_app
from server_utils import ServerThread, wait_for, wait_idle

MAX_TOKENS = 6
NUM_CLIENTS = 32
NAME = "smollm2"
KEY = "test-key-123"
PATHOLOGICAL = {"type": "string", "pattern": "[a-z]{1,50000}[0-9]{1,50000}"}  # compiles for minutes
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150}},
          "required": ["name", "age"], "additionalProperties": False}


def conv(i: int) -> list[dict]:
    return [{"role": "user", "content": f"Tell me about the number {i}."}]


@pytest.fixture(scope="module")
def env():
    llm = LLM(dtype="float32", max_batch=4, max_seq_len=256)
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    refs = [o.text for o in llm.chat([conv(i) for i in range(NUM_CLIENTS)], greedy)]
    ref_ids = llm.tokenizer.encode(llm.apply_chat_template(conv(0)), add_special_tokens=False)
    ref_completion = llm.generate("Once upon a time", SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0,
                                                                     logprobs=2))[0]
    engine = AsyncLLM(llm, grammar_timeout=5.0)
    engine.start_grammar_worker()
    open_srv = ServerThread(build_app(engine, ServerConfig(model_name=NAME)))
    strict_srv = ServerThread(build_app(engine, ServerConfig(
        model_name=NAME, api_key=KEY, max_body_bytes=4096, max_prompt_tokens=64, max_tokens=250, max_n=2,
        max_concurrent=2)))
    yield dict(llm=llm, engine=engine, refs=refs, ref_ids=ref_ids, ref_completion=ref_completion,
               url=open_srv.url, port=open_srv.port, strict_url=strict_srv.url, strict_port=strict_srv.port)
    open_srv.stop()
    strict_srv.stop()
    engine.shutdown()


def client(url, key="unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=300)


def chat(c, i=0, **kw):
    return c.chat.completions.create(model=NAME, messages=conv(i), max_tokens=MAX_TOKENS, temperature=0, **kw)


def test_models_health_and_chat_completion(env):
    c = client(env["url"])
    assert [m.id for m in c.models.list().data] == [NAME]
    r = chat(c)
    assert r.choices[0].message.content == env["refs"][0]
    assert r.choices[0].finish_reason == "length" and r.model == NAME
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(env["ref_ids"]), MAX_TOKENS)
    conn = http.client.HTTPConnection("127.0.0.1", env["port"], timeout=30)
    conn.request("GET", "/health")
    assert conn.getresponse().status == 200


def test_streaming_deltas_concatenate_to_the_final_text(env):
    c = client(env["url"])
    chunks = list(chat(c, stream=True, stream_options={"include_usage": True}))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == env["refs"][0]
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == MAX_TOKENS


def test_completions_logprobs_n_and_stop(env):
    c = client(env["url"])
    ref = env["ref_completion"]
    r = c.completions.create(model=NAME, prompt="Once upon a time", max_tokens=MAX_TOKENS, temperature=0, n=2,
                             logprobs=2)
    assert [ch.text for ch in r.choices] == [ref.text, ref.text]
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == MAX_TOKENS
    assert lp.token_logprobs == pytest.approx([e[t] for t, e in zip(ref.token_ids, ref.logprobs)], abs=1e-4)
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):  # greedy: the chosen token is the top one
        assert len(top) <= 2 and max(top.values()) == pytest.approx(chosen, abs=1e-5)
    assert r.usage.completion_tokens == 2 * MAX_TOKENS
    stop = ref.text[len(ref.text) // 2:][:3]
    r = c.completions.create(model=NAME, prompt="Once upon a time", max_tokens=MAX_TOKENS, temperature=0, stop=[stop])
    assert r.choices[0].text == ref.text[: ref.text.index(stop)] and r.choices[0].finish_reason == "stop"


def test_json_schema_and_choice_outputs_are_valid(env):
    c = client(env["url"])
    r = c.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": "Describe a person as JSON."}], max_tokens=48,
        temperature=0, response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}})
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)
    r = c.chat.completions.create(model=NAME, messages=conv(1), max_tokens=8, temperature=0,
                                  extra_body={"guided_choice": ["odd", "even"]})
    assert r.choices[0].message.content in ("odd", "even")


def test_device_dfa_is_built_off_the_engine_thread(env, monkeypatch):
    """A schema's token DFA (0.1-1.4 s for a real schema and vocabulary) is built in a worker thread by
    AsyncLLM (Engine.prepare_dfa), not on the engine thread that runs every other request; the
    request still runs on the device DFA and its output follows the schema."""
    import threading
    from specjax.dfa_routing import DFARouter
    built, build = [], DFARouter._build

    def recording(self, *a, **kw):
        built.append(threading.current_thread().name)
        return build(self, *a, **kw)

    monkeypatch.setattr(DFARouter, "_build", recording)
    schema = dict(PERSON, properties=dict(PERSON["properties"], name={"type": "string", "maxLength": 7}))
    before = env["engine"].engine._dfa_counts()["dfa_requests"]
    r = client(env["url"]).chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": "Describe a person as JSON."}], max_tokens=48,
        temperature=0, response_format={"type": "json_schema", "json_schema": {"name": "p7", "schema": schema}})
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    assert len(built) == 1 and built[0] != "specjax-engine", built
    assert env["engine"].engine._dfa_counts()["dfa_requests"] == before + 1


def test_32_concurrent_streaming_clients_match_generate(env):
    def run(i):
        c = client(env["url"])
        text, n = "", 0
        for ch in chat(c, i, stream=True):
            n += 1
            assert n < 200, "unbounded stream"
            text += ch.choices[0].delta.content or ""
        return text

    with cf.ThreadPoolExecutor(NUM_CLIENTS) as pool:
        outs = list(pool.map(run, range(NUM_CLIENTS), timeout=600))
    assert outs == env["refs"]


def _open_stream(port, body: dict, key: str | None = None) -> http.client.HTTPConnection:
    """A raw streaming request whose first event has arrived (the request holds a slot)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {key}"} if key else {})
    conn.request("POST", "/v1/chat/completions", json.dumps(body), headers)
    resp = conn.getresponse()
    assert resp.status == 200
    events = 0
    while events < 2:  # the role event, then the first token's
        line = resp.readline()
        assert line, "the stream ended early"
        events += line.startswith(b"data: ")
    return conn


LONG = {"model": NAME, "messages": conv(2), "max_tokens": 200, "temperature": 0, "stream": True, "ignore_eos": True}


def test_client_disconnect_frees_its_slot_and_pages(env):
    engine = env["engine"]
    wait_idle(engine)
    cancelled, tokens = engine.stats.finished["cancelled"], engine.stats.generation_tokens
    conn = _open_stream(env["port"], LONG)
    wait_for(lambda: engine.stats.running == 1 and engine.stats.kv_pages_used > 0, what="the request to run")
    conn.close()
    wait_idle(engine)
    assert engine.stats.finished["cancelled"] == cancelled + 1
    assert engine.stats.generation_tokens - tokens < LONG["max_tokens"]  # it stopped early
    alloc = engine.engine.alloc
    assert sum(map(len, alloc.owned)) == 0 and alloc.num_free == engine.stats.kv_pages_total


BAD = [
    ({"model": "/etc/passwd"}, "unknown model"),
    ({"temperature": -1}, "temperature"),
    ({"top_p": 2}, "top_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"n": 0}, "n=0"),
    ({"top_logprobs": 3}, "logprobs"),
    ({"unknown_field": 1}, "unknown_field"),
    ({"tools": [{"type": "function"}]}, "tools"),
    ({"messages": [{"role": "user", "content": "word " * 300}]}, "tokens"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "json_schema"),
    ({"regex": "(unclosed"}, "regex"),
    ({"regex": "a", "choice": ["b"]}, "at most one"),
]


def test_bad_requests_get_400_while_others_complete(env):
    c = client(env["url"])
    with cf.ThreadPoolExecutor(1) as pool:
        good = pool.submit(lambda: "".join(ch.choices[0].delta.content or "" for ch in chat(client(env["url"]), 3,
                                                                                           stream=True)))
        for fields, reason in BAD:
            body = {"model": NAME, "messages": conv(0), "max_tokens": MAX_TOKENS} | fields
            with pytest.raises(openai.BadRequestError, match=reason) as e:
                c.post("/chat/completions", body=body, cast_to=object)
            assert e.value.status_code == 400
        assert good.result(timeout=300) == env["refs"][3]


def test_pathological_schema_fails_alone(env):
    c = client(env["url"])
    with cf.ThreadPoolExecutor(1) as pool:
        t0 = time.monotonic()
        bad = pool.submit(lambda: c.chat.completions.create(
            model=NAME, messages=conv(0), max_tokens=8,
            response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": PATHOLOGICAL}}))
        r = c.chat.completions.create(model=NAME, messages=conv(1), max_tokens=8, temperature=0,
                                      extra_body={"guided_choice": ["odd", "even"]})  # compiled before: cached
        assert r.choices[0].message.content in ("odd", "even")
        assert chat(c, 4).choices[0].message.content == env["refs"][4]
        with pytest.raises(openai.BadRequestError, match="longer than 5 s"):
            bad.result(timeout=300)
        assert time.monotonic() - t0 < 120
    r = c.chat.completions.create(model=NAME, messages=conv(5), max_tokens=8, temperature=0,
                                  extra_body={"choice": ["yes", "no"]})  # a new constraint: the worker restarted
    assert r.choices[0].message.content in ("yes", "no")


def test_api_key_and_limits(env):
    url, port = env["strict_url"], env["strict_port"]
    with pytest.raises(openai.AuthenticationError):
        client(url).models.list()
    with pytest.raises(openai.AuthenticationError):
        chat(client(url))
    c = client(url, KEY)
    assert chat(c).choices[0].message.content == env["refs"][0]
    for path, status in (("/health", 200), ("/metrics", 401)):
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        conn.request("GET", path)
        assert conn.getresponse().status == status
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    big = json.dumps({"model": NAME, "messages": [{"role": "user", "content": "x" * 5000}]})
    conn.request("POST", "/v1/chat/completions", big, {"Authorization": f"Bearer {KEY}",
                                                       "Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 413 and b"4096 bytes" in resp.read()
    for kw, reason in (({"max_tokens": 251}, "limit of 250"), ({"n": 3}, r"\[1, 2\]"),
                       ({"messages": [{"role": "user", "content": "word " * 60}]}, "limit of 64")):
        body = {"model": NAME, "messages": conv(0), "max_tokens": MAX_TOKENS} | kw
        with pytest.raises(openai.BadRequestError, match=reason):
            c.post("/chat/completions", body=body, cast_to=object)
    streams = [_open_stream(port, LONG, KEY) for _ in range(2)]
    with pytest.raises(openai.RateLimitError, match="limit is 2"):
        chat(c)
    for s in streams:
        s.close()
    wait_idle(env["engine"])
    assert chat(c).choices[0].message.content == env["refs"][0]  # tickets returned


def test_async_generate_streams_and_cancels_on_early_exit(env):
    engine, llm = env["engine"], env["llm"]
    prompt = llm.apply_chat_template(conv(6))

    async def full():
        return "".join([d.text async for d in engine.generate(prompt, SamplingParams(max_tokens=MAX_TOKENS,
                                                                                    temperature=0.0))])

    async def first_then_leave():
        async for d in engine.generate(prompt, {"max_tokens": 200, "ignore_eos": True, "temperature": 0.0}):
            if d.token_ids:
                return d.finish_reason

    assert asyncio.run(full()) == env["refs"][6]
    wait_idle(engine)
    cancelled = engine.stats.finished["cancelled"]
    assert asyncio.run(first_then_leave()) is None
    wait_idle(engine)  # leaving the loop cancelled the request: slot and pages are free
    assert engine.stats.finished["cancelled"] == cancelled + 1
    with pytest.raises(RequestError, match="top_p"):
        asyncio.run(engine.add_request(prompt, {"top_p": 0}))


def test_metrics_and_nothing_leaked(env):
    engine = env["engine"]
    wait_idle(engine)
    conn = http.client.HTTPConnection("127.0.0.1", env["port"], timeout=30)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    values = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines() if not line.startswith("#")}
    assert values["specjax_requests_running"] == values["specjax_kv_pages_used"] == 0
    assert values["specjax_requests_in_flight"] == 0 and values["specjax_speculative"] == 0
    assert values["specjax_generation_tokens_total"] == engine.stats.generation_tokens > NUM_CLIENTS * MAX_TOKENS
    assert values['specjax_requests_finished_total{finish_reason="cancelled"}'] >= 3
    assert values['specjax_http_responses_total{route="/v1/chat/completions",code="400"}'] >= len(BAD)
    eng = engine.engine
    st = eng.stats()  # the engine's own figures (idle: as of its last step); the 32 chats share the system prompt
    assert values["specjax_prefix_cache_enabled"] == 1 and st["prefix_cache_hits"] > 0
    for key in ("queries", "hits", "queried_tokens", "hit_tokens", "evictions"):
        assert values[f"specjax_prefix_cache_{key}_total"] == st[f"prefix_cache_{key}"], key
    assert values["specjax_prefix_cache_hit_rate"] == pytest.approx(st["prefix_cache_hit_rate"], abs=1e-4)
    assert values["specjax_kv_pages_cached"] == st["pages_cached"] > 0
    assert values["specjax_prefill_tokens_total"] == st["prefill_tokens"]
    # time to first token: every request that got a token was counted once, its phases sum to the total
    n = values["specjax_time_to_first_token_seconds_count"]
    assert n == engine.stats.ttft_count >= NUM_CLIENTS and values['specjax_time_to_first_token_seconds_bucket{le="+Inf"}'] == n
    phases = [values[f'specjax_time_to_first_token_phase_seconds_total{{phase="{p}"}}'] for p in ("prepare", "pickup", "engine")]
    assert all(v >= 0 for v in phases) and phases[2] > 0
    assert values["specjax_time_to_first_token_seconds_sum"] == pytest.approx(sum(phases), abs=1e-5)
    buckets = [values[f'specjax_time_to_first_token_seconds_bucket{{le="{le}"}}'] for le in TTFT_BUCKETS]
    assert buckets == sorted(buckets) and buckets[-1] <= n  # cumulative
    assert not eng.has_unfinished() and all(s is None for s in eng.slots)
    assert sum(map(len, eng.alloc.owned)) == 0 and eng.alloc.num_free == values["specjax_kv_pages_total"]
