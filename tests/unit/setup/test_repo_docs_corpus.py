"""setup/repo_docs_corpus.py: the post-cutoff held-out split is the committed snapshot's bytes, whole files only,
held out (no training chunk), refused in one sentence when the snapshot was changed."""

import json

import pytest

from lingua.data import DataArgs
from lingua.evaluation.heldout import eval_files
from lingua.errors import DataError
from setup import repo_docs_corpus as repo_docs


def test_the_installed_split_is_the_frozen_snapshot_and_a_second_install_is_a_no_op(tmp_path):
    source_dir = repo_docs.prepare_repo_docs(tmp_path)
    val = source_dir / "repodocs.val.jsonl"
    assert val.read_bytes() == repo_docs.SNAPSHOT.read_bytes()
    marker = json.loads((source_dir / "corpus_ready.json").read_text())
    assert marker["version"] == repo_docs.VERSION and marker["sha256"] == repo_docs.SNAPSHOT_SHA256
    docs = [json.loads(line) for line in val.read_text().splitlines()]
    assert marker["files"] == [d["file"] for d in docs] and len(set(marker["files"])) == len(docs)  # one doc a file
    assert sum(len(d["text"]) for d in docs) >= repo_docs.MIN_CHARS
    assert not list(source_dir.glob("*.chunk.*"))  # held out only: nothing for training to read
    # A config reads it as an eval source beside the training sources.
    files = eval_files(DataArgs(root_dir=str(tmp_path), sources={"repodocs": 1.0}, eval_sources=["repodocs"]))
    assert files == {"repodocs": [val]}
    stamp = (source_dir / "corpus_ready.json").stat().st_mtime_ns
    repo_docs.prepare_repo_docs(tmp_path)
    assert (source_dir / "corpus_ready.json").stat().st_mtime_ns == stamp


def test_a_changed_snapshot_is_refused_in_one_sentence(tmp_path):
    changed = tmp_path / "changed.jsonl"
    changed.write_bytes(repo_docs.SNAPSHOT.read_bytes() + b'{"text": "new", "file": "x.md"}\n')
    with pytest.raises(DataError, match=r"cannot be installed: .*not the frozen .*bump VERSION"):
        repo_docs.prepare_repo_docs(tmp_path / "corpus", snapshot=changed)
    assert not (tmp_path / "corpus" / "repodocs").exists()


def test_the_split_takes_whole_files_markdown_and_docstrings(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "lingua").mkdir()
    (tmp_path / "README.md").write_text("# Read me\n\n" + "word " * 40)
    (tmp_path / "docs" / "page.md").write_text("# Page\n\n" + "text " * 40)
    (tmp_path / "lingua" / "mod.py").write_text('"""The module."""\n\nclass Box:\n    """A box."""\n\n'
                                                 '    def open(self):\n        """Opens it."""\n\nX = 1\n')
    (tmp_path / "lingua" / "empty.py").write_text("X = 1\n")
    docs = repo_docs.collect_repo_docs(tmp_path)
    assert [d["file"] for d in docs] == ["README.md", "docs/page.md", "lingua/mod.py"]
    assert docs[2]["text"] == ("Module lingua.mod\n\nThe module.\n\nlingua.mod.Box\n\nA box.\n\n"
                               "lingua.mod.Box.open\n\nOpens it.")
    chosen = repo_docs.held_out_files(docs, min_chars=150)
    assert 1 <= len(chosen) <= 3 and all(d in docs for d in chosen)
    assert sum(len(d["text"]) for d in chosen) >= 150
    with pytest.raises(DataError, match="fewer than"):
        repo_docs.held_out_files(docs, min_chars=10**6)
