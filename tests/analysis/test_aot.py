"""Compile-only checks for hardware that is not here (`sage_jax.analysis.compile_check`, `python -m
sage_jax.aot`): a tiny decoder's train step and sampler programs compiled by the XLA TPU
compiler for a v5e:2x2 slice (libtpu, `requirements-tpu.txt`) and by the XLA GPU compiler for
4 A100s (`requirements-gpu-aot.txt`, in a venv of its own), their memory within a budget, the
parameters and KV caches sharded as the partition rules say (read back from the compiled
programs), the FLOP count with loops multiplied out, and a run that does not fit failing with
one line."""

import importlib.util
import json
import os
import re
import site
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from sage_jax import models
from sage_jax.config import MeshConfig
from sage_jax.infra import hardware, parallel
from sage_jax.engine.sampler import placement
from sage_jax.engine.trainer.state import trainable_split
from sage_jax.analysis import compile_check as aot
from sage_jax.models.presets import PRESETS
from sage_jax.tasks import registry

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
TINY = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 512,
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0, "tie_word_embeddings": False, "eos_token_id": 1}
RUN = ["rl.prompts_per_step=8", "rl.group_size=4", "rl.max_new_tokens=96",
       "data.max_prompt_tokens=40", "hint.max_new_tokens=16", "hint.max_request_tokens=64",
       "rl.micro_batch_size=8", "mesh.data=1", "mesh.fsdp=-1", "mesh.tensor=1"]
BUDGET = 64 * 1024 ** 2  # per device: the tiny run's every program, resident arrays included


def tiny_cfg(*overrides):
    return registry.load_config("paper_qwen2.5-7b", [*RUN, *overrides])


@pytest.fixture(scope="module", params=[(4, 1), (2, 2)], ids=["fsdp4", "fsdp2-tensor2"])
def report(request):
    fsdp, tensor = request.param
    cfg = tiny_cfg(f"mesh.fsdp={fsdp}", f"mesh.tensor={tensor}")
    return cfg, aot.check_run(cfg, models.DecoderConfig.from_hf_dict(TINY), "v5e:2x2",
                              keep_compiled=True)


def _spec(sharding) -> tuple:
    """A sharding's (or PartitionSpec's) axes as a tuple without trailing whole dimensions."""
    spec = list(getattr(sharding, "spec", sharding))
    while spec and spec[-1] is None:
        spec.pop()
    return tuple(spec)


def test_every_program_compiles_for_tpu_within_budget(report):
    cfg, r = report
    names = [q.name for q in r.programs]
    assert names[0] == "rollout/prefill" and names[-1] == "train_step"
    for kind in ("rollout/start", "rollout/decode@32x32", "rollout/decode@32x96",
                 "rollout/grow@96", "hint/prefill", "hint/decode@8x16"):
        assert kind in names, names
    assert r.chip.name == "v5e" and r.devices == 4
    for q in r.programs:
        assert q.error is None, q.error
        assert 0 < q.peak and q.total <= BUDGET, (q.name, q.total)
        assert q.compiled is not None
        # decode attention by the Pallas TPU kernel: prompt and generated columns, per layer
        assert q.kernels == (2 * TINY["num_hidden_layers"] if "decode@" in q.name else 0), q
    train = r.programs[-1]
    assert train.argument >= r.state_bytes  # the state is an argument, donated
    assert train.alias > 0
    aot.check_fits(r, aot.HEADROOM)


