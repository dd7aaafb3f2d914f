"""One training run in a run folder: data -> rollout (sample, reward, SAGE hints) -> batch ->
jitted update, with orbax checkpoints (running it again on the same folder resumes exactly),
metrics (console progress, metrics.jsonl, groups.jsonl, TensorBoard when installed), sample logs
(samples.jsonl) and in-training validation. `python -m sage_jax.train` runs it inside a job
(`sage_jax.jobs`)."""

from __future__ import annotations

import dataclasses
import json
import math
import signal
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from sage_jax.infra import checkpoint, distributed, metrics as metrics_lib
from sage_jax import config as config_lib
from sage_jax.config import Config
from sage_jax.infra import host_memory, parallel, provenance, rewards, wandb_log
from sage_jax.engine.trainer import update
from sage_jax.analysis import compile_check
from sage_jax.engine.trainer import state as trainer_state
from sage_jax.engine.trainer.state import TrainState, param_counts
from sage_jax.eval import accuracy as eval_lib
from sage_jax.rl import batching, engines, rollout
from sage_jax.rl.types import Rollout, RolloutEngine, SageTables
from sage_jax.run import build, restore
from sage_jax.tasks import data as data_lib, registry
from sage_jax.tasks.base import Task
from sage_jax.tasks.benchmarks import Problem
from sage_jax.tasks.data import Example

PROVENANCE_FILE = "provenance.json"  # the run folder's commit, seed and resolved config


class TrainingError(RuntimeError):
    """The run cannot continue (e.g. NaN loss); the last good checkpoint is kept."""


def check_fits(cfg: Config, mesh: Mesh) -> None:
    """Fails before any compile when the step's rows do not fit the mesh and mini-batches."""
    rows = cfg.rl.prompts_per_step * cfg.rl.group_size
    _, _, r = update.batch_split(rows, update.UpdateSettings.of(cfg))
    parallel.check_rows(rows, mesh, "the step's rows (rl.prompts_per_step * rl.group_size)")
    parallel.check_rows(r, mesh, "a micro-batch (rl.micro_batch_size)")


def check_hint_source(cfg: Config) -> None:
    """A ConfigError when a hinted method's hint.source is still `auto`: only the toy job
    resolves it (`jobs.toy_job.with_hint_source`), so every other run names its source."""
    if cfg.rl.hinted and cfg.hint.source == "auto":
        raise config_lib.ConfigError(
            f"hint.source='auto' is resolved only by the toy job (python -m sage_jax.train with "
            f"task.name=toy); this {cfg.task.name} run with rl.method={cfg.rl.method} must name "
            f"its hint source: online, offline, column or reference", key="hint.source")


def aot_check(cfg: Config, mesh: Mesh, say: Callable[[str], None] | None = None) -> None:
    """train.aot_check: the step's programs compiled for `mesh`'s devices at the run's shapes
    (no weights read); their table printed by `say`; `compile_check.DoesNotFit` when one does not fit."""
    report = compile_check.check_run(cfg, build.model_dims(cfg), devices=list(mesh.devices.flat))
    if say:
        say(compile_check.format_report(report))
    compile_check.check_fits(report)


def step_metrics(ro: Rollout, max_new_tokens: int, eos_ids: Sequence[int]) -> dict[str, float]:
    """Reward and response-length metrics of one rollout."""
    lengths = ro.samples.lengths
    last = np.take_along_axis(ro.samples.tokens, np.maximum(lengths - 1, 0)[..., None], -1)[..., 0]
    truncated = (lengths >= max_new_tokens) & ~np.isin(last, list(eos_ids))
    return {"reward/mean": float(ro.rewards.mean()),
            "response/mean_length": float(lengths.mean()),
            "response/clipped_frac": float(truncated.mean())}


