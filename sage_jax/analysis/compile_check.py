"""Compile-only check of a training run: every device program a step runs, compiled for the
run's mesh (compile-only devices of a TPU or GPU topology, or real ones) at the shapes the run
will use, with XLA's per-device memory, the matmul FLOPs and a roofline time. No weights or data
are read: parameters and the train state are abstract (`jax.eval_shape`).

Worst-case shapes of one step (`run_shapes`): B = rl.prompts_per_step prompts of P tokens
(data.max_prompt_tokens; with hints written into them, P + hint.max_new_tokens), G answers of
up to T = rl.max_new_tokens tokens; the update's batch is the trainer's own (`update.row_len`:
the packed sequences of every step have that shape), every micro-batch computed. The programs:

  train_step           the jitted, sharded update (`update.TrainStep`), state donated
  rollout/...          the sampling call's plan, `SamplingPlan.programs()`: by default the
                       largest program of each kind (`all_buckets`: every program a call may
                       run, the list `sampling.sample` takes its programs from):
    prefill            the B prompts' prefill (chunked when long, `decode.prefill_rows`)
    start              first tokens and the decode state with its first cache size
    empty, admit@N,S   continuous batching: the state of free slots, and N prefilled prompts'
                       rows written into a state with an S-slot cache
    decode@R,S         a decode segment of R rows with an S-slot generated-token cache: all B*G
                       rows at the first and the last cache size, and the largest smaller row
                       bucket (one row per group) at the last
    grow@S             one layer's cache grown to S slots (layer by layer, the rest resident)
    drop@R, rows@R     one layer's rows gathered into R rows, and the per-row fields
  hint/...             the same programs for hint writing (greedy, one answer per request)

Per program: compile seconds; per-device bytes XLA assigns (arguments, outputs, aliased,
temporaries; peak = arguments + outputs - aliased + temporaries); what other live arrays hold
meanwhile (`resident`: the optimiser state while sampling, the other layers' caches while one
is regrouped); the whole mesh's matmul FLOPs with loops multiplied out (`matmul_flops`; a
decode segment counts one step); and a roofline time per step at the chip's peak FLOP/s and
HBM bandwidth (`hardware.CHIPS`).
"""

from __future__ import annotations

import dataclasses
import math
import re
import time
from typing import Callable, cast

import jax
import jax.numpy as jnp
from flax import nnx
from jax.extend import core as jcore
from jax.sharding import Mesh, Sharding

from sage_jax.config import Config
from sage_jax.infra import hardware, parallel
from sage_jax import models
from sage_jax.engine.sampler import decode, decode_attention, placement, programs
from sage_jax.engine.trainer import update
from sage_jax.engine.sampler.sampling_plan import DecodeShape, Knobs, SamplingPlan
from sage_jax.engine.trainer.state import TrainState

GIB = 1024 ** 3
HEADROOM = 0.10  # the share of HBM a run should leave free (fragmentation, runtime buffers)


class DoesNotFit(ValueError):
    """A program of the run needs more memory per device than the chip has."""


@dataclasses.dataclass(frozen=True)
class RunShapes:
    """The worst-case shapes of one training step (see the module docstring)."""

    prompts: int  # B
    group: int  # G
    sample_prompts: int  # prompts per sampling call (rollout.micro_batch_size // G, or B)
    prompt_len: int  # the longest prompt the rollout samples from (hints included)
    max_new_tokens: int  # T
    row_len: int  # L, the update's rows
    hint_prompts: int  # hint requests per step (0: the run writes no hints)
    hint_request_len: int
    hint_tokens: int


