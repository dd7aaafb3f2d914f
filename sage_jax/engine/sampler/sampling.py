"""Jit-compiled sampling: prefill, then decode in segments that drop finished rows.

Shapes: B prompts, G samples per prompt, R = B*G rows (prompt-major: row b*G + g), P prompt
length, T = max_new_tokens, V vocab.

Two entry points:

* `sample(graphdef, params, prompt_BxP, prompt_mask_BxP, *, key, num_samples=G, ...)` -- the
  array-level API the trainer uses. Works on the `(graphdef, params)` pytree (no host round trip
  of the weights) and returns a `SampleOutput` of host arrays shaped [B, G, T] / [B, G].
* `generate(model, prompts, ...)` -- convenience for users and tests: a `Decoder` and a list of
  token-id lists of varying lengths; returns numpy arrays with one row per sample, [N*G, T],
  prompt-major (row n*G + g is sample g of prompt n).

How a call runs (its sizes are a `sampling_plan.SamplingPlan`; the device programs are in
`decode`, jitted once by `programs`):

1. Bucketing. Prompts are left-padded (mask True on the valid suffix). The prompt length and the
   number of prompts are rounded up to the plan's buckets; padding rows are marked finished
   from the start and dropped from the output.
2. Prefill: the B prompts run once through the model (a prompt is never prefilled G times); only
   the last position's logits are computed, and the prompts' keys/values come out in the
   layout decode reads. Every row draws its first token.
3. Decode in segments, each a jitted `lax.while_loop` (no host synchronisation inside; the
   state is donated and updated in place). A row attends to its prompt's keys/values, read
   once for the G rows that share them, and to its own generated ones. A segment runs until
   the generated-token cache is full or the running rows fit a smaller row bucket; the host
   then gathers the running rows into that bucket (one row per group from then on, the
   prompt's keys/values copied) or doubles the cache, which starts small (all T without EOS
   ids), so attention reads only the slots in use. A call therefore synchronises with the host
   once per cache size and row bucket it passes through (`SampleOutput.host_syncs`: about
   log2(T / 32) + the row buckets, not one per fixed number of tokens). Regrouping and growing
   go layer by layer, each old layer freed once read: the old and the new cache never both live
   whole. Decoding ends when every row has emitted an EOS id or T tokens. Programs are cached
   per shape: a run compiles one segment program per (prompt bucket, row bucket, cache size)
   it meets.
4. Continuous batching (`max_rows`, when B*G is larger): the decode state holds `max_rows`
   slots, one row per group, each with its prompt's keys/values. The first prompts fill the
   slots; whenever a quarter of the slots (or what the pending prompts need) have finished, the
   next prompts are prefilled (`admit_bucket` of them at once) and their rows take the free
   slots while the others keep decoding, each row at its own step. With no prompt pending,
   step 3's regrouping takes over.

Sampling knobs (`select`): `temperature`, `top_p`, `top_k` and `eos_ids` are *static* (part of
the compiled program's key; a run uses two or three settings -- training 1.0/1.0/0, evaluation
0.6/0.95/0, greedy hints 0). `temperature=0` is greedy (argmax).

Log-probs: `logprobs` is the log-softmax of the model's *raw* logits (temperature 1, no top-k /
top-p) at the chosen token -- exactly what the GRPO update recomputes as "old" log-probs. With
temperature != 1 or top-k/top-p active it is therefore not the log-probability under the
distribution the token was actually drawn from.

Randomness: row (prompt b, sample g) uses `row_key = fold_in(fold_in(key, prompt_ids_B[b]), g)`
and step t draws from `fold_in(row_key, t)`. `prompt_ids_B` defaults to `arange(B)`; pass stable
ids (e.g. dataset indices) so that a row's tokens do not depend on which other prompts share the
batch, on the buckets or on when other rows finish. Fold the training step / hint level into
`key` before calling.

Padding: tokens after a row's end are `pad_id`; log-probs after the end are 0; `lengths` counts
the generated tokens including the EOS token.

Meshes (`sample(..., mesh=mesh)`, what the trainer passes): the programs run on the trainer's
("data", "fsdp", "tensor") mesh with the weights as the trainer holds them (no host round trip);
rows and caches are placed as `placement` says. Results do not depend on the mesh (the per-row
keys above; logits only up to float summation order). Without a mesh (the default) nothing is
placed or constrained. With several processes every process gets the whole output.
"""

