"""Adaptive steps never compile on the engine thread: a level whose program is not compiled for the
batch's rows gives way to the nearest compiled one while a worker compiles it
(specjax.background_compile); the engine switches once it is ready, without compiling; outputs stay
those of a fixed K; several processes switch at the same step (process 0 says when)."""
from __future__ import annotations

import os
import queue
import subprocess
import sys
import types

import jax.numpy as jnp
import numpy as np
import pytest

from helpers import Held, IdTokenizer, Recording, tiny_config, tiny_model
from specjax import compile_watch, multihost
from specjax.dispatch_plan import StepsCap, plan
from specjax.drafter import DraftInfo
from specjax.engine import BatchOptions, CacheOptions, Draft, Engine
from specjax.request import Request
from specjax.sampling_params import SamplingParams
from specjax.tree import SpecConfig

MAX_SEQ = 64
EOS = 7
PARAMS = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def test_plan_takes_the_nearest_compiled_level():
    """The level's K when its program is compiled for the rows, else the nearest compiled level's
    (also when growing back to the configured K), else the configured K (compiled on first use, as
    with a fixed K); `wanted` says which K to compile elsewhere. A fixed K is not adapted."""
    opts = BatchOptions(steps_per_call=8)
    cap = StepsCap(adaptive=True)
    rows = [(0, types.SimpleNamespace(max_len=100, token_ids=[]))]
    asked = []

    def run(level, compiled, rows=rows, cap=cap):
        cap.set(level)
        asked.clear()
        p = plan(rows, False, opts, sched=None, caps=cap.chain(opts),
                 ready=lambda kind, K: asked.append(K) or K in compiled)
        return p.num_steps, p.wanted

    assert run(2, {8}) == (8, 2) and asked == [2, 4, 8]
    assert run(2, {4, 8}) == (4, 2)
    assert run(2, {2}) == (2, None)
    assert run(0, {2}) == (2, 8)  # growing back: the compiled quarter until the configured K is ready
    assert run(1, {2, 8}) == (8, 4)  # nearest first, the larger K of two as near
    assert run(0, set()) == (8, None)  # nothing compiled for these rows: the configured K, as ever
    assert run(2, set()) == (8, 2)
    tail = [(0, types.SimpleNamespace(max_len=3, token_ids=[]))]  # 3 tokens left: K = 4 at levels 0 and 1
    assert run(1, set(), rows=tail) == (4, None)
    assert run(0, {4}, cap=StepsCap(adaptive=False)) == (8, None) and asked == [8]  # fixed K


@pytest.fixture(scope="module")
def world():
    cfg = tiny_config(num_hidden_layers=1)
    rng = np.random.default_rng(4)
    prompts = [[int(t) for t in rng.integers(0, 96, size=n)] for n in (5, 13, 9)]
    return cfg, tiny_model(cfg, seed=0), prompts


def _engine(world, spec: bool) -> tuple[Engine, list]:
    cfg, model, _ = world
    draft = Draft(model, cfg, DraftInfo("draft"), SpecConfig(method="draft", num_steps=2)) if spec else None
    eng = Engine(model, cfg, CacheOptions(page_size=4, max_seq_len=MAX_SEQ, prefix_cache=False),
                 BatchOptions(max_batch=3), jnp.float32, draft=draft)
    eng.background = Held()
    used = []
    if spec:
        eng.spec_steps = eng.spec_steps._replace(step=Recording(eng.spec_steps.step, used))
    else:
        eng.steps = eng.steps._replace(decode_many=Recording(eng.steps.decode_many, used))
    return eng, used


def _requests(prompts, start: int = 0):
    return [Request(start + i, None, p, PARAMS, IdTokenizer(), (EOS,), MAX_SEQ, 3) for i, p in enumerate(prompts)]


def _run(eng, prompts) -> list:
    reqs = _requests(prompts)
    eng.run(reqs)
    return [r.token_ids for r in reqs]


@pytest.mark.parametrize("spec", [False, True], ids=["plain", "spec"])
def test_a_cold_level_compiles_off_the_engine_thread(world, spec):
    """Warm at the configured K; then at level 1 (cold): while its programs compile on the worker
    (held here) the engine runs the configured K and compiles nothing on its thread; once they are
    ready it runs them, still compiling nothing on its thread; the outputs never change."""
    _, _, prompts = world
    eng, used = _engine(world, spec)
    hi = 4 if spec else 8
    expected = _run(eng, prompts)  # compiles the configured K's programs (on this thread, as ever)
    assert max(used) == hi
    eng.steps_cap.set(1)  # K halves: programs of hi // 2 steps, not compiled for these rows
    held = compile_watch.thread_compiles()[0]
    used.clear()
    assert _run(eng, prompts) == expected
    assert compile_watch.thread_compiles()[0] == held, "the engine thread compiled for a cold level"
    assert hi // 2 not in used and eng.background.requested  # it waited for the worker (held)
    eng.background.gate.set()
    eng.background.wait()
    programs = eng.num_compiled()
    # a run at the level's K can reach a rows bucket the run before did not (the hold-back near
    # max_tokens depends on the tokens per dispatch): its program compiles in the background too
    assert _run(eng, prompts) == expected
    eng.background.wait()
    used.clear()
    assert _run(eng, prompts) == expected
    assert hi // 2 in used and max(used) == hi // 2  # the level's programs, once compiled
    assert compile_watch.thread_compiles()[0] == held, "the engine thread compiled a program compiled in the background"
    assert eng.num_compiled() > programs  # new executables in the jit caches, compiled by the worker
    assert eng.stats()["background_compiles"] == len(eng.background.requested)