def run_shapes(cfg: Config, prompt_len: int | None = None) -> RunShapes:
    """`RunShapes` of `cfg`; `prompt_len`: the longest rendered prompt the rollout samples
    (default data.max_prompt_tokens), to which hinted prompts add hint.max_new_tokens. The
    update's rows are the trainer's packed width (`update.row_len`)."""
    b, rows = cfg.rl.prompts_per_step, cfg.rollout.micro_batch_size
    return RunShapes(
        prompts=b, group=cfg.rl.group_size, prompt_len=cfg.sample_prompt_len(prompt_len),
        sample_prompts=b if rows is None else min(b, rows // cfg.rl.group_size),
        max_new_tokens=cfg.rl.max_new_tokens,
        row_len=update.row_len(cfg),  # the trainer's packed width, whatever the prompts
        hint_prompts=cfg.rl.prompts_per_step if cfg.writes_hints else 0,
        hint_request_len=cfg.hint.max_request_tokens, hint_tokens=cfg.hint.max_new_tokens)


@dataclasses.dataclass
class Program:
    """One compiled program (bytes are per device; see the module docstring)."""

    name: str
    compile_s: float = 0.0
    argument: int = 0
    output: int = 0
    alias: int = 0
    temp: int = 0
    resident: int = 0
    flops: float = 0.0  # whole mesh, one call (a decode segment: one step)
    bytes_per_call: int = 0  # per device, read and written by one call (roofline)
    calls: float = 1.0  # per step in the worst case (a decode segment: steps)
    roofline_s: float = 0.0  # per step, all its calls
    kernels: int = 0  # Pallas decode-attention calls (`decode_attention`) compiled in
    gen_cache_bytes: int = 0  # per device, a decode segment's generated-token caches
    read_share: float = 1.0  # of the generated caches, the share a decode step reads (mean)
    whole_bytes_per_call: int = 0  # per device, a decode step reading every cache slot
    error: str | None = None  # the compiler's out-of-memory message
    compiled: jax.stages.Compiled | None = dataclasses.field(default=None, repr=False,
                                                             compare=False)

    @property
    def peak(self) -> int:
        return self.argument + self.output - self.alias + self.temp

    @property
    def total(self) -> int:
        return self.peak + self.resident


@dataclasses.dataclass
class Report:
    """The compiled programs of a run, on `topology` with `mesh_shape`."""

    topology: str
    chip: hardware.Chip
    devices: int
    mesh_shape: dict
    shapes: RunShapes
    programs: list[Program]
    state_bytes: int  # per device: params + optimiser state
    optimizer_bytes: int

    @property
    def hbm(self) -> int:
        return self.chip.hbm_bytes

    def worst(self) -> Program:
        return max(self.programs, key=lambda p: (p.error is not None, p.total))

    def step_flops(self) -> float:
        return sum(p.flops * p.calls for p in self.programs)

    def step_seconds(self) -> float:
        return sum(p.roofline_s for p in self.programs)

    def mfu_bound(self) -> float:
        """The step's matmul FLOPs over what the chips could do in its roofline time."""
        t = self.step_seconds()
        return self.step_flops() / (t * self.devices * self.chip.peak_flops) if t else 0.0


# ---- FLOPs ------------------------------------------------------------------------------------

def _sub_jaxprs(value):
    if isinstance(value, jcore.ClosedJaxpr):
        return [value.jaxpr]
    if isinstance(value, jcore.Jaxpr):
        return [value]
    if isinstance(value, (tuple, list)):
        return [j for v in value for j in _sub_jaxprs(v)]
    return []


def matmul_flops(jaxpr) -> float:
    """2 * M * N * K summed over the `dot_general`s of a jaxpr (the whole mesh's work), a
    `scan` body counted `length` times, a `cond` as its costliest branch and a `while` body
    once (one iteration)."""
    total = 0.0
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name == "dot_general":
            (lhs_c, _), _ = eqn.params["dimension_numbers"]
            lhs = eqn.invars[0].aval.shape
            total += 2.0 * math.prod(eqn.outvars[0].aval.shape) * math.prod(
                lhs[i] for i in lhs_c)
        elif name == "scan":
            total += eqn.params["length"] * matmul_flops(eqn.params["jaxpr"].jaxpr)
        elif name == "cond":
            total += max(matmul_flops(j) for j in _sub_jaxprs(eqn.params["branches"]))
        elif name == "while":
            total += matmul_flops(eqn.params["body_jaxpr"].jaxpr)
        else:
            total += sum(matmul_flops(j) for v in eqn.params.values() for j in _sub_jaxprs(v))
    return total


# ---- per-device bytes -------------------------------------------------------------------------

def device_bytes(tree) -> int:
    """Bytes one device holds of a pytree of arrays or ShapeDtypeStructs with shardings."""
    total = 0
    for x in jax.tree.leaves(tree):
        shape = x.sharding.shard_shape(x.shape) if x.sharding is not None else x.shape
        total += math.prod(shape) * jnp.dtype(x.dtype).itemsize
    return total


def _abstract(shape, dtype, sharding) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(dtype), sharding=sharding)


