"""Data loader: packing, sharding without drops, mixing, exact resume, malformed lines, eval, chunk preparation.

All on the byte tokenizer (bos=256, eos=257), so a document's tokens are [256] + its UTF-8 bytes + [257].
"""

import json
import logging
import multiprocessing
import random
from pathlib import Path

import pytest
import torch

from lingua.args import dataclass_from_dict
from lingua.data import DataArgs, DataLoader
from lingua.loading.documents import shard_files
from lingua.evaluation.heldout import iterate_eval_batches
from lingua.tokenizer import ByteTokenizer, TokenizerArgs
from setup.download_prepare_hf_data import prepare_source, shuffle_and_split

TOKENIZER = ByteTokenizer()
BOS, EOS = TOKENIZER.bos_id, TOKENIZER.eos_id


def write_chunks(root, source: str, files: list[list], suffix: str = "chunk") -> None:
    """Write `files[i]` (texts, or raw lines as bytes) to root/source/source.chunk.<i>.jsonl."""
    directory = root / source
    directory.mkdir(parents=True, exist_ok=True)
    for i, lines in enumerate(files):
        name = f"{source}.{suffix}.{i}.jsonl" if suffix == "chunk" else f"{source}.{suffix}.jsonl"
        with open(directory / name, "wb") as f:
            for line in lines:
                f.write(line if isinstance(line, bytes) else (json.dumps({"text": line}) + "\n").encode())


def make_args(root, sources, **overrides) -> DataArgs:
    values = dict(root_dir=str(root), sources=sources, batch_size=2, seq_len=16, seed=7, load_async=False)
    values.update(overrides)
    return DataArgs(**values)


def windows_of(batch) -> list[list[int]]:
    """The seq_len+1 token windows of a training batch (inputs plus the last label)."""
    return torch.cat([batch["input_ids"], batch["labels"][:, -1:]], dim=1).tolist()


def split_documents(stream: list[int]) -> list[str]:
    """Complete documents (bos ... eos) in a token stream, decoded."""
    docs, current = [], None
    for token in stream:
        if token == BOS:
            current = []
        elif token == EOS:
            if current is not None:
                docs.append(bytes(current).decode())
            current = None
        elif current is not None:
            current.append(token)
    return docs


def split_at_bos(stream: list[int]) -> list[list[int]]:
    """The token lists that start with bos, each up to the next bos."""
    starts = [i for i, token in enumerate(stream) if token == BOS] + [len(stream)]
    return [stream[a:b] for a, b in zip(starts, starts[1:])]


def random_texts(rng: random.Random, n: int, prefix: str, max_len: int = 40) -> list[str]:
    return [f"{prefix}{i}:" + "".join(rng.choices("abcdefgh ", k=rng.randint(0, max_len))) for i in range(n)]


@pytest.mark.timeout(10)
def test_packing_concatenates_windows_into_the_token_stream(tmp_path):
    texts = random_texts(random.Random(0), 25, "doc")
    write_chunks(tmp_path, "web", [texts])
    args = make_args(tmp_path, {"web": 1.0}, batch_size=3, seq_len=16)
    stream, doc_index = [], []  # doc_index: which document (counting from the start) each token is in
    for n, text in enumerate(texts * 3):
        ids = TOKENIZER.encode(text, add_bos=True, add_eos=True)
        stream += ids
        doc_index += [n] * len(ids)
    windows, doc_windows = [], []
    with DataLoader(args, TOKENIZER, dp_rank=0, dp_degree=1) as loader:
        for _ in range(30):
            batch = next(loader)
            assert batch["input_ids"].shape == batch["labels"].shape == batch["doc_ids"].shape == (3, 16)
            assert batch["input_ids"].dtype == batch["labels"].dtype == torch.long
            assert batch["doc_ids"].dtype == torch.int32
            assert torch.equal(batch["labels"][:, :-1], batch["input_ids"][:, 1:])
            assert not (batch["labels"] == -100).any()
            windows += windows_of(batch)
            doc_windows += batch["doc_ids"].tolist()
        state = loader.state_dict()
    flat = [t for w in windows for t in w]
    assert len(flat) == 30 * 3 * 17 < len(stream)
    assert flat == stream[:len(flat)]
    assert state["sources"]["web"]["epoch"] >= 1 and state["windows"] == 90
    for k, doc_ids in enumerate(doc_windows):
        expected = doc_index[k * 17:k * 17 + 16]
        assert doc_ids == [d - expected[0] for d in expected]


