"""Configuration: nested dataclasses filled by OmegaConf from a YAML file plus dotted overrides.

    python -m apps.main.train config=configs/debug_cpu.yaml steps=20 optim.lr=1e-3

A dotted override sets one key and keeps the rest of its section (`data.sources.code=0.5` adds or changes one
source). A mapping given whole to a map field (`'data.sources={pydocs: 1.0}'`) replaces the config file's map:
what the command line wrote is the whole map (a section such as `model={dim: 64}` still merges key by key).
Parsing rejects unknown keys (naming the valid keys at that level) and values of the wrong type, each
in one sentence; every `XArgs.validate()` then checks the values with `require`, before anything
distributed happens. All of it raises ConfigError (MissingPathError for a missing config file), the user
errors of lingua/errors.py.
"""

import dataclasses
import re
import sys
import typing
from pathlib import Path
from typing import Any, Optional, Type, TypeVar

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from lingua.cli.words import format_value, type_words
from lingua.errors import ConfigError, MissingPathError
from lingua.cli.help import exit_with_help

T = TypeVar("T")


def require(ok: bool, key: str, value: Any, fix: str) -> None:
    """Raise ConfigError("<key>=<value>; <fix>.") unless `ok`: every config error names the key, the value
    and what to set instead, e.g. "optim.lr=-0.001; use a positive learning rate."."""
    if not ok:
        raise ConfigError(f"{key}={format_value(value)}; {fix}.")


def is_placeholder(value: Any) -> bool:
    """Whether `value` is a placeholder a printed command left for the user (`<teacher checkpoint dir>`)."""
    return isinstance(value, str) and len(value) > 2 and value[0] == "<" and value[-1] == ">" and "<" not in value[1:]


def require_filled(key: str, value: Any, what: str) -> None:
    """One sentence for a placeholder pasted as it was printed (apps.plan prints `<...>` where it cannot know a
    path): replace it with `what`."""
    require(not is_placeholder(value), key, value,
            f"that is a placeholder of a printed command; replace it with {what}")


def one_line(text: str) -> str:
    """`text` with its line breaks folded into spaces (OmegaConf and YAML errors span several lines)."""
    return " ".join(str(text).split())


def _dataclass_type(annotation) -> Optional[type]:
    """The dataclass inside `X`, `Optional[X]` or `Union[X, None]`, else None."""
    if dataclasses.is_dataclass(annotation):
        return annotation
    for arg in typing.get_args(annotation):
        if dataclasses.is_dataclass(arg):
            return arg
    return None


def check_keys(cls: type, values: Any, where: str = "") -> None:
    """Raise ConfigError naming the first key of `values` that `cls` (recursively) does not have."""
    if not isinstance(values, (dict, DictConfig)):
        return
    hints = typing.get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls)}
    for key, value in values.items():
        path = f"{where}.{key}" if where else str(key)
        if key not in fields:
            raise ConfigError(
                f"Unknown config key {path!r}. Valid keys{' under ' + where if where else ''} are: "
                f"{', '.join(sorted(fields))}."
            )
        sub = _dataclass_type(hints[key])
        if sub is not None:
            check_keys(sub, value, path)
        element = typing.get_args(hints[key])[0] if typing.get_origin(hints[key]) is list else None
        if dataclasses.is_dataclass(element) and isinstance(value, (list, ListConfig)):
            for i, item in enumerate(value):  # a list of sections (distillation.teachers): each element's keys
                check_keys(element, item, f"{path}[{i}]")


