"""The SFT warm start of a Hugging Face model on word problems: `warm_started_model(cfg)` is the
word task's starting point for model.path (what `run.build.load_model` returns).

The SFT mix (`sft_examples`) teaches what the RL run needs and the model cannot do yet: the
boxed answer format on problems of every length, answers that go on from a hint, and hint
writing, one level per request (the first l steps of a reference solution, plain text). The
result is cached as a Hugging Face folder (weights, config and the base model's tokenizer
files) under `task.words.cache_dir` (default $SAGE_JAX_CACHE or ~/.cache/sage_jax), keyed by
everything that shapes its weights: the base model's files, the settings, the code it runs
through, the numeric libraries' versions and XLA_FLAGS (`warm_start_settings`).
`weights_sha256(folder)` identifies the weights a run started from.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import os
import shutil
from pathlib import Path

import numpy as np

from sage_jax import models
from sage_jax.engine.trainer import sft_step as sft
from sage_jax.infra import provenance
from sage_jax.models.hf_io import check_model_dir
from sage_jax.tasks.words import problems as wp
from sage_jax.tasks.words.words_config import WordsConfig
from sage_jax.tasks.words.prompts import WordsTask

DESIGN_VERSION = 1  # bump when the prompts, the problems or the SFT recipe change
WARMUP_STEPS = 10
SFT_BUCKET = 64  # rows padded to a multiple of 64 tokens: a few compiled step shapes
# Each layer recomputed in the backward pass and the loss's logits made 64 columns at a time:
# six SFT steps of SmolLM2-135M (batches of 8) peaked at 4,465 MiB instead of 10,556, in
# 250 s instead of 215 s, losses within 1e-6 (docs/bench/words_sft_memory_2026-12-06.json).
SFT_REMAT = True
SFT_LOGPROB_CHUNK = 64
# The libraries whose version can change the warm start's numbers or its tokens.
LIBRARIES = ("jax", "jaxlib", "flax", "optax", "numpy", "transformers", "tokenizers",
             "safetensors")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "generation_config.json", "vocab.json", "merges.txt")


def sft_examples(task: WordsTask, rng: np.random.Generator, n: int, *, max_steps: int,
                 write_share: float, hinted_share: float) -> list[tuple[list[int], list[int]]]:
    """`n` (prompt ids, answer ids) pairs: hint writing (a random level the problem allows),
    hinted answers (the whole solution after a hint of a random level) and plain answers, in the
    given shares, on problems of 1..max_steps steps (uniform). Answers end with EOS."""
    eos = [int(task.eos_ids[0])]
    out = []
    for _ in range(n):
        kind = rng.choice(3, p=[write_share, hinted_share, 1 - write_share - hinted_share])
        p = wp.make_problem(rng, int(rng.integers(1, max_steps + 1)))
        levels = sorted(task.reference_hints(p.problem, p.solution, str(p.answer)))
        if kind < 2 and levels:
            level = levels[int(rng.integers(len(levels)))]
            hint = wp.first_steps(p.solution, level)
            if kind == 0:
                out.append((task.hint_requests(p.problem, p.solution)[level],
                            task.tok.encode(hint) + eos))
                continue
            out.append((task.hinted_prompt(p.problem, hint), task.tok.encode(p.solution) + eos))
            continue
        out.append((task.answer_prompt(p.problem), task.tok.encode(p.solution) + eos))
    return out


def cache_root(cfg) -> Path:
    root = (cfg.task.section(WordsConfig).cache_dir or os.environ.get("SAGE_JAX_CACHE")
            or "~/.cache/sage_jax")
    return Path(root).expanduser()


@functools.cache
def _file_sha256(path: Path, size: int, mtime_ns: int) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


def file_sha256(path: Path) -> str:
    """sha256 of a file's bytes (remembered per path, size and modification time)."""
    st = path.stat()
    return _file_sha256(path.resolve(), st.st_size, st.st_mtime_ns)


def weights_sha256(folder: str | Path) -> str:
    """sha256 over a Hugging Face folder's safetensors files (names and bytes)."""
    h = hashlib.sha256()
    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder}: no .safetensors file")
    for f in files:
        h.update(f.name.encode() + b"\0" + file_sha256(f).encode() + b"\0")
    return h.hexdigest()


