"""Training problems: rows of JSON/JSONL/Parquet files (or a hub dataset) read into `Example`s,
and the deterministic order in which training visits them.

Two layouts are read:
- plain: one field each for problem, answer and (optionally) solution, hint and index; names are
  set in `DataConfig` and may be dotted paths into nested fields (`extra_info.solution`);
- verl: `prompt` is a list of {role, content} chat messages whose last user message is the
  problem; the answer is `reward_model.ground_truth`, the solution `extra_info.solution` and the
  index `extra_info.index`.

The data position is one integer (`position`, examples consumed so far), so it can live in the
train state and a resumed run continues with exactly the batches it would have seen.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import logging
import math
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import datasets
import numpy as np

if TYPE_CHECKING:
    from sage_jax.config import DataConfig

log = logging.getLogger(__name__)


class DataError(ValueError):
    """The training data cannot be read; the message names the file, row and field."""


@dataclasses.dataclass(frozen=True)
class Example:
    """One training problem."""

    problem: str  # The problem text, as shown to the policy (before any chat template).
    answer: str  # Ground-truth final answer, as text.
    solution: str | None  # Reference solution (hints are written from it), if any.
    hint: str | None  # A ready-made hint from the data (hint.source: column), if any.
    index: int  # Stable id: the index field if configured, else the row's position in the files.


# ----------------------------------------------------------------------------------------------
# Reading files.

_EXTENSIONS = {".json": "json", ".jsonl": "json", ".parquet": "parquet"}


def _sources(files: tuple[str, ...] | list[str], fmt: str) -> list[tuple[str, str]]:
    """(source, builder) pairs: local globs expanded, each file's datasets builder decided."""
    sources = []
    for spec in files:
        if fmt == "hub":
            sources.append((spec, "hub"))
            continue
        spec = str(Path(spec).expanduser()) if spec.startswith("~") else spec
        paths = sorted(glob.glob(spec)) if glob.has_magic(spec) else [spec]
        if not paths:
            raise DataError(f"data.train_files pattern {spec!r} matches no files")
        for path in paths:
            suffixes = [s for s in Path(path).suffixes if s not in (".gz", ".bz2", ".xz", ".zst")]
            builder = fmt if fmt in ("parquet", "json") else "json" if fmt == "jsonl" else (
                _EXTENSIONS.get(suffixes[-1] if suffixes else "", ""))
            if not Path(path).exists():
                if fmt == "auto" and not builder and path.count("/") == 1:
                    builder = "hub"  # `owner/name`: a hub dataset id.
                else:
                    raise DataError(f"training data file not found: {path}")
            if not builder:
                raise DataError(f"cannot tell the format of {path} from its name: set data.format "
                                f"to one of json, jsonl, parquet, hub")
            sources.append((path, builder))
    return sources


_CHECKED_BYTES = 1 << 30  # local JSON files up to this size are checked line by line first


def _check_local(path: str, builder: str) -> None:
    """One clear DataError for a local file that is empty, not UTF-8 or not valid JSON(L),
    naming the file and line (the datasets library reports these without the row)."""
    f = Path(path)
    if not f.is_file():
        return
    if f.stat().st_size == 0:
        raise DataError(f"{path} is empty (no rows)")
    if builder != "json" or f.suffix not in (".json", ".jsonl") or (
            f.stat().st_size > _CHECKED_BYTES):
        return
    raw = f.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise DataError(f"{path}:{line}: not UTF-8 text (byte 0x{raw[e.start]:02x})") from None
    if not text.strip():
        raise DataError(f"{path} is empty (no rows)")
    if text.lstrip()[:1] == "[":  # one JSON document (a list of rows)
        try:
            json.loads(text)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{e.lineno}: not valid JSON ({e.msg}, column {e.colno})"
                            ) from None
        return
    try:
        json.loads(text)  # one JSON object (or a single line)
        return
    except json.JSONDecodeError:
        pass
    for n, line in enumerate(text.splitlines(), 1):  # JSON lines: one object per line
        if line.strip():
            try:
                json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{n}: not valid JSON ({e.msg}, column {e.colno})"
                                ) from None