def test_the_tpu_decode_loop_keeps_its_caches_in_place():
    """The 7B's attention shapes (4 KV heads over tensor 2, 7 query heads each, head dim 128),
    512 rows of 2,048 generated slots on v5p-16, one layer and small weights so the caches
    dominate: the decode program's temporaries stay far below its generated caches. (Written
    by a scatter, the caches took a scatter-friendly TPU layout and the program copied them
    all at every call: temporaries of 0.26 GiB against 0.25 GiB of caches.)"""
    dims = models.DecoderConfig.from_hf_dict({
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 1024,
        "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 1,
        "num_attention_heads": 28, "num_key_value_heads": 4, "head_dim": 128,
        "rms_norm_eps": 1e-6, "rope_theta": 1e6, "tie_word_embeddings": False,
        "eos_token_id": 1})
    cfg = registry.load_config("paper_qwen2.5-7b", ["rl.max_new_tokens=2048",
                                                    "data.max_prompt_tokens=256"])
    r = aot.check_run(cfg, dims, "v5p-16", only=("rollout",))
    (q,) = [q for q in r.programs if q.name == "rollout/decode@512x2048"]
    assert q.error is None and q.kernels == 2, q
    assert q.gen_cache_bytes >= 2 ** 28  # 0.25 GiB a chip
    assert q.temp < q.gen_cache_bytes / 4, (q.temp, q.gen_cache_bytes)


def test_compiled_shardings_follow_the_partition_rules(report):
    """The train step's state and the decode segment's weights and KV cache are sharded in
    the compiled programs as `parallel.PARTITION_RULES` and `placement` say."""
    cfg, r = report
    mesh = parallel.make_mesh(cfg.mesh, hardware.compile_devices(hardware.parse("v5e:2x2")))
    train = next(q for q in r.programs if q.name == "train_step")
    state_sh = train.compiled.input_shardings[0][0]
    params = state_sh.params
    seen = 0
    for path, sh in jax.tree_util.tree_flatten_with_path(params)[0]:
        leaf = parallel.path_str(path)
        want = parallel.spec_for(leaf, _shape_of(leaf), mesh)
        assert _spec(sh) == _spec(want), (leaf, sh.spec, want)
        seen += any(a is not None for a in want)
    assert seen >= 8  # weight matrices are split
    decode = next(q for q in r.programs if q.name == "rollout/decode@32x96")
    st = decode.compiled.input_shardings[0][1]
    kv = "tensor" if mesh.shape["tensor"] > 1 else None
    assert _spec(st.gen_k[0]) == (parallel.ROWS, kv)[: 2 if kv else 1]
    assert _spec(st.prompt_v[1]) == (parallel.ROWS, kv)[: 2 if kv else 1]
    # The sampler's weights are regathered over fsdp inside the program: its inputs are the
    # trainer's (fsdp-split) params.
    assert _spec(decode.compiled.input_shardings[0][0]["lm_head"]["kernel"].get_value()) == _spec(
        parallel.spec_for("lm_head/kernel", (64, 512), mesh))
    assert placement.SAMPLER_RULES  # the rules the program regathers to


def _shape_of(leaf: str) -> tuple:
    dims = models.DecoderConfig.from_hf_dict(TINY)
    d, f, v, hd = dims.hidden_size, dims.intermediate_size, dims.vocab_size, dims.head_dim
    n, k = dims.num_heads * hd, dims.num_kv_heads * hd
    table = {"embed_tokens": (v, d), "lm_head/kernel": (d, v), "q_proj/kernel": (d, n),
             "k_proj/kernel": (d, k), "v_proj/kernel": (d, k), "o_proj/kernel": (n, d),
             "gate_proj/kernel": (d, f), "up_proj/kernel": (d, f), "down_proj/kernel": (f, d),
             "q_proj/bias": (n,), "k_proj/bias": (k,), "v_proj/bias": (k,)}
    for key, shape in table.items():
        if leaf.endswith(key):
            return shape
    return (d,) if leaf.endswith("weight") else ()


def test_a_lora_run_is_compiled_with_adam_state_for_its_adapters_only():
    """model.lora.rank=8: the abstract run's params hold the adapters (r * (in + out) per
    projection, counted by hand) and its AdamW moments are theirs alone, in float32."""
    dims = models.DecoderConfig.from_hf_dict(TINY)
    mesh = parallel.make_mesh(MeshConfig(1, 1, 1), jax.devices()[:1])
    d, q, kv, f = 64, 4 * 16, 2 * 16, 128
    adapters = 2 * 8 * ((d + q) + 2 * (d + kv) + (q + d) + 2 * (d + f) + (f + d))
    states = {}
    for rank in (0, 8):
        cfg = tiny_cfg(f"model.lora.rank={rank}")
        _, params = aot.abstract_model(dims, cfg)
        states[rank] = aot.abstract_state(params, cfg, mesh)
    full, lora = (sum(x.size for x in jax.tree.leaves(states[r].params)) for r in (0, 8))
    assert lora - full == adapters
    moments = lambda s: [x for x in jax.tree.leaves(s.opt_state) if x.ndim]  # noqa: E731
    assert sum(x.size for x in moments(states[8])) == 2 * adapters
    assert {x.dtype for x in moments(states[8])} == {jnp.dtype(jnp.float32)}
    assert sum(x.size for x in moments(states[0])) == 2 * full


