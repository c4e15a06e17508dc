r"""The line -> document rule on each nasty input a scraped corpus holds, through the training loader and
the eval reader: every line is a document or a counted skip whose warning names file:line.

Byte tokenizer unless said otherwise (bos=256, eos=257, a document is [256] + its UTF-8 bytes + [257]).
"""

import json
import logging

import pytest

from lingua.loading import documents
from lingua.data import DataLoader
from lingua.loading.documents import MAX_LINE_BYTES, parse_line
from lingua.evaluation.heldout import iterate_eval_batches
from lingua.tokenizer import TokenizerArgs, build_tokenizer
from tests.unit.lingua.test_data import TOKENIZER, make_args, split_documents, windows_of, write_chunks

SURROGATE_LINE = b'{"text": "caf\\u00e9 truncated emoji \\ud83d"}\n'
NESTED_LINE = b"[" * 50_000 + b"\n"


def doc(text: str) -> bytes:
    return (json.dumps({"text": text}) + "\n").encode()


def one_epoch(loader, source: str = "web") -> list[int]:
    """The token stream up to the window that starts the second pass over the source (with a first
    document longer than a window, that pass has read no line past its first)."""
    stream = []
    while loader.state_dict()["sources"][source]["epoch"] == 0:
        stream += windows_of(next(loader))[0]
    return stream


def data_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "lingua.data" and r.levelno == logging.WARNING]


# Each row of the rule: the line, then the text it gives or a piece of the reason it is skipped for.
RULE = [
    (SURROGATE_LINE, None, "'text' holds a lone UTF-16 surrogate ('\\ud83d' at 21)"),
    (b'{"text": "\\udc00 low first"}\n', None, "lone UTF-16 surrogate"),
    (b'{"text": "a pair \\ud83d\\ude00 is fine"}\n', "a pair \U0001F600 is fine", None),
    (NESTED_LINE, None, "nested deeper than 100 levels"),
    (b'{"text": "x", "meta": ' + b"[" * 101 + b"]" * 101 + b"}\n", None, "nested deeper than 100 levels"),
    (b'{"text": "x", "meta": ' + b"[" * 99 + b"]" * 99 + b"}\n", "x", None),
    (b'{"text": "' + b"[" * 500 + b'"}\n', "[" * 500, None),  # brackets inside the text are text
    (b'{"text": ""}\n', None, "'text' is empty"),
    (b'{"text": " \\t\\u3000\\n"}\n', None, "'text' is only whitespace"),
    (b'{"text": "a\x00b"}\n', None, "not valid JSON (Invalid control character"),
    (b'{"text": "x"}\x00\n', None, "not valid JSON (Extra data"),
    (b'{"text": "a\\u0000b"}\n', "a\x00b", None),  # an escaped NUL is a character like any other
    (b'{"text": "caf\xe9"}\n', None, "not valid UTF-8 (byte 0xe9 at offset 13)"),
    (b'{"text": "\xed\xa0\xbd"}\n', None, "not valid UTF-8"),  # a surrogate encoded in UTF-8
    (b'{"text": "x"}'.decode().encode("utf-16-le") + b"\n", None, "not valid JSON"),
    (b'[{"text": "x"}]\n', None, "not a JSON object but an array"),
    (b'"text"\n', None, "not a JSON object but a string"),
    (b"null\n", None, "not a JSON object but null"),
    (b'{"text": 5}\n', None, "'text' is a number, not a string"),
    (b'{"text": null, "content": "c"}\n', None, "'text' is null, not a string"),
    (b'{"text": ["x"]}\n', None, "'text' is an array, not a string"),
    (b'{"content": {"a": 1}}\n', None, "'content' is an object, not a string"),
    (b'{"id": 3}\n', None, "no 'text' or 'content' field"),
    (b'{"text": "x", "n": ' + b"9" * 5000 + b"}\n", None, "not valid JSON (Exceeds the limit"),
    (b'\xef\xbb\xbf{"text": "after a BOM"}\n', "after a BOM", None),
    (b'{"text": "crlf"}\r\n', "crlf", None),
    (b'{"content": "content field"}', "content field", None),  # the last line of a file may lack "\n"
    (None, None, "longer than 8 MiB"),
    (b"\n", None, None),
    (b" \t\r\n", None, None),
    (b"\xef\xbb\xbf\n", None, None),
]


