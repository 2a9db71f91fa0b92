"""A small case of the one-slot defect (sessions 44-45): random tiny models, greedy float32, one row.

    python3 scripts/repro_one_slot.py [--hidden 64] [--layers 2] [--vocab 512] [--tree 3/2/6] [--steps-per-call 4]
        [--prompts 2] [--max-tokens 24] [--json F]

Plain decoding gives the reference tokens; then a speculative engine of one row without hand-over runs with a
device state of one slot (what XLA on H100 / H200 compiled wrong for the real SmolLM2, jax 0.11.2) and of two
(engine_handover.device_slots, the fix). Prints `RESULT slots N match BOOL first_diff [...]` per state. On a GPU,
set XLA_FLAGS="--xla_dump_to=DIR --xla_dump_hlo_module_re=fused --xla_dump_hlo_as_text" to keep the fused
program's HLO of both states for a diff. With the real model, scripts/check_lossless.py --variants old_1slot.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))


def models(hidden: int, layers: int, vocab: int):
    """(cfg, target, draft_cfg, draft): random Llama models, weights scaled so that greedy paths vary."""
    from flax import nnx

    from specjax.config import ModelConfig
    from specjax.models.llama import Llama

    def cfg(n):
        heads = max(2, hidden // 32)
        return ModelConfig.from_hf_dict(dict(
            architectures=["LlamaForCausalLM"], vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
            num_hidden_layers=n, num_attention_heads=heads, num_key_value_heads=max(1, heads // 2),
            head_dim=hidden // heads, rope_theta=10000.0, tie_word_embeddings=False, eos_token_id=vocab - 1))

    def model(c, seed):
        m = Llama(c, jnp.float32, nnx.Rngs(seed))
        for _, p in nnx.iter_graph(m):
            if isinstance(p, nnx.Param) and p[...].ndim > 1:
                p[...] = p[...] * 15.0
        return m
    tc, dc = cfg(layers), cfg(1)
    return tc, model(tc, 0), dc, model(dc, 5)


def run(eng, prompts, max_tokens: int) -> list[list[int]]:
    from specjax.request import Request
    from specjax.sampling_params import SamplingParams
    vocab = int(eng.cfg.vocab_size)
    sp = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    reqs = [Request(i, None, p, sp, _NoText(), (vocab - 1,), 256, 0) for i, p in enumerate(prompts)]
    eng.run(reqs)
    return [list(map(int, r.output().token_ids)) for r in reqs]


class _NoText:
    """The requests' tokenizer: their text is never read."""

    def decode(self, ids, skip_special_tokens=True):
        return ""


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--tree", default="3/2/6", help="draft depth / top-k / tree tokens (topk 1: a chain)")
    p.add_argument("--steps-per-call", type=int, default=4)
    p.add_argument("--prompts", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--json")
    a = p.parse_args(argv)
    from specjax.drafter import DraftInfo
    from specjax.engine import BatchOptions, CacheOptions, Draft, Engine
    from specjax.scheduler import SchedulerOptions
    from specjax.tree import SpecConfig
    from check_lossless import first_diffs, one_device_slot
    try:
        depth, topk, ntok = (int(x) for x in a.tree.split("/"))
    except ValueError:
        p.error(f"--tree takes depth/topk/tokens, e.g. 3/2/6; got {a.tree!r}")
    cfg, target, dcfg, dmodel = models(a.hidden, a.layers, a.vocab)
    rng = np.random.default_rng(1)
    prompts = [[int(t) for t in rng.integers(0, a.vocab - 1, size=n)] for n in rng.integers(5, 20, size=a.prompts)]
    cache = CacheOptions(page_size=16, max_seq_len=256)
    batch = BatchOptions(max_batch=1, spec_steps_per_call=a.steps_per_call)
    want = run(Engine(target, cfg, cache, batch, jnp.float32), prompts, a.max_tokens)
    spec = SpecConfig(method="draft", num_steps=depth, topk=topk, num_draft_tokens=ntok if topk > 1 else None)
    res = {"backend": jax.default_backend(), "args": vars(a), "plain": want, "states": {}}
    for exact in (True, False):
        with one_device_slot() if exact else contextlib.nullcontext():
            eng = Engine(target, cfg, cache, batch, jnp.float32, draft=Draft(dmodel, dcfg, DraftInfo("draft"), spec),
                         sched=SchedulerOptions(handover=False, unread=1))
        slots = int(eng.state.cache.seq_lens.shape[0])
        got = run(eng, prompts, a.max_tokens)
        diffs = first_diffs(got, want)
        print(f"RESULT slots {slots} match {got == want} first_diff {diffs}", flush=True)
        res["states"][slots] = {"tokens": got, "match": got == want, "first_diff": diffs}
    if a.json:
        Path(a.json).write_text(json.dumps(res))
    return res


if __name__ == "__main__":
    main()