def test_matmul_flops_multiply_loop_bodies():
    def f(w, xs):
        return jax.lax.scan(lambda c, x: (c + jnp.sum(x @ w), None), 0.0, xs)[0]

    w, xs = jnp.ones((8, 16)), jnp.ones((5, 4, 8))
    assert aot.matmul_flops(jax.make_jaxpr(f)(w, xs).jaxpr) == 5 * 2 * 4 * 16 * 8
    grad = jax.make_jaxpr(jax.grad(lambda w: f(w, xs)))(w)
    assert aot.matmul_flops(grad.jaxpr) == 2 * 5 * 2 * 4 * 16 * 8  # forward + d/dw


def test_the_decode_roofline_counts_the_slots_a_kernel_reads():
    """Without a kernel a decode step reads its whole generated cache; the TPU kernel reads
    step t's t live slots in whole 512-column blocks. Two compiled cache sizes, 1024 and 2048
    slots; 1 MiB of weights and 1 KiB per slot."""
    def programs():
        return [aot.Program(f"rollout/decode@8x{s}", bytes_per_call=2 ** 20 + 1024 * s,
                            gen_cache_bytes=1024 * s, flops=1e6) for s in (1024, 2048)]

    steps = {1024: 1024, 2048: 1023}  # steps 1..1024 with 1024 slots, 1025..2047 with 2048
    whole = 1024 * (1024 * 1024 + 2048 * 1023)
    for impl, slots_read in [
            ("xla", 1024 * 1024 + 2048 * 1023),
            # blocks of 512: steps 1..512 read 512, 513..1024 read 1024, 1025..1536 read 1536,
            # 1537..2047 read 2048
            ("tpu", 512 * 512 + 512 * 1024 + 512 * 1536 + 511 * 2048)]:
        xs = programs()
        aot._decode_calls(xs, steps, impl)
        big = xs[1]
        assert xs[0].calls == 0 and big.calls == 2047
        assert big.bytes_per_call * 2047 == pytest.approx(2 ** 20 * 2047 + 1024 * slots_read,
                                                          rel=1e-6)
        assert big.read_share == pytest.approx(1024 * slots_read / whole)
        assert big.whole_bytes_per_call * 2047 == pytest.approx(2 ** 20 * 2047 + whole, rel=1e-6)
        assert big.flops == pytest.approx(1e6)
    assert big.read_share < 0.85  # the TPU kernel reads about a fifth less here


def test_topology_names():
    t = hardware.parse("v5p-16")
    assert (t.chip.name, t.chips, t.tpu_name) == ("v5p", 8, "v5p:2x2x2")
    assert hardware.parse("v5litepod-16").tpu_name == "v5e:4x4"
    assert hardware.parse("8xh100").chip.platform == "cuda"
    plugins = importlib.util.find_spec("jax_plugins")  # a namespace only where one is installed
    if plugins is None or importlib.util.find_spec("jax_plugins.xla_cuda12") is None:
        with pytest.raises(hardware.HardwareError, match="requirements-gpu-aot.txt"):
            hardware.compile_devices(hardware.parse("2xh100"))
    with pytest.raises(hardware.HardwareError, match="unknown topology 'v9-3'"):
        hardware.parse("v9-3")


