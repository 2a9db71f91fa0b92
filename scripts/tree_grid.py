"""Tree configuration grid for a draft head: tau and tokens/s of LLM.generate per (batch, num_steps,
topk, num_draft_tokens[, ngram_branch]), against plain decoding at the same batch, on held-out prompt sets.

    python scripts/tree_grid.py --draft checkpoints/eagle3-smollm2-135m --batches 1,8,32 \
        --configs 4:1:4,6:1:6,5:4:16,6:4:24,6:8:32,7:4:24:7,8:8:64 --per-set 6 --max-tokens 128 \
        --json grid.json --markdown grid.md --png grid.png [--write-best HEAD_DIR]

Each configuration is one LLM (its programs compile in a warm-up generate that is not timed);
timed runs generate exactly --max-tokens tokens per prompt (ignore EOS) so plain and speculative
do equal work; the speculative runs always speculate (speculate_below=None). --write-best stores the
fastest configuration per batch size in the head's specjax.json ("spec_defaults"), or "plain" where
plain decoding beat every configuration at that batch; LLM(draft=...) and `specjax generate
--speculate` read it (the tree shape for --max-batch, and lite steps from the smallest batch of the
table from which every entry is "plain": checkpoint.head_speculate_below).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _configs(s: str) -> list[tuple[int, int, int, int]]:
    """"S:K:N[:L],..." -> [(num_steps, topk, num_draft_tokens, ngram_branch (L; 0 when not given))]."""
    out = []
    for part in s.split(","):
        xs = [int(x) for x in part.split(":")]
        if len(xs) not in (3, 4):
            raise ValueError(f"--configs: {part!r} is not num_steps:topk:num_draft_tokens[:ngram_branch]")
        out.append((*xs, 0) if len(xs) == 3 else tuple(xs))
    return out


def shape_name(r: dict) -> str:
    """A grid row's tree as '7/4/24+7' (rows of older JSONs have no ngram_branch)."""
    from specjax.tree import shape_label
    return shape_label(r["num_steps"], r["topk"], r["num_draft_tokens"], r.get("ngram_branch", 0))


def best_entry(r: dict):
    """The spec_defaults entry of a batch from its fastest speculative row: its tree shape, or
    "plain" (checkpoint.PLAIN) when plain decoding was faster still."""
    from specjax.checkpoint import PLAIN
    if r["tok_s"] <= r["plain_tok_s"]:
        return PLAIN
    entry = {k: r[k] for k in ("num_steps", "topk", "num_draft_tokens")}
    if r.get("ngram_branch"):
        entry["ngram_branch"] = r["ngram_branch"]
    return entry


