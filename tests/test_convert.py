"""Checkpoint conversion (HF safetensors folders, GGUF files) and specjax model directories."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from helpers import one_torch_thread
from specjax.checkpoint import CheckpointError, load_flat, load_model
from specjax.config import ConfigError
from specjax.convert import ConvertError, convert
from specjax.models.llama import flat_state

pytestmark = pytest.mark.filterwarnings("ignore:.*has no tokenizer.json")
TINY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=128, max_position_embeddings=256)


def make_hf(path: Path, arch: str = "llama", shard: bool = False, **overrides) -> dict[str, np.ndarray]:
    """Save a tiny random HF model (every weight random, norms included); returns its state dict."""
    import transformers as tf

    cls = {"llama": (tf.LlamaConfig, tf.LlamaForCausalLM), "mistral": (tf.MistralConfig, tf.MistralForCausalLM),
           "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM), "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM)}[arch]
    torch.manual_seed(0)
    model = cls[1](cls[0](**{**TINY, **overrides}))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    model.save_pretrained(path, max_shard_size="40KB" if shard else "5GB")
    return {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}


def expected_flat(sd: dict[str, np.ndarray], cfg) -> dict[str, np.ndarray]:
    """The layout contract of specjax.models.llama, written out independently of the converter."""
    E, H, K, D = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    out = {"embed": sd["model.embed_tokens.weight"], "norm.scale": sd["model.norm.weight"]}
    if not cfg.tie_word_embeddings:
        out["lm_head"] = sd["lm_head.weight"].T
    for i in range(cfg.num_layers):
        h, p = f"model.layers.{i}.", f"layers.{i}."
        a = h + "self_attn."
        out[p + "attn_norm.scale"] = sd[h + "input_layernorm.weight"]
        out[p + "mlp_norm.scale"] = sd[h + "post_attention_layernorm.weight"]
        out[p + "attn.wq"] = sd[a + "q_proj.weight"].T.reshape(E, H, D)
        out[p + "attn.wk"] = sd[a + "k_proj.weight"].T.reshape(E, K, D)
        out[p + "attn.wv"] = sd[a + "v_proj.weight"].T.reshape(E, K, D)
        out[p + "attn.wo"] = sd[a + "o_proj.weight"].T.reshape(H, D, E)
        if cfg.qkv_bias:
            out[p + "attn.bq"] = sd[a + "q_proj.bias"].reshape(H, D)
            out[p + "attn.bk"] = sd[a + "k_proj.bias"].reshape(K, D)
            out[p + "attn.bv"] = sd[a + "v_proj.bias"].reshape(K, D)
        if cfg.o_bias:
            out[p + "attn.bo"] = sd[a + "o_proj.bias"]
        if cfg.qk_norm:
            out[p + "attn.q_norm.scale"] = sd[a + "q_norm.weight"]
            out[p + "attn.k_norm.scale"] = sd[a + "k_norm.weight"]
        out[p + "mlp.w_gate"] = sd[h + "mlp.gate_proj.weight"].T
        out[p + "mlp.w_up"] = sd[h + "mlp.up_proj.weight"].T
        out[p + "mlp.w_down"] = sd[h + "mlp.down_proj.weight"].T
    return out


def assert_flat_equal(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for k in want:
        np.testing.assert_array_equal(np.asarray(got[k], np.float32), np.asarray(want[k], np.float32), err_msg=k)


# ---------------------------------------------------------------- HF folders

@pytest.mark.parametrize("arch,overrides", [
    ("llama", {}), ("llama", {"tie_word_embeddings": True}), ("llama", {"attention_bias": True}),
    ("mistral", {}), ("qwen2", {}), ("qwen3", {"tie_word_embeddings": True, "head_dim": 32}),
])
def test_hf_convert_exact_f32(tmp_path, arch, overrides):
    sd = make_hf(tmp_path / "hf", arch, **overrides)
    out = convert(tmp_path / "hf", tmp_path / "out", dtype="float32", progress=False)
    cfg, flat = load_flat(out)
    assert cfg.architecture.lower().startswith(arch)
    want = expected_flat(sd, cfg)
    assert all(v.dtype == np.float32 for v in flat.values())
    assert_flat_equal(flat, want)
    cfg2, model = load_model(out)  # round trip through the nnx model
    assert cfg2 == cfg
    got = flat_state(model)
    assert all(v.dtype == np.float32 for v in got.values())
    assert_flat_equal(got, want)
    meta = json.loads((out / "specjax.json").read_text())
    assert meta["dtype"] == "float32" and meta["format_version"] == 1


def test_hf_sharded_and_bf16(tmp_path):
    sd = make_hf(tmp_path / "hf", "llama", shard=True)
    assert (tmp_path / "hf" / "model.safetensors.index.json").exists()
    out = convert(tmp_path / "hf", tmp_path / "out", dtype="bfloat16", progress=False)
    cfg, flat = load_flat(out)
    assert all(str(v.dtype) == "bfloat16" for v in flat.values())
    want = {k: v.astype(flat["embed"].dtype) for k, v in expected_flat(sd, cfg).items()}
    assert_flat_equal(flat, want)
    _, model = load_model(out)  # default: the checkpoint's dtype
    assert all(str(v.dtype) == "bfloat16" for v in flat_state(model).values())
    _, model32 = load_model(out, dtype="float32")
    assert all(v.dtype == np.float32 for v in flat_state(model32).values())
    assert_flat_equal(flat_state(model32), want)


def test_hf_tokenizer_files_copied(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from specjax.checkpoint import load_tokenizer

    make_hf(tmp_path / "hf", "llama")
    vocab = {c: i for i, c in enumerate("abcdefghij ")}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="a"))
    tk.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="j")
    hf_tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    hf_tok.save_pretrained(tmp_path / "hf")
    out = convert(tmp_path / "hf", tmp_path / "out", progress=False)
    tok = load_tokenizer(out)
    assert tok("abc").input_ids == [0, 1, 2] and tok.eos_token == "j"
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == "hi"


def test_hf_extras_ignored_and_unknown_rejected(tmp_path):
    from safetensors.numpy import load_file, save_file

    sd = make_hf(tmp_path / "hf", "llama", tie_word_embeddings=True)
    st = tmp_path / "hf" / "model.safetensors"
    tensors = load_file(st)
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]  # tied copy: ignored
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.ones(8, np.float32)
    save_file(tensors, st)
    cfg, flat = load_flat(convert(tmp_path / "hf", tmp_path / "out", dtype="float32", progress=False))
    assert_flat_equal(flat, expected_flat(sd, cfg))
    tensors["model.layers.0.mlp.extra.weight"] = np.ones(4, np.float32)
    save_file(tensors, st)
    with pytest.raises(ConvertError, match="unexpected.*model.layers.0.mlp.extra.weight"):
        convert(tmp_path / "hf", tmp_path / "out2", progress=False)


def test_hf_errors(tmp_path):
    from safetensors.numpy import load_file, save_file

    with pytest.raises(ConvertError, match="does not exist"):
        convert(tmp_path / "nowhere", tmp_path / "out")
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ConvertError, match="weights.bin"):
        convert(tmp_path / "weights.bin", tmp_path / "out")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConvertError, match="config.json"):
        convert(tmp_path / "empty", tmp_path / "out")

    make_hf(tmp_path / "sharded", "llama", shard=True)
    shard = sorted((tmp_path / "sharded").glob("model-*-of-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(ConvertError, match=f"missing: {shard.name}"):
        convert(tmp_path / "sharded", tmp_path / "out")

    make_hf(tmp_path / "hf", "llama")
    cfg_path = tmp_path / "hf" / "config.json"
    good_cfg = cfg_path.read_text()
    cfg_path.write_text(json.dumps({**json.loads(good_cfg), "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ConfigError, match=r"GPT2LMHeadModel.*supported: LlamaForCausalLM, MistralForCausalLM, "
                                          r"Qwen2ForCausalLM, Qwen3ForCausalLM"):
        convert(tmp_path / "hf", tmp_path / "out")
    cfg_path.write_text(good_cfg)

    st = tmp_path / "hf" / "model.safetensors"
    good = st.read_bytes()
    tensors = load_file(st)
    tensors["model.layers.1.mlp.up_proj.weight"] = np.zeros((96, 32), np.float32)
    save_file(tensors, st)
    with pytest.raises(ConvertError, match=r"model.layers.1.mlp.up_proj.weight has shape \(96, 32\), "
                                           r"expected \(96, 64\)"):
        convert(tmp_path / "hf", tmp_path / "out")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, st)
    with pytest.raises(ConvertError, match="missing.*model.layers.1.mlp.up_proj.weight"):
        convert(tmp_path / "hf", tmp_path / "out")
    for cut in (len(good) - 100, 20, 4):
        st.write_bytes(good[:cut])
        with pytest.raises(ConvertError, match=r"model\.safetensors: corrupt or truncated"):
            convert(tmp_path / "hf", tmp_path / "out")
    assert not (tmp_path / "out").exists()  # nothing written on failure


def test_load_model_errors(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_model(tmp_path / "nowhere")
    make_hf(tmp_path / "hf", "llama")
    out = convert(tmp_path / "hf", tmp_path / "out", progress=False)
    good_cfg = (out / "config.json").read_text()

    (out / "config.json").unlink()
    with pytest.raises(CheckpointError, match="no config.json"):
        load_model(out)
    (out / "config.json").write_text(json.dumps({**json.loads(good_cfg), "tie_word_embeddings": True}))
    with pytest.raises(CheckpointError, match="unexpected 1 parameter.*lm_head"):
        load_model(out)
    (out / "config.json").write_text(json.dumps({**json.loads(good_cfg), "intermediate_size": 128}))
    with pytest.raises(CheckpointError, match=r"layers.0.mlp.w_down: \(96, 64\) != expected \(128, 64\)"):
        load_model(out)
    (out / "config.json").write_text(good_cfg)
    load_model(out)

    for f in (out / "params").rglob("*"):  # corrupt every data file
        if f.is_file() and f.stat().st_size > 0:
            f.write_bytes(b"\0" * 7)
    with pytest.raises(CheckpointError, match="params.*corrupt"):
        load_model(out)
    shutil.rmtree(out / "params")
    with pytest.raises(CheckpointError, match="no params"):
        load_model(out)
    with pytest.raises(CheckpointError, match="unsupported dtype"):
        convert(tmp_path / "hf", tmp_path / "out3", dtype="int8")


# ---------------------------------------------------------------- GGUF (synthetic)

def lcpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf's q/k row order for its interleaved rope."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


GGUF_NAMES = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
              "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
              "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
              "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
              "self_attn.v_proj.bias": "attn_v.bias", "self_attn.q_norm.weight": "attn_q_norm.weight",
              "self_attn.k_norm.weight": "attn_k_norm.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
              "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight"}


def write_gguf(path: Path, sd: dict[str, np.ndarray], arch: str = "llama", tok_model: str = "gpt2",
               raw: dict[str, tuple[np.ndarray, gguf.GGMLQuantizationType]] | None = None, tied: bool = False,
               **t) -> None:
    """A GGUF as llama.cpp writes it: HF tensors renamed, q/k permuted (llama), shapes as ggml ne."""
    H, K = TINY["num_attention_heads"], TINY["num_key_value_heads"]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(TINY["num_hidden_layers"])
    w.add_context_length(TINY["max_position_embeddings"])
    w.add_embedding_length(TINY["hidden_size"])
    w.add_feed_forward_length(TINY["intermediate_size"])
    w.add_head_count(H)
    w.add_head_count_kv(K)
    w.add_key_length(t.get("head_dim", 16))
    w.add_value_length(t.get("head_dim", 16))
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_tokenizer_model(tok_model)
    w.add_tokenizer_pre("smollm")
    alphabet = [chr(c) for c in range(0x21, 0x7F)]  # 94 printable byte-level symbols
    tokens = alphabet + ["Ġ", "ab", "abc"] + [f"<|s{i}|>" for i in range(128 - 97)]
    w.add_token_list(tokens)
    w.add_token_types([1] * 97 + [3] * (128 - 97))
    w.add_token_merges(["a b", "ab c"])
    w.add_bos_token_id(97)
    w.add_eos_token_id(98)
    for name, arr in sd.items():
        if name == "lm_head.weight" and tied:  # llama.cpp writes no output.weight for tied embeddings
            continue
        if name == "lm_head.weight":
            gname = "output.weight"
        elif name in ("model.embed_tokens.weight", "model.norm.weight"):
            gname = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}[name]
        else:
            _, _, i, rest = name.split(".", 3)
            gname = f"blk.{i}.{GGUF_NAMES[rest]}"
            if arch == "llama" and rest.startswith(("self_attn.q_proj", "self_attn.k_proj")):
                arr = lcpp_permute(arr, H if "q_proj" in rest else K)
        if raw and gname in raw:
            w.add_tensor(gname, raw[gname][0], raw_dtype=raw[gname][1])
        else:
            w.add_tensor(gname, np.ascontiguousarray(arr, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("arch,overrides", [("llama", {}), ("llama", {"tie_word_embeddings": True}),
                                            ("qwen2", {}), ("qwen3", {"tie_word_embeddings": True, "head_dim": 16})])
def test_gguf_synthetic_exact(tmp_path, arch, overrides):
    sd = make_hf(tmp_path / "hf", arch, **overrides)
    ref_cfg, _ = load_flat(convert(tmp_path / "hf", tmp_path / "ref", dtype="float32", progress=False))
    write_gguf(tmp_path / "m.gguf", sd, arch, tied=overrides.get("tie_word_embeddings", False))
    out = convert(tmp_path / "m.gguf", tmp_path / "out", dtype="float32", progress=False)
    cfg, flat = load_flat(out)
    assert (cfg.architecture, cfg.tie_word_embeddings, cfg.qk_norm) == (
        ref_cfg.architecture, ref_cfg.tie_word_embeddings, ref_cfg.qk_norm)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size) == (4, 2, 16, 128)
    assert_flat_equal(flat, expected_flat(sd, cfg))
    assert (out / "tokenizer.json").exists() and cfg.bos_token_id == 97 and cfg.eos_token_ids == (98,)


def test_gguf_errors(tmp_path):
    sd = make_hf(tmp_path / "hf", "llama")
    path = tmp_path / "m.gguf"
    write_gguf(path, sd)
    good = path.read_bytes()
    for data in (good[: len(good) // 2], good[:-64], good[:100], b"GGUF" + b"\xff" * 50, b"not a gguf" * 10):
        path.write_bytes(data)
        with pytest.raises(ConvertError, match=r"m\.gguf: corrupt or truncated GGUF"):
            convert(path, tmp_path / "out")
    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q8_1]
    q8_1 = np.zeros((96, 64 // block * size), np.uint8)  # [F, bytes of E values]: gguf.quants has no Q8_1
    write_gguf(path, sd, raw={"blk.0.ffn_up.weight": (q8_1, gguf.GGMLQuantizationType.Q8_1)})
    with pytest.raises(ConvertError, match="blk.0.ffn_up.weight uses quantization type Q8_1.*unsupported"):
        convert(path, tmp_path / "out")
    write_gguf(path, sd, tok_model="bert")
    with pytest.raises(ConvertError, match="tokenizer model 'bert' is not supported"):
        convert(path, tmp_path / "out")
    write_gguf(path, sd, arch="gpt2")
    with pytest.raises(ConvertError, match="architecture 'gpt2' is not supported; supported: llama, qwen2, qwen3"):
        convert(path, tmp_path / "out")
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------- the real default GGUF vs transformers

def test_default_gguf_matches_transformers():
    """Un-permuted q/k (and every other tensor) equal transformers' own GGUF loader's weights."""
    pytest.importorskip("accelerate")  # transformers needs it to load GGUF
    from transformers import AutoModelForCausalLM

    from specjax.default_model import default_gguf_path, ensure_default

    model_dir = ensure_default()
    gguf = default_gguf_path()
    cfg, flat = load_flat(model_dir)
    assert (cfg.architecture, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads) == ("LlamaForCausalLM", 30, 9, 3)
    assert cfg.tie_word_embeddings and "lm_head" not in flat and flat["embed"].dtype == np.float32
    with one_torch_thread():
        hf = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    sd = {k: v.detach().numpy() for k, v in hf.state_dict().items()}
    assert_flat_equal(flat, expected_flat(sd, cfg))
    _, model = load_model(model_dir, dtype="bfloat16")
    wq = flat_state(model)["layers.3.attn.wq"]
    assert str(wq.dtype) == "bfloat16"
    np.testing.assert_array_equal(np.asarray(wq), flat["layers.3.attn.wq"].astype(wq.dtype))
