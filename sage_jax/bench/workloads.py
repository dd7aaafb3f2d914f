"""The benchmark workloads, defined here: a random Qwen2-shaped model of a fixed size (`small`,
`tiny`) or a real trained LLM on real prompts (`real`), the rows, the token budget and the
timing (warm-up and timed calls). The peer scripts in ../shared/bench/peers/ define the same
workloads in their `workloads.json` (`tests/bench/test_bench_workloads.py` checks that they
agree), so that tunix, transformers, vLLM and this library are timed on one job.

Synthetic workloads: num_prompts x samples_per_prompt rows of prompt_len random token ids (0 is
never drawn: it is the pad id), exactly max_new_tokens new tokens per row (no EOS), temperature
1. `real`: SmolLM2-135M-Instruct (a Hugging Face folder, $SMOL_HF) greedy on the chat-templated
first num_prompts questions of GSM8K's test split, stopping at EOS; the metric is useful tokens
(each row's tokens up to its EOS) per second, and `lengths_sha1` names the outputs. `real_rl`:
the same prompts, 8 answers each at temperature 1, at most `slots` rows decoding at once.

This module needs only numpy, so that a peer's script (`scripts/vllm_real_generate.py`, in vLLM's
own venv) reads the same workloads, prompts and hash.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
from pathlib import Path

import numpy as np

_CHECKOUT_DATA = Path(__file__).resolve().parents[2].parent / "shared" / "data"
_QWEN2 = dict(arch="qwen2", rope_theta=1_000_000.0, rms_norm_eps=1e-6, qkv_bias=True,
              tie_word_embeddings=False, dtype="float32")
_ROWS = dict(num_prompts=16, samples_per_prompt=8, prompt_len=64, max_new_tokens=128,
             temperature=1.0, top_p=1.0, top_k=None)

WORKLOADS: dict[str, dict] = {
    "small": {
        "model": dict(_QWEN2, hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=2,
                      head_dim=32, intermediate_size=1024, vocab_size=4096),
        "sampling": dict(_ROWS),
        "timing": dict(warmup_calls=1, timed_calls=3, seed=0),
    },
    "tiny": {
        "model": dict(_QWEN2, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                      head_dim=16, intermediate_size=128, vocab_size=256),
        "sampling": dict(_ROWS),
        "timing": dict(warmup_calls=1, timed_calls=3, seed=0),
    },
    "real": {
        "model": dict(arch="llama", model_dir_env="SMOL_HF", model_dir_default="/tmp/smol/hf",
                      dtype="float32"),
        "sampling": dict(
            num_prompts=32, samples_per_prompt=1, data="eval/gsm8k/test.jsonl", field="question",
            system_prompt="Please reason step by step, and put your final answer within "
                          "\\boxed{}.",
            max_new_tokens=384, temperature=0.0, top_p=1.0, top_k=None),
        "timing": dict(warmup_calls=1, timed_calls=2, seed=0),
    },
}
# The real model on an RL-shaped rollout: 32 prompts x 8 sampled answers, more rows than the 64
# decode slots an engine holds at once (ours: `sample(max_rows=slots)`; vLLM: max_num_seqs).
WORKLOADS["real_rl"] = copy.deepcopy(WORKLOADS["real"])
WORKLOADS["real_rl"]["sampling"].update(samples_per_prompt=8, temperature=1.0, slots=64)


def load_workload(name: str) -> dict:
    """A copy of workload `name`; an unknown name is an error listing the known ones."""
    if name not in WORKLOADS:
        raise SystemExit(f"unknown workload {name!r}; known: {sorted(WORKLOADS)}")
    return copy.deepcopy(WORKLOADS[name])


def is_real(w: dict) -> bool:
    """Whether the workload runs a trained model folder (rather than a random one)."""
    return "model_dir_env" in w["model"]


def make_prompts(w: dict) -> np.ndarray:
    """The synthetic workload's prompts_BxP: token ids in [1, vocab), drawn by numpy's PCG64
    from the workload's seed (so every engine gets the same ids)."""
    s = w["sampling"]
    rng = np.random.default_rng(w["timing"].get("seed", 0))
    return rng.integers(1, w["model"]["vocab_size"], size=(s["num_prompts"], s["prompt_len"]),
                        dtype=np.int64)


def lengths_sha1(lengths) -> str:
    """12 hex digits naming a list of per-row output lengths (the peers print the same)."""
    return hashlib.sha1(",".join(str(int(n)) for n in lengths).encode()).hexdigest()[:12]


def questions(w: dict, data_dir: str | Path | None = None) -> list[str]:
    """The real workload's first num_prompts questions, from `data_dir` ($SAGE_JAX_DATA_DIR, or a
    checkout's ../shared/data); a clear error when the file is missing."""
    s = w["sampling"]
    root = Path(data_dir or os.environ.get("SAGE_JAX_DATA_DIR") or _CHECKOUT_DATA)
    file = root / s["data"]
    if not file.is_file():
        raise FileNotFoundError(f"the real workload reads {s['data']} under a data folder; "
                                f"{file} is missing: pass --data-dir or set $SAGE_JAX_DATA_DIR")
    with open(file, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()][: s["num_prompts"]]
    return [r[s["field"]] for r in rows]


def chat_prompts(w: dict, tok, data_dir: str | Path | None = None) -> list[list[int]]:
    """The real workload's prompts: token ids of the chat template (system prompt, question,
    generation prompt) by `tok`, a Hugging Face tokenizer."""
    out = []
    for q in questions(w, data_dir):
        msgs = [{"role": "system", "content": w["sampling"]["system_prompt"]},
                {"role": "user", "content": q}]
        ids = tok.apply_chat_template(msgs, add_generation_prompt=True)
        out.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return out


def model_dir(w: dict) -> Path:
    """The real workload's converted model folder; a clear error when it is missing."""
    m = w["model"]
    d = Path(os.environ.get(m["model_dir_env"], m["model_dir_default"])).expanduser()
    if not (d / "config.json").is_file():
        raise FileNotFoundError(
            f"the real workload needs SmolLM2-135M-Instruct as a Hugging Face folder at {d} "
            f"(${m['model_dir_env']}); make it with: python scripts/get_smollm2.py --out {d}")
    return d
