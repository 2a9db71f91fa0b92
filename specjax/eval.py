"""Acceptance and speed-up of speculative decoding over prompt sets (`specjax eval`).

For each prompt file (category = file stem; default: the six shipped sets in specjax/assets/prompts)
the same prompts run greedily with plain decoding and with speculative decoding, and both generate
the same number of tokens per prompt (max_tokens with EOS ignored; fewer only where the context
ends), so that their times compare equal work. The drafter: the EAGLE-3 head shipped for the default model
(--speculate head, the default), the n-gram drafter (--speculate ngram: prompt lookup, no weights)
or a draft directory (--draft).
  tau         mean acceptance length = tokens emitted per speculative step (incl. the bonus token),
              over all steps of the category; per-prompt values give its distribution
  tau to EOS  tau over the steps that produced each response up to its first EOS in the plain
              output (the timed runs go on past EOS; this is what a user stopping at EOS sees)
  acc@k       fraction of steps that accept >= k drafted tokens, k = 1 .. num_steps
  in draft vocab  (an EAGLE-3 head with its own smaller vocabulary) share of the plain output's tokens
              that the head can propose at all; every other token ends a step's accepted run
  tok/s       generated tokens / wall time around generate (after a warm-up that compiles every
              prompt-length bucket and the decode programs), plain and speculative; speed-up = ratio;
              with --repeats N each set's timed runs repeat N times (alternating) and add up; the JSON
              also keeps each repeat's seconds and the speculative engine's counters over it (RUN_STATS)
  identical   prompts whose speculative output equals the plain output (greedy is lossless; bf16
              numerics of a verify step can differ from a decode step's in rare near-ties)
Optionally (--hf-baseline), HF transformers on the same prompt ids, the same number of new tokens
(EOS ignored) and the same machine (torch; GPU when available), loading the model from its GGUF
file: greedy `generate`, and prompt-lookup decoding (`generate(prompt_lookup_num_tokens=K,
max_matching_ngram_size=n)`), the peer of the n-gram drafter (specjax.eval_hf).
A CPU run of the defaults takes hours: `--quick` is a short one (a warning says so).
Outputs: a markdown table (stdout and --markdown), a PNG (tau per category + speed-up bars; both
specjax.eval_report), --json.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from specjax import eval_hf, eval_report
from specjax.assets import PROMPT_SETS as DEFAULT_SETS, PROMPTS_DIR  # the shipped prompt sets

MAX_TOKENS = 256
QUICK_LIMIT, QUICK_TOKENS = 3, 32  # --quick: prompts per set, new tokens per prompt
CPU_TOKENS_PER_S = 10.0  # rough decode rate of the default model on a CPU, for the size warning
CPU_WARN_TOKENS = 5000  # warn on a CPU above this many generated tokens


def load_sets(files: list[str] | None = None, limit: int | None = None) -> dict[str, list[str]]:
    """{category: prompts}: the first turn of each line ("turns"/"prompt"/"question")."""
    from specjax.train.data import read_prompts
    if not files:
        files = [str(PROMPTS_DIR / f"{s}.jsonl") for s in DEFAULT_SETS if (PROMPTS_DIR / f"{s}.jsonl").is_file()]
        if not files:
            raise FileNotFoundError(f"no prompt files in {PROMPTS_DIR}; pass --prompts")
    sets: dict[str, list[str]] = {}
    for f in files:
        name = Path(f).name.split(".")[0]
        prompts = read_prompts(f, allow_eval=True)
        if not prompts:
            raise ValueError(f"{f}: no prompts (lines need \"turns\", \"prompt\" or \"question\")")
        sets[name] = prompts[:limit] if limit else prompts
    return sets


def _run(llm, prompts, params):
    """generate, keeping each request's accepted lengths -> [(RequestOutput, [n per step])]."""
    make = getattr(llm, "_requests", None)
    reqs = make(prompts, params) if make else [llm._request(p, params, i) for i, p in enumerate(prompts)]
    llm.engine.run(reqs)
    return [(r.output(), list(r.accept_lens)) for r in reqs]


