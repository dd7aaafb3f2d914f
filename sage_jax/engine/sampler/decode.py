"""The sampler's device programs: prefill, start, decode segments and regrouping of rows.

Shapes: B prompt groups of G rows each (R = B*G rows, row b*G + g), P prompt columns, S slots
of the generated-token cache, V vocab, K kv heads, H head dim, n steps of a segment.

* `prefill(params, prompt_BxP, mask_BxP)` runs the prompts once and returns the last
  position's logits [B, V] and the prompts' keys/values, transposed for decode (read once for
  the G rows that share them; no cache in the prefill's own layout is kept).
* `start(prompt_k, prompt_v, mask_BxP, logits_BxV, key, prompt_ids_B, valid_B)` draws every
  row's first token and builds the `DecodeState` around the prompt keys/values, with an empty
  generated-token cache of `cap` slots.
* `segment(params, state, t0, stop_live)` decodes steps t0 .. t0+n-1 in a `lax.while_loop`
  (the state is donated and updated in place; no host synchronisation inside) until the
  generated-token cache is full, t reaches max_new_tokens, every row has finished, or at most
  `stop_live` rows still run (the host then moves them into a smaller row bucket); it returns
  the segment's tokens and log-probs [R, S] (the first n columns written) and n.
* `regroup_layer(gen_k, gen_v, prompt_k, prompt_v, index)` gives one layer a larger
  generated-token cache and/or only the rows `index` (then one row per group, G = 1), and
  `regroup_rows(fields, index, keep)` the per-row fields (`ROW_FIELDS`): between segments
  the host drops finished rows into a smaller row bucket and grows the cache as it fills, so
  that a step costs in proportion to the rows still running and attention reads only the
  slots in use (a read of a prefix of a larger cache would copy it every step). Layer by
  layer, each old layer freed once read, the old and the new state never both live whole.

Each step feeds one token per row through the model's own blocks (`decoder.Block.wire`: its
norms, projections, RoPE and MLP); only the cache and the attention core are specialised here.
"""

from __future__ import annotations

import math

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx

from sage_jax.engine.sampler import cpu_attention, decode_attention, placement
from sage_jax.engine.sampler.select import is_eos, select
from sage_jax.models.decoder import MASKED_SCORE, rope_inv_freq

PREFILL_SCORES_BYTES = 1 << 30  # prefill in chunks of prompts above ~1 GiB of attention scores

# Incremented each time a program is traced (i.e. about to be compiled); tests use it to check
# that a second batch in the same buckets does not recompile.
TRACE_COUNTS = {"prefill": 0, "start": 0, "decode": 0, "regroup": 0}


class DecodeState(flax.struct.PyTreeNode):
    """What decoding carries from one segment to the next.

    prompt_k, prompt_v: per layer [B, K, H, P] and [B, K, P, H] (keys stored transposed, so
      that both attention products are plain matrix products); prompt_mask_BxP: real tokens.
    gen_k, gen_v: per layer [B, K, G, H, S] and [B, K, G, S, H]; slot t-1 holds the key/value
      of generated token t-1.
    pos0_R: the position of generated token 0 (the prompt's length); keys_R: per-row PRNG
      keys; last_R: the last chosen token; done_R: finished (EOS, or a padding row);
      lengths_R: tokens generated, the EOS included.
    """

    prompt_k: tuple
    prompt_v: tuple
    prompt_mask_BxP: jax.Array
    gen_k: tuple
    gen_v: tuple
    pos0_R: jax.Array
    keys_R: jax.Array
    last_R: jax.Array
    done_R: jax.Array
    lengths_R: jax.Array

    @property
    def rows(self) -> int:
        return self.done_R.shape[0]

    @property
    def group(self) -> int:
        return self.gen_v[0].shape[2]

    @property
    def slots(self) -> int:
        return self.gen_v[0].shape[3]


# ---- one decode step through the model's layers -----------------------------------------------

