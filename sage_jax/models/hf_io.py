"""Load a Decoder from, and save it to, a Hugging Face checkpoint (config.json + safetensors)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from safetensors import safe_open
from safetensors.flax import save_file

from sage_jax.models.hub import resolve as resolve_hub_path
from sage_jax.models.decoder_config import DecoderConfig
from sage_jax.models.decoder import Decoder, merge_lora

_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class ModelFileError(ValueError):
    """A model folder's safetensors file is unreadable, or a tensor is missing, unexpected or has
    the wrong shape or dtype; the message names the file and tensor."""


def check_model_dir(path: str | Path) -> Path:
    """The Hugging Face model folder of `path` (a folder, or a hub id `org/name[@revision]`
    fetched into the HF cache: `hub.resolve`) when it holds a config.json; else
    FileNotFoundError."""
    path = resolve_hub_path(path)
    if not path.exists():
        raise FileNotFoundError(f"model folder {path} does not exist")
    if not path.is_dir():
        raise FileNotFoundError(f"model path {path} is a file, not a Hugging Face model folder")
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path}: no config.json (expected a Hugging Face model folder)")
    return path


def _open(file: Path, index: Path | None = None):
    """safe_open of a safetensors file; an unreadable one is a ModelFileError naming it."""
    if not file.is_file():
        where = f" (a shard listed in {index.name})" if index is not None else ""
        raise ModelFileError(f"{file}: missing{where}")
    try:
        return safe_open(file, framework="flax")
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
        shard = f", a shard listed in {index.name}" if index is not None else ""
        raise ModelFileError(f"{file}{shard}: not a readable safetensors file (truncated or "
                              f"corrupt: {str(e).strip().splitlines()[0]})") from None


def hf_names(cfg: DecoderConfig) -> dict[str, tuple[tuple, bool]]:
    """HF tensor name -> (our parameter path, whether the HF tensor is the transposed kernel)."""
    names: dict[str, tuple[tuple, bool]] = {"model.embed_tokens.weight": (("embed_tokens",), False),
                                            "model.norm.weight": (("norm", "weight"), False)}
    if not cfg.tie_word_embeddings:
        names["lm_head.weight"] = (("lm_head", "kernel"), True)
    for i in range(cfg.num_layers):
        hf, ours = f"model.layers.{i}.", ("layers", i)
        for norm in ("input_layernorm", "post_attention_layernorm"):
            names[hf + norm + ".weight"] = (ours + (norm, "weight"), False)
        for proj, has_bias in (("q_proj", cfg.qkv_bias), ("k_proj", cfg.qkv_bias),
                               ("v_proj", cfg.qkv_bias), ("o_proj", cfg.o_bias)):
            names[f"{hf}self_attn.{proj}.weight"] = (ours + ("self_attn", proj, "kernel"), True)
            if has_bias:
                names[f"{hf}self_attn.{proj}.bias"] = (ours + ("self_attn", proj, "bias"), False)
        if cfg.qk_norm:
            for norm in ("q_norm", "k_norm"):
                names[f"{hf}self_attn.{norm}.weight"] = (ours + ("self_attn", norm, "weight"), False)
        for proj in ("gate_proj", "up_proj", "down_proj"):
            names[f"{hf}mlp.{proj}.weight"] = (ours + ("mlp", proj, "kernel"), True)
            if cfg.mlp_bias:
                names[f"{hf}mlp.{proj}.bias"] = (ours + ("mlp", proj, "bias"), False)
    return names


def _tensor_files(path: Path) -> dict[str, Path]:
    """Tensor name -> safetensors file, from an index file or the single model.safetensors."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as e:
            raise ModelFileError(f"{index}: not a safetensors index ({type(e).__name__}: "
                                  f"{e})") from None
        out = {name: path / file for name, file in weight_map.items()}
        for f in sorted(set(out.values())):
            with _open(f, index):
                pass
        return out
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"no *.safetensors in {path} (weights are loaded from safetensors only)")
    out: dict[str, Path] = {}
    for f in files:
        with _open(f) as st:
            out.update({name: f for name in st.keys()})
    return out


