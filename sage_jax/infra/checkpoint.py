"""Checkpoints of the whole training state: orbax's `CheckpointManager`, plus what it lacks.

Layout: ``<workdir>/checkpoints/<step>/{state,extra}``; ``state`` is a pytree of jax/numpy arrays
and python scalars (typed PRNG keys included: orbax stores their key data and implementation),
``extra`` a small JSON dict.

From orbax: atomic saves (a step is written into ``<step>.orbax-checkpoint-tmp-*`` and renamed
once complete; leftovers are removed when a `Checkpointer` is created), keep-last-N (older steps
pruned only after a newer one is committed), the latest step, async saves (``async_save=True``:
call `wait` before reading the files), and multi-host saves and restores (every process calls
every method with the same arguments; each writes its own shards).

Added here:
  * A step counts only once ``<step>/commit_success.txt`` exists, so a half-copied ``<step>``
    directory is never restored; saving that step again replaces it.
  * At commit, the primary process writes ``<step>/sage_checksums.json`` (size and CRC-32 of
    every file). `restore_latest_good` tries the newest step first; one that fails `verify` or
    does not read is moved aside to ``<step>.corrupt`` (never deleted) and the one before is
    tried. A target that does not fit (another config) is a `CheckpointMismatchError`.
  * Errors in one line that name the directory (and say so when the disk is full).
  * `fingerprint`: the identity of a set of weights (e.g. the frozen base a LoRA checkpoint's
    adapters belong to), computed where the arrays are, and `size_bytes` of a committed step.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import sys
import warnings
import zlib
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils
from orbax.checkpoint.checkpoint_managers import preservation_policy as ocp_preservation

log = logging.getLogger(__name__)

STATE_ITEM, EXTRA_ITEM = "state", "extra"
COMMIT_FILE = ocp.path.atomicity_types.COMMIT_SUCCESS_FILE  # orbax's "step is complete" marker
TMP_SUFFIX = ocp.path.atomicity_types.TMP_DIR_SUFFIX
CHECKSUM_FILE = "sage_checksums.json"  # sizes and CRC-32s of a committed step's files
_MAX_LISTED = 8


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved or restored; the message names the directory."""


class CheckpointMismatchError(CheckpointError, ValueError):
    """The checkpoint on disk does not have the structure/shapes of the restore target."""


def _is_typed_key(x: Any) -> bool:
    dtype = getattr(x, "dtype", None)
    return dtype is not None and jnp.issubdtype(dtype, jax.dtypes.prng_key)


def _rewrap_keys(restored: Any, target: Any) -> Any:
    """Typed keys of a checkpoint written before orbax recorded key types (saved as raw key
    data) wrapped with the target's implementation."""
    def fix(r: Any, t: Any) -> Any:
        old = _is_typed_key(t) and not _is_typed_key(r)
        return jax.random.wrap_key_data(r, impl=getattr(t.dtype, "_impl")) if old else r

    return jax.tree.map(fix, restored, target)


def _listed(items: list[str], sep: str = ", ") -> str:
    more = f" (+{len(items) - _MAX_LISTED} more)" if len(items) > _MAX_LISTED else ""
    return sep.join(items[:_MAX_LISTED]) + more


def _shapes(tree: Any) -> dict[str, tuple]:
    """{'a/b': shape} of the leaves of a (serialized) tree, empty nodes left out."""
    out = {}
    for k, v in ocp.tree.to_flat_dict(tree).items():
        if v is not None and not (isinstance(v, (dict, list, tuple)) and not v):
            out["/".join(map(str, k))] = _shape(v)
    return out


def _shape(v: Any) -> tuple:
    return tuple(v.shape) if hasattr(v, "shape") else tuple(np.shape(v))