def _read(source: str, builder: str) -> datasets.Dataset:
    """The rows of one file (or hub dataset `name[:split]`) as a `datasets.Dataset`."""
    if builder != "hub":
        _check_local(source, builder)
    try:
        if builder == "hub":
            name, _, split = source.partition(":")
            return datasets.load_dataset(name, split=split or "train")
        return datasets.load_dataset(builder, data_files=source, split="train")
    except Exception as e:  # datasets/pyarrow raise many types; report which file failed.
        what = "a local file, nor a reachable hub dataset" if builder == "hub" else (
            f"readable as a {builder} file")
        raise DataError(f"{source} is not {what}: {type(e).__name__}: {e}") from e


# ----------------------------------------------------------------------------------------------
# Parsing rows.

_MISSING = object()


class _InvalidRow(Exception):
    """A row lacks a required field or has an unusable value (message says which)."""


def _get(row: dict[str, Any], path: str) -> Any:
    """The value at field `path` of `row` (dots descend into nested fields), or _MISSING."""
    if path in row:
        return row[path]
    value: Any = row
    for part in path.split("."):
        if not isinstance(value, dict) or part not in value:
            return _MISSING
        value = value[part]
    return value


def _answer_text(value: Any) -> str | None:
    """A ground-truth answer as text: 27.0 and "27.0" become "27"; None when absent or empty."""
    if isinstance(value, (list, tuple)):
        parts = [_answer_text(v) for v in value]
        return ", ".join(p for p in parts if p) or None
    if value is None or value is _MISSING:
        return None
    if isinstance(value, bool):
        raise _InvalidRow(f"answer must be text or a number, got {value!r}")
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise _InvalidRow(f"answer must be a finite number, got {value!r}")
        return str(int(value)) if value.is_integer() else repr(value)
    if isinstance(value, str):
        text = value.strip()
        if re.fullmatch(r"-?\d+\.0*", text):  # "27.0" -> "27": floats written as text.
            text = text.split(".")[0]
        return text or None
    raise _InvalidRow(f"answer must be text or a number, got {type(value).__name__}")


def _optional_text(value: Any, name: str) -> str | None:
    """An optional text field: None when absent or blank."""
    if value is None or value is _MISSING:
        return None
    if not isinstance(value, str):
        raise _InvalidRow(f"field {name!r} must be text, got {type(value).__name__}")
    return value if value.strip() else None


def _problem_text(value: Any, name: str) -> str:
    text = _optional_text(value, name)
    if text is None:
        raise _InvalidRow(f"missing required field {name!r}")
    return text


def _last_user_message(prompt: Any) -> Any:
    """The content of the last user message of a chat `prompt` (or the prompt, if text)."""
    if isinstance(prompt, str) or prompt is _MISSING or prompt is None:
        return prompt
    users = [m for m in prompt if isinstance(m, dict) and m.get("role") == "user"]
    return users[-1].get("content") if users else None


def _index(value: Any, name: str) -> int:
    if value is None or value is _MISSING:
        raise _InvalidRow(f"missing required field {name!r}")
    try:
        index = int(value)
        if isinstance(value, bool) or index != float(value):
            raise ValueError
    except (TypeError, ValueError):
        raise _InvalidRow(f"field {name!r} must be an integer id, got {value!r}") from None
    return index


def _fields(cfg: DataConfig) -> dict[str, str | None]:
    """Which row field holds what, for the configured layout."""
    if cfg.layout == "verl":
        return dict(problem="prompt", answer="reward_model.ground_truth",
                    solution="extra_info.solution", hint=cfg.hint_key, index="extra_info.index")
    return dict(problem=cfg.problem_key, answer=cfg.answer_key, solution=cfg.solution_key,
                hint=cfg.hint_key, index=cfg.index_key)


def _parse(row: dict[str, Any], cfg: DataConfig, position: int) -> Example:
    """The `Example` of one row; raises `_InvalidRow` naming the field at fault."""
    f = _fields(cfg)
    problem = _get(row, f["problem"])
    if cfg.layout == "verl":
        problem = _last_user_message(problem)
    answer = _answer_text(_get(row, f["answer"]))
    if answer is None:
        raise _InvalidRow(f"missing required field {f['answer']!r}")
    return Example(
        problem=_problem_text(problem, f["problem"]),
        answer=answer,
        solution=_optional_text(_get(row, f["solution"]), f["solution"]) if f["solution"] else None,
        hint=_optional_text(_get(row, f["hint"]), f["hint"]) if f["hint"] else None,
        index=_index(_get(row, f["index"]), f["index"]) if f["index"] else position,
    )


