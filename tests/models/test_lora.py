"""LoRA adapters in the decoder: the adapted projection against numpy, the base weights and
function unchanged by fresh adapters, dtypes, Hugging Face loading and export, partition rules."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from jax.sharding import PartitionSpec as P
from safetensors.numpy import load_file

from hf_reference import hf_logits
from sage_jax import config, models
from sage_jax.config import MeshConfig
from sage_jax.infra import parallel
from sage_jax.models.decoder import Linear

CFG = models.DecoderConfig(family="qwen2", vocab_size=48, hidden_size=32, intermediate_size=64,
                           num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, qkv_bias=True)
SPEC = models.LoraSpec(rank=4, alpha=8.0)


def _tokens(shape=(2, 7), seed=0):
    return jnp.asarray(np.random.default_rng(seed).integers(0, CFG.vocab_size, shape), jnp.int32)


def _adapted_linears(model):
    return [(path, m) for path, m in nnx.iter_graph(model)
            if isinstance(m, Linear) and m.lora_a is not None]


def _randomise_b(model, seed=0, std=0.1):
    """Every adapter's B drawn from N(0, std^2) (fresh adapters have B = 0)."""
    rng = np.random.default_rng(seed)
    for _, m in _adapted_linears(model):
        m.lora_b[...] = jnp.asarray(std * rng.standard_normal(m.lora_b.shape), m.lora_b.dtype)
    return model


def _base(model):
    return nnx.state(model, nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam)))


def test_the_decoders_targets_are_the_configs():
    assert models.LORA_TARGETS == config.LORA_TARGETS
    assert models.LoraSpec.of(config.LoraConfig()) is None  # rank 0: no adapters
    spec = models.LoraSpec.of(config.LoraConfig(rank=8, alpha=4.0, targets=("v_proj",)), seed=3)
    assert spec == models.LoraSpec(8, 4.0, ("v_proj",), 3)
    for bad in (dict(rank=0, alpha=1.0), dict(rank=2, alpha=0.0),
                dict(rank=2, alpha=1.0, targets=("lm_head",))):
        with pytest.raises(ValueError, match="LoraSpec needs"):
            models.LoraSpec(**bad)


def test_a_lora_linear_is_x_w_plus_b_plus_x_a_b_times_alpha_over_r():
    spec = models.LoraSpec(rank=3, alpha=6.0)
    lin = Linear(5, 7, bias=True, dtype=jnp.float32, cdtype=jnp.float32, rngs=nnx.Rngs(0),
                 lora=spec, lora_rngs=nnx.Rngs(lora=1))
    rng = np.random.default_rng(2)
    lin.bias[...] = jnp.asarray(rng.standard_normal(7), jnp.float32)
    lin.lora_b[...] = jnp.asarray(rng.standard_normal((3, 7)), jnp.float32)
    x32 = rng.standard_normal((2, 4, 5)).astype(np.float32)
    w, b = np.asarray(lin.kernel[...], np.float64), np.asarray(lin.bias[...], np.float64)
    a, bb = np.asarray(lin.lora_a[...], np.float64), np.asarray(lin.lora_b[...], np.float64)
    x = x32.astype(np.float64)
    want = x @ w + b + (x @ a) @ bb * (6.0 / 3)
    got = np.asarray(lin(jnp.asarray(x32)))
    assert got.shape == (2, 4, 7)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert np.abs(want - (x @ w + b)).max() > 0.5  # the adapters' term is not negligible
    # A as PEFT initialises it (kaiming-uniform, a = sqrt(5): U(-1/sqrt(in), 1/sqrt(in))).
    assert np.abs(a).max() <= 1 / np.sqrt(5) and a.std() > 0.1 / np.sqrt(5)


@pytest.mark.slow
def test_fresh_adapters_leave_the_base_weights_and_the_logits_unchanged():
    """Same seed with and without LoRA: bit-identical base weights and logits (B = 0); adapters
    on the targets only, in the kernel's dtype; a non-zero B changes the logits."""
    spec = models.LoraSpec(rank=4, alpha=8.0, targets=("q_proj", "down_proj"))
    plain = models.Decoder(CFG, rngs=nnx.Rngs(0))
    lora = models.Decoder(CFG, rngs=nnx.Rngs(0), lora=spec)
    for x, y in zip(jax.tree.leaves(nnx.state(plain)), jax.tree.leaves(_base(lora))):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert jax.tree.structure(nnx.state(plain)) == jax.tree.structure(_base(lora))
    adapted = _adapted_linears(lora)
    assert sorted(p for p, _ in adapted) == [
        ("layers", i, *proj) for i in range(CFG.num_layers)
        for proj in (("mlp", "down_proj"), ("self_attn", "q_proj"))]
    for _, m in adapted:
        assert m.lora_a.shape == (m.kernel.shape[0], 4) and m.lora_b.shape == (4, m.kernel.shape[1])
        assert not np.any(np.asarray(m.lora_b[...]))
    tok = _tokens()
    np.testing.assert_array_equal(np.asarray(plain(tok)), np.asarray(lora(tok)))
    assert np.abs(np.asarray(plain(tok)) - np.asarray(_randomise_b(lora)(tok))).max() > 1e-2