def _check_fits(saved_tree: Any, target: Any, where: Path) -> None:
    """Raises CheckpointMismatchError naming the keys and shapes that differ between the
    checkpoint's metadata and `target`."""
    stored = jax.tree.map(  # typed keys are stored as their key data
        lambda x: jax.eval_shape(jax.random.key_data, x) if _is_typed_key(x) else x, target)
    disk = _shapes(saved_tree)
    want = _shapes(ocp.tree.serialize_tree(stored, keep_empty_nodes=True))
    missing = [repr(k) for k in sorted(set(want) - set(disk))]
    unexpected = [repr(k) for k in sorted(set(disk) - set(want))]
    shapes = [f"{k!r}: checkpoint {disk[k]} vs target {want[k]}"
              for k in sorted(set(disk) & set(want)) if disk[k] != want[k]]
    parts = [f"checkpoint {where} does not match the restore target:"]
    if missing:
        parts.append(f"  keys in the target but not in the checkpoint: [{_listed(missing)}]")
    if unexpected:
        parts.append(f"  keys in the checkpoint but not in the target: [{_listed(unexpected)}]")
    if shapes:
        parts.append(f"  shape mismatches: {_listed(shapes, '; ')}")
    if len(parts) > 1:
        raise CheckpointMismatchError("\n".join(parts))


def _one_line(text: str, limit: int = 200) -> str:
    """The first line of an error message, at most `limit` characters."""
    line = text.strip().splitlines()[0] if text.strip() else "unknown error"
    return line if len(line) <= limit else line[:limit - 3] + "..."


_MIX = (0x9E3779B1, 0x85EBCA6B, 0xC2B2AE35)  # odd 32-bit constants (golden ratio, murmur3)


def _leaf_sums(x: jax.Array) -> jax.Array:
    """Two position-weighted sums (uint32, wrapping) of a leaf's bits: sum(bits * odd weight)
    and sum(murmur3-mixed bits + position). Integer sums are exact in any order, so a sharded
    leaf gives the value its one-device copy gives."""
    u32 = jnp.uint32
    width = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[jnp.dtype(x.dtype).itemsize]
    bits = jax.lax.bitcast_convert_type(x, width).astype(u32)
    pos, stride = jnp.zeros(x.shape, u32), 1
    for axis in reversed(range(x.ndim)):
        pos, stride = pos + jax.lax.broadcasted_iota(u32, x.shape, axis) * u32(stride), \
            stride * x.shape[axis] % 2**32
    h = bits + pos * u32(_MIX[0])
    h = (h ^ (h >> 16)) * u32(_MIX[1])
    h = (h ^ (h >> 13)) * u32(_MIX[2])
    h = h ^ (h >> 16)
    return jnp.stack([jnp.sum(bits * (pos * u32(_MIX[0]) | u32(1)), dtype=u32),
                      jnp.sum(h, dtype=u32)])


def fingerprint(tree: Any) -> str:
    """sha256 (hex) of a pytree's leaf paths, shapes, dtypes and two 32-bit checksums of each
    leaf's bits (`_leaf_sums`), computed on the arrays' devices: the same for the same values
    on one device or sharded over many, without gathering them on one host. A changed element
    always changes the first checksum; distinct weights collide with a chance of about 2^-64
    a leaf. Not a cryptographic hash: it tells weights apart, it does not authenticate them."""
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    sums = jax.device_get(jax.jit(lambda xs: [_leaf_sums(x) for x in xs])([x for _, x in flat]))
    h = hashlib.sha256()
    for (path, x), (a, b) in zip(flat, sums):
        h.update(f"{jax.tree_util.keystr(path)} {tuple(x.shape)} {jnp.dtype(x.dtype).name} "
                 f"{int(a)} {int(b)}\n".encode())
    return h.hexdigest()


def _drop_closed_loop_errors() -> None:
    """Drops, for the rest of the process, the unraisable "Event loop is closed" errors that
    orbax's writer threads raise after a failed write closed their event loop: hundreds of
    tracebacks that would bury the real error, some printed after it."""
    hook = sys.unraisablehook
    if getattr(hook, "drops_closed_loop_errors", False):
        return

    def drop(unraisable):
        if not (isinstance(unraisable.exc_value, RuntimeError)
                and str(unraisable.exc_value) == "Event loop is closed"):
            hook(unraisable)

    setattr(drop, "drops_closed_loop_errors", True)
    sys.unraisablehook = drop


def _file_sums(step_dir: Path) -> dict[str, list[int]]:
    """{relative path: [size, crc32]} of every file of a step directory but the checksum file."""
    out = {}
    for f in sorted(step_dir.rglob("*")):
        if f.is_file() and f.name != CHECKSUM_FILE:
            crc = 0
            with open(f, "rb") as fh:
                while chunk := fh.read(1 << 24):
                    crc = zlib.crc32(chunk, crc)
            out[str(f.relative_to(step_dir))] = [f.stat().st_size, crc]
    return out


