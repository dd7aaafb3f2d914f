"""`python -m sage_jax.aot --config NAME --topology TOPO [--preset M | --hf-config FILE]
[--json] [section.key=value ...]`: compile a run's programs for hardware you do not have.

Compiles, compile-only, every program a training step of the config runs (the train step, the
rollout's prefill, decode segments and regrouping, the hint-writing programs) for a TPU slice
(`v5p-16`, `v5litepod-16`, `v4-32`, or libtpu's `v5p:2x2x2`) or GPUs (`8xh100`,
`8xa100-80gb`), at the shapes the run will use, and prints per program the compile time and
per-device GiB (arguments, outputs, temporaries, peak, what stays resident beside it), the
matmul FLOPs and a roofline time, then the step's FLOPs, roofline time and MFU bound
(`sage_jax.analysis.compile_check`). No weights or data are read: the model's dimensions come from
`--hf-config`, `--preset`, or model.path's config.json. Exits with status 2 and one line naming
the program, its GiB, the HBM and the knob to turn when a program does not fit with
`--headroom` (default 10%) of HBM free.

TPU needs the TPU compiler that matches jax: `pip install -r requirements-tpu.txt`; GPUs the
CUDA plugin: `pip install -r requirements-gpu-aot.txt` (no GPU or CUDA libraries needed; the
process runs jax on the CPU). On GPUs the HBM a program may use is XLA_PYTHON_CLIENT_MEM_FRACTION
of it (jax's default 0.75), as on the real node.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from sage_jax.infra import cli, provenance
from sage_jax import config as config_lib, models
from sage_jax.analysis import compile_check
from sage_jax.models.presets import PRESETS
from sage_jax.run import build
from sage_jax.tasks import registry


def parse(argv=None):
    p = argparse.ArgumentParser(prog="python -m sage_jax.aot", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=None, help="YAML config file or a shipped one's name")
    p.add_argument("--topology", required=True, help="v5p-16, v5litepod-16, v5e:2x2, 8xh100, ...")
    p.add_argument("--preset", choices=sorted(PRESETS), help="the model's dimensions, built in")
    p.add_argument("--hf-config", help="a Hugging Face config.json with the model's dimensions")
    p.add_argument("--prompt-len", type=int,
                   help="longest rendered prompt in tokens (default data.max_prompt_tokens)")
    p.add_argument("--only", default="train,rollout,hint",
                   help="program families to compile (default train,rollout,hint)")
    p.add_argument("--all-buckets", action="store_true",
                   help="every program a sampling call may run (SamplingPlan.programs), "
                        "not only the largest of each kind")
    p.add_argument("--headroom", type=float, default=compile_check.HEADROOM,
                   help="share of HBM that must stay free (default 0.10)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("overrides", nargs="*", metavar="section.key=value")
    return p.parse_args(argv)


def model_dims(cfg, preset: str | None = None, hf_config: str | None = None
               ) -> models.DecoderConfig:
    """The decoder's dimensions: `hf_config`, `preset`, else the run's own (`build.model_dims`)."""
    if hf_config:
        return models.DecoderConfig.from_hf_dict(json.loads(Path(hf_config).read_text()),
                                               source=hf_config)
    if preset:
        return models.DecoderConfig.from_hf_dict(PRESETS[preset], source=f"preset {preset}")
    return build.model_dims(cfg)


def main(argv=None):
    def run():
        args = parse(argv)
        cfg = registry.load_config(args.config or config_lib.DEFAULT_CONFIG, args.overrides)
        dims = model_dims(cfg, args.preset, args.hf_config)
        log = None if args.json else (lambda line: print(line, flush=True))
        if log:
            print(compile_check.HEADER, flush=True)
        report = compile_check.check_run(cfg, dims, args.topology, prompt_len=args.prompt_len,
                               all_buckets=args.all_buckets, log=log,
                               only=tuple(args.only.split(",")))
        if args.json:
            record = compile_check.to_json(report)
            record["argv"] = list(sys.argv[1:] if argv is None else argv)
            record["provenance"] = provenance.record(config_lib.to_dict(cfg), cfg.train.seed)
            print(json.dumps(record))
        else:
            print(compile_check.format_report(report))
        sys.stdout.flush()
        compile_check.check_fits(report, args.headroom)

    cli.run_command(run, (ValueError, FileNotFoundError))


if __name__ == "__main__":
    main()