from __future__ import annotations

from typing import Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from sage_jax.config import check_sampling
from sage_jax.infra import distributed, parallel
from sage_jax.engine.sampler import decode, placement, programs
from sage_jax.engine.sampler.sampling_plan import (DecodeShape, Knobs, ProgramSpec, SamplingPlan,
                                           admit_bucket)


def left_pad(prompts: Sequence[Sequence[int]], length: int, pad_id: int):
    """(tokens_BxP int32, mask_BxP bool) with each prompt right-aligned in `length` columns (the
    layout `sample` takes)."""
    tok = np.full((len(prompts), length), pad_id, np.int32)
    mask = np.zeros((len(prompts), length), bool)
    for i, p in enumerate(prompts):
        if not 0 < len(p) <= length:
            raise ValueError(f"prompt {i} has {len(p)} tokens; must be 1..{length}")
        tok[i, length - len(p):] = p
        mask[i, length - len(p):] = True
    return tok, mask


@flax.struct.dataclass
class SampleOutput:
    """What a sampling call returns (see the module docstring for shapes and padding).

    tokens: int32 generated tokens, `pad_id` after each row's end.
    lengths: int32 number of generated tokens per row, the EOS token included.
    logprobs: float32 log-softmax of the raw (temperature 1) logits at each generated token, 0
      after the end.
    decode_row_steps: row-steps the decode programs ran (rows of each segment, padding and
      finished rows included, times its steps): the work that `lengths` is the useful part of.
    host_syncs: times the host waited for the device's results (the first tokens, then once
      per decode segment).
    """

    tokens: np.ndarray
    lengths: np.ndarray
    logprobs: np.ndarray
    decode_row_steps: int = flax.struct.field(pytree_node=False, default=0)
    host_syncs: int = flax.struct.field(pytree_node=False, default=0)


def _put(x, lay, rows: bool = False):
    """A host array as a program input: placed on the layout's rows (or replicated) on a mesh."""
    if lay is None:
        return jnp.asarray(x)
    return jax.device_put(x, placement.spec(lay) if rows else placement.replicated(lay))


def _program(plan: SamplingPlan, spec: ProgramSpec, graphdef=None, knobs: Knobs | None = None,
             lay: placement.Layout | None = None):
    """The jitted program `spec`, which must be one the call's plan lists."""
    if not plan.allows(spec):
        raise RuntimeError(f"sampler program {spec} is not among the programs of its call's "
                           f"plan {plan}: the plan and the executor disagree")
    return programs.get(spec.kind, graphdef, knobs, lay, spec.extra)


def _check_knobs(temperature, top_p, top_k, num_samples, max_new_tokens):
    check_sampling(temperature, top_p, top_k)  # a ConfigError, which is a ValueError
    if int(num_samples) != num_samples or num_samples < 1:
        raise ValueError(f"num_samples must be an integer >= 1, got {num_samples}")
    if int(max_new_tokens) != max_new_tokens or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens}")


def _eos_tuple(eos) -> tuple[int, ...]:
    if eos is None:
        return ()
    if isinstance(eos, (int, np.integer)):
        return (int(eos),)
    return tuple(sorted({int(e) for e in eos}))


def _check_left_padded(mask: np.ndarray):
    """Every row must be some padding (False) followed by at least one real token (True)."""
    bad = np.nonzero(np.any(mask[:, :-1] & ~mask[:, 1:], axis=1) | ~mask[:, -1])[0]
    if bad.size:
        raise ValueError(
            f"prompt row {int(bad[0])} is not left-padded: its mask must be False... then True..., "
            f"ending with a real token (mask row: {mask[bad[0]].astype(int).tolist()})")


