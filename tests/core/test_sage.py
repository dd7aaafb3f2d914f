"""SAGE's pure building blocks (`core.sage`): hint payload parsing, group status, the hint
cache's byte rows."""

import json

import numpy as np
import pytest

from sage_jax.core import sage


# ---- parse_hints ----------------------------------------------------------------------------

@pytest.mark.parametrize("text,expected", [
    ('{"level1": "a", "level2": "b", "level3": "c"}', {1: "a", 2: "b", 3: "c"}),
    ('Sure!\n```json\n{"level1": "a", "level2": "b", "level3": "c"}\n```', {1: "a", 2: "b", 3: "c"}),
    ('{"level1": "a", "level2": "b",}', {1: "a", 2: "b"}),
    ("{'level1': 'a', 'level3': 'c'}", {1: "a", 3: "c"}),
    ('{"1": "a", "2": "", "3": "c"}', {1: "a", 3: "c"}),
    ('{"hints": {"minimal": "a", "medium": "b", "detailed": "c"}}', {1: "a", 2: "b", 3: "c"}),
    ('{"level1": "a", "level2": "b", "level3": "trunc', {1: "a", 2: "b"}),
    ("", None),
    ("no json here", None),
    ("{}", None),
    ('{"level1": ""}', None),
    ('{"level1": ["list"]}', None),
    ("{" * 5000 + "}" * 5000, None),
    ('{"level1": __import__("os").system("echo pwned")}', None),
])
def test_parse_hints(text, expected):
    assert sage.parse_hints(text) == expected


def test_parse_hints_drops_the_levels_the_task_says_leak():
    text = json.dumps({"level1": "Use symmetry.", "level2": "So it is 1/2",
                       "level3": "Half of it: 1/2."})
    leaks = lambda hint: "1/2" in hint  # noqa: E731 - the task's check, here a stand-in
    assert sage.parse_hints(text, leaks) == {1: "Use symmetry."}
    assert sage.parse_hints(text) == {1: "Use symmetry.", 2: "So it is 1/2", 3: "Half of it: 1/2."}
    assert sage.read_payload(text, leaks) == ({1: "Use symmetry."}, 2)
    assert sage.read_payload("no payload", leaks) == ({}, 0)


def test_group_status_non_binary():
    r = np.array([[0.0, 0.0], [1.0, 1.0], [0.2, 0.25], [0.0, 1.0]])
    st = sage.group_status(r, collapse_std=0.05, success_threshold=0.5)
    np.testing.assert_array_equal(st["all_zero"], [True, False, True, False])
    np.testing.assert_array_equal(st["all_one"], [False, True, False, False])
    np.testing.assert_array_equal(st["mixed"], [False, False, False, True])


def test_hint_cache_round_trip():
    row = sage.encode_hint("héllo ∑", 8)
    assert sage.decode_hint(row) == "héllo "  # cut at a character boundary
    assert sage.decode_hint(sage.encode_hint("abc", 16)) == "abc"
    assert sage.decode_hint(sage.encode_hint(None, 4)) is None
