"""End-to-end `LLM.generate` throughput, plain vs speculative, by batch size (what a user's script gets).

For each batch B: B x --requests-per-slot prompts (MT-bench-like chat messages built in this script),
`max_tokens` new tokens each with EOS ignored (equal work), `max_batch` = B. With one request per slot
(the default) the batch is closed: every row waits for the slowest one (with speculation, the row of
lowest acceptance); more requests than slots measure a continuous batch, whose slots are refilled
as requests finish (the workload of a server or an offline eval). Call 1 compiles; calls 2 and 3 are timed
and the number of XLA compilations during each is counted (a second identical call must compile
nothing). Reports tokens/s of the timed calls, mean accepted tokens per speculative step (tau), and
spec / plain, and the speculative engine's decode dispatches of the last timed call by kind (fused
speculative "spec" / "lite": plain steps that keep the draft in sync, for batches of
>= --speculate-below rows; specjax.dispatch_plan).

    python3 scripts/bench_generate.py --batch 1,8,32,64 --max-tokens 128
    python3 scripts/bench_generate.py --batch 1,8,32,64 --max-tokens 128 --no-plain --speculate-below 8
    python3 scripts/bench_generate.py --batch 8,32,64 --max-tokens 128 --requests-per-slot 4
    python3 scripts/bench_generate.py --batch 1 --prompts 16 --max-tokens 128 --attention cudnn  # tau over 16 texts
    python3 scripts/bench_generate.py --batch 1 --max-batch 32 --prompts 8 --sequential [--spec-tiers]  # a server's lull
    python3 scripts/bench_generate.py --batch 512 --max-tokens 256 --temperature 0.7 --no-spec --profile 25
    python3 scripts/bench_generate.py --model DIR --draft self --dtype float32 --batch 2 --max-tokens 16  # CPU smoke

--profile N prints the N functions with the most host time (cProfile) during the last timed call.
"""
from __future__ import annotations

import argparse
import cProfile
import dataclasses
import json
import pstats
import sys
import time
from pathlib import Path

import jax
import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from specjax import LLM, SamplingParams  # noqa: E402
from specjax.cli import speculate_below_arg  # noqa: E402
from specjax.spec_tiers import describe  # noqa: E402

SUBJECTS = ["a city at night", "the history of bread", "how vaccines work", "a letter to a friend",
            "sorting algorithms", "the water cycle", "a job interview", "renewable energy", "a short mystery",
            "learning a language", "black holes", "a recipe for soup", "time management", "the stock market",
            "a travel plan for Japan", "photosynthesis"]
FORMS = ["Write a short essay about {}.", "Explain {} to a ten-year-old.", "Give five tips related to {}.",
         "Write a poem about {}.", "Describe {} in detail, step by step."]

_compiles = [0]


def _on_event(name, *args, **kw):
    if name == "/jax/core/compile/backend_compile_duration":
        _compiles[0] += 1


jax.monitoring.register_event_duration_secs_listener(_on_event)