def _attend(attn, queries, prompt_kv, prompt_mask_BxP, gen_kv, gen_valid_RxS, new_kv, g):
    """Attention of one new token per row over its prompt, its earlier generated tokens and
    itself; `queries` [R, Q*H] (each row's query heads, flattened).

    The prompt's keys/values are read once for the G rows that share them: k [B, K, H, P], v
    [B, K, P, H]. Earlier generated ones are per row: k [B, K, G, H, S], v [B, K, G, S, H]
    (`gen_valid_RxS` marks each row's slots written before this step); the new token's own k, v are
    [B, K, G, H]. Reading the cache before this step's write lets XLA update it in place (a
    read of the updated cache makes it copy the whole cache every step). Mirrors
    `decoder.Attention`: scaling, masking with its finite minus infinity, float32 softmax.
    """
    r = queries.shape[0]
    b, kh, h = r // g, attn.k, attn.h
    gq = attn.n // kh
    cd = queries.dtype
    (pk, pv), (gk, gv), (nk, nv) = prompt_kv, gen_kv, new_kv
    q = queries.reshape(b, g, kh, gq, h).transpose(0, 2, 1, 3, 4)  # [B, K, G, Gq, H]
    scale = 1.0 / math.sqrt(h)
    s_p = jnp.einsum("bkgqh,bkhs->bkgqs", q, pk.astype(cd),
                     preferred_element_type=jnp.float32) * scale
    s_p = jnp.where(prompt_mask_BxP[:, None, None, None, :], s_p, MASKED_SCORE)
    s_g = jnp.einsum("bkgqh,bkghs->bkgqs", q, gk.astype(cd),
                     preferred_element_type=jnp.float32) * scale
    s_g = jnp.where(gen_valid_RxS.reshape(b, 1, g, 1, -1), s_g, MASKED_SCORE)
    s_n = jnp.einsum("bkgqh,bkgh->bkgq", q, nk.astype(cd),
                     preferred_element_type=jnp.float32)[..., None] * scale
    # softmax over [prompt slots, generated slots, itself] without concatenating them
    m = jnp.maximum(jnp.maximum(jnp.max(s_p, axis=-1, keepdims=True),
                                jnp.max(s_g, axis=-1, keepdims=True)), s_n)
    e_p, e_g, e_n = jnp.exp(s_p - m), jnp.exp(s_g - m), jnp.exp(s_n - m)
    inv = 1.0 / (jnp.sum(e_p, axis=-1, keepdims=True) + jnp.sum(e_g, axis=-1, keepdims=True)
                 + e_n)
    o = (jnp.einsum("bkgqs,bksh->bkgqh", (e_p * inv).astype(cd), pv.astype(cd))
         + jnp.einsum("bkgqs,bkgsh->bkgqh", (e_g * inv).astype(cd), gv.astype(cd))
         + (e_n * inv).astype(cd) * nv[:, :, :, None, :].astype(cd))
    return o.transpose(0, 2, 1, 3, 4).reshape(r, attn.n * h)


def _attend_live(impl, lay, attn, queries, prompt_kv, prompt_mask_BxP, gen_kv, slot_R, new_kv,
                 g):
    """`_attend` by `decode_attention`'s kernels: each row reads only its prompt's real columns
    and its generated slots before `slot_R`; the new token's own score is added here."""
    r = queries.shape[0]
    b, kh, h = r // g, attn.k, attn.h
    gq = attn.n // kh
    (pk, pv), (gk, gv), (nk, nv) = prompt_kv, gen_kv, new_kv
    p, s = pk.shape[-1], gk.shape[-1]
    q = queries.reshape(b, g, kh, gq, h).transpose(0, 2, 1, 3, 4)  # [B, K, G, Gq, H]
    real_B = jnp.sum(prompt_mask_BxP, axis=1, dtype=jnp.int32)
    prompt = decode_attention.over_prompt(impl, lay, q.reshape(b, kh, g * gq, h), pk, pv,
                                          p - real_B, jnp.full_like(real_B, p))
    prompt = decode_attention.Partial(prompt.out.reshape(q.shape),
                                      prompt.lse.reshape(q.shape[:-1]))
    gen = decode_attention.over_rows(impl, lay, q, gk, gv, jnp.clip(slot_R, 0, s).reshape(b, g))
    own = decode_attention.Partial(
        jnp.broadcast_to(nv[:, :, :, None, :].astype(jnp.float32), q.shape),
        jnp.einsum("bkgqh,bkgh->bkgq", q, nk.astype(q.dtype),
                   preferred_element_type=jnp.float32) / math.sqrt(h))
    o = decode_attention.combine(prompt, gen, own).astype(queries.dtype)
    return o.transpose(0, 2, 1, 3, 4).reshape(r, attn.n * h)


