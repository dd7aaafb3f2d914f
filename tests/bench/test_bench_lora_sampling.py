"""scripts/bench_lora_sampling.py's adapters: drawn so that they change the function (B not zero)
and leave the base's weights and the adapters' A as `with_lora` made them."""

import sys
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from sage_jax import models

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

import bench_lora_sampling  # noqa: E402


def test_the_benchmarks_adapters_change_the_function_and_only_b_is_drawn():
    cfg = models.DecoderConfig(family="qwen2", vocab_size=97, hidden_size=32,
                               intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                               head_dim=8, qkv_bias=True)
    base = models.Decoder(cfg, rngs=nnx.Rngs(0))
    lora = bench_lora_sampling.adapted(base, rank=4)
    fresh = models.with_lora(base, models.LoraSpec(4, 4.0))
    drawn = dict(nnx.to_flat_state(nnx.state(lora, nnx.LoRAParam)))
    made = dict(nnx.to_flat_state(nnx.state(fresh, nnx.LoRAParam)))
    assert len(drawn) == 2 * 7 * cfg.num_layers  # A and B on all seven projections
    for path, x in drawn.items():
        if path[-1] == "lora_b":
            assert np.abs(np.asarray(x[...])).min() > 0 and np.std(np.asarray(x[...])) < 0.02
        else:
            np.testing.assert_array_equal(np.asarray(x[...]), np.asarray(made[path][...]))
    tokens = jax.numpy.arange(1, 9)[None]
    out = models.apply(*models.split(lora), tokens)
    ref = models.apply(*models.split(base), tokens)
    assert np.abs(np.asarray(out) - np.asarray(ref)).max() > 1e-4  # the adapters act
