"""A rank's training stream without torch: documents read from its shards, tokenized, packed into windows and
mixed over sources, as numpy batches, with the state dict that resumes it exactly (see `lingua/data.py`).

Importing this module does not import torch, so a producer process (`lingua/loading/producer.py`) that builds these
batches starts in a fraction of a second.
"""

import functools
import logging
import os
import signal
from collections import deque
from dataclasses import dataclass
from typing import Optional

import numpy as np

from lingua.loading.documents import FileShard, MalformedLines, read_line
from lingua.errors import DataError
from lingua.loading.process_pool import BrokenProcessPool, spawn_pool, stop_pool
from lingua.tokenizer import Tokenizer

logger = logging.getLogger("lingua.data")

STATE_VERSION = 1
CHUNK_DOCS = 16  # documents per tokenizing task (a task's round trip costs about as much as tokenizing a few)


class _SourceReader:
    """One source's documents in this rank's shards, looping forever, from a resumable position."""

    def __init__(self, name: str, shards: list[FileShard], position: dict, malformed: MalformedLines):
        self.name = name
        self.shards = shards
        self.malformed = malformed
        self.file_index = position["file_index"]
        self.offset = position["offset"]
        self.line = position["line"]
        self.epoch = position["epoch"]
        # The current file's skips so far, for its total at the end (absent from states of older code).
        malformed.in_file[shards[self.file_index].path] = position.get("bad_lines_in_file", 0)
        self._file = None
        # A pass that starts mid-way after a restore may legitimately find nothing before wrapping.
        self._full_pass = self.file_index == 0 and self.offset == 0
        self._docs_this_pass = 0

    def position(self) -> dict:
        return dict(file_index=self.file_index, offset=self.offset, line=self.line, epoch=self.epoch,
                    bad_lines_in_file=self.malformed.in_file.get(self.shards[self.file_index].path, 0))

    def next_document(self) -> tuple[str, dict]:
        """(text, location of its line) of the next valid document."""
        while True:
            if self._file is None:
                self._file = open(self.shards[self.file_index].path, "rb")
                self._file.seek(self.offset)
            raw, size = read_line(self._file)
            if not size:
                self._next_file()
                continue
            shard = self.shards[self.file_index]
            location = dict(file_index=self.file_index, offset=self.offset, line=self.line)
            self.offset += size
            self.line += 1
            if location["line"] % shard.stride != shard.offset:
                continue
            text = self.malformed.text_of(raw, shard.path, location["line"])
            if text is not None:
                self._docs_this_pass += 1
                return text, location

    def _next_file(self) -> None:
        self.close()
        self.malformed.file_done(self.shards[self.file_index])
        self.file_index, self.offset, self.line = self.file_index + 1, 0, 0
        if self.file_index < len(self.shards):
            return
        if self._full_pass and self._docs_this_pass == 0:
            raise DataError(f"Source '{self.name}' has no valid document in this rank's share "
                            f"{[s.describe() for s in self.shards]} ([file, stride, offset]); add documents "
                            f"or chunk files, or train on fewer data-parallel ranks.")
        self.file_index, self.epoch = 0, self.epoch + 1
        self._full_pass, self._docs_this_pass = True, 0
        logger.info(f"data source '{self.name}': starting epoch {self.epoch}")

    def document_at(self, location: dict) -> str:
        """The text of the document whose line starts at `location` (to resume a cut document)."""
        path = self.shards[location["file_index"]].path
        with open(path, "rb") as f:
            f.seek(location["offset"])
            text = MalformedLines().text_of(read_line(f)[0], path, location["line"])
        if text is None:
            raise DataError(f"The checkpointed data position {path}:{location['line'] + 1} is no longer a valid "
                            f"document; the data files changed since the checkpoint. Restore them or resume "
                            f"without the data state.")
        return text

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


class _Documents:
    """A source's next documents, tokenized here; the reader's position and this source's skipped lines as of the
    last one handed out."""

    def __init__(self, reader: _SourceReader, encode):
        self.reader, self.encode = reader, encode
        self.bad_lines = 0  # malformed lines this source skipped up to the last document handed out
        self.read_bad_lines = 0  # and up to the last one read

    def read(self) -> tuple[str, dict]:
        before = self.reader.malformed.count
        text, location = self.reader.next_document()
        self.read_bad_lines += self.reader.malformed.count - before
        return text, location

    def next(self) -> tuple[list[int], dict]:
        text, location = self.read()
        self.bad_lines = self.read_bad_lines
        return self.encode(text), location

    def position(self) -> dict:
        return self.reader.position()


