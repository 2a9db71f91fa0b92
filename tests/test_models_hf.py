"""Model families against Hugging Face transformers: tiny random HF models are saved, converted with
specjax.convert, loaded with specjax.checkpoint.load_model and run over a paged KV cache.

References are the torch forwards of the very same HF models (float32, eager attention), each row
run on its own (no padding on the HF side)."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from specjax.checkpoint import load_model
from specjax.convert import convert
from specjax.kv_cache import init_cache, step_meta

pytestmark = pytest.mark.filterwarnings("ignore:.*has no tokenizer.json")

PAGE_SIZE = 4
T = 14  # padded length of the [2, T] prefill batch
LENS = (14, 9)  # ragged row lengths
MAX_SEQ = 24
BASE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=128, max_position_embeddings=256, initializer_range=0.2,
            rms_norm_eps=1e-5)

FAMILIES = {
    "llama": ("llama", {}),
    "llama3_rope": ("llama", dict(max_position_embeddings=128, rope_scaling=dict(
        rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=32))),
    "llama_tied_bias": ("llama", dict(tie_word_embeddings=True, attention_bias=True)),
    "mistral_window": ("mistral", dict(sliding_window=5)),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", dict(head_dim=32)),  # 4 heads * 32 != hidden 64
}


def build_hf(arch: str, overrides: dict, seed: int = 0):
    import transformers as tf

    cfg_cls, model_cls = {"llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
                          "mistral": (tf.MistralConfig, tf.MistralForCausalLM),
                          "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
                          "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM)}[arch]
    torch.manual_seed(seed)
    cfg = cfg_cls(**{**BASE, **overrides}, attn_implementation="eager")
    model = model_cls(cfg).eval()
    with torch.no_grad():  # HF initializes norms to 1 and biases to 0: make them matter
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.2)
            elif "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
    return model


def hf_reference(model, ids: list[int]):
    """(logits [T, V], hidden states [L+1] of [T, E] (HF: input of layer i; last = normed),
    pre-norm output of the last layer [T, E])."""
    caught = {}
    hook = model.model.norm.register_forward_hook(lambda m, inp, out: caught.__setitem__("pre", inp[0]))
    try:
        with torch.no_grad():
            out = model(torch.tensor([ids]), output_hidden_states=True)
    finally:
        hook.remove()
    hs = [h[0].numpy().astype(np.float64) for h in out.hidden_states]
    return out.logits[0].numpy().astype(np.float64), hs, caught["pre"][0].numpy().astype(np.float64)


@dataclasses.dataclass
class Family:
    name: str
    hf: object
    cfg: object
    model: object
    out_dir: object
    tokens: np.ndarray  # [2, T] int32, right padded with junk tokens (must not matter)
    ref: list  # per row: hf_reference(...)


@pytest.fixture(scope="module", params=list(FAMILIES))
def fam(request, tmp_path_factory):
    name = request.param
    arch, overrides = FAMILIES[name]
    hf = build_hf(arch, overrides)
    d = tmp_path_factory.mktemp(name)
    hf.save_pretrained(d / "hf")
    out = convert(d / "hf", d / "out", dtype="float32", progress=False)
    cfg, model = load_model(out, "float32")
    assert cfg.architecture.lower().startswith(arch)
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, cfg.vocab_size, size=(2, T)).astype(np.int32)  # padding = random junk
    ref = [hf_reference(hf, tokens[b, :n].tolist()) for b, n in enumerate(LENS)]
    return Family(name, hf, cfg, model, out, tokens, ref)


def scattered_cache(cfg, dtype=jnp.float32, seed=0):
    """Cache with 2 slots whose pages are non-contiguous and interleaved (page 0 = trash).
    Unused pages hold garbage so that reading the wrong page shows."""
    pages_per_slot = -(-MAX_SEQ // PAGE_SIZE)
    num_pages = 2 * pages_per_slot + 3
    cache = init_cache(cfg, num_pages=num_pages, page_size=PAGE_SIZE, max_slots=2, max_seq_len=MAX_SEQ,
                       dtype=dtype)
    rng = np.random.default_rng(seed)
    perm = rng.permutation(np.arange(1, num_pages))[: 2 * pages_per_slot]
    table = perm.reshape(2, pages_per_slot).astype(np.int32)
    garbage = lambda a: jnp.asarray(rng.normal(0, 50.0, a.shape), dtype)  # noqa: E731
    return dataclasses.replace(cache, kv=[garbage(a) for a in cache.kv],
                               page_table=jnp.asarray(table))


@nnx.jit(static_argnames=("aux_layers",))
def forward(model, tokens, positions, cache, meta, aux_layers=()):
    h, cache, aux = model(tokens, positions, cache, meta, aux_layers=aux_layers)
    return model.logits(h), h, cache, aux


def run_prefill(model, cfg, tokens, lens, cache=None, aux_layers=()):
    cache = scattered_cache(cfg) if cache is None else cache
    slots = jnp.arange(2, dtype=jnp.int32)
    lens = jnp.asarray(lens, jnp.int32)
    meta = step_meta(cache, slots, lens, tokens.shape[1])
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    logits, h, cache, aux = forward(model, jnp.asarray(tokens), positions, cache, meta, aux_layers=aux_layers)
    cache = dataclasses.replace(cache, seq_lens=cache.seq_lens.at[slots].set(lens))
    return np.asarray(logits, np.float64), np.asarray(h, np.float64), cache, [np.asarray(a, np.float64) for a in aux]


def assert_close(got, want, rel=1e-4, what=""):
    scale = max(1.0, float(np.max(np.abs(want))))
    err = float(np.max(np.abs(got - want)))
    assert err <= rel * scale, f"{what}: max abs err {err:.3g} > {rel:g} * scale {scale:.3g}"


def test_prefill_logits_and_hidden_states(fam):
    L = fam.cfg.num_layers
    aux_layers = (0, 1, L)
    logits, h, _, aux = run_prefill(fam.model, fam.cfg, fam.tokens, LENS, aux_layers=aux_layers)
    assert np.isfinite(logits).all()
    for b, n in enumerate(LENS):
        ref_logits, ref_hs, ref_pre = fam.ref[b]
        assert float(np.std(ref_logits)) > 0.3, "reference logits too flat to be a meaningful check"
        assert_close(logits[b, :n], ref_logits, what=f"{fam.name} row {b} logits")
        assert_close(aux[0][b, :n], ref_hs[0], what=f"{fam.name} row {b} embeddings (aux 0)")
        assert_close(aux[1][b, :n], ref_hs[1], what=f"{fam.name} row {b} input of layer 1")
        assert_close(aux[2][b, :n], ref_pre, what=f"{fam.name} row {b} pre-norm output (aux {L})")
        assert_close(h[b, :n], ref_hs[L], what=f"{fam.name} row {b} final normed hidden")


def test_incremental_decode_matches_full_forward(fam):
    """Prefill all but the last 3 tokens of each row, then feed them one at a time."""
    full_logits, _, _, _ = run_prefill(fam.model, fam.cfg, fam.tokens, LENS)
    pre = [n - 3 for n in LENS]
    logits, _, cache, _ = run_prefill(fam.model, fam.cfg, fam.tokens, pre)
    for b, n in enumerate(pre):
        assert_close(logits[b, :n], full_logits[b, :n], what=f"{fam.name} row {b} shorter prefill")
    slots = jnp.arange(2, dtype=jnp.int32)
    ones = jnp.ones((2,), jnp.int32)
    for step in range(3):
        pos = np.array([n + step for n in pre], np.int32)
        tok = fam.tokens[np.arange(2), pos][:, None]
        meta = step_meta(cache, slots, ones, 1)
        lg, _, cache, _ = forward(fam.model, jnp.asarray(tok), jnp.asarray(pos[:, None]), cache, meta)
        cache = dataclasses.replace(cache, seq_lens=cache.seq_lens + 1)
        lg = np.asarray(lg, np.float64)
        for b in range(2):
            assert_close(lg[b, 0], full_logits[b, pos[b]], what=f"{fam.name} row {b} decode step {step}")
            assert_close(lg[b, 0], fam.ref[b][0][pos[b]], what=f"{fam.name} row {b} decode step {step} vs HF")
    np.testing.assert_array_equal(np.asarray(cache.seq_lens), LENS)


def test_bfloat16_close_to_float32(tmp_path_factory):
    arch, overrides = FAMILIES["llama"]
    hf = build_hf(arch, overrides)
    d = tmp_path_factory.mktemp("bf16")
    hf.save_pretrained(d / "hf")
    out = convert(d / "hf", d / "out", dtype="bfloat16", progress=False)
    cfg, model = load_model(out)
    assert all(str(p.dtype) == "bfloat16" for p in jax.tree.leaves(nnx.state(model, nnx.Param)))
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, cfg.vocab_size, size=(2, T)).astype(np.int32)
    cache = scattered_cache(cfg, jnp.bfloat16)
    assert cache.kv[0].dtype == jnp.bfloat16
    logits, _, _, _ = run_prefill(model, cfg, tokens, LENS, cache=cache)
    for b, n in enumerate(LENS):
        ref_logits = hf_reference(hf, tokens[b, :n].tolist())[0]
        scale = float(np.max(np.abs(ref_logits)))
        err = np.abs(logits[b, :n] - ref_logits)
        assert float(err.max()) < 0.08 * scale, (float(err.max()), scale)
        assert float(err.mean()) < 0.02 * scale, (float(err.mean()), scale)
        # mostly the same argmax (bf16 may flip near-ties)
        agree = np.mean(np.argmax(logits[b, :n], -1) == np.argmax(ref_logits, -1))
        assert agree >= 0.7, agree


@pytest.mark.parametrize("arch,qkv,o", [("Qwen3ForCausalLM", True, True), ("MistralForCausalLM", False, False),
                                        ("Qwen2ForCausalLM", True, False), ("LlamaForCausalLM", True, True)])
def test_attention_bias_flags_follow_hf(arch, qkv, o):
    from specjax.config import ModelConfig
    cfg = ModelConfig.from_hf_dict(dict(architectures=[arch], vocab_size=8, hidden_size=8, intermediate_size=8,
                                        num_hidden_layers=1, num_attention_heads=2, attention_bias=True))
    assert (cfg.qkv_bias, cfg.o_bias) == (qkv, o)
