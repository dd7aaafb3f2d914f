"""The synthetic workloads' model: a random-initialised Qwen2-shaped `Decoder`."""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from sage_jax import models


def model_config(w: dict) -> models.DecoderConfig:
    """The DecoderConfig of a synthetic workload's model (Qwen2-shaped)."""
    m = w["model"]
    if m["arch"] != "qwen2":
        raise ValueError(f"workload arch {m['arch']!r} is not supported by the benchmark")
    return models.DecoderConfig(
        family="qwen2", vocab_size=m["vocab_size"], hidden_size=m["hidden_size"],
        intermediate_size=m["intermediate_size"], num_layers=m["num_layers"],
        num_heads=m["num_heads"], num_kv_heads=m["num_kv_heads"], head_dim=m["head_dim"],
        rope_theta=m["rope_theta"], rms_norm_eps=m["rms_norm_eps"],
        tie_word_embeddings=m["tie_word_embeddings"], qkv_bias=m["qkv_bias"])


def build_model(w: dict, seed: int = 0) -> models.Decoder:
    """A random-initialised Decoder of the synthetic workload's shape and dtype."""
    dtype = jnp.dtype(w["model"]["dtype"])
    return models.Decoder(model_config(w), dtype=dtype, rngs=nnx.Rngs(seed))
