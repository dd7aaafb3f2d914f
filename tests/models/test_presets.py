"""The paper models' built-in dimensions (`models.presets`), which compile-only checks and
memory estimates use in place of their checkpoints."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest
from flax import nnx

from sage_jax import models
from sage_jax.models.presets import PRESETS

# Parameter counts as published on the models' Hugging Face cards (Qwen2.5-0.5B-Instruct's card
# says 0.49B, its page's safetensors count 494M: the finer one, as 0.49B is 0.8% off;
# Qwen2.5-1.5B-Instruct's card says 1.54B).
PUBLISHED_PARAMS = {"qwen2.5-7b": 7.61e9, "qwen3-4b": 4.02e9, "llama3.2-3b": 3.21e9,
                    "qwen2.5-0.5b": 0.494e9, "qwen2.5-1.5b": 1.54e9}
TOKENIZER_DIRS = {"qwen3-4b": "qwen3-4b-instruct-2507", "llama3.2-3b": "llama-3.2-3b-instruct"}


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_a_preset_builds_the_published_model_size(name):
    cfg = models.DecoderConfig.from_hf_dict(PRESETS[name], source=f"preset {name}")
    shapes = nnx.eval_shape(lambda: models.Decoder(cfg, rngs=nnx.Rngs(0)))
    count = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(shapes, nnx.Param)))
    assert count == pytest.approx(PUBLISHED_PARAMS[name], rel=0.005), count


@pytest.mark.parametrize("name", sorted(TOKENIZER_DIRS))
def test_a_preset_equals_the_checkpoints_config(name, shared_data):
    ref = json.loads((shared_data / "tokenizers" / TOKENIZER_DIRS[name] / "config.json").read_text())
    for key, value in PRESETS[name].items():
        assert ref.get(key) == value, (key, ref.get(key), value)
