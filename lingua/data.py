"""Training data: jsonl chunks per source, weighted mixing, on-the-fly tokenization, packing, prefetch.

The files, their sharding over data-parallel ranks and the line -> document rule (malformed lines are
skipped and counted in `DataLoader.bad_lines`, per file in the log) are in `lingua/documents.py`;
held-out batches for in-loop evaluation in `lingua/eval_data.py`.

Stream: every row of a batch is a window of `seq_len + 1` consecutive tokens from one source, picked
with probability proportional to its weight (so weights are shares of training tokens). Documents are
tokenized when read and packed back to back; a document cut by the end of a window continues at the
start of that source's next window. `input_ids = window[:-1]`, `labels = window[1:]` (training
batches never contain -100), and `doc_ids` numbers the documents inside each window from 0 so that a
doc-causal mask can keep attention within a document.

Ranks may hold different amounts of data; each loops over its share forever.

State: `DataLoader.state_dict()` is a small JSON-serialisable dict with each source's read position
(file, byte offset, line, epoch), the document cut at the last window (re-read and re-tokenized on
restore), the number of windows drawn (the mixing RNG is a pure function of seed, rank and window
index) and the malformed-line counts (in all, and in each source's current file). It describes the
stream just after the last batch handed out; batches the prefetch thread built ahead are not part of
it, so a restore gives bit-identical batches.
"""

import copy
import functools
import logging
import math
import queue
import threading
import weakref
from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np
import torch

from lingua.args import require
from lingua.documents import FileShard, MalformedLines, list_chunk_files, read_line, shard_files
from lingua.errors import DataError, LaunchError
from lingua.tokenizer import Tokenizer, TokenizerArgs

logger = logging.getLogger(__name__)

STATE_VERSION = 1
IGNORE_INDEX = -100
PREFETCH_JOIN_TIMEOUT_S = 30.0


@dataclass
class DataArgs:
    root_dir: Optional[str] = None  # folder with one sub-folder per source
    sources: dict[str, float] = field(default_factory=dict)  # source folder -> weight (share of tokens)
    batch_size: int = 2
    seq_len: int = 256
    seed: int = 42
    add_bos: bool = True
    add_eos: bool = True
    load_async: bool = True  # build batches in a background thread
    prefetch_size: int = 64  # batches the background thread may build ahead
    tokenizer: TokenizerArgs = field(default_factory=TokenizerArgs)
    eval_sources: Optional[list[str]] = None  # sources whose *.val.jsonl to evaluate; None = all that have one
    n_views: int = 2  # Meta Lingua's key: a batch holds 2 views of each window (input_ids, labels = shifted by 1)

    def validate(self) -> None:
        """Sizes, the tokenizer, and a training chunk file in every source with a positive weight."""
        require(bool(self.root_dir), "data.root_dir", self.root_dir,
                "point it at the folder holding one sub-folder per source")
        require(bool(self.sources), "data.sources", self.sources,
                "name at least one source folder with a weight, e.g. data.sources.fineweb_edu=1.0")
        for name, weight in self.sources.items():
            require(math.isfinite(weight) and weight >= 0, f"data.sources.{name}", weight,
                    "weights are shares of the training tokens: use a finite number >= 0")
        require(sum(self.sources.values()) > 0, "data.sources", self.sources,
                "all weights are 0; give at least one source a positive weight")
        for key in ("batch_size", "seq_len", "prefetch_size"):
            require(getattr(self, key) >= 1, f"data.{key}", getattr(self, key), "use a positive number")
        require(self.n_views == 2, "data.n_views", self.n_views, "the loader yields 2 views (input_ids and the "
                "labels shifted by one); set data.n_views=2")
        self.tokenizer.validate()
        for name, weight in self.sources.items():
            if weight > 0:
                list_chunk_files(self.root_dir, name)


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


class _SourcePacker:
    """Cuts one source's token stream into windows; a document cut at a window end carries over."""

    def __init__(self, reader: _SourceReader, tokenizer: Tokenizer, add_bos: bool, add_eos: bool,
                 cut_document: Optional[dict]):
        self.reader = reader
        self.encode = functools.partial(tokenizer.encode, add_bos=add_bos, add_eos=add_eos)
        self.doc_tokens: list[int] = []
        self.doc_pos = 0
        self.doc_location: Optional[dict] = None
        if cut_document is not None:
            self.doc_location = {k: cut_document[k] for k in ("file_index", "offset", "line")}
            self.doc_tokens = self.encode(reader.document_at(self.doc_location))
            self.doc_pos = cut_document["token"]

    def window(self, length: int) -> tuple[list[int], list[int]]:
        """(tokens, doc_ids) of the next `length` tokens."""
        tokens: list[int] = []
        doc_ids: list[int] = []
        while len(tokens) < length:
            if self.doc_pos >= len(self.doc_tokens):
                text, self.doc_location = self.reader.next_document()
                self.doc_tokens, self.doc_pos = self.encode(text), 0
                continue
            take = min(length - len(tokens), len(self.doc_tokens) - self.doc_pos)
            doc_ids.extend([doc_ids[-1] + 1 if doc_ids else 0] * take)
            tokens.extend(self.doc_tokens[self.doc_pos:self.doc_pos + take])
            self.doc_pos += take
        return tokens, doc_ids

    def state(self) -> dict:
        cut = None if self.doc_pos >= len(self.doc_tokens) else dict(self.doc_location, token=self.doc_pos)
        return dict(self.reader.position(), document=cut)


