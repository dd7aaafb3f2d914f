"""Peak RSS and time of the word-problem warm start's first SFT steps, with or without layer
remat and logits in column chunks (the settings `tasks/words/hf_warm_start.py` fixes):

    python scripts/sft_memory.py --model DIR --chunk none --remat 0 --steps 6   # one process
    python scripts/sft_memory.py --model DIR --chunk 64 --remat 1 --steps 6     # per setting

Prints one JSON line: the settings, the commit, seconds, per-step losses, the time at each
step's end and the process's peak RSS (`ru_maxrss`). Same seed, same batches in every setting.
"""

from __future__ import annotations

import argparse
import json
import resource
import time
from pathlib import Path

from sage_jax import models
from sage_jax.engine.trainer import sft_step as sft
from sage_jax.infra import provenance
from sage_jax.tasks import registry
from sage_jax.tasks.words import hf_warm_start as warm
from sage_jax.tasks.words.prompts import WordsTask
from sage_jax.tasks.words.words_config import WordsConfig


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="SmolLM2 folder (scripts/get_smollm2.py)")
    ap.add_argument("--chunk", default="none", help="logit columns per chunk, or none")
    ap.add_argument("--remat", type=int, default=0)
    ap.add_argument("--steps", type=int, default=6)
    args = ap.parse_args(argv)
    base = Path(args.model).expanduser()
    chunk = None if args.chunk == "none" else int(args.chunk)
    cfg = registry.load_config("smollm2_words", [f"model.path={base}"])
    w = cfg.task.section(WordsConfig)
    task = WordsTask(models.Tokenizer(base))
    model = models.from_hf(base, remat=bool(args.remat))
    ends: list[float] = []
    t0 = time.perf_counter()
    _, res = sft.train_sft(
        model, lambda rng, n: warm.sft_examples(task, rng, n, max_steps=w.max_steps,
                                                write_share=w.sft_write_share,
                                                hinted_share=w.sft_hinted_share),
        steps=args.steps, batch_size=w.sft_batch_size, lr=w.sft_lr, seed=w.sft_seed,
        pad_id=task.pad_id, bucket=warm.SFT_BUCKET, warmup=warm.WARMUP_STEPS, log_every=1,
        progress=lambda _: ends.append(round(time.perf_counter() - t0, 1)),
        logprob_chunk=chunk)
    rec = {"chunk": chunk, "remat": bool(args.remat), "steps": args.steps,
           "commit": provenance.commit(), "seconds": res.seconds, "losses": res.losses,
           "step_ends_s": ends,
           "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    print(json.dumps(rec), flush=True)
    return rec


if __name__ == "__main__":
    main()
