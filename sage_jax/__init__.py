"""sage_jax: GRPO and SAGE (self-hinting GRPO) for LLMs in JAX/Flax, on TPUs, GPUs and CPUs."""

__version__ = "0.1.0"
