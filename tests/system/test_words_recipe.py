"""The word-problem recipe, shrunken, on the real model (SmolLM2-135M-Instruct from the
`smollm2_dir` fixture): a short warm start (trained once, on one CPU device as the entry command
runs, and cached) teaches the boxed answer and hint writing; the policy then writes hints that
parse and match the reference, and two SAGE steps of the training loop see mixed groups.
Quality only, never a timing."""

import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from sage_jax import models
from sage_jax.infra import metrics as metrics_lib
from sage_jax.rl import engines, rollout
from sage_jax.run import build
from sage_jax.tasks.words import words_plugin as plugin
from sage_jax.tasks.words import problems as wp
from sage_jax.tasks import registry

pytestmark = pytest.mark.slow

SHRUNKEN = ["task.words.max_steps=3", "task.words.sft_steps=16", "data.max_prompt_tokens=96",
            "rl.max_new_tokens=80", "hint.max_new_tokens=48", "train.steps=2",
            "checkpoint.every=2", "train.samples_every=0"]


@pytest.fixture(scope="module")
def overrides(smollm2_dir):
    cache = Path(os.environ.get("SAGE_JAX_TEST_CACHE", "~/.cache/sage_jax/test")).expanduser()
    return [f"model.path={smollm2_dir}", f"task.words.cache_dir={cache}", *SHRUNKEN]


# the entry command on one CPU device, as a laptop user runs it (the tests' 8 fake devices
# would hold 8 copies of the model and its optimiser state, or shard a 135M model 8 ways); the
# warm start's cache key holds XLA_FLAGS, so it is trained in the same environment, once
ONE_DEVICE = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
WARM_START = """import sys
from sage_jax.tasks import registry
from sage_jax.tasks.words import hf_warm_start
cfg = registry.load_config("smollm2_words", sys.argv[1:])
hf_warm_start.warm_started_model(cfg)
print(hf_warm_start.warm_start_folder(cfg))
"""


@pytest.fixture(scope="module")
def warm_start_dir(overrides):
    """The warm start's folder, trained now or found in the cache, on one CPU device."""
    out = subprocess.run([sys.executable, "-c", WARM_START, *overrides], env=ONE_DEVICE,
                         capture_output=True, text=True, timeout=1800)
    assert out.returncode == 0, out.stderr[-3000:]
    return Path(out.stdout.strip().splitlines()[-1])


def test_the_warm_start_writes_hints_that_parse_and_match_the_reference(overrides,
                                                                         warm_start_dir):
    cfg = registry.load_config("smollm2_words", [*overrides, f"model.path={warm_start_dir}",
                                                 "task.words.sft_steps=0"])
    model = build.load_model(cfg)  # the warm start's folder as it is
    task = build.load_task(cfg)
    examples = [plugin.to_example(p, i) for i, p in enumerate(
        wp.make_problems(4, min_steps=2, max_steps=3, seed=99, per_length=True))]
    graphdef, params = models.split(model)
    engine = engines.NativeEngine(graphdef, params, eos_ids=task.eos_ids, pad_id=task.pad_id)
    sampler = engines.StepSampler(engine, jax.random.fold_in(jax.random.PRNGKey(0), 0))
    written, counts, _ = rollout.write_hints(range(len(examples)), examples, task, sampler,
                                             cfg.hint, dataset_ids=np.arange(len(examples)))
    assert counts["requests"] == 4 * 1 + 4 * 2  # 2 steps: level 1; 3 steps: levels 1 and 2
    assert counts["parsed"] >= 0.8 * counts["requests"], counts
    refs = [task.reference_hints(e.problem, e.solution, e.answer) for e in examples]
    right = sum(written.get(i, {}).get(1) == refs[i][1] for i in range(len(examples)))
    assert right >= 4, (right, written)


def test_two_sage_steps_on_the_warm_start_see_mixed_groups_and_parsed_hints(
        overrides, warm_start_dir, tmp_path):
    out = subprocess.run([sys.executable, "-m", "sage_jax.train", "--config", "smollm2_words",
                          "--workdir", str(tmp_path), *overrides],
                         env=ONE_DEVICE, capture_output=True, text=True, timeout=1800)
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"cached SFT model {warm_start_dir}" in out.stdout  # the same warm start, not a second
    rows = metrics_lib.read_metrics(tmp_path)
    assert len(rows) == 2
    mixed = [1 - r["collapse/frac_all_zero"] - r["collapse/frac_all_one"] for r in rows]
    assert max(mixed) > 0, rows  # a group with right and wrong answers: a learning signal
    assert all(r["hint/requests_parsed"] <= r["hint/requests"] for r in rows)
    assert all(np.isfinite(r["loss"]) for r in rows)
