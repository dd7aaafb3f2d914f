"""Checkpointer: exact round trips, keep-N, shardings, crash safety, clear mismatch errors."""

import shutil

import flax
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

import sage_jax.infra.checkpoint as ckpt_lib
from sage_jax.infra.checkpoint import (
    COMMIT_FILE, Checkpointer, CheckpointError, CheckpointMismatchError,
)


@flax.struct.dataclass
class ToyState:
    params: nnx.State
    opt_state: optax.OptState
    step: jax.Array
    rng: jax.Array
    data_position: int
    sage: dict


class Tiny(nnx.Module):
    def __init__(self, rngs):
        self.lin = nnx.Linear(3, 4, rngs=rngs)
        self.norm = nnx.RMSNorm(4, rngs=rngs)


def make_state(seed: int) -> ToyState:
    params = nnx.state(Tiny(nnx.Rngs(seed)), nnx.Param)
    tx = optax.adamw(1e-3)
    opt_state = tx.init(params)
    # One real update so mu/nu/count are non-trivial.
    grads = jax.tree.map(lambda p: jnp.full_like(p, 0.5 + seed), params)
    _, opt_state = tx.update(grads, opt_state, params)
    f32 = jnp.array([1.5, -0.0, np.nan, np.inf, -np.inf, 1e-45, seed], jnp.float32)
    return ToyState(
        params=params,
        opt_state=opt_state,
        step=jnp.int32(10 + seed),
        rng=jax.random.fold_in(jax.random.key(seed), 7),  # typed key
        data_position=123 + seed,
        sage={
            "f32": f32,
            "bf16": (jnp.arange(6, dtype=jnp.float32) / 3 + seed).astype(jnp.bfloat16),
            "level": jnp.array([0, 1, 2, 3, -1], jnp.int8) + seed,
            "seen": jnp.array([True, False, True, bool(seed % 2)]),
            "hint_ids": np.arange(8, dtype=np.uint8).reshape(2, 4) + seed,  # numpy leaf
            "raw_key": jax.random.PRNGKey(seed + 100),  # legacy uint32[2] key
            "rbg_keys": jax.random.split(jax.random.key(seed, impl="rbg"), 3),
        },
    )


def _bits(x):
    if ckpt_lib._is_typed_key(x):
        return ("key", str(jax.random.key_impl(x)), np.asarray(jax.random.key_data(x)).tobytes())
    a = np.asarray(x)
    return (type(x).__name__ if not isinstance(x, jax.Array) else "jax", a.dtype, a.shape, a.tobytes())


def assert_bitwise_equal(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b)):
        assert _bits(x) == _bits(y), jax.tree_util.keystr(path)


@pytest.mark.slow
def test_round_trip_is_bitwise_exact(tmp_path):
    state = make_state(1)
    with Checkpointer(tmp_path, keep=3) as ck:
        assert ck.latest_step() is None
        assert ck.save(11, state, extra={"metrics_lines": 11, "config_hash": "abc"})
    # A fresh Checkpointer (as after a restart) sees the step and restores it exactly.
    with Checkpointer(tmp_path, keep=3) as ck:
        assert ck.latest_step() == 11
        assert (tmp_path / "checkpoints" / "11" / COMMIT_FILE).is_file()
        restored, extra = ck.restore(target=make_state(0))
        assert extra == {"metrics_lines": 11, "config_hash": "abc"}
        assert isinstance(restored, ToyState) and isinstance(restored.params, nnx.State)
        assert restored.data_position == 124 and isinstance(restored.data_position, int)
        assert isinstance(restored.sage["hint_ids"], np.ndarray)
        assert_bitwise_equal(restored, state)
        # The restored typed key continues the same stream.
        assert np.array_equal(
            jax.random.key_data(jax.random.split(restored.rng)),
            jax.random.key_data(jax.random.split(state.rng)),
        )
        # Abstract target (no arrays allocated) gives the same result.
        abstract = jax.eval_shape(lambda: make_state(0))
        abstract = abstract.replace(data_position=0, sage={**abstract.sage, "hint_ids": np.zeros((2, 4), np.uint8)})
        restored2, _ = ck.restore(11, target=abstract)
        assert_bitwise_equal(restored2, state)


def test_keep_last_n_and_latest_step(tmp_path):
    small = {"w": jnp.arange(3.0), "k": jax.random.key(0)}
    with Checkpointer(tmp_path, keep=2) as ck:
        for step in (1, 2, 3, 4):
            assert ck.save(step, jax.tree.map(lambda x: x, {**small, "s": jnp.int32(step)}))
        assert ck.all_steps() == [3, 4] and ck.latest_step() == 4
        assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit()) == ["3", "4"]
        # Same step again: no-op unless forced.
        assert ck.save(4, {**small, "s": jnp.int32(99)}) is False
        assert ck.restore(target={**small, "s": jnp.int32(0)})[0]["s"] == 4
        assert ck.save(4, {**small, "s": jnp.int32(99)}, force=True) is True
        assert ck.restore(target={**small, "s": jnp.int32(0)})[0]["s"] == 99
        # Older than the latest: refused with a clear message.
        with pytest.raises(CheckpointError, match="older than the latest"):
            ck.save(2, {**small, "s": jnp.int32(2)})
        with pytest.raises(CheckpointError, match="no checkpoint for step 1"):
            ck.restore(1, target={**small, "s": jnp.int32(0)})


