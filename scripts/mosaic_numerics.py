"""Does the Mosaic GPU kernel's rounding alone move τ? The kernel's arithmetic in plain jnp, in the engine.

`mosaic_emul` computes what paged_attention_mosaic computes, in the same order: 64-key blocks, each
one split's partial (the kernel's splits hold one block each while a row has at most `auto_splits`
live blocks: every engine call of the default benchmarks), scores in f32 from bf16 operands, the
unnormalised p = exp(s - m) rounded to bf16 before p @ v, o / l and lse per split, the f32 combine
(pallas_kernels.paged_attention.combine) and the dense tree block (block_partial). --check shows it
equal to the kernel in its interpreter (bit for bit, or within one f32 rounding) on SmolLM2-shaped
cases; unlike the interpreter it is fast enough to run the whole engine on the CPU.

The default run generates with the jnp reference and with the emulation (LLM.generate, greedy, EOS
ignored, bench_generate's prompts and tree), prints τ per prompt, and for the first prompt the first
token where the two texts part and the top log-probabilities there under each (plain decoding).

    PYTHONPATH=. python3 scripts/mosaic_numerics.py --check
    PYTHONPATH=. python3 scripts/mosaic_numerics.py --batch 1 --max-tokens 128
    PYTHONPATH=. python3 scripts/mosaic_numerics.py --batch 8 --max-tokens 128
"""
from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from pallas_kernels.paged_attention import (NEG, block_partial, combine, gather_kv, geometry,  # noqa: E402
                                            group_queries, paged_attention_reference, row_bounds, ungroup, visible)
from bench_generate import prompt_texts  # noqa: E402  (same folder: bench_generate's prompts)


