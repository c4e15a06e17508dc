"""The cache writer's pipeline, around the main thread's teacher forward: windows read ahead on a thread
(`WindowReadAhead`), shards encoded and written atomically by worker processes (`ShardWriters`). A shard's bytes
depend only on its windows, outputs and metadata, so the pipeline writes the serial writer's bytes
(`encode_workers=0`: everything in line, in order). Shards may finish out of order: resuming allows it.
"""

import logging
import os
import queue
import signal
import threading
import time
from concurrent.futures import Future, ProcessPoolExecutor
from pathlib import Path
from typing import Callable, Iterable, Iterator, Optional

import torch

from lingua.distillation.cache.store import CacheManifest, write_shard
from lingua.distillation.outputs import TeacherOutputs
from lingua.errors import UserError
from lingua.logger import FILE_ONLY
from lingua.loading.process_pool import BrokenProcessPool, spawn_pool, stop_pool
from lingua.loading.producer import die_with_parent

logger = logging.getLogger(__name__)
READ_AHEAD = 2  # shards of windows read ahead of the teacher: tokenizing one takes far less than its forward


class ShardWriteError(UserError, RuntimeError):
    """A shard could not be encoded or written (in an encode worker or in line); the sentence names the shard."""


def auto_encode_workers() -> int:
    """One encode worker per core the main thread (the teacher's) leaves free (`python -m apps.bench.feeding`)."""
    return max(1, len(os.sched_getaffinity(0)) - 1)


class StageClock:
    """The main thread's seconds per stage, for the progress line: the teacher's forward, and waiting on the host
    (windows not read yet; every encode worker busy, or in line the encoding and writing itself)."""

    def __init__(self):
        self.start = time.perf_counter()
        self.seconds = {"teacher": 0.0, "windows": 0.0, "encode": 0.0}

    def add(self, stage: str, since: float) -> float:
        now = time.perf_counter()
        self.seconds[stage] += now - since
        return now

    def shares(self) -> str:
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        share = {stage: 100 * s / elapsed for stage, s in self.seconds.items()}
        return (f"teacher {share['teacher']:.0f}% of the time, host {share['windows'] + share['encode']:.0f}% "
                f"(windows {share['windows']:.0f}%, encode+write {share['encode']:.0f}%)")


class WindowReadAhead:
    """(index, `read(index)`) for each index of `todo`, in order, read on a thread at most `depth` ahead (0: in
    line); the waits are charged to `clock`'s "windows"."""

    def __init__(self, read: Callable[[int], object], todo: Iterable[int], clock: StageClock, depth: int = READ_AHEAD):
        self.read, self.todo, self.clock = read, list(todo), clock
        self.stop = threading.Event()
        self.thread: Optional[threading.Thread] = None
        if depth > 0 and self.todo:
            self.ready: queue.Queue = queue.Queue(maxsize=depth)
            self.thread = threading.Thread(target=self._produce, name="cache-read-ahead", daemon=True)
            self.thread.start()

    def _produce(self) -> None:
        for index in self.todo:
            try:
                item = (index, self.read(index), None)
            except BaseException as err:  # handed to the main thread, which raises it
                item = (index, None, err)
            while not self.stop.is_set():
                try:
                    self.ready.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            if self.stop.is_set() or item[2] is not None:
                return

    def __iter__(self) -> Iterator[tuple[int, object]]:
        for index in self.todo:
            since = time.perf_counter()
            if self.thread is None:
                item = self.read(index)
            else:
                got, item, err = self.ready.get()
                assert got == index, (got, index)
                if err is not None:
                    raise err
            self.clock.add("windows", since)
            yield index, item

    def close(self) -> None:
        self.stop.set()
        if self.thread is not None:
            self.thread.join(timeout=5)


