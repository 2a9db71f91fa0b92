"""Host seconds per engine program call at batch 1, GPU machine (runs anywhere).

    python3 scripts/probe_host_calls.py --model DIR [--draft DIR] [--prompts 8] [--max-tokens 256] [--json F]

Runs `LLM.generate` (one slot, greedy, EOS ignored) once to compile, then twice timed: once as the engine runs
("queued": a call may block while the device's launch queue is full, so its time mixes host work and device
time) and once with the device drained before every program call ("drained": the engine's state is waited for
first, so the call's time is the host's own work: argument handling, the launch, XLA's command-buffer updates).
Reports, per program (the engine's name for it: prefill, spec K=4, admit_slots, page-table pushes), the calls
and the median and mean seconds of each mode ("NAME +device": drained, the call and its device work waited
for), and the wall of the queued call. --handover: the engine with row hand-over (specjax.engine_handover). What a request boundary costs
the host at batch 1 is the sum of its calls (a prefill, the n-gram history's admit_slots, a page-table push,
the first fused dispatch) against the device work queued behind it (docs/benchmarks.md, session 38).

--trace-host: a third timed call (drained) under jax.profiler.trace; its host planes' events (XLA's runtime
annotations: the executable's launch, its thunks, command-buffer records and updates, ...) are summed by name
(top 30 by total milliseconds, with counts; Python frames left out).

--stable-args: a decode dispatch's small host arguments (rows' slots, active flags, stop rows) are passed as
device arrays kept by content, so that equal values reach the program in the same buffers on every call
instead of fresh ones (tells whether fresh argument buffers cost the host time per call, e.g. in updates of
XLA's command buffers; at batch 1 they are equal for all of a request's dispatches). Outputs are unchanged.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


class CallTimes:
    """Wraps the engine's program calls (Engine.compiles.call, programs.admit_slots, the page-table push)
    and records host seconds per program name; drain=True waits for the device before each call."""

    def __init__(self, eng):
        import jax

        from specjax import programs as prog

        self.eng, self.on, self.drain = eng, False, False
        self.times: dict[str, list[float]] = defaultdict(list)
        call, admit, push = eng.compiles.call, prog.admit_slots, eng._push_page_table

        def timed(name, fn, *a, **k):
            if not self.on:
                return fn(*a, **k)
            if self.drain:
                jax.block_until_ready(eng.state)
            t = time.perf_counter()
            out = fn(*a, **k)
            self.times[name].append(time.perf_counter() - t)
            if self.drain:  # the call and its device work: drained before, waited for after
                jax.block_until_ready(out)
                self.times[name + " +device"].append(time.perf_counter() - t)
            return out

        def named(what):
            w = what().split()
            return " ".join(w[:2]) if len(w) > 1 and w[1].startswith("K=") else w[0]

        eng.compiles.call = lambda what, fn, *a, **k: timed(named(what), call, what, fn, *a, **k)
        self._restore = lambda: setattr(prog, "admit_slots", admit)
        prog.admit_slots = lambda *a, **k: timed("admit_slots", admit, *a, **k)
        eng._push_page_table = lambda: timed("page_table", push) if eng.alloc.dirty else push()

    def close(self) -> None:
        """Put programs.admit_slots back (the engine's own methods stay wrapped)."""
        self._restore()

    def stable_args(self) -> None:
        """Pass the decode dispatches' numpy arguments as device arrays cached by content (module doc)."""
        import jax
        import numpy as np

        from specjax.programs import StopRows

        cache, decode_call = {}, self.eng._decode_call

        def dev(x):
            if not isinstance(x, np.ndarray):
                return x
            key = (x.shape, x.dtype.str, x.tobytes())
            if key not in cache:
                cache[key] = jax.device_put(x)
            return cache[key]

        def call(*a, **k):
            fn, args, kw = decode_call(*a, **k)
            args = tuple(StopRows(*map(dev, v)) if isinstance(v, StopRows) else dev(v) for v in args)
            return fn, args, kw

        self.eng._decode_call = call

    def summary(self) -> dict:
        return {k: {"calls": len(v), "median_ms": round(1e3 * statistics.median(v), 3),
                    "mean_ms": round(1e3 * statistics.fmean(v), 3)} for k, v in sorted(self.times.items())}


def host_events(trace_dir: str, top: int = 30) -> dict:
    """{event name: [count, total ms]} of the host planes of a jax.profiler trace, largest totals first."""
    import glob
    import os

    from jax.profiler import ProfileData
    files = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
    if not files:
        raise SystemExit(f"no xplane.pb under {trace_dir}")
    tot: dict[str, list] = defaultdict(lambda: [0, 0.0])
    for plane in ProfileData.from_file(files[0]).planes:
        if plane.name.startswith("/device:"):
            continue
        for line in plane.lines:
            for e in line.events:
                if e.name.startswith("$"):  # Python frames (the profiler's Python tracer)
                    continue
                t = tot[e.name]
                t[0] += 1
                t[1] += e.duration_ns / 1e6
    return {k: [n, round(ms, 3)] for k, (n, ms) in sorted(tot.items(), key=lambda kv: -kv[1][1])[:top]}


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--draft", default=None, help="a head dir (default: the shipped one); 'none': plain decoding")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--attention", default="auto", help="LLM(attention=...)")
    p.add_argument("--kv-compact-impl", default="auto", help="LLM(kv_compact_impl=...)")
    p.add_argument("--stable-args", action="store_true", help="decode dispatches' small arguments as device "
                   "arrays kept by content (module doc)")
    p.add_argument("--trace-host", action="store_true", help="a third call under jax.profiler.trace: host "
                   "events summed by name (module doc)")
    p.add_argument("--unread", type=int, default=1, help="SchedulerOptions(unread=N): decode dispatches the "
                   "host leaves unread after a step (default 1)")
    p.add_argument("--handover", action="store_true", help="SchedulerOptions(handover=True) (row hand-over)")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    import jax

    from specjax.llm import LLM
    from specjax.sampling_params import SamplingParams

    draft = a.draft or str(Path(__file__).resolve().parents[1] / "specjax/assets/eagle3-smollm2-135m")
    from specjax.scheduler import SchedulerOptions
    llm = LLM(model=a.model, draft=None if draft == "none" else draft, dtype=a.dtype, max_batch=1,
              attention=a.attention, kv_compact_impl=a.kv_compact_impl,
              scheduler=SchedulerOptions(handover=a.handover, unread=a.unread))
    sp = SamplingParams(max_tokens=a.max_tokens, temperature=0.0, ignore_eos=True)
    prompts = [f"Write a short note number {i} about the weather, the sea and the mountains." for i in range(a.prompts)]
    ct = CallTimes(llm.engine)
    if a.stable_args:
        ct.stable_args()
    llm.generate(prompts, sp)
    res = {"backend": jax.default_backend(), "attention": llm.engine.attention_choice, "kernels": str(llm.engine.kernels),
           "stable_args": a.stable_args}
    for mode in ("queued", "drained"):
        ct.times.clear()
        ct.on, ct.drain = True, mode == "drained"
        t = time.perf_counter()
        outs = llm.generate(prompts, sp)
        res[mode] = {"wall_s": round(time.perf_counter() - t, 4), "calls": ct.summary()}
        ct.on = False
    if a.trace_host:
        import tempfile
        tdir = tempfile.mkdtemp(prefix="specjax_hostcalls_")
        ct.times.clear()
        ct.on, ct.drain = True, True
        with jax.profiler.trace(tdir):
            llm.generate(prompts, sp)
        ct.on = False
        res["traced"] = {"calls": ct.summary(), "host_events": host_events(tdir)}
    st = llm.engine.stats()
    res["engine"] = {k: st.get(k) for k in ("handed_over", "handover_no_pages", "admitted_ahead", "admit_ahead_misses",
                                            "held_back_steps", "spec_dispatch_steps", "spec_dispatches")}
    res["tokens_sha1"] = hashlib.sha1(json.dumps([list(o.token_ids) for o in outs]).encode()).hexdigest()[:12]
    print(json.dumps(res, indent=1), flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main()