class _DocumentsAhead(_Documents):
    """The same documents in the same order, read ahead and tokenized by a pool of worker processes (`CHUNK_DOCS` a
    task, `depth` tasks in flight); the position and counts are those after the last one handed out, not read."""

    def __init__(self, reader: _SourceReader, pool, depth: int):
        super().__init__(reader, encode=None)
        self.pool, self.depth = pool, depth
        self.tasks: deque = deque()  # (the chunk's pending tokens, [(location, position, bad lines) after each])
        self.ready: deque = deque()  # (tokens, location, position, bad lines) of the chunk being handed out
        self._position = reader.position()

    def next(self) -> tuple[list[int], dict]:
        try:  # a worker killed from outside (the OOM killer) breaks the pool: a submit or a result raises; never wait
            while len(self.tasks) < self.depth:
                texts, marks = [], []
                for _ in range(CHUNK_DOCS):
                    text, location = self.read()
                    texts.append(text)
                    marks.append((location, self.reader.position(), self.read_bad_lines))
                self.tasks.append((self.pool.submit(_encode_in_worker, texts), marks))
            if not self.ready:
                pending, marks = self.tasks.popleft()
                encoded = pending.result()
                self.ready.extend((tokens, *mark) for tokens, mark in zip(encoded, marks))
        except BrokenProcessPool as err:
            raise DataError(f"A tokenizing worker of the data producer died ({err}); the run stops here and "
                            f"resumes from its last checkpoint (data.workers=0 tokenizes in the producer).") from None
        tokens, location, self._position, self.bad_lines = self.ready.popleft()
        return tokens, location

    def position(self) -> dict:
        return self._position


_worker_encode = None  # a tokenizing worker's tokenizer.encode, with the stream's bos/eos settings


def _start_worker(tokenizer: Tokenizer, add_bos: bool, add_eos: bool, parent_pid: int) -> None:
    from lingua.loading.producer import die_with_parent

    global _worker_encode
    die_with_parent(parent_pid, True)
    for name in ("SIGINT", "SIGTERM", "SIGUSR1", "SIGUSR2"):  # its producer's rank decides what they mean
        signal.signal(getattr(signal, name), signal.SIG_IGN)
    _worker_encode = functools.partial(tokenizer.encode, add_bos=add_bos, add_eos=add_eos)


def _encode_in_worker(texts: list[str]) -> list[list[int]]:
    return [_worker_encode(text) for text in texts]


class _SourcePacker:
    """Cuts one source's token stream into windows; a document cut at a window end carries over."""

    def __init__(self, docs: _Documents, encode, cut_document: Optional[dict]):
        self.docs = docs
        self.doc_tokens: list[int] = []
        self.doc_pos = 0
        self.doc_location: Optional[dict] = None
        if cut_document is not None:
            self.doc_location = {k: cut_document[k] for k in ("file_index", "offset", "line")}
            self.doc_tokens = encode(docs.reader.document_at(self.doc_location))
            self.doc_pos = cut_document["token"]

    def window(self, length: int) -> tuple[list[int], list[int]]:
        """(tokens, doc_ids) of the next `length` tokens."""
        tokens: list[int] = []
        doc_ids: list[int] = []
        while len(tokens) < length:
            if self.doc_pos >= len(self.doc_tokens):
                self.doc_tokens, self.doc_location = self.docs.next()
                self.doc_pos = 0
                continue
            take = min(length - len(tokens), len(self.doc_tokens) - self.doc_pos)
            doc_ids.extend([doc_ids[-1] + 1 if doc_ids else 0] * take)
            tokens.extend(self.doc_tokens[self.doc_pos:self.doc_pos + take])
            self.doc_pos += take
        return tokens, doc_ids

    def state(self) -> dict:
        cut = None if self.doc_pos >= len(self.doc_tokens) else dict(self.doc_location, token=self.doc_pos)
        return dict(self.docs.position(), document=cut)


