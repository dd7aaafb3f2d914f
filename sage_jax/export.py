"""`python -m sage_jax.export --checkpoint WORKDIR[/STEP] --out DIR`: a plain HF checkpoint.

Writes DIR/config.json and DIR/model.safetensors (the policy's parameters at the checkpoint's
step; latest step by default) plus the base model's tokenizer files copied from the run's
`model.path` (tokenizer*.json, vocab/merges, tokenizer.model, special_tokens_map.json,
added_tokens.json, chat template files, generation_config.json and licence files), so that
`transformers.AutoModelForCausalLM.from_pretrained(DIR)` and `AutoTokenizer.from_pretrained(DIR)`
load it and serving stacks (vLLM, SGLang, TGI) can run it. DIR/sage_export.json records where it
came from.

A LoRA run (`model.lora.rank` > 0) is exported twice: DIR holds its adapters folded into the
kernels (the model above), and DIR/adapter/ holds the adapters alone as a PEFT adapter folder
(adapter_config.json, adapter_model.safetensors) for the run's base model `model.path`:
`peft.PeftModel.from_pretrained(base, DIR/adapter)` on that model, or a server's LoRA slot
(vLLM's `--lora-modules`). sage_export.json's `adapter` names the folder (null without LoRA).

Hints are a training-time device only: the policy is the same network with or without them, so
the export is the hint-free policy, prompted with the bare problem.

A toy-task run has no Hugging Face tokenizer (its tokenizer is the library's character-level
`CharTokenizer`): the export then holds the weights and config only, and says so.
"""

from __future__ import annotations

import argparse
from typing import Any

from sage_jax.infra import cli
from sage_jax import config as config_lib
from sage_jax.run import hf_export as export


def main(argv=None) -> dict[str, Any]:
    p = argparse.ArgumentParser(prog="python -m sage_jax.export", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True, metavar="WORKDIR[/STEP]",
                   help="training run folder (its latest checkpoint), or WORKDIR/STEP")
    p.add_argument("--out", required=True, help="folder to write the Hugging Face checkpoint to")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                   help="weights dtype (default: the run's model.dtype)")
    p.add_argument("--overwrite", action="store_true", help="write into a non-empty --out")
    args = p.parse_args(argv)
    return cli.run_command(
        lambda: export.export_checkpoint(args.checkpoint, args.out, dtype=args.dtype,
                                         overwrite=args.overwrite),
        (FileNotFoundError, FileExistsError, ValueError, config_lib.ConfigError))


if __name__ == "__main__":
    main()
