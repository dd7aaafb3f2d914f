"""The frame of the entry commands: host malloc tuned first (`host_memory.tune_malloc`), and one
error epilogue: a user's mistake is one line on stderr and exit status 2, not a traceback (set
SAGE_JAX_DEBUG=1 to get the traceback)."""

from __future__ import annotations

import os
import sys
from typing import Callable, TypeVar

from sage_jax.infra import host_memory

T = TypeVar("T")


def run_command(fn: Callable[[], T], errors: tuple[type[BaseException], ...]) -> T:
    """`fn()` (after `host_memory.tune_malloc`); an exception of `errors` prints
    `error: <message>` and exits with status 2."""
    host_memory.tune_malloc()
    try:
        return fn()
    except errors as e:
        if os.environ.get("SAGE_JAX_DEBUG"):
            raise
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
