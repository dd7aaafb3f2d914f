"""`train.compile_cache`: JAX's persistent compilation cache (later runs load compiled programs)."""

import os
import subprocess
import sys

from sage_jax.infra import compile_cache
from sage_jax import config
from sage_jax.tasks import registry


def test_enable_makes_compiles_land_in_the_folder(tmp_path):
    folder = tmp_path / "xla"
    code = ("import sys, jax, jax.numpy as jnp; from sage_jax.infra import compile_cache; "
            "print(compile_cache.enable(sys.argv[1])); "
            "jax.jit(lambda x: jnp.sin(x) * 3)(jnp.ones(7)).block_until_ready()")
    env = {k: v for k, v in os.environ.items() if k != compile_cache.ENV}
    got = subprocess.run([sys.executable, "-c", code, str(folder)], env=env, text=True,
                         capture_output=True, timeout=300)
    assert got.returncode == 0, got.stderr
    assert got.stdout.strip() == str(folder)
    assert folder.is_dir() and any(folder.iterdir()), "no compiled program was kept"


def test_jax_variable_wins_and_the_default_is_on(monkeypatch):
    monkeypatch.setenv(compile_cache.ENV, "/somewhere/else")
    assert compile_cache.enable("~/ours") == "/somewhere/else"
    assert registry.load_config(config.DEFAULT_CONFIG).train.compile_cache
    cfg = registry.load_config(config.DEFAULT_CONFIG, ["train.compile_cache=null"])
    assert cfg.train.compile_cache is None