def _start_encode_worker(parent: int) -> None:
    """Ctrl-C is the writer's to handle (it stops the workers); a writer killed (SIGKILL) takes them along."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    die_with_parent(parent, parent_is_main_thread=True)  # the pool is started from the writer's main thread
    torch.set_num_threads(1)  # one thread per worker, as measured


def _ready_worker() -> int:
    return os.getpid()


def _portable(tensor: torch.Tensor) -> tuple:
    """A tensor as its bytes, dtype and shape: through the pool's pipe, not torch's shared-memory file descriptors
    (whose server thread prints a traceback when a worker is stopped during a transfer)."""
    return tensor.contiguous().reshape(-1).view(torch.uint8).numpy(), tensor.dtype, tuple(tensor.shape)


def _tensor(portable: tuple) -> torch.Tensor:
    data, dtype, shape = portable
    return torch.from_numpy(data).view(dtype).reshape(shape)


def _write_portable(path: Path, tokens: tuple, doc_ids: tuple, output_format: str, outputs: list, manifest,
                    metadata: dict, source_ids: Optional[tuple] = None) -> None:
    teacher = TeacherOutputs.from_tensors(output_format, [_tensor(t) for t in outputs])
    write_shard(path, _tensor(tokens), _tensor(doc_ids), teacher, manifest, metadata,
                None if source_ids is None else _tensor(source_ids))


def start_encode_pool(workers: int) -> ProcessPoolExecutor:
    """`workers` encode processes, started now (while the teacher loads)."""
    pool = spawn_pool(workers, _start_encode_worker, (os.getpid(),))
    pool.submit(_ready_worker)
    return pool


class ShardWriters:
    """Encode and write shards (`write_shard`): in line (`workers=0`) or in `workers` processes, at most `workers + 1`
    pending (waits charged to `clock`'s "encode"). A failure is one sentence naming the shard, its traceback in
    the log; `close()` stops every worker (also after an error, Ctrl-C or SIGTERM)."""

    def __init__(self, workers: int, clock: StageClock):
        self.workers, self.clock, self.written = workers, clock, 0
        self.pending: dict[int, tuple[Path, Future]] = {}
        self.pool: Optional[ProcessPoolExecutor] = start_encode_pool(workers) if workers > 0 else None

    def submit(self, index: int, path: Path, tokens: torch.Tensor, doc_ids: torch.Tensor, outputs: TeacherOutputs,
               manifest: CacheManifest, metadata: dict, source_ids: Optional[torch.Tensor] = None) -> None:
        since = time.perf_counter()
        if self.pool is None:
            self._run(index, path, lambda: write_shard(path, tokens, doc_ids, outputs, manifest, metadata, source_ids))
            self.written += 1
        else:
            while len(self.pending) > self.workers:
                self._finish_one()
            packed = [_portable(t) for t in outputs.tensors()]
            self.pending[index] = (path, self._run(index, path, lambda: self.pool.submit(
                _write_portable, path, _portable(tokens), _portable(doc_ids), outputs.format, packed, manifest,
                metadata, None if source_ids is None else _portable(source_ids))))
        self.clock.add("encode", since)

    def _finish_one(self) -> None:
        first = min(self.pending, key=lambda i: self.pending[i][1].done() is False)  # a finished one, else the oldest
        path, future = self.pending.pop(first)
        self._run(first, path, future.result)
        self.written += 1

    def drain(self) -> None:
        since = time.perf_counter()
        while self.pending:
            self._finish_one()
        self.clock.add("encode", since)

    def _run(self, index: int, path: Path, call: Callable):
        try:
            return call()
        except BrokenProcessPool as err:
            self.close()
            raise ShardWriteError(f"An encode worker of the teacher cache writer died while shard {index} ({path}) "
                                  f"was pending ({err}); run the cache command again: finished shards are kept.") \
                from None
        except Exception as err:  # the worker's exception, re-raised here: any kind, one sentence
            self.close()
            remote = getattr(err, "__cause__", None)  # the worker's traceback, as ProcessPoolExecutor relays it
            logger.error(f"teacher cache shard {index} ({path}) was not written: {type(err).__name__}: {err}"
                         + (f"{remote}" if remote is not None else ""), exc_info=remote is None, extra=FILE_ONLY)
            what = " ".join(str(err).split())
            if not isinstance(err, UserError):  # a user error's own sentence says what to do; a bug's does not
                what = (f"{type(err).__name__}: {what}. The traceback is in the rank's log (cache_dir/logs); finished "
                        f"shards are kept, so the same command resumes once it is fixed.")
            raise ShardWriteError(f"Teacher cache shard {index} ({path}) was not written: {what}") from None

    def close(self) -> None:
        """Stop the workers at once: pending shards are dropped (never renamed into place, so a rerun writes them)."""
        pool, self.pool = self.pool, None
        self.pending.clear()
        if pool is not None:
            stop_pool(pool)
