"""Convert a Hugging Face model folder (config.json + safetensors) to a specjax model directory."""
from __future__ import annotations

import json
import re
import shutil
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import ml_dtypes
import numpy as np
from tqdm import tqdm

from specjax.checkpoint import dtype_name, prepare_out_dir, save_model_dir, DTYPES
from specjax.config import ModelConfig
from specjax.convert import ConvertError
from specjax.models.llama import param_specs

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "chat_template.json", "generation_config.json")
IGNORED = re.compile(r".*rotary_emb\.inv_freq$")
_ST_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
              "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2,
              "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}

Transform = Callable[[np.ndarray], np.ndarray]


def hf_name_map(cfg: ModelConfig) -> dict[str, tuple[str, tuple[int, ...], Transform]]:
    """HF tensor name -> (our flat name, expected HF shape, HF array -> our array)."""
    E, H, K, D = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    specs = param_specs(cfg)

    def t(w: np.ndarray) -> np.ndarray:  # nn.Linear [out, in] -> [in, out]
        return w.T

    def proj_in(n: int) -> Transform:  # [n*D, E] -> [E, n, D]
        return lambda w: w.T.reshape(E, n, D)

    def reshape(*shape: int) -> Transform:
        return lambda w: w.reshape(shape)

    m: dict[str, tuple[str, tuple[int, ...], Transform]] = {
        "model.embed_tokens.weight": ("embed", specs["embed"][0], lambda w: w),
        "model.norm.weight": ("norm.scale", (E,), lambda w: w),
    }
    if "lm_head" in specs:
        m["lm_head.weight"] = ("lm_head", specs["lm_head"][0][::-1], t)
    F = cfg.intermediate_size
    for i in range(cfg.num_layers):
        h, p = f"model.layers.{i}.", f"layers.{i}."
        m[h + "input_layernorm.weight"] = (p + "attn_norm.scale", (E,), lambda w: w)
        m[h + "post_attention_layernorm.weight"] = (p + "mlp_norm.scale", (E,), lambda w: w)
        m[h + "self_attn.q_proj.weight"] = (p + "attn.wq", (H * D, E), proj_in(H))
        m[h + "self_attn.k_proj.weight"] = (p + "attn.wk", (K * D, E), proj_in(K))
        m[h + "self_attn.v_proj.weight"] = (p + "attn.wv", (K * D, E), proj_in(K))
        m[h + "self_attn.o_proj.weight"] = (p + "attn.wo", (E, H * D), lambda w: w.T.reshape(H, D, E))
        if cfg.qkv_bias:
            m[h + "self_attn.q_proj.bias"] = (p + "attn.bq", (H * D,), reshape(H, D))
            m[h + "self_attn.k_proj.bias"] = (p + "attn.bk", (K * D,), reshape(K, D))
            m[h + "self_attn.v_proj.bias"] = (p + "attn.bv", (K * D,), reshape(K, D))
        if cfg.o_bias:
            m[h + "self_attn.o_proj.bias"] = (p + "attn.bo", (E,), lambda w: w)
        if cfg.qk_norm:
            m[h + "self_attn.q_norm.weight"] = (p + "attn.q_norm.scale", (D,), lambda w: w)
            m[h + "self_attn.k_norm.weight"] = (p + "attn.k_norm.scale", (D,), lambda w: w)
        m[h + "mlp.gate_proj.weight"] = (p + "mlp.w_gate", (F, E), t)
        m[h + "mlp.up_proj.weight"] = (p + "mlp.w_up", (F, E), t)
        m[h + "mlp.down_proj.weight"] = (p + "mlp.w_down", (E, F), t)
    assert {v[0] for v in m.values()} == set(specs), "hf_name_map out of sync with param_specs"
    return m