# the speculative engine's counters reported for each timed repeat (Engine.stats(); `spec_runs` of a set)
RUN_STATS = ("spec_dispatch_steps", "prefill_tokens", "prefix_cache_hits", "prefix_cache_hit_tokens",
             "prefix_cache_evictions", "catch_ups", "catch_up_tokens", "num_preempted", "admitted_ahead",
             "admitted_early", "admit_ahead_misses", "held_back_steps", "handed_over", "handover_no_pages",
             "host_read_s", "host_dispatch_s", "host_step_s")


def _ids(llm, texts, chat: bool) -> list[list[int]]:
    out = []
    for t in texts:
        text = llm.apply_chat_template([{"role": "user", "content": t}]) if chat else t
        out.append(llm.tokenizer.encode(text, add_special_tokens=False))
    return out


def response_steps(accept: list[int], tokens: list[int], eos: tuple[int, ...]) -> int:
    """Speculative steps that produced the response up to its first EOS (tokens: the plain output;
    the prefill emits the first token, step i emits accept[i]); all steps when there is no EOS."""
    end = next((i + 1 for i, t in enumerate(tokens) if t in eos), len(tokens))
    done = 1
    for i, a in enumerate(accept):
        if done >= end:
            return i
        done += a
    return len(accept)


def acceptance(accepts: list[list[int]], num_steps: int) -> dict:
    """tau and acc@1..num_steps over every step of the given requests (n = drafts accepted + 1)."""
    steps = [a for acc in accepts for a in acc]
    if not steps:
        return {"tau": float("nan"), "spec_steps": 0, "acc": [float("nan")] * num_steps}
    return {"tau": sum(steps) / len(steps), "spec_steps": len(steps),
            "acc": [sum(a - 1 >= k for a in steps) / len(steps) for k in range(1, num_steps + 1)]}


def draft_vocab_ids(draft, method: str, target_cfg):
    """Target ids a draft can propose: an EAGLE-3 head's own (smaller) vocabulary; None: every id."""
    if method != "eagle3":
        return None
    import numpy as np

    from specjax.checkpoint import load_draft_flat
    flat, ecfg, _ = load_draft_flat(draft, target_cfg)
    if ecfg.draft_vocab_size >= target_cfg.vocab_size:
        return None
    return frozenset((np.asarray(flat["d2t"], np.int64) + np.arange(ecfg.draft_vocab_size)).tolist())


def stalls(cat: dict) -> str:
    """A note on the executables a category's timed runs added (each one stalled its run), or ''."""
    n = cat["new_programs_plain"], cat["new_programs_spec"]
    return f" (new programs while timed: plain {n[0]}, spec {n[1]})" if any(n) else ""


BOUNDARY_STATS = ("admitted_ahead", "admitted_early", "admit_ahead_misses", "held_back_steps", "handed_over",
                  "handover_no_pages")  # Engine.stats() keys


