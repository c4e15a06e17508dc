"""Fuzzing the readers: a chunk or validation file of any bytes gives documents and counted skips, never
an exception but the documented sentence, and the counts add up.

Files mix documents, random bytes, JSON of any shape, lone surrogates, deep nesting, long lines, BOMs,
CRLF, NUL and blank lines. Blank lines (empty or ASCII whitespace) are neither documents nor skips, so
on each pass over its lines a rank sees documents + skips == non-blank lines. The loader is checked
after every batch against a model of the reader built from `parse_line`, the rule itself: the token
stream, `bad_lines` and the current file's count in the state, the warnings, and a resume. The line
bound is lowered to MAX_LINE bytes so that generated lines cross it. Hypothesis runs derandomized.
"""

import functools
import json
import logging
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Optional
from unittest import mock

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lingua.loading import documents
from lingua.data import DataLoader
from lingua.loading.documents import MAX_NESTING, parse_line
from lingua.evaluation.heldout import iterate_eval_batches
from lingua.tokenizer import ByteTokenizer, TokenizerArgs, build_tokenizer
from tests.unit.lingua.test_data import make_args, windows_of, write_chunks

MAX_LINE = 4096
FUZZ = settings(derandomize=True, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
BYTES = ByteTokenizer()

# A generated line: its bytes (without the line end) and what the rule must make of it:
# ("doc", text), ("skip",), ("blank",), or ("any",) where only the counts are checked.
short_text = st.text(max_size=30)
doc_items = st.builds(lambda text, ascii_only, bom: (
    (b"\xef\xbb\xbf" if bom else b"") + json.dumps({"text": text}, ensure_ascii=ascii_only).encode(),
    ("doc", text) if text.strip() else ("skip",)), short_text | st.text(min_size=1, max_size=30), st.booleans(),
    st.booleans())
surrogate_items = st.builds(lambda a, s, b, ascii_only: (
    json.dumps({"text": a + s + b}, ensure_ascii=ascii_only).encode("utf-8", "surrogatepass"), ("skip",)),
    short_text, st.characters(categories=["Cs"]), short_text, st.booleans())
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | short_text,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
        st.sampled_from(["text", "content", "id"]) | short_text, inner, max_size=3), max_leaves=12)
any_json_items = st.builds(lambda value: (json.dumps(value).encode(), ("any",)), json_values)
nested_items = st.builds(lambda depth: (
    b'{"text": "deep", "m": ' + b"[" * depth + b"]" * depth + b"}",
    ("doc", "deep") if depth + 1 <= MAX_NESTING else ("skip",)), st.integers(1, 2000))
long_items = st.builds(lambda n: (b'{"text": "' + b"a" * n + b'"}', ("long", "a" * n)),
                       st.integers(MAX_LINE - 14, MAX_LINE - 9))  # around the bound, with the line end
blank_items = st.builds(lambda raw: (raw, ("blank",)), st.sampled_from([b"", b" ", b"\t \x0b\x0c", b"\xef\xbb\xbf"]))
nasty_items = st.builds(lambda raw: (raw, ("any",)), st.sampled_from([
    b"\x00", b'{"text": "a\x00b"}', b'{"text": "a\\u0000b"}', b'{"text": "x"}\x00', b"\xff\xfe", b"\xc0\xaf",
    b'{"text": "\xed\xa0\xbd"}', b"\r", b"[", b"{", b'{"text": NaN}', b'{"text": "x", "n": ' + b"9" * 5000 + b"}",
    b'{"text": "x"} {"text": "y"}', "{\"text\": \"x\"}".encode("utf-16"), b"\xef\xbb\xbf\xef\xbb\xbf{}"]))
random_items = st.builds(lambda raw: (raw, ("any",)), st.binary(max_size=40))
# Documents three times as often as each other kind, so that most ranks' shares hold some.
items = st.lists(st.one_of(doc_items, doc_items, doc_items, surrogate_items, any_json_items, nested_items, long_items,
                           blank_items, nasty_items, random_items), min_size=3, max_size=14)
line_ends = st.lists(st.sampled_from([b"\n", b"\r\n"]), min_size=14, max_size=14)


@functools.cache
def hf_tokenizer(path: str):
    return build_tokenizer(TokenizerArgs(name="hf", path=path))


@contextmanager
def lowered_line_bound():
    with mock.patch.object(documents, "MAX_LINE_BYTES", MAX_LINE), mock.patch.object(documents, "_READ_BLOCK", 1000):
        yield


@contextmanager
def data_warnings():
    """The messages lingua.data warns with meanwhile (in-line)."""
    messages: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: messages.append(record.getMessage())
    logger = logging.getLogger("lingua.data")
    logger.addHandler(handler)
    try:
        yield messages
    finally:
        logger.removeHandler(handler)


