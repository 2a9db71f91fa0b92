"""Convert a llama.cpp GGUF file (llama / qwen2 / qwen3 architectures) to a specjax model directory.

Tensors are dequantized to float32 with gguf.quants and mapped to HF names, then go through the HF
mapping (specjax.convert.hf). GGUF numpy arrays are row-major with shape = reversed(ggml ne), i.e. a
weight with ne = [in, out] reads as [out, in], the HF nn.Linear layout. llama.cpp's converter permutes
the rows of attn_q / attn_k (llama arch only) for its interleaved rope; we undo that here.
"""
from __future__ import annotations

import json
import re
import warnings
from pathlib import Path
from typing import Any, Iterator

import gguf
import numpy as np

from specjax.checkpoint import dtype_name, prepare_out_dir, save_model_dir
from specjax.config import ModelConfig
from specjax.convert import ConvertError
from specjax.convert.hf import map_tensors

ARCHITECTURES = {"llama": ("LlamaForCausalLM", "llama"), "qwen2": ("Qwen2ForCausalLM", "qwen2"),
                 "qwen3": ("Qwen3ForCausalLM", "qwen3")}
_LAYER_MAP = {  # blk.{i}.<gguf> -> model.layers.{i}.<hf>
    "attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias", "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias", "attn_output.bias": "self_attn.o_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_TOP_MAP = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
            "output.weight": "lm_head.weight"}
_BLK = re.compile(r"blk\.(\d+)\.(.+)")
_NO_VALUE = object()


def open_gguf(path: Path) -> gguf.GGUFReader:
    try:
        return gguf.GGUFReader(path)
    except Exception as e:  # noqa: BLE001 - the reader raises ValueError/IndexError/... on bad files
        raise ConvertError(f"{path}: corrupt or truncated GGUF file ({type(e).__name__}: {e})") from None


def meta(reader: gguf.GGUFReader, key: str, default: Any = _NO_VALUE) -> Any:
    field = reader.fields.get(key)
    if field is None:
        if default is _NO_VALUE:
            raise ConvertError(f"GGUF metadata lacks the required key {key!r}")
        return default
    return field.contents()


