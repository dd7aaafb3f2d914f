"""The word task's cached warm start: its cache key covers everything that changes its weights,
and the same key trains the same bits, in this process and in another."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.numpy import load_file, save_file

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))

import eval_fixtures  # noqa: E402
from sage_jax.infra import provenance  # noqa: E402
from sage_jax.tasks import registry  # noqa: E402
from sage_jax.tasks.words import hf_warm_start as ws  # noqa: E402

TINY = ["task.words.sft_steps=2", "task.words.sft_batch_size=2", "task.words.max_steps=2"]


@pytest.fixture(scope="module")
def tiny_qwen(tmp_path_factory):
    return eval_fixtures.tiny_qwen(tmp_path_factory.getbasetemp())


def _cfg(model: Path, *extra: str):
    return registry.load_config("smollm2_words", [f"model.path={model}", *TINY, *extra])


def test_the_cache_key_changes_with_everything_that_changes_the_weights(tiny_qwen, tmp_path,
                                                                       monkeypatch):
    cfg = _cfg(tiny_qwen)
    key = ws.cache_path(cfg)
    assert ws.cache_path(_cfg(tiny_qwen)) == key  # stable
    changed = {}
    for over in ("task.words.sft_steps=3", "task.words.sft_batch_size=4",
                 "task.words.sft_lr=1e-4", "task.words.sft_seed=1", "task.words.max_steps=3",
                 "task.words.sft_write_share=0.2", "task.words.sft_hinted_share=0.1"):
        changed[over] = ws.cache_path(_cfg(tiny_qwen, over))
    for name, value in (("SFT_REMAT", not ws.SFT_REMAT), ("SFT_LOGPROB_CHUNK", 32),
                        ("DESIGN_VERSION", ws.DESIGN_VERSION + 1), ("WARMUP_STEPS", 3),
                        ("SFT_BUCKET", 32)):
        with monkeypatch.context() as m:
            m.setattr(ws, name, value)
            changed[name] = ws.cache_path(cfg)
    with monkeypatch.context() as m:
        m.setattr(ws, "_version", lambda n: "0.0.1" if n == "jax" else "9")
        changed["jax version"] = ws.cache_path(cfg)
    with monkeypatch.context() as m:
        m.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", "") + " --xla_cpu_enable_fast_math=true")
        changed["XLA_FLAGS"] = ws.cache_path(cfg)
    with monkeypatch.context() as m:
        m.setattr(provenance, "source_digest", lambda *mods: "edited")
        changed["code"] = ws.cache_path(cfg)
    other = tmp_path / "other_base"
    shutil.copytree(tiny_qwen, other)
    tensors = load_file(other / "model.safetensors")
    first = sorted(tensors)[0]
    tensors[first] = tensors[first] + 1e-6  # same sizes, other bytes
    save_file(tensors, other / "model.safetensors", metadata={"format": "pt"})
    changed["base weights"] = ws.cache_path(_cfg(other))
    shutil.copytree(tiny_qwen, tmp_path / "other_tok")
    with open(tmp_path / "other_tok" / "tokenizer_config.json", "a") as f:
        f.write("\n")
    changed["tokenizer file"] = ws.cache_path(_cfg(tmp_path / "other_tok"))
    assert [what for what, path in changed.items() if path == key] == []
    assert len(set(changed.values())) == len(changed)


def test_the_code_part_of_the_key_follows_the_imports():
    files = provenance.source_files(ws.__name__)
    for module in ("sage_jax.tasks.words.hf_warm_start", "sage_jax.engine.trainer.sft_step",
                   "sage_jax.models.decoder", "sage_jax.tasks.words.problems",
                   "sage_jax.tasks.words.prompts", "sage_jax.core.grpo", "sage_jax.models",
                   "sage_jax"):
        assert module in files, module
    assert "sage_jax.run.loop" not in files  # the RL loop does not shape the warm start
    assert all(p.is_file() and p.suffix == ".py" for p in files.values())


WORKER = """
import sys
from sage_jax.tasks import registry
from sage_jax.tasks.words import hf_warm_start as ws
cfg = registry.load_config("smollm2_words", sys.argv[3:])
ws.train_warm_start(cfg, sys.argv[2], progress=lambda *a: None)
print(ws.weights_sha256(sys.argv[2]))
"""


@pytest.mark.slow
def test_the_same_key_trains_the_same_bits_here_and_in_another_process(tiny_qwen, tmp_path):
    cfg = _cfg(tiny_qwen)
    ws.train_warm_start(cfg, tmp_path / "a", progress=lambda *a: None)
    here = ws.weights_sha256(tmp_path / "a")
    args = [f"model.path={tiny_qwen}", *TINY]
    out = subprocess.run([sys.executable, "-c", WORKER, "-", str(tmp_path / "b"), *args],
                         env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split()[-1] == here
    assert ws.weights_sha256(tmp_path / "b") == here
    trained = load_file(tmp_path / "a" / "model.safetensors")
    base = load_file(tiny_qwen / "model.safetensors")
    assert any((trained[k] != base[k]).any() for k in base if k in trained)  # it did train
