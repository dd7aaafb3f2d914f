"""A run's policy as a plain Hugging Face folder: config.json, model.safetensors (the
checkpoint's parameters), the base model's tokenizer, generation-config and licence files
(`TOKENIZER_PATTERNS`) and sage_export.json (where it came from); a LoRA run's adapters also
alone, as a PEFT adapter folder in its `ADAPTER_DIR`. What the folders are for and what they
hold for a toy-task run: `python -m sage_jax.export --help`."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import transformers

from sage_jax import models
from sage_jax.config import Config
from sage_jax.run import restore
from sage_jax.tasks import registry

# Files of a Hugging Face model folder that belong to its tokenizer / generation defaults / licence.
TOKENIZER_PATTERNS = (
    "tokenizer*.json", "tokenizer.model", "tokenizer*.model", "vocab.json", "vocab.txt",
    "merges.txt", "special_tokens_map.json", "added_tokens.json", "chat_template.jinja",
    "chat_template.json", "additional_chat_templates/*", "generation_config.json",
    "LICENSE*", "USE_POLICY*", "NOTICE*",
)
EXPORT_INFO = "sage_export.json"
# The subfolder of a LoRA run's export that holds its adapters as a PEFT adapter folder.
ADAPTER_DIR = "adapter"


def copy_tokenizer_files(src: str | Path, out: str | Path) -> list[str]:
    """Copies the tokenizer (and generation-config, licence) files of model folder `src` into
    `out`; returns the copied names (relative to `out`)."""
    src, out = Path(src), Path(out)
    copied = []
    for pattern in TOKENIZER_PATTERNS:
        for f in sorted(src.glob(pattern)):
            if not f.is_file():
                continue
            rel = f.relative_to(src)
            if str(rel) in copied:
                continue
            (out / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(f, out / rel)
            copied.append(str(rel))
    return copied


def _check_tokenizer(out: Path, vocab_size: int) -> str | None:
    """None when `transformers` loads the exported tokenizer and it fits the model, else why not."""
    try:
        tok = transformers.AutoTokenizer.from_pretrained(str(out))
    except Exception as e:  # noqa: BLE001 - transformers raises many kinds
        return f"transformers could not load it ({type(e).__name__}: {e})"
    if len(tok) > vocab_size:
        return (f"it has {len(tok)} tokens but the model's vocabulary has only {vocab_size} "
                f"rows")
    return None


def export_checkpoint(checkpoint: str | Path, out: str | Path, *, dtype: str | None = None,
                      overwrite: bool = False, log=print) -> dict[str, Any]:
    """Exports a training checkpoint (`WORKDIR[/STEP]`, latest step by default) as a Hugging Face
    folder `out`; see `export_policy`."""
    workdir, step = restore.split_checkpoint_path(checkpoint)
    _check_out(out, overwrite)
    cfg, model, step = restore.restore_policy(workdir, step)
    return export_policy(cfg, model, step, out, dtype=dtype, overwrite=overwrite, log=log,
                         source=workdir)


def _base_folder(model_path: str | None) -> Path | None:
    """The local folder of the run's base model (a hub id is looked up in the HF cache), or
    None when it is not there."""
    if not model_path:
        return None
    try:
        folder = models.hub.resolve(model_path)
    except FileNotFoundError:
        return None
    return folder if folder.is_dir() else None


def _check_out(out: str | Path, overwrite: bool) -> None:
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"--out {out} exists and is not a folder")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise FileExistsError(f"--out {out} is not empty; pass --overwrite to write into it")


def export_policy(cfg: Config, model: models.Decoder, step: int, out: str | Path, *,
                  dtype: str | None = None, overwrite: bool = False, log=print,
                  source: str | Path | None = None) -> dict[str, Any]:
    """Writes a restored policy (`restore.restore_policy`'s `(cfg, model, step)`) to `out` as a
    Hugging Face folder: config.json, model.safetensors, the base model's tokenizer files and
    sage_export.json. `dtype` ("float32", "bfloat16") converts the weights; None keeps the
    training dtype. A LoRA run's adapters are folded into the kernels (`models.merge_lora`)
    and also written alone to `out/ADAPTER_DIR` (`models.to_peft`, on the folder the task
    starts from: its `start_folder`, e.g. a warm start, else model.path).
    Returns the export info (the content of sage_export.json)."""
    if dtype not in (None, "float32", "bfloat16"):
        raise ValueError(f"dtype must be float32 or bfloat16, got {dtype!r}")
    _check_out(out, overwrite)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(out / ADAPTER_DIR, ignore_errors=True)  # an earlier export's, when overwriting
    jdtype = None if dtype is None else jnp.dtype(dtype)
    models.to_hf(model, out, dtype=jdtype)
    lora = models.LoraSpec.of(cfg.model.lora)
    start_folder = registry.plugin(cfg.task.name).start_folder
    # the adapters' base: the folder the task starts from (e.g. its warm start), else model.path
    lora_base = (str(start_folder(cfg)) if start_folder is not None and cfg.model.path
                 else cfg.model.path)
    if lora is not None:
        models.to_peft(model, lora, out / ADAPTER_DIR, base_model=lora_base, dtype=jdtype)
    info: dict[str, Any] = {
        "source": None if source is None else str(Path(source).resolve()), "step": int(step),
        "task": cfg.task.name, "method": cfg.rl.method, "base_model": cfg.model.path,
        "dtype": dtype or str(jnp.dtype(model.dtype).name), "hints": "none (hint-free policy)",
        "lora": (f"rank {cfg.model.lora.rank}, alpha {cfg.model.lora.alpha}: merged into the "
                 f"kernels; the adapters alone in {ADAPTER_DIR}/ (PEFT) for the base model "
                 f"{lora_base or f'the {cfg.task.name} task builds'}" if lora else None),
        "adapter": ADAPTER_DIR if lora else None,
        "tokenizer_files": [], "tokenizer": None}
    base = _base_folder(cfg.model.path)
    if not cfg.model.path:
        info["tokenizer"] = (f"none: the run trained the {cfg.task.name} task's built-in model, "
                             f"whose tokenizer is the task's own (the toy task's is the "
                             f"character-level sage_jax.models.CharTokenizer), with no Hugging "
                             f"Face form")
        log(f"note: {cfg.task.name}-task run on its built-in model: no Hugging Face tokenizer "
            f"exists for it; exported the weights and config only")
    elif base is None:
        info["tokenizer"] = f"none: the base model folder {cfg.model.path!r} is not there"
        log(f"warning: the run's base model folder model.path={cfg.model.path!r} does not exist, "
            f"so no tokenizer files were copied; copy them into {out} by hand")
    else:
        copied = copy_tokenizer_files(base, out)
        info["tokenizer_files"] = copied
        problem = (_check_tokenizer(out, model.cfg.vocab_size) if copied
                   else "the base model folder has no tokenizer files")
        if problem:
            info["tokenizer"] = f"copied from {cfg.model.path}, but {problem}"
            log(f"warning: tokenizer from {cfg.model.path}: {problem}. The weights and config "
                f"are exported and load without it; add the missing tokenizer files to {out}")
        else:
            info["tokenizer"] = f"copied from {cfg.model.path}"
    (out / EXPORT_INFO).write_text(json.dumps(info, indent=2) + "\n")
    log(f"exported step {step}{'' if source is None else f' of {source}'} ({cfg.task.name} "
        f"task, {cfg.rl.method}) to {out}: {', '.join(sorted(p.name for p in out.iterdir()))}")
    return info