@pytest.mark.timeout(10)
@pytest.mark.parametrize("n_files,dp_degree", [(1, 1), (1, 3), (3, 2), (3, 3), (3, 5), (4, 7), (5, 2)])
def test_shard_files_assigns_every_line_to_exactly_one_rank(n_files, dp_degree):
    files = [f"f{i}" for i in range(n_files)]
    owners = {}
    for rank in range(dp_degree):
        for shard in shard_files(files, rank, dp_degree):
            for line in range(50):
                if line % shard.stride == shard.offset:
                    assert (shard.path, line) not in owners, "a line is read by two ranks"
                    owners[(shard.path, line)] = rank
    assert set(owners) == {(f, line) for f in files for line in range(50)}
    assert set(owners.values()) == set(range(dp_degree)), "every rank gets data"


@pytest.mark.timeout(15)
@pytest.mark.parametrize("dp_degree", [2, 5])
def test_every_document_is_read_by_exactly_one_rank(tmp_path, dp_degree):
    files = [[f"f{f}-line{line}" for line in range(n)] for f, n in enumerate([7, 5, 6])]
    write_chunks(tmp_path, "web", files)
    args = make_args(tmp_path, {"web": 1.0}, batch_size=1, seq_len=8)
    per_rank = []
    for rank in range(dp_degree):
        with DataLoader(args, TOKENIZER, rank, dp_degree) as loader:
            stream = []
            while loader.state_dict()["sources"]["web"]["epoch"] == 0:
                stream += windows_of(next(loader))[0]
        docs = split_documents(stream)
        per_rank.append(set(docs))
        expected = [text for shard in loader.shards["web"]
                    for text in files[int(Path(shard.path).name.split(".")[2])][shard.offset::shard.stride]]
        assert docs[:len(expected)] == expected, "the rank reads its share in file order"
        assert set(docs) == set(expected)
    everything = {text for lines in files for text in lines}
    assert set().union(*per_rank) == everything
    assert sum(len(docs) for docs in per_rank) == len(everything), "no document read by two ranks"


@pytest.mark.timeout(15)
def test_mixing_follows_weights_and_is_reproducible(tmp_path):
    write_chunks(tmp_path, "a", [["a" * 30] * 10, ["a" * 20] * 10])
    write_chunks(tmp_path, "b", [["b" * 25] * 10])
    write_chunks(tmp_path, "unused", [["u" * 25] * 10])
    args = make_args(tmp_path, {"a": 3.0, "b": 1.0, "unused": 0.0}, batch_size=8, seq_len=16)
    with DataLoader(args, TOKENIZER, 0, 1) as loader:
        batches = [next(loader) for _ in range(60)]
    letters = [next(t for t in window if t < 256) for b in batches for window in windows_of(b)]
    assert len(letters) == 480 and set(letters) == {ord("a"), ord("b")}
    share_a = letters.count(ord("a")) / len(letters)
    assert abs(share_a - 0.75) < 0.06
    with DataLoader(args, TOKENIZER, 0, 1) as again:
        assert all(torch.equal(next(again)["input_ids"], b["input_ids"]) for b in batches)
    other_seed = make_args(tmp_path, {"a": 3.0, "b": 1.0}, batch_size=8, seq_len=16, seed=8)
    with DataLoader(other_seed, TOKENIZER, 0, 1) as other:
        assert not all(torch.equal(next(other)["input_ids"], b["input_ids"]) for b in batches[:5])


def _resume_corpus(root):
    rng = random.Random(1)
    # Documents longer than a window, so a checkpoint usually falls inside one; plus malformed lines.
    web = [random_texts(rng, 12, "w", max_len=60) + [b"{broken\n"], random_texts(rng, 9, "x", max_len=60)]
    write_chunks(root, "web", web)
    write_chunks(root, "code", [random_texts(rng, 8, "c", max_len=30) + [b'{"text": 3}\n']])