def _check_columns(ds: datasets.Dataset, source: str, cfg: DataConfig) -> None:
    """Fails when a field that every row needs is not a column of the file at all."""
    f = _fields(cfg)
    needed = [f["problem"], f["answer"], f["index"], f["hint"]]
    for path in filter(None, needed):
        if path not in ds.column_names and path.split(".")[0] not in ds.column_names:
            raise DataError(
                f"{source}: no field {path!r} in any row (columns: {', '.join(ds.column_names)}); "
                f"check data.layout and the data.*_key settings")


# ----------------------------------------------------------------------------------------------
# Loading.


def load_examples(
    cfg: DataConfig, *, count_tokens: Callable[[str], int] | None = None
) -> tuple[list[Example], dict[str, Any]]:
    """All examples of `cfg.train_files`, in file order, and counts of what was read and skipped.

    Rows missing a problem or answer raise `DataError` (file, row, field), or are skipped and
    counted with `cfg.skip_invalid`. With `count_tokens` (the caller's measure of a problem's
    rendered prompt), problems longer than `cfg.max_prompt_tokens` are skipped and counted.
    """
    if not cfg.train_files:
        raise DataError("no training data: data.train_files is empty")
    examples: list[Example] = []
    stats: dict[str, Any] = dict(files=[], rows_read=0, examples=0, skipped_invalid=0,
                                 skipped_too_long=0, with_solution=0, with_hint=0)
    first_skip = None
    for source, builder in _sources(cfg.train_files, cfg.format):
        ds = _read(source, builder)
        _check_columns(ds, source, cfg)
        stats["files"].append(source)
        for row_number, row in enumerate(ds):
            position = stats["rows_read"]
            stats["rows_read"] += 1
            try:
                example = _parse(row, cfg, position)
            except _InvalidRow as e:
                message = f"{source}: row {row_number}: {e}"
                if not cfg.skip_invalid:
                    raise DataError(message + " (set data.skip_invalid=true to skip such rows)")
                stats["skipped_invalid"] += 1
                first_skip = first_skip or message
                continue
            if count_tokens is not None and count_tokens(example.problem) > cfg.max_prompt_tokens:
                stats["skipped_too_long"] += 1
                continue
            examples.append(example)
            stats["with_solution"] += example.solution is not None
            stats["with_hint"] += example.hint is not None
    stats["examples"] = len(examples)
    if stats["skipped_invalid"]:
        log.warning("skipped %d invalid rows, the first: %s", stats["skipped_invalid"], first_skip)
    if stats["skipped_too_long"]:
        log.warning("skipped %d problems longer than data.max_prompt_tokens=%d",
                    stats["skipped_too_long"], cfg.max_prompt_tokens)
    if not examples:
        raise DataError(
            f"no usable training examples in {', '.join(stats['files'])}: {stats['rows_read']} "
            f"rows read, {stats['skipped_invalid']} invalid, {stats['skipped_too_long']} longer "
            f"than data.max_prompt_tokens={cfg.max_prompt_tokens}")
    return examples, stats


# ----------------------------------------------------------------------------------------------
# Order.


def epoch_order(num_examples: int, seed: int, epoch: int) -> np.ndarray:
    """The permutation of range(num_examples) that epoch `epoch` visits; a pure function."""
    return np.random.default_rng([seed, epoch]).permutation(num_examples)


def next_batch_indices(
    position: int, batch: int, num_examples: int, seed: int, shuffle: bool = True
) -> tuple[np.ndarray, int]:
    """Indices of the `batch` examples after `position` examples were consumed, and the new
    position. Epoch e covers positions [e * num_examples, (e + 1) * num_examples); a batch that
    crosses an epoch boundary takes the tail of one epoch and the head of the next."""
    if num_examples < 1 or batch < 1 or position < 0:
        raise ValueError(f"need num_examples >= 1, batch >= 1, position >= 0; got "
                         f"{num_examples}, {batch}, {position}")
    parts, pos, end = [], position, position + batch
    while pos < end:
        epoch, offset = divmod(pos, num_examples)
        take = min(end - pos, num_examples - offset)
        order = epoch_order(num_examples, seed, epoch) if shuffle else np.arange(num_examples)
        parts.append(order[offset:offset + take])
        pos += take
    return np.concatenate(parts).astype(np.int64), end
