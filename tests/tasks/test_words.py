"""The word-problem task: generated problems are right, hints are one level per request, read
leniently, leaks refused and counted; the rollout writes and scores them per level."""

import re

import numpy as np
import pytest

from sage_jax import config as config_lib
from sage_jax.config import ConfigError, HintConfig, RLConfig
from sage_jax.rl import rollout
from sage_jax.run import build
from sage_jax.tasks import registry
from sage_jax.tasks.data import Example
from sage_jax.tasks.words import words_plugin as plugin
from sage_jax.tasks.words import problems as wp
from sage_jax.tasks.words.prompts import WordsTask

_EQ = re.compile(r"(\d+) ([-+*]) (\d+) = (\d+)")


def test_every_step_of_every_solution_is_right_and_the_answer_is_the_last_value():
    for p in wp.make_problems(50, min_steps=1, max_steps=8, seed=3):
        value = int(re.search(r"has (\d+)", p.problem).group(1))
        for step in p.steps:
            eqs = _EQ.findall(step)
            assert eqs, step
            for a, op, b, c in eqs:
                assert {"+": int(a) + int(b), "-": int(a) - int(b),
                        "*": int(a) * int(b)}[op] == int(c), step
            assert int(eqs[-1][0]) == value  # each step starts from the count so far
            value = int(eqs[-1][3])
            assert 1 <= value <= wp.MAX_VALUE
        assert value == p.answer
        assert p.solution.endswith(f"\\boxed{{{p.answer}}}.")
        assert p.problem.count(".") == p.k + 1  # the start and one sentence per step


def test_problems_are_reproducible_and_lengths_are_what_was_asked():
    a = wp.make_problems(20, min_steps=2, max_steps=5, seed=1)
    assert a == wp.make_problems(20, min_steps=2, max_steps=5, seed=1)
    assert a != wp.make_problems(20, min_steps=2, max_steps=5, seed=2)
    assert {p.k for p in a} <= {2, 3, 4, 5}
    by_len = wp.make_problems(3, min_steps=1, max_steps=4, seed=0, per_length=True)
    assert [p.k for p in by_len] == [1, 1, 1, 2, 2, 2, 3, 3, 3, 4, 4, 4]
    with pytest.raises(ValueError, match="at least one step"):
        wp.make_problem(np.random.default_rng(0), 0)


def test_hint_levels_are_the_first_steps_and_never_the_step_that_gives_the_answer():
    p = wp.make_problems(1, min_steps=3, max_steps=3, seed=0)[0]
    refs = WordsTask.reference_hints(p.problem, p.solution, str(p.answer))
    assert refs == {1: p.steps[0], 2: "\n".join(p.steps[:2])}  # 3 steps: levels 1 and 2 only
    assert wp.first_steps(p.solution, 3) is None
    one = wp.make_problems(1, min_steps=1, max_steps=1, seed=0)[0]
    assert WordsTask.reference_hints(one.problem, one.solution, str(one.answer)) == {}


def test_a_reply_is_read_leniently_and_a_leak_is_refused_and_counted():
    read = WordsTask.read_hints
    assert read("  Tom gets 5 more: 7 + 5 = 12.\n\n", 1, "9") == (
        {1: "Tom gets 5 more: 7 + 5 = 12."}, 0)
    # extra lines beyond the level are dropped, blank lines skipped
    assert read("a = 1.\n\nb = 2.\nc = 3.", 2, "9") == ({2: "a = 1.\nb = 2."}, 0)
    assert read("The answer is 9.", 1, "9") == ({}, 1)
    assert read("12 - 3 = \\boxed{9}", 1, "9") == ({}, 1)
    assert read("   \n", 2, "9") == ({}, 0)


def test_the_plugin_builds_examples_and_held_out_problems_by_length():
    cfg = registry.load_config(config_lib.CONFIG_DIR / "toy_uniform.yaml", [
        "task.name=words", "task.words.problems=12", "task.words.min_steps=2",
        "task.words.max_steps=3"])
    ex = registry.plugin("words").examples(cfg)
    assert len(ex) == 12 and [e.index for e in ex] == list(range(12))
    assert all(e.solution and e.solution.endswith(f"\\boxed{{{e.answer}}}.") for e in ex)
    held = plugin.held_out(4, 1, 3)
    assert list(held) == ["words-1", "words-2", "words-3"] and all(len(v) == 4 for v in held.values())
    train_texts = {e.problem for e in ex}
    assert not train_texts & {p.problem for v in held.values() for p in v}
    with pytest.raises(ConfigError, match="model.path"):
        registry.plugin("words").make_task(cfg, None, None)
    with pytest.raises(ConfigError, match="task.words.min_steps"):
        registry.load_config(config_lib.CONFIG_DIR / "toy_uniform.yaml", ["task.words.min_steps=0"])


# ---- the rollout with one request per level -------------------------------------------------