def _fits(value: Any, annotation) -> bool:
    """Whether a parsed value has the annotation's type, containers element by element."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if type(None) in args:
        return value is None or _fits(value, next(a for a in args if a is not type(None)))
    if annotation is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if annotation in (bool, str):
        return isinstance(value, annotation)
    if dataclasses.is_dataclass(annotation):
        return isinstance(value, annotation)
    if origin is dict:
        return isinstance(value, dict) and all(_fits(k, args[0]) and _fits(v, args[1]) for k, v in value.items())
    if origin is list:
        return isinstance(value, list) and all(_fits(v, args[0]) for v in value)
    return True


def check_types(obj: Any, where: str = "") -> None:
    """Raise ConfigError naming the first field of a parsed dataclass whose value has the wrong type
    (OmegaConf lets nested dicts or lists through inside typed containers, e.g. data.sources={a: {b: 1}})."""
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        key, value = f"{where}{f.name}", getattr(obj, f.name)
        if not _fits(value, hints[f.name]):
            raise ConfigError(f"{key}={format_value(value)} has the wrong type; set {key} to "
                             f"{type_words(hints[f.name])}.")
        if dataclasses.is_dataclass(value):
            check_types(value, f"{key}.")


def _is_map_field(cls: type, dotted: str) -> bool:
    """Whether `a.b.c` names a dict-typed field itself (data.sources), not a section or a key inside the map."""
    annotation = cls
    for part in dotted.split("."):
        sub = _dataclass_type(annotation)
        if sub is None or part not in {f.name for f in dataclasses.fields(sub)}:
            return False
        annotation = typing.get_type_hints(sub)[part]
    return typing.get_origin(annotation) is dict


def replace_maps(cls: type, merged: DictConfig, cli: DictConfig, argv: list[str]) -> None:
    """A mapping the command line gave whole to a map field replaces the file's map in `merged` (the merge kept
    the file's keys beside it); later dotted overrides of keys inside it are already in `cli`'s map."""
    for key in dict.fromkeys(item.split("=", 1)[0] for item in argv):
        if _is_map_field(cls, key) and isinstance(OmegaConf.select(cli, key), DictConfig):
            OmegaConf.update(merged, key, OmegaConf.select(cli, key), merge=False)


def _field_type(cls: type, dotted: str):
    """The annotation of `a.b.c` under `cls` (None when the path leaves the dataclasses)."""
    annotation = cls
    for part in dotted.split("."):
        sub = _dataclass_type(annotation)
        if sub is None or part not in {f.name for f in dataclasses.fields(sub)}:
            return annotation if typing.get_origin(annotation) in (dict, list) else None
        annotation = typing.get_type_hints(sub)[part]
    return annotation


_OMEGACONF_CONTEXT = re.compile(r"\n\s+(full_key|object_type|reference_type)[:=].*", re.DOTALL)


def _omegaconf_words(err: Exception) -> str:
    """An OmegaConf or YAML error in one line, without OmegaConf's trailing key and type lines."""
    return one_line(_OMEGACONF_CONTEXT.sub("", str(getattr(err, "msg", None) or err))).rstrip(".")


def _locate(cls: type, values: dict, prefix: str = "") -> Optional[tuple[str, Exception]]:
    """(dotted key, error) of the first value OmegaConf cannot merge into `cls`, merging them one at a time."""
    hints = typing.get_type_hints(cls)
    for key, value in values.items():
        sub = _dataclass_type(hints[key])
        if sub is not None and isinstance(value, dict):
            found = _locate(sub, value, f"{prefix}{key}.")
        else:
            try:
                OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(cls), {key: value}))
                found = None
            except (OmegaConfBaseException, TypeError) as err:
                found = f"{prefix}{key}", err
        if found is not None:
            return found
    return None


def _merge_error(cls: type, values: dict, err: Exception) -> ConfigError:
    """OmegaConf's multi-line (or keyless) merge error as one sentence naming the key and the expected type."""
    key = getattr(err, "full_key", None)
    if not key:
        key, err = _locate(cls, values) or (None, err)
    message = _omegaconf_words(err)
    if not key:
        return ConfigError(f"Invalid configuration: {message}; check the overrides and the config file.")
    annotation = _field_type(cls, key)
    fix = f"set {key} to {type_words(annotation)}" if annotation is not None else f"fix {key}"
    return ConfigError(f"Invalid value for {key}: {message}; {fix}.")


def dataclass_from_dict(cls: Type[T], values: Any) -> T:
    """Build `cls` from a dict/DictConfig, checking keys and types; any problem is one ConfigError sentence."""
    try:
        if isinstance(values, (DictConfig, ListConfig)):
            values = OmegaConf.to_container(values, resolve=True)
    except OmegaConfBaseException as err:  # an interpolation that does not resolve
        raise _merge_error(cls, {}, err) from None
    values = values or {}
    if not isinstance(values, dict):
        raise ConfigError(f"The configuration is a {type(values).__name__}, not a mapping of keys to values.")
    check_keys(cls, values)
    try:
        obj = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(cls), values))
    except (OmegaConfBaseException, TypeError) as err:  # precise but verbose, not always a ValueError or keyed
        raise _merge_error(cls, values, err) from None
    check_types(obj)
    return obj


