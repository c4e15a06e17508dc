"""Entry points: a user's mistake ends in one sentence on stderr and exit code 2, not a traceback.

    if __name__ == "__main__":
        run_cli(main)

A rank that only lost its connection to a rank that stopped first (`PeerStopped`) says which one, in
one sentence too, and exits 1. Nothing here imports torch: `hold_sigterm` runs before the slow imports.
"""

import logging
import signal
import sys
from typing import Callable

from lingua.errors import USER_ERRORS, PeerStopped

logger = logging.getLogger(__name__)
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


def run_cli(main: Callable[[], object], also: tuple = ()) -> None:
    """Run `main()`; a user-facing error (USER_ERRORS + `also`) prints `error: <sentence>` and exits 2,
    `PeerStopped` prints its sentence and exits 1."""
    try:
        main()
    except (PeerStopped, *USER_ERRORS, *also) as err:
        # We are leaving: a launcher's SIGTERM now (torchrun stops every rank once one exits) would only turn
        # the exit code into -15. SIG_IGN, unlike a Python handler, survives the interpreter's shutdown.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        # The traceback stays available at DEBUG level for developers.
        logger.debug("traceback of the error below", exc_info=True)
        sentence = " ".join(str(err).split())  # one line, whatever the message held
        sys.stderr.write(f"error: {sentence}\n")  # one write: ranks sharing the terminal do not interleave
        sys.exit(1 if isinstance(err, PeerStopped) else 2)
