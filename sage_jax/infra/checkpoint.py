"""Checkpoints of the whole training state with `orbax-checkpoint`: atomic, keep-last-N, exact resume.

Layout: ``<workdir>/checkpoints/<step>/{state,extra}``. ``state`` is any pytree of jax/numpy arrays
(and python scalars) -- in practice the whole `TrainState` -- and ``extra`` is a small JSON dict
(metric-history length, config hash, ...).

Atomicity (what orbax does, and what this module adds)
  * On a local/NFS/GCSFuse filesystem orbax writes a step into ``<step>.orbax-checkpoint-tmp-<ts>``,
    writes ``commit_success.txt`` into it when every array is on disk, and only then renames the
    directory to ``<step>`` (one atomic ``rename``). On ``gs://`` it writes in place and the
    ``commit_success.txt`` file is the commit marker.
  * This module counts a step as *committed* only if ``<step>/commit_success.txt`` exists (orbax's
    own commit-file check, applied when listing steps), so neither a leftover ``*.orbax-checkpoint-tmp-*``
    directory nor a half-copied ``<step>`` directory without the marker is ever picked by
    `latest_step` or `restore`. Leftover temporary directories are removed by the primary process
    when a `Checkpointer` is created (orbax ``cleanup_tmp_directories``; it runs in the background
    and is finished before the first save); an uncommitted ``<step>`` directory is left
    alone until a new save of that same step replaces it.
  * Old steps are pruned (orbax ``LatestN`` preservation policy) only after a newer one is
    committed, so a crash at any moment leaves the previous checkpoint restorable.

Saving is synchronous by default (`save` returns once the step is committed): simple, and a crash
right after `save` returns cannot lose that step. ``async_save=True`` lets orbax copy the arrays to
host memory, return, and write in a background thread; call `wait` before reading the files and
`close` at exit. In both modes it is safe to donate/overwrite the saved arrays once `save` returns.

Multi-host: every process must call `save`, `restore`, `wait` and `close` with the same arguments
(orbax synchronises the processes and has the primary process write metadata and rename
directories; each process writes its own shards). This module adds no barriers of its own.

Typed PRNG keys (``jax.random.key``) are stored as their raw ``key_data`` (uint32) and re-wrapped
with the target's key implementation on restore, so the PRNG stream resumes exactly.

Corruption (a truncated copy, a disk error, a flipped bit)
  * When a step is committed, the primary process writes ``<step>/sage_checksums.json``: the size
    and CRC-32 of every file of the step. `verify` compares them, so a flipped byte that still
    parses is caught, not only the files that orbax / TensorStore fail to read.
  * `restore_latest_good` tries the newest step first; a step that fails `verify` or whose
    arrays do not read is moved aside to ``<step>.corrupt`` (never deleted) with one line saying
    why, and the next older step is tried. A step that does not fit the target (another config)
    is a `CheckpointMismatchError`, never moved. `set_aside_after(n)` moves the steps after n to
    ``<step>.superseded`` (resuming from a chosen step).
"""

from __future__ import annotations

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
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils
from orbax.checkpoint.checkpoint_managers import preservation_policy as ocp_preservation

__all__ = ["Checkpointer", "CheckpointError", "CheckpointMismatchError", "COMMIT_FILE"]

log = logging.getLogger(__name__)

