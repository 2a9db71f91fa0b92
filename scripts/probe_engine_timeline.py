"""Where the engine's wall time goes between a batch-1 request's tokens, GPU machine (runs anywhere).

    python3 scripts/probe_engine_timeline.py --model DIR [--draft DIR] [--prompts 8] [--max-tokens 128] [--show 40]
                                             [--handover] [--trace]

Runs `LLM.generate` (one slot unless --max-batch, greedy, EOS ignored) twice over the same prompts and
records, for every `Engine.step()` of the second call: when it started, how long it took, its host phases
(read = waiting for a dispatch's outputs, dispatch, accept, ...; specjax.host_timing), what it dispatched
(prefills, decode dispatches by kind) and how many requests finished in it; and the gap to the next step()
(the caller's loop: LLM.generate's own work). Prints the first --show steps as a table and one JSON line of
totals: wall, time in read waits, in dispatch calls, in the rest of step(), between steps; the same split
for the steps that start or end a request (its prefill, its last read) and for the others.

Reading it: while the host waits in `read` the device is busy, and so it may be during `dispatch`: on an
H200 a fused dispatch's call blocks while earlier work fills the device's launch queue (its time falls when
the read before it waited longer), so a loop whose steps take the device time of their dispatches is
device-bound even with little read time (docs/benchmarks.md, session 34). --trace adds the device's idle
gaps from a jax.profiler trace, but the tracer's own cost per launch inflates the loop (2x there).
"""
from __future__ import annotations

import argparse
import contextlib
import glob
import hashlib
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specjax.host_timing import PHASES  # noqa: E402


class Timeline:
    """Wraps an engine's step() and _prefill() and records one row per step()."""

    def __init__(self, eng):
        self.rows, self.on = [], False
        self._prefills = 0
        step, prefill = eng.step, eng._prefill

        def timed_prefill(pieces):
            self._prefills += 1
            return prefill(pieces)

        def timed_step():
            if not self.on:
                return step()
            h, d = dict(eng.host.seconds), dict(eng.dispatches)
            p0, t0 = self._prefills, time.perf_counter()
            ups = step()
            t1 = time.perf_counter()
            row = {"t": t0, "dur": t1 - t0, "prefills": self._prefills - p0,
                   "finished": sum(u.request.finished for u in ups),
                   **{k: eng.host.seconds[k] - h[k] for k in PHASES},
                   "kinds": {k: eng.dispatches[k] - d.get(k, 0) for k in eng.dispatches if eng.dispatches[k] - d.get(k, 0)}}
            self.rows.append(row)
            return ups

        eng.step, eng._prefill = timed_step, timed_prefill


def summarize(rows: list[dict]) -> dict:
    """Totals over the recorded steps (seconds); 'boundary' = steps with a prefill or a finished request."""
    if not rows:
        return {}
    gaps = [b["t"] - (a["t"] + a["dur"]) for a, b in zip(rows, rows[1:])] + [0.0]
    out = {"steps": len(rows), "wall_s": rows[-1]["t"] + rows[-1]["dur"] - rows[0]["t"],
           "finished": sum(r["finished"] for r in rows)}
    for name, pick in (("all", lambda r: True), ("boundary", lambda r: r["prefills"] or r["finished"]),
                       ("inner", lambda r: not (r["prefills"] or r["finished"]))):
        sel = [(r, g) for r, g in zip(rows, gaps) if pick(r)]
        out[name] = {"steps": len(sel), "step_s": sum(r["dur"] for r, _ in sel),
                     "read_wait_s": sum(r["read"] for r, _ in sel), "dispatch_s": sum(r["dispatch"] for r, _ in sel),
                     "accept_s": sum(r["accept"] for r, _ in sel), "between_steps_s": sum(g for _, g in sel),
                     "decode_dispatches": sum(sum(r["kinds"].values()) for r, _ in sel),
                     "prefills": sum(r["prefills"] for r, _ in sel)}
        o = out[name]
        o["other_s"] = o["step_s"] - o["read_wait_s"] - o["dispatch_s"] - o["accept_s"]
    return {k: ({kk: round(vv, 6) if isinstance(vv, float) else vv for kk, vv in v.items()}
                if isinstance(v, dict) else (round(v, 6) if isinstance(v, float) else v)) for k, v in out.items()}


def kernel_intervals(trace_dir: str) -> list[tuple[int, int, str]]:
    """(start ns, end ns, program) of every kernel on the device planes of a jax.profiler trace."""
    from jax.profiler import ProfileData
    files = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
    if not files:
        raise SystemExit(f"no xplane.pb under {trace_dir}")
    out = []
    for plane in ProfileData.from_file(files[0]).planes:
        if not plane.name.startswith("/device:"):
            continue
        for line in plane.lines:
            for e in line.events:
                st = dict(e.stats)
                if "hlo_op" in st:
                    mod = re.sub(r"\(\d+\)$", "", str(st.get("hlo_module", "")))
                    out.append((int(e.start_ns), int(e.start_ns + e.duration_ns), mod))
    return sorted(out)