def prompt_texts(n: int) -> list[str]:
    """The benchmark's n user messages (also what scripts/mosaic_numerics.py runs)."""
    return [FORMS[i % len(FORMS)].format(SUBJECTS[(i // len(FORMS) + i) % len(SUBJECTS)]) for i in range(n)]


def prompts(llm, n: int) -> list[list[int]]:
    return [llm.tokenizer.encode(llm.apply_chat_template([{"role": "user", "content": text}]), add_special_tokens=False)
            for text in prompt_texts(n)]


KINDS = ("spec", "lite", "lazy", "decode")


def timed(llm, ids, params, profile: int = 0, sequential: bool = False):
    c0 = _compiles[0]
    st0 = llm.stats()
    prof = cProfile.Profile() if profile else None
    t = time.perf_counter()
    if prof:
        prof.enable()
    if sequential:  # one request at a time: a batch of one in an engine of max_batch slots
        outs = [o for i, p in zip(ids, params) for o in llm.generate([i], [p])]
    else:
        outs = llm.generate(ids, params)
    if prof:
        prof.disable()
    s = time.perf_counter() - t
    n = sum(len(o.token_ids) for o in outs)
    if prof:
        pstats.Stats(prof).sort_stats("tottime").print_stats(profile)
    st = llm.stats()
    counts = {f"{k}_{w}": st[f"{k}_{w}"] - st0[f"{k}_{w}"] for k in KINDS for w in ("dispatches", "dispatch_steps")}
    counts.update({k: st[k] - st0[k] for k in ("tier_switches", "regrown_trees")})
    return dict(seconds=s, tokens=n, tok_s=n / s, compiles=_compiles[0] - c0, **counts), outs


def run(llm, B, a, spec: bool):
    n = a.prompts or B * a.requests_per_slot
    ids = prompts(llm, n)
    params = [SamplingParams(max_tokens=a.max_tokens, temperature=a.temperature, ignore_eos=True, seed=i)
              for i in range(n)]
    c0 = _compiles[0]
    t = time.perf_counter()
    timed(llm, ids, params, sequential=a.sequential)
    first = dict(seconds=time.perf_counter() - t, compiles=_compiles[0] - c0)
    second, _ = timed(llm, ids, params, sequential=a.sequential)
    third, outs = timed(llm, ids, params, a.profile, a.sequential)
    tau = None
    if spec:
        means = [o.accept_len_mean for o in outs if o.accept_len_mean is not None]
        tau = float(np.mean(means)) if means else None
    return dict(batch=B, max_batch=llm.max_batch, sequential=a.sequential, requests=len(ids),
                kind="spec" if spec else "plain", first_s=round(first["seconds"], 2),
                first_compiles=first["compiles"], second_compiles=second["compiles"],
                third_compiles=third["compiles"], tok_s=round(max(second["tok_s"], third["tok_s"]), 1),
                tok_s_second=round(second["tok_s"], 1), tok_s_third=round(third["tok_s"], 1), tau=tau,
                speculate_below=llm.engine.batch_opts.speculate_below if spec else None,
                attention=llm.engine.attention_choice["attention"],
                tiers=None if not spec or llm.spec_tiers is None else describe(llm.spec_tiers),
                tree=None if not spec else f"{llm.spec.num_steps}/{llm.spec.topk}/{llm.spec.num_draft_tokens}",
                **{k: v for k, v in third.items() if k.endswith(("_dispatches", "_dispatch_steps", "tier_switches",
                                                                 "regrown_trees"))})


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--draft", default=None, help="default: the shipped head of the default model (self with --model)")
    p.add_argument("--batch", default="1,8,32,64")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--max-seq-len", type=int, default=1024)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--prompts", type=int, default=None,
                   help="prompts per call (default: the batch size x --requests-per-slot); more than the batch: slots are refilled. "
                   "tau at batch 1 is one prompt's: greedy texts part on near-ties of the logits when the "
                   "attention's rounding changes, and one text's tau moves by 1 or more (docs/benchmarks.md)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--no-spec", action="store_true")
    p.add_argument("--no-plain", action="store_true")
    p.add_argument("--spec-steps-per-call", type=int, default=None)
    p.add_argument("--synced-lite", action="store_true",
                   help="lite steps keep an EAGLE head's draft in sync (BatchOptions.lazy_draft off; default: "
                   "plain decoding's program, the draft caught up when the batch shrinks: specjax.lazy_draft)")
    p.add_argument("--attention", default="auto", help="paged-attention implementation (specjax.attention)")
    p.add_argument("--speculate-below", type=speculate_below_arg, default="auto",
                   help="lite steps (plain, the draft kept in sync) for batches of >= N rows; 'none': always "
                   "speculate; auto: the draft's measured spec_defaults")
    p.add_argument("--profile", type=int, default=0, help="print the N functions with the most host time")
    p.add_argument("--requests-per-slot", type=int, default=1,
                   help="requests per engine slot (1: a closed batch; more: slots refilled as requests finish)")
    p.add_argument("--json", default=None, help="append rows as JSON lines")
    p.add_argument("--max-batch", type=int, default=None, help="the engine's slots (default: the batch)")
    p.add_argument("--sequential", action="store_true",
                   help="one request at a time (a batch of one in an engine of --max-batch slots)")
    p.add_argument("--spec-tiers", action="store_true",
                   help="tree shapes by the running batch (LLM(spec_tiers=True); default: the draft's tree for "
                   "--max-batch at every batch)")
    a = p.parse_args(argv)
    if a.requests_per_slot < 1:
        p.error(f"--requests-per-slot must be >= 1, got {a.requests_per_slot}")
    from specjax.assets import DEFAULT_HEAD_DIR
    draft = a.draft or (str(DEFAULT_HEAD_DIR) if a.model is None else "self")
    batches = [int(b) for b in a.batch.split(",")]
    print(f"device: {jax.devices()[0].device_kind}; draft {draft}", flush=True)
    rows = []
    for B in batches:
        pair = {}
        for spec in ([] if a.no_plain else [False]) + ([] if a.no_spec else [True]):
            mb = a.max_batch or B
            llm = LLM(a.model, dtype=a.dtype, max_batch=mb, max_seq_len=a.max_seq_len, draft=draft if spec else None,
                      speculate_below=a.speculate_below if spec else "auto", attention=a.attention,
                      spec_tiers=spec and a.spec_tiers)
            if spec and a.spec_steps_per_call is not None:
                llm.engine.batch_opts = dataclasses.replace(llm.engine.batch_opts,
                                                            spec_steps_per_call=a.spec_steps_per_call)
            if spec and a.synced_lite:
                llm.engine.batch_opts = dataclasses.replace(llm.engine.batch_opts, lazy_draft=False)
            r = run(llm, B, a, spec)
            pair[r["kind"]] = r
            rows.append(r)
            print(json.dumps(r), flush=True)
            del llm
        if len(pair) == 2:
            pair["spec"]["spec_over_plain"] = round(pair["spec"]["tok_s"] / pair["plain"]["tok_s"], 3)
    if a.json:
        with open(a.json, "a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    print(f"\n{'B':>4} {'kind':6} {'tok/s':>9} {'tau':>5} {'spec/plain':>10} {'compiles 1/2/3':>15} {'first s':>8} "
          f"{'dispatches spec/lite/lazy/decode':>33}")
    for r in rows:
        tau = f"{r['tau']:.2f}" if r["tau"] else "-"
        ratio = f"{r['spec_over_plain']:.2f}" if "spec_over_plain" in r else "-"
        disp = "/".join(str(r[f"{k}_dispatches"]) for k in KINDS)
        print(f"{r['batch']:>4} {r['kind']:6} {r['tok_s']:>9.1f} {tau:>5} {ratio:>10} "
              f"{r['first_compiles']:>5}/{r['second_compiles']}/{r['third_compiles']:<5} {r['first_s']:>8.2f} "
              f"{disp:>33}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
