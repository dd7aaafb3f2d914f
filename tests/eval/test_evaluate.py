"""Tests for sage_jax.evaluate: metrics on hand-made scores, the batching bookkeeping, and the
`python -m sage_jax.evaluate` driver end to end on a tiny random model with a real tokenizer."""

import json

import jax
import numpy as np
import pytest
from flax import nnx

import eval_fixtures
from sage_jax.eval import accuracy as eval_lib
from sage_jax import evaluate, models
from sage_jax.infra import provenance, rewards
from sage_jax.rl import engines
from sage_jax.tasks.math_grading import extract_boxed, math_reward_checked
from sage_jax.tasks.toy import chains as toy
from sage_jax.tasks.benchmarks import Problem, load_benchmark


@pytest.fixture(scope="session")
def tiny_qwen(tmp_path_factory):
    return eval_fixtures.tiny_qwen(tmp_path_factory.getbasetemp())


@pytest.fixture(scope="session")
def toy_run(tmp_path_factory):
    return eval_fixtures.toy_run(tmp_path_factory.getbasetemp())


# ---- metrics ----------------------------------------------------------------------------------

def test_aggregate_on_hand_made_scores():
    scores = [[1, 0, 0, 0],   # 1 of 4
              [0, 0, 0, 0],   # unsolved
              [1, 1, 1, 1],   # all
              [0, 0, 1, 0]]   # 1 of 4
    lengths = [[10, 20, 30, 40]] * 4
    truncated = [[False, False, False, True]] * 4
    m = eval_lib.aggregate(scores, lengths, truncated)
    assert m["n"] == 4 and m["k"] == 4
    assert m["avg@k"] == pytest.approx(6 / 16)  # = mean of per-problem accuracies .25,0,1,.25
    assert m["pass@k"] == pytest.approx(3 / 4)
    assert m["mean_length"] == pytest.approx(25.0)
    assert m["truncated_frac"] == pytest.approx(0.25)
    # k = 1: avg@1 == pass@1.
    one = eval_lib.aggregate([[1], [0], [0]], [[1], [2], [3]], [[False]] * 3)
    assert one["avg@k"] == one["pass@k"] == pytest.approx(1 / 3)


def test_aggregate_rejects_bad_shapes():
    with pytest.raises(ValueError, match="N problems, k samples"):
        eval_lib.aggregate([1, 0], [1, 1], [False, False])
    with pytest.raises(ValueError, match="same shape"):
        eval_lib.aggregate([[1, 0]], [[1]], [[False, False]])


def test_paper_average_metrics_and_table():
    def m(avg, n=10):
        return {"n": n, "k": 4, "avg@k": avg, "pass@k": min(1.0, 2 * avg), "mean_length": 100.0,
                "truncated_frac": 0.1}
    per = {"aime24": m(0.1), "math500": m(0.5, 20), "gsm8k": m(0.9)}
    avg = eval_lib.paper_average(per)  # gsm8k is not one of the paper's six
    assert avg["benchmarks"] == ["aime24", "math500"] and not avg["complete"]
    assert avg["avg@k"] == pytest.approx(0.3) and avg["pass@k"] == pytest.approx(0.6)
    assert avg["n"] == 30
    assert eval_lib.paper_average({"gsm8k": m(0.9)}) is None
    six = {b: m(i / 10) for i, b in enumerate(eval_lib.BENCHMARKS)}
    assert eval_lib.paper_average(six)["complete"]
    assert eval_lib.paper_average(six)["avg@k"] == pytest.approx(0.25)

    result = {"benchmarks": per, "average": avg}
    flat = eval_lib.eval_metrics(result)
    assert flat["eval/aime24/avg@4"] == 0.1 and flat["eval/gsm8k/pass@4"] == 1.0
    assert flat["eval/paper_avg/avg@4"] == pytest.approx(0.3)
    table = eval_lib.format_table(result).splitlines()
    assert table[0].split() == ["benchmark", "n", "avg@4", "%", "pass@4", "%", "mean", "len",
                                "truncated", "%"]
    assert table[2].split() == ["aime24", "10", "10.0", "20.0", "100.0", "10.0"]
    assert table[-1].split()[:4] == ["paper", "avg", "(2/6)", "30"]


