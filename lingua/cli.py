"""Entry points: a user's mistake ends in one sentence on stderr and exit code 2, not a traceback.

    if __name__ == "__main__":
        run_cli(main)
"""

import logging
import sys
from typing import Callable

logger = logging.getLogger(__name__)


class UserError(Exception):
    """An error whose message tells the user what to change; subclasses are reported without a traceback."""


# Errors a user causes: bad config values, missing files, a failed teacher (its text says why).
USER_ERRORS = (ValueError, FileNotFoundError, UserError)


def run_cli(main: Callable[[], object], also: tuple = ()) -> None:
    """Run `main()`; a user-facing error (USER_ERRORS + `also`) prints `error: <sentence>` and exits 2."""
    try:
        main()
    except USER_ERRORS + tuple(also) as err:
        # The traceback stays available at DEBUG level for developers.
        logger.debug("traceback of the error below", exc_info=True)
        sys.stderr.write(f"error: {err}\n")  # one write: ranks sharing the terminal do not interleave
        sys.exit(2)
