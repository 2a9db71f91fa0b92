"""Where the engine's compilations happen: XLA compilations counted by the thread that ran them, and
each program call that added an executable logged.

A compilation on the engine thread stalls every request (seconds per program on a GPU); one on a
worker thread (specjax.background_compile) does not. JAX reports each XLA compilation as a
monitoring event on the thread that compiles; `thread_compiles()` is what the calling thread has
compiled so far (count, seconds). Reading it costs a dict lookup: no device sync.

    Engine.step()             -> CompileWatch.step_begin / step_end: every XLA compilation of the
                                 stepping thread (programs, eager ops, admission helpers) counted
    Engine program calls      -> CompileWatch.call(what, fn, ...): a call after which the engine
                                 holds more executables (Engine.num_compiled) or this thread compiled
                                 is logged at INFO: the program, its shape, how long the call took
    Engine.stats()            -> compiled_programs, engine_thread_compiles / _s (/metrics)

A persistent-cache hit (specjax.compile_cache) is no XLA compilation but still a new executable:
its call is logged with 0 compilations and the time the load took.

After such a call (and once an engine is built) the Python heap is collected and frozen (`freeze_heap`):
the objects alive then (weights' wrappers, executables, jaxprs, tokenizer tables: ~360 000 in an
engine with the default model and head) move to the collector's permanent generation. Otherwise every
full collection walks them all, ~0.2 s on a 2-core CI machine, a stall of the decode loop at random
steps (the eval saw one-off stalls of 0.15-0.26 s on an H200 host; that they were this is not yet
measured). Building an engine first thaws everything and walks it once, so what earlier engines left in
cycles (a dropped `LLM`, its device buffers) is collected; after a compile only what was made since the
last freeze is walked, while the engine thread is stalled by the compile anyway.
"""
from __future__ import annotations

import gc
import logging
import threading
import time
from collections.abc import Callable

import jax

__all__ = ["CompileWatch", "freeze_heap", "install", "thread_compiles"]

COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
log = logging.getLogger("specjax")
_by_thread: dict[int, list] = {}  # thread ident -> [XLA compilations, seconds]
_installed = False
_lock = threading.Lock()


def _listener(event: str, duration: float, **kw) -> None:
    if event == COMPILE_EVENT:
        c = _by_thread.setdefault(threading.get_ident(), [0, 0.0])  # only this thread writes its entry
        c[0] += 1
        c[1] += duration


def install() -> None:
    """Register the listener (once per process)."""
    global _installed
    with _lock:
        if not _installed:
            jax.monitoring.register_event_duration_secs_listener(_listener)
            _installed = True


# seconds between two thaws (0: every engine built thaws, so a dropped engine's device buffers are freed
# before the next one allocates). A thaw walks the whole heap: ~0.2 s for one engine, ~0.7 s in a test
# process, whose conftest raises this to a minute (it builds hundreds of small engines).
RECLAIM_EVERY_S = 0.0
_last_reclaim = float("-inf")


def freeze_heap(reclaim: bool = False) -> None:
    """Collect the cyclic garbage now, then move every object still alive to the permanent generation
    (gc.freeze): later collections skip them (see the module doc). Frozen objects are still freed by
    reference counting; a cycle among them stays until a call with reclaim=True (an engine being
    built: a dropped LLM's engine is such a cycle) puts every frozen object back before collecting, at
    most once per RECLAIM_EVERY_S (every call by default; without the freeze, such cycles waited for a
    full collection)."""
    global _last_reclaim
    if reclaim and time.monotonic() - _last_reclaim >= RECLAIM_EVERY_S:
        gc.unfreeze()
        _last_reclaim = time.monotonic()
    gc.collect()
    gc.freeze()


def thread_compiles() -> tuple[int, float]:
    """(XLA compilations, their seconds) run by the calling thread since install()."""
    c = _by_thread.get(threading.get_ident())
    return (c[0], c[1]) if c else (0, 0.0)


class CompileWatch:
    """An engine's compile counters. num_compiled: the engine's executables (Engine.num_compiled)."""

    def __init__(self, num_compiled: Callable[[], int]):
        install()
        self.num_compiled = num_compiled
        self.step_compiles, self.step_compile_s = 0, 0.0  # XLA compilations on the stepping thread
        self.new_programs = 0  # program calls that added an executable
        self._at_step = (0, 0.0)

    def step_begin(self) -> None:
        self._at_step = thread_compiles()

    def step_end(self) -> None:
        n, s = thread_compiles()
        self.step_compiles += n - self._at_step[0]
        self.step_compile_s += s - self._at_step[1]

    def call(self, what: Callable[[], str], fn, *args, **kwargs):
        """fn(*args, **kwargs); logged when it added an executable or compiled on this thread.
        what() names the program and its shape (only called to log)."""
        n0, (c0, s0), t0 = self.num_compiled(), thread_compiles(), time.perf_counter()
        out = fn(*args, **kwargs)
        n1, (c1, s1) = self.num_compiled(), thread_compiles()
        if n1 != n0 or c1 != c0:
            self.new_programs += max(0, n1 - n0)
            log.info("engine: new program %s: the call took %.3f s on the engine thread, %d XLA compilation(s) "
                     "there (%.3f s); %d executables held", what(), time.perf_counter() - t0, c1 - c0, s1 - s0, n1)
            freeze_heap()  # what the compile left alive: out of later collections' way
        return out

    def stats(self) -> dict:
        return {"compiled_programs": self.num_compiled(), "engine_thread_compiles": self.step_compiles,
                "engine_thread_compile_s": self.step_compile_s}