@pytest.mark.timeout(10)
@pytest.mark.parametrize("raw,text,reason", RULE, ids=[f"rule{i}" for i in range(len(RULE))])
def test_the_rule_gives_a_document_or_a_reason(raw, text, reason):
    got_text, got_reason = parse_line(raw)
    assert got_text == text
    assert (got_reason is None) == (reason is None) and (reason is None or reason in got_reason), got_reason


@pytest.mark.timeout(20)
@pytest.mark.parametrize("load_async", [False, True])
def test_every_nasty_line_is_counted_and_named_with_its_file_and_line(tmp_path, caplog, load_async):
    nasty = [raw for raw, text, reason in RULE if reason is not None and raw is not None]
    first = "the first document, longer than a window " * 2
    lines = [doc(first), b"\n"] + nasty + [b"\r\n", doc("last")]
    write_chunks(tmp_path, "web", [lines])
    args = make_args(tmp_path, {"web": 1.0}, batch_size=1, seq_len=64, load_async=load_async)
    with caplog.at_level(logging.WARNING, logger="lingua.data"):
        with DataLoader(args, TOKENIZER, 0, 1) as loader:
            stream = one_epoch(loader)
            assert loader.bad_lines == len(nasty) == loader.state_dict()["bad_lines"]
    assert split_documents(stream) == [first, "last"]
    path = tmp_path / "web" / "web.chunk.0.jsonl"
    messages = data_warnings(caplog)
    assert messages[0] == f"skipping malformed data line {path}:3: {RULE[0][2]}"
    assert messages[2].startswith(f"skipping malformed data line {path}:5: nested deeper than 100 levels")
    assert messages[4].endswith("; further ones are only counted (totals at 10, 100, 1000, ... and per file)")
    assert messages[5].startswith(f"10 malformed data lines skipped so far (latest {path}:12: ")
    assert messages[6] == f"data file {path}: skipped {len(nasty)} malformed lines"  # the producer may log more


@pytest.mark.timeout(30)
@pytest.mark.parametrize("nasty", [SURROGATE_LINE, NESTED_LINE, b'{"text": ""}\n', b'{"text": "a\x00"}\n'],
                         ids=["surrogate", "nested", "empty", "nul"])
def test_hf_tokenizer_trains_past_the_nasty_line(tmp_path, tiny_teacher, caplog, nasty):
    tokenizer = build_tokenizer(TokenizerArgs(name="hf", path=str(tiny_teacher)))
    texts = ["the teacher reads the same tokens as its students " * 2, "the students learn"]
    write_chunks(tmp_path, "web", [[doc(texts[0]), nasty, doc(texts[1])]])
    args = make_args(tmp_path, {"web": 1.0}, batch_size=1, seq_len=8, load_async=True)
    expected = [t for text in texts for t in tokenizer.encode(text, True, True)]
    with caplog.at_level(logging.WARNING, logger="lingua.data"):
        with DataLoader(args, tokenizer, 0, 1) as loader:
            stream = one_epoch(loader)
            assert loader.bad_lines == 1
    assert stream[:len(expected)] == expected
    path = tmp_path / "web" / "web.chunk.0.jsonl"
    # The first pass's; the producer may be passes ahead.
    assert data_warnings(caplog)[:2] == [f"skipping malformed data line {path}:2: {parse_line(nasty)[1]}",
                                         f"data file {path}: skipped 1 malformed line"]


@pytest.mark.timeout(20)
def test_a_line_over_the_bound_is_skipped_and_the_position_stays_exact(tmp_path, caplog):
    huge = b'{"text": "' + b"a" * MAX_LINE_BYTES + b'"}\n'
    before = "the document before the long line"
    write_chunks(tmp_path, "web", [[doc(before), huge, doc("after")]])
    args = make_args(tmp_path, {"web": 1.0}, batch_size=1, seq_len=8)
    with caplog.at_level(logging.WARNING, logger="lingua.data"):
        with DataLoader(args, TOKENIZER, 0, 1) as loader:
            stream = one_epoch(loader)
            assert loader.bad_lines == 1
            position = loader.state_dict()["sources"]["web"]
    assert split_documents(stream) == [before, "after"]
    # The second pass found the end of the file after the long line and restarted at its first line.
    assert (position["epoch"], position["line"], position["offset"]) == (1, 1, len(doc(before)))
    assert data_warnings(caplog)[0].endswith("web.chunk.0.jsonl:2: longer than 8 MiB")


