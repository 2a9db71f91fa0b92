"""What a request costs beyond its decode steps at batch 1: `LLM.generate` over the same prompts at
two output lengths (EOS ignored), plain and speculative, on one machine. With T(L) the wall time of a
run and S(L) the decode steps it dispatched (fused steps for the speculative engine, past-the-end
ones included),

    T(L) = n * per_request + S(L) * per_step      (n prompts, queued: one runs at a time)

two lengths give both: per_step is what a longer output costs per step, per_request what admitting,
prefilling, starting and ending a request costs on top (host round trips, the prefill program, the
first dispatch's launch while the device waits). The share of per_request in the longer run is
what a batch-1 evaluation of that many prompts loses to request boundaries. A third run of one token
per request (the prefill alone, no decode dispatch) gives the part of per_request that is the prefill.

    python3 scripts/probe_request_overhead.py [--prompts 8] [--lengths 128,256] [--reps 2]
        [--draft DIR | --no-spec] [--no-plain] [--spec-steps-per-call 4] [--admit-ahead on|off|both]
        [--sets "mt_bench,sum" | "sum;mt_bench"] [--max-chars 1500 | 0]

--admit-ahead both times each engine with admission ahead (SchedulerOptions.admit_ahead, specjax.engine_ahead)
and without it, on the same compiled programs (the option is read every step): labels `plain` /
`plain-noahead`, `spec` / `spec-noahead`.

Prompts: halves of mt_bench and sum from specjax/assets/prompts (chat template applied), cut to 1 500
characters; `--sets "sum;mt_bench" --max-chars 0` probes the whole sum prompts (the eval's long ones) and
mt_bench's apart, on the same engines. Each length
runs twice untimed first (compilation, prefix-cache pages), then --reps timed runs; the fastest
counts. On the CPU the figures mean little (programs run inside their calls): run it on a GPU.
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
ASSETS = os.path.join(REPO, "specjax", "assets")


def prompt_ids(llm, n: int, sets=("mt_bench", "sum"), max_chars: int = 1500) -> list[list[int]]:
    """n prompts, an equal share from each set, each cut to max_chars characters (0: whole), chat template on."""
    texts = []
    for name in sets:
        with open(os.path.join(ASSETS, "prompts", f"{name}.jsonl")) as fh:
            texts += [json.loads(line)["turns"][0][: max_chars or None] for line in list(fh)[: -(-n // len(sets))]]
    chat = [llm.apply_chat_template([{"role": "user", "content": t}]) for t in texts[:n]]
    return [llm.tokenizer.encode(c, add_special_tokens=False) for c in chat]


def timed_run(llm, ids, tokens: int, reps: int) -> dict:
    """The fastest of reps runs: wall seconds, decode steps and dispatches, host dispatch seconds."""
    from specjax import SamplingParams
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    for _ in range(2):
        llm.generate(ids, params)
    llm.engine.background.wait()  # programs asked of the worker threads (the long rows' attention split
    best = None                   # cap sibling): compiled before timing, as `specjax eval` does
    for _ in range(reps):
        s0 = llm.engine.stats()
        t = time.perf_counter()
        outs = llm.generate(ids, params)
        wall = time.perf_counter() - t
        s1 = llm.engine.stats()
        kinds = [k[: -len("_dispatch_steps")] for k in s1 if k.endswith("_dispatch_steps")]
        run = dict(wall=wall, steps=sum(s1[f"{k}_dispatch_steps"] - s0[f"{k}_dispatch_steps"] for k in kinds),
                   dispatches=sum(s1[f"{k}_dispatches"] - s0[f"{k}_dispatches"] for k in kinds),
                   host_dispatch=s1["host_dispatch_s"] - s0["host_dispatch_s"],
                   admitted_ahead=s1["admitted_ahead"] - s0["admitted_ahead"],
                   admit_ahead_misses=s1["admit_ahead_misses"] - s0["admit_ahead_misses"],
                   tokens_sha=hashlib.sha256(json.dumps([o.token_ids for o in outs]).encode()).hexdigest()[:16])
        if best is None or run["wall"] < best["wall"]:
            best = run
    return best


def fit(n: int, short: dict, long: dict) -> tuple[float, float]:
    """(per_step, per_request) seconds from two runs of n requests (module doc)."""
    ds = long["steps"] - short["steps"]
    if ds <= 0:
        raise SystemExit("the longer run dispatched no more steps than the shorter: choose lengths further apart")
    per_step = (long["wall"] - short["wall"]) / ds
    return per_step, (long["wall"] - long["steps"] * per_step) / n


def probe(label: str, llm, ids, lengths: tuple[int, int], reps: int) -> dict:
    runs = {L: timed_run(llm, ids, L, reps) for L in lengths}
    for L, r in runs.items():
        print(f"{label} {L} tokens: {r['wall']:.4f} s, {r['steps']} steps in {r['dispatches']} dispatches, "
              f"{r['wall'] / r['steps'] * 1e6:.1f} us / step, host dispatch {r['host_dispatch'] / r['dispatches'] * 1e3:.3f} "
              f"ms / call, admitted ahead {r['admitted_ahead']} (misses {r['admit_ahead_misses']})", flush=True)
    per_step, per_req = fit(len(ids), runs[lengths[0]], runs[lengths[1]])
    share = len(ids) * per_req / runs[lengths[1]]["wall"]
    first = timed_run(llm, ids, 1, reps)  # the prefill alone: each request's first token, no decode dispatch
    print(f"{label}: per step {per_step * 1e6:.1f} us, per request {per_req * 1e3:.2f} ms "
          f"({100 * share:.1f} % of the {lengths[1]}-token run); a request of one token (its prefill) "
          f"{first['wall'] / len(ids) * 1e3:.2f} ms", flush=True)
    return dict(runs={str(L): r for L, r in runs.items()}, per_step_s=per_step, per_request_s=per_req, share=share,
                first_token_s=first["wall"] / len(ids))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--lengths", default="128,256", help="two output lengths, shorter first")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--draft", default=os.path.join(ASSETS, "eagle3-smollm2-135m"))
    ap.add_argument("--no-spec", action="store_true")
    ap.add_argument("--no-plain", action="store_true")
    ap.add_argument("--spec-steps-per-call", type=int, default=4)
    ap.add_argument("--admit-ahead", choices=("on", "off", "both"), default="on",
                    help="admission ahead on, off, or both in turn on the same engine")
    ap.add_argument("--sets", default="mt_bench,sum",
                    help="prompt sets of specjax/assets/prompts; 'a,b' mixes them, 'a;b' probes each on its own")
    ap.add_argument("--max-chars", type=int, default=1500, help="cut each prompt to this many characters (0: whole)")
    ap.add_argument("--json", help="write the figures here")
    a = ap.parse_args(argv)
    lengths = tuple(int(x) for x in a.lengths.split(","))
    if len(lengths) != 2 or not 0 < lengths[0] < lengths[1]:
        ap.error(f"--lengths wants two increasing lengths, got {a.lengths!r}")
    if a.prompts < 1:
        ap.error("--prompts must be >= 1")
    import jax

    from specjax import LLM
    print("device:", jax.devices()[0].device_kind, "jax", jax.__version__, flush=True)
    out = {}
    settings = {"on": (True,), "off": (False,), "both": (True, False)}[a.admit_ahead]

    groups = [tuple(g.split(",")) for g in a.sets.split(";")]

    def probe_settings(label, llm):
        for sets in groups:
            ids = prompt_ids(llm, a.prompts, sets, a.max_chars)
            print(f"{label}: {len(ids)} prompts of {'+'.join(sets)}, {sum(map(len, ids)) / len(ids):.0f} tokens "
                  "on average", flush=True)
            for ahead in settings:
                llm.engine.opts = dataclasses.replace(llm.engine.opts, admit_ahead=ahead)
                name = (label if ahead else f"{label}-noahead") + ("" if len(groups) == 1 else "-" + "+".join(sets))
                out[name] = probe(name, llm, ids, lengths, a.reps)
    if not a.no_plain:
        probe_settings("plain", LLM(max_batch=1))
    if not a.no_spec:
        probe_settings("spec", LLM(draft=a.draft, max_batch=1, speculate_below=None, min_accept=None,
                                   spec_steps_per_call=a.spec_steps_per_call))
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(out, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
