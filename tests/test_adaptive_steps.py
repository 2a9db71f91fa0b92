"""Adaptive steps per dispatch (BatchOptions.adaptive_steps, dispatch_plan.StepsCap): the cap halves
while the engine loop waits for the device and doubles back while it does not; whatever the
dispatches' grouping, outputs equal a fixed K (plain and speculative, greedy and sampled)."""
from __future__ import annotations

import itertools

import jax.numpy as jnp
import numpy as np
import pytest

from helpers import IdTokenizer, Recording, tiny_config, tiny_model
from specjax.background_compile import BackgroundCompiles
from specjax.dispatch_plan import StepsCap
from specjax.drafter import DraftInfo
from specjax.engine import BatchOptions, CacheOptions, Draft, Engine
from specjax.request import Request
from specjax.sampling_params import SamplingParams
from specjax.tree import SpecConfig

MAX_SEQ = 64
EOS = 7


def test_steps_cap_halves_while_waiting_and_grows_while_busy():
    opts = BatchOptions(steps_per_call=8, spec_steps_per_call=4)
    cap = StepsCap(adaptive=True)
    assert cap.caps(opts) == (8, 4)
    assert not cap.observe(0.3, 1.0)  # between the thresholds: stays
    assert not cap.observe(0.9, 1.0)  # the average (0.45) is not past the threshold yet
    assert cap.observe(0.9, 1.0) and cap.caps(opts) == (4, 2)  # (0.56) the loop mostly waits: halve
    assert cap.observe(0.9, 1.0) and cap.caps(opts) == (2, 1)
    assert not cap.observe(1.0, 1.0) and cap.level == StepsCap.MAX_LEVEL  # a quarter at most
    assert not cap.observe(0.0, 1.0)  # the average (0.75) still says waiting
    cap.set(2)  # a change starts the average again
    assert cap.observe(0.0, 1.0) and cap.caps(opts) == (4, 2)  # the host is the bottleneck: grow
    # the average forgets slowly: one busy step after long waiting does not grow the cap at once
    cap.set(1)
    for _ in range(3):
        cap.observe(0.4, 1.0)
    assert not cap.observe(0.1, 1.0) and cap.level == 1
    assert StepsCap(adaptive=True).caps(BatchOptions(steps_per_call=1, spec_steps_per_call=1)) == (1, 1)
    fixed = StepsCap(adaptive=False)
    assert not any(fixed.observe(1.0, 1.0) for _ in range(5)) and fixed.caps(opts) == (8, 4)


class Cycling(StepsCap):
    """A cap that changes level on every observed step (0, 1, 2, 1, 0, ...), to group one run's
    dispatches in every way the adaptive cap can."""
    def __init__(self):
        super().__init__(adaptive=True)
        self._levels = itertools.cycle([1, 2, 1, 0])

    def observe(self, wait_s, loop_s):
        return self.set(next(self._levels))


class CompileAtOnce(BackgroundCompiles):
    """Finishes each request before returning (the next step takes it): a deterministic grouping."""
    def request(self, key, program, args, kwargs):
        out = super().request(key, program, args, kwargs)
        self.wait()
        return out


@pytest.fixture(scope="module")
def setup():
    cfg = tiny_config()
    target = tiny_model(cfg, seed=0)
    dcfg = tiny_config(num_hidden_layers=1)
    rng = np.random.default_rng(3)
    prompts = [[int(t) for t in rng.integers(0, 96, size=n)] for n in (5, 23, 11, 2)]
    return cfg, target, tiny_model(dcfg, seed=5), dcfg, prompts


def _run(setup, spec: bool, params, cycling: bool, runs: int = 1):
    """The prompts' outputs in each of `runs` runs on one engine, and the K of each dispatch."""
    cfg, target, dmodel, dcfg, prompts = setup
    draft = (Draft(dmodel, dcfg, DraftInfo("draft"), SpecConfig(method="draft", num_steps=3, topk=2,
                                                                  num_draft_tokens=6)) if spec else None)
    eng = Engine(target, cfg, CacheOptions(page_size=4, max_seq_len=MAX_SEQ),
                 BatchOptions(max_batch=3, adaptive_steps=cycling), jnp.float32, draft=draft)
    if cycling:
        eng.steps_cap, eng.background = Cycling(), CompileAtOnce()
    used = []
    if spec:
        eng.spec_steps = eng.spec_steps._replace(step=Recording(eng.spec_steps.step, used))
    else:
        eng.steps = eng.steps._replace(decode_many=Recording(eng.steps.decode_many, used))
    outs = []
    for _ in range(runs):
        reqs = [Request(i, None, p, params, IdTokenizer(), (EOS,), MAX_SEQ, 11 + i) for i, p in enumerate(prompts)]
        eng.run(reqs)
        assert all(s is None for s in eng.slots)
        assert eng.alloc.num_free == int(eng.state.cache.kv[0].shape[0]) - 1  # no page leaked
        outs.append([r.token_ids for r in reqs])
    return outs, used


@pytest.mark.parametrize("spec", [False, True], ids=["plain", "spec"])
@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "sampled"])
def test_outputs_equal_a_fixed_k_whatever_the_grouping(setup, spec, temperature):
    params = SamplingParams(max_tokens=30, temperature=temperature, top_p=0.9 if temperature else 1.0)
    (fixed,), used_fixed = _run(setup, spec, params, cycling=False)
    # run 1: each new level falls back to a compiled one while its program compiles (here at once,
    # taken from the next step on); run 2: the levels' programs are compiled
    cycled, used = _run(setup, spec, params, cycling=True, runs=2)
    assert cycled == [fixed, fixed]
    hi = 4 if spec else 8
    assert max(used_fixed) == hi and {hi // 2, hi // 4} <= set(used)  # the cycling run grouped otherwise


class _Pipe:
    """An in-process Channel: what process 0 sends, a follower receives in order."""
    def __init__(self):
        self.msgs = []

    def send(self, payload):
        self.msgs.append(payload)

    def receive(self):
        return self.msgs.pop(0)


def test_multi_host_followers_take_process_0s_steps_per_dispatch():
    """Process 0 adapts its cap and sends each change before the step that uses it; a follower's own
    cap does not adapt (its host timings differ) and applies process 0's, so both dispatch alike."""
    import types

    from specjax import multihost
    pipe = _Pipe()
    leader = multihost.Leader(pipe)
    follower_engine = types.SimpleNamespace(steps_cap=StepsCap(adaptive=True), stepped=[])
    follower_engine.step = lambda: follower_engine.stepped.append(follower_engine.steps_cap.level) or []
    follower = multihost.Follower(pipe, follower_engine, make_request=None)
    assert not follower_engine.steps_cap.adaptive
    for level in (1, 2, 0):
        leader.steps_level(level)
        leader.send("step")
    leader.send("stop")
    assert [ev.then for ev in follower.replay()] == ["step", "step", "step", "stop"]
    assert follower_engine.stepped == [1, 2, 0]
