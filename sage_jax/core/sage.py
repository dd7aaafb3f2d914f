"""SAGE building blocks: group status, hint payload parsing, per-prompt hint levels.

Everything here is a pure function of arrays or strings; `rollout.py` wires them to the sampler.
Shapes: B prompts in the step, G answers per prompt, E training examples (the dataset's prompts).
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Callable

import numpy as np

LEVELS = (1, 2, 3)


# ---- group status ---------------------------------------------------------------------------

COLLAPSE_MIXED, COLLAPSE_ALL_ZERO, COLLAPSE_ALL_ONE = 0, 1, 2  # a group's first-pass status codes

def group_status(rewards_BxG, *, collapse_std: float = 0.0, success_threshold: float = 0.0):
    """Per-prompt masks from one rollout's rewards.

    Returns a dict of bool [B] arrays:
      resolved: some answer scored > success_threshold;
      collapsed: reward std <= collapse_std (0: all rewards exactly equal);
      all_zero: collapsed and unresolved (advantage collapse on failure: needs a hint);
      all_one: collapsed and resolved; mixed: not collapsed.
    """
    r = np.asarray(rewards_BxG, np.float64)
    resolved = r.max(axis=1) > success_threshold
    spread = r.std(axis=1)
    collapsed = (spread <= collapse_std) if collapse_std > 0 else (r.max(1) == r.min(1))
    return {"resolved": resolved, "collapsed": collapsed, "all_zero": collapsed & ~resolved,
            "all_one": collapsed & resolved, "mixed": ~collapsed}


# ---- hint payloads --------------------------------------------------------------------------

_FENCE = re.compile(r"```(?:json|JSON)?\s*(.*?)```", re.S)
_LEVEL_KEYS = {
    1: ("1", "level1", "level_1", "level 1", "l1", "minimal", "hint1", "hint_1"),
    2: ("2", "level2", "level_2", "level 2", "l2", "medium", "hint2", "hint_2"),
    3: ("3", "level3", "level_3", "level 3", "l3", "detailed", "hint3", "hint_3"),
}
MAX_HINT_CHARS = 4000


def _candidates(text: str):
    """JSON-object-like substrings: fenced blocks first, then the outermost {...} spans."""
    for m in _FENCE.finditer(text):
        yield m.group(1).strip()
    depth, start = 0, None
    for i, ch in enumerate(text):
        if ch == "{":
            if depth == 0:
                start = i
            depth += 1
        elif ch == "}" and depth:
            depth -= 1
            if depth == 0:
                yield text[start:i + 1]
    if start is not None and depth:  # truncated payload: close it
        yield text[start:] + "}" * depth


def _loads(s: str):
    """json.loads, then with trailing commas removed, then as a Python literal (single quotes)."""
    s = s.strip()
    for attempt in (s, re.sub(r",\s*([}\]])", r"\1", s)):
        try:
            return json.loads(attempt)
        except (json.JSONDecodeError, RecursionError):
            pass
        try:  # literal_eval parses data only (no names, calls or operators): never executes text
            return ast.literal_eval(attempt)
        except (ValueError, SyntaxError, MemoryError, RecursionError, TypeError):
            pass
    return None


_PAIR = re.compile(r'(["\'])([\w \-]{1,20})\1\s*:\s*"((?:[^"\\]|\\.)*)"', re.S)


def _pairs(s: str) -> dict:
    """Complete "key": "value" pairs of a broken or truncated object (a last resort)."""
    out = {}
    for m in _PAIR.finditer(s):
        try:
            out[m.group(2)] = json.loads('"' + m.group(3) + '"')
        except json.JSONDecodeError:
            continue
    return out


def _level_of(key) -> int | None:
    k = str(key).strip().lower()
    for level, names in _LEVEL_KEYS.items():
        if k in names:
            return level
    return None


def parse_hints(text: str, leaks: Callable[[str], bool] | None = None
                ) -> dict[int, str] | None:
    """The {1: str, 2: str, 3: str} hint levels in a policy's JSON payload, or None.

    Accepts a fenced or bare JSON object, trailing commas, single quotes and partial payloads
    (missing or empty levels are absent). A level whose text `leaks` (the task's check that a hint
    gives the final answer away) is dropped. None when no level is usable.
    """
    if not isinstance(text, str) or not text.strip() or len(text) > 200_000:
        return None
    for cand in _candidates(text):
        obj = _loads(cand)
        if obj is None:
            obj = _pairs(cand)
        if isinstance(obj, dict) and len(obj) == 1:
            inner = next(iter(obj.values()))
            if isinstance(inner, dict) and _level_of(next(iter(obj))) is None:
                obj = inner  # {"hints": {...}}
        if not isinstance(obj, dict):
            continue
        hints: dict[int, str] = {}
        for key, value in obj.items():
            level = _level_of(key)
            if level is None or not isinstance(value, (str, int, float)):
                continue
            value = str(value).strip()
            if not value or len(value) > MAX_HINT_CHARS:
                continue
            if leaks is not None and leaks(value):
                continue
            hints[level] = value
        if hints:
            return dict(sorted(hints.items()))
    return None


def read_payload(text: str, leaks: Callable[[str], bool]) -> tuple[dict[int, str], int]:
    """`parse_hints(text, leaks)` as a dict ({} when nothing parses), and how many levels it
    refused for leaking the answer."""
    kept = parse_hints(text, leaks) or {}
    return kept, len(parse_hints(text) or {}) - len(kept)


# ---- SAGE-light levels ----------------------------------------------------------------------

def sage_light_levels(level_E, last_acc_E, seen_E, *, low: float = 0.1, high: float = 0.35,
                      max_level: int = 3):
    """Next per-prompt hint levels: none the first time; +1 when acc <= low, -1 when acc > high."""
    level = np.asarray(level_E, np.int32)
    acc = np.asarray(last_acc_E, np.float32)
    up = np.asarray(seen_E) & (acc <= low)
    down = np.asarray(seen_E) & (acc > high)
    new = np.clip(level + up.astype(np.int32) - down.astype(np.int32), 0, max_level)
    return np.where(np.asarray(seen_E), new, 0).astype(np.int8)


# ---- hint cache as arrays -------------------------------------------------------------------

def encode_hint(text: str | None, width: int) -> np.ndarray:
    """UTF-8 bytes of `text` in a zero-padded uint8 [width] row (truncated at a char boundary)."""
    row = np.zeros((width,), np.uint8)
    if text:
        data = text.encode("utf-8")[:width]
        data = data.decode("utf-8", errors="ignore").encode("utf-8")
        row[:len(data)] = np.frombuffer(data, np.uint8)
    return row


def decode_hint(row) -> str | None:
    data = bytes(np.asarray(row, np.uint8)).rstrip(b"\0")
    return data.decode("utf-8", errors="ignore") if data else None
