"""The errors a user can fix, apart from bugs: how an entry point tells them from each other.

`run_cli` (lingua/cli/entry.py) reports a `UserError` as one sentence on stderr and exit code 2. Anything else is a
bug, ours or a library's, and keeps its traceback: on stderr, in the rank's log and in torchrun's failure
summary, exit code 1. `PeerStopped` is neither: this rank only lost a peer that failed first, and its sentence
names that rank and its log (exit 1).

The family. Each member is also the builtin it replaces, so `except ValueError` and `pytest.raises(ValueError)`
keep working:

    ConfigError       a config value, an unknown key, a wrong type, a rule across keys (`lingua.args.require`)
    LaunchError       the launch does not fit the config: world size vs mesh, teacher placement, the srun or
                      torchrun environment, GPU binding, a checkpoint written by another number of ranks
    MissingPathError  a path the user gave (config file, data, tokenizer, teacher, cache, checkpoint) does not
                      exist or is incomplete
    DataError         files or data that cannot be used as they are: a source with no valid document, teacher
                      weights that do not load, a damaged or mismatched cache or checkpoint
    StorageError      a write the run needs failed (a full disk, a permission, a quota): the sentence names the
                      path, the error and what is still safe on disk
    NonFiniteError    the loss, or a teacher's outputs, are not finite: the sentence names the step, the rank(s) and
                      the part (CE, KD, the teacher), and what to change
    TeacherError      a teacher's failure every bridge member reports alike: it failed to load (for a reason
                      above), a student's request it refused (token ids beyond its vocabulary)
    RunStopped        a run preempted (SIGTERM, SIGUSR2) before its last step that nothing requeues: saved, and
                      exits non-zero so that a relaunch (or torchrun's restart) resumes it
    RunFailed         a run a command launched (a benchmark's or the study's training runs, the cache writer)
                      failed or ran out of time; the sentence names the run's log, which holds its own error

A bug raises a plain exception, or fails an `assert` for a state our own code should never reach.
"""


class UserError(Exception):
    """An error whose message tells the user what to change; reported without a traceback."""


class ConfigError(UserError, ValueError):
    """A config value, key, type or cross-key rule is wrong; the sentence names the key, the value and the fix."""


class LaunchError(UserError, ValueError):
    """The launch does not fit the config: the number of ranks, their placement, the launcher's environment."""


class MissingPathError(UserError, FileNotFoundError):
    """A path the user gave does not exist or is incomplete; the sentence says what should be there."""


class DataError(UserError, ValueError):
    """Files or data the user gave cannot be used as they are (damaged, mismatched, empty); the sentence says how
    to get usable ones."""


class StorageError(UserError, OSError):
    """A write the run needs failed (full disk, permission, quota); the sentence names the path and what is safe."""


class NonFiniteError(UserError, FloatingPointError):
    """The loss or a teacher's outputs are not finite; the sentence names the step, the rank(s) and the part."""


class TeacherError(UserError, RuntimeError):
    """A teacher's failure (a failed load, a refused request) that every bridge member reports alike."""


class RunFailed(UserError, RuntimeError):
    """A run this command launched failed or ran out of time; the sentence names its log."""


class RunStopped(UserError, RuntimeError):
    """A run stopped before its last step (a preemption signal) with a checkpoint, and nothing requeues it: the
    non-zero exit makes a launcher's restarts (torchrun --max-restarts) resume it; the sentence says how far it got."""


class CrashLoop(UserError, RuntimeError):
    """The run crashed at the same step several launches in a row: restarting again would only loop."""


class PeerStopped(Exception):
    """Another rank stopped first (it failed, or this one lost it in a collective): the message names that
    rank and its log (this rank's traceback would only show where it was waiting)."""


class CollectiveTimeout(PeerStopped):
    """A collective's timeout ran out: the message names the group, the rank(s) that did not arrive and the
    step (the backend's own words only say how long it waited). Reported like `PeerStopped` (exit 1)."""


def describe(err: BaseException) -> str:
    """An error as one rank relays it to others: a user error or a peer's stop is its sentence alone; a bug
    keeps its type, which is half of what a developer needs."""
    return str(err) if isinstance(err, (UserError, PeerStopped)) else f"{type(err).__name__}: {err}"


# CUDA's sticky errors: the context is unusable after one, every later CUDA call (a reply included) fails alike.
STICKY_DEVICE_ERRORS = ("device-side assert triggered", "an illegal memory access was encountered",
                        "unspecified launch failure", "misaligned address", "an illegal instruction was encountered",
                        "hardware stack error", "invalid program counter", "uncorrectable ECC error",
                        "the launch timed out and was terminated")


def is_sticky_device_error(err: BaseException) -> bool:
    """A CUDA error that poisoned this process's context (a device-side assert, an illegal address, ...): nothing
    more can run on its device, so a rank that hits one can only leave (its note and log keep the sentence)."""
    text = str(err)
    return isinstance(err, RuntimeError) and "CUDA error" in text and any(s in text for s in STICKY_DEVICE_ERRORS)
