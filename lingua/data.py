"""Training data: jsonl chunks per source, weighted mixing, on-the-fly tokenization, packing, a producer process.

The stream itself (readers, packing, mixing, its state) is `lingua/loading/stream.py`, torch-free; with
`data.load_async` (the default) it runs in a producer process per rank (`lingua/loading/producer.py`), so the
training loop's Python never slows it down; `data.load_async=false` builds each batch in the training process.
The files, their sharding over data-parallel ranks and the line -> document rule (malformed lines are
skipped and counted in `DataLoader.bad_lines`, per file in the log) are in `lingua/loading/documents.py`;
held-out batches for in-loop evaluation in `lingua/evaluation/heldout.py`.

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
stream just after the last batch handed out; batches the producer built ahead are not part of it, so a
restore gives bit-identical batches.
"""

import copy
import functools
import logging
import math
import weakref
from dataclasses import dataclass, field
from typing import Optional

import torch

from lingua.args import require
from lingua.loading.producer import BatchProducer, ProducedLoader, from_wire
from lingua.loading.stream import STATE_VERSION, StreamSettings, TrainStream, initial_state
from lingua.loading.documents import list_chunk_files, shard_files
from lingua.errors import DataError, LaunchError
from lingua.tokenizer import Tokenizer, TokenizerArgs

logger = logging.getLogger(__name__)

IGNORE_INDEX = -100


@dataclass
class DataArgs:
    root_dir: Optional[str] = None  # folder with one sub-folder per source
    sources: dict[str, float] = field(default_factory=dict)  # source folder -> weight (share of tokens)
    batch_size: int = 2  # rows per micro-batch on each student rank (not global: x students x grad_acc_steps)
    seq_len: int = 256  # tokens per row (a packed window of documents)
    seed: int = 42  # the data order: document shuffling and the source mix (same seed, same batches)
    add_bos: bool = True  # start each document with the tokenizer's bos token (where it has one)
    add_eos: bool = True  # end each document with the tokenizer's eos token (where it has one)
    load_async: bool = True  # build batches in a producer process per rank (false: in the training process)
    prefetch_size: int = 64  # batches the producer may build ahead
    workers: int = 0  # with load_async: tokenizing processes feeding the producer (0: it tokenizes itself)
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
        require(self.workers >= 0, "data.workers", self.workers, "use 0 (the producer tokenizes) or a number of "
                "tokenizing processes")
        require(self.n_views == 2, "data.n_views", self.n_views, "the loader yields 2 views (input_ids and the "
                "labels shifted by one); set data.n_views=2")
        self.tokenizer.validate()
        for name, weight in self.sources.items():
            if weight > 0:
                list_chunk_files(self.root_dir, name)


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
        self._state = initial_state(self.shards, dp_rank, dp_degree)
        self._stream: Optional[TrainStream] = None
        self._producer: Optional[BatchProducer] = None
        self._stop_producer: Optional[weakref.finalize] = None
        summary = ", ".join(f"{name}: {len(s)} file(s)" + (f", 1/{s[0].stride} of the lines" if s[0].stride > 1 else "")
                            for name, s in self.shards.items())
        logger.info(f"data rank {dp_rank}/{dp_degree} reads {summary}")

    @property
    def bad_lines(self) -> int:
        """Malformed lines skipped in the stream up to the last batch handed out."""
        return self._state["bad_lines"]

    def __iter__(self) -> "DataLoader":
        return self

    def _make_stream(self) -> functools.partial:
        workers = self.args.workers if self.args.load_async else 0  # a pool belongs in the producer, not the trainer
        settings = StreamSettings(dict(self.args.sources), self.args.batch_size, self.args.seq_len, self.args.seed,
                                  self.args.add_bos, self.args.add_eos, workers)
        return functools.partial(TrainStream, settings, self.tokenizer, self.shards, copy.deepcopy(self._state))

    def __next__(self) -> dict[str, torch.Tensor]:
        if self.args.load_async:
            if self._producer is None:
                self._producer = BatchProducer(self._make_stream(), self.args.prefetch_size)
                self._stop_producer = weakref.finalize(self, self._producer.close)
            batch, self._state = self._producer.get()
            return batch
        if self._stream is None:
            self._stream = self._make_stream()()
        batch = next(self._stream)
        self._state = self._stream.state_dict()
        return from_wire(batch)

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
        fresh = initial_state(self.shards, self.dp_rank, self.dp_degree)
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
        """Stop the producer process and close open files; iterating again restarts from the current state."""
        if self._stop_producer is not None:
            self._stop_producer()
            self._stop_producer = None
            self._producer = None
        if self._stream is not None:
            self._stream.close()
            self._stream = None

    def __enter__(self) -> "DataLoader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def training_loader(args: DataArgs, tokenizer: Tokenizer, dp_rank: int, dp_degree: int, cache=None):
    """This rank's training batches: the teachers' caches' (`cache`, their TeacherCaches) when given, else the jsonl
    stream; with `args.load_async` built in a producer process (the cache's shards decoded there too)."""
    if cache is None:
        return DataLoader(args, tokenizer, dp_rank, dp_degree)
    return ProducedLoader(cache, args.prefetch_size) if args.load_async else cache
