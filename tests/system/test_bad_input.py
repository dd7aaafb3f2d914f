"""Every bad input is one clear line (`error: ...`, exit status 2) before any heavy work, naming
the file (and row, shard or tensor); SAGE_JAX_DEBUG=1 gives the traceback instead."""

from __future__ import annotations

import json
import re
import shutil

import numpy as np
import pytest
import yaml
from safetensors.numpy import load_file, save_file

import eval_fixtures
from sage_jax import aot, evaluate, export, sft, train
from sage_jax.bench import __main__ as bench

ROWS = [{"problem": f"What is {a} + {b}?", "answer": str(a + b),
         "solution": f"{a} + {b} = {a + b}"} for a, b in ((1, 1), (2, 3), (4, 4), (7, 5))]
MATH = ["task.name=math", "rl.method=grpo", "rl.prompts_per_step=4", "rl.group_size=2",
        "rl.minibatches=1", "rl.max_new_tokens=4", "train.steps=1", "eval.every=0",
        "train.samples_every=0"]


@pytest.fixture(scope="module")
def tiny_qwen(tmp_path_factory):
    return eval_fixtures.tiny_qwen(tmp_path_factory.getbasetemp())


@pytest.fixture(scope="module")
def toy_run(tmp_path_factory):
    return eval_fixtures.toy_run(tmp_path_factory.getbasetemp())


def _model_copy(tiny_qwen, dst, *, tokenizer=True, config=True):
    dst.mkdir()
    for f in tiny_qwen.iterdir():
        is_tok = f.name.startswith(("tokenizer", "vocab", "merges", "special_tokens"))
        if (f.name == "config.json" and not config) or (is_tok and not tokenizer):
            continue
        shutil.copy(f, dst / f.name)
    return dst


def _data(tmp_path, rows=ROWS):
    f = tmp_path / "train.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return f


# Each case: (name, build(tmp_path, tiny_qwen, toy_run) -> (command, argv), first words).
def _no_config(tmp, q, r):
    m = _model_copy(q, tmp / "m", config=False)
    return train, ["--workdir", str(tmp / "w"), *MATH, f"model.path={m}",
                   f"data.train_files=[{_data(tmp)}]"]


def _not_a_model(tmp, q, r):
    return train, ["--workdir", str(tmp / "w"), *MATH, f"model.path={tmp}",
                   f"data.train_files=[{_data(tmp)}]"]


def _no_tokenizer(tmp, q, r):
    m = _model_copy(q, tmp / "m", tokenizer=False)
    return train, ["--workdir", str(tmp / "w"), *MATH, f"model.path={m}",
                   f"data.train_files=[{_data(tmp)}]"]


def _truncated_weights(tmp, q, r):
    m = _model_copy(q, tmp / "m")
    f = m / "model.safetensors"
    f.write_bytes(f.read_bytes()[:1000])
    return train, ["--workdir", str(tmp / "w"), *MATH, f"model.path={m}",
                   f"data.train_files=[{_data(tmp)}]"]