def test_async_save(tmp_path):
    x = {"a": jnp.arange(5, dtype=jnp.int8)}
    with Checkpointer(tmp_path, keep=1, async_save=True) as ck:
        ck.save(1, x)
        ck.save(2, {"a": x["a"] + 1})
        ck.wait()
        assert ck.all_steps() == [2]
        assert np.array_equal(ck.restore(target=x)[0]["a"], x["a"] + 1)


def test_restore_keeps_target_shardings(tmp_path):
    mesh = jax.make_mesh((2, 4), ("data", "model"))

    def put(x, *spec):
        return jax.device_put(x, NamedSharding(mesh, P(*spec)))

    state = {
        "w": put(jnp.arange(64, dtype=jnp.float32).reshape(8, 8), "data", "model"),
        "b": put(jnp.arange(8, dtype=jnp.bfloat16), "model"),
        "rep": put(jnp.ones((4, 2), jnp.int8), None),
        "keys": put(jax.random.split(jax.random.key(5), 8), "data"),
    }
    with Checkpointer(tmp_path, keep=1) as ck:
        ck.save(1, state)
        zeros = jax.tree.map(lambda x: x if ckpt_lib._is_typed_key(x) else jnp.zeros_like(x), state)
        restored, _ = ck.restore(target=zeros)
        for name in state:
            assert restored[name].sharding.is_equivalent_to(state[name].sharding, state[name].ndim), name
            assert restored[name].sharding.spec == state[name].sharding.spec, name
        assert_bitwise_equal(restored, state)
        # Restoring into a different layout reshards.
        other = {
            "w": jax.ShapeDtypeStruct((8, 8), jnp.float32, sharding=NamedSharding(mesh, P("model", "data"))),
            "b": jax.ShapeDtypeStruct((8,), jnp.bfloat16, sharding=NamedSharding(mesh, P())),
            "rep": jax.ShapeDtypeStruct((4, 2), jnp.int8, sharding=NamedSharding(mesh, P("data"))),
            "keys": jax.ShapeDtypeStruct((8,), state["keys"].dtype, sharding=NamedSharding(mesh, P("model"))),
        }
        resharded, _ = ck.restore(target=other)
        assert resharded["w"].sharding.spec == P("model", "data")
        assert resharded["keys"].sharding.spec == P("model")
        assert_bitwise_equal(resharded, state)


def test_keys_saved_as_raw_key_data_restore_as_the_targets_typed_keys(tmp_path):
    """Checkpoints written before orbax recorded the key type hold raw key data."""
    keys = {"fry": jax.random.key(3), "rbg": jax.random.split(jax.random.key(4, impl="rbg"), 2)}
    target = {"fry": jax.random.key(0), "rbg": jax.random.split(jax.random.key(0, impl="rbg"), 2)}
    with Checkpointer(tmp_path, keep=1) as ck:
        ck.save(1, jax.tree.map(jax.random.key_data, keys))
        assert_bitwise_equal(ck.restore(target=target)[0], keys)


def _two_steps(tmp_path):
    s1, s2 = make_state(1), make_state(2)
    with Checkpointer(tmp_path, keep=3) as ck:
        ck.save(1, s1)
        ck.save(2, s2, extra={"n": 2})
    return s2


def test_leftover_tmp_dir_is_ignored_and_cleaned(tmp_path):
    s2 = _two_steps(tmp_path)
    root = tmp_path / "checkpoints"
    # What a crash mid-save leaves: orbax's temporary directory, half written (no commit marker).
    tmp = root / f"3{ckpt_lib.TMP_SUFFIX}-1700000000"
    shutil.copytree(root / "2", tmp)
    for marker in tmp.rglob(COMMIT_FILE):
        marker.unlink()
    with Checkpointer(tmp_path, keep=3) as ck:
        assert ck.latest_step() == 2
        restored, extra = ck.restore(target=make_state(0))
        assert_bitwise_equal(restored, s2) and extra == {"n": 2}
        assert ck.save(3, make_state(3))  # the next save of step 3 works
        assert not tmp.exists()  # orbax removed the leftover
        assert ck.latest_step() == 3


def test_uncommitted_step_dir_is_ignored(tmp_path):
    s2 = _two_steps(tmp_path)
    root = tmp_path / "checkpoints"
    # A step directory without the commit marker (e.g. an interrupted copy of a run).
    shutil.copytree(root / "2", root / "3")
    (root / "3" / COMMIT_FILE).unlink()
    with Checkpointer(tmp_path, keep=3) as ck:
        assert ck.latest_step() == 2 and ck.all_steps() == [1, 2]
        restored, _ = ck.restore(target=make_state(0))
        assert_bitwise_equal(restored, s2)
        with pytest.raises(CheckpointError, match="incomplete"):
            ck.restore(3, target=make_state(0))
        s3 = make_state(3)
        assert ck.save(3, s3)  # replaces the uncommitted directory
        assert_bitwise_equal(ck.restore(target=make_state(0))[0], s3)


