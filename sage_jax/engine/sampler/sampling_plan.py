"""The plan of one sampling call: its buckets, cache sizes, row buckets and the programs it runs.

`sampling.sample` executes a `SamplingPlan`, `analysis.compile_check` compiles its programs,
`analysis.memory` sizes its caches, and the rollout pads its prompts with `prompt_bucket`. Every
size a call can take is decided here and nowhere else (the training rows' is the trainer's:
`trainer.packing.length_bucket`).

Shapes: B prompts, G samples per prompt, P prompt columns, T = max_new_tokens, S slots of the
generated-token cache, R decode rows.

Buckets (each size is a set of programs to compile; padding stays under 1/8 to 1/2):
* prompts: P rounded up to a power of two or (`fine`) 1.5 times one, at least 16;
* prompts per call: B rounded up to a power of two, at least 8;
* decode rows: the running rows of a segment, m, 1.5m, 2m, 3m, ... (m = 8, or 32 without
  `fine`; multiples of the mesh's row shards);
* cache slots: a power of two >= 32, at most T - 1 rounded up to 8; a call starts with room for
  `DECODE_SEGMENT` steps (all T without EOS ids) and doubles it as rows run longer;
`fine` (the 1.5x buckets) is on for models of `FINE_BUCKETS_MIN_PARAMS` parameters and more,
whose decode steps cost enough to pay for the extra compiles.

`SamplingPlan.programs(every=True)` lists each program a call may run (`ProgramSpec`: its kind,
static argument and argument shapes; which of them run depends on when rows finish). The
executor (`sampling`) runs only programs of that list, and `analysis.compile_check` compiles it
(by default the largest program of each kind, `every=True` all of them).
"""

from __future__ import annotations

import dataclasses
import functools

import flax.struct

PROMPT_BUCKET_MIN = 16  # prompt lengths are rounded up to 16, 24, 32, 48, 64, 96, 128, ...
BATCH_BUCKET_MIN = 8  # numbers of prompts are rounded up to 8, 16, 32, 64, ...
DECODE_SEGMENT = 16  # the cache grows (doubles) when fewer than this many more steps fit
SLOT_BUCKET_MIN = 32  # the generated-token cache holds 32, 64, 128, ... slots (as it fills)
ROW_BUCKET_MIN = 8  # rows are regrouped into 8, (12,) 16, (24,) 32, ... (split over row shards)
# Models under FINE_BUCKETS_MIN_PARAMS regroup into 32, 64, ... rows only: below 32 rows their
# decode step costs about the same, so a smaller bucket would mostly add programs to compile.
COARSE_ROW_BUCKET_MIN = 32
FINE_BUCKETS_MIN_PARAMS = 20_000_000  # the 1.5x row and prompt buckets from this model size up
ADMIT_SHARE = 4  # continuous batching admits prompts once a quarter of the slots are free