def mosaic_emul(q, kv_pages, page_table, q_start, kv_len, block_mask=None, *, sliding_window=None, scale=None,
                mask_start=None):
    """paged_attention_mosaic's arithmetic in jnp (no sliding window). Exact while every row has at most
    auto_splits(g) live 64-key blocks (each block is then its own split)."""
    if sliding_window is not None:
        raise NotImplementedError("mosaic_emul: no sliding window")
    block_q = 64 if q.shape[1] * (q.shape[2] // kv_pages.shape[3]) <= 64 else 128
    g = geometry(q, kv_pages, page_table, block_q, sliding_window, scale)
    BK = max(64, g.ps)
    nblk = -(-g.capacity // BK)
    qg = group_queries(q, g)  # [B, Hkv, Rp, D]
    bounds = row_bounds(q_start, kv_len, mask_start, block_mask is not None, g)
    k, v = gather_kv(kv_pages, page_table)  # [B, C, Hkv, D]
    pad = ((0, 0), (0, nblk * BK - k.shape[1]), (0, 0), (0, 0))
    k = jnp.pad(k, pad).reshape(g.B, nblk, BK, g.Hkv, g.D)
    v = jnp.pad(v, pad).reshape(g.B, nblk, BK, g.Hkv, g.D)
    sc = jnp.einsum("bhrd,bjkhd->bhjrk", qg, k, preferred_element_type=jnp.float32) * g.scale  # [B, Hkv, J, Rp, BK]
    row = jnp.arange(g.Rp, dtype=jnp.int32)[None, None, :, None]
    kidx = jnp.arange(nblk, dtype=jnp.int32)[:, None] * BK + jnp.arange(BK, dtype=jnp.int32)[None, :]
    kidx = kidx[None, :, None, :]  # [1, J, 1, BK]
    b4 = tuple(bounds[:, i][:, None, None, None] for i in range(3))
    ok = visible(kidx, row, b4, g.G, None)[:, None]  # [B, 1, J, Rp, BK]
    # blocks the kernel never visits are fully masked here: l = 0, lse = -inf, weight 0 in the combine
    sc = jnp.where(ok, sc, NEG)
    m = jnp.maximum(sc.max(-1), NEG)
    p = jnp.where(ok, jnp.exp(sc - m[..., None]), 0.0)
    l = p.sum(-1)
    o = jnp.einsum("bhjrk,bjkhd->bhjrd", p.astype(q.dtype), v, preferred_element_type=jnp.float32)
    live = l > 0
    safe = jnp.where(live, l, 1.0)
    parts = [((o / safe[..., None])[:, :, :, : g.R], jnp.where(live, m + jnp.log(safe), -jnp.inf)[:, :, :, : g.R])]
    if block_mask is not None:
        parts.append(block_partial(q, kv_pages, page_table, q_start, kv_len, block_mask, mask_start, g))
    return ungroup(combine(parts), g, q.dtype)


def check():
    """The emulation against the kernel in the Mosaic GPU interpreter, SmolLM2's geometry."""
    sys.path.insert(0, str(REPO / "tests"))
    from paged_cases import make_case

    from pallas_kernels.paged_attention_mosaic import paged_attention_mosaic
    kern = jax.jit(functools.partial(paged_attention_mosaic, interpret=True))
    for mode, T, seed in (("verify", 17, 0), ("grow", 4, 1), ("prefill", 64, 2), ("prefill", 6, 3)):
        case = make_case(np.random.default_rng(seed), mode, page_size=16, B=2, T=T, H=9, Hkv=3, D=64,
                         dtype=jnp.bfloat16, P=66)
        outs = [np.asarray(jax.jit(f)(*case.args, mask_start=case.mask_start).astype(jnp.float32))
                for f in (mosaic_emul, kern, paged_attention_reference)]
        n = int(case.num_new[0])
        e, k, r = (x[0, :n] for x in outs)
        print(json.dumps(dict(mode=mode, T=T, emul_vs_kernel_max=float(np.abs(e - k).max()),
                              emul_equal_frac=float((e == k).mean()),
                              reference_vs_kernel_max=float(np.abs(r - k).max()),
                              reference_equal_frac=float((r == k).mean()))))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", action="store_true", help="the emulation vs the kernel in its interpreter")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--max-tokens", type=int, default=128)
    a = p.parse_args(argv)
    if a.check:
        check()
        return 0
    from specjax import LLM, SamplingParams, attention
    from specjax.assets import DEFAULT_HEAD_DIR
    attention.register("mosaic_emul", lambda impl: jax.jit(mosaic_emul, static_argnames=("sliding_window",)))
    toks, prompt = {}, None
    for name in ("reference", "mosaic_emul"):
        llm = LLM(dtype="bfloat16", max_batch=a.batch, max_seq_len=1024, draft=str(DEFAULT_HEAD_DIR), attention=name)
        ids = [llm.tokenizer.encode(llm.apply_chat_template([{"role": "user", "content": t}]), add_special_tokens=False)
               for t in prompt_texts(a.batch)]
        params = [SamplingParams(max_tokens=a.max_tokens, temperature=0.0, ignore_eos=True, seed=i)
                  for i in range(a.batch)]
        outs = llm.generate(ids, params)
        taus = [o.accept_len_mean for o in outs]
        toks[name] = [o.token_ids for o in outs]
        print(json.dumps(dict(attention=name, batch=a.batch, tau_mean=round(float(np.mean(taus)), 3),
                              tau=[round(t, 3) for t in taus])), flush=True)
        print(f"  prompt 0: {llm.tokenizer.decode(outs[0].token_ids)[:160]!r}...", flush=True)
        prompt = ids[0]
        del llm
    for b in range(a.batch):
        x, y = toks["reference"][b], toks["mosaic_emul"][b]
        i = next((j for j in range(min(len(x), len(y))) if x[j] != y[j]), None)
        print(f"prompt {b}: the texts part at generated token {i}")
    ref, emu = toks["reference"][0], toks["mosaic_emul"][0]
    i = next((j for j in range(min(len(ref), len(emu))) if ref[j] != emu[j]), None)
    if i is None:
        return 0
    for name in ("reference", "mosaic_emul"):  # plain greedy decoding, top log-probabilities at token i
        llm = LLM(dtype="bfloat16", max_batch=1, max_seq_len=1024, attention=name)
        out = llm.generate([prompt], SamplingParams(max_tokens=i + 1, temperature=0.0, ignore_eos=True, logprobs=3))[0]
        top = {llm.tokenizer.decode([t]): round(v, 4) for t, v in out.logprobs[i].items()}
        print(json.dumps(dict(attention=name, plain_equals_spec_prefix=out.token_ids[:i] == ref[:i], token=i,
                              text_before=llm.tokenizer.decode(ref[:i]), top_logprobs=top)), flush=True)
        del llm
    return 0


if __name__ == "__main__":
    sys.exit(main())