def test_crash_during_save_keeps_previous(tmp_path, monkeypatch):
    s2 = _two_steps(tmp_path)

    async def crash(self, *a, **k):
        raise OSError("simulated crash before the commit rename")

    monkeypatch.setattr(ckpt_lib.ocp.path.atomicity.AtomicRenameTemporaryPath, "finalize", crash)
    ck = Checkpointer(tmp_path, keep=3)
    with pytest.raises(CheckpointError, match="simulated crash"):
        ck.save(3, make_state(3))
    try:
        ck.close()
    except Exception:  # the "crashed" manager may complain while shutting down
        pass
    monkeypatch.undo()
    leftovers = [p for p in (tmp_path / "checkpoints").iterdir() if ckpt_lib.TMP_SUFFIX in p.name]
    assert leftovers, "the simulated crash should leave orbax's temporary directory behind"
    with Checkpointer(tmp_path, keep=3) as ck:
        assert ck.latest_step() == 2
        restored, extra = ck.restore(target=make_state(0))
        assert_bitwise_equal(restored, s2) and extra == {"n": 2}
        assert ck.save(3, make_state(3))
    assert not any(p.exists() for p in leftovers)


def test_structure_mismatch_names_path_and_keys(tmp_path):
    with Checkpointer(tmp_path, keep=1) as ck:
        ck.save(5, {"params": {"w": jnp.zeros((2, 3)), "b": jnp.zeros(3)}, "step": jnp.int32(0)})
        target = {"params": {"w": jnp.zeros((2, 3)), "bias": jnp.zeros(3)}, "step": jnp.int32(0)}
        with pytest.raises(CheckpointMismatchError) as err:
            ck.restore(target=target)
        msg = str(err.value)
        assert str(tmp_path / "checkpoints" / "5") in msg
        assert "'params/bias'" in msg and "'params/b'" in msg
        assert "Traceback" not in msg and len(msg) < 1000
        target = {"params": {"w": jnp.zeros((2, 4)), "b": jnp.zeros(3)}, "step": jnp.int32(0)}
        with pytest.raises(CheckpointMismatchError, match=r"'params/w': checkpoint \(2, 3\) vs target \(2, 4\)"):
            ck.restore(target=target)


def test_bad_inputs(tmp_path):
    with Checkpointer(tmp_path, keep=1) as ck:
        with pytest.raises(CheckpointError, match="no committed checkpoint"):
            ck.restore(target={"a": jnp.zeros(1)})
        with pytest.raises(CheckpointError, match="plain JSON"):
            ck.save(1, {"a": jnp.zeros(1)}, extra={"x": object()})
    with pytest.raises(ValueError, match="keep"):
        Checkpointer(tmp_path, keep=0)


def test_relative_workdir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    state = {"w": np.arange(4, dtype=np.float32)}
    with Checkpointer("runs/rel", keep=1) as ckpt:
        ckpt.save(1, state)
        restored, _ = ckpt.restore(target=state)
    np.testing.assert_array_equal(restored["w"], state["w"])
    assert (tmp_path / "runs" / "rel" / "checkpoints" / "1").is_dir()


def test_the_fingerprint_is_where_the_weights_are_and_tells_any_change_apart():
    """One value for the same weights on one device or sharded over the mesh; another for one
    element one ulp away, two elements swapped, another dtype or another leaf name."""
    rng = np.random.default_rng(0)
    w = {"a": jnp.asarray(rng.standard_normal((8, 6)), jnp.float32),
         "b": jnp.asarray(rng.standard_normal((16,)), jnp.bfloat16)}
    fp = ckpt_lib.fingerprint(w)
    mesh = jax.make_mesh((len(jax.devices()),), ("d",))
    sharded = {"a": jax.device_put(w["a"], NamedSharding(mesh, P("d"))),
               "b": jax.device_put(w["b"], NamedSharding(mesh, P("d")))}
    assert len(sharded["a"].sharding.device_set) == len(jax.devices()) > 1
    assert ckpt_lib.fingerprint(sharded) == fp
    a = np.asarray(w["a"])
    ulp = a.copy()
    ulp[3, 2] = np.nextafter(ulp[3, 2], np.float32(np.inf))
    swapped = a.copy()
    swapped[[0, 1]] = swapped[[1, 0]]
    others = [{**w, "a": jnp.asarray(ulp)}, {**w, "a": jnp.asarray(swapped)},
              {**w, "b": w["b"].astype(jnp.float32)}, {"a": w["a"], "c": w["b"]}]
    assert len({fp, *map(ckpt_lib.fingerprint, others)}) == 5