STATE_ITEM = "state"
EXTRA_ITEM = "extra"
# The marker orbax writes into a step directory once the step is completely written.
COMMIT_FILE = ocp.path.atomicity_types.COMMIT_SUCCESS_FILE
TMP_SUFFIX = ocp.path.atomicity_types.TMP_DIR_SUFFIX
CHECKSUM_FILE = "sage_checksums.json"  # sizes and CRC-32s of a committed step's files
_MAX_LISTED = 8


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved or restored; the message names the directory."""


class CheckpointMismatchError(CheckpointError, ValueError):
    """The checkpoint on disk does not have the structure/shapes of the restore target."""


# ----------------------------------------------------------------------------- PRNG key handling


def _is_typed_key(x: Any) -> bool:
    dtype = getattr(x, "dtype", None)
    return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def _key_impl(x: Any) -> Any:
    """The PRNG implementation of a typed key array or of a ShapeDtypeStruct with a key dtype."""
    if isinstance(x, jax.Array):
        return jax.random.key_impl(x)
    impl = getattr(x.dtype, "_impl", None)  # jax keeps the impl on the key dtype
    if impl is None:  # pragma: no cover - depends on jax internals
        raise CheckpointError(
            f"cannot tell the PRNG implementation of abstract key {x}; pass a concrete key "
            "(e.g. jax.random.key(0)) in the restore target instead"
        )
    return impl


def _keys_to_data(tree: Any) -> Any:
    """Replaces typed PRNG key leaves by their uint32 key data (what is written to disk)."""
    return jax.tree.map(lambda x: jax.random.key_data(x) if _is_typed_key(x) else x, tree)


# ----------------------------------------------------------------------------- restore targets


def _abstract_leaf(x: Any) -> Any:
    """Target leaf -> what orbax restores into (shape, dtype, sharding; typed keys as key data)."""
    if isinstance(x, jax.Array) and not _is_typed_key(x):
        # Only metadata is read, so a donated (deleted) target array is fine.
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
    if isinstance(x, (jax.Array, jax.ShapeDtypeStruct)):
        sharding = x.sharding
        if _is_typed_key(x):
            data = jax.eval_shape(jax.random.key_data, x)
            # Key data has extra trailing dims; a NamedSharding's spec leaves them replicated.
            ok = isinstance(
                sharding, (jax.sharding.NamedSharding, jax.sharding.SingleDeviceSharding)
            )
            sharding = sharding if ok else _default_sharding()
            return jax.ShapeDtypeStruct(data.shape, data.dtype, sharding=sharding)
        if sharding is None:
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=_default_sharding())
        return x
    if isinstance(x, (np.ndarray, np.generic, int, float, bool)):
        return x  # restored as numpy / python scalar, like the target
    raise CheckpointError(
        f"unsupported restore-target leaf of type {type(x).__name__}: targets must hold jax "
        "arrays, jax.ShapeDtypeStruct, numpy arrays or python scalars"
    )


def _default_sharding() -> jax.sharding.Sharding:
    """Fully replicated over all devices (for abstract target leaves that give no sharding)."""
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()), ("_all",))
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())


def _rewrap_keys(restored: Any, target: Any) -> Any:
    def fix(r: Any, t: Any) -> Any:
        if _is_typed_key(t):
            return jax.random.wrap_key_data(r, impl=_key_impl(t))
        return r

    return jax.tree.map(fix, restored, target)


def _path_str(key: tuple) -> str:
    return "/".join(str(k) for k in key)


def _listing(keys: list) -> str:
    shown = ", ".join(repr(_path_str(k)) for k in keys[:_MAX_LISTED])
    more = f" (+{len(keys) - _MAX_LISTED} more)" if len(keys) > _MAX_LISTED else ""
    return f"[{shown}]{more}"


def _check_structure(saved_tree: Any, abstract: Any, where: Path) -> None:
    """Raises CheckpointMismatchError naming the keys that differ between disk and target."""
    saved = ocp.tree.to_flat_dict(saved_tree)
    wanted = ocp.tree.to_flat_dict(ocp.tree.serialize_tree(abstract, keep_empty_nodes=True))
    # Empty containers (e.g. optax EmptyState) show up as None / empty nodes on both sides.
    saved = {k: v for k, v in saved.items() if v is not None and not _is_empty_node(v)}
    wanted = {k: v for k, v in wanted.items() if v is not None and not _is_empty_node(v)}
    missing = sorted(set(wanted) - set(saved))
    unexpected = sorted(set(saved) - set(wanted))
    shapes = []
    for k in sorted(set(saved) & set(wanted)):
        s_shape = getattr(saved[k], "shape", None)
        w_shape = np.shape(wanted[k]) if not hasattr(wanted[k], "shape") else wanted[k].shape
        if s_shape is not None and tuple(s_shape) != tuple(w_shape):
            shapes.append(f"{_path_str(k)!r}: checkpoint {tuple(s_shape)} vs target {tuple(w_shape)}")
    if not (missing or unexpected or shapes):
        return
    parts = [f"checkpoint {where} does not match the restore target:"]
    if missing:
        parts.append(f"  keys in the target but not in the checkpoint: {_listing(missing)}")
    if unexpected:
        parts.append(f"  keys in the checkpoint but not in the target: {_listing(unexpected)}")
    if shapes:
        more = f" (+{len(shapes) - _MAX_LISTED} more)" if len(shapes) > _MAX_LISTED else ""
        parts.append("  shape mismatches: " + "; ".join(shapes[:_MAX_LISTED]) + more)
    raise CheckpointMismatchError("\n".join(parts))


def _is_empty_node(v: Any) -> bool:
    return isinstance(v, (dict, list, tuple)) and len(v) == 0


def _one_line(text: str, limit: int = 200) -> str:
    """The first line of an error message, at most `limit` characters."""
    line = text.strip().splitlines()[0] if text.strip() else "unknown error"
    return line if len(line) <= limit else line[:limit - 3] + "..."


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

    drop.drops_closed_loop_errors = True
    sys.unraisablehook = drop


def _file_sums(step_dir: Path) -> dict[str, list[int]]:
    """{relative path: [size, crc32]} of every file of a step directory but the checksum file."""
    out = {}
    for f in sorted(step_dir.rglob("*")):
        if not f.is_file() or f.name == CHECKSUM_FILE:
            continue
        crc = 0
        with open(f, "rb") as fh:
            while chunk := fh.read(1 << 24):
                crc = zlib.crc32(chunk, crc)
        out[str(f.relative_to(step_dir))] = [f.stat().st_size, crc]
    return out


# ----------------------------------------------------------------------------- the checkpointer


class Checkpointer:
    """Saves and restores a state pytree under ``<workdir>/checkpoints/<step>``, keeping the last N.

    Args:
      workdir: run directory; checkpoints go to ``workdir/checkpoints``.
      keep: how many of the most recent committed steps to keep (>= 1).
      async_save: write in a background thread (see module docstring); default synchronous.
    """

    def __init__(self, workdir: str | Path, *, keep: int, async_save: bool = False,
                 checksums: bool = True):
        if keep < 1:
            raise ValueError(f"Checkpointer(keep={keep}): keep must be >= 1")
        # orbax needs an absolute path (a relative workdir such as runs/x fails at save time).
        self.directory = Path(workdir).absolute() / "checkpoints"
        self.keep = keep
        self.async_save = async_save
        self.checksums = checksums
        self._unsummed: list[int] = []  # committed (or committing) steps without checksums yet
        # Count a step as committed only when its commit marker exists (orbax writes the marker
        # under both atomicity protocols; see module docstring).
        name_format = ocp.path.step.standard_name_format(
            temporary_path_cls=ocp.path.atomicity.CommitFileTemporaryPath
        )
        options = ocp.CheckpointManagerOptions(
            preservation_policy=ocp_preservation.LatestN(n=keep),
            enable_async_checkpointing=async_save,
            cleanup_tmp_directories=True,
            step_name_format=name_format,
            create=True,
        )
        self._mgr = ocp.CheckpointManager(
            self.directory,
            item_handlers={
                STATE_ITEM: ocp.StandardCheckpointHandler(),
                EXTRA_ITEM: ocp.JsonCheckpointHandler(),
            },
            options=options,
        )
        self._warn_uncommitted()

    # -- queries

    def all_steps(self) -> list[int]:
        """Committed steps on disk, ascending."""
        return sorted(self._mgr.all_steps())

    def latest_step(self) -> int | None:
        """The newest committed step, or None when there is none."""
        return self._mgr.latest_step()

    def step_dir(self, step: int) -> Path:
        return self.directory / str(step)

    def _uncommitted(self) -> list[Path]:
        if not self.directory.is_dir():
            return []
        return sorted(
            p for p in self.directory.iterdir()
            if p.is_dir() and p.name.isdigit() and not (p / COMMIT_FILE).exists()
        )

    def _warn_uncommitted(self) -> None:
        for p in self._uncommitted():
            log.warning(
                "ignoring uncommitted checkpoint directory %s (no %s: an interrupted save or "
                "copy); it is replaced if that step is saved again", p, COMMIT_FILE,
            )

    # -- save

    def save(
        self,
        step: int,
        state: Any,
        *,
        extra: dict | None = None,
        force: bool = False,
    ) -> bool:
        """Saves ``state`` (any pytree of arrays) and ``extra`` (a small JSON dict) as ``step``.

        Returns True if a checkpoint was written. Saving a step that is already committed is a
        no-op returning False unless ``force`` (then the old one is replaced). Saving a step older
        than the latest committed one raises unless ``force`` (it would be pruned out of order).
        All processes must call this with the same arguments.
        """
        step = int(step)
        extra = {} if extra is None else dict(extra)
        try:
            json.dumps(extra, allow_nan=False)
        except (TypeError, ValueError) as e:
            raise CheckpointError(
                f"checkpoint extra metadata for step {step} must be plain JSON "
                f"(str/int/float/bool/None, lists, dicts): {e}"
            ) from e
        latest = self.latest_step()
        if step in self._mgr.all_steps():
            if not force:
                log.warning("checkpoint %s already exists; not saving again", self.step_dir(step))
                return False
            self._mgr.wait_until_finished()
            self._mgr.delete(step)
        elif latest is not None and step < latest and not force:
            raise CheckpointError(
                f"cannot save step {step} into {self.directory}: it is older than the latest "
                f"checkpoint (step {latest}). Use a fresh workdir, delete the newer steps, or "
                "pass force=True."
            )
        stale = self.step_dir(step)
        if stale.exists() and jax.process_index() == 0:
            # An uncommitted leftover of this step (an interrupted copy); orbax's own
            # save-start barrier orders this removal before any process writes the step.
            log.warning("removing uncommitted checkpoint directory %s before saving", stale)
            shutil.rmtree(stale)
        args = ocp.args.Composite(
            **{
                STATE_ITEM: ocp.args.StandardSave(_keys_to_data(state)),
                EXTRA_ITEM: ocp.args.JsonSave(extra),
            }
        )
        _drop_closed_loop_errors()
        try:
            saved = self._mgr.save(step, args=args, force=True)
            if saved:
                self._unsummed.append(step)
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
                f"{why}{type(e).__name__}: {_one_line(str(e), 400)}"
            ) from e
        return bool(saved)

    def _settle(self) -> None:
        """Joins orbax's writer threads after a failed save, so that they neither print over the
        error nor raise it a second time when the checkpointer is closed, and mutes the echoes of
        the same failure that its abandoned tasks print when they are garbage-collected."""
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
        for step in steps:
            where = self.step_dir(step)
            if not (where / COMMIT_FILE).exists():
                continue
            tmp = where / (CHECKSUM_FILE + ".tmp")
            tmp.write_text(json.dumps({"crc32": _file_sums(where)}))
            os.replace(tmp, where / CHECKSUM_FILE)

    def verify(self, step: int) -> str | None:
        """None when the files of `step` match the checksums written at its commit (or it has
        none), else why not, naming the file."""
        where = self.step_dir(step)
        sums_file = where / CHECKSUM_FILE
        if not sums_file.is_file():
            return None
        try:
            want = json.loads(sums_file.read_text())["crc32"]
        except (ValueError, KeyError, TypeError) as e:
            return f"{sums_file} is unreadable ({type(e).__name__})"
        got = _file_sums(where)
        for name, (size, crc) in want.items():
            if name not in got:
                return f"file {name} is missing"
            if got[name][0] != size:
                return f"file {name} has {got[name][0]} bytes, {size} when saved"
            if got[name][1] != crc:
                return f"file {name} does not match its checksum (changed since it was saved)"
        return None

    # -- restore

    def restore(self, step: int | None = None, *, target: Any) -> tuple[Any, dict]:
        """Restores ``step`` (default: the latest committed one) into the structure of ``target``.

        ``target`` is the concrete or abstract state (jax arrays, ``jax.ShapeDtypeStruct``s, numpy
        arrays or python scalars): the result has its pytree structure, dtypes (values are cast
        if the checkpoint's dtype differs) and shardings (abstract leaves without a sharding are
        restored fully replicated). Typed PRNG keys come back as typed keys of the target's
        implementation. Returns ``(state, extra)``.
        """
        self.wait()
        if step is None:
            step = self.latest_step()
            if step is None:
                raise CheckpointError(f"no committed checkpoint in {self.directory}")
        step = int(step)
        where = self.step_dir(step)
        if step not in self._mgr.all_steps():
            if where.exists():
                raise CheckpointError(
                    f"checkpoint {where} is incomplete (no {COMMIT_FILE}: an interrupted save "
                    f"or copy); committed steps: {self.all_steps()}"
                )
            raise CheckpointError(
                f"no checkpoint for step {step} in {self.directory}; committed steps: "
                f"{self.all_steps()}"
            )
        abstract = jax.tree.map(_abstract_leaf, target)
        try:
            meta = self._mgr.item_metadata(step)
            saved_tree = getattr(meta[STATE_ITEM], "tree", None) if meta is not None else None
        except Exception as e:  # unreadable metadata: let the restore below report it
            log.debug("could not read metadata of %s: %s", where, e)
            saved_tree = None
        if saved_tree is not None:
            _check_structure(saved_tree, abstract, where)
        args = ocp.args.Composite(
            **{
                STATE_ITEM: ocp.args.StandardRestore(abstract),
                EXTRA_ITEM: ocp.args.JsonRestore(),
            }
        )
        try:
            out = self._mgr.restore(step, args=args)
        except Exception as e:
            raise CheckpointError(
                f"restoring checkpoint {where} failed: {type(e).__name__}: {e}"
            ) from e
        state = _rewrap_keys(out[STATE_ITEM], target)
        extra = out[EXTRA_ITEM] or {}
        return state, dict(extra)

    def restore_subtree(self, step: int, key: str) -> Any:
        """The state's top-level entry `key` (e.g. "params") of committed `step`, read alone (the
        rest of the state is not read and needs no target): a nested dict of arrays with the
        saved dtypes, on this process's first device."""
        self.wait()
        where = self.step_dir(step)
        if int(step) not in self._mgr.all_steps():
            raise CheckpointError(f"no committed checkpoint for step {step} in {self.directory}; "
                                  f"committed steps: {self.all_steps()}")
        reader = ocp.PyTreeCheckpointer()
        try:
            saved = self._mgr.item_metadata(int(step))[STATE_ITEM].tree
            if key not in saved:
                raise CheckpointError(f"checkpoint {where} has no {key!r} (it holds "
                                      f"{sorted(saved)})")
            device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
            item = {key: jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype),
                                      saved[key])}
            args = jax.tree.map(lambda _: ocp.ArrayRestoreArgs(restore_type=jax.Array,
                                                               sharding=device), item)
            out = reader.restore(where / STATE_ITEM, args=ocp.args.PyTreeRestore(
                item=item, restore_args=args, partial_restore=True))
        except CheckpointError:
            raise
        except Exception as e:
            raise CheckpointError(
                f"restoring {key!r} of checkpoint {where} failed: {type(e).__name__}: {e}"
            ) from e
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
                    state, extra = self.restore(step, target=target)
                    return state, extra, step
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
        dst = src.with_name(f"{step}.{why}")
        n = 1
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

    # -- lifecycle

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

    def __repr__(self) -> str:
        return f"Checkpointer({str(self.directory)!r}, keep={self.keep}, steps={self.all_steps()})"