def _aot(*args, timeout=900):
    return subprocess.run([sys.executable, "-m", "sage_jax.aot", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


def test_command_prints_the_table_and_json(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    out = _aot("--config", "paper_qwen2.5-7b", "--topology", "v5e:2x2", "--hf-config",
               str(tmp_path / "config.json"), "--only", "train", "--json", *RUN)
    assert out.returncode == 0, out.stderr[-2000:]
    rep = json.loads(out.stdout.strip().splitlines()[-1])
    assert rep["mesh"] == {"data": 1, "fsdp": 4, "tensor": 1}
    assert [p["name"] for p in rep["programs"]] == ["train_step"]
    assert rep["programs"][0]["peak"] > 0 and rep["step_flops"] > 0


def test_a_run_that_does_not_fit_fails_in_one_line(tmp_path):
    """A 4k-token update of 512 rows in one micro-batch on 16 GiB v5e chips: XLA refuses it,
    and the command says which program, how much, the HBM and the knob."""
    big = dict(TINY, vocab_size=32000, hidden_size=1024, intermediate_size=4096,
               num_attention_heads=8, num_key_value_heads=8)
    (tmp_path / "config.json").write_text(json.dumps(big))
    out = _aot("--config", "paper_qwen2.5-7b", "--topology", "v5e:2x2", "--hf-config",
               str(tmp_path / "config.json"), "--only", "train", "rl.prompts_per_step=64",
               "rl.max_new_tokens=4096", "data.max_prompt_tokens=64", "model.remat=false",
               "rl.micro_batch_size=null", "mesh.fsdp=-1", "mesh.tensor=1")
    assert out.returncode == 2, (out.stdout[-2000:], out.stderr[-2000:])
    err = out.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: train_step needs"), err
    assert "16.0 GiB HBM" in err[0] and "rl.micro_batch_size" in err[0]


# The free-Colab recipes: (config, --preset, the committed table of the long test's command).
COLAB = [("colab_qwen2.5-0.5b", "qwen2.5-0.5b", "colab_qwen2.5-0.5b_v5e-1.txt"),
         ("colab_qwen2.5-1.5b_lora", "qwen2.5-1.5b", "colab_qwen2.5-1.5b_lora_v5e-1.txt")]
ROW = re.compile(r"^(\S+/\S+|train_step)\s+[\d.]+" + r"\s+([\d.]+)" * 6 + r"\s", re.M)


@pytest.mark.parametrize("name,preset,record", COLAB, ids=[c[0] for c in COLAB])
def test_the_committed_colab_table_fits_at_the_configs_settings(name, preset, record):
    """docs/aot/<record> (the long test's command, below, run by hand) is the command's table
    for the config at its own micro-batch, log-prob chunk and LoRA rank, and every program in
    it leaves >= 10% of the v5e's 16 GiB free."""
    text = (ROOT / "docs" / "aot" / record).read_text()
    cfg = registry.load_config(name)
    head = text.splitlines()
    assert head[0] == (f"# python -m sage_jax.aot --config {name} --topology v5e:1x1 "
                       f"--preset {preset}")
    assert (f"(rl.micro_batch_size={cfg.rl.micro_batch_size}, "
            f"rl.logprob_chunk={cfg.rl.logprob_chunk}") in head[1]
    assert (f"model.lora.rank={cfg.model.lora.rank})" in head[1]) == (cfg.model.lora.rank > 0)
    rows = {m[1]: float(m[7]) for m in ROW.finditer(text)}
    assert {"rollout/prefill", "hint/prefill", "train_step"} <= set(rows), rows
    assert any(n.startswith("rollout/decode@") for n in rows), rows
    assert all(0 < total <= 0.9 * 16.0 for total in rows.values()), rows
    assert "exit status 0" in head[1] and "error:" not in text


def test_the_colab_lora_table_holds_a_frozen_bf16_base():
    """The LoRA recipe's committed table: the train state is the bf16 base plus the adapters
    with float32 masters and AdamW mu and nu (12 bytes an adapter element), the optimiser the
    adapters' alone -- the adapters counted in the abstract LoRA decoder -- and no sampling
    program holds a second (merged) copy of the base: each one's temporaries are less."""
    name, preset, record = COLAB[1]
    cfg = registry.load_config(name)
    _, params = aot.abstract_model(models.DecoderConfig.from_hf_dict(PRESETS[preset]), cfg)
    adapters = sum(x.size for x in jax.tree.leaves(trainable_split(params)[0]))
    base = sum(x.size for x in jax.tree.leaves(params)) - adapters
    assert cfg.model.lora.rank == 16 and cfg.model.dtype == "bfloat16" and adapters > 0
    text = (ROOT / "docs" / "aot" / record).read_text()
    gib = lambda b: f"{b / aot.GIB:.2f}"  # noqa: E731
    assert (f"per device: train state {gib(2 * base + 12 * adapters)} GiB (optimiser "
            f"{gib(8 * adapters)}, resident while sampling)") in text
    temps = {m[1]: float(m[4]) for m in ROW.finditer(text) if "/" in m[1]}
    assert len(temps) >= 10 and max(temps.values()) < float(gib(2 * base)), temps


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("SAGE_JAX_LONG_AOT"),
                    reason="8 to 21 minutes and 5 to 10 GiB of host memory to compile here (17 "
                           "programs), more than CI's budget allows; set SAGE_JAX_LONG_AOT=1 to "
                           "run it")
@pytest.mark.parametrize("name,preset,record", COLAB, ids=[c[0] for c in COLAB])
def test_the_colab_recipe_fits_a_free_tpu_v5e_1(name, preset, record):
    """A free-Colab recipe (`colab_qwen2.5-0.5b`: Qwen2.5-0.5B-Instruct, full fine-tuning;
    `colab_qwen2.5-1.5b_lora`: Qwen2.5-1.5B-Instruct with LoRA; SAGE on GSM8K) at its published
    shape: every program of a step compiles for one v5e chip (Colab's free TPU runtime, 16 GiB)
    with >= 10% of the HBM free (docs/aot/<record> is the command's table)."""
    cfg = registry.load_config(name)
    assert cfg.model.path.lower() == f"qwen/{preset}-instruct" and cfg.rl.method == "sage"
    out = _aot("--config", name, "--topology", "v5e:1x1", "--preset", preset, "--json",
               timeout=3600)  # 24 or 28 layers, 17 programs
    assert out.returncode == 0, (out.stdout[-2000:], out.stderr[-2000:])
    rep = json.loads(out.stdout.strip().splitlines()[-1])
    assert rep["chip"]["name"] == "v5e" and rep["devices"] == 1
    assert rep["hbm_bytes"] == 16 * 1024 ** 3
    names = [p["name"] for p in rep["programs"]]
    assert {"rollout/prefill", "hint/prefill", "train_step"} <= set(names), names
    assert any(n.startswith("rollout/decode@") for n in names), names
    for p in rep["programs"]:
        assert p["error"] is None and 0 < p["total"] <= 0.9 * rep["hbm_bytes"], p


def test_train_aot_check_stops_before_the_weights_load(tmp_path):
    """train.aot_check=true compiles the step for the run's own devices (here the CPU) and
    stops, in one line, when it does not fit -- before model.path's weights are read (the
    folder holds a config.json and no weights)."""
    big = dict(TINY, vocab_size=200000, hidden_size=512, num_attention_heads=8,
               num_key_value_heads=8)
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps(big))
    out = subprocess.run(
        [sys.executable, "-m", "sage_jax.train", "--config", "paper_qwen2.5-7b", "--workdir",
         str(tmp_path / "run"), f"model.path={tmp_path / 'model'}", "train.aot_check=true",
         "data.train_files=[x.jsonl]", "rl.prompts_per_step=64", "rl.max_new_tokens=8192",
         "model.dtype=float32", "model.compute_dtype=float32", "mesh.data=1", "mesh.tensor=1",
         "rl.micro_batch_size=null"],
        cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert out.returncode == 2, (out.stdout[-2000:], out.stderr[-2000:])
    err = out.stderr.strip().splitlines()
    assert len(err) == 1 and "needs" in err[0] and "GiB" in err[0], err


@pytest.fixture(scope="session")
def gpu_python() -> str:
    """A Python with this environment's packages and the CUDA compiler plugin
    (`requirements-gpu-aot.txt`), in a venv of its own (cached in $SAGE_JAX_TEST_CACHE): without
    a GPU the plugin writes to stderr at every jax import, so the test environment stays without
    it."""
    root = Path(os.environ.get("SAGE_JAX_TEST_CACHE", "~/.cache/sage_jax/test")).expanduser()
    venv = root / f"gpu-aot-jax{jax.__version__}-py{sys.version_info[0]}{sys.version_info[1]}"
    python = venv / "bin" / "python"
    done = venv / "installed"
    if not done.is_file():
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
    own = subprocess.run([str(python), "-c", "import site; print(site.getsitepackages()[0])"],
                         check=True, capture_output=True, text=True).stdout.strip()
    # every run: the cached venv may have been built beside another checkout's environment
    Path(own, "_sage_jax_base.pth").write_text(
        f"import site; site.addsitedir({site.getsitepackages()[0]!r})\n")
    if not done.is_file():
        subprocess.run([str(python), "-m", "pip", "install", "-q", "-r",
                        str(ROOT / "requirements-gpu-aot.txt")], check=True, timeout=900)
        done.write_text("ok\n")
    return str(python)


def _plugin_noise(line: str) -> bool:
    """The lines the CUDA plugin writes at jax import on a machine without a GPU driver."""
    return "cudart_stub.cc" in line or line.startswith("WARNING: All log messages before absl")


def _aot_gpu(python, *args, **env):
    environ = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}  # as a user runs it
    return subprocess.run([python, "-m", "sage_jax.aot", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=900, env={**environ, **env})


def test_every_program_compiles_for_gpus_within_budget(gpu_python, tmp_path):
    """The tiny run, its rollout sampled 4 prompts a call, compiled for 4 A100s (fsdp 4) by the
    XLA GPU compiler from the chip table's target config: every program fits the budget, the
    rollout's programs run twice a step, and the HBM is what XLA's allocator may use."""
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    out = _aot_gpu(gpu_python, "--config", "paper_qwen2.5-7b", "--topology", "4xa100-80gb",
                   "--hf-config", str(tmp_path / "config.json"), "--json", *RUN,
                   "rollout.micro_batch_size=16")
    assert out.returncode == 0, out.stderr[-3000:]
    rep = json.loads(out.stdout.strip().splitlines()[-1])
    assert rep["chip"]["name"] == "a100-80gb" and rep["devices"] == 4
    assert rep["mesh"] == {"data": 1, "fsdp": 4, "tensor": 1}
    assert rep["hbm_bytes"] == int(0.75 * 80 * 1024 ** 3)  # jax's default share of the HBM
    assert rep["shapes"]["sample_prompts"] == 4
    progs = {p["name"]: p for p in rep["programs"]}
    assert {"rollout/prefill", "rollout/decode@32x96", "hint/prefill", "train_step"} <= set(progs)
    assert progs["rollout/prefill"]["calls"] == 2 and progs["hint/prefill"]["calls"] == 1
    for p in rep["programs"]:
        assert p["error"] is None and 0 < p["peak"] and p["total"] <= BUDGET, p
        # decode attention by the Pallas GPU (Triton) kernel: prompt and generated columns
        assert p["kernels"] == (2 * TINY["num_hidden_layers"] if "decode@" in p["name"] else 0), p
    assert progs["train_step"]["alias"] > 0 and progs["train_step"]["flops"] > 0


def test_a_gpu_run_that_does_not_fit_fails_in_one_line(gpu_python, tmp_path):
    """XLA's GPU compiler does not refuse a program too big for the HBM; the check does, with
    the HBM that XLA_PYTHON_CLIENT_MEM_FRACTION leaves it."""
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    out = _aot_gpu(gpu_python, "--config", "paper_qwen2.5-7b", "--topology", "2xh100",
                   "--hf-config", str(tmp_path / "config.json"), "--only", "rollout", *RUN,
                   XLA_PYTHON_CLIENT_MEM_FRACTION="0.00001")
    assert out.returncode == 2, (out.stdout[-2000:], out.stderr[-2000:])
    err = [line for line in out.stderr.strip().splitlines() if not _plugin_noise(line)]
    assert len(err) == 1 and err[0].startswith("error: rollout/"), err
    assert "h100's 0.0 GiB HBM" in err[0] and "rollout.micro_batch_size" in err[0], err


def test_the_fsdp_train_step_gathers_weights_not_rows():
    """On a 4-way fsdp mesh (CPU devices), the compiled train step's collectives move weight
    shards and token ids, never a float array of every device's rows (activations, logits):
    `models.decoder.keep_rows` pins the rows of matmul outputs to the devices that hold them."""
    cfg = tiny_cfg("mesh.fsdp=4")
    dims = models.DecoderConfig.from_hf_dict(dict(TINY, tie_word_embeddings=True))
    r = aot.check_run(cfg, dims, devices=jax.devices()[:4], only=("train",), keep_compiled=True)
    text = r.programs[0].compiled.as_text()
    rows, length = 8, r.shapes.row_len  # a micro-batch's sequences, their columns
    moved = re.findall(r"= ((?:f32|bf16|s32)\[[\d,]*\])\S* (?:all-gather|all-reduce|all-to-all)\(",
                       text)
    assert any(s.startswith("f32[64,") for s in moved), moved  # weights are gathered
    every_row = re.compile(rf"(f32|bf16)\[({rows * length}|{rows},{length})[,\]]")
    assert not [s for s in moved if every_row.match(s)], moved


# The decode-attention kernels alone, at the paper configs' head shapes (KV heads, query heads
# per KV head, head dim), 8 groups x 8 rows, 2048 prompt columns, 8192 generated slots, bf16.
KERNEL_SHAPES = """
import sys, jax, jax.numpy as jnp
from jax.sharding import SingleDeviceSharding
from sage_jax.infra import hardware
from sage_jax.engine.sampler import decode_attention as da
dev = hardware.compile_devices(hardware.parse(sys.argv[1]))[0]
impl, sh = da.PLATFORMS[dev.platform], SingleDeviceSharding(dev)
arg = lambda *s, dt=jnp.bfloat16: jax.ShapeDtypeStruct(s, dt, sharding=sh)
b, g, p, s = 8, 8, 2048, 8192
for name, (kh, gq, h) in {"qwen2.5-7b": (4, 7, 128), "qwen3-4b": (8, 4, 128),
                          "llama3.2-3b": (8, 3, 128)}.items():
    jax.jit(lambda q, k, v, lo, hi: da.over_prompt(impl, None, q, k, v, lo, hi)).trace(
        arg(b, kh, g * gq, h), arg(b, kh, h, p), arg(b, kh, p, h), arg(b, dt=jnp.int32),
        arg(b, dt=jnp.int32)).lower().compile()
    jax.jit(lambda q, k, v, hi: da.over_rows(impl, None, q, k, v, hi)).trace(
        arg(b, kh, g, gq, h), arg(b, kh, g, h, s), arg(b, kh, g, s, h),
        arg(b, g, dt=jnp.int32)).lower().compile()
    print(impl, name, "compiled", flush=True)
"""


@pytest.mark.skipif(not os.environ.get("SAGE_JAX_LONG_AOT"),
                    reason="about a minute (two compiler processes), beyond CI's 30-minute "
                           "budget (the tiny run's kernels compile in CI); set "
                           "SAGE_JAX_LONG_AOT=1 to run it")
def test_the_decode_kernels_compile_at_the_paper_head_shapes(gpu_python):
    """Mosaic (v5e) and Triton (A100) compile both kernels for Qwen2.5-7B's 7, Qwen3-4B's 4
    and Llama-3.2-3B's 3 query heads per KV head at 128 head dims and the paper's cache sizes."""
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    for python, topo, impl in ((sys.executable, "v5e:2x2", "tpu"),
                               (gpu_python, "8xa100-80gb", "gpu")):
        out = subprocess.run([python, "-c", KERNEL_SHAPES, topo], cwd=ROOT, capture_output=True,
                             text=True, timeout=900, env=env)
        assert out.returncode == 0, out.stderr[-3000:]
        assert out.stdout.split() == [w for m in ("qwen2.5-7b", "qwen3-4b", "llama3.2-3b")
                                      for w in (impl, m, "compiled")], out.stdout