def _base_identity(path: Path) -> dict:
    """What identifies the base model: its config (less the fields that name where it was
    converted from or with which transformers), its weights' and tokenizer files' bytes."""
    config = json.loads((path / "config.json").read_text())
    return {"config": {k: v for k, v in config.items()
                       if not k.startswith("_") and k != "transformers_version"},
            "weights": weights_sha256(path),
            "tokenizer": {n: file_sha256(path / n) for n in TOKENIZER_FILES
                          if (path / n).is_file()}}


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def warm_start_settings(cfg) -> dict:
    """Everything that shapes the warm start's weights (its cache key)."""
    w = cfg.task.section(WordsConfig)
    return {"design": DESIGN_VERSION, "base": _base_identity(Path(cfg.model.path).expanduser()),
            "sft_steps": w.sft_steps, "batch_size": w.sft_batch_size, "lr": w.sft_lr,
            "seed": w.sft_seed, "max_steps": w.max_steps, "write_share": w.sft_write_share,
            "hinted_share": w.sft_hinted_share, "warmup": WARMUP_STEPS, "bucket": SFT_BUCKET,
            "remat": SFT_REMAT, "logprob_chunk": SFT_LOGPROB_CHUNK,
            "code": provenance.source_digest(__name__),
            "libraries": {n: _version(n) for n in LIBRARIES},
            "xla_flags": os.environ.get("XLA_FLAGS", "")}


def cache_path(cfg) -> Path:
    blob = json.dumps(warm_start_settings(cfg), sort_keys=True, default=str).encode()
    return cache_root(cfg) / f"words_sft-{hashlib.sha256(blob).hexdigest()[:12]}"


def warm_start_folder(cfg) -> Path:
    """The Hugging Face folder the run starts from: the cached warm start, or model.path itself
    when task.words.sft_steps is 0."""
    if cfg.task.section(WordsConfig).sft_steps == 0:
        return check_model_dir(Path(cfg.model.path).expanduser())
    return cache_path(cfg)


def warm_started_model(cfg, *, dtype=None, compute_dtype=None, progress=print):
    """model.path after the warm start (cached, or trained now and cached); model.path as it is
    when task.words.sft_steps is 0."""
    base = check_model_dir(Path(cfg.model.path).expanduser())
    if cfg.task.section(WordsConfig).sft_steps == 0:
        return models.from_hf(base, dtype=dtype, compute_dtype=compute_dtype,
                              remat=cfg.model.remat)
    path = cache_path(cfg)
    if not (path / "config.json").is_file():
        tmp = path.with_name(path.name + f".tmp{os.getpid()}")
        train_warm_start(cfg, tmp, progress=progress)
        if path.exists():  # another process got there first
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            os.replace(tmp, path)
    else:
        progress(f"warm start: cached SFT model {path}")
    return models.from_hf(path, dtype=dtype, compute_dtype=compute_dtype, remat=cfg.model.remat)


def train_warm_start(cfg, out: str | Path, *, progress=print) -> Path:
    """SFT of model.path on the word-problem mix with the run's settings, saved to `out` as a
    Hugging Face folder (with the base's tokenizer files and `sft.json`: settings, losses,
    time)."""
    w = cfg.task.section(WordsConfig)
    base = check_model_dir(Path(cfg.model.path).expanduser())
    task = WordsTask(models.Tokenizer(base))
    progress(f"warm start: SFT of {base} on word problems ({w.sft_steps} steps of "
             f"{w.sft_batch_size}); saved in {out}")
    model = models.from_hf(base, remat=SFT_REMAT)
    examples = lambda rng, n: sft_examples(  # noqa: E731
        task, rng, n, max_steps=w.max_steps, write_share=w.sft_write_share,
        hinted_share=w.sft_hinted_share)
    model, result = sft.train_sft(model, examples, steps=w.sft_steps,
                                  batch_size=w.sft_batch_size, lr=w.sft_lr, seed=w.sft_seed,
                                  pad_id=task.pad_id, bucket=SFT_BUCKET, warmup=WARMUP_STEPS,
                                  log_every=10, progress=progress,
                                  logprob_chunk=SFT_LOGPROB_CHUNK)
    out = Path(out)
    models.to_hf(model, out)
    for name in TOKENIZER_FILES:
        if (base / name).is_file():
            shutil.copy2(base / name, out / name)
    (out / "sft.json").write_text(json.dumps(
        {"settings": warm_start_settings(cfg), "steps": result.steps,
         "seconds": result.seconds, "losses": result.losses}, default=float, indent=1))
    progress(f"warm start: {result.steps} SFT steps in {result.seconds:.0f}s, last loss "
             f"{np.mean(result.losses[-10:]):.4f}")
    return out