def prompt_bucket(n: int, *, fine: bool = True) -> int:
    """Padded prompt length for prompts of at most n tokens: a power of two or (when `fine`)
    1.5 times one, at least 16."""
    n = max(int(n), 1)
    c = 1 << max(n - 1, 0).bit_length()  # the power of two >= n
    return max(PROMPT_BUCKET_MIN, c * 3 // 4 if fine and c * 3 // 4 >= n else c)


def batch_bucket(n: int) -> int:
    """Padded number of prompts for n prompts: the next power of two, at least 8."""
    return max(BATCH_BUCKET_MIN, 1 << max(n - 1, 0).bit_length())


def admit_bucket(n: int) -> int:
    """Prompts a continuous-batching prefill runs for n admitted prompts: a power of two."""
    return 1 << max(n - 1, 0).bit_length()


def row_bucket(n: int, shards: int = 1, *, fine: bool = True) -> int:
    """Rows a decode segment runs for n live rows: the smallest of m, 1.5m, 2m, 3m, 4m, ...
    (the 1.5x sizes only when `fine` and when they split over the row shards) that holds them,
    m = the least multiple of `shards` >= `ROW_BUCKET_MIN` (`COARSE_ROW_BUCKET_MIN` when not
    `fine`)."""
    least = ROW_BUCKET_MIN if fine else COARSE_ROW_BUCKET_MIN
    c = -(-least // shards) * shards
    while c < n:
        if fine and c * 3 // 2 >= n and (c * 3 // 2) % shards == 0 and c % 2 == 0:
            return c * 3 // 2
        c *= 2
    return c


def fine_buckets(num_params: int) -> bool:
    """Whether sampling uses the 1.5x row and prompt buckets: models of at least
    `FINE_BUCKETS_MIN_PARAMS` parameters."""
    return num_params >= FINE_BUCKETS_MIN_PARAMS


def gen_slots(max_new_tokens: int) -> int:
    """Generated-token cache slots at most: T - 1 (the last token is never fed), rounded up
    to 8."""
    return max(8, -(-(max_new_tokens - 1) // 8) * 8)


def slot_bucket(need: int, max_new_tokens: int) -> int:
    """Generated-token cache slots for `need` slots: a power of two >= `SLOT_BUCKET_MIN`, at
    most `gen_slots(max_new_tokens)`."""
    return min(gen_slots(max_new_tokens), max(SLOT_BUCKET_MIN, 1 << max(need - 1, 0).bit_length()))


def first_slots(max_new_tokens: int, eos: bool) -> int:
    """The generated-token cache a call starts with: room for `DECODE_SEGMENT` steps, or all T
    without EOS ids (no row ends early, so one segment decodes everything)."""
    return slot_bucket(DECODE_SEGMENT if eos else max_new_tokens, max_new_tokens)


def slots_for(t: int, slots: int, max_new_tokens: int) -> int:
    """The cache a segment starting at step t runs with: `slots` while it holds at least
    `DECODE_SEGMENT` more steps (or the rest), else the next bucket that does."""
    if slots >= min(t + DECODE_SEGMENT - 1, max_new_tokens - 1):
        return slots
    return slot_bucket(t + DECODE_SEGMENT - 1, max_new_tokens)


def slot_schedule(max_new_tokens: int, eos: bool) -> dict[int, int]:
    """{cache slots: decode steps run with it} when no row ends early (steps 1 .. T-1)."""
    out, t, s = {}, 1, first_slots(max_new_tokens, eos)
    while t < max_new_tokens:
        s = slots_for(t, s, max_new_tokens)
        n = min(s + 1, max_new_tokens) - t
        out[s], t = out.get(s, 0) + n, t + n
    return out


def stop_live(rows: int, shards: int = 1, *, fine: bool = True) -> int:
    """Running rows at which a segment of `rows` rows stops so that the host can move them into
    a smaller row bucket: the most that fit one (-1: no smaller bucket)."""
    n = rows - 1
    while n > 0 and row_bucket(n, shards, fine=fine) >= rows:
        n -= 1
    return n if n > 0 else -1


@flax.struct.dataclass
class Knobs:
    """The compile-time settings of a call's programs (hashable: part of a program's key)."""

    num_samples: int = flax.struct.field(pytree_node=False)
    max_new_tokens: int = flax.struct.field(pytree_node=False)
    temperature: float = flax.struct.field(pytree_node=False)
    top_p: float = flax.struct.field(pytree_node=False)
    top_k: int = flax.struct.field(pytree_node=False)
    eos_ids: tuple = flax.struct.field(pytree_node=False)
    pad_id: int = flax.struct.field(pytree_node=False)


@dataclasses.dataclass(frozen=True)
class DecodeShape:
    """One decode segment program: `rows` rows, `rows_per_group` of them sharing a prompt's
    keys/values, a `slots`-slot generated-token cache."""

    rows: int
    rows_per_group: int
    slots: int

    @property
    def groups(self) -> int:
        return self.rows // self.rows_per_group


@dataclasses.dataclass(frozen=True)
class ProgramSpec:
    """One program a call may run: its `kind` (`programs.KINDS`), the static argument `extra`
    it is built with, and the shapes of its arguments (the call's P prompt columns besides):

    * prefill: `prompts` prompts; start: `prompts` prompts, a first cache of `extra` slots;
    * empty: a state of `rows` free slots for prompts of a `prompts`-prompt prefill, `extra` =
      (cache slots, rows); admit: `prompts` prefilled prompts of `extra` = G rows each into
      `state`;
    * segment: `state`; regroup: `state`'s caches, one layer, grown to `extra` slots and, when
      `rows` < `state.rows`, gathered into `rows` rows; rows: `state`'s per-row fields gathered
      into `rows` rows (`state.slots` 0: it reads no cache).

    `rows`: the rows the program's layout places (`placement.layout`). `label` names it in
    reports and is not part of its identity."""

    kind: str
    rows: int
    extra: int | tuple[int, int] | None = None
    prompts: int = 0
    state: DecodeShape | None = None
    label: str = dataclasses.field(default="", compare=False)

    @classmethod
    def prefill(cls, prompts: int, label: str = "") -> "ProgramSpec":
        return cls("prefill", prompts, prompts=prompts, label=label)

    @classmethod
    def start(cls, prompts: int, slots: int, label: str = "") -> "ProgramSpec":
        return cls("start", prompts, slots, prompts=prompts, label=label)

    @classmethod
    def empty(cls, prompts: int, rows: int, slots: int, label: str = "") -> "ProgramSpec":
        return cls("empty", rows, (slots, rows), prompts=prompts, label=label)

    @classmethod
    def admit(cls, prompts: int, group: int, state: DecodeShape, label: str = "") -> "ProgramSpec":
        return cls("admit", state.rows, group, prompts=prompts, state=state, label=label)

    @classmethod
    def segment(cls, state: DecodeShape, label: str = "") -> "ProgramSpec":
        return cls("segment", state.rows, state=state, label=label)

    @classmethod
    def regroup(cls, state: DecodeShape, slots: int, rows: int | None = None,
                label: str = "") -> "ProgramSpec":
        """`state`'s caches grown to `slots` and (with `rows`) gathered into that many rows."""
        return cls("regroup", state.rows if rows is None else rows, slots, state=state,
                   label=label)

    @classmethod
    def gather_rows(cls, rows: int, state_rows: int, rows_per_group: int,
                    label: str = "") -> "ProgramSpec":
        """A state's per-row fields (`state_rows` rows) gathered into `rows` rows."""
        return cls("rows", rows, state=DecodeShape(state_rows, rows_per_group, 0), label=label)


@dataclasses.dataclass(frozen=True)
class SamplingPlan:
    """The shapes of one sampling call of `prompts` prompts of at most `prompt_len` tokens with
    `knobs` (G = knobs.num_samples answers each), its rows split over `shards` row shards;
    `max_rows`: decode at most that many rows at once (continuous batching when B*G is more)."""

    knobs: Knobs
    prompts: int
    prompt_len: int
    fine: bool
    shards: int = 1
    max_rows: int | None = None

    @classmethod
    def of(cls, knobs: Knobs, prompts: int, prompt_len: int, *, num_params: int,
           shards: int = 1, max_rows: int | None = None) -> "SamplingPlan":
        """The plan of a call; `num_params`: the model's size (it picks the buckets)."""
        return cls(knobs, int(prompts), int(prompt_len), fine_buckets(num_params), int(shards),
                   None if max_rows is None else int(max_rows))

    @classmethod
    def of_chunk(cls, knobs: Knobs, prompts: int, prompt_len: int, *, num_params: int,
                 shards: int = 1, continuous: bool = False) -> "SamplingPlan":
        """The plan of one chunk of `prompts` prompts of a training step's rollout; with
        `continuous` (rollout.continuous_batching) the step's call holds more prompts than that and
        batches them continuously in `prompts` * G slots."""
        more = 2 if continuous else 1  # any count above `prompts` gives the same plan
        return cls.of(knobs, prompts * more, prompt_len, num_params=num_params, shards=shards,
                      max_rows=prompts * knobs.num_samples if continuous else None)

    @property
    def group(self) -> int:
        return self.knobs.num_samples

    @property
    def batch(self) -> int:
        """Prompts the prefill and the first decode state hold (B's bucket)."""
        return batch_bucket(self.prompts)

    @property
    def prefill_prompts(self) -> int:
        """Prompts a prefill runs: the batch, or a continuous call's first admission."""
        if self.slots is None:
            return self.batch
        return admit_bucket(min(self.prompts, self.slots // self.group))

    @property
    def prompt_cols(self) -> int:
        """Prompt columns (P's bucket)."""
        return prompt_bucket(self.prompt_len, fine=self.fine)

    @property
    def slots(self) -> int | None:
        """Decode rows of a continuous call (max_rows rounded up to the row shards), else None."""
        if self.max_rows is None:
            return None
        s = -(-self.max_rows // self.shards) * self.shards
        return s if self.prompts * self.group > s else None

    @property
    def continuous(self) -> bool:
        return self.slots is not None

    @property
    def decode_knobs(self) -> Knobs:
        """The knobs the decode segments are built with: one row per group in a continuous
        call's state (its rows come G to a prompt, each drawn as its own)."""
        return dataclasses.replace(self.knobs, num_samples=1) if self.continuous else self.knobs

    @property
    def eos(self) -> bool:
        return bool(self.knobs.eos_ids)

    @property
    def first_rows(self) -> int:
        """Rows of the first decode state: every row of the batch, or the continuous slots."""
        return self.slots if self.slots is not None else self.batch * self.group

    @property
    def schedule(self) -> dict[int, int]:
        """{cache slots: decode steps} when no row ends early."""
        return slot_schedule(self.knobs.max_new_tokens, self.eos)

    @property
    def cache_sizes(self) -> list[int]:
        """The generated-token cache sizes a call may run with, ascending (the first alone
        when no step decodes: T = 1)."""
        return sorted(self.schedule) or [self.first_cache]

    @property
    def first_cache(self) -> int:
        return first_slots(self.knobs.max_new_tokens, self.eos)

    def cache_for(self, t: int, slots: int) -> int:
        """The cache a segment starting at step t runs with (see `slots_for`)."""
        return slots_for(t, slots, self.knobs.max_new_tokens)

    def rows_for(self, live: int) -> int:
        """The row bucket of `live` running rows."""
        return row_bucket(live, self.shards, fine=self.fine)

    def stop_at(self, rows: int) -> int:
        """Running rows at which a segment of `rows` rows stops to regroup (-1: never)."""
        return stop_live(rows, self.shards, fine=self.fine)

    @property
    def admit_at(self) -> int:
        """Free slots at which a continuous call admits more prompts (with B' pending, at most
        B'*G)."""
        assert self.slots is not None
        return max(self.group, self.slots // ADMIT_SHARE)

    @property
    def smaller_rows(self) -> list[int]:
        """The row buckets below the first state's rows that regrouping can move into."""
        r0 = self.first_rows
        return sorted(r for r in {self.rows_for(n) for n in range(1, r0)} if r < r0)

    def decode_shapes(self, all_buckets: bool = False) -> list[DecodeShape]:
        """The decode segments a call compiles: all first rows at the first and the last cache
        size, and the largest smaller row bucket at the last (`all_buckets`: every pair)."""
        slots = self.cache_sizes
        g0 = 1 if self.continuous else self.group
        out = [DecodeShape(self.first_rows, g0, s)
               for s in (slots if all_buckets else sorted({slots[0], slots[-1]}))]
        smaller = self.smaller_rows
        out += [DecodeShape(r, 1, s) for r in (smaller if all_buckets else smaller[-1:])
                for s in (slots if all_buckets else slots[-1:])]
        return out

    @property
    def grow(self) -> tuple[int, int] | None:
        """(slots before, slots after) of the last cache growth, None when it never grows."""
        slots = self.cache_sizes
        return (slots[-2], slots[-1]) if len(slots) > 1 else None

    @property
    def drop_rows(self) -> int | None:
        """The largest row bucket finished rows are dropped into, None when there is none."""
        smaller = self.smaller_rows
        return smaller[-1] if smaller else None

    @property
    def admit_prompts(self) -> list[int]:
        """The prefill sizes a continuous call's admissions may run (powers of two)."""
        assert self.slots is not None
        most = min(self.prompts, self.slots // self.group)
        return sorted({admit_bucket(n) for n in range(1, most + 1)})

    def programs(self, every: bool = False) -> list[ProgramSpec]:
        """The programs this call may run (`every`), or the largest of each kind (what
        `compile_check` compiles by default): the decode segments of `decode_shapes`, the last
        cache growth of the first rows, their drop into the largest smaller row bucket at the
        last cache size, and a continuous call's largest admission into the last cache size."""
        slots = self.cache_sizes
        last, r0 = slots[-1], self.first_rows
        g0 = 1 if self.continuous else self.group
        out = []
        if self.continuous:
            sizes = self.admit_prompts if every else [self.prefill_prompts]
            out += [ProgramSpec.prefill(nb, "prefill" if nb == self.prefill_prompts
                                        else f"prefill@{nb}") for nb in sizes]
            out.append(ProgramSpec.empty(self.prefill_prompts, r0, self.first_cache, "empty"))
            out += [ProgramSpec.admit(nb, self.group, DecodeShape(r0, 1, s), f"admit@{nb}x{s}")
                    for nb in sizes for s in (slots if every else [last])]
        else:
            out += [ProgramSpec.prefill(self.batch, "prefill"),
                    ProgramSpec.start(self.batch, self.first_cache, "start")]
        out += [ProgramSpec.segment(d, f"decode@{d.rows}x{d.slots}")
                for d in self.decode_shapes(every)]
        bucket_rows = [(r0, g0)] + [(r, 1) for r in self.smaller_rows]
        states = bucket_rows if every else bucket_rows[:1]
        grows = list(zip(slots, slots[1:])) if every else [self.grow] if self.grow else []
        out += [ProgramSpec.regroup(DecodeShape(r, g, s), s2,
                                    label=f"grow@{s2}" if r == r0 else f"grow@{r}x{s2}")
                for r, g in states for s, s2 in grows]
        for r, g in states:
            for r1 in [x for x in self.smaller_rows if x < r][(0 if every else -1):]:
                for s, s2 in (zip(slots, slots[1:] + [last]) if every else [(last, last)]):
                    for cap in sorted({s, s2}):
                        out.append(ProgramSpec.regroup(
                            DecodeShape(r, g, s), cap, rows=r1,
                            label=f"drop@{r1}" if (r, s, cap) == (r0, last, last)
                            else f"drop@{r}x{s}>{r1}x{cap}"))
                out.append(ProgramSpec.gather_rows(
                    r1, r, g, label=f"rows@{r1}" if r == r0 else f"rows@{r}>{r1}"))
        return out

    @functools.cached_property
    def every_program(self) -> frozenset:
        """`programs(every=True)` as a set: what `allows` looks in."""
        return frozenset(self.programs(every=True))

    def allows(self, spec: ProgramSpec) -> bool:
        """Whether `spec` is one of the programs this call may run."""
        return spec in self.every_program