@pytest.mark.timeout(10)
def test_read_line_never_holds_a_long_line_whole(tmp_path, monkeypatch):
    monkeypatch.setattr(documents, "MAX_LINE_BYTES", 10)
    monkeypatch.setattr(documents, "_READ_BLOCK", 4)
    path = tmp_path / "lines"
    path.write_bytes(b"0123456789\n" + b"x" * 11 + b"\n" + b"y" * 30 + b"\nshort\n" + b"z" * 25 + b"\n" + b"w" * 10)
    with open(path, "rb") as f:
        lines = [documents.read_line(f) for _ in range(7)]
    assert lines == [(b"0123456789\n", 11), (None, 12), (None, 31), (b"short\n", 6), (None, 26), (b"w" * 10, 10),
                     (b"", 0)]


@pytest.mark.timeout(10)
def test_file_totals_come_once_per_file_and_only_when_non_zero(tmp_path, caplog):
    write_chunks(tmp_path, "web", [[doc("clean")], [doc("one bad follows"), b'{"text": ""}\n'], [doc("clean too")]])
    args = make_args(tmp_path, {"web": 1.0}, batch_size=1, seq_len=16)
    with caplog.at_level(logging.WARNING, logger="lingua.data"):
        with DataLoader(args, TOKENIZER, 0, 1) as loader:
            one_epoch(loader)
    path = tmp_path / "web" / "web.chunk.1.jsonl"
    assert data_warnings(caplog) == [f"skipping malformed data line {path}:2: 'text' is empty",
                                     f"data file {path}: skipped 1 malformed line"]


@pytest.mark.timeout(10)
def test_a_file_total_after_a_resume_counts_the_lines_before_it(tmp_path, caplog):
    lines = [doc(f"document number {i}") if i % 3 else b"{broken\n" for i in range(12)]
    write_chunks(tmp_path, "web", [lines])
    args = make_args(tmp_path, {"web": 1.0}, batch_size=1, seq_len=16)
    with DataLoader(args, TOKENIZER, 0, 1) as loader:
        for _ in range(4):
            next(loader)
        state = json.loads(json.dumps(loader.state_dict()))
    assert 0 < state["sources"]["web"]["bad_lines_in_file"] == state["bad_lines"] < 4
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="lingua.data"):
        with DataLoader(args, TOKENIZER, 0, 1) as resumed:
            resumed.load_state_dict(state)
            one_epoch(resumed)
            assert resumed.bad_lines == 4 + 1  # the first line of the next pass is broken too
    assert f"data file {tmp_path / 'web' / 'web.chunk.0.jsonl'}: skipped 4 malformed lines" in data_warnings(caplog)


@pytest.mark.timeout(10)
def test_a_shared_file_total_says_it_is_this_ranks_share(tmp_path, caplog):
    write_chunks(tmp_path, "web", [[doc("a"), doc("b"), b"junk\n", b"junk\n", doc("c"), doc("d")]])
    with caplog.at_level(logging.WARNING, logger="lingua.data"):
        with DataLoader(make_args(tmp_path, {"web": 1.0}, batch_size=1, seq_len=8), TOKENIZER, 1, 2) as loader:
            one_epoch(loader)
    assert data_warnings(caplog)[-1].endswith("web.chunk.0.jsonl: skipped 1 malformed line (this rank reads 1/2 "
                                              "of its lines)")


@pytest.mark.timeout(10)
def test_eval_reader_follows_the_same_rule_and_logs_file_totals(tmp_path, caplog):
    write_chunks(tmp_path, "web", [["train"]])
    write_chunks(tmp_path, "web", [[doc("held out"), SURROGATE_LINE, NESTED_LINE, b'{"text": " "}\n', b"\n",
                                    b'\xef\xbb\xbf{"text": "bom"}\r\n']], suffix="val")
    with caplog.at_level(logging.WARNING, logger="lingua.data"):
        batches = list(iterate_eval_batches(make_args(tmp_path, {"web": 1.0}, seq_len=32), TOKENIZER, 0, 1))
    assert len(batches) == 1
    row = batches[0]["input_ids"][0].tolist()
    assert split_documents(row) == ["held out", "bom"]
    path = tmp_path / "web" / "web.val.jsonl"
    messages = data_warnings(caplog)
    assert [m.split(": ")[0] for m in messages[:3]] == [f"skipping malformed data line {path}:{n}" for n in (2, 3, 4)]
    assert messages[3:] == [f"data file {path}: skipped 3 malformed lines"]