def _initial_state(shards: dict[str, list[FileShard]], dp_rank: int, dp_degree: int) -> dict:
    sources = {name: dict(file_index=0, offset=0, line=0, epoch=0, bad_lines_in_file=0, document=None,
                          files=[s.describe() for s in source_shards]) for name, source_shards in shards.items()}
    return dict(version=STATE_VERSION, dp_rank=dp_rank, dp_degree=dp_degree, windows=0, bad_lines=0, sources=sources)


def _train_batch(windows: list[tuple[list[int], list[int]]]) -> dict[str, torch.Tensor]:
    tokens = torch.from_numpy(np.array([w[0] for w in windows], dtype=np.int64))
    doc_ids = torch.from_numpy(np.array([w[1] for w in windows], dtype=np.int32))
    return dict(input_ids=tokens[:, :-1].contiguous(), labels=tokens[:, 1:].contiguous(),
                doc_ids=doc_ids[:, :-1].contiguous())


class _TrainStream:
    """The deterministic batch stream of one rank, starting from a state dict."""

    def __init__(self, args: DataArgs, tokenizer: Tokenizer, shards: dict[str, list[FileShard]], state: dict):
        self.batch_size, self.window_len = args.batch_size, args.seq_len + 1
        self.seed, self.dp_rank, self.dp_degree = args.seed, state["dp_rank"], state["dp_degree"]
        self.names = list(shards)
        weights = np.array([args.sources[name] for name in self.names], dtype=np.float64)
        self.cumulative = np.cumsum(weights) / weights.sum()
        self.windows = state["windows"]
        self.files = {name: state["sources"][name]["files"] for name in self.names}
        self.malformed = MalformedLines(state["bad_lines"])
        self.packers = {}
        try:
            for name in self.names:
                source_state = state["sources"][name]
                reader = _SourceReader(name, shards[name], source_state, self.malformed)
                self.packers[name] = _SourcePacker(reader, tokenizer, args.add_bos, args.add_eos,
                                                   source_state["document"])
        except BaseException:
            self.close()
            raise

    def _source_of_window(self, window_index: int) -> str:
        # A pure function of (seed, rank, index): the state needs only the window count.
        u = np.random.default_rng([self.seed, self.dp_rank, window_index]).random()
        return self.names[min(int(np.searchsorted(self.cumulative, u, side="right")), len(self.names) - 1)]

    def next_batch(self) -> dict[str, torch.Tensor]:
        windows = []
        for _ in range(self.batch_size):
            source = self._source_of_window(self.windows)
            windows.append(self.packers[source].window(self.window_len))
            self.windows += 1
        return _train_batch(windows)

    def state_dict(self) -> dict:
        sources = {name: dict(packer.state(), files=self.files[name]) for name, packer in self.packers.items()}
        return dict(version=STATE_VERSION, dp_rank=self.dp_rank, dp_degree=self.dp_degree, windows=self.windows,
                    bad_lines=self.malformed.count, sources=sources)

    def close(self) -> None:
        for packer in self.packers.values():
            packer.reader.close()


class _Prefetcher:
    """Builds (batch, state after it) pairs in a background thread; close() stops it promptly.

    The thread is a daemon so a loader that is never closed cannot keep the interpreter alive; the
    DataLoader also closes it from a weakref finalizer (which runs at exit) for a clean shutdown.
    """

    def __init__(self, make_stream: Callable[[], _TrainStream], size: int):
        self.queue: queue.Queue = queue.Queue(maxsize=size)
        self.stop = threading.Event()
        self.error: Optional[BaseException] = None
        self.thread = threading.Thread(target=self._run, args=(make_stream,), name="data-prefetch", daemon=True)
        self.thread.start()

    def _run(self, make_stream: Callable[[], _TrainStream]) -> None:
        stream = None
        try:
            stream = make_stream()
            while not self.stop.is_set():
                batch = stream.next_batch()
                self._put(("batch", (batch, stream.state_dict())))
        except BaseException as err:  # handed to the consumer, which re-raises it in the main thread
            self._put(("error", err))
        finally:
            if stream is not None:
                stream.close()

    def _put(self, item) -> None:
        while not self.stop.is_set():
            try:
                self.queue.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    def get(self) -> tuple[dict, dict]:
        if self.error is not None:
            raise self.error
        while True:
            try:
                kind, payload = self.queue.get(timeout=1.0)
            except queue.Empty:
                if not self.thread.is_alive():
                    raise RuntimeError("The data prefetch thread stopped without a reason; "
                                       "retry with data.load_async=false to see the error.") from None
                continue
            if kind == "error":
                self.error = payload
                raise payload
            return payload

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=PREFETCH_JOIN_TIMEOUT_S)
        if self.thread.is_alive():
            logger.warning(f"data prefetch thread did not stop within {PREFETCH_JOIN_TIMEOUT_S:.0f}s")


