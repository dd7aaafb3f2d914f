"""One GRPO step of `smollm2_gsm8k`, this library beside TRL's `GRPOTrainer`, in one sitting.

    python scripts/bench_vs_trl.py --model ~/models/smollm2-135m-instruct \
        --data ~/data/gsm8k_demo.jsonl --trl-python /path/to/trl-venv/bin/python

Both runs train SmolLM2-135M-Instruct with GRPO on the same prompts in the same order (the ones
this library's run drew, replayed to TRL unshuffled), 4 prompts x 4 answers a step, at most 384
new tokens at temperature 1, float32, lr 1e-6, no KL term, the paper's system prompt, reward 1
when the last `\\boxed{}` equals the answer. Activation checkpointing on both sides (TRL's
default; this library's `model.remat=true`, the config's own). Each run is a child process; its
peak RSS is the kernel's (`wait4` ru_maxrss), its step times its own (our `metrics.jsonl`
`time/step_s`; a `TrainerCallback` for TRL). The first step compiles (ours) or warms up (TRL),
so the medians are over the other steps; the first is reported beside them.

With --vllm-python, this library runs a second time under that python (a venv with vLLM and
sage_jax) with `rollout.engine=vllm`, on the same prompts (the same seed draws them), so the
native and the vLLM engine are timed in the same sitting.

With --lora-rank R, this library also trains LoRA adapters of rank R (`model.lora.rank`, alpha
--lora-alpha, all seven projections) beside its full fine-tuning, and TRL trains the same
adapters through peft (`GRPOTrainer(peft_config=...)`) instead of every weight. Each side's
final checkpoint is saved and its size on disk reported (ours: the step's orbax folder, the
optimiser state included; TRL's: its `checkpoint-N` folder, optimizer.pt included).

TRL is optional and runs from its own venv (`pip install torch==2.13.0 trl==1.16.0`, and
`peft` for --lora-rank): without --trl-python only this library is measured. The machine should be otherwise idle: the script
reads /proc/stat around each run and marks a run `contended` when other processes used more
than --other-cores-limit of a core on average; discard contended lines.

The TRL side runs this same file with `--worker trl` under the TRL venv's python, and needs
only the standard library, torch, transformers, datasets and trl.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SYSTEM = "Please reason step by step, and put your final answer within \\boxed{}."  # tasks.math
GROUP, PROMPTS, MAX_NEW, LR = 4, 4, 384, 1e-6  # smollm2_gsm8k's rl.* and optim.lr
# the projections LoRA adapts on both sides (the library's default model.lora.targets)
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


# ---- measuring a child process -----------------------------------------------------------------

def _cpu_jiffies() -> tuple[int, int]:
    """(busy, total) jiffies of all cores since boot, from /proc/stat."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
    idle = fields[3] + fields[4]
    return sum(fields) - idle, sum(fields)


def _session_cpu(sid: int) -> dict[int, int]:
    """{pid: user + system jiffies} of the live processes of session `sid`, from /proc."""
    out = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # exited meanwhile
        if int(fields[3]) == sid:  # fields after the command: state, ppid, pgrp, session, ...
            out[int(stat.parent.name)] = int(fields[11]) + int(fields[12])
    return out


def run_child(cmd: list[str], log: Path, env=None, cwd: Path = ROOT) -> dict:
    """Runs `cmd` in `cwd` to the end (output to `log`) in a session of its own; its wall time, peak
    RSS and the cores that other processes used meanwhile: whole-machine busy time minus the
    CPU time of the child and every process it started (its session, read from /proc every
    quarter second, so worker processes count as its own)."""
    busy0, _ = _cpu_jiffies()
    t0 = time.time()
    seen: dict[int, int] = {}
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=cwd,
                                start_new_session=True)
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            seen.update(_session_cpu(proc.pid))
            time.sleep(0.25)
        proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here, not by Popen
    wall = time.time() - t0
    busy1, _ = _cpu_jiffies()
    hz = os.sysconf("SC_CLK_TCK")
    # the child's rusage holds the children it reaped, the session's sum those still running
    # when last seen (a forkserver's workers, say): the larger is the least the tree used
    own = max(usage.ru_utime + usage.ru_stime, sum(seen.values()) / hz)
    other = max(0.0, (busy1 - busy0) / hz - own) / wall
    code = proc.returncode
    if code != 0:
        tail = log.read_text()[-2000:]
        raise SystemExit(f"error: {' '.join(cmd[:4])} ... exited with {code}; its log "
                         f"{log} ends:\n{tail}")
    return {"wall_s": round(wall, 1), "peak_rss_mib": round(usage.ru_maxrss / 1024, 1),
            "other_cores": round(other, 3)}


