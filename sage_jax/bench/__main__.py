"""`python -m sage_jax.bench {sampler,update} --workload small [--json]`."""

from __future__ import annotations

import argparse
import importlib

from sage_jax.infra import host_memory


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m sage_jax.bench", description=__doc__)
    p.add_argument("what", choices=["sampler", "update"], help="what to time")
    p.add_argument("--workload", default="small", help="workload name in workloads.json")
    p.add_argument("--json", action="store_true", help="print one JSON line (the peers' schema)")
    p.add_argument("--peers-dir", default=None, help="folder of the peer scripts (_common.py)")
    args = p.parse_args(argv)
    host_memory.tune_malloc()  # as every entry command (`cli.run_command`)
    importlib.import_module(f"sage_jax.bench.{args.what}").run(args)


if __name__ == "__main__":
    main()