def device_gaps(iv: list[tuple[int, int, str]], top: int = 8) -> dict:
    """Busy time (union of kernel intervals), span, and the idle gaps between kernels (ms), summed by the
    programs of the kernels before and after each gap (gaps under 20 us are counted only in the total)."""
    if not iv:
        return {"kernels": 0}
    busy, gaps, by = 0, [], {}
    s0, e0, m0 = iv[0]
    for s, e, m in iv[1:]:
        if s > e0:
            busy += e0 - s0
            gaps.append((s - e0, m0, m))
            s0, e0 = s, e
        else:
            e0 = max(e0, e)
        m0 = m
    busy += e0 - s0
    for g, a, b in gaps:
        if g >= 20_000:
            k = f"{a} -> {b}"
            n, t = by.get(k, (0, 0))
            by[k] = (n + 1, t + g)
    return {"kernels": len(iv), "span_ms": round((iv[-1][1] - iv[0][0]) / 1e6, 3), "busy_ms": round(busy / 1e6, 3),
            "idle_ms": round(sum(g for g, _, _ in gaps) / 1e6, 3),
            "idle_ms_in_gaps_over_20us": round(sum(g for g, _, _ in gaps if g >= 20_000) / 1e6, 3),
            "gaps_over_20us_by_programs": {k: {"n": n, "ms": round(t / 1e6, 3)}
                                           for k, (n, t) in sorted(by.items(), key=lambda kv: -kv[1][1])[:top]}}


def table(rows: list[dict], show: int) -> str:
    lines = ["  t_ms  step_ms  read  disp  acc  gap_ms  prefill finished kinds"]
    t0 = rows[0]["t"] if rows else 0.0
    for i, r in enumerate(rows[:show]):
        gap = rows[i + 1]["t"] - (r["t"] + r["dur"]) if i + 1 < len(rows) else 0.0
        lines.append(f"{1e3 * (r['t'] - t0):7.2f} {1e3 * r['dur']:6.2f} {1e3 * r['read']:5.2f} {1e3 * r['dispatch']:5.2f} "
                     f"{1e3 * r['accept']:4.2f} {1e3 * gap:6.2f}   {r['prefills']}       {r['finished']}      "
                     f"{','.join(f'{k}:{v}' for k, v in r['kinds'].items())}")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--draft", default=None, help="a head dir (default: the shipped one); 'none': plain decoding")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--max-batch", type=int, default=1, help="engine slots (the prompts run max-batch at a time)")
    p.add_argument("--show", type=int, default=40, help="steps printed as a table")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--unread", type=int, default=1, help="SchedulerOptions(unread=N): decode dispatches the "
                   "host leaves unread after a step (default 1)")
    p.add_argument("--handover", action="store_true", help="SchedulerOptions(handover=True) (row hand-over: "
                   "specjax.engine_handover)")
    p.add_argument("--trace", action="store_true", help="also trace the timed call (jax.profiler) and report the "
                   "device's idle gaps between kernels, summed by the programs on either side")
    p.add_argument("--repeat", type=int, default=1, help="timed calls (the table and totals: the last one; "
                   "every call's wall time: repeat_wall_s)")
    p.add_argument("--lock", default=None, help="a file to hold (flock) for the timed call, so that probes "
                   "compile side by side on one machine and time one at a time")
    p.add_argument("--ready", default=None, metavar="DIR:N", help="after compiling, wait until N probes have "
                   "compiled (each leaves a file in DIR), so that no compile runs beside a timed call")
    a = p.parse_args(argv)
    import jax

    from specjax.llm import LLM
    from specjax.sampling_params import SamplingParams
    from specjax.scheduler import SchedulerOptions

    draft = a.draft or str(Path(__file__).resolve().parents[1] / "specjax/assets/eagle3-smollm2-135m")
    llm = LLM(model=a.model, draft=None if draft == "none" else draft, dtype=a.dtype,
              max_batch=a.max_batch, scheduler=SchedulerOptions(handover=a.handover, unread=a.unread))
    sp = SamplingParams(max_tokens=a.max_tokens, temperature=0.0, ignore_eos=True)
    prompts = [f"Write a short note number {i} about the weather, the sea and the mountains." for i in range(a.prompts)]
    tl = Timeline(llm.engine)
    llm.generate(prompts, sp)
    if a.ready:
        d, n = a.ready.rsplit(":", 1)
        Path(d).mkdir(parents=True, exist_ok=True)
        (Path(d) / str(os.getpid())).touch()
        while len(list(Path(d).iterdir())) < int(n):
            time.sleep(0.5)
    lock = open(a.lock, "a") if a.lock else None
    if lock is not None:
        import fcntl
        fcntl.flock(lock, fcntl.LOCK_EX)
    walls = []
    for _ in range(a.repeat):
        tl.rows = []
        tl.on = True
        tdir = tempfile.mkdtemp(prefix="specjax_timeline_") if a.trace else None
        t = time.perf_counter()
        with (jax.profiler.trace(tdir) if a.trace else contextlib.nullcontext()):
            outs = llm.generate(prompts, sp)
        walls.append(round(time.perf_counter() - t, 4))
        tl.on = False
    if lock is not None:
        lock.close()
    print(table(tl.rows, a.show))
    res = summarize(tl.rows)
    res["repeat_wall_s"] = walls
    res["kernels"] = str(llm.engine.kernels)
    res["tokens_sha1"] = hashlib.sha1(json.dumps([list(o.token_ids) for o in outs]).encode()).hexdigest()[:12]
    if a.trace:
        res["device"] = device_gaps(kernel_intervals(tdir))
    print(json.dumps(res), flush=True)
    return res


if __name__ == "__main__":
    main()