def hf_config_from_gguf(reader: gguf.GGUFReader) -> dict:
    """HF-style config.json dict from GGUF metadata."""
    arch = meta(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise ConvertError(f"GGUF architecture {arch!r} is not supported; supported: {', '.join(ARCHITECTURES)}")
    names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in names:
        raise ConvertError("GGUF carries rope_freqs.weight (Llama 3.1-style rope scaling), which the GGUF "
                           "converter does not support; convert the HF checkpoint instead")

    def a(key: str, default: Any = _NO_VALUE) -> Any:
        return meta(reader, f"{arch}.{key}", default)

    heads, kv_heads = a("attention.head_count"), a("attention.head_count_kv", None)
    if isinstance(heads, list) or isinstance(kv_heads, list):
        raise ConvertError("per-layer attention head counts are not supported")
    embd = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if embd is None:
        raise ConvertError("GGUF has no token_embd.weight tensor")
    hidden, vocab = int(embd.shape[0]), int(embd.shape[1])  # ne = [E, V]
    head_dim = a("attention.key_length", None) or hidden // int(heads)
    hf_arch, model_type = ARCHITECTURES[arch]
    cfg: dict[str, Any] = {
        "architectures": [hf_arch], "model_type": model_type, "hidden_act": "silu",
        "hidden_size": int(a("embedding_length")), "intermediate_size": int(a("feed_forward_length")),
        "num_hidden_layers": int(a("block_count")), "num_attention_heads": int(heads),
        "num_key_value_heads": int(kv_heads or heads), "head_dim": int(head_dim),
        "rms_norm_eps": float(a("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(a("rope.freq_base", 10000.0)), "vocab_size": vocab,
        "max_position_embeddings": int(a("context_length", 4096)),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names and arch == "llama",
    }
    if cfg["hidden_size"] != hidden:
        raise ConvertError(f"token_embd.weight has hidden size {hidden}, metadata says {cfg['hidden_size']}")
    scaling = a("rope.scaling.type", None)
    if scaling and scaling != "none":
        if scaling != "linear":
            raise ConvertError(f"GGUF rope scaling {scaling!r} is not supported (only 'linear')")
        cfg["rope_scaling"] = {"rope_type": "linear", "factor": float(a("rope.scaling.factor"))}
    bos = meta(reader, "tokenizer.ggml.bos_token_id", None)
    eos = [meta(reader, f"tokenizer.ggml.{k}_token_id", None) for k in ("eos", "eot")]
    eos = list(dict.fromkeys(int(e) for e in eos if e is not None))
    if bos is not None:
        cfg["bos_token_id"] = int(bos)
    if eos:
        cfg["eos_token_id"] = eos[0] if len(eos) == 1 else eos
    return cfg


def unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation: rows [n, D/2, 2] (interleaved) -> [n, 2, D/2] (halves).

    w: [n*D, E] weight or [n*D] bias, as read from the GGUF."""
    rest = w.shape[1:]
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *rest).swapaxes(1, 2).reshape(w.shape)


def hf_name(name: str) -> str:
    if name in _TOP_MAP:
        return _TOP_MAP[name]
    m = _BLK.fullmatch(name)
    if m and m.group(2) in _LAYER_MAP:
        return f"model.layers.{m.group(1)}.{_LAYER_MAP[m.group(2)]}"
    return name  # unknown: reported by map_tensors under its GGUF name


def iter_gguf_tensors(reader: gguf.GGUFReader, cfg: ModelConfig, arch: str, path: Path
                      ) -> Iterator[tuple[str, np.ndarray, str]]:
    for t in reader.tensors:
        try:
            w = gguf.quants.dequantize(t.data, t.tensor_type)  # float32, shape reversed(ne)
        except NotImplementedError:
            raise ConvertError(f"{path}: tensor {t.name} uses quantization type {t.tensor_type.name}, "
                               "which cannot be dequantized (unsupported)") from None
        w = w.reshape([int(n) for n in reversed(t.shape)])
        part = t.name.split(".")
        if arch == "llama" and len(part) == 4 and part[2] in ("attn_q", "attn_k"):
            w = unpermute(w, cfg.num_heads if part[2] == "attn_q" else cfg.num_kv_heads)
        yield hf_name(t.name), w, f"{path} ({t.name})"


# ---- tokenizer: HF tokenizer.json rebuilt from tokenizer.ggml.* metadata (byte-level BPE only) ----

_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# tokenizer.ggml.pre -> how text is split before BPE (llama.cpp's pre-tokenizer families)
PRE_TOKENIZERS = {
    **dict.fromkeys(("default", "gpt-2", "gpt2", "phi-2"), "gpt2"),
    **dict.fromkeys(("smollm", "starcoder", "refact", "codeshell"), "gpt2-digits"),
    **dict.fromkeys(("llama3", "llama-bpe", "llama-v3", "smaug-bpe", "falcon3"), "llama3"),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen"), "qwen2"),
}
CONTROL, USER_DEFINED = 3, 4  # llama.cpp token types


def _pre_tokenizer(pre: str | None):
    from tokenizers import Regex, pre_tokenizers as pt

    kind = PRE_TOKENIZERS.get(pre or "default")
    if kind is None:
        raise ConvertError(f"GGUF pre-tokenizer {pre!r} is not supported; supported: {', '.join(PRE_TOKENIZERS)}")
    if kind == "gpt2":
        return pt.ByteLevel(add_prefix_space=False, use_regex=True), False
    if kind == "gpt2-digits":  # digits split one by one, then the GPT-2 regex (SmolLM, StarCoder)
        return pt.Sequence([pt.Digits(individual_digits=True),
                            pt.ByteLevel(add_prefix_space=False, use_regex=True)]), False
    split = _LLAMA3_SPLIT if kind == "llama3" else _QWEN2_SPLIT
    seq = pt.Sequence([pt.Split(Regex(split), behavior="isolated", invert=False),
                       pt.ByteLevel(add_prefix_space=False, use_regex=False)])
    return seq, kind == "llama3"  # Llama 3 takes whole-word vocab hits before merges


def build_tokenizer_files(reader: gguf.GGUFReader) -> dict[str, str]:
    """{file name: text} of tokenizer.json, tokenizer_config.json, generation_config.json; {} if none."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, processors

    model = meta(reader, "tokenizer.ggml.model", None)
    if model is None:
        warnings.warn("GGUF has no tokenizer metadata; the converted model has no tokenizer", stacklevel=2)
        return {}
    if model != "gpt2":
        raise ConvertError(f"GGUF tokenizer model {model!r} is not supported; supported: 'gpt2' (byte-level BPE)")
    tokens: list[str] = meta(reader, "tokenizer.ggml.tokens")
    types: list[int] = meta(reader, "tokenizer.ggml.token_type", None) or [1] * len(tokens)
    if len(types) != len(tokens):
        raise ConvertError(f"GGUF has {len(tokens)} tokens but {len(types)} token types")
    merges = [tuple(m.split(" ", 1)) for m in meta(reader, "tokenizer.ggml.merges")]
    vocab: dict[str, int] = {}
    for i, tok in enumerate(tokens):
        vocab.setdefault(tok, i)
    pre, ignore_merges = _pre_tokenizer(meta(reader, "tokenizer.ggml.pre", None))
    tk = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False,
                              ignore_merges=ignore_merges))
    tk.pre_tokenizer = pre
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens([AddedToken(t, special=True, normalized=False)
                           for t, ty in zip(tokens, types, strict=True) if ty == CONTROL])
    tk.add_tokens([AddedToken(t, special=False, normalized=False)
                   for t, ty in zip(tokens, types, strict=True) if ty == USER_DEFINED])

    def tok_of(key: str) -> str | None:
        i = meta(reader, f"tokenizer.ggml.{key}_token_id", None)
        return tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else None

    special = {f"{k}_token": tok_of(key) for k, key in
               (("bos", "bos"), ("eos", "eos"), ("unk", "unknown"), ("pad", "padding"))}
    add_bos = bool(meta(reader, "tokenizer.ggml.add_bos_token", False)) and special["bos_token"] is not None
    add_eos = bool(meta(reader, "tokenizer.ggml.add_eos_token", False)) and special["eos_token"] is not None
    single, pair = ["$A"], ["$A", "$B:1"]
    if add_bos:
        single, pair = [special["bos_token"]] + single, [special["bos_token"], "$A", special["bos_token"], "$B:1"]
    if add_eos:
        single, pair = single + [special["eos_token"]], pair + [special["eos_token"]]
    used = {t for t in (special["bos_token"], special["eos_token"]) if t and (add_bos or add_eos)}
    tk.post_processor = processors.TemplateProcessing(
        single=single, pair=pair, special_tokens=[(t, vocab[t]) for t in sorted(used)])
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False,
        "add_bos_token": add_bos, "add_eos_token": add_eos,
        **{k: v for k, v in special.items() if v is not None},
    }
    template = meta(reader, "tokenizer.chat_template", None)
    if template:
        config["chat_template"] = template
    gen = {k: int(v) for k, v in (("bos_token_id", meta(reader, "tokenizer.ggml.bos_token_id", None)),
                                  ("eos_token_id", meta(reader, "tokenizer.ggml.eos_token_id", None)),
                                  ("pad_token_id", meta(reader, "tokenizer.ggml.padding_token_id", None)))
           if v is not None}
    return {"tokenizer.json": tk.to_str(pretty=True), "tokenizer_config.json": json.dumps(config, indent=2),
            "generation_config.json": json.dumps(gen, indent=2)}


def convert_gguf(src: str | Path, out: str | Path, dtype: str = "bfloat16", progress: bool = True) -> Path:
    path = Path(src)
    dtype = dtype_name(dtype)
    reader = open_gguf(path)
    try:
        hf_config = hf_config_from_gguf(reader)
        tok_files = build_tokenizer_files(reader)  # fails fast on an unsupported tokenizer
    except ConvertError as e:
        raise ConvertError(f"{path}: {e}") from None
    cfg = ModelConfig.from_hf_dict(hf_config)
    arch = meta(reader, "general.architecture")
    flat = map_tensors(cfg, iter_gguf_tensors(reader, cfg, arch, path), len(reader.tensors), dtype, progress)
    out = prepare_out_dir(out)
    for name, text in tok_files.items():
        (out / name).write_text(text + "\n")
    return save_model_dir(out, flat, hf_config, dtype, source=str(path.absolute()))
