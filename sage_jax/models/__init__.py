"""Decoder models (Llama-3.x, Qwen2/2.5, Qwen3), Hugging Face checkpoint I/O (and PEFT adapter
folders of LoRA models) and tokenizers."""

from sage_jax.models import hub
from sage_jax.models.decoder_config import ARCHITECTURES, DecoderConfig, UnsupportedModelError
from sage_jax.models.decoder import (
    LORA_TARGETS, Decoder, KVCache, LoraSpec, apply, init_cache, merge, merge_lora,
    merged_params, split, with_lora,
)
from sage_jax.models.hf_io import (
    ModelFileError, check_model_dir, from_hf, hf_names, hf_tensors, to_hf,
)
from sage_jax.models.peft_io import peft_config, peft_tensors, to_peft
from sage_jax.models.tokenizer import Tokenizer

__all__ = [
    "ARCHITECTURES", "LORA_TARGETS", "ModelFileError", "Decoder", "KVCache", "DecoderConfig",
    "LoraSpec", "Tokenizer", "UnsupportedModelError", "apply", "check_model_dir", "from_hf",
    "hf_names", "hf_tensors", "hub", "init_cache", "merge", "merge_lora", "merged_params", "peft_config",
    "peft_tensors", "split", "to_hf", "to_peft", "with_lora",
]