def _with(tree, shardings):
    return jax.tree.map(lambda x, s: _abstract(x.shape, x.dtype, s), tree, shardings)


# ---- the abstract run -------------------------------------------------------------------------

def abstract_model(model_cfg: models.DecoderConfig, cfg: Config) -> tuple:
    """(graphdef, abstract params in the model dtype) of the run's decoder (`model.remat` set,
    LoRA adapters with model.lora.rank > 0)."""
    dt, cdt = jnp.dtype(cfg.model.dtype), jnp.dtype(cfg.model.compute_dtype)
    lora = models.LoraSpec.of(cfg.model.lora)
    model = nnx.eval_shape(lambda: models.Decoder(model_cfg, dtype=dt, compute_dtype=cdt,
                                                  rngs=nnx.Rngs(0), remat=cfg.model.remat,
                                                  lora=lora))
    return models.split(model)


def abstract_state(params, cfg: Config, mesh: Mesh) -> TrainState:
    """The run's `TrainState` (params as the trainer keeps them, AdamW of `cfg.optim`: of the
    adapters only with LoRA), as ShapeDtypeStructs placed by the partition rules."""
    state = jax.eval_shape(lambda p: update.new_state(p, update.UpdateSettings.of(cfg)), params)
    return _with(state, parallel.tree_shardings(state, mesh))


def abstract_batch(cfg: Config, shapes: RunShapes, mesh: Mesh) -> dict:
    """The update's packed batch at its worst: every row alone in a sequence of L columns."""
    n, length = shapes.prompts * shapes.group, shapes.row_len
    rows = parallel.rows_sharding(mesh)
    token = {"tokens_ZxL": jnp.int32, "segments_ZxL": jnp.int32, "loss_mask_ZxL": jnp.bool_,
             "advantages_ZxL": jnp.float32, "answer_len_ZxL": jnp.float32}
    if cfg.rl.sampler_old_logprobs:
        token["old_logp_ZxL"] = jnp.float32
    if cfg.rl.kl_beta > 0:
        token["ref_logp_ZxL"] = jnp.float32
    if cfg.rl.rollout_correction != "none":
        token["sampler_logp_ZxL"] = jnp.float32
        if cfg.rl.loss_context == "plain":
            token["sampled_logp_ZxL"] = jnp.float32
    batch = {k: _abstract((n, length), dt, rows) for k, dt in token.items()}
    per_row = {"advantages_N": jnp.float32, "answer_len_N": jnp.float32, "level_N": jnp.int8,
               "collapse_N": jnp.int8}
    batch.update({k: _abstract((n,), dt, rows) for k, dt in per_row.items()})
    return batch


def decode_state(model_cfg: models.DecoderConfig, lay: placement.Layout, b: int, g: int, p: int,
                 s: int, dtype) -> decode.DecodeState:
    """An abstract `decode.DecodeState` of b groups of g rows, p prompt columns, s cache slots."""
    r, kv, hd, nl = b * g, model_cfg.num_kv_heads, model_cfg.head_dim, model_cfg.num_layers
    rows, kvs = placement.spec(lay), placement.spec(lay, kv_dim=1)
    layers = lambda shape: tuple(_abstract(shape, dtype, kvs) for _ in range(nl))  # noqa: E731
    return decode.DecodeState(
        prompt_k=layers((b, kv, hd, p)), prompt_v=layers((b, kv, p, hd)),
        prompt_mask_BxP=_stand_in((b, p), jnp.bool_, rows),
        gen_k=layers((b, kv, g, hd, s)), gen_v=layers((b, kv, g, s, hd)),
        pos0_R=_stand_in((r,), jnp.int32, rows), keys_R=_stand_in((r, 2), jnp.uint32, rows),
        last_R=_stand_in((r,), jnp.int32, rows), done_R=_stand_in((r,), jnp.bool_, rows),
        lengths_R=_stand_in((r,), jnp.int32, rows))


