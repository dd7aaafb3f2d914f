"""JAX's persistent compilation cache: compiled programs kept on disk and loaded by later runs
of the same programs (`train.compile_cache`), so only a machine's first run pays for compiles."""

from __future__ import annotations

import os

import jax

ENV = "JAX_COMPILATION_CACHE_DIR"  # JAX's own variable: when set, it wins


def enable(path: str | None) -> str | None:
    """Points JAX's persistent compilation cache at `path` (`~` expanded) and caches every
    program, however quick its compile; None or "" leaves JAX's setting as it is. Returns the
    folder in use (None: no cache)."""
    if os.environ.get(ENV):
        return os.environ[ENV]
    if not path:
        return jax.config.jax_compilation_cache_dir or None
    folder = os.path.expanduser(path)
    jax.config.update("jax_compilation_cache_dir", folder)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    return folder