def run_eval(sets: dict[str, list[str]], *, model=None, draft: str, num_steps: int | None = None,
             topk: int | None = None,
             num_draft_tokens: int | None = None, ngram_max: int = 4, ngram_min: int = 1,
             ngram_branch: int | None = None,
             max_batch: int = 1,
             max_tokens: int = MAX_TOKENS, dtype: str = "auto", max_seq_len: int = 2048,
             chat: bool | None = None, warmup_tokens: int = 8, min_accept="auto", draft_topk: str = "auto",
             attention: str = "auto", repeats: int = 1, handover: bool | None = None, unread: int | None = None,
             spec_steps_per_call: int | None = None, log=print) -> dict:
    """Plain vs speculative greedy decoding per category, the same tokens per prompt (EOS ignored)
    -> summary dict (see module doc). draft: a draft directory, "self" or "ngram"; min_accept: the
    speculative LLM's acceptance gate (LLM(min_accept=...), specjax.adaptive); draft_topk: its draft
    tree's top-k (LLM(draft_topk=...)); attention: both LLMs' paged attention (LLM(attention=...)).
    repeats: timed runs of each set per engine, alternating plain and speculative; seconds, tokens and
    step counts add up over them, τ and the outputs are the last run's (greedy: the same tokens).
    handover: the speculative engine's row hand-over (SchedulerOptions.handover, specjax.engine_handover;
    None: the engine's default, on at max_batch 1); unread: its decode dispatches left unread after a step
    (SchedulerOptions.unread; None: the default, 2 with hand-over at one row). The settings record what ran.
    spec_steps_per_call: its fused steps per dispatch (LLM(spec_steps_per_call=...); None: the default)."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    import dataclasses

    from specjax import LLM, SamplingParams
    from specjax.llm import draft_method
    from specjax.tree import SpecConfig

    t0 = time.perf_counter()
    method = draft_method(draft)
    spec_cfg = None  # no tree flags: the LLM's default (the draft's spec_defaults for max_batch, else a chain of 4)
    if method == "ngram" or (num_steps, topk, num_draft_tokens) != (None, None, None):
        spec_cfg = SpecConfig(method=method, num_steps=num_steps or 4, topk=topk or 1,
                              num_draft_tokens=num_draft_tokens, ngram_max=ngram_max, ngram_min=ngram_min,
                              ngram_branch=ngram_branch or 0)
    elif ngram_branch is not None:  # the draft's spec_defaults with this branch (0: without theirs)
        from specjax.llm import default_spec
        spec_cfg = default_spec(draft, method, max_batch, ngram_branch=ngram_branch, ngram_max=ngram_max,
                                ngram_min=ngram_min)
    plain = LLM(model, dtype=dtype, max_batch=max_batch, max_seq_len=max_seq_len, attention=attention)
    from specjax.scheduler import SchedulerOptions
    spec = LLM(model, dtype=dtype, max_batch=max_batch, max_seq_len=max_seq_len, draft=draft, spec=spec_cfg,
               min_accept=min_accept, draft_topk=draft_topk, attention=attention,
               scheduler=SchedulerOptions(handover=handover, unread=unread),
               **({} if spec_steps_per_call is None else {"spec_steps_per_call": spec_steps_per_call}))
    spec_cfg = spec.spec
    num_steps, topk = spec_cfg.num_steps, spec_cfg.topk
    vocab = draft_vocab_ids(draft, method, plain.cfg)
    chat = bool(plain.tokenizer.chat_template) if chat is None else chat
    ids = {c: [p for p in _ids(plain, ps, chat) if len(p) + 1 < max_seq_len] for c, ps in sets.items()}
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)  # equal work
    log(f"[eval] models loaded in {time.perf_counter() - t0:.1f}s; warming up")
    t1 = time.perf_counter()
    every = [p for ps in ids.values() for p in ps]
    # full-length warm-up runs, each alone: the first prompt, and the longest, whose long contexts need
    # programs of their own (specjax.attention.split_cap: a sibling compiled once a row nears SHORT_CONTEXT)
    longest = max(every, key=len, default=None)
    full = [every[:1]] + ([[longest]] if longest is not None and longest is not every[0] else [])
    short = SamplingParams(max_tokens=warmup_tokens, temperature=0.0, ignore_eos=True)
    for llm in (plain, spec):  # compile every prefill bucket and the decode programs; the second pass
        _run(llm, every, short)  # compiles the prefill buckets of prefix-cache hits, which the timed
        _run(llm, every, short)  # runs below get (the warm-up computed those prompts' pages)
        for one in full:
            _run(llm, one, params)
    gate = spec.engine.batch_opts.min_accept
    if gate is not None:  # the lite programs the gate switches to: forced on once (every bucket of K)
        spec.engine.batch_opts = dataclasses.replace(spec.engine.batch_opts, min_accept=float("inf"))
        _run(spec, every, short)
        for one in full:
            _run(spec, one, params)
        spec.engine.batch_opts = dataclasses.replace(spec.engine.batch_opts, min_accept=gate)
    for llm in (plain, spec):  # programs the warm-up asked of the engines' worker threads (a sibling
        llm.engine.background.wait()  # attention split cap, adaptive steps): compiled before the timed runs
    log(f"[eval] warm-up {time.perf_counter() - t1:.1f}s")
    eos = plain.eos_ids
    cats = {}
    for c, ps in ids.items():
        pc0, st0 = plain.engine.stats()["compiled_programs"], spec.engine.stats()
        runs_p, runs_s, stats_s = [], [], []
        for _ in range(repeats):  # a set's timed run lasts ~1 s on a GPU: one host stall moves it by 10 %
            t = time.perf_counter()
            res_p = _run(plain, ps, params)
            runs_p.append(time.perf_counter() - t)
            b = spec.engine.stats()
            t = time.perf_counter()
            res_s = _run(spec, ps, params)
            runs_s.append(time.perf_counter() - t)
            a = spec.engine.stats()
            stats_s.append({k: round(a[k] - b[k], 4) for k in RUN_STATS})
        tp, ts = sum(runs_p), sum(runs_s)
        for llm in (plain, spec):  # programs the timed runs asked of the worker threads: counted below
            llm.engine.background.wait()  # (untimed; they stalled nothing, but the warm-up missed them)
        pc1, st1 = plain.engine.stats()["compiled_programs"], spec.engine.stats()
        steps = {k: st1[f"{k}_dispatch_steps"] - st0[f"{k}_dispatch_steps"] for k in ("spec", "lite", "lazy")}
        ok = [i for i, ((op, _), (os_, _)) in enumerate(zip(res_p, res_s))
              if op.finish_reason != "error" and os_.finish_reason != "error"]
        n_p = repeats * sum(len(res_p[i][0].token_ids) for i in ok)
        n_s = repeats * sum(len(res_s[i][0].token_ids) for i in ok)
        acc = [res_s[i][1] for i in ok]
        upto = [acc[j][: response_steps(acc[j], res_p[i][0].token_ids, eos)] for j, i in enumerate(ok)]
        cats[c] = {"prompts": len(ok), "tokens_plain": n_p, "tokens_spec": n_s,
                   "seconds_plain": round(tp, 4), "seconds_spec": round(ts, 4),
                   "seconds_plain_runs": [round(x, 4) for x in runs_p],  # each repeat's timed run
                   "seconds_spec_runs": [round(x, 4) for x in runs_s],
                   "spec_runs": stats_s,  # the speculative engine's counters over each repeat (RUN_STATS)
                   "tok_s_plain": n_p / tp if tp > 0 else 0.0, "tok_s_spec": n_s / ts if ts > 0 else 0.0,
                   **acceptance(acc, num_steps), "tau_to_eos": acceptance(upto, num_steps)["tau"],
                   "steps_to_eos": sum(map(len, upto)),
                   "tau_per_prompt": [sum(a) / len(a) for a in acc if a],
                   "identical": sum(res_p[i][0].token_ids == res_s[i][0].token_ids for i in ok),
                   "fused_steps": steps["spec"], "lite_steps": steps["lite"] + steps["lazy"],
                   "gate_probes": st1["gate_probes"] - st0["gate_probes"],
                   # request boundaries of the speculative run (specjax.engine_ahead, Engine._hold_back):
                   # slots given to the next request ahead, of those rows not finished (re-admitted), and
                   # steps that dispatched nothing because the steps in flight were expected to finish
                   **{k: st1[k] - st0[k] for k in BOUNDARY_STATS},
                   # executables added during the timed runs (compiled, or loaded from the persistent
                   # cache): each one stalls its run; 0 when the warm-up covered every program
                   "new_programs_plain": pc1 - pc0,
                   "new_programs_spec": st1["compiled_programs"] - st0["compiled_programs"]}
        cats[c]["speedup"] = cats[c]["tok_s_spec"] / cats[c]["tok_s_plain"] if cats[c]["tok_s_plain"] else 0.0
        if vocab is not None:  # the target's tokens the head could have proposed at all
            cats[c]["in_draft_vocab"] = sum(t in vocab for i in ok for t in res_p[i][0].token_ids)
        log(f"[eval] {c}: tau {cats[c]['tau']:.3f} (to EOS {cats[c]['tau_to_eos']:.3f}), plain "
            f"{cats[c]['tok_s_plain']:.1f} tok/s, spec {cats[c]['tok_s_spec']:.1f} tok/s, speed-up "
            f"{cats[c]['speedup']:.2f}x" + stalls(cats[c]))
    tot = {k: sum(v[k] for v in cats.values()) for k in ("prompts", "tokens_plain", "tokens_spec", "seconds_plain",
                                                       "seconds_spec", "spec_steps", "steps_to_eos", "identical",
                                                       "fused_steps", "lite_steps", "gate_probes",
                                                       "new_programs_plain", "new_programs_spec",
                                                       *BOUNDARY_STATS)}
    if vocab is not None:
        tot["in_draft_vocab"] = sum(v["in_draft_vocab"] for v in cats.values())

    def weighted(key, by):
        return sum(v[key] * v[by] for v in cats.values() if v[by]) / max(tot[by], 1)
    tot["tau"] = weighted("tau", "spec_steps")
    tot["tau_to_eos"] = weighted("tau_to_eos", "steps_to_eos")
    tot["acc"] = [sum(v["acc"][k] * v["spec_steps"] for v in cats.values() if v["spec_steps"]) / max(tot["spec_steps"], 1)
                  for k in range(num_steps)]
    tot["tok_s_plain"] = tot["tokens_plain"] / tot["seconds_plain"] if tot["seconds_plain"] else 0.0
    tot["tok_s_spec"] = tot["tokens_spec"] / tot["seconds_spec"] if tot["seconds_spec"] else 0.0
    tot["speedup"] = tot["tok_s_spec"] / tot["tok_s_plain"] if tot["tok_s_plain"] else 0.0
    import jax
    settings = {"model": str(plain.model_dir), "draft": str(draft), "method": spec_cfg.method,
                "num_steps": num_steps, "topk": topk, "num_draft_tokens": spec_cfg.num_draft_tokens,
                "max_batch": max_batch, "max_tokens": max_tokens, "ignore_eos": True, "dtype": plain.dtype, "chat": chat,
                "repeats": repeats, "handover": spec.engine.handover, "unread": spec.engine.opts.unread,
                "spec_steps_per_call": spec.engine.batch_opts.spec_steps_per_call,
                "device": str(jax.devices()[0].device_kind), "backend": jax.default_backend(), "min_accept": gate,
                "draft_vocab_size": None if vocab is None else len(vocab),
                "attention_plain": plain.engine.attention_choice["attention"],
                "attention_spec": spec.engine.attention_choice["attention"]}
    if spec_cfg.method == "ngram" or spec_cfg.ngram_branch:
        settings.update(ngram_max=ngram_max, ngram_min=ngram_min, ngram_branch=spec_cfg.ngram_branch)
    return {"settings": settings, "categories": cats, "overall": tot, "prompt_ids": ids}


def add_arguments(p: argparse.ArgumentParser) -> None:
    from specjax.cli import DRAFT_TOPK_CHOICES, HelpFormatter, min_accept_arg, positive_int
    from specjax.machine import ATTENTION_CHOICES, DTYPE_CHOICES
    p.formatter_class = HelpFormatter  # --help shows the defaults (also for scripts/eval_acceptance.py)
    p.add_argument("--model", default=None, help="converted model dir (default: SmolLM2-135M-Instruct)")
    p.add_argument("--speculate", choices=("head", "ngram"), default=None,
                   help="drafter: 'head' the EAGLE-3 head shipped for the default model, 'ngram' drafts copied "
                   "from the prompt and output so far (prompt lookup, no weights) (default: head, unless --draft)")
    p.add_argument("--draft", default=None,
                   help="a draft directory instead (EAGLE head, draft model), or 'self' / 'ngram'")
    p.add_argument("--prompts", nargs="+", default=None,
                   help="jsonl prompt files, one category each (default: the six shipped sets)")
    p.add_argument("--quick", action="store_true",
                   help=f"a short run: the first {QUICK_LIMIT} prompts of each set, {QUICK_TOKENS} new tokens each")
    p.add_argument("--limit", type=int, default=None,
                   help=f"first N prompts of each file (default: all; {QUICK_LIMIT} with --quick)")
    p.add_argument("--max-tokens", type=int, default=None,
                   help=f"new tokens per prompt, the same for plain and speculative decoding (EOS ignored) "
                   f"(default: {MAX_TOKENS}; {QUICK_TOKENS} with --quick)")
    p.add_argument("--max-batch", type=int, default=1, help="requests decoded together")
    p.add_argument("--num-steps", type=int, default=None,
                   help="tokens drafted per step (tree depth; default: the draft's spec_defaults, else 4)")
    p.add_argument("--topk", type=int, default=None, help="draft tree branching (1 = chain; default: the draft's "
                   "spec_defaults, else 1)")
    p.add_argument("--num-draft-tokens", type=int, default=None,
                   help="draft tree size (default: num_steps for a chain, num_steps * topk for a tree)")
    p.add_argument("--ngram-max", type=int, default=4, help="n-gram drafter: longest suffix matched")
    p.add_argument("--ngram-min", type=int, default=1, help="n-gram drafter: shortest suffix matched")
    p.add_argument("--ngram-branch", type=int, default=None, metavar="L",
                   help="a model draft's tree: L nodes of the request's best n-gram continuation under the root "
                        "(SpecConfig.ngram_branch; default: the draft's spec_defaults without tree flags, else 0; "
                        "0 turns a default branch off)")
    p.add_argument("--min-accept", type=min_accept_arg, default="auto", metavar="TAU",
                   help="acceptance gate of the speculative runs: plain (lite) steps while the measured tokens "
                   "per fused step stay below TAU ('none': always fused steps; default: the n-gram drafter's "
                   "break-even, or the draft's spec_defaults)")
    p.add_argument("--draft-topk", choices=DRAFT_TOPK_CHOICES, default="auto",
                   help="the draft tree's per-level top-k (auto: one variadic reduction on GPU, lax.top_k elsewhere)")
    p.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto",
                   help="compute dtype; auto: float32 on the CPU, bfloat16 on GPUs and TPUs")
    p.add_argument("--max-seq-len", type=int, default=2048, help="context length")
    p.add_argument("--attention", default="auto", choices=ATTENTION_CHOICES,
                   help="paged attention of both engines (as `specjax generate --attention`)")
    p.add_argument("--warmup-tokens", type=int, default=8, help="tokens per prompt of the compiling warm-up")
    p.add_argument("--repeats", type=int, default=1,
                   help="timed runs of each set per engine, alternating (seconds, tokens and steps add up; "
                   "a set's run is short on a GPU, so repeats steady the tokens/s)")
    p.add_argument("--handover", action=argparse.BooleanOptionalAction, default=None,
                   help="the speculative engine hands a fused dispatch's row over to the next request, prefilled "
                        "ahead into a spare slot, once its request ends (SchedulerOptions.handover; default: "
                        "on at --max-batch 1)")
    p.add_argument("--unread", type=positive_int, default=None, metavar="N",
                   help="the speculative engine's decode dispatches left unread after a step: 1 reads one "
                        "behind, 2 two behind (SchedulerOptions.unread; default: 2 with hand-over at --max-batch 1, else 1)")
    p.add_argument("--spec-steps-per-call", type=positive_int, default=None, metavar="K",
                   help="fused speculative steps per dispatch of the speculative engine (default: the engine's, "
                        "as `specjax generate --spec-steps-per-call`)")
    p.add_argument("--raw", action="store_true", help="no chat template")
    p.add_argument("--json", help="write the summary as JSON")
    p.add_argument("--markdown", help="write the table as markdown")
    p.add_argument("--png", help="write the plot (τ distribution, speed-up)")
    p.add_argument("--hf-baseline", action="store_true",
                   help="also time HF transformers on the same prompts and tokens: greedy generate and "
                   "prompt-lookup decoding")
    p.add_argument("--hf-lookup-tokens", type=int, default=10,
                   help="HF prompt lookup: prompt_lookup_num_tokens (0: no prompt-lookup run)")
    p.add_argument("--hf-lookup-ngram", type=int, default=2, help="HF prompt lookup: max_matching_ngram_size")
    p.add_argument("--gguf", default=None, help="GGUF file for --hf-baseline (default: the default model's)")
    p.add_argument("--hf-device", default="auto", help="torch device of --hf-baseline (auto: cuda if available)")


def resolve(a) -> None:
    """Fill the defaults that depend on other options: the draft (--speculate / --draft), --quick's
    limit and tokens. Raises ValueError for contradicting options."""
    if a.draft is not None and a.speculate is not None:
        raise ValueError("give --speculate or --draft, not both")
    if a.speculate == "ngram":
        a.draft = "ngram"
    elif a.draft is None:
        if a.model is not None:
            raise ValueError("the shipped EAGLE-3 head (--speculate head) is for the default model; with --model "
                             "give --draft DIR or --speculate ngram")
        from specjax.assets import DEFAULT_HEAD_DIR
        a.draft = str(DEFAULT_HEAD_DIR)
    if a.limit is None and a.quick:
        a.limit = QUICK_LIMIT
    if a.max_tokens is None:
        a.max_tokens = QUICK_TOKENS if a.quick else MAX_TOKENS
    if a.repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {a.repeats}")


def size_warning(sets: dict[str, list[str]], max_tokens: int, backend: str, hf: bool = False) -> str | None:
    """A warning when the run is long for a CPU (None on accelerators or for small runs)."""
    prompts = sum(map(len, sets.values()))
    tokens = prompts * max_tokens * (4 if hf else 2)  # plain + speculative (+ HF plain + lookup)
    if backend != "cpu" or tokens <= CPU_WARN_TOKENS:
        return None
    minutes = tokens / CPU_TOKENS_PER_S / 60
    return (f"[eval] warning: this runs on the CPU: {prompts} prompts x {max_tokens} tokens, plain and speculative"
            f"{' and HF' if hf else ''} ({tokens} generated tokens) take about {minutes:.0f} min at ~"
            f"{CPU_TOKENS_PER_S:.0f} tokens/s; --quick runs {QUICK_LIMIT} prompts per set with {QUICK_TOKENS} "
            "tokens (or pass --limit / --max-tokens)")


def cmd_eval(a) -> int:
    resolve(a)
    if a.hf_baseline:  # fail before the long run
        _gguf(a)
    sets = load_sets(a.prompts, a.limit)

    def log(m):
        print(m, file=sys.stderr, flush=True)
    import jax
    warning = size_warning(sets, a.max_tokens, jax.default_backend(), a.hf_baseline)
    if warning:
        log(warning)
    summary = run_eval(sets, model=a.model, draft=a.draft, num_steps=a.num_steps, topk=a.topk,
                       num_draft_tokens=a.num_draft_tokens, ngram_max=a.ngram_max, ngram_min=a.ngram_min,
                       ngram_branch=a.ngram_branch, max_batch=a.max_batch, max_tokens=a.max_tokens, dtype=a.dtype,
                       max_seq_len=a.max_seq_len,
                       chat=False if a.raw else None, warmup_tokens=a.warmup_tokens, min_accept=a.min_accept,
                       draft_topk=a.draft_topk, attention=a.attention, repeats=a.repeats, handover=a.handover,
                       unread=a.unread,
                       spec_steps_per_call=a.spec_steps_per_call, log=log)
    ids = summary.pop("prompt_ids")
    if a.hf_baseline:
        hf = summary["hf"] = eval_hf.hf_baseline(_gguf(a), ids, a.max_tokens, a.hf_device, a.hf_lookup_tokens,
                                         a.hf_lookup_ngram, log)
        o = summary["overall"]
        o["speedup_vs_hf"] = o["tok_s_spec"] / max(hf["overall"]["tok_s"], 1e-9)
        o["plain_vs_hf"] = o["tok_s_plain"] / max(hf["overall"]["tok_s"], 1e-9)
        if "tok_s_lookup" in hf["overall"]:
            o["speedup_vs_hf_lookup"] = o["tok_s_spec"] / max(hf["overall"]["tok_s_lookup"], 1e-9)
    table = eval_report.markdown(summary)
    print(table)
    if a.markdown:
        Path(a.markdown).write_text(table)
    if a.json:
        Path(a.json).write_text(json.dumps(summary, indent=2) + "\n")
    if a.png:
        try:
            eval_report.plot(summary, a.png)
        except ImportError:
            print("specjax eval: matplotlib is not installed: no PNG", file=sys.stderr)
    return 0


def _gguf(a) -> Path:
    if a.gguf:
        path = Path(a.gguf)
    else:
        from specjax.default_model import CACHE_DIR, GGUF_NAME
        path = CACHE_DIR / GGUF_NAME
    if not path.is_file():
        raise FileNotFoundError(f"--hf-baseline needs the model's GGUF file: {path} does not exist (pass --gguf)")
    return path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="eval_acceptance", description=__doc__.split("\n")[0])
    add_arguments(p)
    return cmd_eval(p.parse_args(argv))
