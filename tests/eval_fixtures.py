"""Small models and training runs shared by test_evaluate.py and test_export.py.

Each builder writes into pytest's session base folder and reuses what an earlier test module of the
same session built (a marker file says the build finished), so a run is trained once per session.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
import transformers

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"
QWEN_TOKENIZER = SHARED_DATA / "tokenizers" / "qwen2.5-instruct"
DONE = ".built"


def _cached(folder: Path, build) -> Path:
    if (folder / DONE).is_file():
        return folder
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    build(folder)
    (folder / DONE).write_text("ok\n")
    return folder


def tiny_qwen(base: Path) -> Path:
    """A random 2-layer Qwen2 (hidden 32, tied embeddings) with the real Qwen2.5 tokenizer."""
    def build(out: Path):
        for f in QWEN_TOKENIZER.iterdir():
            shutil.copyfile(f, out / f.name)
        tok = transformers.AutoTokenizer.from_pretrained(str(out))
        cfg = transformers.Qwen2Config(
            vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
            max_position_embeddings=1024, rms_norm_eps=1e-6,
            eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"), bos_token_id=None,
            pad_token_id=tok.pad_token_id)
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(cfg)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.copy_(1.0 + 0.3 * torch.randn_like(p))
                elif name.endswith("bias"):
                    p.copy_(0.2 * torch.randn_like(p))
                else:
                    p.copy_(0.1 * torch.randn_like(p))
        model.float().save_pretrained(out)
    return _cached(base / "tiny_qwen", build)


# A big learning rate and weight decay make one step move every parameter (a random policy earns
# no reward, so the policy gradient alone would be zero), so an export of the base weights
# instead of the trained ones is caught.
_STEP = ["train.steps=1", "rl.method=grpo", "rl.minibatches=1", "optim.lr=0.01",
         "optim.weight_decay=1.0", "train.samples_every=0", "checkpoint.every=0",
         "task.toy.warm_start=false"]


def _train(workdir: Path, overrides: list[str]) -> None:
    from sage_jax.run import loop
    from sage_jax import config
    from sage_jax.tasks import registry
    cfg = registry.load_config(config.CONFIG_DIR / "toy_uniform.yaml", _STEP + overrides)
    loop.train(cfg, workdir)


def toy_run(base: Path) -> Path:
    """A toy-task run folder with the checkpoint of its initial policy (step 0; no step is
    trained, which saves compiling the update: `math_run` covers a trained step)."""
    return _cached(base / "toy_run", lambda d: _train(d, ["train.steps=0"]))


def math_run(base: Path) -> Path:
    """A one-step GRPO run of the math task on `tiny_qwen` with four short problems."""
    model = tiny_qwen(base)

    def build(d: Path):
        data = d.parent / "math_train.jsonl"
        rows = [{"problem": f"What is {a} + {b}?", "answer": str(a + b),
                 "solution": f"{a} + {b} = {a + b}, so the answer is $\\boxed{{{a + b}}}$."}
                for a, b in ((1, 1), (2, 3), (4, 4), (7, 5))]
        data.write_text("".join(json.dumps(r) + "\n" for r in rows))
        _train(d, ["task.name=math", f"model.path={model}", f"data.train_files=[{data}]",
                   "rl.prompts_per_step=4", "rl.group_size=2", "rl.max_new_tokens=4",
                   "hint.max_new_tokens=4"])
    return _cached(base / "math_run", build)
