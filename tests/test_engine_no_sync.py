"""The engine's loop reads the device only where it reads a dispatch's outputs (Engine._read): no other
device -> host read in `Engine.step()` (each would wait for the device's queue to drain and leave the device
idle while the host works; on a CPU such reads cost nothing, so the test counts them instead of timing).
Counted during the steps of a warm engine (plain, speculative and with row hand-over, at one and two rows):
every materialisation of a jax array's value through ArrayImpl._value (.tolist(), int(), bool(), float(),
np.asarray on a GPU) and every np.asarray / np.array of a jax array made by specjax's modules (on a CPU numpy
reads such an array's buffer directly, past _value)."""
from __future__ import annotations

import collections
import sys
import traceback
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src import array as jax_array

import specjax.engine_results as engine_results
from helpers import IdTokenizer, draft_setup, draft_of
from specjax.engine import BatchOptions, CacheOptions, Engine
from specjax.request import Request
from specjax.sampling_params import SamplingParams
from specjax.scheduler import SchedulerOptions

MAX_SEQ = 64


@pytest.fixture(scope="module")
def setup():
    return draft_setup((5, 19, 2, 11, 7, 3))


class HostReads:
    """Counts host reads of jax array values outside Engine._read, by the specjax frames that made them."""

    def __init__(self, monkeypatch):
        self.where, self.in_read, self.on = collections.Counter(), 0, False
        value, read = jax_array.ArrayImpl._value, engine_results.ResultSteps._read

        def counted(arr):
            self.note()
            return value.fget(arr)

        def numpy_call(fn):
            def call(x, *args, **kw):
                if isinstance(x, jax.Array):
                    self.note()
                return fn(x, *args, **kw)
            return call

        watched = types.ModuleType("numpy_watched")  # numpy, with asarray / array counting jax arrays
        watched.__getattr__ = lambda name: getattr(np, name)
        watched.asarray, watched.array = numpy_call(np.asarray), numpy_call(np.array)
        for name, mod in list(sys.modules.items()):
            if name.startswith("specjax") and getattr(mod, "np", None) is np:
                monkeypatch.setattr(mod, "np", watched)

        def reading(eng, e):
            self.in_read += 1
            try:
                return read(eng, e)
            finally:
                self.in_read -= 1

        monkeypatch.setattr(jax_array.ArrayImpl, "_value", property(counted))
        monkeypatch.setattr(engine_results.ResultSteps, "_read", reading)

    def note(self):
        if self.on and not self.in_read:
            frames = [f for f in traceback.extract_stack()[:-2] if "/specjax/" in f.filename]
            self.where["; ".join(f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno} {f.name}" for f in frames[-3:])] += 1


@pytest.mark.parametrize("draft,handover,max_batch", [(None, False, 1), ("other", False, 1), ("other", True, 1),
                                                      ("other", True, 2), ("self", False, 2)])
def test_steps_read_the_device_only_in_read(setup, monkeypatch, draft, handover, max_batch):
    cfg, target = setup[:2]
    eng = Engine(target, cfg, CacheOptions(page_size=4, max_seq_len=MAX_SEQ), BatchOptions(max_batch=max_batch),
                 jnp.float32, draft=draft_of(setup, draft), sched=SchedulerOptions(handover=handover))
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)

    def requests(first_id):
        return [Request(first_id + i, None, p, params, IdTokenizer(), (96,), MAX_SEQ, 1000 + i)
                for i, p in enumerate(setup[4])]

    eng.run(requests(0))  # compiles
    reads = HostReads(monkeypatch)
    reqs = requests(100)
    for r in reqs:
        eng.add_request(r)
    reads.on = True
    while eng.has_unfinished():
        eng.step()
    reads.on = False
    assert all(r.output().finish_reason == "length" for r in reqs)
    assert reads.where == {}, f"device reads outside Engine._read: {dict(reads.where)}"
    if handover:
        assert eng.handed_over > 0