def _stand_in(shape, dtype, sharding: Sharding) -> jax.Array:
    """`_abstract` where a pytree field is typed `jax.Array`: jit traces and lowers a
    ShapeDtypeStruct in an array's place, as the array it describes."""
    return cast(jax.Array, _abstract(shape, dtype, sharding))


# ---- compiling --------------------------------------------------------------------------------

def compile_one(name: str, jitted, args, *, resident: int = 0, calls: float = 1.0) -> Program:
    """Traces and compiles `jitted(*args)`; the `Program` with XLA's memory numbers, or with
    the compiler's message when it does not fit."""
    prog = Program(name, resident=resident, calls=calls)
    t0 = time.perf_counter()
    traced = jitted.trace(*args)
    prog.flops = matmul_flops(traced.jaxpr.jaxpr)
    try:
        compiled = traced.lower().compile()
    except Exception as e:  # noqa: BLE001 - XLA's out-of-memory is a runtime error
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        prog.error = " ".join(str(e).split())[:400]
        prog.temp = _exhausted_bytes(str(e))
        prog.compile_s = time.perf_counter() - t0
        return prog
    prog.compile_s = time.perf_counter() - t0
    mem = compiled.memory_analysis()
    prog.argument, prog.output = mem.argument_size_in_bytes, mem.output_size_in_bytes
    prog.alias, prog.temp = mem.alias_size_in_bytes, mem.temp_size_in_bytes
    prog.bytes_per_call = prog.argument + prog.output - prog.alias
    prog.kernels = sum("custom-call(" in line and "decode_attention_" in line
                       for line in compiled.as_text().splitlines())
    prog.compiled = compiled
    return prog


def _exhausted_bytes(message: str) -> int:
    """The bytes an out-of-memory compile error says the program needs (its first G/M size)."""
    m = re.search(r"\(([\d.]+)([GMK])\)", message)
    if not m:
        return 0
    return int(float(m.group(1)) * {"G": GIB, "M": 1024 ** 2, "K": 1024}[m.group(2)])


def _roofline(prog: Program, chip: hardware.Chip, devices: int) -> None:
    per_call = max(prog.flops / devices / chip.peak_flops, prog.bytes_per_call / chip.hbm_bandwidth)
    prog.roofline_s = per_call * prog.calls


def train_program(graphdef, state: TrainState, cfg: Config, mesh: Mesh, shapes: RunShapes
                  ) -> Program:
    step = update.TrainStep(graphdef, update.UpdateSettings.of(cfg), mesh)
    return compile_one("train_step", step.jitted(state), (state, abstract_batch(cfg, shapes, mesh)))


def sampler_programs(prefix: str, graphdef, params, model_cfg: models.DecoderConfig,
                     cfg: Config, mesh: Mesh, *, prompts: int,
                     group: int, prompt_len: int, max_new_tokens: int, temperature: float,
                     optimizer_bytes: int, all_buckets: bool = False, passes: int = 1
                     ) -> list[Program]:
    """The programs of one `sampling.sample` call of `prompts` prompts of `prompt_len` tokens,
    `group` answers each, up to `max_new_tokens`, on `mesh` (see the module docstring);
    `passes` such calls a step (their calls counted that many times)."""
    progs = _sampler_programs(prefix, graphdef, params, model_cfg, cfg, mesh, prompts=prompts,
                              group=group, prompt_len=prompt_len, max_new_tokens=max_new_tokens,
                              temperature=temperature, optimizer_bytes=optimizer_bytes,
                              all_buckets=all_buckets,
                              continuous=passes > 1 and cfg.rollout.continuous_batching)
    for q in progs:
        q.calls *= passes
    return progs


