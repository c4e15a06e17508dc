"""Training batches built in a producer process per rank (Meta Lingua's `async_iterator`: a `Process` feeding a
bounded `Queue`; here a pipe fed by a bounded queue), so a training loop busy in Python never slows the data down
(a thread would share its GIL).

    producer = BatchProducer(make_stream, size=64)   # make_stream(): an iterator of batches with state_dict()
    batch, state = producer.get()                     # in order: the batch and the stream's state right after it
    producer.close()                                  # stops the process (it also dies with its rank, however)

The process is started with `spawn` (never `fork`: the rank has threads) and imports only what `make_stream`
needs: the jsonl stream (`lingua/loading/stream.py`) is torch-free, so it starts in a fraction of a second.
Batches travel as numpy arrays (pickled through a pipe, at most a few hundred KB each; torch tensors
come back with `torch.from_numpy`, no copy). The producer issues no collective: it is in no process group.

Failure: an error in the producer reaches the rank at its next `get()`: a `UserError` (a bad data file, a
missing path, a damaged cache shard) as the same one-sentence error and nothing else (its traceback only at DEBUG:
the sentence says all there is, as when the rank reads in-line), anything else (a bug, the process killed) as a
`RunFailed` sentence with the producer's traceback in the rank's log. Its log lines reach the rank's log too,
when the batch they came with is handed out. Lifetime: the producer ignores the signals its rank handles
(Ctrl-C, SIGTERM, the preemption signals), and exits when its rank does, however it does (SIGKILL included):
the kernel kills it when the rank's thread that started it exits (PR_SET_PDEATHSIG, Linux, when started from
the main thread), and a thread of its own exits when the pipe from its parent closes.
"""

import contextlib
import ctypes
import dataclasses
import logging
import multiprocessing
import multiprocessing.util
import os
import pickle
import queue
import signal
import sys
import threading
import traceback
from typing import Any, Callable, Optional

import numpy as np

from lingua.errors import RunFailed, UserError

logger = logging.getLogger(__name__)

POLL_S = 1.0  # how often a waiting get() checks that the producer is alive
STOP_WAIT_S = 2.0  # a producer gets this long to stop by itself before it is killed
PR_SET_PDEATHSIG = 1
IGNORED_SIGNALS = ("SIGINT", "SIGTERM", "SIGUSR1", "SIGUSR2")  # the rank decides what they mean


class BatchProducer:
    """A process that draws batches from `make_stream()`, up to `size` ahead; `get()` hands them over in order."""

    def __init__(self, make_stream: Callable[[], Any], size: int, name: str = "data-producer"):
        context = multiprocessing.get_context("spawn")
        self.reader, writer = context.Pipe(duplex=False)
        self.stop = context.Event()
        # Not a daemon: it may start tokenizing workers; it is closed before the exit joins it (below).
        self.process = context.Process(target=produce, name=name, args=(
            make_stream, writer, size, self.stop, os.getpid(), threading.current_thread() is threading.main_thread(),
            logging.getLogger().getEffectiveLevel()))
        # Closed before multiprocessing's own exit step, which would wait forever for it to end by itself; registered
        # before the start, so a Ctrl-C landing during the start leaves no child that nothing stops.
        self._close_at_exit = multiprocessing.util.Finalize(self, self.close, exitpriority=10)
        try:
            with _main_module_hidden():
                self.process.start()
        finally:
            writer.close()  # the producer holds the only write end: its death is an end of file here, never a wait
        logger.info(f"{name} process started (pid {self.process.pid})")

    def get(self) -> tuple[Any, dict]:
        """The next (batch, state after it); raises the producer's error, or a sentence if it died."""
        while True:
            try:
                if not self.reader.poll(POLL_S):
                    continue
                kind, payload = self.reader.recv()
            except (EOFError, OSError):
                self.process.join(timeout=STOP_WAIT_S)
                raise self._death() from None
            if kind == "log":
                name, level, message = payload
                logging.getLogger(name).log(level, "%s", message)
            elif kind == "error":
                raise self._failure(*payload) from None
            else:
                batch, state = payload
                return from_wire(batch), state

    def _failure(self, error: Optional[BaseException], summary: str, trace: str) -> BaseException:
        if isinstance(error, UserError):  # its sentence is the whole story: a traceback would read as a crash
            logger.debug(f"the data producer (pid {self.process.pid}) stopped on:\n{trace}")
            return error
        logger.error(f"the data producer (pid {self.process.pid}) failed:\n{trace}")  # the rank log keeps it
        return RunFailed(f"The data producer process (pid {self.process.pid}) failed: {summary}; its traceback is "
                         f"in this rank's log. Set data.load_async=false to build batches in the training process.")

    def _death(self) -> RunFailed:
        code = self.process.exitcode
        how = f"was killed by {signal.Signals(-code).name}" if code is not None and code < 0 else f"exited ({code})"
        return RunFailed(f"The data producer process (pid {self.process.pid}) {how} without a reason: out of memory "
                         f"or killed from outside? Set data.load_async=false to build batches in the training process.")

    def close(self) -> None:
        """Stop the producer: asked first, killed if it does not stop within STOP_WAIT_S."""
        if self.reader.closed:
            return
        self._close_at_exit.cancel()  # it holds this producer: let it go
        self.stop.set()
        if self.process.pid is not None:  # started (a start interrupted before the fork leaves nothing to stop)
            self.process.join(timeout=STOP_WAIT_S)
            if self.process.is_alive():
                self.process.kill()  # it ignores SIGTERM
                self.process.join()
        self.reader.close()


