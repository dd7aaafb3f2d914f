"""Workloads and the timing protocol shared with the peer scripts in ../shared/bench/peers/.

The peers' stdlib-only `_common.py` is imported from that folder at run time (it is not part of
this package), so our numbers use the same prompts, quiet-machine wait, warm-up, median-of-N
timing and JSON schema as tunix's and transformers' runs.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import jax.numpy as jnp
from flax import nnx

from sage_jax import models

_DEFAULT_PEERS = Path(__file__).resolve().parents[2].parent / "shared" / "bench" / "peers"


def peers_module(peers_dir: str | Path | None = None):
    """The peers' `_common` module (from --peers-dir, $SAGE_JAX_PEERS_DIR or ../shared)."""
    d = Path(peers_dir or os.environ.get("SAGE_JAX_PEERS_DIR") or _DEFAULT_PEERS)
    file = d / "_common.py"
    if not file.is_file():
        raise FileNotFoundError(f"peer benchmark helpers not found at {file}; pass --peers-dir")
    spec = importlib.util.spec_from_file_location("_peers_common", file)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def model_config(w: dict) -> models.DecoderConfig:
    """Our DecoderConfig for a workload's "model" entry (Qwen2-shaped)."""
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
    """A random-initialised Decoder of the workload's shape and dtype."""
    dtype = jnp.dtype(w["model"]["dtype"])
    return models.Decoder(model_config(w), dtype=dtype, rngs=nnx.Rngs(seed))
