"""The sampler's jitted programs, built once per key and kept for the life of the process.

`get(kind, graphdef, knobs, layout, extra)` is the one place a `decode` function is wrapped in
`jax.jit` (with its static arguments and donated buffers); `sampling.sample` runs what it
returns and `analysis.compile_check` compiles it for other devices. jit then keeps one
executable per input shape: `compiled()` counts them and `drop()` frees them.
"""

from __future__ import annotations

import functools

import jax

from sage_jax.engine.sampler import decode, placement
from sage_jax.engine.sampler.sampling_plan import Knobs

KINDS = ("prefill", "start", "segment", "empty", "admit", "regroup", "rows")
TAKE_PARAMS = ("prefill", "segment")  # the kinds built for a model definition (graphdef)
TAKE_KNOBS = ("start", "segment", "admit")  # the kinds built for sampling knobs
# Compiled sampler programs the trainer keeps between steps (`drop`), counted in program-layers:
# a decode program's code grows with the layers it unrolls, about 22 MB of host memory for one
# of SmolLM2-135M's (30 layers), so 48 of those; a 4-layer model keeps 360.
MAX_PROGRAM_LAYERS = 48 * 30
MAX_PROGRAMS = 48  # `drop`'s default limit
_CACHE: dict = {}  # (kind, graphdef, knobs, layout, extra) -> jitted function
_UNHASHABLE: list = []  # [(key, jitted)] for graphdefs that cannot be hashed


def _build(kind: str, graphdef, knobs: Knobs | None, lay: placement.Layout | None, extra):
    if kind == "prefill":
        return jax.jit(functools.partial(decode.prefill, graphdef, lay))
    if kind == "start":  # the prompt keys/values pass through into the state, not copied
        assert extra is not None, "start takes the first cache size"
        return jax.jit(functools.partial(decode.start, knobs, lay, extra), donate_argnums=(0, 1))
    if kind == "segment":
        return jax.jit(functools.partial(decode.segment, graphdef, knobs, lay),
                       donate_argnums=(1,))
    if kind == "empty":
        assert extra is not None, "empty takes (cache size, rows)"
        return jax.jit(functools.partial(decode.empty, lay, *extra))
    if kind == "admit":
        assert extra is not None, "admit takes the rows per prompt"
        return jax.jit(functools.partial(decode.admit, knobs, lay, extra), donate_argnums=(0,))
    if kind == "regroup":
        assert extra is not None, "regroup takes the new cache size"
        return jax.jit(functools.partial(decode.regroup_layer, lay, extra))
    if kind == "rows":
        return jax.jit(functools.partial(decode.regroup_rows, lay))
    raise ValueError(f"unknown sampler program {kind!r}; one of {KINDS}")


def get(kind: str, graphdef=None, knobs: Knobs | None = None,
        lay: placement.Layout | None = None, extra=None):
    """The jitted `decode` program `kind` (one of `KINDS`) for a model definition, knobs, mesh
    layout and extra static argument, built once and cached. A graphdef whose config holds a
    dict (e.g. llama3 `rope_scaling`) is unhashable: found by equality."""
    key = (kind, graphdef, knobs, lay, extra)
    try:
        return _CACHE[key]
    except TypeError:
        for k, fn in _UNHASHABLE:
            if k[0] == kind and k[2:] == key[2:] and (k[1] is graphdef or k[1] == graphdef):
                return fn
    except KeyError:
        pass
    fn = _build(kind, graphdef, knobs, lay, extra)
    try:
        _CACHE[key] = fn
    except TypeError:
        _UNHASHABLE.append((key, fn))
    return fn


def _all() -> list:
    return list(_CACHE.values()) + [fn for _, fn in _UNHASHABLE]


def compiled() -> int:
    """Compiled sampler programs this process holds (every cached program's executables)."""
    return sum(fn._cache_size() for fn in _all())


def budget(num_layers: int) -> int:
    """The programs to keep between steps for a model of `num_layers` layers."""
    return max(MAX_PROGRAMS, MAX_PROGRAM_LAYERS // max(num_layers, 1))


def drop(limit: int = MAX_PROGRAMS) -> bool:
    """Drops every compiled sampler program once more than `limit` are held, and returns
    whether it did. Each prompt length bucket compiles its own (about 22 MB of host memory
    each for SmolLM2-135M, 6 per bucket); the persistent compilation cache, when on, reloads
    the ones needed next instead of compiling them."""
    if compiled() <= limit:
        return False
    for fn in _all():
        fn.clear_cache()
    return True
