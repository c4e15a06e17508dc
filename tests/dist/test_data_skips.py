"""Malformed data lines in a 2-student run: training goes on, the log rows sum the students' skips and the
summary reports them. Hard timeout: a hang fails the test."""

import pytest

from lingua.run.dump_dir import RunDir, last_train_row
from tests.runs import assert_ok, base_overrides, torchrun, write_corpus

pytestmark = pytest.mark.slow  # every test here launches processes


@pytest.mark.timeout(120)
def test_students_train_past_bad_lines_and_the_summary_counts_them(tmp_path):
    corpus = write_corpus(tmp_path / "corpus", n_chunks=2, docs_per_chunk=40)
    bad = {0: [b'{"text": "caf\\u00e9 truncated emoji \\ud83d"}\n'],  # rank 0 reads chunk 0, rank 1 chunk 1
           1: [b"[" * 50_000 + b"\n", b'{"text": ""}\n']}
    for i, lines in bad.items():
        chunk = corpus / "text" / f"text.chunk.{i}.jsonl"
        chunk.write_bytes(b"".join(lines) + chunk.read_bytes())
    dump = tmp_path / "run"
    result = torchrun(2, base_overrides(corpus, dump, steps=3), timeout=100)
    assert_ok(result)
    assert last_train_row(dump)["data/bad_lines"] == 3
    assert "skipped 3 malformed data lines (warnings in logs/rank_<r>.log)" in result.stdout
    rank1 = RunDir(dump).rank_log(1).read_text()
    assert f"skipping malformed data line {corpus / 'text' / 'text.chunk.1.jsonl'}:1: nested deeper than 100" in rank1
    assert f"{corpus / 'text' / 'text.chunk.1.jsonl'}:2: 'text' is empty" in rank1
