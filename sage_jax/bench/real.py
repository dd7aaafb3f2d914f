"""The `real` workload: a trained LLM (SmolLM2-135M-Instruct) on GSM8K chat prompts.

The model folder comes from the workload's `model_dir_env` ($SMOL_HF; `scripts/get_smollm2.py`
makes it). Prompts and the hash of the per-row lengths come from the peers' own
`hf_real_generate.py` (`real_prompts`, `lengths_sha1`), so every engine decodes the same token
ids and greedy outputs can be compared by hash.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import transformers

from sage_jax import models


def peer_script(peers, name: str = "hf_real_generate"):
    """A peer script of the peers' folder as a module (its torch import is inside `main`)."""
    file = Path(peers.HERE) / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"_peers_{name}", file)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def model_dir(w: dict) -> Path:
    """The converted model folder of the workload; a clear error when it is missing."""
    m = w["model"]
    d = Path(os.environ.get(m["model_dir_env"], m["model_dir_default"])).expanduser()
    if not (d / "config.json").is_file():
        raise FileNotFoundError(
            f"the real workload needs SmolLM2-135M-Instruct as a Hugging Face folder at {d} "
            f"(${m['model_dir_env']}); make it with: python scripts/get_smollm2.py --out {d}")
    return d


def load(peers, w: dict):
    """(Decoder, token-id prompts, eos id, peer script module) of the real workload."""
    d = model_dir(w)
    script = peer_script(peers)
    tok = transformers.AutoTokenizer.from_pretrained(d)
    return (models.from_hf(d), script.real_prompts(w, tok), int(tok.eos_token_id), script)