@contextlib.contextmanager
def _main_module_hidden():
    """spawn re-runs the parent's main module in the child (for `-m apps.main.train`: the whole trainer, torch
    and all); the producer needs none of it, so the child is started as if there were none."""
    main = sys.modules["__main__"]
    saved = {key: main.__dict__[key] for key in ("__spec__", "__file__") if key in main.__dict__}
    main.__dict__.pop("__file__", None)
    main.__spec__ = None
    try:
        yield
    finally:
        main.__dict__.pop("__spec__", None)
        main.__dict__.update(saved)


def produce(make_stream, writer, size: int, stop, parent_pid: int, parent_is_main_thread: bool,
            log_level: int) -> None:
    """The producer process: batches and their states to the rank until `stop`, or the error that ended it.
    A sender thread writes them to the pipe while this one builds the next (up to `size` wait in between)."""
    die_with_parent(parent_pid, parent_is_main_thread)
    for name in IGNORED_SIGNALS:
        signal.signal(getattr(signal, name), signal.SIG_IGN)
    outbox: queue.Queue = queue.Queue(maxsize=size)
    threading.Thread(target=_send, args=(outbox, writer), name="producer-send", daemon=True).start()
    root = logging.getLogger()
    root.handlers = [_ForwardLogs(outbox, stop)]
    root.setLevel(log_level)
    stream = None
    try:
        stream = make_stream()
        while not stop.is_set():
            batch = next(stream)
            _put(outbox, stop, ("batch", (to_wire(batch), stream.state_dict())))
    except BaseException as err:  # handed to the rank, which raises it
        _put(outbox, stop, ("error", (_picklable(err), f"{type(err).__name__}: {err}", traceback.format_exc())))
        outbox.join()  # delivered before exiting (the rank is alive to read it, or we die with it)
    finally:
        if stream is not None and hasattr(stream, "close"):
            stream.close()


def _send(outbox: queue.Queue, writer) -> None:
    while True:
        item = outbox.get()
        try:
            writer.send(item)
        except OSError:  # the rank closed its end: it wants no more
            os._exit(0)
        outbox.task_done()


def _put(outbox: queue.Queue, stop, item) -> None:
    while not stop.is_set():
        try:
            outbox.put(item, timeout=0.1)
            return
        except queue.Full:
            continue


def _picklable(err: BaseException) -> Optional[BaseException]:
    try:
        pickle.loads(pickle.dumps(err))
        return err
    except Exception:  # the summary and the traceback still travel
        return None


