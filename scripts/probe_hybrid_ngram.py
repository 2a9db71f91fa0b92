"""Would an n-gram branch in the head's tree pay? An estimate from one speculative run (CPU or GPU).

Runs the shipped head (or --draft DIR) with a tree over some prompt sets, keeps each step's
accepted length a_i and where it started (output position p_i = 1 + a_0 + ... + a_{i-1}), and asks
specjax.ngram (the n-gram drafter's own lookup, best candidate) what it would have proposed from
prompt + output[:p_i]: m_i = how many of its first L tokens the output then has. A branch of L
n-gram nodes under the root would have emitted at least max(a_i, m_i + 1) tokens at that step. The
estimate keeps the run's step positions (a longer step would move the later ones) and ignores the
verify cost of the extra nodes: it says where a hybrid tree could gain, not what it would run at.
--measure runs the tree with each branch length L <= num_steps for real (SpecConfig.ngram_branch)
and reports its τ beside the estimate (the same prompts and settings; greedy float32 outputs are
plain decoding's either way).

    python3 scripts/probe_hybrid_ngram.py --prompts ../shared/data/prompts/{sum,qa,humaneval,mt_bench}.jsonl \
        --limit 4 --max-tokens 96 --dtype float32 --branch 4,5,8
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def ngram_matches(prompt, out, accepts, lengths, cfg):
    """-> {L: [m_i per step]}: the leading tokens of specjax.ngram's best proposal (L tokens) at each
    step's context that the output goes on with."""
    import jax.numpy as jnp
    from specjax import ngram
    starts = np.cumsum([1] + list(accepts[:-1]))
    ctx = [prompt + out[:p] for p in starts]
    W = max(map(len, ctx))
    hist = np.zeros((len(ctx), W), np.int32)
    for i, c in enumerate(ctx):
        hist[i, :len(c)] = c
    H = jnp.asarray([len(c) for c in ctx], jnp.int32)
    best = ngram.candidates(jnp.asarray(hist), H, cfg)
    props = np.asarray(ngram.continuations(jnp.asarray(hist), H, best, max(lengths)))[:, 0]  # [steps, Lmax]
    got = {}
    for L in lengths:
        ms = []
        for prop, p in zip(props, starts):
            want = out[p: p + L]
            m = 0
            while m < len(want) and prop[m] == want[m]:
                m += 1
            ms.append(m)
        got[L] = ms
    return got


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", nargs="+", required=True, help="prompt sets (.jsonl, as specjax eval reads them)")
    p.add_argument("--limit", type=int, default=4, help="prompts per set")
    p.add_argument("--model", default=None)
    p.add_argument("--draft", default=None, help="head directory (default: the shipped head)")
    p.add_argument("--num-steps", type=int, default=5)
    p.add_argument("--topk", type=int, default=4)
    p.add_argument("--num-draft-tokens", type=int, default=20)
    p.add_argument("--branch", default="4,5,8", help="n-gram branch lengths L to estimate")
    p.add_argument("--ngram-max", type=int, default=4)
    p.add_argument("--ngram-min", type=int, default=1)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--max-batch", type=int, default=4)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--measure", action="store_true",
                   help="also run the tree with each branch length <= --num-steps (SpecConfig.ngram_branch)")
    p.add_argument("--json", help="write per-set figures (and every step) as JSON")
    a = p.parse_args(argv)
    from specjax import LLM, SamplingParams
    from specjax.assets import DEFAULT_HEAD_DIR
    from specjax.eval import _ids, _run, load_sets
    from specjax.tree import SpecConfig
    lengths = [int(x) for x in a.branch.split(",")]
    spec = SpecConfig(method="eagle3", num_steps=a.num_steps, topk=a.topk, num_draft_tokens=a.num_draft_tokens)
    llm = LLM(a.model, dtype=a.dtype, max_batch=a.max_batch, draft=a.draft or str(DEFAULT_HEAD_DIR), spec=spec,
              min_accept=None, speculate_below=None)
    ng_cfg = SpecConfig(method="ngram", num_steps=max(lengths), topk=1, ngram_max=a.ngram_max, ngram_min=a.ngram_min)
    params = SamplingParams(max_tokens=a.max_tokens, temperature=0.0, ignore_eos=True)
    rows, steps, texts_out, same = {}, {}, {}, [0, 0]
    t0 = time.perf_counter()
    for name, texts in load_sets(a.prompts, a.limit).items():
        ids = _ids(llm, texts, bool(llm.tokenizer.chat_template))
        steps[name] = []
        for prompt, (o, acc) in zip(ids, _run(llm, ids, params)):
            texts_out.setdefault(name, []).append(list(o.token_ids))
            ms = ngram_matches(prompt, list(o.token_ids), acc, lengths, ng_cfg)
            steps[name] += [{"eagle": e, **{f"m{L}": ms[L][i] for L in lengths}} for i, e in enumerate(acc)]
    real = {}  # (set, L) -> accepted lengths of the real hybrid run
    for L in (x for x in lengths if a.measure and x <= a.num_steps):
        hy = LLM(a.model, dtype=a.dtype, max_batch=a.max_batch, draft=a.draft or str(DEFAULT_HEAD_DIR),
                 spec=dataclasses.replace(spec, ngram_branch=L), min_accept=None, speculate_below=None)
        for name, texts in load_sets(a.prompts, a.limit).items():
            ids = _ids(hy, texts, bool(hy.tokenizer.chat_template))
            res = _run(hy, ids, params)
            real[name, L] = [n for _, acc in res for n in acc]
            same[0] += sum(list(o.token_ids) == t for (o, _), t in zip(res, texts_out[name]))
            same[1] += len(res)
        real["overall", L] = [n for (k, b), v in list(real.items()) if b == L and k != "overall" for n in v]
    groups = {**steps, "overall": [s for v in steps.values() for s in v]}
    print(f"{spec.num_steps}/{spec.topk}/{spec.num_draft_tokens} tree, {a.dtype}, greedy, {a.max_tokens} tokens, "
          f"{time.perf_counter() - t0:.0f} s\n")
    print("| set | steps | L | τ tree | τ n-gram branch alone | τ hybrid (estimate) | gain | steps the branch wins "
          "| τ hybrid (measured) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, st in groups.items():
        e = np.array([s["eagle"] for s in st], float)
        for L in lengths:
            g = np.array([s[f"m{L}"] for s in st], float) + 1
            h = np.maximum(e, g)
            got = real.get((name, L))
            rows[f"{name}/L{L}"] = {"steps": len(st), "tau": e.mean(), "tau_ngram": g.mean(), "tau_hybrid": h.mean(),
                                    "wins": float((g > e).mean()),
                                    "tau_hybrid_measured": None if got is None else float(np.mean(got))}
            print(f"| {name} | {len(st)} | {L} | {e.mean():.3f} | {g.mean():.3f} | {h.mean():.3f} | "
                  f"{100 * (h.mean() / e.mean() - 1):+.1f} % | {(g > e).mean():.1%} | "
                  + ("-" if got is None else f"{np.mean(got):.3f} ({100 * (np.mean(got) / e.mean() - 1):+.1f} %)")
                  + " |")
    if same[1]:
        print(f"\nhybrid outputs equal to the tree's: {same[0]} / {same[1]}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"summary": rows, "steps": steps}, f)


if __name__ == "__main__":
    main()
