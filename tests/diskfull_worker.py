"""One run of tests/run/test_train.py's disk-full test: `python tests/diskfull_worker.py WORKDIR`.

Trains the toy task for one step (checkpoint 1), then runs `python -m sage_jax.train` for a
second step with a file-size limit (RLIMIT_FSIZE, SIGXFSZ ignored) set when step 2's checkpoint
is saved, as a full disk fails the write."""

import resource
import signal
import sys

from sage_jax.infra import checkpoint
from sage_jax import config, train
from sage_jax.run import loop
from sage_jax.tasks import registry

ARGS = ["rl.prompts_per_step=4", "rl.group_size=4", "rl.max_new_tokens=16", "rl.minibatches=2",
        "checkpoint.every=1", "train.samples_every=0", "task.toy.warm_start=false",
        "rl.method=grpo", "task.toy.calibrate=false", "task.toy.report=false"]
LIMIT_BYTES = 200_000  # below the size of a parameter file, above that of metrics.jsonl


def main(workdir: str) -> None:
    loop.train(registry.load_config(config.CONFIG_DIR / "toy_uniform.yaml",
                                    ARGS + ["train.steps=1"]), workdir)
    real_save = checkpoint.Checkpointer.save

    def save_on_a_full_disk(self, step, state, **kw):
        resource.setrlimit(resource.RLIMIT_FSIZE, (LIMIT_BYTES, resource.RLIM_INFINITY))
        return real_save(self, step, state, **kw)

    checkpoint.Checkpointer.save = save_on_a_full_disk
    train.main(["--config", "toy_uniform", "--workdir", workdir, *ARGS, "train.steps=2"])


if __name__ == "__main__":
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
    main(sys.argv[1])