def _sampler_programs(prefix: str, graphdef, params, model_cfg: models.DecoderConfig,
                      cfg: Config, mesh: Mesh, *, prompts: int, group: int, prompt_len: int,
                      max_new_tokens: int, temperature: float, optimizer_bytes: int,
                      all_buckets: bool, continuous: bool = False) -> list[Program]:
    """`sampler_programs`: the programs of the call's `SamplingPlan`; `continuous`: the call
    has more rows than `prompts` * `group` and batches continuously
    (`sampling.sample(max_rows=...)`)."""
    knobs = Knobs(num_samples=group, max_new_tokens=max_new_tokens,
                  temperature=float(temperature), top_p=cfg.rl.top_p, top_k=cfg.rl.top_k,
                  eos_ids=tuple(model_cfg.eos_ids) or (0,), pad_id=0)
    plan = SamplingPlan.of_chunk(knobs, prompts, prompt_len, num_params=model_cfg.num_params(),
                                 shards=parallel.row_shards(mesh), continuous=continuous)
    return plan_programs(prefix, plan, graphdef, params, model_cfg, mesh,
                         optimizer_bytes=optimizer_bytes, every=all_buckets)


def plan_programs(prefix: str, plan: SamplingPlan, graphdef, params,
                  model_cfg: models.DecoderConfig, mesh: Mesh, *, optimizer_bytes: int = 0,
                  every: bool = False) -> list[Program]:
    """Compiles `plan.programs(every)` (the largest of each kind, or every program the call
    may run) on `mesh`, each named `prefix/label`; stops after a prefill that does not fit.
    Resident meanwhile: the optimiser state, and while one layer is regrouped the other
    layers' caches (of the first rows at the last cache size)."""
    p, kv, nl = plan.prompt_cols, model_cfg.num_kv_heads, model_cfg.num_layers
    lay_of = lambda rows: placement.layout(mesh, kv, rows)  # noqa: E731
    slots = plan.cache_sizes
    r0, g0 = plan.first_rows, (1 if plan.continuous else plan.group)
    prefilled: dict[int, tuple] = {}  # prompts -> the prefill's (logits, prompt_k, prompt_v)
    progs: list[Program] = []
    whole = regroup_resident = 0
    for spec in plan.programs(every):
        name, lay = f"{prefix}/{spec.label}", lay_of(spec.rows)
        knobs = plan.decode_knobs if spec.kind == "segment" else plan.knobs
        jitted = programs.get(spec.kind, graphdef if spec.kind in programs.TAKE_PARAMS else None,
                              knobs if spec.kind in programs.TAKE_KNOBS else None, lay,
                              spec.extra)
        if spec.kind == "prefill":
            b = spec.prompts
            rows = placement.spec(lay)
            q = compile_one(name, jitted, (params, _abstract((b, p), jnp.int32, rows),
                                           _abstract((b, p), jnp.bool_, rows)),
                            resident=optimizer_bytes)
            progs.append(q)
            if q.error:
                return progs
            assert q.compiled is not None  # compile_one keeps what compiled
            prefilled[b] = q.compiled.out_info
            dtype = prefilled[b][1][0].dtype
            whole = device_bytes(decode_state(model_cfg, lay_of(r0), r0 // g0, g0, p, slots[-1],
                                              dtype))
            regroup_resident = optimizer_bytes + whole - whole // nl
            continue
        logits, prompt_k, prompt_v = prefilled[max(prefilled)]
        dtype = prompt_k[0].dtype
        if spec.kind in ("start", "empty", "admit"):
            logits, prompt_k, prompt_v = prefilled[spec.prompts]
            play = lay_of(spec.prompts)
            rows, repl, b = placement.spec(play), placement.replicated(play), spec.prompts
            firsts = (_abstract((b, p), jnp.bool_, rows), logits,
                      _abstract((2,), jnp.uint32, repl), _abstract((b,), jnp.int32, rows),
                      _abstract((b,), jnp.bool_, rows))
            if spec.kind == "start":
                args = (prompt_k, prompt_v, *firsts)
            elif spec.kind == "empty":
                args = (prompt_k, prompt_v)
            else:
                assert spec.state is not None  # an admission names the state it writes into
                state = _state(model_cfg, lay, spec.state, p, dtype)
                at = _abstract((b * plan.group,), jnp.int32, placement.replicated(lay))
                args = (state, prompt_k, prompt_v, *firsts, at)
            progs.append(compile_one(name, jitted, args, resident=optimizer_bytes))
            continue
        assert spec.state is not None
        old = _state(model_cfg, lay_of(spec.state.rows), spec.state, p, dtype)
        if spec.kind == "segment":
            q = compile_one(name, jitted, (params, old, _abstract((), jnp.int32,
                                                                  placement.replicated(lay))),
                            resident=optimizer_bytes, calls=0.0)
            q.bytes_per_call = q.argument  # one step reads every weight and cache slot once
            q.gen_cache_bytes = device_bytes((old.gen_k, old.gen_v))
        elif spec.kind == "regroup" and spec.rows == spec.state.rows:  # a cache grows
            first = (spec.state.rows, spec.extra) == (r0, slots[-1])
            q = compile_one(name, jitted, (old.gen_k[0], old.gen_v[0]),
                            resident=regroup_resident,
                            calls=nl * (len(slots) - 1) if first else 0.0)
        elif spec.kind == "regroup":  # rows are gathered into fewer
            index = _abstract((spec.rows,), jnp.int32, placement.replicated(lay))
            q = compile_one(name, jitted, (old.gen_k[0], old.gen_v[0], old.prompt_k[0],
                                           old.prompt_v[0], index),
                            resident=regroup_resident, calls=0.0)
        else:  # "rows": the per-row fields gathered
            fields = {k: getattr(old, k) for k in decode.ROW_FIELDS}
            q = compile_one(name, jitted, (fields, _abstract((spec.rows,), jnp.int32,
                                                             placement.replicated(lay)),
                                           _abstract((spec.rows,), jnp.bool_,
                                                     placement.spec(lay))),
                            resident=optimizer_bytes + whole, calls=0.0)
        progs.append(q)
    impl = decode_attention.implementation(lay_of(plan.prefill_prompts))
    _decode_calls([q for q in progs if f"/decode@{r0}x" in q.name], plan.schedule,
                  impl if any(q.kernels for q in progs) else "xla")
    return progs


