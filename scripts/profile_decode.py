"""Where a decode step's time goes on the `real` workload (SmolLM2-135M-Instruct, float32, CPU).

    SMOL_HF=<folder> python scripts/profile_decode.py [--rows 32,16,8] [--slots 256] [--json]
    TORCH_PY=<python with torch> ... also times the same matrix products in torch (oneDNN)

Times, per row count R, one decode step of the sampler (`engine.sampler.decode._step` and greedy
selection, as a segment runs it) and its parts, each as 16 steps inside one jitted loop so that
no dispatch is counted (median of 7 runs):
  step        the whole step: embedding, 30 layers, final norm, LM head, token choice;
  matmuls     the 30 layers' seven projections alone (q, k, v, o, gate, up, down);
  head        the LM head [R, D] x [D, V] with the log-softmax and argmax of the token choice;
  attention   the attention core alone (`decode._attend`) over P prompt and S generated slots;
  rest        step - (matmuls + head + attention): norms, RoPE, SiLU, cache writes, the loop.
With TORCH_PY, the same `matmuls` and `head` products run in torch in a subprocess (same
weights' shapes, same R), the engine vLLM's CPU backend uses for its linear layers. Prints one
line per R (and with --json one JSON line).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from sage_jax import models  # noqa: E402
from sage_jax.bench import workloads  # noqa: E402
from sage_jax.engine.sampler import decode  # noqa: E402

STEPS, REPEATS = 16, 7

TORCH_SRC = r"""
import json, statistics, sys, time, torch
torch.set_num_threads(int(sys.argv[1]))
r, d, f, v, layers, q_out, kv_out = map(int, sys.argv[2:9])
g = torch.Generator().manual_seed(0)
ws = [[torch.randn(o, i, generator=g) * 0.02 for o, i in ((q_out, d), (kv_out, d), (kv_out, d),
       (d, q_out), (f, d), (f, d), (d, f))] for _ in range(layers)]
head = torch.randn(v, d, generator=g) * 0.02
x0 = torch.randn(r, d, generator=g)
lin = torch.nn.functional.linear
def matmuls(x):
    for wq, wk, wv, wo, wg, wu, wd in ws:
        a = lin(x, wq); lin(x, wk); lin(x, wv)
        x = x + lin(a, wo)
        x = x + lin(torch.nn.functional.silu(lin(x, wg)) * lin(x, wu), wd)
    return x
def head_fn(x):
    lg = lin(x, head)
    return torch.log_softmax(lg, -1).amax(-1), lg.argmax(-1)
out = {}
with torch.inference_mode():
    for name, fn in (("matmuls", matmuls), ("head", head_fn)):
        fn(x0)
        t = []
        for _ in range(%d):
            s = time.perf_counter()
            for _ in range(%d):
                fn(x0)
            t.append((time.perf_counter() - s) / %d)
        out[name] = statistics.median(t)
print(json.dumps(out))
""" % (REPEATS, STEPS, STEPS)


def _timed(fn, *args):
    """Median seconds of one of the STEPS iterations of `fn` (jitted, compiled first)."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append((time.perf_counter() - t0) / STEPS)
    return statistics.median(times)


def _loop(body):
    """jit of `STEPS` iterations of body(x) -> x."""
    return jax.jit(lambda x, *a: jax.lax.fori_loop(0, STEPS, lambda i, y: body(y, *a), x))


