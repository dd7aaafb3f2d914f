"""The CPU decode-attention kernel (`engine/sampler/cpu_attention.cc`, an XLA FFI call) equals the XLA
path (`decode._attend` and the cache scatter of `decode_attention.write_rows`, the path the
parity tests check against transformers): one layer on empty, partial and full ranges, per
shard on the 8-device mesh, and whole sampling calls; its build cache is keyed and atomic, and
a machine without a compiler falls back to the XLA path."""

import os
import subprocess
import sys
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sage_jax import models
from sage_jax.config import MeshConfig
from sage_jax.engine.sampler import cpu_attention, decode, decode_attention, placement, programs, sampling
from sage_jax.infra import parallel

REPO = Path(__file__).resolve().parents[2]


def _inputs(b, g, k, q, h, p, s, seed=0):
    rng = np.random.default_rng(seed)
    f = lambda *shape: rng.standard_normal(shape).astype(np.float32)  # noqa: E731
    return dict(queries=f(b * g, k * q * h), pk=f(b, k, h, p), pv=f(b, k, p, h),
                gk=f(b, k, g, h, s), gv=f(b, k, g, s, h), nk=f(b, g, k, h), nv=f(b, g, k, h))


def _xla(x, live_B, slot_R, g, k, q, h):
    """The XLA path: attention output [R, K*Q*H] and the caches after the scatter."""
    b, p = x["pk"].shape[0], x["pk"].shape[-1]
    s = x["gk"].shape[-1]
    mask = np.arange(p)[None, :] >= (p - live_B)[:, None]
    valid = np.arange(s)[None, :] < slot_R[:, None]
    new = (x["nk"].transpose(0, 2, 1, 3), x["nv"].transpose(0, 2, 1, 3))  # [B, K, G, H]
    attn = types.SimpleNamespace(k=k, h=h, n=k * q)
    out = decode._attend(attn, jnp.asarray(x["queries"]), (x["pk"], x["pv"]), jnp.asarray(mask),
                         (x["gk"], x["gv"]), jnp.asarray(valid), new, g)
    gk, gv = decode_attention.write_rows("xla", None, jnp.asarray(x["gk"]), jnp.asarray(x["gv"]),
                                         *new, jnp.asarray(slot_R.reshape(b, g)))
    return np.asarray(out), np.asarray(gk), np.asarray(gv)


def _kernel(x, live_B, slot_R, g, k, q, h, lay=None):
    b, p = x["pk"].shape[0], x["pk"].shape[-1]
    out, gk, gv = jax.jit(cpu_attention.attend, static_argnums=0)(
        lay, x["queries"].reshape(b, g, k, q * h), x["pk"], x["pv"], jnp.asarray(p - live_B),
        x["gk"], x["gv"], x["nk"], x["nv"], jnp.asarray(slot_R.reshape(b, g)))
    return np.asarray(out).reshape(b * g, -1), np.asarray(gk), np.asarray(gv)


@pytest.fixture(autouse=True, scope="module")
def kernel_built():
    ok, why = cpu_attention.status()
    assert ok, why  # g++ is on every machine of this project


@pytest.mark.parametrize("g,q", [(1, 3), (3, 2)])
def test_the_kernel_equals_the_xla_attention_and_cache_write(g, q):
    """5 prompts of 0, 1, 7, P-1 and P live columns; rows at slot -1 (nothing before, not
    written), 0, a middle slot, S-1 (the last written) and S (the whole cache read, not
    written); float32."""
    b, k, h, p, s = 5, 2, 16, 24, 12
    x = _inputs(b, g, k, q, h, p, s)
    live = np.asarray([0, 1, 7, p - 1, p])
    slots = np.resize(np.asarray([-1, 0, 5, s - 1, s, 3, 9]), b * g)
    want = _xla(x, live, slots, g, k, q, h)
    got = _kernel(x, live, slots, g, k, q, h)
    np.testing.assert_allclose(got[0], want[0], rtol=2e-5, atol=2e-6)
    np.testing.assert_array_equal(got[1], want[1])  # the same slots written, the rest kept
    np.testing.assert_array_equal(got[2], want[2])


def test_the_kernel_runs_per_shard_on_the_8_device_mesh():
    """Rows over data x fsdp (4 shards), KV heads over tensor (2): the same outputs and caches
    as on one device."""
    b, g, k, q, h, p, s = 8, 2, 2, 3, 16, 32, 16
    mesh = parallel.make_mesh(MeshConfig(2, 2, 2), jax.devices()[:8])
    lay = placement.layout(mesh, k, b * g)
    assert lay.rows is not None and lay.kv == "tensor"
    x = _inputs(b, g, k, q, h, p, s, seed=1)
    live = np.random.default_rng(2).integers(0, p + 1, b)
    slots = np.random.default_rng(3).integers(-1, s + 1, b * g)
    whole = _kernel(x, live, slots, g, k, q, h)
    sharded = _kernel(x, live, slots, g, k, q, h, lay=lay)
    for got, want in zip(sharded, whole):
        np.testing.assert_array_equal(got, want)
    np.testing.assert_allclose(whole[0], _xla(x, live, slots, g, k, q, h)[0], rtol=2e-5,
                               atol=2e-6)