class LevelTask:
    """Characters as tokens; 'Q:' asks, '|H:' adds a hint, 'R<l>:' requests level l."""

    name, eos_ids, pad_id, system_prompt = "chars", (0,), 0, None
    read_hints = staticmethod(WordsTask.read_hints)

    @staticmethod
    def reference(problem, answer, hint=None):
        return answer

    def answer_prompt(self, problem):
        return [ord(c) for c in "Q:" + problem]

    def hinted_prompt(self, problem, hint):
        return [ord(c) for c in "Q:" + problem + "|H:" + hint]

    def hint_requests(self, problem, solution):
        return {lvl: [ord(c) for c in f"R{lvl}:{problem}"] for lvl in self.reference_hints(
            problem, solution, "")}

    def decode(self, ids):
        return "".join(chr(int(i)) for i in ids if int(i))

    @staticmethod
    def reference_hints(problem, solution, answer):
        steps = solution.split("\n")[:-1]
        return {lvl: "\n".join(steps[:lvl]) for lvl in (1, 2, 3) if lvl < len(steps) + 1}


def level_policy(replies):
    """Answers RIGHT when hinted with 2+ steps; hint request 'R<l>:<p>' gets replies[(p, l)]."""
    calls = []

    def sample(prompts, *, prompt_ids, salt, num_samples, max_new_tokens, temperature, top_p,
               top_k):
        texts = ["".join(chr(t) for t in p) for p in prompts]
        calls.append(texts)
        outs = []
        for text in texts:
            if text.startswith("R"):
                lvl, _, name = text[1:].partition(":")
                outs.append(replies.get((name, int(lvl)), ""))
            else:
                hint = text.partition("|H:")[2]
                outs.append("RIGHT" if hint.count("\n") >= 1 else "WRONG")
        tokens = np.zeros((len(prompts), num_samples, max_new_tokens), np.int32)
        lengths = np.zeros((len(prompts), num_samples), np.int32)
        for b, s in enumerate(outs):
            ids = [ord(c) for c in s][:max_new_tokens]
            tokens[b, :, :len(ids)] = ids
            lengths[b] = len(ids)
        return rollout.Samples(tokens, lengths, np.zeros(tokens.shape, np.float32))

    return sample, calls


def test_sage_asks_one_request_per_level_and_counts_parsed_right_and_leaked_hints():
    sol = "s1\ns2\ns3\nans"
    ex = [Example(problem=f"p{i}", answer="RIGHT", solution=sol, hint=None, index=i)
          for i in range(2)]
    replies = {("p0", 1): "s1", ("p0", 2): "s1\ns2", ("p0", 3): "the answer is RIGHT",
               ("p1", 1): "wrong step", ("p1", 2): "s1\ns2\nextra", ("p1", 3): ""}
    sample, calls = level_policy(replies)
    tables = rollout.SageTables.empty(2, hint_width=64)
    out = rollout.run(ex, np.arange(2), task=LevelTask(), sampler=sample,
                      scorer=lambda r, g: (np.array([float(x == "RIGHT") for x in r]), {}),
                      rl=RLConfig(method="sage", group_size=2, max_new_tokens=32),
                      hint=HintConfig(source="online", retries=0), tables=tables, step=0)
    requests = [t for batch in calls for t in batch if t.startswith("R")]
    assert sorted(requests) == sorted(f"R{l}:p{i}" for i in range(2) for l in (1, 2, 3))
    m = out.metrics
    assert m["hint/requests"] == 6 and m["hint/requests_parsed"] == 4 and m["hint/leaked"] == 1
    assert (m["hint/written_level_1"], m["hint/right_level_1"]) == (2, 1)
    assert (m["hint/written_level_2"], m["hint/right_level_2"]) == (2, 2)
    assert m["hint/written_level_3"] == 0
    # level 1 leaves both wrong; level 2 (two steps) rescues both
    np.testing.assert_array_equal(out.level, [2, 2])
    assert m["hint/rescued"] == 0  # all-right groups are collapsed, not mixed
    assert tables.cached_hints(0) == {1: "s1", 2: "s1\ns2"}
    assert out.hint_written[0].splitlines()[0] == "s1"


def test_built_in_problems_longer_than_the_rollout_rows_are_refused_naming_the_key():
    cfg = registry.load_config(config_lib.CONFIG_DIR / "toy_uniform.yaml", [
        "task.name=words", "task.words.problems=8", "task.words.max_steps=6",
        "data.max_prompt_tokens=200"])
    chars = type("Chars", (), {"answer_prompt": staticmethod(lambda p: list(p))})()
    with pytest.raises(ConfigError, match="data.max_prompt_tokens=200"):
        build.load_examples(cfg, chars)
    ok = registry.load_config(config_lib.CONFIG_DIR / "toy_uniform.yaml", [
        "task.name=words", "task.words.problems=8", "data.max_prompt_tokens=2000"])
    examples, stats = build.load_examples(ok, chars)
    assert len(examples) == 8 and stats["examples"] == 8