def group_record(ro: Rollout, dataset_ids: np.ndarray, success_threshold: float = 0.0
                 ) -> dict[str, list]:
    """Per prompt of the step: dataset id, first-pass status (`core.sage.COLLAPSE_*`), hint level
    and re-sample round of the trained group, and whether the trained group solved it."""
    return {"id": [int(i) for i in dataset_ids], "collapse": ro.collapse.tolist(),
            "level": ro.level.tolist(), "round": ro.round.tolist(),
            "solved": (ro.rewards.max(axis=1) > success_threshold).astype(int).tolist()}


def sample_records(ro: Rollout, examples: Sequence[Example], task: Task, limit: int = 4
                   ) -> list[dict[str, Any]]:
    out = []
    for b in range(min(limit, len(examples))):
        out.append({"problem": examples[b].problem, "answer": examples[b].answer,
                    "level": int(ro.level[b]), "hint": ro.hints[b],
                    "hint_written": ro.hint_written[b] if ro.hint_written else None,
                    "prompt": task.decode(ro.prompts[b]),
                    "responses": ro.texts[b], "rewards": ro.rewards[b].tolist()})
    return out


class _Stop:
    """SIGINT/SIGTERM: finish the current step, save a checkpoint, exit cleanly. A handler the
    caller installed (a Python function) is called too, so a caller running several trainings
    learns of the stop."""

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
        caller = self._old.get(signum)
        if callable(caller) and caller is not signal.default_int_handler:
            caller(signum, frame)

    def __exit__(self, *exc):
        for sig, old in self._old.items():
            signal.signal(sig, old)


@dataclasses.dataclass
class _Run:
    """What a training run holds between steps."""

    cfg: Config
    workdir: Path
    mesh: Mesh
    task: Task
    examples: list[Example]
    graphdef: nnx.GraphDef
    state: TrainState  # without its SAGE tables (`tables` while the loop runs): sage is {}
    tables: SageTables  # host copies of the saved state.sage, updated in place by the rollout
    ckpt: checkpoint.Checkpointer
    step_fn: update.TrainStep
    batch: batching.BatchSettings  # how a rollout becomes the update's batch
    scorer: distributed.ShardedScorer
    logger: metrics_lib.MetricsLogger
    eval_problems: dict[str, list[Problem]] | None
    engine: RolloutEngine  # rollout.engine: samples every pass, validation too
    last_saved: int = 0
    # log-probs of a rollout's answers (`batching.answer_logprobs`): the trainer's in the sampled
    # context, when the rollout correction needs them apart from the update's
    # (rl.loss_context=plain), and the frozen reference's (rl.kl_beta > 0)
    logprob_fn: Callable | None = None
    # rl.kl_beta > 0: the reference's parameters, a copy of the initial policy's (None with
    # LoRA: the current params with the adapters zeroed, `reference`)
    ref_params: Any = None

    def reference(self):
        """The KL reference's parameters: the initial policy (LoRA: the frozen base)."""
        return (trainer_state.without_adapters(self.state.params) if self.ref_params is None
                else self.ref_params)
    # params/trainable and params/total (`param_counts`), logged with every step
    counts: dict[str, int] = dataclasses.field(default_factory=dict)
    # saved with each checkpoint: with LoRA, the frozen base's record (`restore.base_record`)
    extra: dict = dataclasses.field(default_factory=dict)
    sized: bool = False  # the checkpoint's size was printed

    def save(self, step: int) -> None:
        if step != self.last_saved or self.ckpt.latest_step() is None:
            lora = self.cfg.model.lora.rank > 0
            self.ckpt.save(step, trainer_state.checkpointed(
                self.state.replace(sage=self.tables.arrays()), lora), extra=self.extra)
            self.last_saved = step
            if not self.sized and distributed.is_main():
                held = ("the adapters and their optimiser state (not the frozen base)" if lora
                        else "the parameters and the optimiser state")
                print(f"checkpoint: step {step} is {self.ckpt.size_bytes(step) / 2**20:.1f} MiB "
                      f"on disk ({held}) in {self.ckpt.step_dir(step)}", flush=True)
                self.sized = True

    def close(self) -> None:
        self.engine.close()
        self.logger.close()
        self.scorer.close()
        self.ckpt.close()


