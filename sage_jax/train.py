"""`python -m sage_jax.train [--config FILE] [--workdir DIR] [section.key=value ...]`.

Wires the stages: data -> rollout (sample, reward, SAGE hints) -> batch -> jitted update, with
orbax checkpoints (re-running the same command resumes exactly), metrics (console progress,
DIR/metrics.jsonl, TensorBoard when installed) and sample logs (DIR/samples.jsonl).
With no arguments it runs the built-in default, `configs/toy.yaml`, into a fresh `runs/` folder.
"""

from __future__ import annotations

import argparse
import datetime
import math
import signal
import sys
import time
from pathlib import Path

import jax
import numpy as np

from sage_jax import batching, build, checkpoint, config as config_lib, metrics as metrics_lib
from sage_jax import distributed, evaluate, parallel, rewards, rollout, update
from sage_jax.tasks import data as data_lib

DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "toy.yaml"


class TrainingError(RuntimeError):
    """The run cannot continue (e.g. NaN loss); the last good checkpoint is kept."""


def rollout_settings(cfg) -> rollout.RolloutSettings:
    rl, h = cfg.rl, cfg.hint
    return rollout.RolloutSettings(
        method=rl.method, group_size=rl.group_size, max_new_tokens=rl.max_new_tokens,
        temperature=rl.temperature, top_p=rl.top_p, top_k=rl.top_k,
        collapse_std=rl.collapse_std, success_threshold=rl.success_threshold,
        hint_source="online" if h.source == "auto" else h.source,
        hint_refresh_every=h.refresh_every if h.source in ("online", "auto") else 0,
        hint_temperature=h.temperature, hint_max_new_tokens=h.max_new_tokens,
        hint_retries=h.retries, hint_max_request_tokens=h.max_request_tokens, light_low=h.low,
        light_high=h.high, max_level=h.max_level)


def check_fits(cfg, mesh) -> None:
    """Fails before any compile when the step's rows do not fit the mesh and mini-batches."""
    rows = cfg.rl.prompts_per_step * cfg.rl.group_size
    _, _, micro = update.layout(rows, cfg.rl)
    parallel.check_rows(rows, mesh, "the step's rows (rl.prompts_per_step * rl.group_size)")
    parallel.check_rows(micro, mesh, "a micro-batch (rl.micro_batch_size)")


def step_metrics(ro: rollout.Rollout, max_new_tokens: int, eos_ids) -> dict[str, float]:
    """Reward and response-length metrics of one rollout."""
    lengths = ro.samples.lengths
    last = np.take_along_axis(ro.samples.tokens, np.maximum(lengths - 1, 0)[..., None], -1)[..., 0]
    truncated = (lengths >= max_new_tokens) & ~np.isin(last, list(eos_ids))
    return {"reward/mean": float(ro.rewards.mean()),
            "response/mean_length": float(lengths.mean()),
            "response/clipped_frac": float(truncated.mean())}


def group_record(ro: rollout.Rollout, dataset_ids, success_threshold: float = 0.0
                 ) -> dict[str, list]:
    """Per prompt of the step: dataset id, first-pass status (`rollout.COLLAPSE_*`), hint level
    and re-sample round of the trained group, and whether the trained group solved it."""
    return {"id": [int(i) for i in dataset_ids], "collapse": ro.collapse.tolist(),
            "level": ro.level.tolist(), "round": ro.round.tolist(),
            "solved": (ro.rewards.max(axis=1) > success_threshold).astype(int).tolist()}


def sample_records(ro: rollout.Rollout, examples, task, limit: int = 4) -> list[dict]:
    out = []
    for b in range(min(limit, len(examples))):
        out.append({"problem": examples[b].problem, "answer": examples[b].answer,
                    "level": int(ro.level[b]), "hint": ro.hints[b],
                    "prompt": task.decode(ro.prompts[b]),
                    "responses": ro.texts[b], "rewards": ro.rewards[b].tolist()})
    return out


class _Stop:
    """SIGINT/SIGTERM: finish the current step, save a checkpoint, exit cleanly."""

    def __init__(self):
        self.requested = False
        self._old = {}

    def __enter__(self):
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        if self.requested:  # second signal: stop now
            raise KeyboardInterrupt
        self.requested = True
        print(f"\nsignal {signum}: saving a checkpoint after this step, then exiting",
              file=sys.stderr, flush=True)

    def __exit__(self, *exc):
        for sig, old in self._old.items():
            signal.signal(sig, old)


