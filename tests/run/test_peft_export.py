"""A LoRA run's export holds its adapters as a PEFT adapter folder: `peft` loads it onto the
transformers base model and gets this library's logits, unmerged and merged (`merge_and_unload`)
alike, and those of the merged export beside it. A run without LoRA writes no adapter folder."""

import dataclasses
import json

import jax.numpy as jnp
import numpy as np
import peft
import pytest
import torch
import transformers
from flax import nnx
from safetensors import safe_open

from hf_reference import hf_logits, make_hf_model
from sage_jax import config, models
from sage_jax.models.decoder import Linear
from sage_jax.run import hf_export
from sage_jax.tasks.words import hf_warm_start

TOL = 1e-5  # float32 logits, this library against transformers + peft
TARGETS = ("q_proj", "v_proj", "o_proj", "down_proj")
SPEC = models.LoraSpec(rank=4, alpha=12.0, targets=TARGETS)


def _run_config(base, lora=SPEC):
    """The config of a float32 run on base model folder `base` (LoRA of `lora`, None: off)."""
    lora_cfg = (config.LoraConfig() if lora is None else
                config.LoraConfig(rank=lora.rank, alpha=lora.alpha, targets=lora.targets))
    return config.Config(model=config.ModelConfig(path=str(base), dtype="float32",
                                                  compute_dtype="float32", lora=lora_cfg))


def _trained_lora(base, seed=0):
    """The Decoder of `base` with adapters of SPEC, B (zero when fresh) drawn N(0, 0.1^2)."""
    model = models.with_lora(models.from_hf(base), SPEC)
    rng = np.random.default_rng(seed)
    for _, m in nnx.iter_graph(model):
        if isinstance(m, Linear) and m.lora_b is not None:
            m.lora_b[...] = jnp.asarray(0.1 * rng.standard_normal(m.lora_b.shape), jnp.float32)
    return model


def _hf(path):
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(path), dtype=torch.float32, attn_implementation="eager").eval()


def _max_diff(a, b):
    return float(np.max(np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32))))


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen2_qkv_bias", "llama_llama3_rope_tied"])
def test_peft_loads_the_adapter_folder_onto_the_base_with_the_librarys_logits(family, tmp_path):
    base = tmp_path / "base"
    make_hf_model(family).save_pretrained(base)
    model = _trained_lora(base)
    out = tmp_path / "export"
    info = hf_export.export_policy(_run_config(base), model, 7, out, log=lambda line: None)
    adapter = out / info["adapter"]
    assert info["adapter"] == hf_export.ADAPTER_DIR and adapter.is_dir()
    assert json.loads((out / hf_export.EXPORT_INFO).read_text()) == info
    assert {p.name for p in adapter.iterdir()} == {"adapter_config.json",
                                                   "adapter_model.safetensors"}
    written = json.loads((adapter / "adapter_config.json").read_text())
    assert (written["r"], written["lora_alpha"]) == (SPEC.rank, SPEC.alpha)
    assert written["base_model_name_or_path"] == str(base.resolve())

    # The tensors are those peft itself makes for this config on this model: names and shapes.
    made = peft.get_peft_model(_hf(base), peft.LoraConfig.from_pretrained(str(adapter)))
    want = {k: tuple(v.shape) for k, v in peft.get_peft_model_state_dict(made).items()}
    with safe_open(adapter / "adapter_model.safetensors", framework="numpy") as f:
        got = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    assert got == want and len(got) == 2 * len(TARGETS) * model.cfg.num_layers

    tokens = np.random.default_rng(1).integers(0, model.cfg.vocab_size, (2, 9)).astype(np.int32)
    ours = np.asarray(model(jnp.asarray(tokens)), np.float32)
    loaded = peft.PeftModel.from_pretrained(_hf(base), str(adapter)).eval()
    unmerged = hf_logits(loaded, tokens)
    merged_export = hf_logits(_hf(out), tokens)
    merged_by_peft = hf_logits(loaded.merge_and_unload(), tokens)
    base_logits = hf_logits(_hf(base), tokens)
    errs = {"peft (unmerged) vs ours": _max_diff(unmerged, ours),
            "merged export vs peft": _max_diff(merged_export, unmerged),
            "peft merge_and_unload vs merged export": _max_diff(merged_by_peft, merged_export)}
    print(f"{family}: " + ", ".join(f"{k} {v:.1e}" for k, v in errs.items()))
    assert max(errs.values()) < TOL, errs
    assert _max_diff(base_logits, ours) > 100 * TOL  # the adapters change the function


def test_a_run_without_lora_writes_no_adapter_folder(tmp_path):
    """Nor leaves one behind when it overwrites a LoRA run's export."""
    base = tmp_path / "base"
    make_hf_model("qwen2_qkv_bias").save_pretrained(base)
    out = tmp_path / "export"
    hf_export.export_policy(_run_config(base), _trained_lora(base), 3, out, log=lambda line: None)
    assert (out / hf_export.ADAPTER_DIR).is_dir()
    info = hf_export.export_policy(_run_config(base, lora=None), models.from_hf(base), 0, out,
                                   overwrite=True, log=lambda line: None)
    assert info["adapter"] is None and info["lora"] is None
    assert not (out / hf_export.ADAPTER_DIR).exists() and not list(out.rglob("adapter*"))
    assert {"config.json", "model.safetensors", "sage_export.json"} <= {p.name for p in
                                                                        out.iterdir()}


def test_the_adapter_config_is_the_models_adapters_or_an_error(tmp_path):
    cfg = models.DecoderConfig(family="qwen2", vocab_size=48, hidden_size=32,
                               intermediate_size=64, num_layers=1, num_heads=4, num_kv_heads=2,
                               head_dim=8)
    model = nnx.eval_shape(lambda: models.Decoder(cfg, rngs=nnx.Rngs(0), lora=SPEC))
    for other, why in ((models.LoraSpec(4, 12.0, ("q_proj",)), "adapters are on"),
                       (models.LoraSpec(2, 6.0, TARGETS), "have rank 4 and scale 3.0"),
                       (models.LoraSpec(4, 8.0, TARGETS), "have rank 4 and scale 3.0")):
        with pytest.raises(ValueError, match=why):
            models.peft_config(model, other)
    with pytest.raises(ValueError, match="no projection"):
        models.peft_config(nnx.eval_shape(lambda: models.Decoder(cfg, rngs=nnx.Rngs(0))), SPEC)
    hub = models.peft_config(model, SPEC, "Qwen/Qwen2.5-0.5B-Instruct@abc123")
    assert (hub["base_model_name_or_path"], hub["revision"]) == ("Qwen/Qwen2.5-0.5B-Instruct",
                                                                 "abc123")
    assert hub["target_modules"] == sorted(TARGETS)


def test_the_adapters_of_a_warm_started_run_name_the_warm_start_as_their_base(tmp_path):
    """The word task trains from its SFT warm start (the task's `start_folder`), not from
    model.path itself: that folder is the base the exported adapters belong to."""
    base = tmp_path / "base"
    make_hf_model("qwen2_qkv_bias").save_pretrained(base)
    cfg = dataclasses.replace(_run_config(base), task=config.TaskConfig(name="words"))
    info = hf_export.export_policy(cfg, _trained_lora(base), 3, tmp_path / "export",
                                   log=lambda line: None)
    written = json.loads((tmp_path / "export" / info["adapter"] / "adapter_config.json")
                         .read_text())
    warm = str(hf_warm_start.warm_start_folder(cfg))
    assert written["base_model_name_or_path"] == warm != str(base.resolve())
    assert warm in info["lora"]
