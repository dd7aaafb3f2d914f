"""The `real` workload's model and prompts: SmolLM2-135M-Instruct as a Hugging Face folder
($SMOL_HF; `scripts/get_smollm2.py` makes it) and its chat-templated GSM8K questions."""

from __future__ import annotations

from pathlib import Path

import transformers

from sage_jax import models
from sage_jax.bench import workloads


def load(w: dict, data_dir: str | Path | None = None):
    """(Decoder, token-id prompts, eos id) of the real workload."""
    d = workloads.model_dir(w)
    tok = transformers.AutoTokenizer.from_pretrained(d)
    return models.from_hf(d), workloads.chat_prompts(w, tok, data_dir), int(tok.eos_token_id)
