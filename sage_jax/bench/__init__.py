"""Benchmarks on the shared peer workloads: `python -m sage_jax.bench {sampler,update}`."""