def _step(model, tok_R, pos_R, slot_R, prompt_kv, prompt_mask_BxP, gen_kv, g, lay=None):
    """Feeds one token per row at positions pos_R through the model's own blocks
    (`Block.wire`, `Attention.qkv`), with the attention core and the cache specialised here;
    writes row r's K/V at its generated slot slot_R[r] (rows may be at different steps; a slot
    outside the cache is not written).

    Returns (float32 logits [R, V], updated generated-token cache)."""
    inv_freq = rope_inv_freq(model.cfg)
    p, s = prompt_mask_BxP.shape[1], gen_kv[0][1].shape[3]
    gen_valid_RxS = jnp.arange(s)[None, :] < slot_R[:, None]
    impl = decode_attention.implementation(lay)
    if not decode_attention.supports(impl, model.cfg.head_dim, p, s,
                                     (model.compute_dtype, gen_kv[0][0].dtype)):
        impl = "xla"
    x = placement.on(lay, model.embed(tok_R[:, None]))  # [R, 1, D]
    r = x.shape[0]
    b = r // g
    lo_B = p - jnp.sum(prompt_mask_BxP, axis=1, dtype=jnp.int32)  # left-padded prompts
    slot_BxG = slot_R.reshape(b, g)

    def core(pkv, gk, gv):
        def attend(attn, h_Rx1xD):
            q, k, v = attn.qkv(h_Rx1xD, pos_R[:, None], inv_freq)  # [R, 1, Q|K, H]
            k, v = k.reshape(b, g, attn.k, attn.h), v.reshape(b, g, attn.k, attn.h)
            if impl == "cpu":  # the kernel reads live columns and writes the cache in place
                pk, pv = pkv
                a, nk, nv = cpu_attention.attend(lay, q.reshape(b, g, attn.k, -1), pk, pv, lo_B,
                                                 gk, gv, k, v, slot_BxG)
                return a.reshape(r, 1, attn.n * attn.h).astype(x.dtype), (nk, nv)
            q = q.reshape(r, attn.n * attn.h)
            k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # [B, K, G, H]
            if impl == "xla":
                a = _attend(attn, q, pkv, prompt_mask_BxP, (gk, gv), gen_valid_RxS, (k, v), g)
            else:
                a = _attend_live(impl, lay, attn, q, pkv, prompt_mask_BxP, (gk, gv), slot_R,
                                 (k, v), g)
            # The cache is written after it is read, and XLA must know it to write in place
            # (else it copies the whole cache every step): a zero that depends on the row's
            # attention output orders the write after the reads.
            after = 0.0 * a[:, :1].reshape(b, 1, g, 1)
            return a[:, None], decode_attention.write_rows(impl, lay, gk, gv, k + after,
                                                           v + after, slot_BxG)
        return attend

    new_gen = []
    for layer, pkv, (gk, gv) in zip(model.layers, prompt_kv, gen_kv):
        x, kv = layer.wire(x, core(pkv, gk, gv))
        new_gen.append(kv)
    return (placement.on(lay, model.head(x)[:, 0]),
            placement.on(lay, tuple(new_gen), kv_dim=1))


# ---- the programs ----------------------------------------------------------------------------

def _compute_dtype(graphdef, params):
    return nnx.merge(graphdef, params).compute_dtype


def prefill_rows(cfg, b: int, p: int) -> int:
    """Prompts per prefill chunk: the model's attention materialises [rows, N, P, P] float32
    scores, so long prompts are prefilled a power-of-two number of rows at a time."""
    rows = b
    while rows > 1 and rows * cfg.num_heads * p * p * 4 > PREFILL_SCORES_BYTES:
        rows //= 2
    return rows


