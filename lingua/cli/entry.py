"""Entry points: a user's mistake ends in one sentence, a bug in its traceback.

    if __name__ == "__main__":
        run_cli(main)

A `UserError` (lingua/errors.py) is one `error: <sentence>` line on stderr and exit code 2. A rank that only
lost a rank that stopped first (`PeerStopped`) says which one, in one sentence too, and exits 1. Under torchrun
the sentence also goes to torchrun's error file (its failure report shows it), and ranks failing alike print it
once (`first_to_say`). Anything else
is a bug: its traceback goes to stderr, to the rank's log once `init_logger` opened it, and to torchrun's error
file (its failure summary shows it), and the exit code is 1. Nothing here imports torch at import time:
`hold_sigterm` runs before the slow imports. When `main` returns, the objects still alive are frozen out of
the cycle collector before the interpreter's teardown (`end_without_cycle_collections`).
"""

import gc
import hashlib
import json
import logging
import os
import re
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Callable

from lingua.errors import PeerStopped, RunStopped, UserError
from lingua.logger import FILE_ONLY, rank_log_file

logger = logging.getLogger(__name__)
ELASTIC_ERROR_FILE = "TORCHELASTIC_ERROR_FILE"  # where torchrun wants a failing rank's traceback (its summary)
_held_signals: list[int] = []


def hold_sigterm() -> None:
    """Until `PreemptionFlag` takes over, note a SIGTERM instead of dying of it. torchrun SIGTERMs every rank
    as soon as one exits, so without this a rank still importing or checking its config when another rank
    rejected the same config would vanish without its own sentence."""
    signal.signal(signal.SIGTERM, lambda signum, frame: _held_signals.append(signum))


def check_no_sigterm_held() -> None:
    """Raise `PeerStopped` if a SIGTERM arrived while `hold_sigterm` was in force: after its own config check
    passed, this rank learns that the launcher is stopping the job (another rank failed first)."""
    if _held_signals:
        raise PeerStopped("the launcher stopped this rank (SIGTERM) before the job started: another rank "
                          "failed first; its error is above and in its log")


def release_sigterm() -> None:
    """SIGTERM kills again (for entry points that install no handler of their own), after `check_no_sigterm_held`."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    check_no_sigterm_held()


def run_cli(main: Callable[[], object]) -> None:
    """Run `main()`: a `UserError` prints `error: <sentence>` and exits 2, `PeerStopped` prints its sentence and
    exits 1, any other exception (a bug) prints its traceback, logs it and exits 1."""
    try:
        main()
    except (UserError, PeerStopped) as err:
        _leaving()
        sentence = " ".join(str(err).split())  # one line, whatever the message held
        # Said once where every rank fails alike: before a rank's log opened (the launch's own checks) or a stopped run.
        if first_to_say(sentence, once=rank_log_file() is None or isinstance(err, RunStopped)):
            sys.stderr.write(f"error: {sentence}\n")  # one write: ranks sharing the terminal do not interleave
        elif rank_log_file() is not None:
            logger.error(f"error: {sentence}", extra=FILE_ONLY)
        sys.exit(1 if isinstance(err, PeerStopped) else 2)
    except Exception as err:
        _leaving()
        report_bug(err)
        sys.exit(1)
    else:
        if sys._getframe(1).f_globals.get("__name__") == "__main__":  # the program's entry: the process ends next
            end_without_cycle_collections()  # (not when a test calls run_cli in its own process)


def first_to_say(sentence: str, once: bool) -> bool:
    """Whether this rank prints `sentence`. Under torchrun it also goes to torchrun's error file, so torchrun's
    failure report shows it in place of `error_file: <N/A>`. With `once` (every rank fails alike: the launch's own
    checks of one config, a stopped run), only the first of its agent's ranks to fail with it prints it and is the
    report's root cause; the others stay quiet and record `the same error as local rank N`, a second later (the
    report's root cause is the earliest). Outside torchrun every rank prints."""
    if ELASTIC_ERROR_FILE not in os.environ:
        return True
    error_file = Path(os.environ[ELASTIC_ERROR_FILE])  # <log dir>/<run id>/attempt_<n>/<local rank>/error.json
    if not once:
        _write_error_file(error_file, sentence, int(time.time()))
        return True
    alike = re.sub(r"\d+", "#", sentence)  # a heartbeat's age, read a second apart, is still the same error
    said = error_file.parent.parent / f"said.{hashlib.sha1(alike.encode()).hexdigest()[:16]}"
    now = int(time.time())
    try:
        error_file.parent.mkdir(parents=True, exist_ok=True)  # torchrun made it; a test may not have
        with open(said, "x") as f:  # exclusive: of the ranks failing alike at once, exactly one creates it
            f.write(json.dumps(dict(local_rank=error_file.parent.name, timestamp=now)))
        first, message = True, sentence
    except FileExistsError:
        sayer = _read_json(said)
        first, now = False, max(now, int(sayer.get("timestamp", now)) + 1)
        message = f"the same error as local rank {sayer.get('local_rank', '?')}"
    except OSError:  # torchrun's folder is not writable here: say it, as without torchrun
        return True
    _write_error_file(error_file, message, now)
    return first


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):  # the sayer is still writing it: the second is close enough
        return {}