class _Pipe:
    """An in-process Channel whose receive waits for the next message."""
    def __init__(self):
        self.q = queue.SimpleQueue()

    def send(self, payload):
        self.q.put(payload)

    def receive(self):
        return self.q.get(timeout=120)


def test_followers_switch_at_process_0s_step(world):
    """Process 0's worker finishes, the follower's does not: the follower still takes the level's
    program at the same dispatch as process 0 (compiling it itself), so both dispatch the same
    programs and compute the same outputs."""
    _, _, prompts = world
    lead, used0 = _engine(world, spec=False)
    follow, used1 = _engine(world, spec=False)
    pipe = _Pipe()
    lead.replica = multihost.Leader(pipe)

    def make_request(f):
        return Request(f["id"], f["prompt"], f["prompt_ids"], multihost.params_from(f["params"]), IdTokenizer(),
                       (EOS,), MAX_SEQ, f["seed"])

    follower = multihost.Follower(pipe, follow, make_request)
    steps = follower.replay()

    def run(reqs):
        for r in reqs:
            lead.add_request(r)
        while lead.has_unfinished():
            lead.step()
            assert next(steps).then == "step"
            if lead.background.requested and not lead.background.gate.is_set():
                lead.background.gate.set()  # process 0's worker runs; the follower's stays held
                lead.background.wait()
        return [r.token_ids for r in reqs]

    expected = run(_requests(prompts))
    lead.steps_cap.set(1)
    lead.replica.steps_level(1)
    got = run(_requests(prompts, start=10))
    assert got == expected
    assert used0 == used1 and 4 in used0  # the same programs, the level's among them
    assert follow.background.count == 0 and follow.background.requested  # its own worker never compiled
    lead.replica.send("stop")
    assert next(steps).then == "stop"
    follow.background.gate.set()


EXIT_SCRIPT = """
import time, jax, jax.numpy as jnp
from specjax.background_compile import BackgroundCompiles
def f(x):
    for i in range(150):
        x = jnp.sin(x @ x.T + i) @ x
    return x
bg = BackgroundCompiles()
bg.request("k", jax.jit(f), (jnp.ones((64, 64)),), {})
time.sleep(0.3)
print("exiting with", bg.pending, "pending", flush=True)
"""


def test_exit_waits_for_the_compile_in_progress(tmp_path):
    """A process that ends while the worker is inside an XLA compile exits cleanly: the compile is
    waited for at exit (without it the process aborted, status 134 on the CPU)."""
    script = tmp_path / "exit_while_compiling.py"
    script.write_text(EXIT_SCRIPT)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    res = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert "exiting with 1 pending" in res.stdout, res.stdout + res.stderr  # it was compiling at the end
    assert res.returncode == 0, res.stderr[-2000:]


def test_close_drops_the_queued_requests_and_counts_them():
    """close() waits for the compile in progress, drops the queued ones: they stop counting as
    pending (wait() returns at once), later requests are refused."""
    import threading

    from specjax.background_compile import BackgroundCompiles

    started, release = threading.Event(), threading.Event()

    class Slow:  # a "program" whose compile blocks until released
        def __init__(self):
            self.compiled = 0

        def lower(self, *a, **kw):
            return self

        def compile(self):
            started.set()
            release.wait(30)
            self.compiled += 1

    bg, prog = BackgroundCompiles(), Slow()
    assert bg.request("a", prog, (), {}) and bg.request("b", prog, (), {}) and bg.request("c", prog, (), {})
    assert started.wait(30)  # "a" is compiling, "b" and "c" queued
    closer = threading.Thread(target=bg.close)
    closer.start()
    release.set()
    closer.join(30)
    assert not closer.is_alive()
    assert (bg.count, bg.failed, bg.dropped, bg.pending, prog.compiled) == (1, 0, 2, 0, 1)
    bg.wait(timeout=1)  # nothing pending: returns
    assert not bg.request("d", prog, (), {}) and bg.pending == 0
