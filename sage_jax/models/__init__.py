"""Decoder models (Llama-3.x, Qwen2/2.5, Qwen3), Hugging Face checkpoint I/O and tokenizers."""

from sage_jax.models import hub
from sage_jax.models.decoder_config import ARCHITECTURES, DecoderConfig, UnsupportedModelError
from sage_jax.models.decoder import Decoder, KVCache, apply, init_cache, merge, split
from sage_jax.models.hf_io import (
    ModelFileError, check_model_dir, from_hf, hf_names, hf_tensors, to_hf,
)
from sage_jax.models.tokenizer import Tokenizer

__all__ = [
    "ARCHITECTURES", "ModelFileError", "Decoder", "KVCache", "DecoderConfig", "Tokenizer",
    "UnsupportedModelError", "apply", "check_model_dir", "from_hf", "hf_names", "hf_tensors",
    "hub", "init_cache", "merge", "split", "to_hf",
]
