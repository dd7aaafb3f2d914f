"""A LoRA Decoder's adapters as a PEFT adapter folder (adapter_config.json +
adapter_model.safetensors) that `peft.PeftModel.from_pretrained(base, folder)` loads onto the
Hugging Face base model: the same function as the Decoder, unmerged."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax.numpy as jnp
from flax import nnx
from safetensors.flax import save_file

from sage_jax.models.hub import is_hub_id
from sage_jax.models.decoder import Decoder, Linear, LoraSpec
from sage_jax.models.hf_io import hf_names

# PEFT's names: its wrapper (`base_model`, a LoraModel) around the transformers model (`model`).
PEFT_PREFIX = "base_model.model."
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"


def _adapted(model: Decoder) -> list[tuple[tuple, Linear]]:
    """(parameter path, Linear) of every projection of `model` that has adapters."""
    return [(tuple(path), m) for path, m in nnx.iter_graph(model)
            if isinstance(m, Linear) and m.lora_a is not None]


def peft_tensors(model: Decoder, *, dtype=None) -> dict[str, Any]:
    """{PEFT tensor name: array} of `model`'s adapters, as adapter_model.safetensors holds
    them: `<PEFT_PREFIX><HF module>.lora_{A,B}.weight`, A [r, in] and B [out, r] (the
    transposes of lora_a [in, r] and lora_b [r, out]; the HF module names are those of
    `hf_names`). `dtype` converts them (default: the adapters' own)."""
    modules = {ours[:-1]: hf.removesuffix(".weight")
               for hf, (ours, _) in hf_names(model.cfg).items() if ours[-1] == "kernel"}
    tensors = {}
    for path, m in _adapted(model):
        for ab in ("a", "b"):  # PEFT names lora_a, lora_b with the letter in upper case
            t = getattr(m, f"lora_{ab}")[...].T
            tensors[f"{PEFT_PREFIX}{modules[path]}.lora_{ab.upper()}.weight"] = jnp.asarray(
                t, dtype=dtype or t.dtype)
    return tensors


def peft_config(model: Decoder, lora: LoraSpec, base_model: str | None = None) -> dict[str, Any]:
    """adapter_config.json of `model`'s adapters, which `lora` describes (a ValueError when the
    model's adapters are not its rank, scale and targets); `base_model` is the Hugging Face
    folder (written as an absolute path) or hub id (`org/name[@revision]`) they were trained
    on."""
    adapted = _adapted(model)
    targets = {path[-1] for path, _ in adapted}
    if targets != set(lora.targets):
        raise ValueError(f"the model's adapters are on {sorted(targets) or 'no projection'}, "
                         f"not on {lora}'s targets")
    for path, m in adapted:
        assert m.lora_a is not None
        if m.lora_a.shape[1] != lora.rank or m.lora_scale != lora.alpha / lora.rank:
            raise ValueError(f"the adapters of {'/'.join(map(str, path))} have rank "
                             f"{m.lora_a.shape[1]} and scale {m.lora_scale}, not {lora}'s")
    revision = None
    if base_model is not None and is_hub_id(base_model):
        base_model, _, revision = base_model.partition("@")
    elif base_model is not None:
        base_model = str(Path(base_model).expanduser().resolve())
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lora.rank,
            "lora_alpha": lora.alpha, "target_modules": sorted(targets), "lora_dropout": 0.0,
            "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
            "init_lora_weights": True, "inference_mode": True, "modules_to_save": None,
            "base_model_name_or_path": base_model, "revision": revision or None}


def to_peft(model: Decoder, lora: LoraSpec, out_dir: str | Path, *,
            base_model: str | None = None, dtype=None) -> Path:
    """Writes `model`'s adapters (`lora`) to `out_dir` as a PEFT adapter folder
    (`peft_config`, `peft_tensors`); returns the folder."""
    out = Path(out_dir)
    config = peft_config(model, lora, base_model)
    out.mkdir(parents=True, exist_ok=True)
    save_file(peft_tensors(model, dtype=dtype), str(out / WEIGHTS_FILE),
              metadata={"format": "pt"})
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    return out
