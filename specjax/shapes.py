"""Named model shapes for benchmarks and tests (random weights; no checkpoint needed)."""
from specjax.config import ModelConfig

SHAPES = {
    # SmolLM2-135M-Instruct (Llama architecture, tied embeddings)
    "smollm2-135m": dict(architectures=["LlamaForCausalLM"], vocab_size=49152, hidden_size=576,
                         intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, rope_theta=100000.0, rms_norm_eps=1e-5,
                         tie_word_embeddings=True, max_position_embeddings=8192),
    # a tiny Llama for CPU smoke runs of the benchmarks (head_dim 64: every attention kernel serves it)
    "tiny": dict(architectures=["LlamaForCausalLM"], vocab_size=512, hidden_size=128, intermediate_size=256,
                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                 tie_word_embeddings=False, max_position_embeddings=4096),
    # Llama-3.1-8B
    "llama3.1-8b": dict(architectures=["LlamaForCausalLM"], vocab_size=128256, hidden_size=4096,
                        intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                        num_key_value_heads=8, rms_norm_eps=1e-5, tie_word_embeddings=False,
                        max_position_embeddings=131072,
                        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                          high_freq_factor=4.0, original_max_position_embeddings=8192),
                        rope_theta=500000.0),
}


def shape_config(name: str) -> ModelConfig:
    if name not in SHAPES:
        raise ValueError(f"unknown model shape {name!r}; known: {sorted(SHAPES)}")
    return ModelConfig.from_hf_dict(SHAPES[name])
