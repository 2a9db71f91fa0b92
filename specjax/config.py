"""Model configuration read from a checkpoint's HF-style config.json."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


class ConfigError(ValueError):
    """A config.json that specjax cannot serve."""


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    kind: str = "default"  # default | linear | llama3
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope: RopeConfig = RopeConfig()
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    max_position_embeddings: int = 4096
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @property
    def q_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    @classmethod
    def from_hf_dict(cls, d: dict) -> "ModelConfig":
        archs = d.get("architectures") or []
        arch = archs[0] if archs else None
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ConfigError(
                f"unknown architecture {arch!r} (model_type={d.get('model_type')!r}); "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        try:
            hidden = int(d["hidden_size"])
            heads = int(d["num_attention_heads"])
            kv_heads = int(d.get("num_key_value_heads") or heads)
            head_dim = int(d.get("head_dim") or hidden // heads)
            cfg = dict(
                architecture=arch,
                vocab_size=int(d["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(d["intermediate_size"]),
                num_layers=int(d["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=kv_heads,
                head_dim=head_dim,
            )
        except KeyError as e:
            raise ConfigError(f"config.json lacks the required key {e.args[0]!r}") from None
        if heads % kv_heads:
            raise ConfigError(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
        if d.get("mlp_bias"):
            raise ConfigError("mlp_bias=True is not supported")
        if d.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"hidden_act={d.get('hidden_act')!r} is not supported (only 'silu')")
        window = d.get("sliding_window")
        if arch.startswith("Qwen") and d.get("use_sliding_window"):
            raise ConfigError("use_sliding_window=True (Qwen per-layer windows) is not supported")
        if arch != "MistralForCausalLM":
            window = None
        eos = d.get("eos_token_id")
        eos = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (int(eos),))
        attn_bias = bool(d.get("attention_bias", False))
        return cls(
            **cfg,
            rope=_rope_from_hf(d),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            # Mistral has no attention biases; Qwen2 always has q/k/v biases (never o).
            qkv_bias=(attn_bias and arch != "MistralForCausalLM") or arch == "Qwen2ForCausalLM",
            o_bias=attn_bias and arch in ("LlamaForCausalLM", "Qwen3ForCausalLM"),
            qk_norm=arch == "Qwen3ForCausalLM",
            sliding_window=int(window) if window else None,
            max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos,
        )

    @classmethod
    def from_file(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        if not path.exists():
            raise FileNotFoundError(f"missing config file: {path}")
        try:
            d = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path} is not valid JSON: {e}") from None
        return cls.from_hf_dict(d)


def _rope_from_hf(d: dict) -> RopeConfig:
    # transformers >= 5 writes rope_parameters; older files rope_theta + rope_scaling.
    params = dict(d.get("rope_parameters") or {})
    scaling = d.get("rope_scaling") or {}
    params = {**scaling, **params}
    theta = float(params.get("rope_theta", d.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    if kind not in SUPPORTED_ROPE_TYPES:
        raise ConfigError(f"rope type {kind!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    return RopeConfig(
        theta=theta,
        kind=kind,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(params.get("original_max_position_embeddings", 8192)),
    )
