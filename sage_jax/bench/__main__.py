"""`python -m sage_jax.bench {sampler,update} --workload {small,tiny,real} [--json]`: the sampler
or the update step timed on a benchmark workload (`bench/workloads.py`)."""

from __future__ import annotations

import argparse

from sage_jax.bench import sampler_bench, update_bench, workloads
from sage_jax.infra import cli

BENCHES = {"sampler": sampler_bench.run, "update": update_bench.run}


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m sage_jax.bench", description=__doc__)
    p.add_argument("what", choices=sorted(BENCHES), help="what to time")
    p.add_argument("--workload", default="small", choices=sorted(workloads.WORKLOADS),
                   help="the workload (bench/workloads.py)")
    p.add_argument("--json", action="store_true", help="print one JSON line (the peers' schema)")
    p.add_argument("--data-dir", default=None,
                   help="data folder holding eval/gsm8k/test.jsonl, for the real workload "
                        "(default: $SAGE_JAX_DATA_DIR, else a checkout's ../shared/data)")
    args = p.parse_args(argv)
    cli.run_command(lambda: BENCHES[args.what](args), (FileNotFoundError,))


if __name__ == "__main__":
    main()
