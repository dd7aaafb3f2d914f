"""The task table: every shipped config loads through it, with the plug-ins' own sections."""

from __future__ import annotations

import pytest

from sage_jax import config
from sage_jax.tasks import registry
from sage_jax.tasks.toy.toy_config import ToyConfig
from sage_jax.tasks.words.words_config import WordsConfig

SHIPPED = sorted(p.stem for p in config.CONFIG_DIR.glob("*.yaml"))


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_configs_load_and_round_trip(name, tmp_path):
    cfg = registry.load_config(name)
    registry.plugin(cfg.task.name)  # a task of the table
    config.save_config(cfg, tmp_path / "config.yaml")
    assert registry.load_config(tmp_path / "config.yaml") == cfg


def test_plugins_bring_their_sections():
    assert registry.SECTIONS == {"math": None, "toy": ToyConfig, "words": WordsConfig}
    cfg = registry.load_config("toy_tail", ["task.words.max_steps=4"])
    assert cfg.task.section(ToyConfig).rare_operands == (7,)
    assert cfg.task.section(WordsConfig) == WordsConfig(max_steps=4)
    with pytest.raises(config.ConfigError, match=r"'task.toy.rare_operands\[0\]'"):
        registry.load_config("toy", ["task.toy.rare_operands=[x]"])