def train(cfg, workdir: str | Path, *, stop_after: int | None = None) -> dict:
    """Runs (or resumes) training in `workdir`; returns the last step's metrics.

    `stop_after`: stop (with a checkpoint) once this many steps are done in total.
    """
    distributed.initialize_from_env()  # multi-host: before anything starts a JAX backend
    distributed.check_same({"workdir": str(workdir), "config": config_lib.to_yaml(cfg)})
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    is_main = distributed.is_main()
    if is_main:
        print(config_lib.to_yaml(cfg))
        config_lib.save_config(cfg, workdir / "config.yaml")
    mesh = parallel.make_mesh(cfg.mesh)
    check_fits(cfg, mesh)
    task = build.load_task(cfg)
    model = build.load_model(cfg)
    examples, data_stats = build.load_examples(cfg, task)
    if is_main:
        print(f"data: {data_stats}; mesh: {dict(mesh.shape)}; model: {model.cfg.family} "
              f"{model.cfg.num_params() / 1e6:.2f}M params; processes: {jax.process_count()}",
              flush=True)
    graphdef, state = update.init_train_state(model, cfg, mesh)
    del model
    if is_main:
        print(f"per device: params {_device_mib(state.params):.1f} MiB, optimiser "
              f"{_device_mib(state.opt_state):.1f} MiB (mesh {dict(mesh.shape)})", flush=True)
    tables = rollout.SageTables.empty(len(examples), cfg.hint.cache_bytes)
    state = state.replace(sage=tables.as_dict())
    ckpt = checkpoint.Checkpointer(workdir, keep=cfg.checkpoint.keep)
    start = ckpt.latest_step()
    if start is not None:
        state, _ = ckpt.restore(start, target=state)
        tables = rollout.SageTables(**{k: np.array(v) for k, v in state.sage.items()})
        if is_main:
            print(f"resumed from {ckpt.step_dir(start)}", flush=True)
    start = int(state.step)
    step_fn = update.make_train_step(graphdef, cfg, mesh)
    settings = rollout_settings(cfg)
    scorer = distributed.ShardedScorer(rewards.RewardPool(  # each process scores its share
        rewards.get_reward(task.reward_name), timeout_s=cfg.rl.reward_timeout_s))
    logger = metrics_lib.MetricsLogger(workdir, total_steps=cfg.train.steps, is_main=is_main,
                                       resume_step=start)
    eval_problems = None
    if cfg.eval.every:
        names = list(cfg.eval.benchmarks) if cfg.task.name == "math" else ["toy"]
        eval_problems = evaluate.load_problems(names, cfg.eval.data_dir, limit=cfg.eval.limit)
    last_saved = start
    end = cfg.train.steps if stop_after is None else min(cfg.train.steps, stop_after)
    metrics: dict = {}

    def save(step):
        nonlocal last_saved
        if step != last_saved or ckpt.latest_step() is None:
            ckpt.save(step, state.replace(sage=tables.as_dict()))
            last_saved = step

    try:
        with _Stop() as stop:
            for step in range(start, end):
                t_step = time.perf_counter()
                idx, position = data_lib.next_batch_indices(
                    int(state.data_position), cfg.rl.prompts_per_step, len(examples),
                    cfg.train.seed, cfg.data.shuffle)
                batch_examples = [examples[i] for i in idx]
                sampler = batching.PolicySampler(graphdef, state.params, key=state.rng,
                                                 step=step, eos_ids=task.eos_ids,
                                                 pad_id=task.pad_id, mesh=mesh)
                timer = metrics_lib.Timer()
                ro = rollout.run(batch_examples, idx, task=task,
                                 sampler=_timed(sampler, timer, "sample"),
                                 scorer=_timed(scorer.score, timer, "reward"),
                                 settings=settings, tables=tables, step=step)
                batch = batching.train_batch(ro, loss_context=cfg.rl.loss_context,
                                             adv_scale=cfg.rl.adv_scale, pad_id=task.pad_id)
                with timer("update"):
                    n_rows = len(batch["advantages_N"])
                    mine = parallel.local_rows(n_rows, mesh)  # this process's rows
                    state, upd = step_fn(state, parallel.shard_batch(
                        {k: v[mine] for k, v in batch.items()}, mesh, global_rows=n_rows))
                    upd = jax.device_get(upd)
                state = state.replace(
                    data_position=parallel.replicate(np.int32(position), mesh))
                _check_finite(upd, step, last_saved, workdir)
                elapsed = time.perf_counter() - t_step
                metrics = {**step_metrics(ro, cfg.rl.max_new_tokens, task.eos_ids), **ro.metrics,
                           **{k: float(v) for k, v in upd.items()}, **timer.metrics(),
                           "time/step_s": elapsed, "tokens/sampled": sampler.generated_tokens,
                           "throughput/tokens_per_s": sampler.generated_tokens / elapsed}
                if eval_problems and (step + 1) % cfg.eval.every == 0:
                    metrics.update(run_eval(cfg, graphdef, state.params, task, eval_problems,
                                            scorer))
                logger.log(step + 1, metrics)
                logger.log_groups(step + 1, group_record(ro, idx, cfg.rl.success_threshold))
                if cfg.train.samples_every and (step + 1) % cfg.train.samples_every == 0:
                    logger.log_samples(step + 1, sample_records(ro, batch_examples, task))
                done = step + 1
                stopping = distributed.any_process(stop.requested)  # all hosts stop together
                if (cfg.checkpoint.every and done % cfg.checkpoint.every == 0) or stopping:
                    save(done)
                if stopping:
                    if is_main:
                        print(f"stopped at step {done}; re-run the same command to resume",
                              flush=True)
                    return metrics
            save(int(state.step))
    finally:
        logger.close()
        scorer.close()
        ckpt.close()
    return metrics