def map_tensors(cfg: ModelConfig, tensors: Iterator[tuple[str, np.ndarray, str]], total: int | None,
                dtype: str, progress: bool = True, ignore: Callable[[str], bool] = lambda n: False
                ) -> dict[str, np.ndarray]:
    """(HF name, array, source file) stream -> our flat dict in dtype, every name and shape checked."""
    np_dtype = np.dtype(DTYPES[dtype_name(dtype)])
    names = hf_name_map(cfg)
    flat: dict[str, np.ndarray] = {}
    unexpected: list[str] = []
    for name, arr, where in tqdm(tensors, total=total, desc="converting", unit="tensor", disable=not progress):
        if name not in names:
            if not (IGNORED.match(name) or ignore(name)
                    or (cfg.tie_word_embeddings and name == "lm_head.weight")):
                unexpected.append(name)
            continue
        ours, shape, fn = names[name]
        if tuple(arr.shape) != tuple(shape):
            raise ConvertError(f"{where}: tensor {name} has shape {tuple(arr.shape)}, expected {tuple(shape)} "
                               f"for {cfg.architecture} with this config")
        flat[ours] = np.ascontiguousarray(fn(np.asarray(arr, np.float32))).astype(np_dtype)
    missing = [n for n, (ours, _, _) in names.items() if ours not in flat]
    if missing:
        raise ConvertError(f"{len(missing)} tensor(s) missing from the checkpoint: {', '.join(missing[:8])}")
    if unexpected:
        raise ConvertError(f"{len(unexpected)} unexpected tensor(s) for {cfg.architecture}: "
                           f"{', '.join(unexpected[:8])}")
    return flat


# ---- safetensors (read directly: numpy memmap, bf16 via ml_dtypes, truncation detected) ----

def read_safetensors_header(path: Path) -> tuple[dict, int]:
    """(header without __metadata__, byte offset of the data) with every tensor's extent checked."""
    size = path.stat().st_size
    try:
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise ValueError("file shorter than the 8-byte header length")
            n = int.from_bytes(raw, "little")
            if n > size - 8:
                raise ValueError(f"header length {n} runs past the end of the file ({size} bytes)")
            header = json.loads(f.read(n))
        header.pop("__metadata__", None)
        data_len = size - 8 - n
        for name, info in header.items():
            start, end = info["data_offsets"]
            count = int(np.prod(info["shape"], dtype=np.int64))
            if info["dtype"] not in _ST_DTYPES:
                raise ValueError(f"tensor {name} has unsupported dtype {info['dtype']}")
            if end > data_len or end - start != count * np.dtype(_ST_DTYPES[info["dtype"]]).itemsize:
                raise ValueError(f"tensor {name} extends past the end of the file (truncated?)")
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
        raise ConvertError(f"{path}: corrupt or truncated safetensors file: {e}") from None
    return header, 8 + n


def iter_safetensors(paths: list[Path]) -> Iterator[tuple[str, np.ndarray, str]]:
    for path in paths:
        header, base = read_safetensors_header(path)
        mm = np.memmap(path, dtype=np.uint8, mode="r")
        for name, info in header.items():
            start, end = info["data_offsets"]
            arr = mm[base + start: base + end].view(_ST_DTYPES[info["dtype"]]).reshape(info["shape"])
            yield name, arr, str(path)
        del mm


def find_weight_files(src: Path) -> list[Path]:
    single = src / "model.safetensors"
    index = src / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError, AttributeError) as e:
            raise ConvertError(f"{index} is not a valid safetensors index: {e}") from None
        missing = [s for s in shards if not (src / s).is_file()]
        if missing:
            raise ConvertError(f"{src}: shard file(s) listed in {index.name} are missing: {', '.join(missing)}")
        return [src / s for s in shards]
    if single.is_file():
        return [single]
    found = sorted(p.name for p in src.glob("*.safetensors"))
    if found:
        raise ConvertError(f"{src}: found {', '.join(found[:4])} but neither model.safetensors nor "
                           "model.safetensors.index.json")
    raise ConvertError(f"{src}: no model.safetensors or model.safetensors.index.json "
                       "(only safetensors checkpoints are supported)")


def convert_hf(src: str | Path, out: str | Path, dtype: str = "bfloat16", progress: bool = True) -> Path:
    src = Path(src)
    dtype = dtype_name(dtype)
    cfg_path = src / "config.json"
    if not cfg_path.is_file():
        raise ConvertError(f"{src} has no config.json (not a Hugging Face model folder)")
    try:
        hf_config = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise ConvertError(f"{cfg_path} is not valid JSON: {e}") from None
    cfg = ModelConfig.from_hf_dict(hf_config)  # ConfigError names unknown architectures
    files = find_weight_files(src)
    total = sum(len(read_safetensors_header(p)[0]) for p in files)
    flat = map_tensors(cfg, iter_safetensors(files), total, dtype, progress)
    out = prepare_out_dir(out)
    copied = [n for n in TOKENIZER_FILES if (src / n).is_file()]
    for n in copied:
        shutil.copyfile(src / n, out / n)
    if "tokenizer.json" not in copied:
        warnings.warn(f"{src} has no tokenizer.json; the converted model has no tokenizer", stacklevel=2)
    return save_model_dir(out, flat, hf_config, dtype, source=str(src.absolute()))
