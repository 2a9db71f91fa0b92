"""The HF transformers peer of `specjax eval --hf-baseline` (specjax.eval): the same prompt ids, the
same number of new tokens (EOS ignored) on the same machine, greedy `generate` and prompt-lookup
decoding (the peer of the n-gram drafter), timed per category."""
from __future__ import annotations

import time
from pathlib import Path


def hf_baseline(gguf: str | Path, ids: dict[str, list[list[int]]], max_tokens: int, device: str = "auto",
                lookup_tokens: int = 10, lookup_ngram: int = 2, log=print) -> dict:
    """HF transformers, model loaded from its GGUF file: hf_timings on `device` (auto: cuda if
    torch sees a GPU), bfloat16 on a GPU, float32 on the CPU."""
    import torch
    import transformers

    gguf = Path(gguf)
    dev = ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device
    dtype = torch.bfloat16 if dev.startswith("cuda") else torch.float32
    model = transformers.AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=dtype)
    out = hf_timings(model.to(dev).eval(), ids, max_tokens, lookup_tokens, lookup_ngram, log)
    return {"device": dev, "dtype": str(dtype).replace("torch.", ""), "gguf": str(gguf), **out}


def hf_timings(model, ids: dict[str, list[list[int]]], max_tokens: int, lookup_tokens: int = 10,
               lookup_ngram: int = 2, log=print) -> dict:
    """HF `generate` at batch 1, greedy, exactly max_tokens new tokens per prompt (EOS ignored, as
    in run_eval): plain, then prompt-lookup decoding (prompt_lookup_num_tokens=lookup_tokens,
    max_matching_ngram_size=lookup_ngram; lookup_tokens 0: plain only) -> tok/s per category;
    identical_lookup counts prompts where both give the same tokens (greedy lookup is lossless)."""
    import copy

    import torch

    dev = str(model.device)
    gc = copy.deepcopy(model.generation_config)
    gc.eos_token_id = []  # equal work: no early stop (None would fall back to the model's EOS)
    gc.do_sample, gc.max_new_tokens, gc.min_new_tokens = False, max_tokens, None
    if gc.pad_token_id is None:
        gc.pad_token_id = 0
    for k in ("temperature", "top_p", "top_k"):  # greedy: no sampling settings (HF warns otherwise)
        setattr(gc, k, None)
    modes = {"plain": gc}
    if lookup_tokens:
        modes["lookup"] = copy.deepcopy(gc)
        modes["lookup"].prompt_lookup_num_tokens = lookup_tokens
        modes["lookup"].max_matching_ngram_size = lookup_ngram

    def gen(p, config):
        x = torch.tensor([p], device=dev)
        with torch.no_grad():
            out = model.generate(x, attention_mask=torch.ones_like(x), generation_config=config)
        if dev.startswith("cuda"):
            torch.cuda.synchronize()
        return out[0, x.shape[1]:].tolist()

    first = next(p for ps in ids.values() for p in ps)
    for config in modes.values():
        gen(first, config)  # warm-up
    cats = {}
    for c, ps in ids.items():
        outs, secs = {}, {}
        for mode, config in modes.items():
            t = time.perf_counter()
            outs[mode] = [gen(p, config) for p in ps]
            secs[mode] = time.perf_counter() - t
        n = sum(map(len, outs["plain"]))
        cats[c] = {"tokens": n, "seconds": round(secs["plain"], 4), "tok_s": n / secs["plain"] if secs["plain"] else 0.0}
        if "lookup" in outs:
            nl = sum(map(len, outs["lookup"]))
            cats[c].update(tokens_lookup=nl, seconds_lookup=round(secs["lookup"], 4),
                           tok_s_lookup=nl / secs["lookup"] if secs["lookup"] else 0.0,
                           identical_lookup=sum(a == b for a, b in zip(outs["plain"], outs["lookup"])))
            cats[c]["speedup_lookup"] = cats[c]["tok_s_lookup"] / cats[c]["tok_s"] if cats[c]["tok_s"] else 0.0
        log(f"[eval] HF {c}: {cats[c]['tok_s']:.1f} tok/s" + (
            f", prompt lookup {cats[c]['tok_s_lookup']:.1f} tok/s ({cats[c]['speedup_lookup']:.2f}x)"
            if "lookup" in outs else ""))
    overall = {k: sum(v[k] for v in cats.values()) for k in ("tokens", "seconds")}
    overall["tok_s"] = overall["tokens"] / overall["seconds"] if overall["seconds"] else 0.0
    if lookup_tokens:
        overall.update({k: sum(v[k] for v in cats.values()) for k in ("tokens_lookup", "seconds_lookup",
                                                                     "identical_lookup")})
        overall["tok_s_lookup"] = overall["tokens_lookup"] / overall["seconds_lookup"] if overall["seconds_lookup"] else 0.0
        overall["speedup_lookup"] = overall["tok_s_lookup"] / overall["tok_s"] if overall["tok_s"] else 0.0
    return {"max_tokens": max_tokens, "lookup_tokens": lookup_tokens, "lookup_ngram": lookup_ngram,
            "categories": cats, "overall": overall}
