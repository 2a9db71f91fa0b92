"""/metrics figures of KV pages and the prefix cache are the engine's own (Engine.stats()): a page
shared by two running requests counts once, cached pages and hit counters are exported as the
engine counts them, and no prefix-cache figure is exported with the cache off. Tiny random model,
the engine stepped by hand (no thread, no HTTP: tests/test_server.py covers the route)."""
from __future__ import annotations

import types
from collections import Counter

import jax.numpy as jnp
import pytest
from helpers import IdTokenizer, tiny_config, tiny_model

from specjax.async_llm import EngineStats
from specjax.engine import BatchOptions, CacheOptions, Engine
from specjax.request import Request
from specjax.sampling_params import SamplingParams
from specjax.server_metrics import render_metrics

MAX_SEQ, PAGE = 64, 4
SYSTEM = list(range(10, 30))  # 20 tokens: 5 pages of 4
LONG = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def world():
    cfg = tiny_config()
    return cfg, tiny_model(cfg, seed=0)


def _engine(world, prefix_cache=True):
    cfg, model = world
    return Engine(model, cfg, CacheOptions(page_size=PAGE, max_seq_len=MAX_SEQ, prefix_cache=prefix_cache),
                  BatchOptions(max_batch=2), jnp.float32)


def _metrics(eng) -> dict[str, float]:
    stats = EngineStats()
    stats.observe(eng, waiting_outside=0)
    llm = types.SimpleNamespace(stats=stats, error=None, speculative=False)
    state = types.SimpleNamespace(responses=Counter(), in_flight=0, prompt_tokens=0)
    text = render_metrics(llm, state)
    return {ln.split(" ")[0]: float(ln.split(" ")[1]) for ln in text.splitlines() if not ln.startswith("#")}


def _req(i, ids):
    return Request(i, None, ids, LONG, IdTokenizer(), (96,), MAX_SEQ, 0)


def test_shared_pages_count_once_and_prefix_counters_are_the_engines(world):
    eng = _engine(world)
    a = _req(0, SYSTEM + [1, 2, 3])
    eng.add_request(a)
    while not a.token_ids:
        eng.step()
    b = _req(1, SYSTEM + [4, 5])  # admitted after a's pages are registered: shares its 5 system pages
    eng.add_request(b)
    while not b.token_ids:
        eng.step()
    assert not a.finished and not b.finished
    owned = eng.alloc.owned
    shared = set(owned[a.slot]) & set(owned[b.slot])
    assert len(shared) == len(SYSTEM) // PAGE
    m, st = _metrics(eng), eng.stats()
    distinct = len(set(owned[a.slot]) | set(owned[b.slot]))
    assert m["specjax_kv_pages_used"] == st["pages_in_use"] == distinct < len(owned[a.slot]) + len(owned[b.slot])
    assert m["specjax_kv_pages_total"] == st["pages_total"]
    assert m["specjax_requests_running"] == 2
    assert m["specjax_prefix_cache_enabled"] == 1
    assert (m["specjax_prefix_cache_queries_total"], m["specjax_prefix_cache_hits_total"]) == (2, 1)
    assert m["specjax_prefix_cache_hit_tokens_total"] == st["prefix_cache_hit_tokens"] == len(SYSTEM)
    assert m["specjax_prefix_cache_queried_tokens_total"] == st["prefix_cache_queried_tokens"] == 23 + 22
    assert m["specjax_prefix_cache_hit_rate"] == pytest.approx(len(SYSTEM) / 45, abs=1e-4)
    assert m["specjax_prefill_tokens_total"] == st["prefill_tokens"] == 23 + 2
    while eng.has_unfinished():
        eng.step()
    m, st = _metrics(eng), eng.stats()
    assert m["specjax_kv_pages_used"] == m["specjax_requests_running"] == 0
    assert m["specjax_kv_pages_cached"] == st["pages_cached"] > 0  # the registered pages stay for reuse
    assert m["specjax_prefix_cache_evictions_total"] == st["prefix_cache_evictions"]
    for kind in ("decode", "spec", "lite"):  # decode dispatches and their steps, the engine's own counts
        assert m[f'specjax_decode_dispatches_total{{kind="{kind}"}}'] == st[f"{kind}_dispatches"]
        assert m[f'specjax_decode_dispatch_steps_total{{kind="{kind}"}}'] == st[f"{kind}_dispatch_steps"]
    assert m['specjax_decode_dispatches_total{kind="decode"}'] > 0
    assert m["specjax_steps_per_dispatch_cap"] == st["steps_per_call_cap"] == eng.batch_opts.steps_per_call
    # compilations: the engine's executables, XLA compilations of the thread that stepped it (this one)
    assert m["specjax_compiled_programs"] == st["compiled_programs"] == eng.num_compiled() >= 2  # prefill, decode
    assert m["specjax_engine_thread_compilations_total"] == st["engine_thread_compiles"]
    assert m["specjax_engine_thread_compile_seconds_total"] == pytest.approx(st["engine_thread_compile_s"], abs=1e-5)
    assert m["specjax_background_compilations_total"] == st["background_compiles"] == 0  # fixed steps per dispatch


def test_prefix_cache_off_exports_no_prefix_figures(world):
    m = _metrics(_engine(world, prefix_cache=False))
    assert m["specjax_prefix_cache_enabled"] == 0
    assert not [k for k in m if k.startswith("specjax_prefix_cache_") and k != "specjax_prefix_cache_enabled"]
    assert m["specjax_kv_pages_cached"] == m["specjax_kv_pages_used"] == 0


def test_time_to_first_token_histogram_and_phases():
    """EngineStats.observe_first_token: cumulative buckets, +Inf = count, sum = the phases' sum."""
    from specjax.async_llm import TTFT_BUCKETS
    stats = EngineStats()
    for prep, pick, eng in ((0.001, 0.002, 0.004), (0.002, 0.0, 0.05), (0.5, 1.0, 20.0)):
        stats.observe_first_token(dict(received=10.0, queued=10.0 + prep, taken=10.0 + prep + pick,
                                       first=10.0 + prep + pick + eng))
    stats.engine = {"prefilling": 0, "pages_cached": 0, "prefill_tokens": 0, "num_preempted": 0, "prefix_cache": False}
    text = render_metrics(types.SimpleNamespace(stats=stats, error=None, speculative=False),
                          types.SimpleNamespace(responses=Counter(), in_flight=0, prompt_tokens=0))
    values = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines() if not line.startswith("#")}
    name = "specjax_time_to_first_token_seconds"
    got = {le: values[f'{name}_bucket{{le="{le}"}}'] for le in TTFT_BUCKETS}
    assert got[0.005] == 0 and got[0.01] == 1 and got[0.04] == 1 and got[0.08] == 2 and got[10.24] == 2
    assert values[f'{name}_bucket{{le="+Inf"}}'] == values[f"{name}_count"] == 3
    assert values[f"{name}_sum"] == pytest.approx(0.007 + 0.052 + 21.5, abs=1e-5)
    phase = "specjax_time_to_first_token_phase_seconds_total"
    assert values[f'{phase}{{phase="prepare"}}'] == pytest.approx(0.503, abs=1e-6)
    assert values[f'{phase}{{phase="pickup"}}'] == pytest.approx(1.002, abs=1e-6)
    assert values[f'{phase}{{phase="engine"}}'] == pytest.approx(20.054, abs=1e-6)