def train(cfg: Config, workdir: str | Path, *, stop_after: int | None = None) -> dict:
    """Runs (or resumes) training in `workdir`; returns the last step's metrics.

    `stop_after`: stop (with a checkpoint) once this many steps are done in total.
    """
    check_hint_source(cfg)
    build.check_rollout_engine(cfg)  # before anything starts: one line if it cannot run
    run = _start(cfg, Path(workdir))
    end = cfg.train.steps if stop_after is None else min(cfg.train.steps, stop_after)
    metrics: dict = {}
    try:
        with _Stop() as stop:
            for step in range(int(run.state.step), end):
                metrics = _step(run, step)
                done = step + 1
                stopping = distributed.any_process(stop.requested)  # all hosts stop together
                if (cfg.checkpoint.every and done % cfg.checkpoint.every == 0) or stopping:
                    run.save(done)
                if stopping:
                    if distributed.is_main():
                        print(f"stopped at step {done}; re-run the same command to resume",
                              flush=True)
                    return metrics
            run.save(int(run.state.step))
    finally:
        run.close()
    return metrics


def _start(cfg: Config, workdir: Path) -> _Run:
    """The run's pieces, resumed from the latest checkpoint in `workdir` when there is one."""
    distributed.initialize_from_env()  # multi-host: before anything starts a JAX backend
    distributed.check_same({"workdir": str(workdir), "config": config_lib.to_yaml(cfg)})
    workdir.mkdir(parents=True, exist_ok=True)
    is_main = distributed.is_main()
    if is_main:
        config_lib.save_config(cfg, workdir / "config.yaml")
        (workdir / PROVENANCE_FILE).write_text(json.dumps(
            provenance.record(config_lib.to_dict(cfg), cfg.train.seed), indent=1))
        print(f"resolved config: {workdir / 'config.yaml'} (commit and seed: "
              f"{workdir / PROVENANCE_FILE})", flush=True)
    mesh = parallel.make_mesh(cfg.mesh)
    check_fits(cfg, mesh)
    if cfg.train.aot_check:
        aot_check(cfg, mesh, say=print if is_main else None)
    if cfg.logging.wandb:
        wandb_log.require()  # before any heavy work
    task = build.load_task(cfg)
    reward = reward_fn(cfg, task)  # a bad rl.reward fails here, before the model loads
    model = build.load_model(cfg)
    examples, data_stats = build.load_examples(cfg, task)
    if is_main:
        print(f"data: {data_stats}; mesh: {dict(mesh.shape)}; model: {model.cfg.family} "
              f"{model.cfg.num_params() / 1e6:.2f}M params; processes: {jax.process_count()}",
              flush=True)
    graphdef, state = build.initial_state(model, cfg, mesh, len(examples))
    counts = param_counts(state.params, lora=cfg.model.lora.rank > 0)
    if is_main:
        print(f"per device: params {_device_mib(state.params):.1f} MiB, optimiser "
              f"{_device_mib(state.opt_state):.1f} MiB (mesh {dict(mesh.shape)}); trained "
              f"{counts['params/trainable']:,} of {counts['params/total']:,} parameters",
              flush=True)
    # rl.kl_beta > 0 without LoRA: the initial policy, copied before the first step donates it
    ref_params = (jax.tree.map(jnp.copy, state.params)
                  if cfg.rl.kl_beta > 0 and cfg.model.lora.rank == 0 else None)
    # a LoRA checkpoint holds the adapters, and the fingerprint of the base they belong to
    lora = cfg.model.lora.rank > 0
    extra = restore.base_record(cfg, state.params) if lora else {}
    ckpt = checkpoint.Checkpointer(workdir, keep=cfg.checkpoint.keep,
                                   checksums=cfg.checkpoint.checksums)
    _resume_from(ckpt, cfg.train.resume_step, is_main)
    say = (lambda line: print(line, flush=True)) if is_main else (lambda line: None)
    resumed = ckpt.restore_latest_good(target=trainer_state.checkpointed(state, lora),
                                       report=say)
    if resumed is not None:
        saved, saved_extra, step = resumed
        if lora:
            restore.check_base(saved_extra, extra, ckpt.step_dir(step))
        state = trainer_state.with_base(saved, state, lora)
        say(f"resumed from {ckpt.step_dir(step)}")
    start = int(state.step)
    engine = build.rollout_engine(cfg, model.cfg, graphdef, state.params, task, mesh)
    scorer = distributed.ShardedScorer(rewards.RewardPool(  # each process scores its share
        reward, timeout_s=cfg.rl.reward_timeout_s))
    wandb_run = (wandb_log.WandbRun(workdir, cfg.logging, config_lib.to_dict(cfg))
                 if cfg.logging.wandb and is_main else None)
    logger = metrics_lib.MetricsLogger(workdir, total_steps=cfg.train.steps, is_main=is_main,
                                       resume_step=start, wandb_run=wandb_run)
    batch = batching.BatchSettings.of(cfg, task.pad_id, engine.trainer_logprobs)
    # The SAGE tables live on the host while the loop runs (the rollout updates them in place)
    # and join the state only to be saved: the train step never sees them, so its inputs are
    # the same kind of arrays at every step (host tables at step 1 compiled it twice).
    return _Run(cfg=cfg, workdir=workdir, mesh=mesh, task=task, examples=examples,
                graphdef=graphdef, state=state.replace(sage={}),
                tables=SageTables.from_arrays(state.sage),
                ckpt=ckpt,
                step_fn=update.TrainStep(graphdef, update.UpdateSettings.of(cfg), mesh),
                batch=batch,
                scorer=scorer, logger=logger, eval_problems=load_eval_problems(cfg) if cfg.eval.every else None,
                last_saved=start, engine=engine, counts=counts, extra=extra,
                logprob_fn=update.make_logprob_fn(
                    graphdef, mesh, micro_batch_size=cfg.rl.micro_batch_size,
                    chunk=cfg.rl.logprob_chunk)
                if batch.sampled_context or cfg.rl.kl_beta > 0 else None,
                ref_params=ref_params)


