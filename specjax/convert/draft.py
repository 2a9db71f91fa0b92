"""Convert an EAGLE-1 or EAGLE-3 draft head (config.json + pytorch_model.bin or *.safetensors) to a
specjax draft directory (see specjax.checkpoint.save_draft_dir).

Key layouts (detected from the tensor names):
  EAGLE-1 (EAGLE repo): fc.{weight [E, 2E], bias}, layers.0.self_attn.{q,k,v,o}_proj.*,
      layers.0.post_attention_layernorm.weight, layers.0.mlp.{gate,up,down}_proj.weight
  EAGLE-3 (EAGLE-3 repo, SpecForge): fc.weight [E, 3E], midlayer.{input_layernorm, hidden_norm,
      post_attention_layernorm}.weight, midlayer.self_attn.* (q/k/v over 2E), midlayer.mlp.*,
      norm.weight, lm_head.weight [Vd, E], d2t [Vd] int64 offsets, t2d [V] bool
embed_tokens.weight is ignored in both: the head uses the target's embedding.
"""
from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import numpy as np

from specjax.checkpoint import DTYPES, dtype_name, save_draft_dir
from specjax.config import ConfigError
from specjax.convert import ConvertError
from specjax.convert.hf import iter_safetensors, read_safetensors_header
from specjax.models.eagle import EagleConfig, param_specs

# unused by the head's forward: the target's embedding replaces embed_tokens; EAGLE-1's layer 0
# skips its input norm; rotary caches are recomputed
IGNORED = re.compile(r"^(embed_tokens\.weight|layers\.0\.input_layernorm\.weight|.*rotary_emb\.inv_freq)$")

Transform = Callable[[np.ndarray], np.ndarray]


def detect_method(names) -> str:
    """'eagle' | 'eagle3' from the tensor names of a head checkpoint."""
    names = set(names)
    if any(n.startswith("midlayer.") for n in names):
        return "eagle3"
    if "fc.weight" in names and any(n.startswith("layers.0.") for n in names):
        return "eagle"
    shown = ", ".join(sorted(names)[:8]) or "no tensors"
    raise ConvertError(f"not an EAGLE-1 or EAGLE-3 head: expected fc.weight with layers.0.* (EAGLE-1) or "
                       f"midlayer.* (EAGLE-3); found {shown}")


def draft_name_map(cfg: EagleConfig) -> dict[str, tuple[str, tuple[int, ...], Transform]]:
    """Source tensor name -> (our flat name, expected source shape, source array -> our array)."""
    lc = cfg.layer
    E, H, K, D, F = lc.hidden_size, lc.num_heads, lc.num_kv_heads, lc.head_dim, lc.intermediate_size
    specs = param_specs(cfg)
    Ei = specs["attn.wq"][0][0]
    keep = lambda w: w  # noqa: E731
    t = lambda w: w.T  # noqa: E731 - nn.Linear [out, in] -> [in, out]
    p = "midlayer." if cfg.method == "eagle3" else "layers.0."
    m = {"fc.weight": ("fc.w", specs["fc.w"][0][::-1], t)}
    if cfg.fc_bias:
        m["fc.bias"] = ("fc.b", (E,), keep)
    if cfg.method == "eagle3":
        m[p + "input_layernorm.weight"] = ("attn_norm.scale", (E,), keep)
        m[p + "hidden_norm.weight"] = ("hidden_norm.scale", (E,), keep)
        m["norm.weight"] = ("norm.scale", (E,), keep)
        m["lm_head.weight"] = ("lm_head", (cfg.draft_vocab_size, E), t)
        m["d2t"] = ("d2t", (cfg.draft_vocab_size,), keep)
    a = p + "self_attn."
    m[a + "q_proj.weight"] = ("attn.wq", (H * D, Ei), lambda w: w.T.reshape(Ei, H, D))
    m[a + "k_proj.weight"] = ("attn.wk", (K * D, Ei), lambda w: w.T.reshape(Ei, K, D))
    m[a + "v_proj.weight"] = ("attn.wv", (K * D, Ei), lambda w: w.T.reshape(Ei, K, D))
    m[a + "o_proj.weight"] = ("attn.wo", (E, H * D), lambda w: w.T.reshape(H, D, E))
    if lc.qkv_bias:
        m[a + "q_proj.bias"] = ("attn.bq", (H * D,), lambda w: w.reshape(H, D))
        m[a + "k_proj.bias"] = ("attn.bk", (K * D,), lambda w: w.reshape(K, D))
        m[a + "v_proj.bias"] = ("attn.bv", (K * D,), lambda w: w.reshape(K, D))
    if lc.o_bias:
        m[a + "o_proj.bias"] = ("attn.bo", (E,), keep)
    m[p + "post_attention_layernorm.weight"] = ("mlp_norm.scale", (E,), keep)
    m[p + "mlp.gate_proj.weight"] = ("mlp.w_gate", (F, E), t)
    m[p + "mlp.up_proj.weight"] = ("mlp.w_up", (F, E), t)
    m[p + "mlp.down_proj.weight"] = ("mlp.w_down", (E, F), t)
    assert {v[0] for v in m.values()} == set(specs), "draft_name_map out of sync with eagle.param_specs"
    return m