def _state(model_cfg: models.DecoderConfig, lay, shape: DecodeShape, p: int, dtype):
    return decode_state(model_cfg, lay, shape.groups, shape.rows_per_group, p, shape.slots, dtype)


def _decode_calls(progs: list[Program], steps: dict[int, int], impl: str = "xla") -> None:
    """Spreads the decode steps of all rows over the compiled cache sizes: each step at slot
    size S costs the FLOPs and bytes of the compiled programs interpolated linearly in S (a
    step reads the weights and S slots; attention is linear in S). With decode-attention
    kernels (`impl` "tpu" / "gpu") step t reads only the t live slots of the generated caches,
    in whole column blocks (`decode_attention.columns_read`); the prompt caches count whole
    (the worst case: every prompt as long as the bucket)."""
    at = sorted((int(q.name.rsplit("x", 1)[1]), q) for q in progs)
    if not at:
        return
    (s0, q0), (s1, q1) = at[0], at[-1]
    for q in progs:
        q.calls = 0.0
    per_slot = q1.gen_cache_bytes / s1
    flops = bytes_ = unread = 0.0
    t = 1  # the schedule's steps in order: step t holds t generated tokens
    for s, n in sorted(steps.items()):
        w = 0.0 if s1 == s0 else (s - s0) / (s1 - s0)
        flops += n * (q0.flops + w * (q1.flops - q0.flops))
        bytes_ += n * (q0.bytes_per_call + w * (q1.bytes_per_call - q0.bytes_per_call))
        unread += per_slot * sum(s - decode_attention.columns_read(impl, u, s)
                                 for u in range(t, t + n))
        t += n
    whole = per_slot * sum(s * n for s, n in steps.items())
    q1.read_share = 1.0 - unread / whole if whole else 1.0
    total = sum(steps.values())
    # Booked on the largest program: `calls` steps of its size give the interpolated totals.
    q1.calls = total
    q1.flops, q1.bytes_per_call = flops / max(total, 1), int((bytes_ - unread) / max(total, 1))
    q1.whole_bytes_per_call = int(bytes_ / max(total, 1))


