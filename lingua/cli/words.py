"""How a config value and a config type read to a user: shared by the parser's errors and `--help`."""

import dataclasses
import typing
from typing import Any


def format_value(value: Any) -> str:
    """A config value as the user would type it: strings quoted (newlines escaped), numbers plain, null, true/false."""
    if value is None or isinstance(value, bool):
        return {None: "null", True: "true", False: "false"}[value]
    return repr(value) if isinstance(value, str) else str(value)


def type_words(annotation) -> str:
    """What a value of `annotation` looks like, for "set <key> to <words>"."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if annotation is bool:
        return "true or false"
    if annotation is int:
        return "an integer"
    if annotation is float:
        return "a number"
    if annotation is str:
        return "a string"
    if dataclasses.is_dataclass(annotation):
        return f"a mapping of {annotation.__name__} keys"
    if origin is dict:
        return f"a mapping of names to {type_words(args[1]).removeprefix('a ').removeprefix('an ')}s"
    if origin is list:
        return f"a list of {type_words(args[0]).removeprefix('a ').removeprefix('an ')}s"
    if type(None) in args:
        inner = [a for a in args if a is not type(None)]
        return f"{type_words(inner[0])} or null"
    if origin is typing.Union:
        return " or ".join(type_words(arg) for arg in args)
    return str(annotation)