# ---- the loop, with a stub scorer -------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_toy_policy():
    cfg = toy.toy_model_config(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
                               num_kv_heads=2, head_dim=16)
    return models.split(models.Decoder(cfg, rngs=nnx.Rngs(0)))


def _two_benchmarks(answers):
    # 4..8 steps: prompts of 18..30 tokens, all in one prompt bucket (one compile).
    texts = [p.text for p in toy.make_problems(5, toy.ToySpec(4, 8), seed=3)]
    return {"a": [Problem(texts[i], answers[i], i, "a") for i in (0, 2, 4)],
            "b": [Problem(texts[i], answers[i], j, "b") for j, i in enumerate((1, 3))]}


class _AnswerOnly(toy.ToyTask):
    """Toy prompts, scored against the problem's answer field (not the toy reference)."""

    @staticmethod
    def reference(problem, answer, hint=None):
        return answer


@pytest.mark.slow
def test_evaluate_problems_maps_scores_back_through_the_length_sort(tiny_toy_policy):
    """Problems of two benchmarks with different prompt lengths are sorted and batched; every
    score, length and text must land on its own (benchmark, problem, sample)."""
    graphdef, params = tiny_toy_policy
    task = _AnswerOnly()
    problems = _two_benchmarks([f"x{i}" for i in range(5)])
    good = {"x1", "x2"}
    k, max_new = 2, 8

    def scorer(responses, truths):  # sample 0 of the problems with a "good" answer is right
        assert len(responses) == len(truths) and len(truths) % k == 0
        return np.asarray([float(t in good and j % k == 0) for j, t in enumerate(truths)]), {
            "n": len(truths), "timeouts": 1}

    def run(batch_size):
        engine = engines.NativeEngine(graphdef, params, eos_ids=task.eos_ids,
                                      pad_id=task.pad_id)
        return eval_lib.evaluate_problems(
            engine, task, problems, k=k, temperature=1.0, top_p=1.0,
            max_new_tokens=max_new, key=jax.random.PRNGKey(0), scorer=scorer,
            batch_size=batch_size, keep_samples=True)

    res = run(batch_size=2)  # three sampler calls
    a, b = res["benchmarks"]["a"], res["benchmarks"]["b"]
    assert (a["n"], a["k"], b["n"]) == (3, 2, 2)
    assert a["avg@k"] == pytest.approx(1 / 6) and a["pass@k"] == pytest.approx(1 / 3)  # x2
    assert b["avg@k"] == pytest.approx(1 / 4) and b["pass@k"] == pytest.approx(1 / 2)  # x1
    assert res["average"] is None  # neither is a paper benchmark
    assert res["reward_stats"]["timeouts"] == 3  # one per scorer call
    samples = res["samples"]
    assert [(s["benchmark"], s["index"], s["sample"]) for s in samples] == [
        (n, p.index, g) for n, ps in problems.items() for p in ps for g in range(k)]
    for s in samples:
        prob = problems[s["benchmark"]][[p.index for p in problems[s["benchmark"]]].index(
            s["index"])]
        assert s["problem"] == prob.problem and s["answer"] == prob.answer
        assert s["score"] == float(s["answer"] in good and s["sample"] == 0)
        assert 1 <= s["length"] <= max_new
        assert not s["truncated"] or s["length"] == max_new
        assert len(s["completion"]) <= s["length"]
    assert res["generated_tokens"] == sum(s["length"] for s in samples)
    lengths = np.asarray([s["length"] for s in samples], float)
    assert a["mean_length"] + b["mean_length"] > 0 and lengths.mean() > 0

    # A problem's samples depend on (key, benchmark, index) only, not on the batching.
    again = run(batch_size=5)  # one sampler call
    assert [s["completion"] for s in again["samples"]] == [s["completion"] for s in samples]
    assert again["benchmarks"] == res["benchmarks"]