def build_file(generated: list, ends: list[bytes], last_end: bool) -> tuple[bytes, list]:
    """The file's bytes and, per physical line, what the rule must give (long lines: by their size)."""
    chunks, expected = [], []
    for i, ((raw, want), end) in enumerate(zip(generated, ends)):
        chunk = raw + (end if last_end or i < len(generated) - 1 else b"")
        if want[0] == "long":
            want = ("doc", want[1]) if len(chunk) - chunk.endswith(b"\n") <= MAX_LINE else ("skip",)
        n_lines = len(physical_lines(chunk))
        expected += [want] if n_lines == 1 and b"\n" not in raw else [("any",)] * n_lines
        chunks.append(chunk)
    return b"".join(chunks), expected


def physical_lines(data: bytes) -> list[bytes]:
    """The lines as the reader reads them: split after each b"\\n" only."""
    parts = data.split(b"\n")
    return [p + b"\n" for p in parts[:-1]] + ([parts[-1]] if parts[-1] else [])


def rule_of(line: bytes) -> tuple[Optional[str], Optional[str]]:
    return parse_line(None if len(line) - line.endswith(b"\n") > MAX_LINE else line)


def is_blank(line: bytes) -> bool:
    """Blank by the module docstring, independently of parse_line."""
    short = len(line) - line.endswith(b"\n") <= MAX_LINE
    return short and not line.removeprefix(b"\xef\xbb\xbf").strip(b" \t\r\n\x0b\x0c")


def check_rule(data: bytes, expected: Optional[list]) -> list[tuple[int, Optional[str], Optional[str]]]:
    """Each physical line is a document, a skip or blank; generated lines give what they must."""
    lines = physical_lines(data)
    assert expected is None or len(expected) == len(lines)
    rules = [rule_of(line) for line in lines]
    for line, (text, reason) in zip(lines, rules):
        assert (text is None) or (reason is None)
        assert (text is None and reason is None) == is_blank(line)
        if text is not None:
            assert text.strip() and text.encode("utf-8")  # non-blank, no lone surrogate
    for (text, reason), want in zip(rules, expected or []):
        if want[0] == "doc":
            assert text == want[1]
        elif want[0] == "skip":
            assert reason is not None
        elif want[0] == "blank":
            assert text is None and reason is None
    return [(i, text, reason) for i, (text, reason) in enumerate(rules)]


def reader_after(entries: list, n_tokens: dict, tokens: int) -> tuple[int, int]:
    """(skips in all, skips in the current pass) once the reader has read the documents holding the
    first `tokens` tokens: it reads a line only while it needs a document."""
    consumed = skipped = in_pass = i = 0
    while consumed < tokens:
        if i == len(entries):
            i, in_pass = 0, 0
        _, text, reason = entries[i]
        i += 1
        if reason is not None:
            skipped, in_pass = skipped + 1, in_pass + 1
        elif text is not None:
            consumed += n_tokens[text]
    return skipped, in_pass