class DataLoader:
    """Infinite iterator of packed training batches for one data-parallel rank; also a context manager.

    `next(loader)` -> dict(input_ids=LongTensor[B,S], labels=LongTensor[B,S], doc_ids=IntTensor[B,S]).
    """

    def __init__(self, args: DataArgs, tokenizer: Tokenizer, dp_rank: int, dp_degree: int):
        args.validate()
        assert 0 <= dp_rank < dp_degree, (dp_rank, dp_degree)
        self.args = args
        self.tokenizer = tokenizer
        self.dp_rank, self.dp_degree = dp_rank, dp_degree
        self.shards = {name: shard_files(list_chunk_files(args.root_dir, name), dp_rank, dp_degree)
                       for name, weight in args.sources.items() if weight > 0}
        self._state = _initial_state(self.shards, dp_rank, dp_degree)
        self._stream: Optional[_TrainStream] = None
        self._prefetcher: Optional[_Prefetcher] = None
        self._stop_prefetcher: Optional[weakref.finalize] = None
        summary = ", ".join(f"{name}: {len(s)} file(s)" + (f", 1/{s[0].stride} of the lines" if s[0].stride > 1 else "")
                            for name, s in self.shards.items())
        logger.info(f"data rank {dp_rank}/{dp_degree} reads {summary}")

    @property
    def bad_lines(self) -> int:
        """Malformed lines skipped in the stream up to the last batch handed out."""
        return self._state["bad_lines"]

    def __iter__(self) -> "DataLoader":
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        if self.args.load_async:
            if self._prefetcher is None:
                make_stream = functools.partial(_TrainStream, self.args, self.tokenizer, self.shards,
                                                copy.deepcopy(self._state))
                self._prefetcher = _Prefetcher(make_stream, self.args.prefetch_size)
                self._stop_prefetcher = weakref.finalize(self, self._prefetcher.close)
            batch, self._state = self._prefetcher.get()
            return batch
        if self._stream is None:
            self._stream = _TrainStream(self.args, self.tokenizer, self.shards, copy.deepcopy(self._state))
        batch = self._stream.next_batch()
        self._state = self._stream.state_dict()
        return batch

    def state_dict(self) -> dict:
        """JSON-serialisable position of the stream right after the last batch handed out."""
        return copy.deepcopy(self._state)

    def load_state_dict(self, state: dict) -> None:
        """Resume from `state_dict()` output; the next batches are exactly those that followed it."""
        version = state.get("version") if isinstance(state, dict) else None
        if version != STATE_VERSION:
            raise DataError(f"Unrecognised data loader state (version {version}, expected {STATE_VERSION}); "
                            f"resume from a checkpoint written by this code.")
        if (state["dp_rank"], state["dp_degree"]) != (self.dp_rank, self.dp_degree):
            raise LaunchError(f"The data state was saved by data-parallel rank {state['dp_rank']} of "
                              f"{state['dp_degree']} but this is rank {self.dp_rank} of {self.dp_degree}; resume with "
                              f"the same number of training ranks.")
        fresh = _initial_state(self.shards, self.dp_rank, self.dp_degree)
        restored = copy.deepcopy(state)
        for name, source_state in fresh["sources"].items():
            saved = restored["sources"].get(name)
            if saved is None:
                logger.info(f"data source '{name}' is new since the checkpoint; it starts from its beginning")
                restored["sources"][name] = source_state
            elif saved["files"] != source_state["files"]:
                raise DataError(f"Data source '{name}' changed since the checkpoint: this rank read "
                                f"{saved['files']} and would now read {source_state['files']} ([file, stride, "
                                f"offset]); restore the original chunk files or resume without the data state.")
        for name in set(restored["sources"]) - set(fresh["sources"]):
            logger.info(f"data source '{name}' is no longer in data.sources; its saved position is dropped")
            del restored["sources"][name]
        self.close()
        self._state = restored

    def close(self) -> None:
        """Stop the prefetch thread and close open files; iterating again restarts from the current state."""
        if self._stop_prefetcher is not None:
            self._stop_prefetcher()
            self._stop_prefetcher = None
            self._prefetcher = None
        if self._stream is not None:
            self._stream.close()
            self._stream = None

    def __enter__(self) -> "DataLoader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