def map_draft_tensors(cfg: EagleConfig, tensors: dict[str, np.ndarray], where: str,
                      dtype: str = "float32") -> dict[str, np.ndarray]:
    """Source tensors -> our flat dict (floats in dtype, d2t int32), names, shapes and vocab maps checked."""
    np_dtype = np.dtype(DTYPES[dtype_name(dtype)])
    names = draft_name_map(cfg)
    missing = [n for n in names if n not in tensors]
    unexpected = [n for n in tensors if n not in names and not IGNORED.match(n) and n != "t2d"]
    kind = "EAGLE-3" if cfg.method == "eagle3" else "EAGLE-1"
    if missing:
        raise ConvertError(f"{where}: {len(missing)} tensor(s) missing for an {kind} head: {', '.join(missing[:8])}")
    if unexpected:
        raise ConvertError(f"{where}: {len(unexpected)} unexpected tensor(s) for an {kind} head with this "
                           f"config: {', '.join(sorted(unexpected)[:8])}")
    flat = {}
    for name, (ours, shape, fn) in names.items():
        arr = np.asarray(tensors[name])
        if tuple(arr.shape) != tuple(shape):
            raise ConvertError(f"{where}: tensor {name} has shape {tuple(arr.shape)}, expected {tuple(shape)} "
                               f"for an {kind} head with this config")
        if ours == "d2t":
            flat[ours] = arr.astype(np.int32)
        else:
            flat[ours] = np.ascontiguousarray(fn(arr.astype(np.float32))).astype(np_dtype)
    if cfg.method == "eagle3":
        _check_vocab_maps(cfg, flat["d2t"], tensors.get("t2d"), where)
    return flat


def _check_vocab_maps(cfg: EagleConfig, d2t: np.ndarray, t2d, where: str) -> None:
    V, Vd = cfg.target_vocab_size, cfg.draft_vocab_size
    target = np.arange(Vd) + d2t
    if target.min() < 0 or target.max() >= V:
        raise ConvertError(f"{where}: d2t maps draft ids outside the target vocab [0, {V})")
    if t2d is None:
        return
    t2d = np.asarray(t2d).astype(bool)
    if t2d.shape != (V,):
        raise ConvertError(f"{where}: t2d has shape {tuple(t2d.shape)}, expected ({V},) (the target vocab_size)")
    if int(t2d.sum()) != Vd:
        raise ConvertError(f"{where}: t2d marks {int(t2d.sum())} target ids, expected draft_vocab_size={Vd}")
    if not t2d[target].all():
        raise ConvertError(f"{where}: d2t and t2d disagree (d2t maps to target ids that t2d does not mark)")


def read_head_tensors(src: Path) -> tuple[dict[str, np.ndarray], str]:
    """({name: array}, description of the file(s)) from pytorch_model.bin or *.safetensors."""
    st = sorted(src.glob("*.safetensors"))
    if st:
        for p in st:
            read_safetensors_header(p)  # ConvertError names a corrupt file
        return {n: np.asarray(a) for n, a, _ in iter_safetensors(st)}, ", ".join(str(p) for p in st)
    binf = src / "pytorch_model.bin"
    if binf.is_file():
        import torch
        try:
            sd = torch.load(binf, map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 - torch raises many types for broken files
            raise ConvertError(f"{binf}: cannot read: {type(e).__name__}: {e}") from None
        if not isinstance(sd, dict):
            raise ConvertError(f"{binf}: expected a state dict, found {type(sd).__name__}")
        out = {}
        for k, v in sd.items():
            v = v.detach().cpu()
            if v.dtype.is_floating_point:
                v = v.float()
            out[k] = v.numpy()
        return out, str(binf)
    raise ConvertError(f"{src}: no weight file (expected pytorch_model.bin or *.safetensors)")


def convert_draft(src: str | Path, out: str | Path, dtype: str = "bfloat16", progress: bool = True) -> Path:
    """Convert an EAGLE-1/EAGLE-3 head folder to a specjax draft directory at `out`; returns `out`."""
    src = Path(src)
    dtype = dtype_name(dtype)
    if not src.is_dir():
        raise ConvertError(f"draft source {src} is not a folder (expected config.json + weights)")
    cfg_path = src / "config.json"
    if not cfg_path.is_file():
        raise ConvertError(f"{src} has no config.json")
    try:
        hf_config = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise ConvertError(f"{cfg_path} is not valid JSON: {e}") from None
    tensors, where = read_head_tensors(src)
    method = detect_method(tensors)
    attn = ("midlayer." if method == "eagle3" else "layers.0.") + "self_attn."
    sj = {"method": method, "aux_layers": None, "fc_bias": "fc.bias" in tensors,
          "qkv_bias": attn + "q_proj.bias" in tensors, "o_bias": attn + "o_proj.bias" in tensors}
    try:
        cfg = EagleConfig.from_hf_dict({**hf_config, "specjax_draft": sj}, None)
    except ConfigError as e:
        raise ConvertError(f"{cfg_path}: {e}") from None
    sj["aux_layers"] = list(cfg.aux_layers) or None
    flat = map_draft_tensors(cfg, tensors, where, dtype)
    if progress:
        print(f"converted {method} head: {len(flat)} tensors from {where}")
    return save_draft_dir(out, flat, {**hf_config, "specjax_draft": sj}, dtype, source=str(src.absolute()))