class _BoxedTwelve(_AnswerOnly):
    """Prompts of the toy task; every answer reads as "... \\boxed{12}" for the math checker."""

    reward_fn = staticmethod(math_reward_checked)
    extract_answer = staticmethod(extract_boxed)

    def decode(self, ids):
        return "so the answer is $\\boxed{12}$"


def test_evaluate_problems_with_the_real_math_checker(tiny_toy_policy):
    graphdef, params = tiny_toy_policy
    problems = _two_benchmarks(["12", "12.0", "13", "\\frac{24}{2}", "-12"])
    with rewards.RewardPool(math_reward_checked, num_workers=1) as pool:
        task = _BoxedTwelve()
        engine = engines.NativeEngine(graphdef, params, eos_ids=task.eos_ids, pad_id=task.pad_id)
        res = eval_lib.evaluate_problems(
            engine, task, problems, k=2, temperature=1.0, top_p=1.0,
            max_new_tokens=8, key=jax.random.PRNGKey(0), scorer=pool.score, keep_samples=True)
    # a: answers 12, 13, -12 -> one of three right; b: 12.0, 24/2 -> both right.
    assert res["benchmarks"]["a"]["avg@k"] == pytest.approx(1 / 3)
    assert res["benchmarks"]["a"]["pass@k"] == pytest.approx(1 / 3)
    assert res["benchmarks"]["b"]["avg@k"] == res["benchmarks"]["b"]["pass@k"] == 1.0
    assert all(s["extracted"] == "12" for s in res["samples"])
    assert [s["score"] for s in res["samples"]] == [1, 1, 0, 0, 0, 0, 1, 1, 1, 1]


def test_load_problems_errors(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="unknown benchmark.*aime99"):
        eval_lib.load_problems(["aime99"], tmp_path)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))  # no folder: from the Hub, offline
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(FileNotFoundError, match="--data-dir"):
        eval_lib.load_problems(["aime24"], None)
    with pytest.raises(FileNotFoundError, match="aime24"):
        eval_lib.load_problems(["aime24"], tmp_path)
    with pytest.raises(ValueError, match="unknown benchmark.*toy"):
        eval_lib.load_problems(["toy"], tmp_path)  # a task's built-in problems, not a file
    toys = toy.eval_problems(2, limit=3)["toy"]
    assert len(toys) == 3 and all(p.source == "toy" for p in toys)
    held_out = toy.held_out_problems(2)  # the toy job's set: the same problems, first 3
    assert [p.problem for p in toys] == [p.text for p in held_out[:3]]
    assert len(held_out) == 2 * len(toy.RL_SPEC.lengths)


# ---- the driver, end to end -------------------------------------------------------------------

