"""Config: defaults, YAML + dotted overrides, strict key/type/range checks, YAML round trip."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from sage_jax.config import (
    CONFIG_DIR,
    Config,
    ConfigError,
    RLConfig,
    Section,
    from_dict,
    load_config,
    require,
    save_config,
    to_dict,
    to_yaml,
)

REPO = Path(__file__).resolve().parents[2]


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return path


def test_defaults_are_the_papers_settings():
    cfg = load_config(None, [])
    assert cfg == Config()
    assert (cfg.rl.method, cfg.rl.group_size, cfg.rl.prompts_per_step) == ("sage", 8, 128)
    assert (cfg.rl.clip_low, cfg.rl.clip_high, cfg.rl.dual_clip, cfg.rl.kl_beta) == (
        0.2, 0.28, 3.0, 0.0)
    assert (cfg.optim.lr, cfg.optim.weight_decay, cfg.optim.grad_clip) == (1e-6, 0.01, 1.0)
    assert (cfg.eval.k, cfg.eval.temperature, cfg.eval.top_p) == (16, 0.6, 0.95)
    assert (cfg.hint.low, cfg.hint.high, cfg.hint.max_level) == (0.1, 0.35, 3)
    hash(cfg)  # Frozen and hashable: usable as a static argument to jax.jit.


def test_example_config_loads():
    cfg = load_config(CONFIG_DIR / "grpo_tiny.yaml", [])
    assert cfg.model.path is None and cfg.rl.method == "grpo"


def test_yaml_and_overrides(tmp_path):
    path = _write(tmp_path, "rl:\n  group_size: 4\n  micro_batch_size: 4\noptim:\n  lr: 1e-5\n")
    cfg = load_config(path, [
        "rl.prompts_per_step=64",  # int
        "optim.b2=0.95",  # float
        "optim.eps=1e-6",  # float written without a dot (YAML reads it as text)
        "model.remat=false",  # bool
        "eval.benchmarks=[aime24, amc23]",  # list
        "rl.micro_batch_size=null",  # null over a YAML value
        "--train.seed=7",  # a leading -- is allowed
        "model.path=2024",  # a str field keeps the text as written
    ])
    assert cfg.rl.group_size == 4 and cfg.optim.lr == 1e-5  # from the file
    assert cfg.rl.prompts_per_step == 64 and cfg.optim.b2 == 0.95 and cfg.optim.eps == 1e-6
    assert cfg.model.remat is False
    assert cfg.eval.benchmarks == ("aime24", "amc23")
    assert cfg.rl.micro_batch_size is None and cfg.train.seed == 7
    assert cfg.model.path == "2024"
    assert load_config(path, ["rl={group_size: 6}"]).rl.micro_batch_size == 4  # sections merge


def test_text_numbers_are_coerced():
    cfg = from_dict({"rl": {"group_size": "3", "temperature": "0.7"}})
    assert cfg.rl.group_size == 3 and cfg.rl.temperature == 0.7


def test_shipped_configs_by_name(tmp_path, monkeypatch):
    """A config path that is not a file is the shipped config of that name (from any folder);
    a real file wins; an unknown name is an error naming what was written."""
    monkeypatch.chdir(tmp_path)
    shipped = load_config(CONFIG_DIR / "grpo_tiny.yaml")
    for name in ("grpo_tiny", "grpo_tiny.yaml", "configs/grpo_tiny.yaml"):
        assert load_config(name) == shipped
    assert shipped.rl.method == "grpo"
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "grpo_tiny.yaml").write_text("train:\n  steps: 3\n")
    assert load_config("configs/grpo_tiny.yaml").train.steps == 3
    with pytest.raises(ConfigError, match="config file not found: nope"):
        load_config("nope")


@pytest.mark.parametrize("overrides, message", [
    (["rl.grup_size=4"], "unknown config key 'rl.grup_size' (did you mean 'rl.group_size'?)"),
    (["rll.group_size=4"], "unknown config key 'rll' (did you mean 'rl'?)"),
    (["group_size=4"], "unknown config key 'group_size' (did you mean 'rl.group_size'?)"),
    (["optim.learning_rate=1"], "unknown config key 'optim.learning_rate'"),
    (["rl.group_size.x=1"], "'rl.group_size' is not a section"),
])
def test_unknown_override_keys(overrides, message):
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert message in str(e.value)


def test_unknown_yaml_keys(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown config key 'optm' \(did you mean 'optim'"):
        load_config(_write(tmp_path, "optm:\n  lr: 1.0\n"), [])
    with pytest.raises(ConfigError) as e:
        load_config(_write(tmp_path, "data:\n  problem_kye: q\n"), [])
    assert "run.yaml" in str(e.value)
    assert "'data.problem_kye' (did you mean 'data.problem_key'?)" in str(e.value)
    with pytest.raises(ConfigError, match="'rl.grup_size'.*'rl.group_size'"):
        from_dict({"rl": {"grup_size": 4}})


@pytest.mark.parametrize("overrides, pieces", [
    (["rl.method=ppo"], ["'rl.method'", "'ppo'", "'grpo', 'sage', 'sage_light', 'resample'"]),
    (["optim.lr=-1e-6"], ["'optim.lr'", "must be > 0"]),
    (["rl.group_size=1"], ["'rl.group_size'", "must be >= 2"]),
    (["rl.group_size=abc"], ["'rl.group_size'", "'abc'", "expected int"]),
    (["rl.group_size=2.5"], ["'rl.group_size'", "2.5", "expected int"]),
    (["model.remat=maybe"], ["'model.remat'", "expected bool"]),
    (["rl.micro_batch_size=x"], ["'rl.micro_batch_size'", "expected int or null"]),
    (["rl.clip_low=-0.1"], ["'rl.clip_low'", "[0, 1)"]),
    (["rl.logprob_chunk=0"], ["'rl.logprob_chunk'", "must be >= 1, or null"]),
    (["rollout.programs_kept=-1"], ["'rollout.programs_kept'", "must be >= 0, or null"]),
    (["rl.programs_kept=4"], ["'rl.programs_kept' moved to 'rollout.programs_kept'"]),
    (["rl.rollout_micro_batch_size=8"],
     ["'rl.rollout_micro_batch_size' moved to 'rollout.micro_batch_size'"]),
    (["rl.group_size=8", "rollout.micro_batch_size=4"],
     ["rollout.micro_batch_size=4", "rl.group_size=8", "sampled whole"]),
    (["hint.escalation=eager"], ["'hint.escalation'", "'sequential', 'speculative'"]),
    (["hint.low=0.5"], ["'hint.high'", "[low, 1]"]),
    (["eval.benchmarks=[1]"], ["'eval.benchmarks[0]'", "expected str"]),
    (["rl=3"], ["'rl' is a section"]),
    (["model.lora.rank=-1"], ["'model.lora.rank'", "must be >= 0"]),
    (["model.lora.alpha=0"], ["'model.lora.alpha'", "must be > 0"]),
    (["model.lora.targets=[q_proj, qkv]"], ["'model.lora.targets'", "'qkv'", "down_proj"]),
    (["model.lora.targets=[]"], ["'model.lora.targets'", "a non-empty list"]),
    (["model.lora.rnk=4"], ["'model.lora.rnk'", "did you mean 'model.lora.rank'"]),
])
def test_invalid_values(overrides, pieces):
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    for piece in pieces:
        assert piece in str(e.value)


def test_lora_is_a_nested_section_of_model_off_by_default(tmp_path):
    assert Config().model.lora.rank == 0  # full fine-tuning
    cfg = load_config(None, ["model.lora.rank=16", "model.lora.targets=[q_proj, v_proj]"])
    assert (cfg.model.lora.rank, cfg.model.lora.alpha, cfg.model.lora.targets) == (
        16, 16.0, ("q_proj", "v_proj"))
    cfg = load_config(_write(tmp_path, "model:\n  lora:\n    rank: 8\n    alpha: 32\n"), [])
    assert (cfg.model.lora.rank, cfg.model.lora.alpha) == (8, 32.0)
    assert load_config(_write(tmp_path, to_yaml(cfg)), []) == cfg
    for bad, key in (("rank=-1", "rank"), ("alpha=-2", "alpha"), ("targets=[lm_head]", "targets")):
        with pytest.raises(ConfigError) as e:
            load_config(None, [f"model.lora.{bad}"])
        assert e.value.key == f"model.lora.{key}" and "\n" not in str(e.value), str(e.value)


def test_rollout_lora_merged_is_a_bool_off_by_default():
    assert Config().rollout.lora_merged is False  # the adapters run in place: no merged copy
    assert load_config(None, ["rollout.lora_merged=true"]).rollout.lora_merged is True
    with pytest.raises(ConfigError) as e:
        load_config(None, ["rollout.lora_merged=3"])
    assert "rollout.lora_merged" in str(e.value)


def test_sections_validate_on_construction():
    with pytest.raises(ConfigError, match="group_size"):
        RLConfig(group_size=1)
    with pytest.raises(ConfigError, match="group_size"):
        dataclasses.replace(Config().rl, group_size=0)


def test_cross_field_checks():
    with pytest.raises(ConfigError, match="rl.prompts_per_step=3 must be divisible by "
                                          "rl.minibatches=2"):
        load_config(None, ["rl.prompts_per_step=3"])
    assert load_config(None, ["rl.prompts_per_step=3", "rl.minibatches=1"]).rl.minibatches == 1
    with pytest.raises(ConfigError, match="micro_batch_size=3 must divide"):
        load_config(None, ["rl.micro_batch_size=3"])
    with pytest.raises(ConfigError, match="set data.hint_key"):
        load_config(None, ["hint.source=column"])
    load_config(None, ["hint.source=column", "data.hint_key=hint"])
    with pytest.raises(ConfigError, match="mesh.fsdp and mesh.tensor"):
        load_config(None, ["mesh.fsdp=-1", "mesh.tensor=-1"])
    # fsdp (or tensor) = -1 takes the devices; data's default -1 then counts as 1
    assert load_config(None, ["mesh.fsdp=-1"]).mesh.sizes() == (1, -1, 1)
    assert load_config(None, ["mesh.data=2", "mesh.fsdp=-1"]).mesh.sizes() == (2, -1, 1)
    assert load_config(None, []).mesh.sizes() == (-1, 1, 1)


def test_hinted_names_the_methods_that_take_hints():
    hinted = {m: load_config(None, [f"rl.method={m}"]).rl.hinted
              for m in ("grpo", "sage", "sage_light", "resample")}
    assert hinted == {"grpo": False, "sage": True, "sage_light": True, "resample": False}
    cfg = load_config(None, ["rl.method=sage", "hint.max_new_tokens=7",
                             "data.max_prompt_tokens=5"])
    assert cfg.sample_prompt_len() == 12 and cfg.sample_prompt_len(3) == 10
    grpo = load_config(None, ["rl.method=grpo", "data.max_prompt_tokens=5"])
    assert grpo.sample_prompt_len() == 5 and not grpo.writes_hints
    assert cfg.writes_hints and not load_config(None, [
        "rl.method=sage", "hint.source=reference"]).writes_hints


def test_yaml_round_trip(tmp_path):
    cfg = load_config(None, [
        "rl.method=sage_light", "rl.micro_batch_size=8", "optim.lr=3e-7", "data.hint_key=h",
        "data.train_files=[a.json, b.parquet]", "model.path=/ckpt", "eval.limit=5",
        "train.workdir=/tmp/x y", "hint.source=column",
    ])
    assert cfg.train.workdir == "/tmp/x y"
    save_config(cfg, tmp_path / "out" / "config.yaml")
    assert load_config(tmp_path / "out" / "config.yaml", []) == cfg
    assert from_dict(to_dict(cfg)) == cfg
    assert load_config(_write(tmp_path, to_yaml(Config())), []) == Config()


@dataclasses.dataclass(frozen=True)
class _DemoSection(Section):
    """A task plug-in's own section, as a plug-in writes one."""

    width: int = 3
    mode: str = "a"

    def validate(self) -> None:
        require(self.width >= 1, "width", self.width, ">= 1")


