"""Configs from dicts, YAML files and dotted command-line overrides, strictly checked.

A run is described by one `Config` (`schema.py`), built from (in order of precedence, lowest first)
the schema's defaults, a YAML file and `section.field=value` overrides:

    cfg = load_config("grpo_tiny", ["rl.group_size=4", "optim.lr=3e-6"])

The configs shipped with the package live in `CONFIG_DIR` (`sage_jax/configs/`, also reachable as
the repository's top-level `configs/`); a config path that is not a file is looked up there by name
(`toy`, `toy.yaml` or `configs/toy.yaml`), so the same command works from a checkout and from an
installed wheel. `DEFAULT_CONFIG` is the built-in toy job's.

Every key is checked: an unknown or misspelled key, a value of the wrong type, a value outside a
`Literal`'s choices or outside a field's allowed range is a `ConfigError` that names the dotted key
and says what is allowed. This module knows nothing of the schema beyond its root, `Config`, and
`TaskConfig`'s open slots: `task.<name>` sections come from a task table `{name: section class or
None}` passed in as `tasks` (the task plug-ins' table is `sage_jax.tasks.registry.SECTIONS`;
`registry.load_config` passes it). Without a table, `task.name` is any name and no task section
is known.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import sys
import types
import typing
from pathlib import Path
from typing import Any, Literal, Mapping, Sequence

import yaml

from sage_jax.config.schema import Config, ConfigError, TaskConfig

Tasks = Mapping[str, "type | None"]  # task name -> its plug-in's config section (None: none)

CONFIG_DIR = Path(__file__).parents[1] / "configs"  # the configs shipped with the package
# Keys that moved (old -> new). In a YAML file or an override the old key is an error naming the
# new one; a run folder's saved config is migrated on read (`migrate`).
MOVED = {"rl.rollout_micro_batch_size": "rollout.micro_batch_size",
         "rl.continuous_batching": "rollout.continuous_batching",
         "rl.programs_kept": "rollout.programs_kept"}
DEFAULT_CONFIG = CONFIG_DIR / "toy.yaml"  # what `python -m sage_jax.train` runs without --config


@functools.cache
def _field_types(cls: type) -> dict[str, Any]:
    """The resolved type of every field of dataclass `cls`, in declaration order."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _fields(cls: type, tasks: Tasks) -> dict[str, Any]:
    """The keys of section `cls` and their types; `TaskConfig`'s are `name` and the table's
    sections."""
    if cls is not TaskConfig:
        return _field_types(cls)
    name: Any = Literal.__getitem__(tuple(tasks)) if tasks else str
    return {"name": name, **{task: section for task, section in tasks.items() if section}}


