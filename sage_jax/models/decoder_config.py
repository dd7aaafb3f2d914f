"""DecoderConfig: the decoder's hyper-parameters, read from and written to Hugging Face configs."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

# HF architecture name -> our family name.
ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
_FAMILY_TO_ARCH = {v: k for k, v in ARCHITECTURES.items()}
_HF_MODEL_TYPE = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
SUPPORTED_ROPE_TYPES = ("default", "llama3")


class UnsupportedModelError(ValueError):
    """The checkpoint's architecture or one of its options is not supported."""


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
    """Decoder hyper-parameters for the Llama-3.x / Qwen2 / Qwen2.5 / Qwen3 family."""

    family: str  # "llama" | "qwen2" | "qwen3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # llama3 scaling parameters, or None
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2/2.5: True; Llama: `attention_bias`
    o_bias: bool = False  # Llama with attention_bias=True
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm on q and k over head_dim, before RoPE
    max_position_embeddings: int = 4096
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None

    def __post_init__(self):
        if self.family not in _FAMILY_TO_ARCH:
            raise UnsupportedModelError(
                f"unknown model family {self.family!r}; supported: {sorted(_FAMILY_TO_ARCH)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")

    @property
    def architecture(self) -> str:
        return _FAMILY_TO_ARCH[self.family]

    @property
    def eos_ids(self) -> tuple[int, ...]:
        e = self.eos_token_id
        if e is None:
            return ()
        return tuple(e) if isinstance(e, (list, tuple)) else (int(e),)

    def num_params(self) -> int:
        """Number of parameters (embedding and LM head counted once when tied)."""
        d, h, k, hd, f = (self.hidden_size, self.num_heads, self.num_kv_heads, self.head_dim,
                          self.intermediate_size)
        attn = d * hd * (h + 2 * k) + h * hd * d
        attn += (h + 2 * k) * hd * self.qkv_bias + d * self.o_bias + 2 * hd * self.qk_norm
        mlp = 3 * d * f + (2 * f + d) * self.mlp_bias
        per_layer = attn + mlp + 2 * d
        head = 0 if self.tie_word_embeddings else self.vocab_size * d
        return self.vocab_size * d + self.num_layers * per_layer + d + head

    # ---- Hugging Face conversion -------------------------------------------------------------

    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any], *, source: str = "config.json") -> "DecoderConfig":
        """Builds a DecoderConfig from a Hugging Face config.json dict."""
        archs = hf.get("architectures") or []
        arch = archs[0] if archs else None
        if arch not in ARCHITECTURES:
            raise UnsupportedModelError(
                f"{source}: architecture {arch!r} (model_type {hf.get('model_type')!r}) is not "
                f"supported; supported architectures: {sorted(ARCHITECTURES)}")
        family = ARCHITECTURES[arch]
        if hf.get("use_sliding_window"):
            raise UnsupportedModelError(f"{source}: use_sliding_window=true is not supported")
        rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default")) or "default"
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise UnsupportedModelError(
                f"{source}: rope type {rope_type!r} is not supported; supported: "
                f"{list(SUPPORTED_ROPE_TYPES)}")
        theta = float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))
        scaling = None
        if rope_type == "llama3":
            scaling = {k: rope[k] for k in ("factor", "low_freq_factor", "high_freq_factor",
                                            "original_max_position_embeddings")}
        heads = int(hf["num_attention_heads"])
        attention_bias = bool(hf.get("attention_bias", False))
        return cls(
            family=family,
            vocab_size=int(hf["vocab_size"]),
            hidden_size=int(hf["hidden_size"]),
            intermediate_size=int(hf["intermediate_size"]),
            num_layers=int(hf["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or heads),
            head_dim=int(hf.get("head_dim") or hf["hidden_size"] // heads),
            rope_theta=theta,
            rope_scaling=scaling,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=True if family == "qwen2" else attention_bias,
            o_bias=attention_bias if family in ("llama", "qwen3") else False,
            mlp_bias=bool(hf.get("mlp_bias", False)) if family == "llama" else False,
            qk_norm=family == "qwen3",
            max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=hf.get("eos_token_id"),
            pad_token_id=hf.get("pad_token_id"),
        )

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> "DecoderConfig":
        file = Path(path) / "config.json"
        if not file.is_file():
            raise FileNotFoundError(f"no config.json in {path}")
        return cls.from_hf_dict(json.loads(file.read_text()), source=str(file))

    def to_hf_dict(self) -> dict[str, Any]:
        """A config.json dict that `transformers` loads as the matching architecture."""
        rope: dict[str, Any] = {"rope_type": "default", "rope_theta": self.rope_theta}
        if self.rope_scaling:
            rope = {"rope_type": "llama3", "rope_theta": self.rope_theta, **self.rope_scaling}
        hf = {
            "architectures": [self.architecture],
            "model_type": _HF_MODEL_TYPE[self.family],
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_parameters": rope,
            "rope_scaling": None if rope["rope_type"] == "default" else rope,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
        }
        if self.family == "llama":
            hf["attention_bias"] = self.qkv_bias
            hf["mlp_bias"] = self.mlp_bias
        elif self.family == "qwen3":
            hf["attention_bias"] = self.qkv_bias
            hf["use_sliding_window"] = False
        else:
            hf["use_sliding_window"] = False
        return hf