def test_bf16_compute_keeps_the_compute_dtype_and_adapters_take_the_kernels_dtype():
    lin = Linear(8, 6, bias=False, dtype=jnp.float32, cdtype=jnp.bfloat16, rngs=nnx.Rngs(0),
                 lora=SPEC, lora_rngs=nnx.Rngs(lora=0))
    assert lin(jnp.ones((3, 8), jnp.float32)).dtype == jnp.bfloat16
    model = models.Decoder(CFG, dtype=jnp.bfloat16, rngs=nnx.Rngs(0), lora=SPEC)
    assert {x.dtype for x in jax.tree.leaves(nnx.state(model, nnx.LoRAParam))} == {
        jnp.dtype(jnp.bfloat16)}
    h, _, _ = model.prompt_kv(_tokens(), jnp.ones((2, 7), bool))
    assert h.dtype == jnp.bfloat16


def test_with_lora_adds_the_adapters_a_lora_decoder_is_built_with():
    plain = models.Decoder(CFG, rngs=nnx.Rngs(5))
    added = models.with_lora(plain, SPEC)
    built = models.Decoder(CFG, rngs=nnx.Rngs(5), lora=SPEC)
    assert nnx.graphdef(added) == nnx.graphdef(built)
    for x, y in zip(jax.tree.leaves(nnx.state(added)), jax.tree.leaves(nnx.state(built))):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert len(jax.tree.leaves(nnx.state(added, nnx.LoRAParam))) == 2 * 7 * CFG.num_layers


@pytest.mark.slow
def test_merge_lora_folds_the_adapters_into_the_kernels():
    model = _randomise_b(models.Decoder(CFG, rngs=nnx.Rngs(1), lora=SPEC))
    merged = models.merge_lora(model)
    assert not jax.tree.leaves(nnx.state(merged, nnx.LoRAParam))
    for path, m in _adapted_linears(model):
        want = (np.asarray(m.kernel[...], np.float64) + np.asarray(m.lora_a[...], np.float64)
                @ np.asarray(m.lora_b[...], np.float64) * SPEC.alpha / SPEC.rank)
        got = nnx.to_flat_state(nnx.state(merged))
        np.testing.assert_allclose(np.asarray(dict(got)[(*path, "kernel")].get_value()), want,
                                   rtol=1e-5, atol=1e-6)
    tok = _tokens(seed=1)
    np.testing.assert_allclose(np.asarray(merged(tok)), np.asarray(model(tok)), atol=1e-5)
    with pytest.raises(ValueError, match="LoRA adapters.*merge_lora"):
        models.hf_tensors(CFG, nnx.state(model, nnx.Param))


@pytest.mark.slow
def test_hf_weights_load_under_fresh_adapters_and_a_lora_model_exports_merged(tmp_path):
    """A Hugging Face folder loads as the base of a LoRA model (adapters fresh); a LoRA model
    with a non-zero B exports merged kernels that transformers runs to the same logits."""
    source = models.Decoder(CFG, rngs=nnx.Rngs(2))
    models.to_hf(source, tmp_path / "base")
    loaded = models.with_lora(models.from_hf(tmp_path / "base"), SPEC)
    for x, y in zip(jax.tree.leaves(nnx.state(source)), jax.tree.leaves(_base(loaded))):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert len(_adapted_linears(loaded)) == 7 * CFG.num_layers
    _randomise_b(loaded, seed=3)
    models.to_hf(loaded, tmp_path / "merged")
    tensors = load_file(str(tmp_path / "merged" / "model.safetensors"))
    assert not any("lora" in name for name in tensors)
    q = loaded.layers[0].self_attn.q_proj
    want = (np.asarray(q.kernel[...]) + np.asarray(q.lora_a[...]) @ np.asarray(q.lora_b[...])
            * SPEC.alpha / SPEC.rank)
    np.testing.assert_allclose(tensors["model.layers.0.self_attn.q_proj.weight"].T, want,
                               rtol=1e-5, atol=1e-6)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged",
                                                           torch_dtype=torch.float32)
    tok = np.asarray(_tokens(seed=4))
    np.testing.assert_allclose(hf_logits(hf, tok), np.asarray(loaded(jnp.asarray(tok))),
                               atol=2e-4)


def test_adapters_split_their_in_or_out_axis_as_their_kernel_never_the_rank():
    mesh = parallel.make_mesh(MeshConfig(1, 4, 2))
    spec = lambda path, shape: parallel.spec_for(path, shape, mesh)  # noqa: E731
    layer = "layers/3/"
    for proj in ("self_attn/q_proj", "self_attn/k_proj", "self_attn/v_proj", "mlp/gate_proj",
                 "mlp/up_proj"):
        assert spec(f"{layer}{proj}/kernel", (32, 64)) == P("fsdp", "tensor")
        assert spec(f"{layer}{proj}/lora_a", (32, 8)) == P("fsdp", None)
        assert spec(f"{layer}{proj}/lora_b", (8, 64)) == P(None, "tensor")
    for proj in ("self_attn/o_proj", "mlp/down_proj"):
        assert spec(f"{layer}{proj}/kernel", (64, 32)) == P("tensor", "fsdp")
        assert spec(f"{layer}{proj}/lora_a", (64, 8)) == P("tensor", None)
        assert spec(f"{layer}{proj}/lora_b", (8, 32)) == P(None, "fsdp")
    # Adam's moments of an adapter follow it.
    assert spec(f"opt_state/1/0/mu/{layer}self_attn/q_proj/lora_b", (8, 64)) == P(
        None, "tensor")
