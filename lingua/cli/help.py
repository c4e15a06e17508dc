"""`--help` for the key=value entry points: every key of a config dataclass, its default and one line on it.

    python -m apps.plan --help        (or -h; the same for train, eval, teacher_cache, stool, export_hf, ...)

The line is the field's own comment in the source (on its line, else the comment lines just above it): what the
key does and its unit (tests/unit/lingua/cli/test_help.py checks that every key of every entry point has one). A
tool whose args extend another's (apps.plan's PlanArgs extends the trainer's TrainArgs) lists its own keys first.
Nested dataclasses are listed under their dotted keys (`optim.lr`). Nothing
here imports torch or starts a process group: `parse_args` answers a help request before anything else runs.
"""

import ast
import dataclasses
import inspect
import io
import sys
import textwrap
import tokenize
import typing
from functools import lru_cache
from typing import Any, Optional

from lingua.cli.words import format_value, type_words

HELP_FLAGS = ("--help", "-h")


def wants_help(argv: list[str]) -> bool:
    """Whether the command line asks for help (`--help` or `-h` anywhere in it)."""
    return any(item in HELP_FLAGS for item in argv)


@lru_cache(maxsize=None)
def field_comments(cls: type) -> dict[str, str]:
    """{field name: its comment} from `cls`'s source and its dataclass bases' (a base's comment where the class
    itself has none)."""
    comments: dict[str, str] = {}
    for klass in reversed([k for k in cls.__mro__ if dataclasses.is_dataclass(k)]):
        comments.update(_own_comments(klass))
    return comments


def _own_comments(cls: type) -> dict[str, str]:
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):  # no source (a dataclass made at run time)
        return {}
    by_line: dict[int, str] = {}
    code_lines: set[int] = set()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            by_line[token.start[0]] = token.string.lstrip("#").strip()
        elif token.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT):
            code_lines.add(token.start[0])
    body = ast.parse(source).body[0].body
    found = {}
    for node in body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        trailing = [by_line[n] for n in range(node.lineno, node.end_lineno + 1) if n in by_line]
        above, line = [], node.lineno - 1
        while line in by_line and line not in code_lines:  # the comment block right above the field
            above.insert(0, by_line[line])
            line -= 1
        text = " ".join(trailing or above)
        if text:
            found[node.target.id] = text
    return found


def _dataclass_of(annotation) -> Optional[type]:
    if dataclasses.is_dataclass(annotation):
        return annotation
    return next((arg for arg in typing.get_args(annotation) if dataclasses.is_dataclass(arg)), None)


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def help_rows(cls: type, instance: Any = None, prefix: str = "") -> list[tuple[str, str, str]]:
    """(dotted key, default as typed on the command line, one line) of every leaf key of `cls`, in field order;
    `instance` supplies the defaults (a parent's default_factory may set a nested dataclass's values)."""
    hints = typing.get_type_hints(cls)
    comments = field_comments(cls)
    rows = []
    for f in dataclasses.fields(cls):
        value = getattr(instance, f.name) if instance is not None else _default(f)
        sub = _dataclass_of(hints[f.name])
        if sub is not None and (dataclasses.is_dataclass(value) or value is dataclasses.MISSING):
            rows += help_rows(sub, value if dataclasses.is_dataclass(value) else None, f"{prefix}{f.name}.")
            continue
        shown = "(required)" if value is dataclasses.MISSING else format_value(value)
        doc = comments.get(f.name) or type_words(hints[f.name])  # no comment in the source: what it takes
        rows.append((f"{prefix}{f.name}", shown, doc))
    return rows


def program() -> str:
    """`python -m <module>` of the running entry point, else "<program>" (e.g. under pytest)."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    name = spec.name.removesuffix(".__main__") if spec is not None and spec.name else ""
    return f"python -m {name}" if name and not name.startswith("pytest") else "<program>"


def help_text(cls: type, usage: str = "") -> str:
    """The help screen of `cls`: a usage line, the class's docstring, then a line per key."""
    try:
        instance = cls()
    except TypeError:  # a required field: the rows say "(required)"
        instance = None
    rows = help_rows(cls, instance)
    doc = inspect.getdoc(cls) or ""
    own_doc = doc if doc and not doc.startswith(f"{cls.__name__}(") else ""  # not dataclass's generated signature
    width = min(max(len(f"{key}={shown}") for key, shown, _ in rows), 48)
    lines = [usage or f"usage: {program()} [config=<file.yaml>] [key=value ...]  (the keys of {cls.__name__}: a "
                      f"config file's values, then the command line's, override these defaults)"]
    if own_doc:
        lines += ["", own_doc.split("\n\n")[0]]
    base = next((k for k in cls.__mro__[1:] if dataclasses.is_dataclass(k)), None)
    inherited = {f.name for f in dataclasses.fields(base)} if base is not None else set()
    own = [row for row in rows if row[0].split(".", 1)[0] not in inherited]
    sections = [("keys (default, then what it does):", rows)] if base is None else [
        (f"{cls.__name__}'s own keys, first (default, then what it does):", own),
        (f"the keys it shares with {base.__name__} (its config's sections, as there):",
         [row for row in rows if row not in own])]
    for title, section in sections:
        lines += ["", title]
        for key, shown, text in section:
            left = f"  {key}={shown}"
            lines.append(f"{left:<{width + 4}}  {text}".rstrip() if len(left) <= width + 2 else
                         f"{left}\n{'':<{width + 4}}  {text}".rstrip())
    return "\n".join(lines) + "\n"


def exit_with_help(cls: type, argv: list[str], usage: str = "") -> None:
    """If `argv` asks for help: print `cls`'s keys and exit 0 (SystemExit, which run_cli lets through)."""
    if wants_help(argv):
        sys.stdout.write(help_text(cls, usage))
        sys.stdout.flush()
        raise SystemExit(0)