def profile(model, r: int, p: int, s: int) -> dict:
    """Seconds per decode step of each part at R rows, P prompt and S generated slots."""
    cfg = model.cfg
    graphdef, params = nnx.split(model)
    kh, h, nh = cfg.num_kv_heads, cfg.head_dim, cfg.num_heads
    rng = np.random.default_rng(0)
    f32 = lambda *shape: jnp.asarray(rng.standard_normal(shape, np.float32) * 0.5)  # noqa: E731
    prompt_kv = tuple((f32(r, kh, h, p), f32(r, kh, p, h)) for _ in range(cfg.num_layers))
    gen_kv = tuple((f32(r, kh, 1, h, s), f32(r, kh, 1, s, h)) for _ in range(cfg.num_layers))
    mask = jnp.ones((r, p), bool)
    x0 = f32(r, cfg.hidden_size)

    def step(tok, params, prompt_kv, gen_kv):
        m = nnx.merge(graphdef, params)
        logits, _ = decode._step(m, tok, jnp.full((r,), p, jnp.int32),
                                 jnp.full((r,), s // 2, jnp.int32), prompt_kv, mask, gen_kv, 1)
        return jnp.argmax(jax.nn.log_softmax(logits), -1).astype(jnp.int32)

    def matmuls(x, params):
        m = nnx.merge(graphdef, params)
        for layer in m.layers:
            at, mlp = layer.self_attn, layer.mlp
            a = at.q_proj(x)
            x = x + 0.0 * (at.k_proj(x)[:, :1] + at.v_proj(x)[:, :1])
            x = x + at.o_proj(a)
            x = x + mlp.down_proj(jax.nn.silu(mlp.gate_proj(x)) * mlp.up_proj(x))
        return x

    def head(x, params):
        m = nnx.merge(graphdef, params)
        lp = jax.nn.log_softmax(m.logits(x))
        return x + (jnp.max(lp, -1) + jnp.argmax(lp, -1))[:, None] * 1e-9

    def attention(x, prompt_kv, gen_kv):
        at = model.layers[0].self_attn
        valid = jnp.broadcast_to(jnp.arange(s) < s // 2, (r, s))
        q = jnp.tile(x, (1, -(-nh * h // x.shape[1])))[:, :nh * h]  # [R, N*H] queries
        new = (q[:, :kh * h].reshape(r, kh, 1, h), q[:, :kh * h].reshape(r, kh, 1, h))
        out = q
        for pkv, gkv in zip(prompt_kv, gen_kv):
            out = out + decode._attend(at, out, pkv, mask, gkv, valid, new, 1)
        return x + out[:, :x.shape[1]] * 1e-9

    tok0 = jnp.zeros((r,), jnp.int32)
    t = {"step": _timed(_loop(step), tok0, params, prompt_kv, gen_kv),
         "matmuls": _timed(_loop(matmuls), x0, params),
         "head": _timed(_loop(head), x0, params),
         "attention": _timed(_loop(attention), x0, prompt_kv, gen_kv)}
    t["rest"] = t["step"] - t["matmuls"] - t["head"] - t["attention"]
    return t


def torch_times(model, r: int) -> dict | None:
    py = os.environ.get("TORCH_PY")
    if not py:
        return None
    c = model.cfg
    args = [str(os.cpu_count() or 1), str(r), str(c.hidden_size), str(c.intermediate_size),
            str(c.vocab_size), str(c.num_layers), str(c.num_heads * c.head_dim),
            str(c.num_kv_heads * c.head_dim)]
    out = subprocess.run([py, "-c", TORCH_SRC, *args], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="32,16,8", help="row counts R to profile")
    ap.add_argument("--slots", type=int, default=256, help="generated-token cache slots S")
    ap.add_argument("--prompt", type=int, default=256, help="prompt columns P (the real "
                                                              "workload's prompt bucket)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    w = workloads.load_workload("real")
    model = models.from_hf(workloads.model_dir(w))
    rec = {"jax": jax.__version__, "prompt": args.prompt, "slots": args.slots, "rows": {}}
    for r in map(int, args.rows.split(",")):
        t = profile(model, r, args.prompt, args.slots)
        tt = torch_times(model, r)
        line = (f"R={r:3d}: step {t['step'] * 1e3:6.2f} ms = matmuls {t['matmuls'] * 1e3:6.2f} "
                f"+ head {t['head'] * 1e3:5.2f} + attention {t['attention'] * 1e3:5.2f} "
                f"+ rest {t['rest'] * 1e3:5.2f}")
        if tt:
            line += (f" | torch: matmuls {tt['matmuls'] * 1e3:6.2f} ms, head "
                     f"{tt['head'] * 1e3:5.2f} ms")
            t.update({f"torch_{k}": v for k, v in tt.items()})
        print(line, flush=True)
        rec["rows"][r] = {k: round(v * 1e3, 3) for k, v in t.items()}
    if args.json:
        print(json.dumps(rec))
    return rec


if __name__ == "__main__":
    main()