def folder_mib(folder: Path) -> float:
    """MiB on disk of every file under `folder`."""
    return round(sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()) / 2**20, 1)


def summary(step_s: list[float]) -> dict:
    rest = step_s[1:] or step_s
    return {"steps": len(step_s), "first_step_s": round(step_s[0], 1),
            "median_step_s": round(statistics.median(rest), 1),
            "step_s": [round(s, 1) for s in step_s]}


# ---- the two runs ------------------------------------------------------------------------------

def run_ours(args, work: Path, *, name="sage_jax", python=sys.executable, extra=(),
             env=None) -> tuple[dict, list[list[int]]]:
    """This library's trainer for --steps GRPO steps; (result, the prompt ids of each step)."""
    run_dir = work / name
    cmd = [python, "-m", "sage_jax.train", "--config", "smollm2_gsm8k", "--workdir",
           str(run_dir), f"model.path={args.model}", f"data.train_files=[{args.data}]",
           "rl.method=grpo", f"train.steps={args.steps}", "checkpoint.every=0",
           "train.samples_every=0", *args.override, *extra]
    res = run_child(cmd, work / f"{name}.log", env=env)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    groups = [json.loads(line) for line in (run_dir / "groups.jsonl").read_text().splitlines()]
    res.update(summary([r["time/step_s"] for r in rows]))
    for key in ("update", "sample", "sync"):
        if f"time/{key}_s" in rows[0]:
            res[f"{key}_s"] = [round(r[f"time/{key}_s"], 1) for r in rows]
    res["tokens_sampled"] = [int(r["tokens/sampled"]) for r in rows]
    # what a step's time follows: its answers' length (the update) and how many ran to the cap
    # (the sampler decodes until the longest row of a call ends)
    for key, metric in (("answer_mean_len", "response/mean_length"),
                        ("answers_at_cap", "response/clipped_frac")):
        if metric in rows[0]:
            res[key] = [round(float(r[metric]), 3) for r in rows]
    res["params_trainable"] = int(rows[0]["params/trainable"])
    res["checkpoint_mib"] = folder_mib(run_dir / "checkpoints" / str(len(rows)))
    if "rollout/logprob_diff_mean" in rows[0]:
        res["logprob_diff_mean"] = [r["rollout/logprob_diff_mean"] for r in rows]
        res["logprob_diff_max"] = [r["rollout/logprob_diff_max"] for r in rows]
    return res, [g["id"] for g in groups]


def run_trl(args, work: Path, prompt_ids: list[list[int]], *, name="trl",
            lora_rank: int = 0) -> dict:
    """TRL's GRPOTrainer on the prompts of `prompt_ids`, in order (with `lora_rank`, peft's
    adapters of that rank and --lora-alpha instead of every weight)."""
    order = work / "trl_prompts.json"
    order.write_text(json.dumps([i for step in prompt_ids for i in step]))
    cmd = [args.trl_python, str(Path(__file__).resolve()), "--worker", "trl", "--model",
           args.model, "--data", args.data, "--steps", str(args.steps), "--order", str(order),
           "--out", str(work / f"{name}_steps.json"), "--lora-rank", str(lora_rank),
           "--lora-alpha", str(args.lora_alpha)]
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
    res = run_child(cmd, work / f"{name}.log", env=env)
    steps = json.loads((work / f"{name}_steps.json").read_text())
    res.update(summary(steps["step_s"]))
    for key in ("tokens_sampled", "versions", "params_trainable", "checkpoint_mib"):
        res[key] = steps[key]
    res.update({k: steps[k] for k in ("answer_mean_len", "answers_at_cap") if k in steps})
    return res