def initial_state(shards: dict[str, list[FileShard]], dp_rank: int, dp_degree: int) -> dict:
    sources = {name: dict(file_index=0, offset=0, line=0, epoch=0, bad_lines_in_file=0, document=None,
                          files=[s.describe() for s in source_shards]) for name, source_shards in shards.items()}
    return dict(version=STATE_VERSION, dp_rank=dp_rank, dp_degree=dp_degree, windows=0, bad_lines=0, sources=sources)


def _train_batch(windows: list[tuple[list[int], list[int]]], source_ids: list[int]) -> dict[str, np.ndarray]:
    tokens = np.array([w[0] for w in windows], dtype=np.int64)
    doc_ids = np.array([w[1] for w in windows], dtype=np.int32)
    # A row is one source's window: its index in `active_sources` says which (several teachers route by it).
    return dict(input_ids=np.ascontiguousarray(tokens[:, :-1]), labels=np.ascontiguousarray(tokens[:, 1:]),
                doc_ids=np.ascontiguousarray(doc_ids[:, :-1]), source_ids=np.array(source_ids, dtype=np.int32))


def active_sources(sources: dict) -> list[str]:
    """The sources a stream reads (positive weight), in config order: a batch's `source_ids` index this list."""
    return [name for name, weight in sources.items() if weight > 0]


@dataclass(frozen=True)
class StreamSettings:
    """The data settings that decide a rank's stream (DataArgs' share of them, without importing torch)."""

    sources: dict  # source name -> weight
    batch_size: int
    seq_len: int
    seed: int
    add_bos: bool
    add_eos: bool
    workers: int = 0  # tokenizing worker processes (0: tokenize in the stream's own process)


class TrainStream:
    """The deterministic batch stream of one rank, starting from a state dict: an iterator of numpy batches."""

    def __init__(self, args: StreamSettings, tokenizer: Tokenizer, shards: dict[str, list[FileShard]], state: dict):
        self.batch_size, self.window_len = args.batch_size, args.seq_len + 1
        self.seed, self.dp_rank, self.dp_degree = args.seed, state["dp_rank"], state["dp_degree"]
        self.names = list(shards)
        weights = np.array([args.sources[name] for name in self.names], dtype=np.float64)
        self.cumulative = np.cumsum(weights) / weights.sum()
        self.windows = state["windows"]
        self.files = {name: state["sources"][name]["files"] for name in self.names}
        self.malformed = MalformedLines(state["bad_lines"])
        self.bad_lines_before = state["bad_lines"]
        self.packers = {}
        encode = functools.partial(tokenizer.encode, add_bos=args.add_bos, add_eos=args.add_eos)
        self.pool = None
        try:
            if args.workers:  # spawned, never forked: the producer may hold threads
                self.pool = spawn_pool(args.workers, _start_worker, (tokenizer, args.add_bos, args.add_eos, os.getpid()))
            for name in self.names:
                source_state = state["sources"][name]
                reader = _SourceReader(name, shards[name], source_state, self.malformed)
                docs = _DocumentsAhead(reader, self.pool, 2 * args.workers) if self.pool else _Documents(reader, encode)
                self.packers[name] = _SourcePacker(docs, encode, source_state["document"])
        except BaseException:
            self.close()
            raise

    def _source_of_window(self, window_index: int) -> str:
        # A pure function of (seed, rank, index): the state needs only the window count.
        u = np.random.default_rng([self.seed, self.dp_rank, window_index]).random()
        return self.names[min(int(np.searchsorted(self.cumulative, u, side="right")), len(self.names) - 1)]

    def __iter__(self) -> "TrainStream":
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        windows, source_ids = [], []
        for _ in range(self.batch_size):
            source = self._source_of_window(self.windows)
            windows.append(self.packers[source].window(self.window_len))
            source_ids.append(self.names.index(source))
            self.windows += 1
        return _train_batch(windows, source_ids)

    def state_dict(self) -> dict:
        sources = {name: dict(packer.state(), files=self.files[name]) for name, packer in self.packers.items()}
        return dict(version=STATE_VERSION, dp_rank=self.dp_rank, dp_degree=self.dp_degree, windows=self.windows,
                    bad_lines=self.bad_lines_before + sum(p.docs.bad_lines for p in self.packers.values()),
                    sources=sources)

    def close(self) -> None:
        for packer in self.packers.values():
            packer.docs.reader.close()
        if self.pool is not None:
            stop_pool(self.pool)
            self.pool = None
