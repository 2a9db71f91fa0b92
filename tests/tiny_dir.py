"""A tiny random Llama model directory with a real (word-level) tokenizer and a chat template, so
that specjax.LLM, the CLI and the training pipeline run on it in seconds.

Token i is the word "w{i}"; prompts are strings like "w5 w17 w3"; "w96" is EOS (tiny_config)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from helpers import tiny_config

from specjax.checkpoint import save_model_dir
from specjax.models.llama import param_specs

CHAT_TEMPLATE = ("{% for m in messages %}w1 {{ m['content'] }} w2 {% endfor %}"
                 "{% if add_generation_prompt %}w3{% endif %}")


def tiny_hf_config(num_layers: int = 4) -> dict:
    return dict(architectures=["LlamaForCausalLM"], vocab_size=97, hidden_size=32, intermediate_size=64,
                num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                rope_theta=10000.0, tie_word_embeddings=False, eos_token_id=96, rms_norm_eps=1e-6,
                max_position_embeddings=512)


def write_tokenizer(d: Path, vocab_size: int = 97, eos: int = 96) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab_size)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": f"w{eos}", "unk_token": "w0",
        "chat_template": CHAT_TEMPLATE, "model_max_length": 4096}))


def make_tiny_model_dir(d: Path, num_layers: int = 4, seed: int = 0) -> Path:
    hf = tiny_hf_config(num_layers)
    cfg = tiny_config(num_hidden_layers=num_layers)
    rng = np.random.default_rng(seed)  # like helpers.tiny_model (std 0.3 weights), drawn on the host
    flat = {k: (np.ones(shape, np.float32) if len(shape) == 1 else
                (0.3 * rng.standard_normal(shape)).astype(np.float32)) for k, (shape, _) in param_specs(cfg).items()}
    save_model_dir(d, flat, hf, "float32", source="tests/tiny_dir.py")
    write_tokenizer(d)
    return d


def word_prompts(n: int, seed: int = 0, lo: int = 4, hi: int = 12) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(f"w{int(t)}" for t in rng.integers(4, 90, size=int(rng.integers(lo, hi)))) for _ in range(n)]