def _is_section(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _all_keys(cls: type, tasks: Tasks, prefix: str = "") -> list[str]:
    """Every dotted key of the schema rooted at `cls`, sections included."""
    keys = []
    for name, tp in _fields(cls, tasks).items():
        keys.append(_join(prefix, name))
        if _is_section(tp):
            keys += _all_keys(tp, tasks, _join(prefix, name))
    return keys


def _unknown_key(cls: type, name: str, prefix: str, root: type, tasks: Tasks) -> ConfigError:
    """The error for key `name` not being a field of section `cls` (at dotted `prefix`)."""
    key = _join(prefix, name)
    if key in MOVED:
        return ConfigError(f"config key '{key}' moved to '{MOVED[key]}'", key=key)
    match = difflib.get_close_matches(name, list(_fields(cls, tasks)), n=1)
    suggestion = _join(prefix, match[0]) if match else None
    if suggestion is None:  # Maybe the right field in the wrong section, e.g. `group_size`.
        leaves = {k.rsplit(".", 1)[-1]: k for k in _all_keys(root, tasks)}
        match = difflib.get_close_matches(name, list(leaves), n=1, cutoff=0.8)
        suggestion = leaves[match[0]] if match else None
    hint = f" (did you mean '{suggestion}'?)" if suggestion else ""
    if cls is TaskConfig and not tasks and not hint:
        hint = (" (task sections are known only to a loader given the task table: "
                "sage_jax.tasks.registry.load_config)")
    return ConfigError(f"unknown config key '{key}'{hint}", key=key)


def _type_name(tp: Any) -> str:
    """A readable name for type annotation `tp`, e.g. 'int or null', 'list of str'."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " or ".join("null" if a is type(None) else _type_name(a) for a in args)
    if origin in (list, tuple):
        return f"list of {_type_name(args[0])}"
    if _is_section(tp):
        return f"mapping ({tp.__name__})"
    return getattr(tp, "__name__", str(tp))


def _convert(value: Any, tp: Any, key: str, root: type, tasks: Tasks) -> Any:
    """`value` checked against (and, where lossless, coerced to) type `tp`."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if _is_section(tp):
        value = {} if value is None else value  # An empty YAML section reads as null.
        if not isinstance(value, Mapping):
            raise ConfigError(
                f"config key '{key}' is a section and expects a mapping, got {value!r}", key=key)
        return _build(tp, value, key, root, tasks)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is not type(None):
                try:
                    return _convert(value, arg, key, root, tasks)
                except ConfigError:
                    pass
    elif origin is Literal:
        if value in args and type(value) in {type(a) for a in args}:
            return value
        raise ConfigError(
            f"invalid value {value!r} for config key '{key}': allowed values are "
            + ", ".join(repr(a) for a in args), key=key)
    elif origin in (list, tuple):
        if value is None or isinstance(value, Mapping):
            raise ConfigError(f"invalid value {value!r} for config key '{key}': expected "
                              f"{_type_name(tp)}", key=key)
        items = list(value) if isinstance(value, (list, tuple)) else [value]  # a -> [a]
        converted = [_convert(v, args[0], f"{key}[{i}]", root, tasks)
                     for i, v in enumerate(items)]
        return tuple(converted) if origin is tuple else converted
    elif tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                pass
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML reads `1e-6` (no dot) as a string.
            try:
                return float(value)
            except ValueError:
                pass
    elif tp is str:
        if isinstance(value, str):
            return value
    else:
        raise TypeError(f"config key '{key}' has an unsupported annotation {tp!r}")
    raise ConfigError(
        f"invalid value {value!r} ({type(value).__name__}) for config key '{key}': "
        f"expected {_type_name(tp)}", key=key)


def _build(cls: type, data: Mapping[str, Any], prefix: str, root: type, tasks: Tasks) -> Any:
    """An instance of section `cls` from mapping `data`; missing keys take their defaults (a
    missing section: its keys' defaults)."""
    fields = _fields(cls, tasks)
    kwargs = {}
    for name, value in data.items():
        if name not in fields:
            raise _unknown_key(cls, str(name), prefix, root, tasks)
        kwargs[name] = _convert(value, fields[name], _join(prefix, name), root, tasks)
    for name, tp in fields.items():
        if name not in kwargs and _is_section(tp):
            kwargs[name] = _build(tp, {}, _join(prefix, name), root, tasks)
    if cls is TaskConfig:
        sections = tuple((task, kwargs.pop(task)) for task in list(kwargs) if task != "name")
        kwargs = {**kwargs, "sections": sections}
    try:
        return cls(**kwargs)
    except ConfigError as e:
        if e.key is None or not prefix:
            raise
        key = _join(prefix, e.key)
        raise ConfigError(str(e).replace(f"'{e.key}'", f"'{key}'", 1), key=key) from None


def from_dict(data: Mapping[str, Any], cls: type = Config, tasks: Tasks | None = None) -> Any:
    """A config (`Config` unless `cls` says otherwise) from a nested mapping, strictly checked;
    `tasks`: the task table (see the module docstring)."""
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"a config must be a mapping of sections, got {data!r}")
    return _build(cls, data, "", cls, tasks or {})


def to_dict(cfg: Any) -> dict[str, Any]:
    """The config as plain nested dicts, lists and scalars (what YAML holds)."""
    def plain(x: Any) -> Any:
        if isinstance(x, TaskConfig):
            return {"name": x.name, **{task: plain(s) for task, s in x.sections}}
        if dataclasses.is_dataclass(x):
            return {f.name: plain(getattr(x, f.name)) for f in dataclasses.fields(x)}
        if isinstance(x, (list, tuple)):
            return [plain(v) for v in x]
        return x
    return plain(cfg)


def to_yaml(cfg: Any) -> str:
    """The config as a YAML document that `load_config` reads back to an equal config."""
    return yaml.safe_dump(to_dict(cfg), sort_keys=False, default_flow_style=False)


