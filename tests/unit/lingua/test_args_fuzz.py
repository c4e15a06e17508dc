"""Fuzzed overrides: whatever a user types after the config, parsing and `TrainArgs.validate()` either accept
it or raise a user's error (lingua/errors.py) with a one-line message, never a plain ValueError, KeyError,
TypeError, AttributeError or an OmegaConf exception type (run_cli would print those as bugs)."""

import dataclasses
import typing

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from apps.main.train import TrainArgs
from lingua.args import _dataclass_type, parse_args
from lingua.errors import UserError
from tests.runs import base_overrides, distill_overrides


def field_paths(cls: type, prefix: str = "") -> dict[str, bool]:
    """Every dotted key of `cls` -> whether it is a section: data -> True, data.tokenizer.name -> False, ..."""
    paths = {}
    for f in dataclasses.fields(cls):
        sub = _dataclass_type(typing.get_type_hints(cls)[f.name])
        paths[prefix + f.name] = sub is not None
        if sub is not None:
            paths.update(field_paths(sub, prefix + f.name + "."))
    return paths


KEYS = list(field_paths(TrainArgs))
SECTIONS = [""] + [key + "." for key, is_section in field_paths(TrainArgs).items() if is_section]
NAMES = st.text(alphabet="abcdefghijklmnopqrstuvwxyz_0123456789", min_size=1, max_size=8)
# Unknown names at every level, the real keys, keys past a leaf (steps.x) and odd dotted shapes.
KEY = st.one_of(
    st.sampled_from(KEYS + ["config", "data.sources.text", "data.sources.other"]),
    st.builds(lambda section, name: section + name, st.sampled_from(SECTIONS), NAMES),
    st.builds(lambda key, name: f"{key}.{name}", st.sampled_from(KEYS), NAMES),
    st.sampled_from(["", ".", "a..b", "data.", ".steps", "data.sources.", "+steps", "~model", "steps.0"]),
)
# YAML a user might type: containers, interpolations, special floats, OmegaConf's missing marker.
LITERALS = ["null", "[]", "{}", "[1, 2]", "{a: 1}", "{a: {b: [1]}}", "[a, [b]]", "{text: -1}", "{text: .nan}",
            "???", "${x}", "${steps}", "${oc.env:HOME}", "'1'", "1e999", "-0", "0x1F", "nan", "-inf", ".inf", "true",
            "yes", "'", "[1,", "{a", "${", "a: b", "-", "1_000", "1e-3", "~", "!!binary x", "&a [*a]", "'\\n'"]
VALUE = st.one_of(
    st.integers(min_value=-2**70, max_value=2**70).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.booleans().map(lambda b: str(b).lower()),
    st.sampled_from(LITERALS),
    st.text(max_size=12),
    st.recursive(st.integers(-3, 3) | NAMES,
                 lambda inner: st.lists(inner, max_size=3).map(lambda xs: "[" + ", ".join(map(str, xs)) + "]") |
                 st.dictionaries(NAMES, inner, max_size=2).map(
                     lambda d: "{" + ", ".join(f"{k}: {v}" for k, v in d.items()) + "}"),
                 max_leaves=5).map(str),
)
OVERRIDES = st.lists(st.tuples(KEY, VALUE).map(lambda kv: f"{kv[0]}={kv[1]}"), min_size=1, max_size=4)


@pytest.mark.timeout(120)
@settings(derandomize=True, max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(overrides=OVERRIDES, distill=st.booleans(), world_size=st.sampled_from([1, 2, 3, 4]))
def test_fuzzed_overrides_raise_only_one_line_user_errors(corpus_dir, teacher_dir, overrides, distill, world_size):
    base = distill_overrides(corpus_dir, teacher_dir, corpus_dir / "dump") if distill else \
        base_overrides(corpus_dir, corpus_dir / "dump")
    try:
        args = parse_args(TrainArgs, base + overrides)
        args.validate(world_size)
    except Exception as err:  # anything but a user's error would be a bug: run_cli prints its traceback
        message = str(err)
        assert isinstance(err, UserError), (type(err), message)
        assert message and len(message.splitlines()) == 1 and "\n" not in message, repr(message)


@pytest.fixture(scope="module")
def corpus_dir(corpus):
    return corpus


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("teacher")
    (path / "config.json").write_text('{"max_position_embeddings": 4096}')
    return path