def table(result: dict) -> str:
    """The sitting as a markdown table: each side's median and per-step times, sampling and
    update times, peak RSS and tokens sampled, and its median step over the native engine's."""
    trl = result.get("trl", result.get("trl_lora"))
    trl_name = f"TRL {trl['versions']['trl']}" if isinstance(trl, dict) else "TRL"
    rank = result.get("lora_rank", 0)
    peft = trl["versions"].get("peft") if isinstance(trl, dict) else None
    sides = [(k, name) for k, name in (
        ("sage_jax", "sage_jax, native sampler"),
        ("sage_jax_lora", f"sage_jax, LoRA rank {rank}"),
        ("sage_jax_vllm", "sage_jax, rollout.engine=vllm"),
        ("trl", trl_name), ("trl_lora", f"{trl_name} + peft {peft}, LoRA rank {rank}"))
        if isinstance(result.get(k), dict)]
    native = result["sage_jax"]["median_step_s"]
    sized = any("checkpoint_mib" in result[k] for k, _ in sides)

    def steps(xs):
        return ", ".join(f"{x:.1f}" for x in xs)

    lines = ["| | median step | / native | steps | sampling | update | peak RSS | tokens "
             "sampled |" + (" checkpoint |" if sized else ""),
             "|---|---|---|---|---|---|---|---|" + ("---|" if sized else "")]
    for key, name in sides:
        r = result[key]
        lines.append(
            f"| {name} | {r['median_step_s']:.1f} s | {r['median_step_s'] / native:.2f} | "
            f"{steps(r['step_s'])} s | {steps(r['sample_s']) + ' s' if 'sample_s' in r else '-'}"
            f" | {steps(r['update_s']) + ' s' if 'update_s' in r else '-'} | "
            f"{r['peak_rss_mib']:,.0f} MiB | {min(r['tokens_sampled'])}-"
            f"{max(r['tokens_sampled'])} |"
            + (f" {r['checkpoint_mib']:,.1f} MiB |" if "checkpoint_mib" in r else
               (" - |" if sized else "")))
    return "\n".join(lines)


# ---- the TRL worker (runs under the TRL venv) --------------------------------------------------

