"""scripts/probe_host_calls.py on the CPU: every program call of a speculative engine is timed under its
name, the stable-argument mode gives the same tokens with device arrays reused by content, and a trace's
host events are summed by name (the timings themselves are GPU measurements)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from helpers import IdTokenizer, load_script, tiny_config, tiny_model
from specjax.drafter import DraftInfo
from specjax.engine import BatchOptions, CacheOptions, Draft, Engine
from specjax.programs import StopRows
from specjax.request import Request
from specjax.sampling_params import SamplingParams
from specjax.tree import SpecConfig

PARAMS = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def _engine():
    cfg = tiny_config()
    target = tiny_model(cfg, seed=0)
    d = Draft(target, cfg, DraftInfo("draft"), SpecConfig(method="draft", num_steps=3, topk=2, num_draft_tokens=6))
    return Engine(target, cfg, CacheOptions(page_size=4, max_seq_len=64), BatchOptions(max_batch=1), jnp.float32,
                  draft=d)


def _run(eng):
    rng = np.random.default_rng(3)
    reqs = [Request(i, None, [int(t) for t in rng.integers(0, 96, size=n)], PARAMS, IdTokenizer(), (96,), 64, 0)
            for i, n in enumerate((5, 9))]
    eng.run(reqs)
    return [r.output().token_ids for r in reqs]


def test_calls_are_timed_by_program_and_stable_args_keep_the_tokens():
    mod = load_script("probe_host_calls")
    want = _run(_engine())
    eng = _engine()
    ct = mod.CallTimes(eng)
    try:
        ct.on = ct.drain = True
        assert _run(eng) == want
        calls = ct.summary()
        assert calls["prefill"]["calls"] == 2
        spec = [k for k in calls if k.startswith("spec K=")]
        assert spec and all(calls[k]["calls"] >= 1 and calls[k]["median_ms"] > 0 for k in spec)
        assert calls["page_table"]["calls"] >= 2
    finally:
        ct.close()
    eng2 = _engine()
    ct2 = mod.CallTimes(eng2)
    try:
        ct2.stable_args()
        seen, stop_rows = [], []
        call = eng2.compiles.call

        def spy(what, fn, *a, **k):
            seen.append([x for x in a if isinstance(x, jax.Array) and x.ndim == 1 and x.dtype == jnp.int32])
            stop_rows.extend(x for x in a if isinstance(x, StopRows))
            return call(what, fn, *a, **k)
        eng2.compiles.call = spy
        assert _run(eng2) == want
        decode = [s for s in seen if s]
        assert len(decode) >= 2  # the dispatches' slots / limits arrive as device arrays
        first = [id(s[0]) for s in decode]  # equal slots at batch 1: the same buffer on every call
        assert len(set(first)) < len(first)
        stops = [x.limit for x in stop_rows]  # the stop rows' arrays too
        assert stops and all(isinstance(x, jax.Array) for x in stops)
        assert len({id(x) for x in stops}) < len(stops)
    finally:
        ct2.close()


def test_host_events_sum_a_trace_by_name(tmp_path):
    mod = load_script("probe_host_calls")
    with jax.profiler.trace(str(tmp_path)):
        jax.jit(lambda x: jnp.tanh(x) * 2)(jnp.ones(16)).block_until_ready()
    ev = mod.host_events(str(tmp_path))
    assert ev and all(n >= 1 and ms >= 0 for n, ms in ev.values())
    assert not any(k.startswith("$") for k in ev)
    totals = [ms for _, ms in ev.values()]
    assert totals == sorted(totals, reverse=True)
