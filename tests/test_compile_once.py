"""Compilation happens once: an identical batch of requests run again compiles nothing (no new
executable of the engine's programs, no XLA compilation at all), for plain and speculative
decoding, greedy and sampling, with logprobs and penalties; with prefix caching too, whose cache
hits shorten the prefills of the repeated batch, by more than shape reuse's 4x slack too (issue 13).
(Across processes: tests/test_compile_cache.py.)"""
from __future__ import annotations

import gc
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import IdTokenizer, tiny_config, tiny_model
from specjax.drafter import DraftInfo
from specjax.engine import BatchOptions, CacheOptions, Draft, Engine
from specjax.request import Request
from specjax.sampling_params import SamplingParams
from specjax.shape_reuse import ShapeReuse
from specjax.tree import SpecConfig

MAX_SEQ = 64
COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


class CompileCounter:
    """Counts XLA backend compilations (every jit, eager op and program) while active."""

    def __init__(self):
        self.n = 0

    def __call__(self, event, duration, **kw):
        if event == COMPILE_EVENT:
            self.n += 1

    def __enter__(self):
        jax.monitoring.register_event_duration_secs_listener(self)
        return self

    def __exit__(self, *exc):
        jax.monitoring.unregister_event_duration_listener(self)


@pytest.fixture(scope="module")
def world():
    cfg = tiny_config(num_hidden_layers=1)
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(0, 96, size=n)] for n in (5, 17)]
    return cfg, tiny_model(cfg, seed=0), prompts


@pytest.mark.parametrize("spec", [False, True], ids=["plain", "spec"])
def test_second_identical_run_compiles_nothing(world, spec):
    """Plain, prefix caching off: greedy with logprobs beside sampling with a penalty (the per-slot
    penalty state is created on the way, between the programs' calls); the second identical run
    compiles nothing. Speculative (a draft of the target itself, greedy) with prefix caching on (the
    default): the second run finds the prompts' pages cached and prefills only the rest, padded to the
    prefill length the first run compiled (Engine._prefill_shape); neither it nor a third run compiles."""
    cfg, model, prompts = world
    draft = Draft(model, cfg, DraftInfo("draft"), SpecConfig(method="draft", num_steps=2)) if spec else None
    eng = Engine(model, cfg, CacheOptions(page_size=4, max_seq_len=MAX_SEQ, prefix_cache=spec),
                 BatchOptions(max_batch=2), jnp.float32, draft=draft)
    params = [SamplingParams(max_tokens=9, temperature=0, ignore_eos=True, logprobs=None if spec else 2),
              SamplingParams(max_tokens=9, temperature=0, ignore_eos=True) if spec else
              SamplingParams(max_tokens=9, temperature=0.8, top_p=0.9, ignore_eos=True, seed=3, repetition_penalty=1.2)]
    programs = eng.spec_steps if spec else eng.steps

    def run():
        reqs = [Request(i, None, p, params[i], IdTokenizer(), (96,), MAX_SEQ, 7) for i, p in enumerate(prompts)]
        eng.run(reqs)
        return [r.token_ids for r in reqs]

    first = run()
    compiled = eng.num_compiled()
    assert compiled >= 2
    for _ in range(2):  # with prefix caching the second run's prefills are shorter: they reuse a program
        with CompileCounter() as c:
            assert run() == first
        assert eng.num_compiled() == compiled, "an identical run compiled a new program"
        assert c.n == 0, f"an identical run compiled {c.n} XLA executables"
    if spec:
        assert eng.stats()["prefix_cache_hit_tokens"] > 0


def test_the_engine_freezes_what_its_compiles_leave_alive(world):
    """specjax.compile_watch.freeze_heap: the objects alive when the engine is built, and those alive
    after each call that compiled a program, go to the collector's permanent generation (a full
    collection would walk them at a random decode step otherwise); the requests' own objects do not."""
    cfg, model, prompts = world
    gc.unfreeze()  # earlier tests' engines froze the heap too: start from nothing frozen
    assert gc.get_freeze_count() == 0
    eng = Engine(model, cfg, CacheOptions(page_size=4, max_seq_len=MAX_SEQ, prefix_cache=False),
                 BatchOptions(max_batch=2), jnp.float32)
    at_init = gc.get_freeze_count()
    assert at_init > 0, "building the engine froze nothing"
    p = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    reqs = [Request(i, None, q, p, IdTokenizer(), (96,), MAX_SEQ, 7) for i, q in enumerate(prompts)]
    eng.run(reqs)
    assert eng.num_compiled() >= 2
    after = gc.get_freeze_count()
    assert after > at_init, "the calls that compiled programs froze nothing"
    assert all(r.token_ids for r in reqs)
    assert len(gc.get_objects()) < after, "most of the heap should be frozen after the compiles"