def _write_error_file(error_file: Path, message: str, timestamp: int) -> None:
    """torchrun's error file in the format of its own `record` (its report shows `message` when no traceback)."""
    try:
        error_file.parent.mkdir(parents=True, exist_ok=True)
        error_file.write_text(json.dumps({"message": {"message": message,
                                                      "extraInfo": {"timestamp": str(timestamp)}}}))
    except OSError as err:  # the sentence is printed or the sayer's; a failed copy must not hide it
        sys.stderr.write(f"(torchrun's error file not written: {err})\n")


def end_without_cycle_collections() -> None:
    """The process is ending: collect today's garbage (its finalizers run), then freeze every object still alive
    out of the cycle collector. The interpreter's teardown then does not traverse torch's, transformers' and
    sympy's millions of objects in collection after collection: about 1 CPU second per rank, on every launch
    (a 3-rank distillation launch's processes: 17.6 -> 14.4 CPU seconds; each rank is gone 0.5 s after its
    process group instead of 3 s, on a loaded 2-core machine). Exit handlers, the joins of non-daemon threads
    and the reference-counted teardown (files closed and flushed) run as before.

    Only after a clean exit: torchrun stops every other rank as soon as one exits non-zero, and a rank that
    fails sooner gives the others less time to reach their own check and sentence (a rank still before
    `check_no_sigterm_held` then says that the launcher stopped it instead), so error exits keep their timing."""
    gc.collect()
    gc.freeze()


def _leaving() -> None:
    """We are leaving: a launcher's SIGTERM now (torchrun stops every rank once one exits) would only turn the
    exit code into -15. SIG_IGN, unlike a Python handler, survives the interpreter's shutdown."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def report_bug(err: Exception) -> None:
    """The traceback of `err` on stderr, in the rank's log (not again on stdout) and in torchrun's error file.
    Call it while `err` is being handled: torchrun's error handler reads the current exception."""
    sys.stderr.write("".join(traceback.format_exception(err)))  # one write, as for a sentence
    if rank_log_file() is not None:
        logger.error("stopped on this error (a bug: the traceback is on stderr too)", exc_info=err, extra=FILE_ONLY)
    if ELASTIC_ERROR_FILE not in os.environ:  # not under torchrun: nothing to record, no torch import
        return
    try:
        from torch.distributed.elastic.multiprocessing.errors import get_error_handler

        get_error_handler().record_exception(err)  # torchrun's `record`, without re-raising
    except Exception as unrecorded:  # the traceback is out already; a failed copy must not hide it
        sys.stderr.write(f"(torchrun's error file not written: {type(unrecorded).__name__}: {unrecorded})\n")
