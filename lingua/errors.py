"""The errors a user can fix, apart from bugs: how an entry point tells them from each other.

`run_cli` (lingua/cli.py) reports a `UserError` as one sentence on stderr and exit code 2; anything else is a
bug of ours or of a library and keeps its traceback (exit 1). `PeerStopped` is neither: this rank only lost a
peer that failed first, and its sentence names that rank (exit 1).
"""


class UserError(Exception):
    """An error whose message tells the user what to change; reported without a traceback."""


class PeerStopped(Exception):
    """Another rank stopped first and this one lost it in a collective: the message names that rank and its
    log (this rank's traceback would only show where it was waiting)."""


class CollectiveTimeout(PeerStopped):
    """A collective's timeout ran out: the message names the group, the rank(s) that did not arrive and the
    step (the backend's own words only say how long it waited). Reported like `PeerStopped` (exit 1)."""


# Errors a user causes: bad config values, missing files, a failed teacher (its text says why).
USER_ERRORS = (ValueError, FileNotFoundError, UserError)
