"""One process of tests/infra/test_multihost.py:
`python tests/multihost_worker.py WORKDIR REPORT [kill|term STEP]`.

The environment gives the cluster (JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID,
4 fake CPU devices each). Checks the host-side helpers of `sage_jax.infra.distributed`, then trains the
toy task for two steps with `loop.train` (checkpoint at step 2), restores the latest checkpoint on
all processes with the trainer's own restore path, and writes REPORT (JSON): the helpers'
results, the process layout, the steps this process ran, the checkpoints it saved, the last
metrics and a hash of every parameter. `kill STEP`: process 1 SIGKILLs itself after step STEP.
`term STEP`: process 1 (only) gets a SIGTERM as step STEP starts, as a preempted host does.
"""

import hashlib
import json
import os
import signal
import sys

import numpy as np

from sage_jax.run import loop
from sage_jax.run import restore
from sage_jax.infra import checkpoint, distributed
from sage_jax.tasks import registry

# rl.reward_timeout_s: a fresh reward worker imports the toy task (jax, flax) on its first answer,
# which can take more than the default 5 s on a loaded 2-core machine.
ARGS = ["rl.method=grpo", "rl.prompts_per_step=4", "rl.group_size=4", "rl.max_new_tokens=16",
        "rl.minibatches=2", "rl.reward_timeout_s=60", "train.steps=2", "checkpoint.every=2",
        "checkpoint.keep=2", "train.samples_every=1", "task.toy.warm_start=false"]


def param_hashes(model) -> dict[str, str]:
    from flax import nnx
    flat = nnx.to_flat_state(nnx.state(model, nnx.Param))
    host = distributed.fetch({"/".join(map(str, k)): v.get_value() for k, v in flat})
    return {k: hashlib.sha256(v.tobytes()).hexdigest() for k, v in host.items()}


def main(workdir: str, report: str, fault: str | None = None, at: int | None = None) -> None:
    assert distributed.initialize_from_env(), "the environment should ask for 2 processes"
    import jax
    from sage_jax import config

    steps_run, saves = [], []
    real_step, real_save = loop._step, checkpoint.Checkpointer.save

    def watched_step(run, step):
        if fault == "term" and step + 1 == at and jax.process_index() == 1:
            print(f"process 1: SIGTERM as step {step + 1} starts", flush=True)
            os.kill(os.getpid(), signal.SIGTERM)
        steps_run.append(step + 1)
        out = real_step(run, step)
        if fault == "kill" and step + 1 == at and jax.process_index() == 1:
            print(f"process 1: killing myself after step {step + 1}", flush=True)  # host lost
            os.kill(os.getpid(), signal.SIGKILL)
        return out

    def counted_save(self, step, state, **kw):
        saves.append(step)
        return real_save(self, step, state, **kw)

    loop._step, checkpoint.Checkpointer.save = watched_step, counted_save
    out = {"helpers": helpers()}
    cfg = registry.load_config(config.CONFIG_DIR / "toy_uniform.yaml", ARGS)
    metrics = loop.train(cfg, workdir)
    _, model, restored = restore.restore_policy(workdir)  # every process restores (orbax needs all)
    out.update(process_index=jax.process_index(), process_count=jax.process_count(),
               devices=jax.device_count(), local_devices=jax.local_device_count(),
               steps_run=steps_run, saves=saves, restored_step=restored, loss=metrics["loss"],
               reward=metrics["reward/mean"], params=param_hashes(model))
    with open(report, "w") as f:
        json.dump(out, f)


class _LengthPool:
    """A stand-in reward pool: the score of an answer is its length."""

    def score(self, responses, truths):
        return np.asarray([len(r) for r in responses], np.float32), {"n": len(responses)}


def helpers() -> dict:
    """Results of the host-side helpers, run on every process."""
    import jax
    from sage_jax import config
    from sage_jax.infra import parallel

    p = jax.process_index()
    out = {"process_index": p}
    texts = ["x" * i for i in range(7)]  # 7 answers over 2 processes: 4 + 3
    scores, stats = distributed.ShardedScorer(_LengthPool()).score(texts, [""] * 7)
    out["scores"], out["stats"] = scores.tolist(), stats
    out["empty"] = distributed.gather_rows(np.zeros(0, np.float32), 0).tolist()
    out["any"] = distributed.any_process(p == 1)
    distributed.check_same({"same": "x"})
    try:
        distributed.check_same({"same": "x", "workdir": f"runs/{p}"})
        out["mismatch"] = None
    except distributed.DistributedError as e:
        out["mismatch"] = str(e)
    mesh = parallel.make_mesh(config.MeshConfig())
    rows = parallel.local_rows(16, mesh)
    x = np.arange(16 * 3).reshape(16, 3)
    batch = parallel.shard_batch({"x": x[rows]}, mesh, global_rows=16)
    out["local_rows"] = [rows.start, rows.stop]
    out["batch_ok"] = bool((distributed.fetch(batch["x"]) == x).all())
    out["batch_sharded"] = not batch["x"].is_fully_addressable
    out["replicated"] = int(distributed.fetch(parallel.replicate(np.int32(7), mesh)))
    return out


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], *([sys.argv[3], int(sys.argv[4])] if len(sys.argv) > 3 else []))
