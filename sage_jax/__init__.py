"""sage_jax: GRPO and SAGE (self-hinting GRPO) for LLMs in JAX/Flax, on TPUs, GPUs and CPUs."""

import os

# transformers prints "PyTorch was not found ..." on import (once per process, so once more per
# reward worker); this library never uses torch. Set the variable to 0 to see it again.
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

__version__ = "0.1.0"