def _missing_shard(tmp, q, r):
    m = _model_copy(q, tmp / "m")
    tensors = load_file(m / "model.safetensors")
    names = sorted(tensors)
    (m / "model.safetensors").unlink()
    save_file({n: tensors[n] for n in names[:3]}, m / "model-00001-of-00002.safetensors")
    weight_map = {n: ("model-00001-of-00002.safetensors" if i < 3
                      else "model-00002-of-00002.safetensors") for i, n in enumerate(names)}
    (m / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return train, ["--workdir", str(tmp / "w"), *MATH, f"model.path={m}",
                   f"data.train_files=[{_data(tmp)}]"]


def _tensor_edit(change):
    def build(tmp, q, r):
        m = _model_copy(q, tmp / "m")
        tensors = load_file(m / "model.safetensors")
        tensors["model.norm.weight"] = change(tensors["model.norm.weight"])
        save_file(tensors, m / "model.safetensors")
        return train, ["--workdir", str(tmp / "w"), *MATH, f"model.path={m}",
                       f"data.train_files=[{_data(tmp)}]"]
    return build


def _data_file(name, content: bytes):
    def build(tmp, q, r):
        f = tmp / name
        f.write_bytes(content)
        return train, ["--workdir", str(tmp / "w"), *MATH, f"model.path={q}",
                       f"data.train_files=[{f}]"]
    return build


def _parquet_without_answer(tmp, q, r):
    import pyarrow as pa
    import pyarrow.parquet as pq
    f = tmp / "train.parquet"
    pq.write_table(pa.table({"problem": [x["problem"] for x in ROWS]}), f)
    return train, ["--workdir", str(tmp / "w"), *MATH, f"model.path={q}",
                   f"data.train_files=[{f}]"]


def _edited_run_config(command):
    def build(tmp, q, r):
        run = tmp / "run"
        shutil.copytree(r, run)
        cfg = yaml.safe_load((run / "config.yaml").read_text())
        cfg["rl"]["group_size"] = 1
        (run / "config.yaml").write_text(yaml.safe_dump(cfg))
        if command is export:
            return export, ["--checkpoint", str(run), "--out", str(tmp / "hf")]
        return evaluate, ["--checkpoint", str(run), "--out", str(tmp / "e")]
    return build


def _evaluate_not_a_model(tmp, q, r):
    return evaluate, ["--model", str(tmp), "--out", str(tmp / "e")]


def _sft_unknown_key(tmp, q, r):
    return sft, ["--out", str(tmp / "sft"), "task.toy.no_such_key=1"]


def _aot_unknown_topology(tmp, q, r):
    return aot, ["--config", "toy", "--topology", "v9-nope"]


def _bench_without_the_model(tmp, q, r):
    return bench, ["sampler", "--workload", "real", "--data-dir", str(tmp)]


GOOD = "".join(json.dumps(r) + "\n" for r in ROWS).encode()
CASES = [
    ("model folder without config.json", _no_config, r"error: .*/m: no config\.json"),
    ("model.path not a model folder", _not_a_model, r"error: .*: no config\.json"),
    ("model folder without tokenizer", _no_tokenizer, r"error: .*/m: no tokenizer files"),
    ("truncated safetensors", _truncated_weights,
     r"error: .*model\.safetensors: not a readable safetensors file"),
    ("sharded index, a shard missing", _missing_shard,
     r"error: .*model-00002-of-00002\.safetensors: missing \(a shard listed in "
     r"model\.safetensors\.index\.json\)"),
    ("tensor of the wrong shape", _tensor_edit(lambda t: t[:-1]),
     r"error: .*model\.safetensors: tensor 'model\.norm\.weight' has shape"),
    ("tensor of the wrong dtype", _tensor_edit(lambda t: t.astype(np.int32)),
     r"error: .*model\.safetensors: tensor 'model\.norm\.weight' has dtype int32"),
    ("malformed JSONL", _data_file("bad.jsonl", GOOD + b'{"problem": "x", "answer": "1"\n'),
     r"error: .*bad\.jsonl:5: not valid JSON"),
    ("malformed JSON document", _data_file("bad.json", b'[\n{"problem": "x",\n "answer": }\n]'),
     r"error: .*bad\.json:3: not valid JSON"),
    ("empty data file", _data_file("empty.jsonl", b""), r"error: .*empty\.jsonl is empty"),
    ("non-UTF-8 bytes", _data_file("latin.jsonl", GOOD + b'{"problem": "caf\xe9", "answer": "1"}\n'),
     r"error: .*latin\.jsonl:5: not UTF-8 text \(byte 0xe9\)"),
    ("Parquet without an answer column", _parquet_without_answer,
     r"error: .*train\.parquet: no field 'answer' in any row"),
    ("edited run config (evaluate)", _edited_run_config(evaluate),
     r"error: .*run/config\.yaml: invalid value 1 for config key 'rl\.group_size'"),
    ("edited run config (export)", _edited_run_config(export),
     r"error: .*run/config\.yaml: invalid value 1 for config key 'rl\.group_size'"),
    ("evaluate --model not a model folder", _evaluate_not_a_model,
     r"error: --model .*: no config\.json"),
    ("sft: unknown config key", _sft_unknown_key,
     r"error: unknown config key 'task\.toy\.no_such_key'"),
    ("aot: unknown topology", _aot_unknown_topology, r"error: unknown topology 'v9-nope'"),
    ("bench: the real workload without its model", _bench_without_the_model,
     r"error: (the real workload needs SmolLM2-135M-Instruct|.*eval/gsm8k/test\.jsonl)"),
]


@pytest.mark.parametrize("build, first_words", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_one_clear_line(tmp_path, tiny_qwen, toy_run, capsys, build, first_words):
    command, argv = build(tmp_path, tiny_qwen, toy_run)
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        command.main(argv)
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert "Traceback" not in err and len(errors) == 1 and err.endswith(errors[0]), err
    assert re.match(first_words, errors[0]), err


def test_debug_env_gives_the_traceback(tmp_path, tiny_qwen, toy_run, monkeypatch):
    monkeypatch.setenv("SAGE_JAX_DEBUG", "1")
    command, argv = _data_file("empty.jsonl", b"")(tmp_path, tiny_qwen, toy_run)
    with pytest.raises(ValueError, match="is empty"):
        command.main(argv)