def _resume_from(ckpt: checkpoint.Checkpointer, step: int | None, is_main: bool) -> None:
    """train.resume_step: the steps after it are set aside, once (a marker file records it, so
    re-running the same command continues instead of rolling back again)."""
    marker = ckpt.directory.parent / "resumed_from.json"
    if step is None or (marker.is_file() and json.loads(marker.read_text()) == {"step": step}):
        return
    for moved in ckpt.set_aside_after(step):
        if is_main:
            print(f"train.resume_step={step}: set checkpoint {moved.name} aside", flush=True)
    if is_main:
        marker.write_text(json.dumps({"step": step}))


def _step(run: _Run, step: int) -> dict:
    """One RL step (rollout, batch, update; validation when due), logged; returns its metrics."""
    cfg, task, mesh = run.cfg, run.task, run.mesh
    t_step = time.perf_counter()
    timer = metrics_lib.Timer()  # the phases of `infra.phases.PHASES` that the loop runs
    with timer("host"):
        idx, position = data_lib.next_batch_indices(
            int(run.state.data_position), cfg.rl.prompts_per_step, len(run.examples),
            cfg.train.seed, cfg.data.shuffle)
        batch_examples = [run.examples[i] for i in idx]
        sampler = engines.StepSampler(run.engine, jax.random.fold_in(run.state.rng, step))
    ro = rollout.run(batch_examples, idx, task=task, sampler=_timed(sampler, timer, "sample"),
                     scorer=_timed(run.scorer.score, timer, "reward"), rl=cfg.rl,
                     hint=cfg.hint, tables=run.tables, step=step)
    with timer("host"):
        host_memory.trim()  # what sampling freed, before the update's peak
        # The old log-probs are JAX's: another engine's are only compared with them (`gap`).
        gap = run.engine.logprob_gap(ro)
        sampled = ref = None
        if run.batch.sampled_context:  # the rollout correction under loss_context=plain
            sampled = batching.answer_logprobs(ro, run.logprob_fn, run.state.params, mesh,
                                               context="hinted", pad_id=task.pad_id)
        if cfg.rl.kl_beta > 0:
            ref = batching.answer_logprobs(ro, run.logprob_fn, run.reference(), mesh,
                                           context=run.batch.loss_context, pad_id=task.pad_id)
        batch = batching.update_batch(ro, run.step_fn.settings, run.batch, sampled, ref)
    with timer("update"):
        # This process's rows (or packed sequences) of each array; each is split over the mesh.
        state, upd = run.step_fn(run.state, parallel.shard_batch(
            {k: v[parallel.local_rows(len(v), mesh)] for k, v in batch.items()}, mesh))
        upd = jax.device_get(upd)
    with timer("host"):
        run.state = state.replace(data_position=parallel.replicate(np.int32(position), mesh))
        with timer("sync"):  # time/sync_s: a part of time/host_s, not a phase of its own
            synced = run.engine.sync(run.state.params)  # the updated policy samples next
        host_memory.trim()
    _check_finite(upd, step, run.last_saved, run.workdir)
    elapsed = time.perf_counter() - t_step
    metrics = {**step_metrics(ro, cfg.rl.max_new_tokens, task.eos_ids), **ro.metrics, **gap,
               **{k: float(v) for k, v in upd.items()}, **timer.metrics(),
               **synced, **run.counts, "time/step_s": elapsed,
               "tokens/sampled": sampler.generated_tokens,
               "throughput/tokens_per_s": sampler.generated_tokens / elapsed}
    if run.eval_problems and (step + 1) % cfg.eval.every == 0:
        metrics.update(run_eval(cfg, run.engine, task, run.eval_problems, run.scorer))
    run.logger.log(step + 1, metrics)
    run.logger.log_groups(step + 1, group_record(ro, idx, cfg.rl.success_threshold))
    if cfg.train.samples_every and (step + 1) % cfg.train.samples_every == 0:
        run.logger.log_samples(step + 1, sample_records(ro, batch_examples, task))
    return metrics


