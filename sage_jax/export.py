"""`python -m sage_jax.export --checkpoint WORKDIR[/STEP] --out DIR`: a plain HF checkpoint.

Writes DIR/config.json and DIR/model.safetensors (the policy's parameters at the checkpoint's
step; latest step by default) plus the base model's tokenizer files copied from the run's
`model.path` (tokenizer*.json, vocab/merges, tokenizer.model, special_tokens_map.json,
added_tokens.json, chat template files, generation_config.json and licence files), so that
`transformers.AutoModelForCausalLM.from_pretrained(DIR)` and `AutoTokenizer.from_pretrained(DIR)`
load it and serving stacks (vLLM, SGLang, TGI) can run it. DIR/sage_export.json records where it
came from.

Hints are a training-time device only: the policy is the same network with or without them, so
the export is the hint-free policy, prompted with the bare problem.

A toy-task run has no Hugging Face tokenizer (its tokenizer is the library's character-level
`CharTokenizer`): the export then holds the weights and config only, and says so.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path
from typing import Any

__all__ = ["TOKENIZER_PATTERNS", "copy_tokenizer_files", "export_checkpoint", "export_policy",
           "main", "split_checkpoint_path"]

# Files of a Hugging Face model folder that belong to its tokenizer / generation defaults / licence.
TOKENIZER_PATTERNS = (
    "tokenizer*.json", "tokenizer.model", "tokenizer*.model", "vocab.json", "vocab.txt",
    "merges.txt", "special_tokens_map.json", "added_tokens.json", "chat_template.jinja",
    "chat_template.json", "additional_chat_templates/*", "generation_config.json",
    "LICENSE*", "USE_POLICY*", "NOTICE*",
)
EXPORT_INFO = "sage_export.json"


def split_checkpoint_path(path: str | Path) -> tuple[Path, int | None]:
    """(run folder, step or None for the latest) of `WORKDIR`, `WORKDIR/STEP` or
    `WORKDIR/checkpoints/STEP`."""
    path = Path(path)
    if (path / "config.yaml").is_file():
        return path, None
    if path.name.isdigit():
        parent = path.parent
        if parent.name == "checkpoints" and (parent.parent / "config.yaml").is_file():
            return parent.parent, int(path.name)
        if (parent / "config.yaml").is_file():
            return parent, int(path.name)
    if not path.exists():
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    raise FileNotFoundError(f"{path} is not a training run folder (no config.yaml): expected "
                            f"WORKDIR or WORKDIR/STEP of a `python -m sage_jax.train` run")


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
        import transformers
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
    from sage_jax import build

    workdir, step = split_checkpoint_path(checkpoint)
    _check_out(out, overwrite)
    cfg, model, step = build.restore_policy(workdir, step)
    return export_policy(cfg, model, step, out, dtype=dtype, overwrite=overwrite, log=log,
                         source=workdir)


def _check_out(out: str | Path, overwrite: bool) -> None:
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"--out {out} exists and is not a folder")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise FileExistsError(f"--out {out} is not empty; pass --overwrite to write into it")


def export_policy(cfg, model, step: int, out: str | Path, *, dtype: str | None = None,
                  overwrite: bool = False, log=print,
                  source: str | Path | None = None) -> dict[str, Any]:
    """Writes a restored policy (`build.restore_policy`'s `(cfg, model, step)`) to `out` as a
    Hugging Face folder: config.json, model.safetensors, the base model's tokenizer files and
    sage_export.json. `dtype` ("float32", "bfloat16") converts the weights; None keeps the
    training dtype. Returns the export info (the content of sage_export.json)."""
    import jax.numpy as jnp

    from sage_jax import models

    if dtype not in (None, "float32", "bfloat16"):
        raise ValueError(f"dtype must be float32 or bfloat16, got {dtype!r}")
    _check_out(out, overwrite)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    models.to_hf(model, out, dtype=None if dtype is None else jnp.dtype(dtype))
    info: dict[str, Any] = {
        "source": None if source is None else str(Path(source).resolve()), "step": int(step),
        "task": cfg.task.name, "method": cfg.rl.method, "base_model": cfg.model.path,
        "dtype": dtype or str(jnp.dtype(model.dtype).name), "hints": "none (hint-free policy)",
        "tokenizer_files": [], "tokenizer": None}
    if cfg.task.name == "toy" and not cfg.model.path:
        info["tokenizer"] = ("none: a toy-task model uses the library's character-level "
                             "CharTokenizer (sage_jax.models.char_tokenizer), which has no "
                             "Hugging Face form")
        log("note: toy-task run: no Hugging Face tokenizer exists for it (character-level "
            "CharTokenizer); exported the weights and config only")
    elif not cfg.model.path or not Path(cfg.model.path).is_dir():
        info["tokenizer"] = f"none: the base model folder {cfg.model.path!r} is not there"
        log(f"warning: the run's base model folder model.path={cfg.model.path!r} does not exist, "
            f"so no tokenizer files were copied; copy them into {out} by hand")
    else:
        copied = copy_tokenizer_files(cfg.model.path, out)
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


def main(argv=None) -> dict[str, Any]:
    p = argparse.ArgumentParser(prog="python -m sage_jax.export", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True, metavar="WORKDIR[/STEP]",
                   help="training run folder (its latest checkpoint), or WORKDIR/STEP")
    p.add_argument("--out", required=True, help="folder to write the Hugging Face checkpoint to")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                   help="weights dtype (default: the run's model.dtype)")
    p.add_argument("--overwrite", action="store_true", help="write into a non-empty --out")
    args = p.parse_args(argv)
    from sage_jax import config as config_lib
    try:
        return export_checkpoint(args.checkpoint, args.out, dtype=args.dtype,
                                 overwrite=args.overwrite)
    except (FileNotFoundError, FileExistsError, ValueError, config_lib.ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
