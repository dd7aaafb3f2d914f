"""The update benchmark's model-FLOP count against the model it times."""

import dataclasses

import numpy as np
import pytest
from flax import nnx

from sage_jax import models
from sage_jax.bench import update_bench
from sage_jax.models.decoder import Linear

CFG = models.DecoderConfig(family="llama", vocab_size=96, hidden_size=48, intermediate_size=80,
                           num_layers=3, num_heads=6, num_kv_heads=2, head_dim=8)


def test_the_matmul_part_counts_six_flops_per_kernel_weight_per_token():
    model = models.Decoder(CFG, rngs=nnx.Rngs(0))
    weights = sum(m.kernel.size for _, m in nnx.iter_graph(model) if isinstance(m, Linear))
    assert model.lm_head is not None  # untied: the LM head is one of the Linears
    lengths = [5, 17, 1]
    attention = 12.0 * CFG.num_layers * CFG.num_heads * CFG.head_dim * (25 + 289 + 1)
    got = update_bench.model_flops(dataclasses.asdict(CFG), lengths)
    assert got - attention == pytest.approx(6.0 * weights * sum(lengths), rel=1e-12)


def test_a_row_counts_its_own_length_not_the_batch_width():
    dims = dataclasses.asdict(CFG)
    short_and_long = update_bench.model_flops(dims, np.array([4, 60]))
    both_long = update_bench.model_flops(dims, np.array([60, 60]))
    assert short_and_long < both_long
    assert update_bench.model_flops(dims, [4]) + update_bench.model_flops(dims, [60]) == \
        pytest.approx(short_and_long)
