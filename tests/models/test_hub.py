"""Hub ids as model paths, offline: a cache laid out as huggingface_hub lays it out
(`models--org--name/snapshots/<rev>/...`, `refs/main`) with HF_HUB_OFFLINE=1 resolves
`org/name[@revision]`; a 1-step run trains from it; a missing id is one clear error."""

from __future__ import annotations

import fnmatch
import json
import shutil

import pytest

import eval_fixtures
from sage_jax import config, models, train
from sage_jax.infra.checkpoint import Checkpointer
from sage_jax.models import hub
from sage_jax.run import loop
from sage_jax.tasks import registry

REVISION = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def offline_cache(tmp_path, monkeypatch):
    """A hub cache holding `org/tiny-qwen` (main -> REVISION); the environment points at it."""
    src = eval_fixtures.tiny_qwen(tmp_path.parent / "shared_models")
    repo = tmp_path / "hub" / "models--org--tiny-qwen"
    snapshot = repo / "snapshots" / REVISION
    shutil.copytree(src, snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(REVISION)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return snapshot


@pytest.mark.slow
def test_a_hub_id_resolves_from_the_cache_and_trains(offline_cache, tmp_path):
    assert hub.is_hub_id("org/tiny-qwen") and not hub.is_hub_id(str(tmp_path))
    assert hub.resolve("org/tiny-qwen") == offline_cache
    assert hub.resolve(f"org/tiny-qwen@{REVISION}") == offline_cache
    assert models.check_model_dir("org/tiny-qwen") == offline_cache
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"problem": f"What is {a} + 1?", "answer": str(a + 1)})
                            + "\n" for a in range(4)))
    cfg = registry.load_config(config.CONFIG_DIR / "toy_uniform.yaml", [
        "task.name=math", "model.path=org/tiny-qwen", f"data.train_files=[{data}]",
        "rl.method=grpo", "rl.prompts_per_step=4", "rl.group_size=2", "rl.minibatches=1",
        "rl.max_new_tokens=4", "train.steps=1", "eval.every=0", "train.samples_every=0"])
    loop.train(cfg, tmp_path / "run")
    assert Checkpointer(tmp_path / "run", keep=1).all_steps() == [1]
    assert registry.load_config(tmp_path / "run" / "config.yaml").model.path == "org/tiny-qwen"


def test_a_missing_hub_id_is_one_clear_error(offline_cache, tmp_path, capsys):
    with pytest.raises(FileNotFoundError, match=r"model org/absent: not in the Hugging Face "
                                                r"cache .*hub and HF_HUB_OFFLINE is set"):
        hub.resolve("org/absent")
    with pytest.raises(SystemExit) as e:
        train.main(["--workdir", str(tmp_path / "w"), "task.name=math", "model.path=org/absent",
                    "rl.method=grpo", f"data.train_files=[{tmp_path / 'x.jsonl'}]"])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and err[-1].startswith("error: model org/absent: not in the Hugging")


def test_only_configs_safetensors_and_tokenizers_are_fetched():
    for name in ("config.json", "model-00001-of-00002.safetensors", "tokenizer.json",
                 "model.safetensors.index.json", "generation_config.json", "merges.txt"):
        assert any(fnmatch.fnmatch(name, p) for p in hub.ALLOW_PATTERNS), name
    for name in ("pytorch_model.bin", "model.pt", "modeling_qwen.py", "consolidated.pth",
                 "flax_model.msgpack", "tf_model.h5"):
        assert not any(fnmatch.fnmatch(name, p) for p in hub.ALLOW_PATTERNS), name