def load_config_file(path: Any) -> DictConfig:
    """The YAML mapping at `path`; a missing file, bad YAML or a non-mapping is one sentence."""
    if not isinstance(path, str) or not path:
        raise ConfigError(f"config={format_value(path)}; pass config=<path to a .yaml file>.")
    if not Path(path).is_file():
        raise MissingPathError(f"Config file {path!r} does not exist; pass config=<path to a .yaml>.")
    try:
        loaded = OmegaConf.load(path)
    except (yaml.YAMLError, OmegaConfBaseException, UnicodeDecodeError) as err:
        raise ConfigError(f"Config file {path!r} is not valid YAML ({_omegaconf_words(err)}); fix the file.") from None
    if not isinstance(loaded, DictConfig):
        raise ConfigError(f"Config file {path!r} holds a {type(loaded).__name__}, not a mapping of keys to values.")
    return loaded


def drop_retired_keys(cls: type, merged: DictConfig) -> None:
    """Top-level keys `cls` no longer has (its RETIRED_KEYS: key -> where that went). Null, as an older run's
    config.yaml holds them, they are dropped, so that file still launches; set, they are one sentence."""
    for key, moved_to in getattr(cls, "RETIRED_KEYS", {}).items():
        if key in merged:
            if merged[key] is not None:
                raise ConfigError(f"{key}={format_value(merged[key])} is no longer a config key: {moved_to}.")
            del merged[key]


def parse_args(cls: Type[T], argv: Optional[list[str]] = None) -> T:
    """Parse `config=path.yaml key=value a.b=c` (sys.argv by default) into `cls`; `--help` (or `-h`) prints
    its keys with their defaults and exits 0."""
    argv = list(sys.argv[1:] if argv is None else argv)
    exit_with_help(cls, argv)  # --help / -h: the keys, their defaults and a line each, then exit 0
    for item in argv:
        if "=" not in item:
            raise ConfigError(f"Override {item!r} has no '='; write key=value (e.g. steps=20), without dashes "
                              f"(--help lists the keys).")
    try:
        cli = OmegaConf.from_cli(argv)
        file_cfg = load_config_file(cli.pop("config")) if "config" in cli else OmegaConf.create()
        merged = OmegaConf.merge(file_cfg, cli)
        replace_maps(cls, merged, cli, argv)
        drop_retired_keys(cls, merged)
    except (yaml.YAMLError, OmegaConfBaseException, TypeError) as err:
        key = getattr(err, "full_key", None)
        if key and _field_type(cls, key) is not None:  # e.g. model=[1, 2] next to model.dim=32
            raise _merge_error(cls, {}, err) from None
        raise ConfigError(f"Could not parse {'the value of ' + key if key else 'the overrides'} "
                         f"({_omegaconf_words(err)}); write key=value, with YAML values (lists [a, b], "
                         f"mappings {{a: 1}}).") from None
    return dataclass_from_dict(cls, merged)


def fill_training_defaults(args: Any) -> None:
    """Fill what a training config leaves to the trainer (a TrainArgs or a subclass, e.g. the planner's PlanArgs),
    so that every tool reads a Lingua config as the trainer does: model.max_seqlen=-1 is data.seq_len, as in Meta
    Lingua. apps.main.train calls it before validating, apps.plan before planning."""
    if args.model.max_seqlen == -1:
        args.model.max_seqlen = args.data.seq_len


def to_dict(obj: Any) -> dict:
    """A plain dict of a (nested) dataclass."""
    return OmegaConf.to_container(OmegaConf.structured(obj), resolve=True)


def dump_config(obj: Any, path: str | Path) -> None:
    """Write the resolved config as YAML (what the run actually used)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(OmegaConf.to_yaml(OmegaConf.structured(obj)))
    tmp.replace(path)
