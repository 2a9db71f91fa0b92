"""Programs compiled on a worker thread, ahead of their first dispatch, so that the engine thread
never waits for them.

Used for adaptive steps per dispatch (dispatch_plan.StepsCap): a lower or higher cap runs other
programs (num_steps is static) that may not be compiled yet for the batch's rows; compiling one on
the engine thread stalls every request for seconds (H200: 4-7 s per program, measured). Instead the engine
keeps dispatching programs it has, asks for the wanted one here, and switches once it is ready:

    engine thread                                      worker thread ("specjax-compile")
    plan falls back (DispatchPlan.wanted)
    request(key, program, args, kwargs)  -- abstract args (shapes, dtypes, shardings) -->
                                                        program.lower(*args, **kwargs).compile()
    finished() at the start of a step   <-- (key, ok) --
    the key is ready (ShapeReuse): the next dispatch with that shape runs it

`program.lower(...).compile()` fills the jitted function's own caches (trace, lowering,
compilation): the engine's later call with concrete arguments of the same shapes, dtypes and
shardings runs the compiled executable without compiling (tests/test_background_compile.py checks
this on the engine's programs). Arguments are made abstract on the requesting thread: a donated
buffer may be gone when the worker runs. An argument that the program would see as committed to a
device (jax.Array.committed) keeps its sharding; an uncommitted one (numpy, default-placed arrays)
gets none, as the call would.

The worker holds the GIL while it traces and lowers (Python), releases it while XLA compiles.

At interpreter exit the compile in progress is waited for and queued ones are dropped (`close`): a
process that exits while a thread is inside an XLA compile aborts (CPU) or segfaults (GPU; seen at the
end of an eval whose last requests asked for a program), losing its exit status.
"""
from __future__ import annotations

import atexit
import logging
import queue
import threading
import time
import weakref

import jax
import numpy as np

__all__ = ["BackgroundCompiles", "abstract"]

log = logging.getLogger("specjax")


def abstract(x):
    """A program argument as the worker lowers it: arrays -> ShapeDtypeStruct (sharding only where
    committed), anything else as it is."""
    if isinstance(x, jax.Array):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding if x.committed else None,
                                    weak_type=x.weak_type)
    if isinstance(x, np.ndarray):
        return jax.ShapeDtypeStruct(x.shape, x.dtype)
    return x


class BackgroundCompiles:
    """One worker thread compiling requested programs in order; each key is compiled once."""

    def __init__(self):
        self.requested: set = set()
        self._todo: queue.SimpleQueue = queue.SimpleQueue()
        self._done: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self.count, self.seconds, self.failed = 0, 0.0, 0  # compiled (ok) and their seconds, failed
        self.dropped = 0  # requests close() dropped before their compile began
        self.closed = False
        _LIVE.add(self)

    @property
    def pending(self) -> int:
        return len(self.requested) - self.count - self.failed - self.dropped

    def request(self, key, program, args: tuple, kwargs: dict) -> bool:
        """Compile program(*args, **kwargs) (a jitted function; kwargs its static arguments) unless
        key was requested before. False: already requested."""
        if key in self.requested or self.closed:
            return False
        self.requested.add(key)
        self._todo.put((key, program, jax.tree.map(abstract, args), kwargs))
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="specjax-compile", daemon=True)
            self._thread.start()
        return True

    def finished(self) -> list[tuple[object, bool]]:
        """(key, compiled ok) of the requests finished since the last call."""
        out = []
        while True:
            try:
                out.append(self._done.get_nowait())
            except queue.Empty:
                return out

    def wait(self, timeout: float = 300.0) -> None:
        """Until every request so far is finished (tests, benchmarks)."""
        deadline = time.monotonic() + timeout
        while self.pending:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.pending} background compilations still running after {timeout:.0f} s")
            time.sleep(0.01)

    def close(self) -> None:
        """Take no more requests, drop the queued ones and wait for the compile in progress (if any);
        the dropped ones no longer count as pending."""
        self.closed = True
        if self._thread is not None and self._thread.is_alive():
            self._todo.put(None)  # wakes an idle worker
            self._thread.join()
        while True:  # the worker has stopped (or never started): what is left in the queue never runs
            try:
                item = self._todo.get_nowait()
            except queue.Empty:
                return
            self.dropped += item is not None

    def _run(self) -> None:
        while True:
            item = self._todo.get()
            if item is None or self.closed:
                self.dropped += item is not None  # taken after close(): never compiled
                return
            key, program, args, kwargs = item
            t0 = time.perf_counter()
            try:
                program.lower(*args, **kwargs).compile()
                ok = True
            except Exception as e:  # noqa: BLE001 - the engine keeps running the programs it has
                log.warning("background compile of %s failed (the engine keeps its compiled programs): %s: %s",
                            key, type(e).__name__, e)
                ok = False
            dt = time.perf_counter() - t0
            self._done.put((key, ok))  # before the counts: once wait() sees none pending, finished() has it
            if ok:
                log.info("background compile of %s: %.3f s", key, dt)
                self.seconds += dt
                self.count += 1
            else:
                self.failed += 1


_LIVE: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _close_at_exit() -> None:
    for bg in list(_LIVE):
        if bg.pending and bg._thread is not None and bg._thread.is_alive():
            log.info("waiting for a background compile to finish before exit")
        bg.close()