def check_run(cfg: Config, model_cfg: models.DecoderConfig, topology: str | None = None, *,
              devices: list | None = None, prompt_len: int | None = None,
              all_buckets: bool = False, only: tuple[str, ...] = ("train", "rollout", "hint"),
              log: Callable[[str], None] | None = None, keep_compiled: bool = False) -> Report:
    """Compiles the run's programs (see the module docstring) for `topology` (compile-only
    devices; or `devices`, e.g. real ones) and returns the `Report`. `only` picks program
    families; `log(line)` hears each program as it compiles; `keep_compiled` keeps each
    program's `jax.stages.Compiled` (else dropped: they hold the executables)."""
    topo = hardware.parse(topology) if topology else None
    if devices is None:
        if topo is None:
            raise ValueError("check_run needs a topology or devices")
        devices = hardware.compile_devices(topo)
    chip = topo.chip if topo else hardware.chip_of(devices[0])
    mesh = parallel.make_mesh(cfg.mesh, devices=devices)
    shapes = run_shapes(cfg, prompt_len)
    graphdef, params = abstract_model(model_cfg, cfg)
    state = abstract_state(params, cfg, mesh)
    opt_bytes = device_bytes(state.opt_state)
    report = Report(topology=topology or str(devices[0].device_kind), chip=chip,
                    devices=len(devices), mesh_shape=dict(mesh.shape), shapes=shapes,
                    programs=[], state_bytes=device_bytes(state), optimizer_bytes=opt_bytes)

    def add(progs):
        for q in progs if isinstance(progs, list) else [progs]:
            _roofline(q, chip, len(devices))
            report.programs.append(q)
            if log:
                log(format_row(q, chip))

    if "rollout" in only:
        add(sampler_programs("rollout", graphdef, state.params, model_cfg, cfg, mesh,
                             prompts=shapes.sample_prompts, group=shapes.group,
                             passes=-(-shapes.prompts // shapes.sample_prompts),
                             prompt_len=shapes.prompt_len, max_new_tokens=shapes.max_new_tokens,
                             temperature=cfg.rl.temperature, optimizer_bytes=opt_bytes,
                             all_buckets=all_buckets))
    if "hint" in only and shapes.hint_prompts:
        per_call = min(shapes.hint_prompts, cfg.rollout.micro_batch_size or shapes.prompts)
        add(sampler_programs("hint", graphdef, state.params, model_cfg, cfg, mesh,
                             prompts=per_call, group=1,
                             passes=-(-shapes.hint_prompts // per_call),
                             prompt_len=shapes.hint_request_len,
                             max_new_tokens=shapes.hint_tokens,
                             temperature=cfg.hint.temperature, optimizer_bytes=opt_bytes,
                             all_buckets=all_buckets))
    if "train" in only:
        add(train_program(graphdef, state, cfg, mesh, shapes))
    if not keep_compiled:
        for q in report.programs:
            q.compiled = None
    return report


# ---- output -----------------------------------------------------------------------------------

HEADER = (f"{'program':<26}{'compile s':>10}{'args':>9}{'out':>9}{'temp':>9}{'peak':>9}"
          f"{'resident':>10}{'total':>9}{'GFLOP':>12}{'calls':>7}{'roofline s':>12}")


def format_row(q: Program, chip: hardware.Chip) -> str:
    g = lambda b: f"{b / GIB:9.2f}"  # noqa: E731
    if q.error:
        return f"{q.name:<26}{q.compile_s:10.1f}  DOES NOT FIT: {q.error[:160]}"
    return (f"{q.name:<26}{q.compile_s:10.1f}{g(q.argument)}{g(q.output)}{g(q.temp)}{g(q.peak)}"
            f"{q.resident / GIB:10.2f}{g(q.total)}{q.flops / 1e9:12.1f}{q.calls:7.0f}"
            f"{q.roofline_s:12.3f}")


def format_report(r: Report) -> str:
    s = r.shapes
    worst = r.worst()
    lines = [
        f"topology {r.topology}: {r.devices} x {r.chip.name} ({r.chip.hbm_bytes / GIB:.1f} GiB "
        f"HBM, {r.chip.peak_flops / 1e12:.0f} TFLOP/s bf16, {r.chip.hbm_bandwidth / 1e9:.0f} "
        f"GB/s; {r.chip.source}); mesh {r.mesh_shape}",
        f"step: {s.prompts} prompts x {s.group} answers ({s.sample_prompts} prompts a sampling "
        f"call), prompts <= {s.prompt_len} tokens, "
        f"answers <= {s.max_new_tokens}, update rows {s.row_len} columns; hint requests "
        f"{s.hint_prompts} x {s.hint_request_len} tokens -> {s.hint_tokens}",
        f"per device: train state {r.state_bytes / GIB:.2f} GiB (optimiser "
        f"{r.optimizer_bytes / GIB:.2f}, resident while sampling); GiB below are per device",
        HEADER]
    lines += [format_row(q, r.chip) for q in r.programs]
    lines += [f"{q.name}: {q.kernels} decode-attention kernel calls; a step reads "
              f"{q.read_share:.0%} of the generated-token caches (no early EOS)"
              for q in r.programs if q.kernels and q.calls]
    free = 1 - worst.total / r.hbm
    lines.append(
        f"largest: {worst.name} {worst.total / GIB:.2f} GiB of {r.hbm / GIB:.1f} GiB "
        f"({free:.0%} free; want >= {HEADROOM:.0%}); step (no early EOS, one rollout pass): "
        f"{r.step_flops():.3g} FLOP, roofline {r.step_seconds():.1f} s, MFU bound "
        f"{r.mfu_bound():.0%}")
    return "\n".join(lines)


def to_json(r: Report) -> dict:
    return {"topology": r.topology, "chip": dataclasses.asdict(r.chip), "devices": r.devices,
            "mesh": r.mesh_shape, "shapes": dataclasses.asdict(r.shapes),
            "state_bytes": r.state_bytes, "optimizer_bytes": r.optimizer_bytes,
            "programs": [dict({f.name: getattr(q, f.name) for f in dataclasses.fields(q)
                               if f.name != "compiled"}, peak=q.peak, total=q.total)
                         for q in r.programs],
            "step_flops": r.step_flops(), "step_roofline_s": r.step_seconds(),
            "mfu_bound": r.mfu_bound(), "hbm_bytes": r.hbm,
            "largest": r.worst().name, "largest_bytes": r.worst().total}


KNOBS = {
    "train_step": "lower rl.micro_batch_size (sequences per gradient-accumulation pass), keep "
                  "model.remat=true, or shard wider (mesh.fsdp)",
    "prefill": "fewer prompts a sampling call (rollout.micro_batch_size) or shorter prompts "
               "(data.max_prompt_tokens), or shard wider (mesh.fsdp / mesh.tensor)",
    "decode": "sample fewer rows at once (rollout.micro_batch_size) or a shorter budget "
              "(rl.max_new_tokens), or shard wider (mesh.fsdp / mesh.tensor)",
}


def check_fits(r: Report, headroom: float = 0.0) -> None:
    """Raises `DoesNotFit` naming the largest program, its GiB, the HBM and the knob to turn
    when it leaves less than `headroom` of the chip's HBM free."""
    worst = r.worst()
    if worst.error is None and worst.total <= r.hbm * (1 - headroom):
        return
    kind = worst.name.split("/")[-1].split("@")[0]
    knob = KNOBS.get(kind, KNOBS["decode"] if "/" in worst.name else KNOBS["train_step"])
    need = f"{worst.total / GIB:.2f} GiB" if worst.error is None else "more than it has"
    raise DoesNotFit(
        f"{worst.name} needs {need} per device ({worst.peak / GIB:.2f} GiB program + "
        f"{worst.resident / GIB:.2f} GiB resident) of {r.chip.name}'s {r.hbm / GIB:.1f} GiB HBM"
        + (f" with {headroom:.0%} headroom" if headroom else "") + f" on {r.topology}: {knob}"
        + (f" [XLA: {worst.error[:200]}]" if worst.error else ""))

