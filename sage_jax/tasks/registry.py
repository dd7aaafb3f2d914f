"""The task table: `task.name` -> its plug-in. A new task is a module under `tasks/` with a
`TaskPlugin`, and one line here (and its name in `config.TaskConfig.name`'s choices)."""

from __future__ import annotations

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


def plugin(name: str) -> TaskPlugin:
    """The plug-in of task `name` (a ConfigError naming task.name when there is none)."""
    try:
        return TASKS[name]
    except KeyError:
        raise ConfigError(f"unknown task {name!r}; known: {', '.join(sorted(TASKS))}",
                          key="task.name") from None