def prefill(graphdef, lay, params, prompt_BxP, mask_BxP):
    """Runs the B prompts once; returns (last-position logits [B, V], prompt keys [B, K, H, P]
    and values [B, K, P, H] per layer, in the model dtype, transposed for decode)."""
    TRACE_COUNTS["prefill"] += 1
    model = nnx.merge(graphdef, placement.sampler_params(params, lay, _compute_dtype(graphdef,
                                                                                   params)))
    b, p = prompt_BxP.shape
    rows = prefill_rows(model.cfg, b, p)

    def run(tok, mask):
        h, ks, vs = model.prompt_kv(tok, mask)
        return (model.logits(h[:, -1:])[:, 0],
                tuple(k.astype(model.dtype).transpose(0, 2, 3, 1) for k in ks),
                tuple(v.astype(model.dtype).transpose(0, 2, 1, 3) for v in vs))

    if rows >= b:
        logits, prompt_k, prompt_v = run(prompt_BxP, mask_BxP)
    else:  # `rows` prompts at a time (sequentially)
        n = b // rows
        logits, prompt_k, prompt_v = jax.lax.map(
            lambda xs: run(*xs), (prompt_BxP.reshape(n, rows, p), mask_BxP.reshape(n, rows, p)))
        flat = lambda a: a.reshape((b,) + a.shape[2:])  # noqa: E731
        logits, prompt_k, prompt_v = flat(logits), tuple(map(flat, prompt_k)), tuple(
            map(flat, prompt_v))
    return (placement.on(lay, logits), placement.on(lay, prompt_k, kv_dim=1),
            placement.on(lay, prompt_v, kv_dim=1))


def start(st, lay, cap: int, prompt_k, prompt_v, mask_BxP, logits_BxV, key, prompt_ids_B,
          valid_B):
    """(DecodeState with an empty `cap`-slot generated cache, first tokens [R], their
    log-probs [R]); row (b, g) draws from fold_in(fold_in(key, prompt_ids_B[b]), g)."""
    TRACE_COUNTS["start"] += 1
    b, g = logits_BxV.shape[0], st.num_samples
    _, kh, h, _ = prompt_k[0].shape
    dtype = prompt_k[0].dtype
    gen_k = placement.on(lay, tuple(jnp.zeros((b, kh, g, h, cap), dtype) for _ in prompt_k),
                         kv_dim=1)
    gen_v = placement.on(lay, tuple(jnp.zeros((b, kh, g, cap, h), dtype) for _ in prompt_k),
                         kv_dim=1)
    fields, tok, logp = _first_rows(st, g, mask_BxP, placement.on(lay, logits_BxV), key,
                                    prompt_ids_B, valid_B)
    state = DecodeState(prompt_k=prompt_k, prompt_v=prompt_v,
                        prompt_mask_BxP=mask_BxP.astype(bool), gen_k=gen_k, gen_v=gen_v,
                        **placement.on(lay, fields))
    return state, *placement.on(lay, (tok, logp))


