"""Shared test helpers: tiny random models and a stand-in tokenizer."""
from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from specjax.config import ModelConfig
from specjax.models.llama import Llama


def tiny_config(arch="LlamaForCausalLM", **kw) -> ModelConfig:
    d = dict(architectures=[arch], vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=8, rope_theta=10000.0,
             tie_word_embeddings=False, eos_token_id=96)
    d.update(kw)
    return ModelConfig.from_hf_dict(d)


def tiny_model(cfg: ModelConfig, seed=0, dtype=jnp.float32, std=0.3) -> Llama:
    m = Llama(cfg, dtype, nnx.Rngs(seed))
    # larger weights than the init default so that argmax paths differ between tokens
    for _, p in nnx.iter_graph(m):
        if isinstance(p, nnx.Param) and p[...].ndim > 1:
            p[...] = p[...] * (std / 0.02)
    return m


class IdTokenizer:
    """Tokenizer stand-in for engine tests: token i <-> f"<{i}>"."""
    eos_token_id = None
    chat_template = None

    def encode(self, text, add_special_tokens=False):
        return [int(t) for t in text.replace("<", " ").replace(">", " ").split()]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(f"<{i}>" for i in ids)