def test_the_implementation_is_the_kernel_on_cpu_for_float32():
    assert decode_attention.implementation(None) == "cpu"  # the tests' CPU backend
    assert decode_attention.supports("cpu", 64, 24, 96, (jnp.float32, jnp.float32))
    assert not decode_attention.supports("cpu", 64, 24, 96, (jnp.bfloat16, jnp.float32))


@pytest.mark.slow
@pytest.mark.parametrize("on_mesh", [False, True])
def test_sampling_with_the_cpu_kernel_equals_the_xla_path(on_mesh, monkeypatch):
    """Whole calls, sampled with EOS and continuous batching (rows at different steps, slots
    refilled), on one device and per shard on 8: the same tokens and lengths as the XLA path,
    log-probs within 1e-5."""
    cfg = models.DecoderConfig(family="qwen2", vocab_size=32, hidden_size=64,
                               intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                               head_dim=16, qkv_bias=True)
    model = models.Decoder(cfg, rngs=nnx.Rngs(7))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(2, 32, n).tolist() for n in (3, 17, 9, 30)]
    kw = dict(max_new_tokens=40, num_samples=2, temperature=1.0, eos_token_id=(3, 5),
              max_rows=4, key=jax.random.PRNGKey(3),
              mesh=parallel.make_mesh(MeshConfig(2, 2, 2), jax.devices()[:8]) if on_mesh
              else None)
    programs.drop(0)
    got = sampling.generate(model, prompts, **kw)
    monkeypatch.setattr(decode_attention, "implementation", lambda lay: "xla")
    programs.drop(0)
    want = sampling.generate(model, prompts, **kw)
    programs.drop(0)
    assert len(set(want.lengths.ravel().tolist())) >= 3  # rows end at different steps
    np.testing.assert_array_equal(got.tokens, want.tokens)
    np.testing.assert_array_equal(got.lengths, want.lengths)
    np.testing.assert_allclose(got.logprobs, want.logprobs, atol=1e-5)


def test_the_build_key_changes_with_source_flags_and_cpu(monkeypatch, tmp_path):
    cxx = cpu_attention.compiler()
    key = cpu_attention.build_key(cxx)
    with monkeypatch.context() as m:
        m.setattr(cpu_attention, "FLAGS", cpu_attention.FLAGS + ("-DX",))
        assert cpu_attention.build_key(cxx) != key
    with monkeypatch.context() as m:
        m.setattr(cpu_attention, "_cpu_identity", lambda: "another cpu")
        assert cpu_attention.build_key(cxx) != key
    src = tmp_path / "cpu_attention.cc"
    src.write_bytes(cpu_attention.SOURCE.read_bytes() + b"\n// edited\n")
    with monkeypatch.context() as m:
        m.setattr(cpu_attention, "SOURCE", src)
        assert cpu_attention.build_key(cxx) != key
    assert cpu_attention.build_key(cxx) == key


BUILD = ("import sys\nfrom pathlib import Path\nfrom sage_jax.engine.sampler import cpu_attention as c\n"
         "print(c.build(c.compiler(), Path(sys.argv[1])))")


@pytest.mark.slow
def test_concurrent_builds_leave_one_whole_library(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    procs = [subprocess.Popen([sys.executable, "-c", BUILD, str(tmp_path)], env=env,
                              stdout=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=600)[0].strip().splitlines()[-1] for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert outs[0] == outs[1] and [f.name for f in tmp_path.iterdir()] == [Path(outs[0]).name]
    check = subprocess.run([sys.executable, "-c", "import ctypes, sys; ctypes.cdll.LoadLibrary("
                            "sys.argv[1]).SageDecodeAttention", outs[0]], capture_output=True)
    assert check.returncode == 0, check.stderr


STATUS = ("from sage_jax.engine.sampler import cpu_attention as c, decode_attention as d\n"
          "print(c.status()[0], d.supports(d.implementation(None), 16, 16, 16, ()))")


@pytest.mark.parametrize("env,why", [
    ({"CXX": "/nonexistent/g++"}, "the kernel did not build"),
    ({"PATH": "/nonexistent"}, "no C++ compiler found"),
    ({"SAGE_JAX_CPU_KERNEL": "0"}, "SAGE_JAX_CPU_KERNEL=0")])
def test_without_a_compiler_the_xla_path_runs_and_says_why(env, why, tmp_path):
    full = {k: v for k, v in os.environ.items() if k != "CXX"}
    full.update(PYTHONPATH=str(REPO), SAGE_JAX_KERNEL_CACHE=str(tmp_path), **env)
    out = subprocess.run([sys.executable, "-c", STATUS], env=full, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert f"CPU decode attention: XLA path ({why}" in out.stdout
    assert out.stdout.strip().splitlines()[-1] == "False False"
    assert not list(tmp_path.glob("*.so"))