def segment(graphdef, st, lay, params, state: DecodeState, stop_live):
    """Decodes until a running row's cache is full (a row with n tokens feeds token n-1 at
    position pos0 + n - 1 and writes generated slot n - 1, so the last step has n = S), every
    row has finished (EOS or max_new_tokens), or at most `stop_live` rows still run (-1:
    never). Rows may be at different steps (continuous batching): each draws for its own step.
    Returns (state, tokens [R, S] (column i: the row's token of the segment's step i; `pad_id`
    where the row had finished or the step did not run), log-probs [R, S] (0 there), steps
    run n)."""
    TRACE_COUNTS["decode"] += 1
    model = nnx.merge(graphdef, placement.sampler_params(params, lay, _compute_dtype(graphdef,
                                                                                   params)))
    g, r, s, pad = state.group, state.rows, state.slots, st.pad_id
    prompt_kv = tuple(zip(state.prompt_k, state.prompt_v))

    def cond(c):
        _, _, _, _, lengths, _, done = c
        longest = jnp.max(jnp.where(done, 0, lengths))
        return (longest <= s) & (jnp.sum(~done, dtype=jnp.int32) > jnp.maximum(stop_live, 0))

    def body(c):
        i, gen_kv, toks, logps, lengths, last, done = c
        logits, gen_kv = _step(model, last, state.pos0_R + lengths - 1, lengths - 1, prompt_kv,
                               state.prompt_mask_BxP, gen_kv, g, lay)
        tok, logp = select(logits, state.keys_R, lengths, st)
        live = ~done
        toks = jax.lax.dynamic_update_slice(toks, jnp.where(live, tok, pad)[:, None], (0, i))
        logps = jax.lax.dynamic_update_slice(logps, jnp.where(live, logp, 0.0)[:, None], (0, i))
        lengths = lengths + live.astype(jnp.int32)
        done = done | is_eos(tok, st.eos_ids) | (lengths >= st.max_new_tokens)
        return (i + 1, gen_kv, *placement.on(lay, (toks, logps, lengths, tok, done)))

    toks = placement.on(lay, jnp.full((r, s), pad, jnp.int32))
    logps = placement.on(lay, jnp.zeros((r, s), jnp.float32))
    init = (jnp.asarray(0, jnp.int32), tuple(zip(state.gen_k, state.gen_v)), toks, logps,
            state.lengths_R, state.last_R, state.done_R)
    n, gen_kv, toks, logps, lengths, last, done = jax.lax.while_loop(cond, body, init)
    state = state.replace(gen_k=tuple(k for k, _ in gen_kv), gen_v=tuple(v for _, v in gen_kv),
                          lengths_R=lengths, last_R=last, done_R=done)
    return state, toks, logps, n


def empty(lay, cap: int, rows: int, prompt_k, prompt_v) -> DecodeState:
    """A state of `rows` free slots (finished, no tokens), one row per group, for prompts of
    `prompt_k`'s / `prompt_v`'s shapes and dtype (only their shapes are read) and a `cap`-slot
    generated cache: what continuous batching admits prompts into."""
    TRACE_COUNTS["start"] += 1
    _, kh, h, p = prompt_k[0].shape
    dtype = prompt_k[0].dtype
    zeros = lambda *shape: tuple(jnp.zeros(shape, dtype) for _ in prompt_k)  # noqa: E731
    pk, pv = placement.on(lay, (zeros(rows, kh, h, p), zeros(rows, kh, p, h)), kv_dim=1)
    gk, gv = placement.on(lay, (zeros(rows, kh, 1, h, cap), zeros(rows, kh, 1, cap, h)),
                          kv_dim=1)
    i32 = jnp.zeros((rows,), jnp.int32)
    return DecodeState(
        prompt_k=pk, prompt_v=pv, gen_k=gk, gen_v=gv,
        prompt_mask_BxP=placement.on(lay, jnp.zeros((rows, p), bool)),
        pos0_R=placement.on(lay, i32), keys_R=placement.on(lay, jax.random.split(
            jax.random.PRNGKey(0), rows)), last_R=placement.on(lay, i32),
        done_R=placement.on(lay, jnp.ones((rows,), bool)), lengths_R=placement.on(lay, i32))


def _first_rows(st, g: int, prompt_mask_BxP, logits_BxV, key, prompt_ids_B, valid_B):
    """The per-row fields of G rows for each of B prompts (row b*G + g) and their first tokens:
    (fields of `ROW_FIELDS` but the prompt mask, first tokens [R], their log-probs [R]); row
    (b, g) draws from fold_in(fold_in(key, prompt_ids_B[b]), g)."""
    b = logits_BxV.shape[0]
    pid_R = jnp.repeat(prompt_ids_B.astype(jnp.int32), g)
    sid_R = jnp.tile(jnp.arange(g, dtype=jnp.int32), b)
    keys_R = jax.vmap(lambda p, s: jax.random.fold_in(jax.random.fold_in(key, p), s))(pid_R,
                                                                                        sid_R)
    valid_R = jnp.repeat(valid_B, g)
    tok, logp = select(jnp.repeat(logits_BxV, g, axis=0), keys_R, 0, st)
    pos0_R = jnp.repeat(jnp.sum(prompt_mask_BxP.astype(bool), axis=1, dtype=jnp.int32), g)
    fields = dict(pos0_R=pos0_R, keys_R=keys_R, last_R=tok,
                  done_R=~valid_R | is_eos(tok, st.eos_ids) | (st.max_new_tokens <= 1),
                  lengths_R=valid_R.astype(jnp.int32))
    return (fields, jnp.where(valid_R, tok, st.pad_id), jnp.where(valid_R, logp, 0.0))


