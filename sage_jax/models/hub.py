"""Model folders from the Hugging Face Hub: `model.path=Qwen/Qwen2.5-7B-Instruct[@revision]`.

A path that is not an existing folder and looks like `org/name[@revision]` is fetched with
`huggingface_hub.snapshot_download` into the standard Hugging Face cache (`HF_HUB_CACHE`, else
`HF_HOME/hub`, else ~/.cache/huggingface/hub), with `HF_TOKEN` for gated models; with
`HF_HUB_OFFLINE=1` only the cache is read. Only configs, safetensors (and their index) and
tokenizer files are fetched: never pickled weights (`.bin`, `.pt`) or code (`.py`). Hub datasets
(`dataset`: the benchmarks' sources) are fetched the same way: data files and README.md only. The
environment is read at each call. Processes on one host that fetch the same model at once share
the download (huggingface_hub locks each file), so the others wait for the first.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import huggingface_hub
from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

ALLOW_PATTERNS = [
    "config.json", "generation_config.json", "*.safetensors", "model.safetensors.index.json",
    "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
    "added_tokens.json", "vocab.json", "vocab.txt", "merges.txt", "chat_template.jinja",
    "chat_template.json", "LICENSE*", "USE_POLICY*", "NOTICE*",
]
DATASET_PATTERNS = ["README.md", "*.parquet", "*.jsonl", "*.json", "*.csv", "LICENSE*"]
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+(@[\w./-]+)?$")


def is_hub_id(path: str | Path) -> bool:
    """Whether `path` reads as `org/name[@revision]` (and is not an existing file or folder)."""
    text = str(path)
    return not Path(text).exists() and bool(_HUB_ID.match(text))


def cache_dir() -> Path:
    """The Hugging Face hub cache this process uses (from the environment, now)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or Path(
        os.environ.get("XDG_CACHE_HOME", "~/.cache")).expanduser() / "huggingface"
    return Path(home).expanduser() / "hub"


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def resolve(path: str | Path, *, config_only: bool = False) -> Path:
    """The local folder of `path`: itself when it exists, else the snapshot of the hub id
    (downloaded, or from the cache when offline; `config_only`: its config.json alone).
    FileNotFoundError when neither works."""
    if Path(path).expanduser().exists() or not is_hub_id(path):
        return Path(path).expanduser()
    repo_id, _, revision = str(path).partition("@")
    return _snapshot(repo_id, revision or None, "model",
                     ["config.json"] if config_only else ALLOW_PATTERNS,
                     what=f"model {path}", instead="point model.path at a folder")


def dataset(repo_id: str, *, revision: str | None = None, instead: str = "pass a local copy"
            ) -> Path:
    """The local snapshot of hub dataset `repo_id` (its data files and README.md, whose
    `configs` name the files of each config and split), downloaded or, offline, from the cache.
    FileNotFoundError (saying `instead`) when neither works."""
    return _snapshot(repo_id, revision, "dataset", DATASET_PATTERNS,
                     what=f"dataset {repo_id}", instead=instead)


def _snapshot(repo_id: str, revision: str | None, repo_type: str, patterns: list[str], *,
              what: str, instead: str) -> Path:
    cache = cache_dir()
    try:
        folder = huggingface_hub.snapshot_download(
            repo_id, repo_type=repo_type, revision=revision, cache_dir=cache,
            local_files_only=_offline(), allow_patterns=patterns,
            token=os.environ.get("HF_TOKEN") or None)
    except LocalEntryNotFoundError:
        why = "HF_HUB_OFFLINE is set" if _offline() else "the hub could not be reached"
        raise FileNotFoundError(f"{what}: not in the Hugging Face cache {cache} and {why}; "
                                f"download it once online, or {instead}") from None
    except (HfHubHTTPError, OSError, ValueError) as e:
        raise FileNotFoundError(f"{what}: could not be fetched from the Hugging Face Hub "
                                f"into {cache} ({type(e).__name__}: {str(e).splitlines()[0]})"
                                ) from None
    return Path(folder)
