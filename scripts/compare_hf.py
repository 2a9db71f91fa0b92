"""Check that `specjax generate` output equals HF transformers' greedy output on the default model.

    specjax generate --prompts P.jsonl --dtype float32 --temperature 0 --max-tokens 64 --output O.jsonl
    python scripts/compare_hf.py P.jsonl O.jsonl --max-tokens 64

HF transformers (torch, CPU, f32) loads the same GGUF; prompts get the same chat template. Each
prompt's specjax tokens must equal HF's greedy tokens up to HF's stop (EOS) or max-tokens.
"""
from __future__ import annotations

import argparse
import json

import torch
import transformers

from specjax.checkpoint import load_tokenizer
from specjax.default_model import CACHE_DIR, GGUF_NAME, default_gguf_path, ensure_default


def hf_greedy(model, ids, n, eos):
    with torch.no_grad():
        out = model(torch.tensor([ids]), use_cache=True)
        new = []
        for _ in range(n):
            tok = int(out.logits[0, -1].argmax())
            new.append(tok)
            if tok in eos:
                break
            out = model(torch.tensor([[tok]]), past_key_values=out.past_key_values, use_cache=True)
    return new


def main():
    p = argparse.ArgumentParser()
    p.add_argument("prompts")
    p.add_argument("outputs")
    p.add_argument("--max-tokens", type=int, default=64)
    a = p.parse_args()
    default_gguf_path()
    tok = load_tokenizer(ensure_default())
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(CACHE_DIR), gguf_file=GGUF_NAME, dtype=torch.float32)
    eos = {tok.eos_token_id}
    ok = 0
    rows = [json.loads(x) for x in open(a.prompts) if x.strip()]
    outs = [json.loads(x) for x in open(a.outputs) if x.strip()]
    for row, out in zip(rows, outs):
        text = row.get("prompt") or row["turns"][0]
        ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                 add_generation_prompt=True), add_special_tokens=False)
        ref = hf_greedy(hf, ids, a.max_tokens, eos)
        same = out["token_ids"] == ref
        ok += same
        print(f"{'OK  ' if same else 'DIFF'} {text[:60]!r}")
    print(f"{ok}/{len(rows)} prompts identical to HF transformers greedy")
    raise SystemExit(0 if ok == len(rows) else 1)


if __name__ == "__main__":
    main()