@pytest.mark.timeout(20)
@pytest.mark.parametrize("save_async,load_async", [(False, False), (True, True), (True, False), (False, True)])
def test_state_restores_the_exact_stream(tmp_path, save_async, load_async):
    _resume_corpus(tmp_path)
    sources = {"web": 2.0, "code": 1.0}
    with DataLoader(make_args(tmp_path, sources), TOKENIZER, 1, 2) as reference:
        for _ in range(9):
            next(reference)
        reference_state = reference.state_dict()
        expected = [next(reference) for _ in range(12)]

    with DataLoader(make_args(tmp_path, sources, load_async=save_async, prefetch_size=4), TOKENIZER, 1, 2) as saver:
        for _ in range(9):
            next(saver)
        state = json.loads(json.dumps(saver.state_dict()))
    assert state == reference_state, "prefetched batches leaked into the state"
    assert any(s["document"] is not None for s in state["sources"].values()), "test should cut a document"

    with DataLoader(make_args(tmp_path, sources, load_async=load_async, prefetch_size=3), TOKENIZER, 1, 2) as resumed:
        resumed.load_state_dict(state)
        for want in expected:
            got = next(resumed)
            for key in ("input_ids", "labels", "doc_ids"):
                assert torch.equal(got[key], want[key])
        assert resumed.state_dict()["windows"] == (9 + 12) * 2
        assert resumed.bad_lines >= state["bad_lines"]
        # Loading again mid-stream rewinds, also with a live producer process.
        resumed.load_state_dict(state)
        assert torch.equal(next(resumed)["input_ids"], expected[0]["input_ids"])


@pytest.mark.timeout(10)
def test_state_from_another_rank_layout_is_rejected(tmp_path):
    write_chunks(tmp_path, "web", [["x" * 10] * 3] * 2)
    with DataLoader(make_args(tmp_path, {"web": 1.0}), TOKENIZER, 0, 2) as loader:
        state = loader.state_dict()
    with DataLoader(make_args(tmp_path, {"web": 1.0}), TOKENIZER, 0, 1) as loader:
        with pytest.raises(ValueError, match="same number of training ranks"):
            loader.load_state_dict(state)


@pytest.mark.timeout(10)
def test_malformed_lines_are_counted_skipped_and_rate_limited(tmp_path, caplog):
    good = [f"good document {i}" for i in range(6)]
    bad = [b"not json at all\n", b'{"txt": "wrong field"}\n', b'{"text": 5}\n', b"[1, 2]\n",
           b'\xff\xfe{"text": "x"}\n', b'{"text": null}\n']
    lines = []
    for i in range(6):
        lines += [(json.dumps({"text": good[i]}) + "\n").encode()] + bad * 4 + [b"\n"]
    lines[-1] = (json.dumps({"content": "content field works"}) + "\n").encode()
    write_chunks(tmp_path, "web", [lines])
    args = make_args(tmp_path, {"web": 1.0}, batch_size=1, seq_len=32)
    with caplog.at_level(logging.WARNING, logger="lingua.data"):
        with DataLoader(args, TOKENIZER, 0, 1) as loader:
            stream = []
            while loader.state_dict()["sources"]["web"]["epoch"] == 0:
                stream += windows_of(next(loader))[0]
            assert loader.bad_lines == 6 * 6 * 4 == loader.state_dict()["bad_lines"]
    assert split_documents(stream)[:7] == good + ["content field works"]
    warnings = [r for r in caplog.records if r.name == "lingua.data" and r.levelno == logging.WARNING]
    assert len(warnings) == 5 + 2 + 1  # five in full, then the totals at 10 and 100, then the file's total
    assert warnings[-1].getMessage().endswith("web.chunk.0.jsonl: skipped 144 malformed lines")


@pytest.mark.timeout(10)
@pytest.mark.parametrize("load_async", [False, True])
def test_source_without_valid_documents_raises_readably(tmp_path, load_async):
    write_chunks(tmp_path, "web", [[b"junk\n", b'{"text": 1}\n']])
    with DataLoader(make_args(tmp_path, {"web": 1.0}, load_async=load_async), TOKENIZER, 0, 1) as loader:
        with pytest.raises(ValueError, match="Source 'web' has no valid document"):
            next(loader)


