"""Acceptance and speed-up of speculative decoding over prompt sets (`specjax eval`).

For each prompt file (category = file stem; default: the six sets in data/prompts/), the same
prompts run greedily with plain decoding and with speculative decoding (a draft directory):
  tau        mean acceptance length = tokens emitted per speculative step (incl. the bonus token),
             over all steps of the category; per-prompt values give its distribution
  tok/s      generated tokens / wall time around generate (after a warm-up that compiles every
             prompt-length bucket and the decode programs), plain and speculative; speed-up = ratio
  identical  prompts whose speculative output equals the plain output (greedy is lossless; bf16
             numerics of a verify step can differ from a decode step's in rare near-ties)
Optionally, HF transformers' greedy `generate` on the same prompts (torch; GPU when available),
loading the model from its GGUF file.
Outputs: a markdown table (stdout and --markdown), a PNG (tau per category + speed-up bars), --json.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
PROMPTS_DIR = REPO_ROOT / "data" / "prompts"
DEFAULT_SETS = ("mt_bench", "gsm8k", "humaneval", "alpaca", "qa", "sum")


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


def _ids(llm, texts, chat: bool) -> list[list[int]]:
    out = []
    for t in texts:
        text = llm.apply_chat_template([{"role": "user", "content": t}]) if chat else t
        out.append(llm.tokenizer.encode(text, add_special_tokens=False))
    return out


def run_eval(sets: dict[str, list[str]], *, model=None, draft: str, num_steps: int = 4, topk: int = 1,
             num_draft_tokens: int | None = None, max_batch: int = 1, max_tokens: int = 256,
             dtype: str = "bfloat16", max_seq_len: int = 2048, chat: bool | None = None,
             warmup_tokens: int = 8, log=print) -> dict:
    """Plain vs speculative greedy decoding per category -> summary dict (see module doc)."""
    from specjax import LLM, SamplingParams
    from specjax.llm import draft_method
    from specjax.tree import SpecConfig

    t0 = time.perf_counter()
    spec_cfg = SpecConfig(method=draft_method(draft), num_steps=num_steps, topk=topk,
                          num_draft_tokens=num_draft_tokens)
    plain = LLM(model, dtype=dtype, max_batch=max_batch, max_seq_len=max_seq_len)
    spec = LLM(model, dtype=dtype, max_batch=max_batch, max_seq_len=max_seq_len, draft=draft, spec=spec_cfg)
    chat = bool(plain.tokenizer.chat_template) if chat is None else chat
    ids = {c: [p for p in _ids(plain, ps, chat) if len(p) + 1 < max_seq_len] for c, ps in sets.items()}
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    log(f"[eval] models loaded in {time.perf_counter() - t0:.1f}s; warming up")
    t1 = time.perf_counter()
    every = [p for ps in ids.values() for p in ps]
    first = every[:1]
    for llm in (plain, spec):  # compile every prefill bucket and the decode programs
        _run(llm, every, SamplingParams(max_tokens=warmup_tokens, temperature=0.0))
        _run(llm, first, params)
    log(f"[eval] warm-up {time.perf_counter() - t1:.1f}s")
    cats = {}
    for c, ps in ids.items():
        tp = time.perf_counter()
        res_p = _run(plain, ps, params)
        tp = time.perf_counter() - tp
        ts = time.perf_counter()
        res_s = _run(spec, ps, params)
        ts = time.perf_counter() - ts
        ok = [i for i, ((op, _), (os_, _)) in enumerate(zip(res_p, res_s))
              if op.finish_reason != "error" and os_.finish_reason != "error"]
        n_p = sum(len(res_p[i][0].token_ids) for i in ok)
        n_s = sum(len(res_s[i][0].token_ids) for i in ok)
        acc = [res_s[i][1] for i in ok]
        steps = sum(len(a) for a in acc)
        cats[c] = {"prompts": len(ok), "tokens_plain": n_p, "tokens_spec": n_s,
                   "seconds_plain": round(tp, 4), "seconds_spec": round(ts, 4),
                   "tok_s_plain": n_p / tp if tp > 0 else 0.0, "tok_s_spec": n_s / ts if ts > 0 else 0.0,
                   "tau": sum(map(sum, acc)) / steps if steps else float("nan"), "spec_steps": steps,
                   "tau_per_prompt": [sum(a) / len(a) for a in acc if a],
                   "identical": sum(res_p[i][0].token_ids == res_s[i][0].token_ids for i in ok)}
        cats[c]["speedup"] = cats[c]["tok_s_spec"] / cats[c]["tok_s_plain"] if cats[c]["tok_s_plain"] else 0.0
        log(f"[eval] {c}: tau {cats[c]['tau']:.3f}, plain {cats[c]['tok_s_plain']:.1f} tok/s, "
            f"spec {cats[c]['tok_s_spec']:.1f} tok/s, speed-up {cats[c]['speedup']:.2f}x")
    tot = {k: sum(v[k] for v in cats.values()) for k in ("prompts", "tokens_plain", "tokens_spec", "seconds_plain",
                                                       "seconds_spec", "spec_steps", "identical")}
    tot["tau"] = sum(v["tau"] * v["spec_steps"] for v in cats.values() if v["spec_steps"]) / max(tot["spec_steps"], 1)
    tot["tok_s_plain"] = tot["tokens_plain"] / tot["seconds_plain"] if tot["seconds_plain"] else 0.0
    tot["tok_s_spec"] = tot["tokens_spec"] / tot["seconds_spec"] if tot["seconds_spec"] else 0.0
    tot["speedup"] = tot["tok_s_spec"] / tot["tok_s_plain"] if tot["tok_s_plain"] else 0.0
    import jax
    settings = {"model": str(plain.model_dir), "draft": str(draft), "method": spec_cfg.method,
                "num_steps": num_steps, "topk": topk, "num_draft_tokens": spec_cfg.num_draft_tokens,
                "max_batch": max_batch, "max_tokens": max_tokens, "dtype": dtype, "chat": chat,
                "device": str(jax.devices()[0].device_kind), "backend": jax.default_backend()}
    return {"settings": settings, "categories": cats, "overall": tot, "prompt_ids": ids}


def hf_baseline(gguf: str | Path, ids: dict[str, list[list[int]]], max_tokens: int, device: str = "auto",
                eos: tuple[int, ...] = (), log=print) -> dict:
    """HF transformers greedy generate (batch 1) over the same prompt ids -> tok/s per category."""
    import torch
    import transformers

    gguf = Path(gguf)
    dev = ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device
    dtype = torch.bfloat16 if dev.startswith("cuda") else torch.float32
    model = transformers.AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=dtype)
    model = model.to(dev).eval()
    kw = dict(do_sample=False, max_new_tokens=max_tokens, eos_token_id=list(eos) or None,
              pad_token_id=(list(eos) or [0])[0])

    def gen(p):
        x = torch.tensor([p], device=dev)
        with torch.no_grad():
            out = model.generate(x, attention_mask=torch.ones_like(x), **kw)
        if dev.startswith("cuda"):
            torch.cuda.synchronize()
        return out.shape[1] - x.shape[1]

    first = next(p for ps in ids.values() for p in ps)
    gen(first)  # warm-up
    cats = {}
    for c, ps in ids.items():
        t = time.perf_counter()
        n = sum(gen(p) for p in ps)
        s = time.perf_counter() - t
        cats[c] = {"tokens": n, "seconds": round(s, 4), "tok_s": n / s if s > 0 else 0.0}
        log(f"[eval] HF {c}: {cats[c]['tok_s']:.1f} tok/s")
    n, s = sum(v["tokens"] for v in cats.values()), sum(v["seconds"] for v in cats.values())
    return {"device": dev, "dtype": str(dtype).replace("torch.", ""), "gguf": str(gguf), "categories": cats,
            "overall": {"tokens": n, "seconds": s, "tok_s": n / s if s else 0.0}}


def markdown(summary: dict) -> str:
    s, hf = summary["settings"], summary.get("hf")
    head = ["category", "prompts", "τ (tokens/step)", "plain tok/s", "spec tok/s", "speed-up", "identical"]
    if hf:
        head += ["HF tok/s", "plain / HF", "spec / HF"]
    rows = [(c, v) for c, v in summary["categories"].items()] + [("**overall**", summary["overall"])]
    lines = [f"Speculative decoding with `{s['draft']}` ({s['method']}, {s['num_steps']} steps, topk {s['topk']}, "
             f"{s['num_draft_tokens']} draft tokens) on `{s['model']}` ({s['dtype']}), greedy, batch "
             f"{s['max_batch']}, max {s['max_tokens']} new tokens, {s['device']}.", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for c, v in rows:
        cells = [c, str(v["prompts"]), f"{v['tau']:.2f}", f"{v['tok_s_plain']:.1f}", f"{v['tok_s_spec']:.1f}",
                 f"{v['speedup']:.2f}x", f"{v['identical']}/{v['prompts']}"]
        if hf:
            h = hf["overall"] if c == "**overall**" else hf["categories"].get(c, {})
            hs = h.get("tok_s", 0.0)
            cells += [f"{hs:.1f}"] + [f"{v[k] / hs:.1f}x" if hs else "-" for k in ("tok_s_plain", "tok_s_spec")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(summary: dict, png: str | Path) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cats = summary["categories"]
    names = list(cats)
    fig, (ax_t, ax_s) = plt.subplots(1, 2, figsize=(12, 4.5))
    data = [cats[c]["tau_per_prompt"] or [float("nan")] for c in names]
    ax_t.boxplot(data, showmeans=True)
    ax_t.set_xticks(range(1, len(names) + 1), names, rotation=20)
    ax_t.set(ylabel="mean acceptance length τ per prompt", title="acceptance length (tokens / step)")
    labels = names + ["overall"]
    sp = [cats[c]["speedup"] for c in names] + [summary["overall"]["speedup"]]
    bars = ax_s.bar(labels, sp, color=["tab:blue"] * len(names) + ["tab:orange"])
    ax_s.bar_label(bars, fmt="%.2fx", fontsize=8)
    ax_s.axhline(1.0, color="gray", lw=1, ls="--")
    ax_s.set(ylabel="speculative / plain tokens per second", title="speed-up")
    ax_s.tick_params(axis="x", rotation=20)
    for ax in (ax_t, ax_s):
        ax.grid(alpha=0.3, axis="y")
    s = summary["settings"]
    fig.suptitle(f"{Path(s['draft']).name}: {s['method']}, {s['num_steps']} steps, topk {s['topk']}, "
                 f"batch {s['max_batch']}, {s['dtype']}, {s['device']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)
    return Path(png)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="converted model dir (default: SmolLM2-135M-Instruct)")
    p.add_argument("--draft", required=True, help="draft directory (EAGLE head, draft model) or 'self'")
    p.add_argument("--prompts", nargs="+", default=None,
                   help="jsonl prompt files, one category each (default: the six sets in data/prompts/)")
    p.add_argument("--limit", type=int, default=None, help="first N prompts of each file")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--max-batch", type=int, default=1)
    p.add_argument("--num-steps", type=int, default=4)
    p.add_argument("--topk", type=int, default=1)
    p.add_argument("--num-draft-tokens", type=int, default=None)
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    p.add_argument("--max-seq-len", type=int, default=2048)
    p.add_argument("--warmup-tokens", type=int, default=8)
    p.add_argument("--raw", action="store_true", help="no chat template")
    p.add_argument("--json", help="write the summary as JSON")
    p.add_argument("--markdown", help="write the table as markdown")
    p.add_argument("--png", help="write the plot (τ distribution, speed-up)")
    p.add_argument("--hf-baseline", action="store_true", help="also time HF transformers' greedy generate")
    p.add_argument("--gguf", default=None, help="GGUF file for --hf-baseline (default: the default model's)")
    p.add_argument("--hf-device", default="auto")


def cmd_eval(a) -> int:
    if a.hf_baseline:  # fail before the long run
        _gguf(a)
    sets = load_sets(a.prompts, a.limit)

    def log(m):
        print(m, file=sys.stderr, flush=True)
    summary = run_eval(sets, model=a.model, draft=a.draft, num_steps=a.num_steps, topk=a.topk,
                       num_draft_tokens=a.num_draft_tokens, max_batch=a.max_batch, max_tokens=a.max_tokens,
                       dtype=a.dtype, max_seq_len=a.max_seq_len, chat=False if a.raw else None,
                       warmup_tokens=a.warmup_tokens, log=log)
    ids = summary.pop("prompt_ids")
    if a.hf_baseline:
        from specjax.checkpoint import load_config
        from specjax.default_model import ensure_default
        cfg = load_config(a.model or ensure_default())
        summary["hf"] = hf_baseline(_gguf(a), ids, a.max_tokens, a.hf_device, cfg.eos_token_ids, log)
        summary["overall"]["speedup_vs_hf"] = summary["overall"]["tok_s_spec"] / max(summary["hf"]["overall"]["tok_s"], 1e-9)
        summary["overall"]["plain_vs_hf"] = summary["overall"]["tok_s_plain"] / max(summary["hf"]["overall"]["tok_s"], 1e-9)
    table = markdown(summary)
    print(table)
    if a.markdown:
        Path(a.markdown).write_text(table)
    if a.json:
        Path(a.json).write_text(json.dumps(summary, indent=2) + "\n")
    if a.png:
        try:
            plot(summary, a.png)
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
