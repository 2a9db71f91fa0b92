"""Host cost of the engine's fused dispatches, and whether XLA kept their step loop, GPU machine.

    python3 scripts/probe_fused_call.py --model DIR [--draft DIR] [--steps-per-call 4] [--prompts 8] [--max-tokens 128]

Runs `LLM.generate` (batch 1, greedy, EOS ignored) twice over the same prompts and reports, for the
second call: wall µs per fused step, the engine's host dispatch time per decode call (Engine.stats'
dispatch phase, which also holds the call's prefill dispatches, one per request: the figure is an upper
bound), and,
from XLA's optimized HLO of the fused program (dumped to a temporary directory before jax starts),
how many while loops it has and how many kernels (fusions, custom calls) its entry computation and its
loop bodies launch. Run it under different XLA_FLAGS (e.g. --xla_gpu_enable_while_loop_unrolling=...)
to compare; the flags in effect are printed. One JSON line.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path

DUMP = None
if __name__ == "__main__":  # before jax starts
    DUMP = tempfile.mkdtemp(prefix="specjax_fused_hlo_")
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={DUMP} --xla_dump_hlo_as_text").strip()
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

_COMP = re.compile(r"^(ENTRY )?%?([\w.\-]+) .*\{$")
_LAUNCH = re.compile(r"= \S.*? (fusion|custom-call|copy)\(")
_WHILE = re.compile(r"while\(.*body=%?([\w.\-]+)")


def hlo_summary(text: str) -> dict:
    """While loops of an optimized HLO module and the kernels launched by its entry and loop bodies."""
    comps, cur, entry = {}, None, None
    for line in text.splitlines():
        m = _COMP.match(line)
        if m:
            cur = m.group(2)
            comps[cur] = []
            if m.group(1):
                entry = cur
        elif line.startswith("}"):
            cur = None
        elif cur is not None:
            comps[cur].append(line)
    bodies = [m.group(1) for lines in comps.values() for ln in lines for m in [_WHILE.search(ln)] if m]
    count = {name: sum(bool(_LAUNCH.search(ln)) for ln in lines) for name, lines in comps.items()}
    return {"while_loops": len(bodies), "entry_kernels": count.get(entry, 0),
            "body_kernels": [count.get(b, 0) for b in bodies]}


def main():
    import jax

    from specjax.llm import LLM
    from specjax.sampling_params import SamplingParams

    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--draft", default=None, help="a head dir (default: the shipped one)")
    p.add_argument("--steps-per-call", type=int, default=None)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--lock", default=None, help="a file to hold (flock) for the timed call, so that probes under "
                   "several XLA_FLAGS compile side by side on one machine and time one at a time")
    a = p.parse_args()
    draft = a.draft or str(Path(__file__).resolve().parents[1] / "specjax/assets/eagle3-smollm2-135m")
    kw = {} if a.steps_per_call is None else {"spec_steps_per_call": a.steps_per_call}
    llm = LLM(model=a.model, draft=draft, dtype="bfloat16", max_batch=1, **kw)
    sp = SamplingParams(max_tokens=a.max_tokens, temperature=0.0, ignore_eos=True)
    prompts = [f"Write a short note number {i} about the weather, the sea and the mountains." for i in range(a.prompts)]
    llm.generate(prompts, sp)
    eng = llm.engine
    lock = open(a.lock, "a") if a.lock else None
    if lock is not None:
        import fcntl
        fcntl.flock(lock, fcntl.LOCK_EX)
    s0 = dict(eng.stats())
    t = time.perf_counter()
    llm.generate(prompts, sp)
    wall = time.perf_counter() - t
    s1 = eng.stats()
    if lock is not None:
        lock.close()
    d = {k: s1[k] - s0.get(k, 0) for k in s1 if isinstance(s1[k], (int, float)) and not isinstance(s1[k], bool)}
    calls = sum(v for k, v in d.items() if k.endswith("_dispatches") and k != "gated_dispatches")
    steps = d.get("spec_dispatch_steps", 0)
    res = {"xla_flags": os.environ.get("XLA_FLAGS", "").replace(f"--xla_dump_to={DUMP}", "").strip(),
           "device": str(jax.devices()[0].device_kind), "wall_s": round(wall, 4), "fused_steps": steps,
           "decode_calls": calls, "us_per_fused_step": round(1e6 * wall / max(steps, 1), 1),
           "host_dispatch_ms_per_decode_call_incl_prefills": round(1e3 * d.get("host_dispatch_s", 0) / max(calls, 1), 3),
           "host_read_ms_per_decode_call": round(1e3 * d.get("host_read_s", 0) / max(calls, 1), 3)}
    files = sorted(glob.glob(os.path.join(DUMP, "*jit_fused*after_optimizations.txt")))
    texts = {f: Path(f).read_text() for f in files}
    res["fused_modules"] = [dict(file=os.path.basename(f)[:60], command_buffer_lines=t.count("command_buffer"),
                                 **hlo_summary(t)) for f, t in texts.items()]
    print(json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