def sample(graphdef, params, prompt_BxP, prompt_mask_BxP, *, key, num_samples: int = 1,
           max_new_tokens: int, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0,
           eos_ids: Sequence[int] | int | None = (), prompt_ids_B=None,
           pad_id: int = 0, mesh: Mesh | None = None,
           max_rows: int | None = None) -> SampleOutput:
    """Samples `num_samples` continuations of each of B left-padded prompts.

    Args:
      graphdef, params: the model as from `models.split(model)`; params stay on device.
      prompt_BxP: int token ids, left-padded; prompt_mask_BxP: True on real tokens (a suffix of
        each row, at least one token). Host (numpy) inputs are checked for left padding.
      key: PRNG key; row (b, g) uses fold_in(fold_in(key, prompt_ids_B[b]), g), step t folds in t.
      num_samples: G, samples per prompt (the prompt is prefilled once, its cache shared).
      max_new_tokens: T, the per-row token budget.
      temperature, top_p, top_k: sampling knobs (temperature 0 = greedy, top_p 1 and top_k 0 or
        None = off); see the module docstring, also for what they do to `logprobs`.
      eos_ids: an id or ids that end a row (the EOS token is part of the output and its length).
      prompt_ids_B: int ids that identify the prompts for the PRNG (default arange(B)).
      pad_id: the token written after a row's end (and used to pad prompts).
      mesh: the ("data", "fsdp", "tensor") mesh that `params` live on (e.g. the trainer's): rows
        and caches are placed on it as the module docstring says. None: no placement.
      max_rows: decode at most this many rows at once (rounded up to the mesh's row shards;
        at least G). With more rows (B*G) the call batches continuously: a finished row's slot
        takes the next pending prompt's rows; the tokens stay the same. None: all at once.

    All of num_samples, max_new_tokens, temperature, top_p, top_k, eos_ids and pad_id are static:
    each distinct combination compiles its own programs (cached for the life of the process).

    Returns:
      SampleOutput(tokens [B, G, T] int32, lengths [B, G] int32, logprobs [B, G, T] float32) as
      host (numpy) arrays, the same on every process.
    """
    top_k = 0 if top_k is None else top_k
    _check_knobs(temperature, top_p, top_k, num_samples, max_new_tokens)
    if max_rows is not None and (int(max_rows) != max_rows or max_rows < num_samples):
        raise ValueError(f"max_rows must be an integer >= num_samples ({num_samples}), "
                         f"got {max_rows}")
    if prompt_BxP.ndim != 2 or tuple(prompt_mask_BxP.shape) != tuple(prompt_BxP.shape):
        raise ValueError(f"prompt_BxP {tuple(prompt_BxP.shape)} and prompt_mask_BxP "
                         f"{tuple(prompt_mask_BxP.shape)} must both be [B, P]")
    b, p = prompt_BxP.shape
    if b == 0 or p == 0:
        raise ValueError(f"sample() needs at least one prompt token, got prompts of shape {(b, p)}")
    st = Knobs(num_samples=int(num_samples), max_new_tokens=int(max_new_tokens),
               temperature=float(temperature), top_p=float(top_p), top_k=int(top_k),
               eos_ids=_eos_tuple(eos_ids), pad_id=int(pad_id))
    plan = SamplingPlan.of(st, b, p, num_params=sum(x.size for x in jax.tree.leaves(params)),
                           shards=1 if mesh is None else parallel.row_shards(mesh),
                           max_rows=max_rows)
    bb, pb = plan.batch, plan.prompt_cols
    if prompt_ids_B is None:
        prompt_ids_B = np.arange(b, dtype=np.int32)
    if tuple(np.shape(prompt_ids_B)) != (b,):
        raise ValueError(
            f"prompt_ids_B must have shape ({b},), got {tuple(np.shape(prompt_ids_B))}")

    host = not isinstance(prompt_BxP, jax.Array)
    xp = np if host else jnp
    if host:
        prompt_mask_BxP = np.asarray(prompt_mask_BxP).astype(bool)
        _check_left_padded(prompt_mask_BxP)
    tokens = xp.pad(xp.asarray(prompt_BxP).astype(xp.int32), ((0, bb - b), (pb - p, 0)),
                    constant_values=st.pad_id)
    mask = xp.pad(xp.asarray(prompt_mask_BxP).astype(bool), ((0, bb - b), (pb - p, 0)))
    ids = xp.pad(xp.asarray(prompt_ids_B).astype(xp.int32), (0, bb - b))
    valid = np.arange(bb) < b

    model = nnx.merge(graphdef, params)  # cheap: only to read the config
    if plan.continuous:
        return _continuous(graphdef, params, plan, mesh, tokens[:b], mask[:b], ids[:b], key,
                           model.cfg.num_kv_heads)
    lay = placement.layout(mesh, model.cfg.num_kv_heads, bb)
    if lay is not None:  # every input placed where the programs keep it (no later reshard)
        tokens, mask, ids, valid = (_put(x, lay, rows=True) for x in (tokens, mask, ids, valid))
        key = _put(key, lay)
    logits, prompt_k, prompt_v = _program(plan, ProgramSpec.prefill(bb), graphdef, None, lay)(
        params, tokens, mask)
    state, tok0, logp0 = _program(plan, ProgramSpec.start(bb, plan.first_cache), None, st, lay)(
        prompt_k, prompt_v, mask, logits, key, ids, valid)
    del prompt_k, prompt_v
    run = _Decoding(plan, st, mesh, state.rows)
    run.first(np.arange(state.rows), *distributed.fetch(
        (tok0, logp0, state.lengths_R, state.done_R)))
    out = run.finish(run.decode(graphdef, params, lay, state))
    if bb != b:
        out = jax.tree.map(lambda x: x[:b], out)
    return out