def test_building_an_engine_reclaims_frozen_cycles(world, monkeypatch):
    """A dropped engine is a reference cycle (its bound methods) frozen with the heap: the next engine
    built thaws and collects it (its device buffers go with it): by default at every build; with
    RECLAIM_EVERY_S set (the test process's conftest), once the last thaw is that old."""
    from specjax import compile_watch
    cfg, model, _ = world

    def build():
        return Engine(model, cfg, CacheOptions(page_size=4, max_seq_len=MAX_SEQ, prefix_cache=False),
                      BatchOptions(max_batch=2), jnp.float32)

    monkeypatch.setattr(compile_watch, "RECLAIM_EVERY_S", 0.0)  # the library's default
    old = weakref.ref(build())
    assert old() is not None, "expected the engine to be kept alive by its frozen cycles"
    build()
    assert old() is None, "the default: building an engine left an earlier, dropped engine alive"

    monkeypatch.setattr(compile_watch, "RECLAIM_EVERY_S", 60.0)
    monkeypatch.setattr(compile_watch, "_last_reclaim", float("-inf"))
    old = weakref.ref(build())  # dropped at once: only its own cycles keep it, frozen by its constructor
    assert old() is not None, "expected the engine to be kept alive by its frozen cycles"
    build()  # the first build thawed a moment ago: this one does not
    assert old() is not None, "a thaw within RECLAIM_EVERY_S of the last one"
    monkeypatch.setattr(compile_watch, "_last_reclaim", float("-inf"))
    build()
    assert old() is None, "building an engine left an earlier, dropped engine alive"


@pytest.mark.parametrize("spec", [False, True], ids=["plain", "spec"])
def test_repeat_of_long_prompts_compiles_nothing(world, spec):
    """Issue 13: prompts of 70 and 100 tokens prefill as [2, 128]; run again, the prefix cache holds
    all but their last 2-4 tokens, whose bucket [2, 16] is 8x smaller (beyond the 4x slack of shape
    reuse), and the second run compiled it. A prompt found whole in the cache counts as its uncached
    length for the reuse (Scheduler.uncached_len): the repeats run on [2, 128] and compile nothing,
    with the outputs of an engine without prefix caching. New text after a cached prefix still gets
    its own short bucket (a shared system prompt keeps its short prefills)."""
    cfg, model, _ = world
    rng = np.random.default_rng(2)
    prompts = [[int(t) for t in rng.integers(0, 96, size=n)] for n in (70, 100)]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)

    def engine(prefix_cache):
        draft = Draft(model, cfg, DraftInfo("draft"), SpecConfig(method="draft", num_steps=2)) if spec else None
        return Engine(model, cfg, CacheOptions(page_size=4, max_seq_len=256, prefix_cache=prefix_cache),
                      BatchOptions(max_batch=2), jnp.float32, draft=draft)

    def run(eng, ps):
        reqs = [Request(i, None, p, params, IdTokenizer(), (96,), 256, 7) for i, p in enumerate(ps)]
        eng.run(reqs)
        return [r.token_ids for r in reqs]

    eng, ref = engine(True), engine(False)
    expected = run(ref, prompts)
    assert run(eng, prompts) == expected
    compiled = eng.num_compiled()
    for _ in range(2):
        with CompileCounter() as c:
            assert run(eng, prompts) == expected
        assert eng.num_compiled() == compiled, "an identical run compiled a new program"
        assert c.n == 0, f"an identical run compiled {c.n} XLA executables"
    assert eng.stats()["prefix_cache_hit_tokens"] == 2 * (68 + 96)
    new_text = [prompts[1][:80] + [int(t) for t in rng.integers(0, 96, size=20)]]  # 80 cached, 20 new tokens
    assert run(eng, new_text) == run(ref, new_text)
    prefills = set().union(*[v for k, v in eng.shapes.used.items() if k[0] == "prefill"])
    assert (1, 32) in prefills


@pytest.mark.parametrize("spec", [False, True], ids=["plain", "spec"])
def test_smaller_batches_reuse_larger_programs(world, spec):
    """After a batch of 8 requests, batches of 5 and 3 (other buckets, shorter prompts) run on the
    programs already compiled, padded (specjax.shape_reuse): no new executable, where an engine that
    reuses nothing (slack 1) compiles the exact buckets; the outputs are the same."""
    cfg, model, _ = world
    rng = np.random.default_rng(1)
    prompts = [[int(t) for t in rng.integers(0, 96, size=n)] for n in (9, 14, 6, 11, 13, 7, 10, 12)]
    params = [SamplingParams(max_tokens=7, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=7, temperature=0.7, ignore_eos=True, seed=5)]

    def engine():
        draft = Draft(model, cfg, DraftInfo("draft"), SpecConfig(method="draft", num_steps=2)) if spec else None
        return Engine(model, cfg, CacheOptions(page_size=4, max_seq_len=MAX_SEQ, prefix_cache=False),
                      BatchOptions(max_batch=8), jnp.float32, draft=draft)

    def run(eng, ps):
        reqs = [Request(i, None, p, params[i % 2], IdTokenizer(), (96,), MAX_SEQ, 7) for i, p in enumerate(ps)]
        eng.run(reqs)
        assert all(r.finish_reason == "length" for r in reqs)
        return [r.token_ids for r in reqs]

    def second_phase(slack):
        eng = engine()
        eng.shapes = ShapeReuse(slack=slack)
        run(eng, prompts)
        compiled = eng.num_compiled()
        with CompileCounter() as c:
            got = [run(eng, ps) for ps in [prompts[1:6], prompts[5:8]]]
        return got, eng.num_compiled() - compiled, c.n

    got, new_programs, xla = second_phase(4)
    assert new_programs == 0 and xla == 0, f"smaller batches compiled {new_programs} programs ({xla} executables)"
    exact, new_programs, xla = second_phase(1)  # no reuse: the exact buckets, compiled now
    assert new_programs > 0 and xla > 0
    assert got == exact