def save_config(cfg: Any, path: str | Path) -> None:
    """Writes `to_yaml(cfg)` to `path`, creating parent folders."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(to_yaml(cfg))


def _check_keys(data: Any, cls: type, prefix: str, root: type, tasks: Tasks) -> None:
    """Raises for the first key in nested mapping `data` that is not in the schema."""
    if not isinstance(data, Mapping):
        return
    fields = _fields(cls, tasks)
    for name, value in data.items():
        if name not in fields:
            raise _unknown_key(cls, str(name), prefix, root, tasks)
        if _is_section(fields[name]):
            _check_keys(value, fields[name], _join(prefix, name), root, tasks)


def _override_value(raw: str, tp: Any) -> Any:
    """Override text parsed as YAML, except that a `str` field keeps the text as written."""
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError:
        return raw
    args = typing.get_args(tp) if typing.get_origin(tp) in (typing.Union,
                                                            types.UnionType) else (tp,)
    if str in args and value is not None and not isinstance(value, (str, list, dict)):
        return raw.strip()  # `data.hint_key=2024` or `model.path=1.10` stay text.
    return value


def apply_overrides(data: Mapping[str, Any], overrides: Sequence[str], cls: type = Config,
                    tasks: Tasks | None = None) -> dict[str, Any]:
    """A copy of nested mapping `data` with `a.b=value` overrides applied (values are YAML)."""
    tasks = tasks or {}
    result = _copy_dict(data)
    for item in overrides:
        text = item[2:] if item.startswith("--") else item
        key, sep, raw = text.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(f"override {item!r} must look like section.key=value")
        section, node, prefix = cls, result, ""
        parts = key.split(".")
        for i, name in enumerate(parts):
            fields = _fields(section, tasks)
            if name not in fields:
                raise _unknown_key(section, name, prefix, cls, tasks)
            tp = fields[name]
            prefix = _join(prefix, name)
            if i == len(parts) - 1:
                value = _override_value(raw, tp)
                if _is_section(tp) and isinstance(value, Mapping) and isinstance(
                        node.get(name), Mapping):
                    value = {**node[name], **value}
                node[name] = value
            elif not _is_section(tp):
                raise ConfigError(f"config key '{prefix}' is not a section, so "
                                  f"'{key}' does not exist", key=key)
            else:
                if not isinstance(node.get(name), dict):
                    node[name] = {}
                section, node = tp, node[name]
    return result


def migrate(data: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """(a copy of a config mapping written before keys moved, with each key of `MOVED` at its
    new place; the moves made, as "old -> new")."""
    out, moves = _copy_dict(data), []
    for old, new in MOVED.items():
        (osec, oname), (nsec, nname) = old.split("."), new.split(".")
        section = out.get(osec)
        if isinstance(section, dict) and oname in section:
            out.setdefault(nsec, {})
            if not isinstance(out[nsec], dict):
                continue  # not a mapping: the strict load names it
            out[nsec][nname] = section.pop(oname)
            moves.append(f"{old} -> {new}")
    return out, moves


def _copy_dict(data: Mapping[str, Any]) -> dict[str, Any]:
    """A deep copy of nested mapping `data` whose mappings are plain dicts."""
    return {k: _copy_dict(v) if isinstance(v, Mapping) else v for k, v in data.items()}


def resolve_config_path(path: str | Path) -> Path:
    """`path` when it is a file, else the shipped config of that name (`CONFIG_DIR`), else
    `path` unchanged (so the error names what the user wrote)."""
    path = Path(path)
    if path.is_file():
        return path
    name = path.name if path.suffix in (".yaml", ".yml") else path.name + ".yaml"
    shipped = CONFIG_DIR / name
    if shipped.is_file() and (len(path.parts) == 1 or path.parent.name == "configs"):
        return shipped
    return path


def load_config(path: str | Path | None = None, overrides: Sequence[str] = (),
                tasks: Tasks | None = None, *, saved: bool = False) -> Config:
    """Defaults, then the YAML file at `path` (if any), then `overrides`; strictly checked.
    `tasks`: the task table (see the module docstring). `saved`: `path` is a run folder's
    saved config, whose moved keys (`MOVED`) are migrated, with a note on stderr."""
    tasks = tasks or {}
    data: Any = {}
    if path is not None:
        path = resolve_config_path(path)
        try:
            data = yaml.safe_load(Path(path).read_text(encoding="utf-8")) or {}
        except FileNotFoundError:
            raise ConfigError(f"config file not found: {path}") from None
        except UnicodeDecodeError as e:
            raise ConfigError(f"config file {path} is not UTF-8 text ({e.reason} at byte "
                              f"{e.start})") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {path} is not valid YAML: {e}") from None
        if not isinstance(data, Mapping):
            raise ConfigError(f"config file {path} must hold a mapping of sections")
        if saved:
            data, moves = migrate(data)
            if moves:
                print(f"note: {path} was saved before config keys moved; read as "
                      f"{', '.join(moves)}", file=sys.stderr, flush=True)
        try:
            _check_keys(data, Config, "", Config, tasks)
        except ConfigError as e:
            raise ConfigError(f"{path}: {e}", key=e.key) from None
    try:
        return from_dict(apply_overrides(data, overrides, tasks=tasks), tasks=tasks)
    except ConfigError as e:
        if path is None:
            raise
        try:
            from_dict(data, tasks=tasks)
        except ConfigError:  # the file itself is invalid (not only with the overrides): name it
            raise ConfigError(f"{path}: {e}", key=e.key) from None
        raise