DEMO = {"plain": None, "demo": _DemoSection}  # a task table: name -> its section (None: none)


def test_task_sections_come_from_the_task_table(tmp_path):
    cfg = load_config(_write(tmp_path, "task:\n  name: demo\n  demo:\n    width: 5\n"),
                      ["task.demo.mode=b"], tasks=DEMO)
    assert cfg.task.name == "demo"
    assert cfg.task.section(_DemoSection) == _DemoSection(width=5, mode="b")
    assert load_config(None, [], tasks=DEMO).task.section(_DemoSection) == _DemoSection()
    save_config(cfg, tmp_path / "out.yaml")  # the section round-trips through YAML
    assert load_config(tmp_path / "out.yaml", [], tasks=DEMO) == cfg
    assert Config().task.section(_DemoSection) == _DemoSection()  # none held: defaults


@pytest.mark.parametrize("overrides, tasks, pieces", [
    (["task.demo.widht=2"], DEMO, ["'task.demo.widht'", "'task.demo.width'"]),
    (["task.demo.width=0"], DEMO, ["'task.demo.width'", ">= 1"]),
    (["task.demo.width=x"], DEMO, ["'task.demo.width'", "expected int"]),
    (["task.name=other"], DEMO, ["'task.name'", "'plain', 'demo'"]),
    (["task.dmo.width=2"], DEMO, ["'task.dmo'", "'task.demo'"]),
    (["task.demo.width=2"], None, ["'task.demo'", "sage_jax.tasks.registry.load_config"]),
])
def test_task_section_errors_name_the_key(overrides, tasks, pieces):
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides, tasks=tasks)
    for piece in pieces:
        assert piece in str(e.value)


def test_a_moved_key_fails_in_a_yaml_file_and_a_saved_run_config_is_migrated(tmp_path, capsys):
    old = "rl:\n  group_size: 4\n  rollout_micro_batch_size: 8\n  programs_kept: 3\n"
    with pytest.raises(ConfigError) as e:
        load_config(_write(tmp_path, old), [])
    assert "'rl.rollout_micro_batch_size' moved to 'rollout.micro_batch_size'" in str(e.value)
    assert len(str(e.value).splitlines()) == 1
    cfg = load_config(_write(tmp_path, old), [], saved=True)  # a run folder's config.yaml
    assert (cfg.rollout.micro_batch_size, cfg.rollout.programs_kept) == (8, 3)
    assert cfg.rl.group_size == 4
    note = capsys.readouterr().err
    assert "rl.rollout_micro_batch_size -> rollout.micro_batch_size" in note
    assert "rl.programs_kept -> rollout.programs_kept" in note
    assert load_config(_write(tmp_path, to_yaml(cfg)), [], saved=True) == cfg  # nothing to move
    assert capsys.readouterr().err == ""