def _abstract_model(cfg: DecoderConfig, dtype, compute_dtype, remat: bool = False):
    return nnx.eval_shape(lambda: Decoder(cfg, dtype=dtype, compute_dtype=compute_dtype,
                                          rngs=nnx.Rngs(0), remat=remat))


def from_hf(path: str | Path, *, dtype=jnp.float32, compute_dtype=None,
            remat: bool = False) -> Decoder:
    """Loads a Llama-3.x / Qwen2 / Qwen2.5 / Qwen3 checkpoint directory into a Decoder.

    `dtype` is the parameter dtype; `compute_dtype` defaults to it; `remat`: recompute each
    layer in the backward pass (`Decoder`'s flag).
    """
    path = check_model_dir(path)
    cfg = DecoderConfig.from_hf_dir(path)
    graphdef, abstract = nnx.split(_abstract_model(cfg, dtype, compute_dtype, remat))
    expected = hf_names(cfg)
    files = _tensor_files(path)
    unexpected = [n for n in files if n not in expected and not n.endswith(_IGNORED_SUFFIXES)
                  and not (cfg.tie_word_embeddings and n == "lm_head.weight")]
    if unexpected:
        raise ModelFileError(f"{path}: unexpected tensors for {cfg.architecture}: "
                              f"{unexpected[:5]}{' ...' if len(unexpected) > 5 else ''}")
    flat = dict(nnx.to_flat_state(abstract))
    by_file: dict[Path, list[str]] = {}
    for name in expected:
        if name not in files:
            raise ModelFileError(f"{path}: missing tensor {name!r} for {cfg.architecture}")
        by_file.setdefault(files[name], []).append(name)
    for file, names in by_file.items():
        with _open(file) as st:
            for name in names:
                ours, transpose = expected[name]
                var = flat[ours]
                try:
                    t = st.get_tensor(name)
                except Exception as e:  # noqa: BLE001 - a truncated file fails here
                    raise ModelFileError(f"{file}: tensor {name!r} does not read (truncated or "
                                          f"corrupt: {str(e).strip().splitlines()[0]})") from None
                if not jnp.issubdtype(t.dtype, jnp.floating):
                    raise ModelFileError(f"{file}: tensor {name!r} has dtype {t.dtype}, expected "
                                          f"a floating-point dtype")
                t = t.T if transpose else t
                if tuple(t.shape) != tuple(var.shape):
                    raise ModelFileError(
                        f"{file}: tensor {name!r} has shape {tuple(t.shape)}, expected "
                        f"{tuple(var.shape)} for {cfg.architecture}")
                var.set_value(jnp.asarray(t, dtype=dtype))
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def hf_tensors(cfg: DecoderConfig, params: nnx.State, *, dtype=None) -> dict[str, Any]:
    """{HF tensor name: array} of a decoder's parameters (`hf_names`: kernels transposed), as
    model.safetensors holds them; `dtype` converts them (default: the parameters' own). The
    parameters of a model with LoRA adapters are refused (`merge_lora` folds them in first)."""
    if jax.tree.leaves(nnx.filter_state(params, nnx.LoRAParam)):
        raise ValueError("hf_tensors: the parameters hold LoRA adapters, which a Hugging Face "
                         "checkpoint has no place for: fold them in first (models.merge_lora)")
    flat = dict(nnx.to_flat_state(params))
    tensors = {}
    for name, (ours, transpose) in hf_names(cfg).items():
        t = flat[ours].get_value()
        t = t.T if transpose else t
        tensors[name] = jnp.asarray(t, dtype=dtype or t.dtype)
    return tensors


def to_hf(model: Decoder, out_dir: str | Path, *, dtype=None) -> Path:
    """Writes config.json + model.safetensors that `transformers` loads; returns the folder.

    `dtype` (e.g. jnp.bfloat16) converts the weights; default keeps the parameter dtype. A
    model with LoRA adapters is written with them folded into its kernels (`merge_lora`).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg: DecoderConfig = model.cfg
    tensors = hf_tensors(cfg, nnx.state(merge_lora(model), nnx.Param), dtype=dtype)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    hf = cfg.to_hf_dict()
    hf["torch_dtype"] = str(jnp.dtype(dtype or model.dtype).name)
    (out / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    return out
