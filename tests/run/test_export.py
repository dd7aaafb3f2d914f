"""Tests for `python -m sage_jax.export`: a training checkpoint round-trips through a plain
Hugging Face folder that `transformers` loads with the same logits (and tokenizer)."""

import json

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from safetensors import safe_open

import eval_fixtures
from hf_reference import hf_logits
import shutil

import yaml
from flax import nnx

from sage_jax.infra import checkpoint, parallel
from sage_jax import export, models
from sage_jax.engine.trainer import update
from sage_jax.run import build, hf_export as export_lib, restore
from sage_jax.tasks import data as data_lib
from sage_jax.tasks.toy import calibrate, chains as toy_task, warm_start
from sage_jax.tasks.toy.toy_config import ToyConfig
from sage_jax.tasks import registry

TOL = 2e-4  # float32 logits


@pytest.fixture(scope="session")
def math_run(tmp_path_factory):
    return eval_fixtures.math_run(tmp_path_factory.getbasetemp())


@pytest.fixture(scope="session")
def toy_run(tmp_path_factory):
    return eval_fixtures.toy_run(tmp_path_factory.getbasetemp())


def _hf_model(path):
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(path), dtype=torch.float32, attn_implementation="eager").eval()


def test_split_checkpoint_path(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints" / "12").mkdir(parents=True)
    (run / "config.yaml").write_text("task: {name: toy}\n")
    assert restore.split_checkpoint_path(run) == (run, None)
    assert restore.split_checkpoint_path(run / "12") == (run, 12)
    assert restore.split_checkpoint_path(run / "checkpoints" / "12") == (run, 12)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        restore.split_checkpoint_path(tmp_path / "missing")
    with pytest.raises(FileNotFoundError, match="not a training run folder"):
        restore.split_checkpoint_path(tmp_path)


@pytest.mark.slow
def test_math_checkpoint_round_trips_through_transformers(math_run, tmp_path):
    out = tmp_path / "hf"
    cfg, model, step = restore.restore_policy(math_run)  # the latest step
    assert step == 1
    info = export_lib.export_policy(cfg, model, step, out, source=math_run)
    assert info["step"] == 1 and info["task"] == "math"
    assert info["tokenizer"].startswith("copied from")
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "vocab.json", "merges.txt",
            "tokenizer_config.json", "generation_config.json", "sage_export.json"} <= names
    assert json.loads((out / "sage_export.json").read_text()) == info
    assert json.loads((out / "config.json").read_text())["architectures"] == ["Qwen2ForCausalLM"]

    # The tokenizer loads from the export and renders the training prompt identically.
    base_tok = models.Tokenizer(cfg.model.path)
    tok = transformers.AutoTokenizer.from_pretrained(str(out))
    messages = [{"role": "system", "content": "Please reason step by step."},
                {"role": "user", "content": "What is 2 + 3?"}]
    ids = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True,
                                  return_dict=False)
    ids = list(ids["input_ids"] if isinstance(ids, dict) else ids)
    assert ids == base_tok.encode_chat("What is 2 + 3?", system="Please reason step by step.")
    assert tok.convert_tokens_to_ids("<|im_end|>") in base_tok.eos_ids

    # Same logits as the checkpoint's parameters; different from the untrained base model.
    tokens = np.asarray([ids], np.int32)
    ours = np.asarray(model(jnp.asarray(tokens)), np.float32)
    theirs = hf_logits(_hf_model(out), tokens)
    assert ours.shape == theirs.shape
    err = float(np.max(np.abs(ours - theirs)))
    print(f"export round trip (qwen2, float32): max |dlogit| = {err:.2e}")
    assert err < TOL
    base = np.asarray(models.from_hf(cfg.model.path)(jnp.asarray(tokens)), np.float32)
    assert float(np.max(np.abs(base - theirs))) > 100 * TOL  # the trained weights were exported


def test_toy_checkpoint_exports_weights_without_a_tokenizer(toy_run, tmp_path, capsys):
    out = tmp_path / "hf"
    info = export.main(["--checkpoint", str(toy_run / "0"), "--out", str(out)])
    assert "no Hugging Face tokenizer" in capsys.readouterr().out
    assert info["tokenizer"].startswith("none") and info["tokenizer_files"] == []
    assert {p.name for p in out.iterdir()} == {"config.json", "model.safetensors",
                                               "sage_export.json"}
    cfg, model, step = restore.restore_policy(toy_run, 0)
    tokens = np.asarray([[1, 5, 9, 14, 20, 3, 7]], np.int32)
    ours = np.asarray(model(jnp.asarray(tokens)), np.float32)
    theirs = hf_logits(_hf_model(out), tokens)
    assert float(np.max(np.abs(ours - theirs))) < TOL

    # A non-empty --out is refused unless --overwrite; --dtype converts the weights.
    with pytest.raises(SystemExit) as e:
        export.main(["--checkpoint", str(toy_run), "--out", str(out)])
    assert e.value.code == 2 and "--overwrite" in capsys.readouterr().err
    export_lib.export_policy(cfg, model, step, out, overwrite=True, dtype="bfloat16")
    with safe_open(out / "model.safetensors", framework="numpy") as f:
        assert all(str(f.get_slice(n).get_dtype()) == "BF16" for n in f.keys())
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"