def _continuous(graphdef, params, plan: SamplingPlan, mesh, tokens_BxP, mask_BxP, ids_B, key,
                num_kv_heads: int) -> SampleOutput:
    """`sample` for more rows than `plan.slots` (continuous batching): the decode state holds
    that many rows; whenever a quarter of them (or all the prompts still pending) are free, the
    next prompts are prefilled and their G rows take the free slots, while the other rows go
    on decoding. Once no prompt is pending, rows regroup into smaller buckets as in the
    lockstep path. Tokens equal the lockstep path's: each row draws from its own key and step."""
    st, slots = plan.knobs, plan.first_rows
    b, g = tokens_BxP.shape[0], st.num_samples
    lay = placement.layout(mesh, num_kv_heads, slots)
    run = _Decoding(plan, plan.decode_knobs, mesh, b * g)  # one row per group
    tokens_BxP, mask_BxP, ids_B = (np.asarray(jax.device_get(x)) for x in (tokens_BxP, mask_BxP,
                                                                          ids_B))
    pending, state = list(range(b)), None

    def admit(state, free):
        n = min(len(pending), free.size // g)
        take = pending[:n]
        del pending[:n]
        nb = admit_bucket(n)
        sel = np.array(take + [take[0]] * (nb - n))
        valid = np.arange(nb) < n
        at = np.where(np.repeat(valid, g), np.resize(free[:n * g], nb * g), slots).astype(np.int32)
        play = placement.layout(mesh, num_kv_heads, nb)
        tok, msk, pid, ok = (_put(x, play, rows=True) for x in (tokens_BxP[sel], mask_BxP[sel],
                                                                ids_B[sel], valid))
        logits, pk, pv = _program(plan, ProgramSpec.prefill(nb), graphdef, None, play)(
            params, tok, msk)
        if state is None:
            state = _program(plan, ProgramSpec.empty(nb, slots, plan.first_cache), lay=lay)(pk, pv)
        into = DecodeShape(state.rows, state.group, state.slots)
        state, tok0, logp0 = _program(plan, ProgramSpec.admit(nb, g, into), None, st, lay)(
            state, pk, pv, msk, logits, _put(key, play), pid, ok, _put(at, lay))
        rows = np.flatnonzero(np.repeat(valid, g))
        out_rows = (np.repeat(np.array(take), g) * g + np.tile(np.arange(g), n))
        tok0, logp0, lengths, done = distributed.fetch(
            (tok0, logp0, state.lengths_R, state.done_R))
        ids_now = run.row_ids.copy() if run.row_ids.size else np.full(slots, -1)
        ids_now[at[rows]] = out_rows
        first = np.full(slots, -1)
        first[at[rows]] = rows
        run.first(ids_now, np.where(first >= 0, tok0[np.maximum(first, 0)], 0),
                  np.where(first >= 0, logp0[np.maximum(first, 0)], 0.0), lengths, done,
                  fresh=first >= 0)
        return state

    state = admit(None, np.arange(slots))
    while pending:
        free = np.flatnonzero(run.done)
        need = min(plan.admit_at, len(pending) * g)
        if free.size >= need:
            state = admit(state, free)
            continue
        state = run.segments(graphdef, params, lay, state, stop=slots - need, once=True)
    return run.finish(run.decode(graphdef, params, lay, state), b=b, g=g)


class _Decoding:
    """The host side of one sampling call: the output arrays, which output row each state row
    is (-1: none), and the decode segments that fill them."""

    def __init__(self, plan: SamplingPlan, st: Knobs, mesh, out_rows: int):
        t_max = st.max_new_tokens
        self.plan, self.st, self.mesh = plan, st, mesh
        self.tokens = np.full((out_rows, t_max), st.pad_id, np.int32)
        self.logps = np.zeros((out_rows, t_max), np.float32)
        self.lengths = np.zeros(out_rows, np.int32)
        self.row_ids = np.full(0, -1)  # set by `first`
        self.done, self.len_R = np.ones(0, bool), np.zeros(0, np.int32)
        self.row_steps, self.syncs = 0, 0

    def first(self, row_ids, tok0, logp0, lengths_R, done_R, fresh=None):
        """Records the first tokens of the state rows `fresh` (default: all) and the state's
        row ids, lengths and finished flags (one host sync)."""
        fresh = np.ones(len(row_ids), bool) if fresh is None else fresh
        out = row_ids[fresh]
        self.tokens[out, 0], self.logps[out, 0] = np.asarray(tok0)[fresh], np.asarray(logp0)[fresh]
        self.lengths[out] = np.asarray(lengths_R)[fresh]
        self.row_ids, self.len_R, self.done = np.array(row_ids), np.array(lengths_R), np.array(done_R)
        self.syncs += 1

    def segments(self, graphdef, params, lay, state, *, stop: int, once: bool = False):
        """Runs decode segments (each stopping once at most `stop` rows run, or a row's cache
        is full: then the cache grows) until every row has finished, or after one segment with
        `once`; records their tokens. Returns the state."""
        st = self.st
        while not self.done.all():
            longest = int(self.len_R[~self.done].max())
            cap = self.plan.cache_for(longest, state.slots)
            if cap > state.slots:  # the cache is full: grow it
                state = self.regroup(state, lay, cap)
            shape = DecodeShape(state.rows, state.group, state.slots)
            run = _program(self.plan, ProgramSpec.segment(shape), graphdef, st, lay)
            state, seg_tok, seg_logp, n = run(params, state, _put(np.int32(stop), lay))
            seg_tok, seg_logp, len_R, done, n = distributed.fetch(
                (seg_tok, seg_logp, state.lengths_R, state.done_R, n))
            self._record(seg_tok, seg_logp, np.asarray(len_R), np.asarray(done))
            self.row_steps += state.rows * int(n)
            if once:
                break
        return state

    def decode(self, graphdef, params, lay, state):
        """Decodes every row to its end, moving the running rows into smaller row buckets as
        they finish. Returns the state."""
        while not self.done.all():
            live = np.flatnonzero(~self.done)
            rows = self.plan.rows_for(live.size)
            if rows < state.rows:  # the running rows fit a smaller bucket: gather them
                index = np.concatenate([live, np.full(rows - live.size, live[0])]).astype(np.int32)
                keep = np.arange(rows) < live.size
                longest = int(self.len_R[live].max())
                cap = self.plan.cache_for(longest, state.slots)
                lay = placement.layout(self.mesh, state.prompt_k[0].shape[1], rows)
                state = self.regroup(state, lay, cap, _put(index, lay), _put(keep, lay, rows=True))
                self.row_ids = np.where(keep, self.row_ids[index], -1)
                self.len_R, self.done = self.len_R[index], self.done[index] | ~keep
            state = self.segments(graphdef, params, lay, state, once=True,
                                  stop=self.plan.stop_at(state.rows))
        return state

    def _record(self, seg_tok, seg_logp, len_R, done):
        """Writes a segment's tokens: state row r's column i is its token len_R_before[r] + i."""
        mine = self.row_ids >= 0
        k = np.where(mine, len_R - self.len_R, 0)
        rr, cc = np.nonzero(np.arange(seg_tok.shape[1])[None, :] < k[:, None])
        out, col = self.row_ids[rr], self.len_R[rr] + cc
        self.tokens[out, col], self.logps[out, col] = seg_tok[rr, cc], seg_logp[rr, cc]
        self.lengths[self.row_ids[mine]] = len_R[mine]
        self.len_R, self.done = len_R, done
        self.syncs += 1

    def regroup(self, state, lay, cap: int, index_R=None, keep_R=None):
        """`state` with a `cap`-slot generated cache and, with `index_R`, only those rows (one per
        group; `keep_R` False: padding). Layer by layer: each old layer is deleted as soon as its
        program is queued (the runtime frees it once read), so the old and the new cache never
        both live whole. `state`'s caches are gone afterwards."""
        old_shape = DecodeShape(state.rows, state.group, state.slots)
        rows = None if index_R is None else int(index_R.shape[0])
        fn = _program(self.plan, ProgramSpec.regroup(old_shape, cap, rows), lay=lay)
        layers = []
        for i in range(len(state.gen_k)):
            old = (state.gen_k[i], state.gen_v[i])
            if index_R is not None:
                old += (state.prompt_k[i], state.prompt_v[i])
            layers.append(fn(*old) if index_R is None else fn(*old, index_R))
            for x in old:
                x.delete()
        if index_R is None:
            return state.replace(gen_k=tuple(k for k, _ in layers),
                                 gen_v=tuple(v for _, v in layers))
        assert rows is not None  # index_R given: the rows are gathered
        pk, pv, gk, gv = (tuple(x) for x in zip(*layers))
        fields = {k: getattr(state, k) for k in decode.ROW_FIELDS}
        fields = _program(self.plan, ProgramSpec.gather_rows(rows, state.rows, state.group),
                          lay=lay)(fields, index_R, keep_R)
        return state.replace(prompt_k=pk, prompt_v=pv, gen_k=gk, gen_v=gv, **fields)

    def finish(self, state, b: int | None = None, g: int | None = None) -> SampleOutput:
        """The call's SampleOutput, [B, G, T] (G = the static num_samples unless given)."""
        del state
        g = self.st.num_samples if g is None else g
        b = self.tokens.shape[0] // g if b is None else b
        t = self.st.max_new_tokens
        return SampleOutput(tokens=self.tokens.reshape(b, g, t),
                            lengths=self.lengths.reshape(b, g),
                            logprobs=self.logps.reshape(b, g, t),
                            decode_row_steps=self.row_steps, host_syncs=self.syncs)


def generate(model, prompts: Sequence[Sequence[int]], *, max_new_tokens: int = 256,
             temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0,
             eos_token_id: int | Sequence[int] | None = None, key=None, num_samples: int = 1,
             prompt_ids: Sequence[int] | None = None, pad_id: int = 0,
             mesh=None, max_rows: int | None = None) -> SampleOutput:
    """Samples continuations of token-id prompts of varying lengths with a `Decoder`.

    `eos_token_id`: an id or a list of ids; None uses the model config's EOS ids (pass () for
    none). `key` defaults to PRNGKey(0); `prompt_ids` (default 0..N-1) identify the prompts for
    the PRNG. `mesh`: sample on it, the parameters placed by the partition rules as the trainer
    places them (so a trainer's sampling programs on that mesh are the same ones). `max_rows`:
    at most this many rows decode at once (continuous batching, see `sample`). Returns
    numpy arrays, one row per sample, prompt-major: tokens int32 [N*G, T], lengths int32 [N*G],
    logprobs float32 [N*G, T] (G = num_samples).
    """
    if not len(prompts):
        raise ValueError("generate() needs at least one prompt")
    for i, pr in enumerate(prompts):
        if len(pr) == 0:
            raise ValueError(f"prompt {i} is empty; every prompt needs at least one token")
    n = len(prompts)
    tok, mask = left_pad(prompts, max(len(pr) for pr in prompts), pad_id)
    eos = model.cfg.eos_ids if eos_token_id is None else eos_token_id
    key = jax.random.PRNGKey(0) if key is None else key
    graphdef, params = nnx.split(model)
    if mesh is not None:
        params = jax.device_put(params, parallel.tree_shardings(params, mesh))
    ids = None if prompt_ids is None else np.asarray(prompt_ids, np.int32)
    out = jax.device_get(sample(
        graphdef, params, tok, mask, key=key, num_samples=num_samples,
        max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
        eos_ids=eos, prompt_ids_B=ids, pad_id=pad_id, mesh=mesh, max_rows=max_rows))
    rows = n * num_samples
    return SampleOutput(tokens=np.asarray(out.tokens).reshape(rows, -1),
                        lengths=np.asarray(out.lengths).reshape(rows),
                        logprobs=np.asarray(out.logprobs).reshape(rows, -1),
                        decode_row_steps=out.decode_row_steps, host_syncs=out.host_syncs)