@pytest.mark.timeout(10)
def test_missing_or_empty_source_dir_names_the_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "nothere")):
        DataLoader(make_args(tmp_path, {"nothere": 1.0}), TOKENIZER, 0, 1)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"empty' has no '\*\.chunk"):
        DataLoader(make_args(tmp_path, {"empty": 1.0}), TOKENIZER, 0, 1)
    with pytest.raises(ValueError, match="data.root_dir"):
        DataLoader(DataArgs(sources={"web": 1.0}), TOKENIZER, 0, 1)
    with pytest.raises(ValueError, match="data.sources"):
        DataLoader(make_args(tmp_path, {}), TOKENIZER, 0, 1)


@pytest.mark.timeout(20)
def test_producer_process_stops_on_close(tmp_path):
    write_chunks(tmp_path, "web", [random_texts(random.Random(2), 20, "d")])
    loader = DataLoader(make_args(tmp_path, {"web": 1.0}, load_async=True, prefetch_size=2), TOKENIZER, 0, 1)
    next(loader)
    process = loader._producer.process
    assert process.is_alive()
    loader.close()
    assert not process.is_alive()
    loader.close()
    with DataLoader(make_args(tmp_path, {"web": 1.0}, load_async=True), TOKENIZER, 0, 1) as loader:
        next(loader)
        process = loader._producer.process
    assert not process.is_alive()
    assert not multiprocessing.active_children()


@pytest.mark.timeout(10)
def test_data_args_load_through_the_config_system(tmp_path):
    args = dataclass_from_dict(DataArgs, {"root_dir": str(tmp_path), "sources": {"web": 2, "code": 0.5},
                                          "eval_sources": ["web"], "tokenizer": {"name": "bytes"}})
    assert args.sources == {"web": 2.0, "code": 0.5} and args.eval_sources == ["web"]
    assert args.tokenizer == TokenizerArgs(name="bytes")


@pytest.mark.timeout(15)
@pytest.mark.parametrize("dp_degree", [1, 3])
def test_eval_batches_cover_the_validation_docs_once(tmp_path, dp_degree):
    val = {"web": [f"web-val-{i}-" + "v" * (i % 7) for i in range(11)], "code": [f"code-val-{i}" for i in range(4)]}
    for name, texts in val.items():
        write_chunks(tmp_path, name, [["train"]])
        write_chunks(tmp_path, name, [texts], suffix="val")
    args = make_args(tmp_path, {"web": 1.0, "code": 1.0}, batch_size=2, seq_len=16)
    per_rank, padded = [], 0
    for rank in range(dp_degree):
        stream, batches = [], list(iterate_eval_batches(args, TOKENIZER, rank, dp_degree))
        for batch in batches:
            assert batch["input_ids"].shape == batch["labels"].shape == batch["doc_ids"].shape == (2, 16)
            for row in range(2):
                n_labels = int((batch["labels"][row] != -100).sum())
                assert (batch["labels"][row, n_labels:] == -100).all()
                if n_labels:
                    stream += batch["input_ids"][row, :n_labels].tolist() + [int(batch["labels"][row, n_labels - 1])]
        last = batches[-1]
        padded += int((last["labels"] == -100).sum())
        assert (last["input_ids"][last["labels"] == -100] == EOS).all(), "padding (and the final eos) are eos"
        # A window's first token is never a label, so a document's eos may be missing: split at bos.
        per_rank.append([bytes(t for t in doc if t < 256).decode() for doc in split_at_bos(stream)])
        assert len(list(iterate_eval_batches(args, TOKENIZER, rank, dp_degree, max_batches=1))) == 1
    assert sorted(d for docs in per_rank for d in docs) == sorted(val["web"] + val["code"])
    assert padded > 0


