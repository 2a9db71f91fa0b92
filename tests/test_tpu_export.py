"""Every program the engine runs lowers for TPU (jax.export with platforms=("tpu",) lowers without
the hardware): plain prefill and decode, the speculative prefill, the fused speculative step (tree
verify with the attention kernels, KV compaction, draft extend and growth) and its split halves,
for a draft model and an EAGLE-3 head, built by the same builders the engine uses
(specjax.programs) on tiny models whose attention was resolved for a TPU.

Where the Mosaic TPU attention kernel serves (head_dim a multiple of 128, page size a multiple of
the sublane tile) it is in the program once per layer and call site; elsewhere the jnp reference
is, and resolve says why. KV compaction has no TPU kernel: its jnp reference is in the TPU program
(kv_compact's "auto" picks kernels on GPU only). The final Mosaic compilation of the kernels
happens on a TPU and is not checked here."""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from helpers import tiny_config, tiny_model
from jax import export

from specjax import attention, programs as prog
from specjax.decode import DecodeState, whole_prompts
from specjax.drafter import DraftInfo
from specjax.kernels import Kernels
from specjax.kv_cache import init_cache
from specjax.sampling import SamplingArrays
from specjax.step import init_spec_state
from specjax.tree import SpecConfig

KERNEL = "tpu_custom_call"
B, MAX_SEQ, PS = 2, 64, 16


def _cfg():  # head_dim 128: the TPU kernel's lane width
    return tiny_config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=128, intermediate_size=64)


def _for_tpu(model, cfg, dtype, page_size):
    impl, choice = attention.resolve("auto", backend="tpu", dtype=dtype, page_size=page_size, head_dim=cfg.head_dim)
    return attention.configure(model, impl), choice


def _kernel_calls(text: str) -> int:
    """Attention call sites that run the TPU kernel in an exported module: the kernel is lowered once
    per shape (a jitted function, specjax.attention) and called from every layer."""
    calls = len(re.findall(r"call @paged_attention_tpu(_\d+)?\(", text))
    assert (calls > 0) == (KERNEL in text)
    return calls


def _export(fn, *args, **kw):
    return export.export(fn, platforms=("tpu",))(*args, **kw).mlir_module()


def _samp(n):
    return SamplingArrays(jnp.zeros((n,), jnp.float32), jnp.ones((n,), jnp.float32), jnp.zeros((n,), jnp.int32),
                          jnp.zeros((n,), jnp.uint32))


@pytest.mark.parametrize("dtype,page_size,kernel", [(jnp.bfloat16, PS, True), (jnp.float32, 4, False)])
def test_plain_programs_export_for_tpu(dtype, page_size, kernel):
    cfg = _cfg()
    model, choice = _for_tpu(tiny_model(cfg, dtype=dtype), cfg, dtype, page_size)
    assert choice.name == ("tpu" if kernel else "reference"), choice
    if not kernel:
        assert "page_size 4" in choice.note  # the fallback says why
    progs, w = prog.plain_programs(*nnx.split(model))
    cache = init_cache(cfg, num_pages=B * MAX_SEQ // page_size + 1, page_size=page_size, max_slots=B,
                       max_seq_len=MAX_SEQ, dtype=dtype)
    state = DecodeState(cache, jnp.zeros((B,), jnp.int32))
    slots = jnp.arange(B, dtype=jnp.int32)
    flags = dict(want_logprobs=False, stochastic=True)
    rows = whole_prompts(jnp.zeros((B, 32), jnp.int32), jnp.full((B,), 5, jnp.int32), slots)
    text = _export(progs.prefill, w, state, _samp(B), rows, _samp(B), None, **flags)
    assert _kernel_calls(text) == (cfg.num_layers if kernel else 0)
    text = _export(progs.decode_many, w, state, _samp(B), slots, jnp.ones((B,), bool), None, num_steps=4, **flags)
    assert _kernel_calls(text) == (cfg.num_layers if kernel else 0)  # once per layer in the loop body


