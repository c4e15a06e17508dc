"""Configuration: nested dataclasses filled by OmegaConf from a YAML file plus dotted overrides.

    python -m apps.main.train config=configs/debug_cpu.yaml steps=20 optim.lr=1e-3

Unknown keys are rejected with the valid keys at that level, before anything distributed happens.
"""

import dataclasses
import typing
from pathlib import Path
from typing import Any, Optional, Type, TypeVar

from omegaconf import DictConfig, ListConfig, OmegaConf

T = TypeVar("T")


def _dataclass_type(annotation) -> Optional[type]:
    """The dataclass inside `X`, `Optional[X]` or `Union[X, None]`, else None."""
    if dataclasses.is_dataclass(annotation):
        return annotation
    for arg in typing.get_args(annotation):
        if dataclasses.is_dataclass(arg):
            return arg
    return None


def check_keys(cls: type, values: Any, where: str = "") -> None:
    """Raise ValueError naming the first key of `values` that `cls` (recursively) does not have."""
    if not isinstance(values, (dict, DictConfig)):
        return
    hints = typing.get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls)}
    for key, value in values.items():
        path = f"{where}.{key}" if where else str(key)
        if key not in fields:
            raise ValueError(
                f"Unknown config key '{path}'. Valid keys{' under ' + where if where else ''} are: "
                f"{', '.join(sorted(fields))}."
            )
        sub = _dataclass_type(hints[key])
        if sub is not None:
            check_keys(sub, value, path)


def dataclass_from_dict(cls: Type[T], values: Any) -> T:
    """Build `cls` from a dict/DictConfig, checking keys and types with OmegaConf."""
    if isinstance(values, (DictConfig, ListConfig)):
        values = OmegaConf.to_container(values, resolve=True)
    values = values or {}
    check_keys(cls, values)
    schema = OmegaConf.structured(cls)
    try:
        merged = OmegaConf.merge(schema, values)
    except Exception as err:  # omegaconf's validation errors are precise but verbose
        raise ValueError(f"Invalid configuration for {cls.__name__}: {err}") from None
    return OmegaConf.to_object(merged)


def parse_args(cls: Type[T], argv: Optional[list[str]] = None) -> T:
    """Parse `config=path.yaml key=value a.b=c` (sys.argv by default) into `cls`."""
    cli = OmegaConf.from_cli(argv) if argv is not None else OmegaConf.from_cli()
    file_cfg = OmegaConf.create()
    if "config" in cli:
        path = Path(cli.pop("config"))
        if not path.is_file():
            raise FileNotFoundError(f"Config file '{path}' does not exist; pass config=<path to a .yaml>.")
        file_cfg = OmegaConf.load(path)
    merged = OmegaConf.merge(file_cfg, cli)
    return dataclass_from_dict(cls, merged)


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
