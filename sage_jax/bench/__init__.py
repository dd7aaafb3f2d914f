"""Benchmarks on fixed workloads, beside the peers' (tunix, transformers, vLLM):
`python -m sage_jax.bench {sampler,update}`."""
