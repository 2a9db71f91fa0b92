"""The reports of `specjax eval` (specjax.eval): its summary as a markdown table and as a PNG (tau per
category, speed-up bars)."""
from __future__ import annotations

from pathlib import Path


def _x(a, b) -> str:
    return f"{a / b:.2f}x" if b else "-"


def markdown(summary: dict) -> str:
    s, hf = summary["settings"], summary.get("hf")
    k = s["num_steps"]
    head = ["category", "prompts", "τ (tokens/step)", "τ to EOS", f"acc@1..{k}", "plain tok/s", "spec tok/s",
            "speed-up", "identical"]
    gated = s.get("min_accept") is not None
    if gated:
        head += ["lite / fused steps"]
    dv = s.get("draft_vocab_size")
    if dv:
        head += [f"in draft vocab ({dv})"]
    lookup = bool(hf) and "tok_s_lookup" in hf["overall"]
    if hf:
        head += ["HF tok/s"] + (["HF lookup tok/s", "HF lookup speed-up"] if lookup else []) + ["plain / HF"]
        head += ["spec / HF lookup"] if lookup else ["spec / HF"]
    rows = [(c, v) for c, v in summary["categories"].items()] + [("**overall**", summary["overall"])]
    ngram = (f", n-gram {s['ngram_max']}..{s['ngram_min']}" if s["method"] == "ngram" else
             f", n-gram branch of {s['ngram_branch']}" if s.get("ngram_branch") else "")
    lines = [f"Speculative decoding with `{s['draft']}` ({s['method']}{ngram}, {s['num_steps']} steps, topk "
             f"{s['topk']}, {s['num_draft_tokens']} draft tokens) on `{s['model']}` ({s['dtype']}), greedy, batch "
             f"{s['max_batch']}, {s['max_tokens']} new tokens per prompt (EOS ignored: equal work), {s['device']}"
             + (f"; acceptance gate: lite steps below τ {s['min_accept']:g} (specjax.adaptive)." if gated else "."),
             "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for c, v in rows:
        acc = "/".join(f"{a:.2f}" for a in v.get("acc", []))
        cells = [c, str(v["prompts"]), f"{v['tau']:.2f}", f"{v.get('tau_to_eos', float('nan')):.2f}", acc,
                 f"{v['tok_s_plain']:.1f}", f"{v['tok_s_spec']:.1f}", f"{v['speedup']:.2f}x",
                 f"{v['identical']}/{v['prompts']}"]
        if gated:
            cells += [f"{v.get('lite_steps', 0)} / {v.get('fused_steps', 0)}"]
        if dv:
            cells += [f"{v['in_draft_vocab'] / v['tokens_plain']:.1%}" if v["tokens_plain"] else "-"]
        if hf:
            h = hf["overall"] if c == "**overall**" else hf["categories"].get(c, {})
            hs, hl = h.get("tok_s", 0.0), h.get("tok_s_lookup", 0.0)
            cells += [f"{hs:.1f}"] + ([f"{hl:.1f}", _x(hl, hs)] if lookup else []) + [_x(v["tok_s_plain"], hs)]
            cells += [_x(v["tok_s_spec"], hl)] if lookup else [_x(v["tok_s_spec"], hs)]
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