def request_count(num_prompts: int, batch: int) -> int:
    """Requests per timed call: the prompts, repeated up to a whole number of batches (a call of
    B + a few requests would time a second wave of a few rows, which speculation pays for most)."""
    return batch * -(-num_prompts // batch)


def plot(rows: list[dict], path: str) -> None:
    """Speed-up against plain decoding per tree shape, one line per batch size, to a PNG
    (`python3 -c "import json, tree_grid; tree_grid.plot(json.load(open('grid.json'))['rows'], 'grid.png')"`
    redraws it from a JSON, also from a run cut short)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 4))
    for B in sorted({r["batch"] for r in rows}):
        rs = [r for r in rows if r["batch"] == B]
        ax.plot([shape_name(r) for r in rs],
                [r["speedup"] for r in rs], marker="o", label=f"batch {B}")
        for r in rs:
            ax.annotate(f"τ {r['tau']:.2f}", (shape_name(r), r["speedup"]),
                        textcoords="offset points", xytext=(0, 6), ha="center", fontsize=7)
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set(xlabel="num_steps / topk / num_draft_tokens [+ n-gram branch]", ylabel="speed-up vs plain", title="tree grid")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _timed(llm, ids, params, tries: int = 3) -> tuple[float, float, int]:
    """tok/s, mean tau and tokens of an identical generate call that compiled nothing (up to `tries`
    calls: with more requests than slots the admission order, and so the prefill shapes of prefix
    cache hits, can differ between calls; a call that compiled is not a timing)."""
    for i in range(tries):
        before = llm.engine.num_compiled()
        t0 = time.perf_counter()
        outs = llm.generate(ids, params)
        dt = time.perf_counter() - t0
        compiled = llm.engine.num_compiled() - before
        if compiled == 0:
            break
        print(f"[grid]   timed call {i + 1} compiled {compiled} program(s) ({dt:.1f} s): again", flush=True)
    else:
        raise RuntimeError(f"every one of {tries} identical calls compiled programs: no timing")
    n = sum(len(o.token_ids) for o in outs)
    return n / dt, _tau(outs), n


def _tau(outs) -> float:
    """The mean over requests of their mean tokens per speculative step (1.0: none speculated)."""
    taus = [o.accept_len_mean for o in outs if o.accept_len_mean is not None]
    return sum(taus) / len(taus) if taus else 1.0


def main(argv=None) -> int:
    from specjax import LLM, SamplingParams
    from specjax.eval import load_sets
    from specjax.llm import draft_method
    from specjax.tree import SpecConfig

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--draft", required=True)
    p.add_argument("--model", default=None)
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--configs", default="4:1:4,6:1:6,5:4:16,6:4:24,6:8:32,8:8:64",
                   help="num_steps:topk:num_draft_tokens[:ngram_branch],... (a 4th field: an n-gram branch "
                        "of that many nodes in the tree, SpecConfig.ngram_branch)")
    p.add_argument("--per-set", type=int, default=6, help="prompts per prompt set")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--max-seq-len", type=int, default=1024)
    p.add_argument("--json", default=None)
    p.add_argument("--markdown", default=None)
    p.add_argument("--png", default=None)
    p.add_argument("--write-best", default=None, help="head directory whose specjax.json gets spec_defaults")
    p.add_argument("--tau-only", action="store_true",
                   help="acceptance only: one untimed generate per configuration, no plain decoding (tree "
                        "shapes compared on any machine, e.g. the CPU in float32)")
    a = p.parse_args(argv)
    if a.tau_only and a.write_best:
        p.error("--write-best needs timings; it cannot be used with --tau-only")
    try:
        configs = _configs(a.configs)
    except ValueError as e:
        p.error(str(e))
    sets = load_sets(None, a.per_set)
    method = draft_method(a.draft)
    rows = []
    for B in (int(x) for x in a.batches.split(",")):
        plain = LLM(a.model, dtype=a.dtype, max_batch=B, max_seq_len=a.max_seq_len)
        texts = [t for ps in sets.values() for t in ps]
        ids = [plain.tokenizer.encode(plain.apply_chat_template([{"role": "user", "content": t}]),
                                      add_special_tokens=False) for t in texts]
        ids = [x for x in ids if len(x) + a.max_tokens < a.max_seq_len]
        ids = (ids * B)[: request_count(len(ids), B)]  # whole waves: no second wave of a few rows
        params = SamplingParams(max_tokens=a.max_tokens, temperature=0.0, ignore_eos=True)
        plain_tps = None
        if not a.tau_only:
            plain.generate(ids[:B], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))  # compile
            plain.generate(ids, params)
            plain_tps, _, n = _timed(plain, ids, params)
            print(f"[grid] batch {B}: plain {plain_tps:.0f} tok/s ({n} tokens)", flush=True)
        del plain
        for steps, topk, ntok, branch in configs:
            cfg = SpecConfig(method=method, num_steps=steps, topk=topk, num_draft_tokens=ntok, ngram_branch=branch)
            llm = LLM(a.model, dtype=a.dtype, max_batch=B, max_seq_len=a.max_seq_len, draft=a.draft, spec=cfg,
                      speculate_below=None)
            row = {"batch": B, "num_steps": steps, "topk": topk, "num_draft_tokens": ntok, "ngram_branch": branch}
            if a.tau_only:  # one untimed call: its acceptance only
                row.update(tau=round(_tau(llm.generate(ids, params)), 3), tok_s=None, plain_tok_s=None, speedup=None)
                print(f"[grid] batch {B} tree {shape_name(row)}: tau {row['tau']:.3f}", flush=True)
            else:
                llm.generate(ids, params)  # compile every bucket; the second pass compiles the prefill
                llm.generate(ids, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))  # of cache hits
                tps, tau, _ = _timed(llm, ids, params)
                attention = llm.engine.attention_name
                row.update(tau=round(tau, 3), tok_s=round(tps, 1), plain_tok_s=round(plain_tps, 1),
                           speedup=round(tps / plain_tps, 3))
                print(f"[grid] batch {B} tree {shape_name(row)}: tau {tau:.2f}, {tps:.0f} tok/s, "
                      f"x{tps / plain_tps:.2f}", flush=True)
            rows.append(row)
            del llm
            if a.json:  # after every row: a run cut short keeps what it measured
                Path(a.json).write_text(json.dumps({"rows": rows, "complete": False}, indent=2) + "\n")

    def num(x, fmt):
        return "-" if x is None else format(x, fmt)

    md = ["| batch | num_steps | topk | num_draft_tokens | n-gram branch | τ | spec tok/s | plain tok/s | speed-up |",
          "|---|---|---|---|---|---|---|---|---|"]
    md += [f"| {r['batch']} | {r['num_steps']} | {r['topk']} | {r['num_draft_tokens']} | {r.get('ngram_branch', 0)} | "
           f"{r['tau']:.2f} | "
           f"{num(r['tok_s'], '.0f')} | {num(r['plain_tok_s'], '.0f')} | {num(r['speedup'], '.2f')}{'' if r['speedup'] is None else 'x'} |" for r in rows]
    text = "\n".join(md)
    print(text)
    if a.markdown:
        Path(a.markdown).write_text(text + "\n")
    if a.tau_only:
        if a.json:
            Path(a.json).write_text(json.dumps({"rows": rows, "complete": True}, indent=2) + "\n")
        return 0
    best = {}
    for r in rows:
        if r["batch"] not in best or r["tok_s"] > best[r["batch"]]["tok_s"]:
            best[r["batch"]] = r
    if a.json:
        Path(a.json).write_text(json.dumps({"rows": rows, "best": best, "complete": True}, indent=2) + "\n")
    if a.png:
        plot(rows, a.png)
    if a.write_best:
        meta_path = Path(a.write_best) / "specjax.json"
        meta = json.loads(meta_path.read_text())
        meta["spec_defaults"] = {str(B): best_entry(r) for B, r in sorted(best.items())}
        import jax
        meta["spec_defaults_measured"] = {"attention": attention, "device": jax.devices()[0].device_kind,
                                          "jax": jax.__version__, "date": time.strftime("%Y-%m-%d"),
                                          "by": "scripts/tree_grid.py --write-best"}
        meta_path.write_text(json.dumps(meta, indent=2) + "\n")
        print(f"[grid] wrote spec_defaults {meta['spec_defaults']} to {meta_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