def _eagle3_head(cfg):
    from specjax.config import ModelConfig
    from specjax.models.eagle import EagleConfig, EagleHead
    layer = ModelConfig.from_hf_dict(dict(
        architectures=["LlamaForCausalLM"], vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
        intermediate_size=48, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=128,
        rope_theta=10000.0))
    ecfg = EagleConfig(method="eagle3", layer=layer, target_vocab_size=cfg.vocab_size, draft_vocab_size=48,
                       aux_layers=(0, 1, 2), fc_bias=False)
    return EagleHead(ecfg, jnp.bfloat16, nnx.Rngs(1)), ecfg


@pytest.mark.parametrize("method,topk_impl", [("draft", "xla"), ("eagle3", "xla"), ("eagle3", "reduce")])
def test_spec_programs_export_for_tpu(method, topk_impl):
    """topk_impl: the draft's top-k (Kernels.draft_topk; "reduce": one variadic reduction per level)."""
    dtype = jnp.bfloat16
    cfg = _cfg()
    target, _ = _for_tpu(tiny_model(cfg, dtype=dtype), cfg, dtype, PS)
    if method == "draft":  # the target drafts for itself: a Llama-family draft model
        draft, dcfg, info = target, cfg, DraftInfo("draft")
    else:
        head, ecfg = _eagle3_head(cfg)
        draft, _ = _for_tpu(head, ecfg.layer, dtype, PS)
        dcfg, info = ecfg.layer, DraftInfo("eagle3", ecfg.aux_layers)
    spec = SpecConfig(method=method, num_steps=3, topk=2, num_draft_tokens=6)  # a tree: compaction runs
    progs, tw, dw = prog.spec_programs(info, spec, *nnx.split(target), *nnx.split(draft),
                                       kernels=Kernels(draft_topk=topk_impl))
    pages = B * MAX_SEQ // PS + 1
    cache = init_cache(cfg, num_pages=pages, page_size=PS, max_slots=B, max_seq_len=MAX_SEQ, dtype=dtype)
    dkv = init_cache(dcfg, num_pages=pages, page_size=PS, max_slots=B, max_seq_len=MAX_SEQ, dtype=dtype).kv
    state = init_spec_state(cache, dkv, spec, cfg.vocab_size, sample_drafts=False)
    slots, active = jnp.arange(B, dtype=jnp.int32), jnp.ones((B,), bool)
    flags = dict(want_logprobs=False, stochastic=False)
    L, Ld = cfg.num_layers, len(dkv)
    # prefill: target over the prompt, draft extend over it, S - 1 growth steps
    rows = whole_prompts(jnp.zeros((B, 32), jnp.int32), jnp.full((B,), 5, jnp.int32), slots)
    text = _export(progs.prefill, tw, dw, state, _samp(B), rows, _samp(B), None, **flags)
    assert _kernel_calls(text) == L + Ld * spec.num_steps
    # fused step: tree verify (target), draft extend + growth; KV compaction (jnp) in between
    text = _export(progs.step, tw, dw, state, _samp(B), slots, active, None, prog.no_stop(B), num_steps=1, **flags)
    assert _kernel_calls(text) == L + Ld * spec.num_steps
    assert "compact" in text  # the compaction's named scope is in the program
    assert ("chlo.top_k" in text) == (topk_impl == "xla"), topk_impl  # "reduce": no TopK op left
    verified_shapes = jax.eval_shape(progs.verify, tw, state, slots, active)
    text = _export(progs.verify, tw, state, slots, active)
    assert _kernel_calls(text) == L
    verified = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), verified_shapes[0])
    mask = jnp.full((B, spec.num_nodes, (cfg.vocab_size + 31) // 32), -1, jnp.int32)
    text = _export(progs.finish, tw, dw, state, verified, _samp(B), slots, active, mask, **flags)
    assert _kernel_calls(text) == Ld * spec.num_steps