def check_loader(data: bytes, entries: list, tokenizer, dp_rank: int, dp_degree: int, batch_size: int, seq_len: int,
                 resume_at: Optional[int]) -> None:
    """In-line (load_async=false): the lowered line bound is patched into this process only. The producer process
    builds the same stream (tests/unit/lingua/loading/test_producer.py)."""
    mine = [e for e in entries if e[0] % dp_degree == dp_rank]
    docs = [text for _, text, _ in mine if text is not None]
    skips = sum(reason is not None for _, _, reason in mine)
    assert len(docs) + skips == sum(not is_blank(physical_lines(data)[i]) for i, _, _ in mine)
    with tempfile.TemporaryDirectory() as root, lowered_line_bound(), data_warnings() as warnings:
        write_chunks(Path(root), "web", [[data]])
        path = str(Path(root) / "web" / "web.chunk.0.jsonl")
        args = make_args(root, {"web": 1.0}, batch_size=batch_size, seq_len=seq_len, load_async=False)
        if not docs:
            with DataLoader(args, tokenizer, dp_rank, dp_degree) as loader:
                with pytest.raises(ValueError, match="Source 'web' has no valid document in this rank's share"):
                    next(loader)
            assert warnings[-1:] == ([f"data file {path}: skipped {skips} malformed line{'s' if skips > 1 else ''}"
                                      + (f" (this rank reads 1/{dp_degree} of its lines)" if dp_degree > 1 else "")]
                                     if skips else [])
            return
        n_tokens = {text: len(tokenizer.encode(text, True, True)) for text in docs}
        one_pass = [t for text in docs for t in tokenizer.encode(text, True, True)]
        window = seq_len + 1
        n_batches = min(40, (3 * len(one_pass)) // (2 * batch_size * window) + 2)
        stream, states, batches = [], [], []
        with DataLoader(args, tokenizer, dp_rank, dp_degree) as loader:
            for n in range(1, n_batches + 1):
                batch = next(loader)
                batches.append(batch)
                stream += [t for w in windows_of(batch) for t in w]
                state = json.loads(json.dumps(loader.state_dict()))
                states.append(state)
                skipped, in_pass = reader_after(mine, n_tokens, n * batch_size * window)
                assert loader.bad_lines == state["bad_lines"] == skipped
                assert state["sources"]["web"]["bad_lines_in_file"] == in_pass
        passes = one_pass * (len(stream) // len(one_pass) + 1)
        assert stream == passes[:len(stream)]
        share = f" (this rank reads 1/{dp_degree} of its lines)" if dp_degree > 1 else ""
        totals = [m for m in warnings if m.startswith("data file ")]
        assert set(totals) <= {f"data file {path}: skipped {skips} malformed line{'s' if skips > 1 else ''}{share}"}
        assert bool(totals) == (skips > 0 and states[-1]["sources"]["web"]["epoch"] > 0)
        first = [m for m in warnings if m.startswith("skipping malformed")]
        skipped_lines = [(i, reason) for i, _, reason in mine if reason is not None]
        last_words = "; further ones are only counted (totals at 10, 100, 1000, ... and per file)"
        assert first == [f"skipping malformed data line {path}:{i + 1}: {reason}" + (last_words if k == 4 else "")
                         for k, (i, reason) in enumerate((skipped_lines * 5)[:len(first)])]
        if resume_at is not None:
            k = resume_at % len(states)
            with DataLoader(args, tokenizer, dp_rank, dp_degree) as resumed:
                resumed.load_state_dict(states[k])
                for want in batches[k + 1:k + 4]:
                    assert windows_of(next(resumed)) == windows_of(want)
                    k += 1
                    assert resumed.state_dict() == states[k]


@pytest.mark.timeout(120)
@FUZZ
@given(st.binary(max_size=200) | items.map(lambda g: b"\n".join(raw for raw, _ in g)))
def test_parse_line_never_raises_and_partitions_lines(data):
    with lowered_line_bound():
        check_rule(data, None)


@pytest.mark.timeout(120)
@settings(FUZZ, max_examples=120)
@given(items, line_ends, st.booleans(), st.integers(0, 2), st.sampled_from([1, 2, 3]), st.integers(1, 3),
       st.integers(1, 24), st.none() | st.integers(0, 40))
def test_loader_on_any_file_counts_every_line(generated, ends, last_end, rank, dp_degree, batch_size, seq_len,
                                              resume_at):
    data, expected = build_file(generated, ends, last_end)
    with lowered_line_bound():
        entries = check_rule(data, expected)
    check_loader(data, entries, BYTES, rank % dp_degree, dp_degree, batch_size, seq_len, resume_at)


@pytest.mark.timeout(120)
@settings(FUZZ, max_examples=40)
@given(items, line_ends, st.booleans(), st.integers(1, 16))
def test_loader_with_the_hf_tokenizer_never_raises(tiny_teacher, generated, ends, last_end, seq_len):
    data, expected = build_file(generated, ends, last_end)
    with lowered_line_bound():
        entries = check_rule(data, expected)
    check_loader(data, entries, hf_tokenizer(str(tiny_teacher)), 0, 1, 2, seq_len, None)


@pytest.mark.timeout(120)
@settings(FUZZ, max_examples=80)
@given(items, line_ends, st.booleans(), st.integers(0, 1), st.sampled_from([1, 2]), st.integers(1, 3),
       st.integers(1, 24), st.booleans())
def test_eval_batches_on_any_file_hold_every_document(tiny_teacher, generated, ends, last_end, rank, dp_degree,
                                                      batch_size, seq_len, use_hf):
    data, expected = build_file(generated, ends, last_end)
    with lowered_line_bound():
        entries = check_rule(data, expected)
    tokenizer = hf_tokenizer(str(tiny_teacher)) if use_hf else BYTES
    rank = rank % dp_degree
    mine = [e for e in entries if e[0] % dp_degree == rank]
    skips = sum(reason is not None for _, _, reason in mine)
    want = [t for _, text, _ in mine if text is not None for t in tokenizer.encode(text, True, True)]
    with tempfile.TemporaryDirectory() as root, lowered_line_bound(), data_warnings() as warnings:
        write_chunks(Path(root), "web", [[b'{"text": "train"}\n']])
        write_chunks(Path(root), "web", [[data]], suffix="val")
        args = make_args(root, {"web": 1.0}, batch_size=batch_size, seq_len=seq_len)
        stream = []
        for batch in iterate_eval_batches(args, tokenizer, rank, dp_degree):
            assert batch["input_ids"].shape == batch["labels"].shape == (batch_size, seq_len)
            for row in range(batch_size):
                n_labels = int((batch["labels"][row] != -100).sum())
                if n_labels:
                    stream += batch["input_ids"][row, :n_labels].tolist() + [int(batch["labels"][row, n_labels - 1])]
    # A lone last token has nothing to predict: it is left out.
    assert stream == (want[:-1] if len(want) % (seq_len + 1) == 1 else want)
    path = Path(root) / "web" / "web.val.jsonl"
    share = f" (this rank reads 1/{dp_degree} of its lines)" if dp_degree > 1 else ""
    totals = [m for m in warnings if m.startswith("data file ")]
    assert totals == ([f"data file {path}: skipped {skips} malformed line{'s' if skips > 1 else ''}{share}"]
                      if skips else [])