def reward_fn(cfg: Config, task: Task) -> rewards.RewardFn:
    """The run's reward: `rl.reward` (a name given to `rewards.register_reward`), else the
    task's own."""
    if cfg.rl.reward is None:
        return task.reward_fn
    try:
        return rewards.get_reward(cfg.rl.reward)
    except KeyError as e:
        raise config_lib.ConfigError(f"rl.reward={cfg.rl.reward!r}: {e.args[0]}",
                                     key="rl.reward") from None


def load_eval_problems(cfg: Config) -> dict[str, list[Problem]]:
    """The run's validation problems: its task's built-in ones, else cfg.eval.benchmarks."""
    builtin = registry.plugin(cfg.task.name).eval_problems
    if builtin is not None:
        return builtin(cfg, cfg.eval.limit)
    return eval_lib.load_problems(list(cfg.eval.benchmarks), cfg.eval.data_dir,
                                  limit=cfg.eval.limit)


def run_eval(cfg: Config, engine: RolloutEngine, task: Task,
             problems: dict[str, list[Problem]], scorer: distributed.ShardedScorer
             ) -> dict[str, float]:
    """No-hint validation by the run's engine (synced to the policy): `eval/<benchmark>/avg@k`
    (and pass@k) with a fixed key."""
    e = cfg.eval
    result = eval_lib.evaluate_problems(
        engine, task, problems, k=e.k, temperature=e.temperature, top_p=e.top_p,
        max_new_tokens=e.max_new_tokens, key=jax.random.PRNGKey(cfg.train.seed + 7),
        scorer=scorer.score)
    return eval_lib.eval_metrics(result)


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