@pytest.mark.slow
def test_cli_end_to_end_on_a_tiny_qwen_with_a_real_tokenizer(tiny_qwen, shared_data, tmp_path,
                                                             capsys):
    out = tmp_path / "eval"
    report = evaluate.main([
        "--model", str(tiny_qwen), "--data-dir", str(shared_data),
        "--benchmarks", "aime24,amc23", "--limit", "4", "--k", "2", "--max-new-tokens", "8",
        "--batch-size", "8", "--out", str(out), "--no-progress", "--reward-workers", "1"])
    printed = capsys.readouterr().out
    lines = printed.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("benchmark"))
    assert lines[head].split()[1:4] == ["n", "avg@2", "%"]
    assert lines[head + 2].split()[:2] == ["aime24", "4"]
    assert lines[head + 3].split()[:2] == ["amc23", "4"]
    assert lines[head + 5].split()[:4] == ["paper", "avg", "(2/6)", "8"]

    results = json.loads((out / "results.json").read_text())
    assert results == json.loads(json.dumps(report))
    assert set(results["benchmarks"]) == {"aime24", "amc23"}
    for m in results["benchmarks"].values():
        assert (m["n"], m["k"]) == (4, 2)
        assert 0 <= m["avg@k"] <= m["pass@k"] <= 1
        assert 1 <= m["mean_length"] <= 8 and 0 <= m["truncated_frac"] <= 1
    assert results["settings"]["hints"] is False and results["settings"]["k"] == 2
    assert results["engine"] == "native"  # --engine's default without a run's config
    assert results["system_prompt"].startswith("Please reason step by step")
    assert results["average"]["benchmarks"] == ["aime24", "amc23"]
    assert (out / "table.txt").read_text().startswith("benchmark")

    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 2 * 4 * 2
    for name in ("aime24", "amc23"):
        truth = load_benchmark(name, shared_data, limit=4)
        mine = [s for s in samples if s["benchmark"] == name]
        assert [(s["index"], s["sample"]) for s in mine] == [(i, g) for i in range(4)
                                                              for g in range(2)]
        assert [s["answer"] for s in mine] == [p.answer for p in truth for _ in range(2)]
        assert [s["problem"] for s in mine] == [p.problem for p in truth for _ in range(2)]
        scores = np.asarray([s["score"] for s in mine]).reshape(4, 2)
        assert results["benchmarks"][name]["avg@k"] == pytest.approx(scores.mean())
    for s in samples:
        assert s["extracted"] == extract_boxed(s["completion"])
        assert s["score"] in (0.0, 1.0) and 1 <= s["length"] <= 8


@pytest.mark.slow
def test_cli_toy_checkpoint_uses_the_toy_problems(toy_run, tmp_path, capsys):
    out = tmp_path / "eval"
    report = evaluate.main(["--checkpoint", str(toy_run), "--limit", "4", "--k", "2",
                            "--max-new-tokens", "8", "--out", str(out), "--no-progress",
                            "--reward-workers", "1"])
    assert report["task"] == "toy" and report["step"] == 0
    saved = json.loads((out / "results.json").read_text())["provenance"]
    assert saved["seed"] == 0 and saved["config"]["task"]["name"] == "toy"
    assert saved["commit"] == provenance.commit()
    assert list(report["benchmarks"]) == ["toy"] and report["benchmarks"]["toy"]["n"] == 4
    assert report["average"] is None
    assert "toy" in capsys.readouterr().out
    samples = (out / "samples.jsonl").read_text().splitlines()
    assert len(samples) == 4 * 2

    with pytest.raises(SystemExit) as e:
        evaluate.main(["--checkpoint", str(toy_run), "--benchmarks", "aime24", "--out",
                       str(out)])
    assert e.value.code == 2
    assert "toy-task run" in capsys.readouterr().err


def test_cli_errors_are_clear(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        evaluate.main(["--model", str(tmp_path), "--out", str(tmp_path / "o")])
    assert e.value.code == 2 and "no config.json" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        evaluate.main(["--checkpoint", str(tmp_path / "nope")])
    assert e.value.code == 2 and "does not exist" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        evaluate.main(["--model", str(tmp_path), "--k", "0"])


@pytest.mark.parametrize("flags, pieces", [
    (["--k", "0"], ["--k:", "must be >= 1"]),
    (["--top-p", "0"], ["--top-p:", "(0, 1]"]),
    (["--temperature", "-1"], ["--temperature:", ">= 0"]),
    (["--top-k", "-2"], ["--top-k:", "integer >= 0"]),
    (["--max-new-tokens", "0"], ["--max-new-tokens:", ">= 1"]),
    (["--limit", "0"], ["--limit:", ">= 1"]),
    (["--batch-size", "0"], ["--batch-size must be >= 1"]),
])
def test_cli_knobs_are_checked_as_the_config_checks_them(tmp_path, capsys, flags, pieces):
    with pytest.raises(SystemExit) as e:
        evaluate.main(["--model", str(tmp_path), *flags])
    err = capsys.readouterr().err
    assert e.value.code == 2
    for piece in pieces:
        assert piece in err