@pytest.mark.timeout(10)
def test_eval_without_validation_files_names_the_directory(tmp_path):
    write_chunks(tmp_path, "web", [["train"]])
    args = make_args(tmp_path, {"web": 1.0})
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "web")):
        iterate_eval_batches(args, TOKENIZER, 0, 1)
    write_chunks(tmp_path, "code", [["train"]])
    write_chunks(tmp_path, "code", [["val"]], suffix="val")
    assert len(list(iterate_eval_batches(make_args(tmp_path, {"web": 1.0, "code": 1.0}), TOKENIZER, 0, 1))) == 1
    explicit = make_args(tmp_path, {"web": 1.0, "code": 1.0}, eval_sources=["code", "web"])
    with pytest.raises(FileNotFoundError, match="data.eval_sources"):
        iterate_eval_batches(explicit, TOKENIZER, 0, 1)


def _jsonl_lines(paths) -> list[bytes]:
    return [line for p in paths for line in p.read_bytes().splitlines(keepends=True)]


@pytest.mark.timeout(15)
def test_shuffle_and_split_keeps_every_document(tmp_path):
    inputs = [tmp_path / "in0.jsonl", tmp_path / "in1.jsonl"]
    originals = [(json.dumps({"text": f"document {i}", "id": i}) + "\n").encode() for i in range(103)]
    inputs[0].write_bytes(b"".join(originals[:60]) + b"\n   \n")
    inputs[1].write_bytes(b"".join(originals[60:])[:-1])  # no newline at the end of the last line
    stats = shuffle_and_split(inputs, tmp_path / "out", "web", n_chunks=4, val_docs=10, seed=3)
    chunks = [tmp_path / "out" / f"web.chunk.{i}.jsonl" for i in range(4)]
    val = tmp_path / "out" / "web.val.jsonl"
    sizes = [len(_jsonl_lines([c])) for c in chunks]
    assert sizes == stats["chunk_sizes"] and sum(sizes) == 93 and max(sizes) - min(sizes) <= 1
    assert len(_jsonl_lines([val])) == stats["n_val_docs"] == 10
    written = _jsonl_lines(chunks + [val])
    assert sorted(written) == sorted(originals)
    assert _jsonl_lines(chunks) != sorted(_jsonl_lines(chunks), key=originals.index), "chunks are shuffled"

    again = shuffle_and_split(inputs, tmp_path / "again", "web", n_chunks=4, val_docs=10, seed=3)
    assert again == stats
    assert all((tmp_path / "again" / c.name).read_bytes() == c.read_bytes() for c in chunks + [val])
    shuffle_and_split(inputs, tmp_path / "other", "web", n_chunks=4, val_docs=10, seed=4)
    assert (tmp_path / "other" / "web.val.jsonl").read_bytes() != val.read_bytes()
    no_val = shuffle_and_split(inputs, tmp_path / "no_val", "web", n_chunks=2, val_docs=0)
    assert no_val["n_train_docs"] == 103 and not (tmp_path / "no_val" / "web.val.jsonl").exists()
    with pytest.raises(ValueError, match="cannot fill 100 chunks"):
        shuffle_and_split(inputs, tmp_path / "too_many", "web", n_chunks=100, val_docs=10)


@pytest.mark.timeout(15)
def test_prepared_layout_feeds_the_loader(tmp_path):
    source = tmp_path / "raw.jsonl"
    source.write_text("".join(json.dumps({"text": f"doc {i}"}) + "\n" for i in range(30)))
    prepare_source([source], tmp_path / "data", "web", n_chunks=3, val_docs=5)
    prepare_source([source], tmp_path / "data", "web", n_chunks=2, val_docs=5)  # replaces, no stale chunks
    assert sorted(p.name for p in (tmp_path / "data" / "web").glob("*.jsonl")) == \
        ["web.chunk.0.jsonl", "web.chunk.1.jsonl", "web.val.jsonl"]
    args = make_args(tmp_path / "data", {"web": 1.0}, batch_size=1, seq_len=8)
    seen = set()
    for rank in range(2):
        with DataLoader(args, TOKENIZER, rank, 2) as loader:
            stream = []
            while loader.state_dict()["sources"]["web"]["epoch"] == 0:
                stream += windows_of(next(loader))[0]
            seen |= set(split_documents(stream))
    val_lines = (tmp_path / "data" / "web" / "web.val.jsonl").read_text().splitlines()
    val_docs = {json.loads(line)["text"] for line in val_lines}
    assert seen | val_docs == {f"doc {i}" for i in range(30)} and not seen & val_docs