def test_copy_tokenizer_files_of_every_shared_tokenizer(shared_data, tmp_path):
    """The copy takes every tokenizer, generation-config and licence file of a model folder and
    leaves its config.json (the export writes its own). Loading the copies is covered by the
    round-trip test (qwen2.5-instruct, which has no tokenizer.json) and by test_models."""
    for src in sorted((shared_data / "tokenizers").iterdir()):
        out = tmp_path / src.name
        out.mkdir()
        copied = export_lib.copy_tokenizer_files(src, out)
        assert "config.json" not in copied
        expected = {p.name for p in src.iterdir()} - {"config.json"}
        assert set(copied) == expected, src.name


def test_unloadable_tokenizer_is_a_warning_not_a_failure(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text('{"tokenizer_class": "NoSuchTokenizer"}')
    problem = export_lib._check_tokenizer(tmp_path, vocab_size=100)
    assert problem and "could not load" in problem


def test_restoring_a_toy_run_never_trains_reads_data_or_builds_an_optimizer(
        toy_run, tmp_path, monkeypatch, capsys):
    """export (and evaluate --checkpoint) rebuild the policy from the model config and the
    checkpoint alone. The run's config is edited so that loading its starting model would train
    a fresh warm start (settings unlike the shipped one's, an empty cache) from another seed, and
    everything a training run builds raises: the export still writes the checkpoint's weights."""
    run = tmp_path / "run"
    shutil.copytree(toy_run, run)
    cfg = registry.load_config(run / "config.yaml")
    # The checkpoint's params, restored the way a training run resumes (full state as target).
    mesh = parallel.make_mesh(cfg.mesh)
    problems = cfg.task.section(ToyConfig).problems
    _, target = build.initial_state(build.load_model(cfg), cfg, mesh, problems)
    with checkpoint.Checkpointer(run, keep=1) as ckpt:
        want = nnx.to_flat_state(ckpt.restore(0, target=target)[0].params)
    raw = yaml.safe_load((run / "config.yaml").read_text())
    raw["task"]["toy"].update(warm_start=True, sft_seed=12345, cache_dir=str(tmp_path / "cache"))
    raw["train"]["seed"] = 999
    (run / "config.yaml").write_text(yaml.safe_dump(raw))

    def forbidden(what):
        def fail(*args, **kwargs):
            raise AssertionError(f"restoring a policy called {what}")
        return fail

    for module, name in [(warm_start, "warm_started_model"), (warm_start, "train_warm_start"),
                         (calibrate, "warm_start"), (update, "init_train_state"),
                         (update, "make_optimizer"), (data_lib, "load_examples"),
                         (toy_task, "make_examples"), (build, "load_model")]:
        monkeypatch.setattr(module, name, forbidden(f"{module.__name__}.{name}"))
    out = tmp_path / "hf"
    export.main(["--checkpoint", str(run), "--out", str(out)])
    assert "exported step 0" in capsys.readouterr().out
    got = dict(nnx.to_flat_state(nnx.state(models.from_hf(out), nnx.Param)))
    want = dict(want)
    assert set(got) == set(want)
    for k in want:
        np.testing.assert_array_equal(_value(got[k]), _value(want[k]), err_msg=str(k))
    # A checkpoint that does not fit the run's model is named, not a traceback of shapes.
    raw["model"] = {**raw.get("model", {}), "path": str(_other_toy_shape(tmp_path))}
    (run / "config.yaml").write_text(yaml.safe_dump(raw))
    with pytest.raises(checkpoint.CheckpointError, match="do not fit the run's model|has shape"):
        restore.restore_policy(run)


def _value(v):
    return np.asarray(v.get_value() if hasattr(v, "get_value") else v)


def _other_toy_shape(tmp_path):
    """A model folder whose config.json is the toy model with a wider MLP."""
    folder = tmp_path / "wider"
    mcfg = toy_task.toy_model_config(intermediate_size=2 * toy_task.toy_model_config()
                                     .intermediate_size)
    models.to_hf(models.Decoder(mcfg, rngs=nnx.Rngs(0)), folder)
    return folder