class Checkpointer:
    """Saves and restores a state pytree under ``<workdir>/checkpoints/<step>``, keeping the last
    `keep` committed steps; ``async_save`` writes in a background thread; ``checksums`` writes
    the checksum file of each step."""

    def __init__(self, workdir: str | Path, *, keep: int, async_save: bool = False,
                 checksums: bool = True):
        if keep < 1:
            raise ValueError(f"Checkpointer(keep={keep}): keep must be >= 1")
        self.directory = Path(workdir).absolute() / "checkpoints"  # orbax needs it absolute
        self.async_save, self.checksums = async_save, checksums
        self._unsummed: list[int] = []  # committed (or committing) steps without checksums yet
        options = ocp.CheckpointManagerOptions(
            preservation_policy=ocp_preservation.LatestN(n=keep),
            enable_async_checkpointing=async_save, cleanup_tmp_directories=True, create=True,
            step_name_format=ocp.path.step.standard_name_format(  # committed = has COMMIT_FILE
                temporary_path_cls=ocp.path.atomicity.CommitFileTemporaryPath))
        self._mgr = ocp.CheckpointManager(self.directory, options=options, item_handlers={
            STATE_ITEM: ocp.StandardCheckpointHandler(), EXTRA_ITEM: ocp.JsonCheckpointHandler()})

    def all_steps(self) -> list[int]:
        """Committed steps on disk, ascending."""
        return sorted(self._mgr.all_steps())

    def latest_step(self) -> int | None:
        """The newest committed step, or None when there is none."""
        return self._mgr.latest_step()

    def step_dir(self, step: int) -> Path:
        return self.directory / str(step)

    def _committed(self, step: int) -> int:
        """`step` as an int; a CheckpointError when it is not a committed step."""
        step = int(step)
        if step not in self.all_steps():
            why = (f"checkpoint {self.step_dir(step)} is incomplete (no {COMMIT_FILE}: an "
                   f"interrupted save or copy)" if self.step_dir(step).exists() else
                   f"no checkpoint for step {step} in {self.directory}")
            raise CheckpointError(f"{why}; committed steps: {self.all_steps()}")
        return step

    def save(self, step: int, state: Any, *, extra: dict | None = None,
             force: bool = False) -> bool:
        """Saves ``state`` (any pytree of arrays) and ``extra`` (a small JSON dict) as ``step``.

        Returns True if a checkpoint was written. Saving a step that is already committed is a
        no-op returning False unless ``force`` (then the old one is replaced). Saving a step older
        than the latest committed one raises unless ``force`` (it would be pruned out of order).
        """
        step, extra = int(step), dict(extra or {})
        try:
            json.dumps(extra, allow_nan=False)
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"checkpoint extra metadata for step {step} must be plain "
                                  f"JSON (str/int/float/bool/None, lists, dicts): {e}") from e
        latest = self.latest_step()
        if step in self.all_steps():
            if not force:
                log.warning("checkpoint %s already exists; not saving again", self.step_dir(step))
                return False
            self._mgr.wait_until_finished()
            self._mgr.delete(step)
        elif latest is not None and step < latest and not force:
            raise CheckpointError(
                f"cannot save step {step} into {self.directory}: it is older than the latest "
                f"checkpoint (step {latest}). Use a fresh workdir, delete the newer steps, or "
                "pass force=True.")
        if self.step_dir(step).exists() and jax.process_index() == 0:
            # An uncommitted leftover of this step; orbax's save-start barrier orders this
            # removal before any process writes the step.
            log.warning("removing uncommitted checkpoint directory %s", self.step_dir(step))
            shutil.rmtree(self.step_dir(step))
        _drop_closed_loop_errors()
        try:
            saved = self._mgr.save(step, force=True, args=ocp.args.Composite(**{
                STATE_ITEM: ocp.args.StandardSave(state), EXTRA_ITEM: ocp.args.JsonSave(extra)}))
            self._unsummed += [step] if saved else []
            if not self.async_save:
                self.wait()  # a failed write may surface only here, when its commit is awaited
        except Exception as e:
            self._unsummed = [s for s in self._unsummed if s != step]
            self._settle()
            full = any(m in str(e) for m in ("No space left", "File too large", "Disk quota"))
            why = "The disk is full (or a file-size limit was hit): " if full else ""
            kept = (f"the last good checkpoint (step {latest}) is intact" if latest is not None
                    else "no earlier checkpoint exists")
            raise CheckpointError(
                f"saving checkpoint step {step} to {self.step_dir(step)} failed; {kept}. "
                f"{why}{type(e).__name__}: {_one_line(str(e), 400)}") from e
        return bool(saved)

    def _settle(self) -> None:
        """Joins orbax's writer threads after a failed save, so that they neither print over the
        error nor raise it a second time at close, and mutes the echoes of the same failure that
        its abandoned tasks print when they are garbage-collected."""
        try:
            self._mgr.wait_until_finished()
        except Exception:  # the failure being reported by the caller
            pass
        logging.getLogger("asyncio").setLevel(logging.CRITICAL)
        warnings.filterwarnings("ignore", r"coroutine .* was never awaited", RuntimeWarning)

    def _write_checksums(self) -> None:
        """The checksum files of the steps committed since the last call (primary process)."""
        steps, self._unsummed = self._unsummed, []
        if not self.checksums or jax.process_index() != 0:
            return
        for where in (self.step_dir(s) for s in steps):
            if (where / COMMIT_FILE).exists():
                tmp = where / (CHECKSUM_FILE + ".tmp")
                tmp.write_text(json.dumps({"crc32": _file_sums(where)}))
                os.replace(tmp, where / CHECKSUM_FILE)

    def verify(self, step: int) -> str | None:
        """None when the files of `step` match the checksums written at its commit (or it has
        none), else why not, naming the file."""
        sums_file = self.step_dir(step) / CHECKSUM_FILE
        if not sums_file.is_file():
            return None
        try:
            want = json.loads(sums_file.read_text())["crc32"]
        except (ValueError, KeyError, TypeError) as e:
            return f"{sums_file} is unreadable ({type(e).__name__})"
        got = _file_sums(self.step_dir(step))
        for name, (size, crc) in want.items():
            if name not in got:
                return f"file {name} is missing"
            if got[name][0] != size:
                return f"file {name} has {got[name][0]} bytes, {size} when saved"
            if got[name][1] != crc:
                return f"file {name} does not match its checksum (changed since it was saved)"
        return None

    def restore(self, step: int | None = None, *, target: Any) -> tuple[Any, dict]:
        """(state, extra) of ``step`` (default: the latest committed one).

        ``target`` is the concrete or abstract state (jax arrays, ``jax.ShapeDtypeStruct``s, numpy
        arrays or python scalars): the result has its pytree structure, dtypes (values are cast)
        and shardings (an abstract leaf without one takes the saved sharding, or is replicated
        when that does not fit the devices).
        """
        self.wait()
        if step is None and (step := self.latest_step()) is None:
            raise CheckpointError(f"no committed checkpoint in {self.directory}")
        step, where = self._committed(step), self.step_dir(step)
        try:
            saved_tree = self._mgr.item_metadata(step)[STATE_ITEM].tree
        except Exception as e:  # unreadable metadata: let the restore below report it
            log.debug("could not read metadata of %s: %s", where, e)
        else:
            _check_fits(saved_tree, target, where)
        everywhere = jax.sharding.NamedSharding(
            jax.sharding.Mesh(np.asarray(jax.devices()), ("_all",)), jax.sharding.PartitionSpec())
        try:
            out = self._mgr.restore(step, args=ocp.args.Composite(**{
                STATE_ITEM: ocp.args.StandardRestore(target, fallback_sharding=everywhere),
                EXTRA_ITEM: ocp.args.JsonRestore()}))
        except Exception as e:
            raise CheckpointError(f"restoring checkpoint {where} failed: {type(e).__name__}: "
                                  f"{e}") from e
        return _rewrap_keys(out[STATE_ITEM], target), dict(out[EXTRA_ITEM] or {})

    def extra(self, step: int) -> dict:
        """The `extra` JSON dict saved with committed `step` (the state is not read)."""
        self.wait()
        step = self._committed(step)
        try:
            out = self._mgr.restore(step, args=ocp.args.Composite(**{
                EXTRA_ITEM: ocp.args.JsonRestore()}))
        except Exception as e:
            raise CheckpointError(f"reading the metadata of checkpoint {self.step_dir(step)} "
                                  f"failed: {type(e).__name__}: {_one_line(str(e))}") from e
        return dict(out[EXTRA_ITEM] or {})

    def size_bytes(self, step: int) -> int:
        """Bytes on disk of committed `step` (every file of its directory)."""
        step = self._committed(step)
        return sum(f.stat().st_size for f in self.step_dir(step).rglob("*") if f.is_file())

    def restore_subtree(self, step: int, key: str) -> Any:
        """The state's top-level entry `key` (e.g. "params") of committed `step`, read alone (the
        rest of the state is not read and needs no target): a nested dict of arrays with the
        saved dtypes, on this process's first device."""
        self.wait()
        step, where = self._committed(step), self.step_dir(step)
        try:
            saved = self._mgr.item_metadata(step)[STATE_ITEM].tree
            if key not in saved:
                raise CheckpointError(f"checkpoint {where} has no {key!r} (it holds "
                                      f"{sorted(saved)})")
            device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
            item = {key: jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype),
                                      saved[key])}
            args = jax.tree.map(lambda _: ocp.ArrayRestoreArgs(restore_type=jax.Array,
                                                               sharding=device), item)
            out = ocp.PyTreeCheckpointer().restore(where / STATE_ITEM, args=ocp.args.PyTreeRestore(
                item=item, restore_args=args, partial_restore=True))
        except CheckpointError:
            raise
        except Exception as e:
            raise CheckpointError(f"restoring {key!r} of checkpoint {where} failed: "
                                  f"{type(e).__name__}: {e}") from e
        return out[key]

    def restore_latest_good(self, *, target: Any, report=log.warning
                            ) -> tuple[Any, dict, int] | None:
        """(state, extra, step) of the newest step that verifies and restores into `target`;
        None when there is no committed step. A step that fails is moved to `<step>.corrupt`
        and `report` gets one line (step, file, reason); when none restores, a CheckpointError
        lists what was tried. A `CheckpointMismatchError` (another config) is raised as is."""
        tried = []
        for step in reversed(self.all_steps()):
            reason = self.verify(step)
            if reason is None:
                try:
                    return (*self.restore(step, target=target), step)
                except CheckpointMismatchError:
                    raise
                except CheckpointError as e:
                    reason = _one_line(str(e).split(": ", 1)[-1])
            moved = self.set_aside(step, "corrupt")
            report(f"checkpoint step {step} is corrupt ({reason}); moved it to {moved.name} and "
                   f"trying the one before")
            tried.append(f"step {step}: {reason}")
        if tried:
            raise CheckpointError(f"no checkpoint in {self.directory} restores (each was moved "
                                  f"to <step>.corrupt): " + "; ".join(tried))
        return None

    def set_aside(self, step: int, why: str) -> Path:
        """Renames the directory of `step` to `<step>.<why>` (or `<step>.<why>.<n>`); returns
        the new path. It is no longer a step of this checkpointer."""
        self.wait()
        src = self.step_dir(step)
        dst, n = src.with_name(f"{step}.{why}"), 1
        while dst.exists():
            dst, n = src.with_name(f"{step}.{why}.{n}"), n + 1
        if jax.process_index() == 0:
            os.replace(src, dst)
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices(f"sage_jax set_aside {step}")
        self._mgr.reload()
        return dst

    def set_aside_after(self, step: int) -> list[Path]:
        """Moves every committed step after `step` to `<step>.superseded` (resuming from a
        chosen step); a CheckpointError when `step` itself is not a committed step."""
        if step not in self.all_steps():
            raise CheckpointError(f"train.resume_step={step}: no committed checkpoint for that "
                                  f"step in {self.directory}; committed steps: "
                                  f"{self.all_steps()}")
        return [self.set_aside(s, "superseded") for s in self.all_steps() if s > step]

    def wait(self) -> None:
        """Blocks until a pending asynchronous save is committed (no-op when synchronous), then
        writes its checksums."""
        self._mgr.wait_until_finished()
        self._write_checksums()

    def close(self) -> None:
        """Waits for pending saves and releases orbax resources. All processes must call it."""
        self.wait()
        self._mgr.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