def run_eval(cfg, graphdef, params, task, problems, scorer) -> dict[str, float]:
    """No-hint validation: `eval/<benchmark>/avg@k` (and pass@k) with a fixed key."""
    e = cfg.eval
    result = evaluate.evaluate_problems(
        graphdef, params, task, problems, k=e.k, temperature=e.temperature, top_p=e.top_p,
        max_new_tokens=e.max_new_tokens, key=jax.random.PRNGKey(cfg.train.seed + 7),
        scorer=scorer.score)
    return evaluate.eval_metrics(result)


def _device_mib(tree) -> float:
    """MiB that the first local device holds of the arrays of `tree`."""
    dev = jax.local_devices()[0]
    total = 0
    for x in jax.tree.leaves(tree):
        if isinstance(x, jax.Array):
            total += sum(s.data.nbytes for s in x.addressable_shards if s.device == dev)
    return total / 2**20


def _timed(fn, timer, name):
    def call(*args, **kwargs):
        with timer(name):
            return fn(*args, **kwargs)
    return call


def _check_finite(upd, step, last_saved, workdir):
    bad = [k for k in ("loss", "grad_norm") if k in upd and not math.isfinite(float(upd[k]))]
    if bad:
        raise TrainingError(
            f"step {step + 1}: non-finite {', '.join(bad)} ({ {k: float(upd[k]) for k in bad} }); "
            f"stopping without saving. The last good checkpoint (step {last_saved}) in "
            f"{workdir}/checkpoints is intact: lower optim.lr or check the data, then re-run.")


def parse(argv=None):
    p = argparse.ArgumentParser(
        prog="python -m sage_jax.train", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=None,
                   help="YAML config file (default: the built-in configs/toy.yaml)")
    p.add_argument("--workdir", default=None,
                   help="run folder; re-running on the same folder resumes (default: runs/<time>)")
    p.add_argument("overrides", nargs="*", metavar="section.key=value",
                   help="config overrides, e.g. rl.method=grpo optim.lr=3e-6 train.steps=10")
    args = p.parse_args(argv)
    cfg = config_lib.load_config(args.config or DEFAULT_CONFIG, args.overrides)
    workdir = args.workdir or cfg.train.workdir or Path("runs") / datetime.datetime.now(
    ).strftime("%Y%m%d-%H%M%S")
    return cfg, workdir


def run(cfg, workdir) -> dict:
    """`train`, and around it for the built-in toy task: the calibration gate before RL on a
    fresh run (which also resolves `hint.source: auto`), the no-hint evaluation by difficulty
    and summary.md/.png after (single-process runs only: the toy job is a one-machine
    testbed)."""
    from sage_jax.tasks import toy_job
    distributed.initialize_from_env()  # before anything below starts a JAX backend
    toy_extras = toy_job.is_default_toy_run(cfg) and jax.process_count() == 1
    fresh = not (Path(workdir) / "checkpoints").is_dir()
    cal = None
    if toy_extras and fresh and cfg.task.toy.calibrate:
        Path(workdir).mkdir(parents=True, exist_ok=True)
        cal = toy_job.before_rl(cfg, workdir, build.load_model(cfg))
    if toy_extras:
        cfg = toy_job.with_hint_source(cfg, workdir, cal)
    metrics = train(cfg, workdir)
    if toy_extras:
        toy_job.after_rl(cfg, workdir)
    return metrics


def main(argv=None):
    try:
        cfg, workdir = parse(argv)
        run(cfg, workdir)
    except (config_lib.ConfigError, data_lib.DataError, TrainingError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
