"""Engine host-loop benchmark (GPU): the host bubble and the cost of grammar constraints.

For each batch size and scenario (speculative decoding with the fused step, async or sync loop;
grammars on with the overlap on or off; optionally plain decoding) it runs the traffic once to
compile, then again measuring, in that one run:

  wall ms/step    mean wall time of engine.step() over the steady state (every row running)
  device ms/step  time the device was busy during those steps: each program call is timed on the
                  host when it returns (enqueued) and a thread blocks on its first output to time
                  its completion; programs run in order, so program i keeps the device busy from
                  max(done[i-1], enqueued[i]) to done[i]
  bubble          1 - device / wall over the steady steps: the share of wall time the device waits
                  for the host (reported as measured, not clamped). On the CPU a program runs
                  (partly) inside its dispatch call, so these two figures mean something on GPUs only.
  tok/s           tokens delivered per second over the steady state (and over the whole run)
  host ms/step    the engine's own host time by phase over the steady steps (Engine.stats(), host_*_s):
                  read (waiting for / converting outputs), accept (tokens to requests and matchers),
                  masks (grammar masks), drafts (grammar drafts), dispatch (enqueueing programs,
                  with the copies of their numpy inputs: the masks' upload);
                  "other" is the rest of the step (scheduling, page tables). Read includes the wait
                  for the device: where the host is ahead, that is where it waits.

Grammars: "any" is a permissive regex (every token allowed, the tokens equal the unconstrained
run's, so the difference is pure overhead: mask computation, upload, split programs); "json" is a
nested JSON schema (real masks; acceptance differs from free text): on the host grammar path with
grammar drafts (the text the schema fixes drafted by the host: specjax.grammar_drafts) and without
("no-drafts"), and on the device DFA ("json dfa": the schema's regex, specjax.json_schema_regex;
the draft drafts under the DFA masks, an EAGLE-3 head (the default here) over its own vocabulary
(draft_tree.draft_vocab_view; since 2026-11-26, unmasked before); same tokens as the host path). Plain
decoding with a grammar runs one token per step (forward | sample, the masks computed while the
forward runs; "no-overlap": masks first). Goals checked: bubble <= 2% for the unconstrained async
scenarios and <= 5% with grammars (overlap); the permissive regex >= 0.95x the unconstrained
tokens/s, speculative and plain, on the host grammar path ("any") and on the device DFA
("any dfa": SchedulerOptions(device_dfa=True), the default; no host work per token); JSON tau
(accepted tokens per step) >= 0.8x the unconstrained tau; plain decoding under the JSON schema on
the device DFA >= 0.95x the unconstrained tokens/s, and speculative decoding under it >= 1.0x plain
unconstrained decoding (issue 15), its tau >= 0.8x too.

    python scripts/bench_engine.py                      # SmolLM2 with its shipped EAGLE-3 head
    python scripts/bench_engine.py --draft self --batch 1,32 --max-tokens 256 --json out.jsonl
    python scripts/bench_engine.py --model DIR --draft self --dtype float32 --batch 2 --max-tokens 24 \
        --scenarios "spec fused,plain"                  # a CPU smoke run on a small model
    python scripts/bench_engine.py --dtype float32 --batch 1 --max-tokens 48 --no-plain \
        --scenarios "spec fused,spec json overlap,spec json no-drafts"   # tau with / without grammar drafts
    python scripts/bench_engine.py --batch 1,8,32 --scenarios "spec fused,plain" --speculate-below 8

--speculate-below N: the speculative engine runs lite steps (plain decoding that keeps the draft in
sync, specjax.dispatch_plan) for batches of >= N rows (default: always fused steps, the draft's
measurements ignored); each row reports the measured run's decode dispatches by kind.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import queue
import sys
import threading
import time
from pathlib import Path

import jax
import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from specjax import LLM, SamplingParams  # noqa: E402
from specjax.cli import speculate_below_arg  # noqa: E402
from specjax.scheduler import SchedulerOptions  # noqa: E402

JSON_SCHEMA = {
    "type": "object",
    "properties": {"title": {"type": "string"}, "year": {"type": "integer", "minimum": 1900, "maximum": 2100},
                   "genre": {"enum": ["drama", "comedy", "horror", "documentary"]},
                   "cast": {"type": "array", "items": {"type": "object", "properties": {
                       "name": {"type": "string"}, "role": {"type": "string"}}, "required": ["name", "role"]}},
                   "summary": {"type": "string"}},
    "required": ["title", "year", "genre", "cast", "summary"],
}
GRAMMARS = {None: {}, "any": {"regex": r"[\s\S]*"}, "json": {"json_schema": JSON_SCHEMA}}
TOPICS = ["a lighthouse keeper", "a robot chef", "a lost city", "the first moon base", "a chess prodigy",
          "a haunted library", "a desert caravan", "an ocean research ship"]
ASYNC, SYNC = SchedulerOptions(), SchedulerOptions(async_loop=False)
HOST = SchedulerOptions(device_dfa=False)  # regexes / schemas on the host grammar path (xgrammar), as before DFAs
NO_OVERLAP = SchedulerOptions(overlap=False, device_dfa=False)
NO_DRAFTS = SchedulerOptions(grammar_drafts=False, device_dfa=False)  # host path, the trees the draft's alone
#                                                                      (specjax.grammar_drafts)
PHASES = ("read", "accept", "masks", "drafts", "dispatch")


def prompts_for(llm, n):
    return [llm.apply_chat_template([{"role": "user", "content": f"Describe a film about {TOPICS[i % len(TOPICS)]} "
                                      f"(#{i}) in detail: title, year, genre, cast and a long summary."}])
            for i in range(n)]


class DeviceTimeline:
    """When each program the engine dispatches is enqueued and when it completes, in the run itself.
    Wraps the engine's program callables; a thread blocks on each program's first output (programs
    complete in dispatch order) and stamps its completion. The interpreter's switch interval is
    shortened while attached, so that the stamping thread gets the GIL within ~10 us of waking."""

    def __init__(self, eng):
        self.eng, self.enqueued, self.done = eng, [], []
        self._q: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._wait, daemon=True)
        self._saved = {}

    def _wait(self):
        while (item := self._q.get()) is not None:
            i, x = item
            jax.block_until_ready(x)
            self.done[i] = time.perf_counter()

    def _timed(self, fn):
        def call(*args, **kw):
            res = fn(*args, **kw)
            self.enqueued.append(time.perf_counter())
            self.done.append(None)
            self._q.put((len(self.done) - 1, jax.tree.leaves(res[0])[0]))  # outputs / verified: never donated
            return res
        return call

    def __enter__(self):
        for attr in ("steps", "spec_steps"):
            progs = getattr(self.eng, attr, None)
            if progs is not None:
                self._saved[attr] = progs
                setattr(self.eng, attr, progs._replace(**{f: self._timed(getattr(progs, f)) for f in progs._fields}))
        self._interval = sys.getswitchinterval()
        sys.setswitchinterval(1e-5)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._q.put(None)
        self._thread.join()
        sys.setswitchinterval(self._interval)
        for attr, progs in self._saved.items():
            setattr(self.eng, attr, progs)

    def busy_within(self, a: float, b: float) -> float:
        """Seconds the device was busy between host times a and b: program i is busy from
        max(done[i-1], enqueued[i]) to done[i]."""
        total, prev = 0.0, float("-inf")
        for enq, done in zip(self.enqueued, self.done):
            start, prev = max(prev, enq), done
            total += max(0.0, min(done, b) - max(start, a))
        return total


def scenario(llm, name, prompts, grammar, sched, max_tokens):
    eng = llm.engine
    eng.opts = sched
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, **GRAMMARS[grammar])
    B = len(prompts)
    llm.generate(prompts, params)  # compile everything this traffic needs
    # measured run: per-step wall times and the device time of the programs each step dispatched;
    # the steady state is where every row runs
    reqs = llm._requests(prompts, params)
    for r in reqs:
        eng.add_request(r)
    st0 = eng.stats()
    spans, toks, full, progs, host = [], [], [], [], [dict(eng.host.seconds)]
    with DeviceTimeline(eng) as tl:
        t_all = time.perf_counter()
        while eng.has_unfinished():
            n0 = len(tl.enqueued)
            t = time.perf_counter()
            ups = eng.step()
            spans.append((t, time.perf_counter()))
            host.append(dict(eng.host.seconds))  # cumulative host seconds by phase after each step
            progs.append(len(tl.enqueued) - n0)
            toks.append(sum(len(u.token_ids) for u in ups))
            full.append(sum(r is not None for r in eng.slots) == B)
        run_s = time.perf_counter() - t_all
    st = eng.stats()
    kinds = {f"{k}_dispatches": st[f"{k}_dispatches"] - st0[f"{k}_dispatches"] for k in ("spec", "lite", "decode")}
    steady = [i for i in range(2, len(spans)) if full[i] and full[i - 1]]
    wall_s = sum(spans[i][1] - spans[i][0] for i in steady)
    dev_s = sum(tl.busy_within(*spans[i]) for i in steady)  # device busy during the steady steps
    n = len(steady)
    taus = [np.mean(r.accept_lens) for r in reqs if r.accept_lens]
    phase_ms = {p: sum(host[i + 1][p] - host[i][p] for i in steady) / n * 1e3 if n else float("nan") for p in PHASES}
    phase_ms["other"] = wall_s / n * 1e3 - sum(phase_ms.values()) if n else float("nan")
    return dict(name=name, batch=B, grammar=grammar or "none", async_loop=sched.async_loop, overlap=sched.overlap,
                steady_steps=n, wall_ms=wall_s / n * 1e3 if n else float("nan"),
                device_ms=dev_s / n * 1e3 if n else float("nan"), bubble=1 - dev_s / wall_s if n else float("nan"),
                programs_per_step=sum(progs[i] for i in steady) / n if n else float("nan"),
                tok_s=sum(toks[i] for i in steady) / wall_s if n else float("nan"), tok_s_run=sum(toks) / run_s,
                tokens_per_step=sum(toks[i] for i in steady) / max(1, n),
                accept_len_mean=float(np.mean(taus)) if taus else float("nan"),
                finished_stop=sum(r.finish_reason == "stop" for r in reqs), **kinds,
                dfa_rows=sum(r.constraint_path == "device_dfa" for r in reqs),  # rows on the device DFA
                **{f"host_{p}_ms": v for p, v in phase_ms.items()})


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="converted model dir (default: SmolLM2-135M-Instruct)")
    p.add_argument("--draft", default=None, help="draft dir or 'self' (default: the EAGLE-3 head shipped for the "
                   "default model; self with --model)")
    p.add_argument("--num-steps", type=int, default=4)
    p.add_argument("--topk", type=int, default=1)
    p.add_argument("--num-draft-tokens", type=int, default=None)
    p.add_argument("--ngram-branch", type=int, default=0, help="n-gram nodes added to the tree (SpecConfig.ngram_branch)")
    p.add_argument("--batch", default="1,32")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--max-seq-len", type=int, default=1024)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--scenarios", default=None, help="comma-separated scenario names to run (default: all)")
    p.add_argument("--no-plain", action="store_true", help="skip the plain-decoding rows")
    p.add_argument("--json", help="append the rows as JSON lines to this file")
    p.add_argument("--attention", default="auto", help="paged-attention implementation (specjax.attention)")
    p.add_argument("--speculate-below", type=speculate_below_arg, default=None,
                   help="lite steps for batches of >= N rows (default: always fused steps; 'auto': the draft's "
                   "measured spec_defaults)")
    p.add_argument("--spec-steps-per-call", default=None,
                   help="comma list K: run the unconstrained speculative scenarios once per K (fused steps per dispatch)")
    a = p.parse_args(argv)
    from specjax.llm import draft_method
    from specjax.tree import SpecConfig
    from specjax.assets import DEFAULT_HEAD_DIR
    draft = a.draft or (str(DEFAULT_HEAD_DIR) if a.model is None else "self")
    spec = SpecConfig(method=draft_method(draft), num_steps=a.num_steps, topk=a.topk,
                      num_draft_tokens=a.num_draft_tokens, ngram_branch=a.ngram_branch)
    batches = [int(b) for b in a.batch.split(",")]
    rows = []
    print(f"device: {jax.devices()[0].device_kind}; draft: {draft} ({spec})", flush=True)
    if jax.default_backend() == "cpu":
        print("note: on the CPU a program runs (partly) inside its dispatch call, which counts as host time: "
              "device time and bubble are not meaningful here (GPU figures only)", flush=True)
    llm = LLM(a.model, dtype=a.dtype, max_batch=max(batches), max_seq_len=a.max_seq_len, draft=draft, spec=spec,
              attention=a.attention, speculate_below=a.speculate_below)
    plans = [("spec fused", None, ASYNC), ("spec fused sync", None, SYNC), ("spec any overlap", "any", HOST),
             ("spec any no-overlap", "any", NO_OVERLAP), ("spec any dfa", "any", ASYNC),
             ("spec json overlap", "json", HOST), ("spec json no-drafts", "json", NO_DRAFTS),
             ("spec json no-overlap", "json", NO_OVERLAP), ("spec json dfa", "json", ASYNC)]
    plain = [("plain", None, ASYNC), ("plain any", "any", HOST), ("plain any no-overlap", "any", NO_OVERLAP),
             ("plain any dfa", "any", ASYNC),
             ("plain json", "json", HOST), ("plain json dfa", "json", ASYNC)]
    if a.scenarios:
        wanted = a.scenarios.split(",")
        unknown = set(wanted) - {n for n, _, _ in plans + plain}
        if unknown:
            p.error(f"--scenarios: unknown {sorted(unknown)}; choose from {[n for n, _, _ in plans + plain]}")
        plans, plain = [x for x in plans if x[0] in wanted], [x for x in plain if x[0] in wanted]
    ks = [int(k) for k in a.spec_steps_per_call.split(",")] if a.spec_steps_per_call else [None]
    base_opts = llm.engine.batch_opts
    for B in batches:
        for name, grammar, sched in plans:
            for K in (ks if grammar is None else [None]):
                if K is not None:
                    llm.engine.batch_opts = dataclasses.replace(base_opts, spec_steps_per_call=K)
                rows.append(scenario(llm, name if K is None else f"{name} K={K}", prompts_for(llm, B), grammar,
                                     sched, a.max_tokens))
                llm.engine.batch_opts = base_opts
                print(json.dumps(rows[-1]), flush=True)
    if not a.no_plain and plain:
        llm = LLM(a.model, dtype=a.dtype, max_batch=max(batches), max_seq_len=a.max_seq_len)
        for B in batches:
            for name, grammar, sched in plain:
                rows.append(scenario(llm, name, prompts_for(llm, B), grammar, sched, a.max_tokens))
                print(json.dumps(rows[-1]), flush=True)
    if a.json:
        with open(a.json, "a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")

    print(f"\n{'scenario':22} {'B':>3} {'wall ms':>8} {'dev ms':>8} {'bubble':>7} {'tok/s':>9} {'tok/step':>8} "
          f"{'tau':>5} {'steps':>5} {'spec/lite/decode':>17}")
    for r in rows:
        disp = "/".join(str(r[f"{k}_dispatches"]) for k in ("spec", "lite", "decode"))
        print(f"{r['name']:22} {r['batch']:>3} {r['wall_ms']:>8.3f} {r['device_ms']:>8.3f} {100 * r['bubble']:>6.1f}% "
              f"{r['tok_s']:>9.1f} {r['tokens_per_step']:>8.2f} {r['accept_len_mean']:>5.2f} {r['steady_steps']:>5} "
              f"{disp:>17}")
    cols = PHASES + ("other",)
    print(f"\nhost ms per steady step, by phase\n{'scenario':22} {'B':>3} " + " ".join(f"{c:>8}" for c in cols))
    for r in rows:
        print(f"{r['name']:22} {r['batch']:>3} " + " ".join(f"{r[f'host_{c}_ms']:>8.3f}" for c in cols))
    ok = True
    for B in batches:
        by = {r["name"]: r for r in rows if r["batch"] == B}
        for name, limit in (("spec fused", 0.02), ("plain", 0.02), ("spec any overlap", 0.05),
                            ("spec json overlap", 0.05), ("plain any", 0.05), ("plain json", 0.05)):
            if name not in by:
                continue
            b = by[name]["bubble"]
            good = b <= limit  # NaN (no steady step) fails
            ok &= good
            print(f"goal B={B} {name}: bubble {100 * b:.1f}% <= {100 * limit:.0f}%: {'PASS' if good else 'FAIL'}")
        for name, base in (("spec any overlap", "spec fused"), ("plain any", "plain"), ("spec any dfa", "spec fused"),
                           ("plain any dfa", "plain"), ("plain json dfa", "plain")):
            if name not in by or base not in by:
                continue
            ratio = by[name]["tok_s"] / by[base]["tok_s"]
            good = ratio >= 0.95
            ok &= good
            print(f"goal B={B} {name}: {ratio:.3f}x unconstrained ({base}) tok/s >= 0.95x: {'PASS' if good else 'FAIL'}")
        if "spec json dfa" in by and "plain" in by:  # issue 15: a schema-constrained request at full speed
            ratio = by["spec json dfa"]["tok_s"] / by["plain"]["tok_s"]
            good = ratio >= 1.0 and by["spec json dfa"]["dfa_rows"] == B  # (no row fell back to the host)
            ok &= good
            host = by.get("spec json overlap", {}).get("tok_s", float("nan")) / by["plain"]["tok_s"]
            print(f"goal B={B} spec json dfa: {ratio:.3f}x plain unconstrained tok/s >= 1.0x (host path: "
                  f"{host:.3f}x): {'PASS' if good else 'FAIL'}")
        for name in ("spec json overlap", "spec json dfa"):  # acceptance under the schema, same head and prompts
            if name not in by or "spec fused" not in by:
                continue
            tau, free = by[name]["accept_len_mean"], by["spec fused"]["accept_len_mean"]
            good = tau >= 0.8 * free
            ok &= good
            without = by.get("spec json no-drafts", {}).get("accept_len_mean", float("nan"))
            print(f"goal B={B} {name}: tau {tau:.2f} = {tau / free:.2f}x unconstrained tau {free:.2f} >= 0.8x"
                  + (f" (without grammar drafts: {without:.2f})" if name == "spec json overlap" else "")
                  + f": {'PASS' if good else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