def admit(st, lay, g: int, state: DecodeState, prompt_k, prompt_v, mask_BxP, logits_BxV, key,
          prompt_ids_B, valid_B, slot_R):
    """`state` with G rows of each of B newly prefilled prompts written into the free slots
    slot_R [B*G] (row b*G + g into slot_R[b*G + g]; an index >= the state's rows: not
    admitted, e.g. a padding prompt), each row's first token drawn as `start` draws it.
    Returns (state, first tokens [B*G], their log-probs [B*G])."""
    TRACE_COUNTS["start"] += 1
    fields, tok, logp = _first_rows(st, g, mask_BxP, logits_BxV, key, prompt_ids_B, valid_B)
    b_R = jnp.repeat(jnp.arange(logits_BxV.shape[0]), g)
    put = lambda old, new: old.at[slot_R].set(new.astype(old.dtype), mode="drop")  # noqa: E731
    state = state.replace(
        prompt_k=tuple(put(o, n[b_R]) for o, n in zip(state.prompt_k, prompt_k)),
        prompt_v=tuple(put(o, n[b_R]) for o, n in zip(state.prompt_v, prompt_v)),
        prompt_mask_BxP=put(state.prompt_mask_BxP, mask_BxP[b_R]),
        **{k: put(getattr(state, k), v) for k, v in fields.items()})
    state = state.replace(
        prompt_k=placement.on(lay, state.prompt_k, kv_dim=1),
        prompt_v=placement.on(lay, state.prompt_v, kv_dim=1),
        **{k: placement.on(lay, getattr(state, k)) for k in ROW_FIELDS})
    return state, tok, logp


def regroup_layer(lay, cap: int, gen_k, gen_v, prompt_k=None, prompt_v=None, index_R=None):
    """One layer's generated keys/values in a `cap`-slot cache (cap >= its slots) and, with
    `index_R`, only the rows index_R, one row per group, with the prompt's keys/values copied:
    (gen_k, gen_v), or (prompt_k, prompt_v, gen_k, gen_v) with `index_R`. The host runs it
    layer by layer and frees each old layer once read, so the old and the new cache never both
    live whole."""
    TRACE_COUNTS["regroup"] += 1
    grow = cap - gen_v.shape[3]
    gen_k = jnp.pad(gen_k, ((0, 0),) * 4 + ((0, grow),))
    gen_v = jnp.pad(gen_v, ((0, 0),) * 3 + ((0, grow), (0, 0)))
    if index_R is None:
        return placement.on(lay, (gen_k, gen_v), kv_dim=1)
    assert prompt_k is not None and prompt_v is not None, "index_R needs prompt_k, prompt_v"
    b_R, g_R = index_R // gen_v.shape[2], index_R % gen_v.shape[2]
    prompt_k, prompt_v = jnp.take(prompt_k, b_R, axis=0), jnp.take(prompt_v, b_R, axis=0)
    gen_k, gen_v = gen_k[b_R, :, g_R][:, :, None], gen_v[b_R, :, g_R][:, :, None]
    return placement.on(lay, (prompt_k, prompt_v, gen_k, gen_v), kv_dim=1)


ROW_FIELDS = ("prompt_mask_BxP", "pos0_R", "keys_R", "last_R", "done_R", "lengths_R")


def regroup_rows(lay, fields: dict, index_R, keep_R) -> dict:
    """The `ROW_FIELDS` of a state for the rows index_R (one row per group); rows where
    `keep_R` is False are padding, marked finished."""
    b_R = index_R // (fields["done_R"].shape[0] // fields["prompt_mask_BxP"].shape[0])
    out = {k: placement.on(lay, jnp.take(x, b_R if k == "prompt_mask_BxP" else index_R, axis=0))
           for k, x in fields.items()}
    out["done_R"] = out["done_R"] | ~keep_R
    return out
