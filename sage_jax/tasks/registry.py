"""The task table: `task.name` -> its plug-in. A new task is a module under `tasks/` with a
`TaskPlugin` (and, if it has settings, its own config section, `TaskPlugin.config`), and one line
here. Run configs are loaded through `load_config`, which knows the plug-ins' sections."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Sequence

from sage_jax import config
from sage_jax.config import ConfigError
from sage_jax.tasks import math
from sage_jax.tasks.base import TaskPlugin
from sage_jax.tasks.toy import toy_plugin as toy
from sage_jax.tasks.words import words_plugin as words

TASKS: dict[str, TaskPlugin] = {
    "math": math.PLUGIN,
    "toy": toy.PLUGIN,
    "words": words.PLUGIN,
}

SECTIONS: dict[str, type | None] = {name: p.config for name, p in TASKS.items()}


def load_config(path: str | Path | None = None, overrides: Sequence[str] = (), *,
                saved: bool = False) -> config.Config:
    """`config.load_config` with the plug-ins' `task.<name>` sections (`saved`: a run folder's
    config, its moved keys migrated)."""
    return config.load_config(path, overrides, tasks=SECTIONS, saved=saved)


def from_dict(data: Mapping[str, Any]) -> config.Config:
    """`config.from_dict` with the plug-ins' `task.<name>` sections."""
    return config.from_dict(data, tasks=SECTIONS)


def plugin(name: str) -> TaskPlugin:
    """The plug-in of task `name` (a ConfigError naming task.name when there is none)."""
    try:
        return TASKS[name]
    except KeyError:
        raise ConfigError(f"unknown task {name!r}; known: {', '.join(sorted(TASKS))}",
                          key="task.name") from None