def last_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}` (braces balanced), as `math_grading.extract_boxed`."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    i, depth = start + len("\\boxed{"), 1
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j].strip()
    return None


def trl_worker(args) -> None:
    # Imported here: this branch runs under the TRL venv, which has no jax or sage_jax.
    import datasets
    import torch
    import transformers
    import trl

    rows = [json.loads(line) for line in Path(args.data).read_text().splitlines() if line.strip()]
    order = json.loads(Path(args.order).read_text())
    ds = datasets.Dataset.from_list([
        {"prompt": [{"role": "system", "content": SYSTEM},
                    {"role": "user", "content": rows[i]["problem"]}],
         "answer": str(rows[i]["answer"])} for i in order])

    def boxed_reward(completions, answer, **_):
        return [float(last_boxed(c[-1]["content"]) == a.strip())
                for c, a in zip(completions, answer)]

    out_dir = tempfile.mkdtemp()
    cfg = trl.GRPOConfig(  # one checkpoint, after the last step (not inside a timed step)
        output_dir=out_dir, use_cpu=True, bf16=False, max_steps=args.steps,
        per_device_train_batch_size=GROUP * PROMPTS, num_generations=GROUP,
        max_completion_length=MAX_NEW, temperature=1.0, learning_rate=LR, beta=0.0,
        shuffle_dataset=False, logging_steps=1, save_strategy="steps", save_steps=args.steps,
        report_to=[], seed=0)
    peft_config, versions = None, {}
    if args.lora_rank:
        import peft  # the TRL venv's, for --lora-rank only

        peft_config = peft.LoraConfig(r=args.lora_rank, lora_alpha=args.lora_alpha,
                                      target_modules=LORA_TARGETS, lora_dropout=0.0,
                                      bias="none", task_type="CAUSAL_LM")
        versions["peft"] = peft.__version__
    times, tokens, logged = [], [], {"answer_mean_len": [], "answers_at_cap": []}

    class StepTimes(transformers.TrainerCallback):
        def on_step_begin(self, *a, **k):
            self.t0 = time.perf_counter()

        def on_step_end(self, *a, **k):
            times.append(time.perf_counter() - self.t0)

        def on_log(self, _args, _state, _control, logs=None, **k):
            if logs and "completions/mean_length" in logs:
                tokens.append(round(logs["completions/mean_length"] * GROUP * PROMPTS))
                logged["answer_mean_len"].append(round(logs["completions/mean_length"], 3))
                if "completions/clipped_ratio" in logs:
                    logged["answers_at_cap"].append(round(logs["completions/clipped_ratio"], 3))

    model = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    tok = transformers.AutoTokenizer.from_pretrained(args.model)
    trainer = trl.GRPOTrainer(model=model, processing_class=tok, reward_funcs=boxed_reward,
                              args=cfg, train_dataset=ds, callbacks=[StepTimes()],
                              peft_config=peft_config)
    trainer.train()
    trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    Path(args.out).write_text(json.dumps({
        "step_s": times, "tokens_sampled": tokens, **{k: v for k, v in logged.items() if v},
        "params_trainable": trainable,
        "checkpoint_mib": folder_mib(Path(out_dir) / f"checkpoint-{args.steps}"),
        "versions": {"trl": trl.__version__, "transformers": transformers.__version__,
                     "torch": torch.__version__, **versions}}))


# ---- main --------------------------------------------------------------------------------------

def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="SmolLM2-135M-Instruct as a HF folder")
    ap.add_argument("--data", required=True, help="GSM8K-style jsonl (make_gsm8k_demo.py)")
    ap.add_argument("--steps", type=int, default=4, help="GRPO steps per run")
    ap.add_argument("--trl-python", default=None, help="a python with trl installed")
    ap.add_argument("--vllm-python", default=None,
                    help="a python with vLLM and sage_jax installed: also runs this library "
                         "with rollout.engine=vllm")
    ap.add_argument("--vllm-kv-gib", type=int, default=1,
                    help="VLLM_CPU_KVCACHE_SPACE for that run (GiB of KV cache)")
    ap.add_argument("--lora-rank", type=int, default=0,
                    help="also train LoRA adapters of this rank (ours beside full "
                         "fine-tuning; TRL with peft instead of full)")
    ap.add_argument("--lora-alpha", type=float, default=16.0,
                    help="LoRA alpha on both sides (default 16, model.lora.alpha's)")
    ap.add_argument("--other-cores-limit", type=float, default=0.15)
    ap.add_argument("--out", default=None, help="also write the JSON result here")
    ap.add_argument("--worker", choices=["trl"], help=argparse.SUPPRESS)
    ap.add_argument("--order", help=argparse.SUPPRESS)
    ap.add_argument("override", nargs="*", help="extra key=value overrides for our trainer")
    args = ap.parse_args(argv)
    if args.worker == "trl":
        return trl_worker(args)
    # Here, not at the top: the TRL worker above runs this file where sage_jax is not installed.
    from sage_jax.infra import provenance
    with tempfile.TemporaryDirectory(prefix="bench_vs_trl_") as tmp:
        work = Path(tmp)
        ours, prompt_ids = run_ours(args, work)
        result = {"workload": "smollm2_gsm8k grpo", "commit": provenance.commit(),
                  "sage_jax": ours}
        print(json.dumps({"sage_jax": ours}), flush=True)
        sides = ["sage_jax"]
        if args.lora_rank:
            result["lora_rank"], result["lora_alpha"] = args.lora_rank, args.lora_alpha
            result["sage_jax_lora"], _ = run_ours(
                args, work, name="sage_jax_lora", extra=[f"model.lora.rank={args.lora_rank}",
                                                         f"model.lora.alpha={args.lora_alpha}"])
            print(json.dumps({"sage_jax_lora": result["sage_jax_lora"]}), flush=True)
            sides.append("sage_jax_lora")
        if args.vllm_python:
            env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=str(args.vllm_kv_gib))
            result["sage_jax_vllm"], _ = run_ours(
                args, work, name="sage_jax_vllm", python=args.vllm_python, env=env,
                extra=["rollout.engine=vllm"])
            print(json.dumps({"sage_jax_vllm": result["sage_jax_vllm"]}), flush=True)
            result["ratio_vllm_to_native"] = {
                "median_step": round(result["sage_jax_vllm"]["median_step_s"]
                                     / ours["median_step_s"], 3),
                "peak_rss": round(result["sage_jax_vllm"]["peak_rss_mib"]
                                  / ours["peak_rss_mib"], 3)}
            sides.append("sage_jax_vllm")
        trl_side, ours_side = ("trl_lora", "sage_jax_lora") if args.lora_rank else ("trl",
                                                                                   "sage_jax")
        if args.trl_python:
            result[trl_side] = t = run_trl(args, work, prompt_ids, name=trl_side,
                                           lora_rank=args.lora_rank)
            print(json.dumps({trl_side: t}), flush=True)
            mine = result[ours_side]
            result["ratio"] = {
                "median_step": round(mine["median_step_s"] / t["median_step_s"], 3),
                "peak_rss": round(mine["peak_rss_mib"] / t["peak_rss_mib"], 3)}
            sides.append(trl_side)
        else:
            result[trl_side] = "skipped: no --trl-python"
        for side in sides:
            if isinstance(result.get(side), dict):
                result[side]["contended"] = result[side]["other_cores"] > args.other_cores_limit
    print(json.dumps(result, indent=1))
    print(table(result))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