class _ForwardLogs(logging.Handler):
    """The producer's log records, sent to the rank with the batches (the rank's handlers format and write them)."""

    def __init__(self, outbox: queue.Queue, stop):
        super().__init__()
        self.outbox, self.stop = outbox, stop

    def emit(self, record: logging.LogRecord) -> None:
        _put(self.outbox, self.stop, ("log", (record.name, record.levelno, record.getMessage())))


def die_with_parent(parent_pid: int, parent_is_main_thread: bool) -> None:
    """Exit when the rank exits, however: the kernel's parent-death signal, and a thread watching the parent's pipe."""
    if sys.platform.startswith("linux") and parent_is_main_thread:  # the signal follows the starting thread
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:  # it died before the signal was armed
        os._exit(0)
    parent = multiprocessing.parent_process()
    threading.Thread(target=lambda: (parent.join(), os._exit(0)), name="parent-watch", daemon=True).start()


def to_wire(obj):
    """Batches as the queue carries them cheaply: torch tensors as numpy arrays (bfloat16 as its int16 bits)."""
    if isinstance(obj, dict):
        return {key: to_wire(value) for key, value in obj.items()}
    if isinstance(obj, list):  # several teachers' targets
        return [to_wire(value) for value in obj]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return _WireDataclass(type(obj), {f.name: to_wire(getattr(obj, f.name)) for f in dataclasses.fields(obj)})
    torch = sys.modules.get("torch")  # imported only where the stream makes tensors (the cache road)
    if torch is not None and isinstance(obj, torch.Tensor):
        bfloat16 = obj.dtype == torch.bfloat16
        array = (obj.view(torch.int16) if bfloat16 else obj).detach().cpu().numpy()
        return _WireTensor(array, bfloat16)
    return obj


def from_wire(obj):
    """Inverse of `to_wire`, with numpy arrays as torch tensors (sharing their memory)."""
    import torch

    if isinstance(obj, dict):
        return {key: from_wire(value) for key, value in obj.items()}
    if isinstance(obj, list):
        return [from_wire(value) for value in obj]
    if isinstance(obj, _WireDataclass):
        return obj.cls(**{key: from_wire(value) for key, value in obj.fields.items()})
    if isinstance(obj, _WireTensor):
        tensor = torch.from_numpy(obj.array)
        return tensor.view(torch.bfloat16) if obj.bfloat16 else tensor
    if isinstance(obj, np.ndarray):
        return torch.from_numpy(obj)
    return obj


@dataclasses.dataclass
class _WireTensor:
    array: np.ndarray
    bfloat16: bool


@dataclasses.dataclass
class _WireDataclass:
    cls: type
    fields: dict


class ProducedLoader:
    """A resumable loader (`next`, `state_dict`, `load_state_dict`) run in a producer process: here only its
    position is kept; the producer iterates a copy restored to it. Validation (`load_state_dict`) runs here."""

    def __init__(self, loader, size: int, name: str = "data-producer"):
        self.loader, self.size, self.name = loader, size, name
        self._state = loader.state_dict()
        self._producer: Optional[BatchProducer] = None

    def __iter__(self) -> "ProducedLoader":
        return self

    def __next__(self):
        if self._producer is None:
            self._producer = BatchProducer(_Restored(self.loader, self._state), self.size, self.name)
        batch, self._state = self._producer.get()
        return batch

    @property
    def bad_lines(self) -> int:
        return self._state.get("bad_lines", 0)

    def state_dict(self) -> dict:
        return dict(self._state)

    def load_state_dict(self, state: dict) -> None:
        self.loader.load_state_dict(state)  # its checks, in the rank
        self.close()
        self._state = self.loader.state_dict()

    def close(self) -> None:
        if self._producer is not None:
            self._producer.close()
            self._producer = None
        if hasattr(self.loader, "close"):
            self.loader.close()


@dataclasses.dataclass
class _Restored:
    """`loader` at `state`, in the producer (a picklable stand-in for a closure)."""

    loader: Any
    state: dict

    def __call__(self):
        self.loader.load_state_dict(self.state)
        return self.loader
