"""What a checkpoint's files say when a save or a load goes wrong, in one sentence instead of torch's traceback.

- A save that fails (full disk, permission, quota) is `CheckpointWriteFailed` on every training rank: the path,
  the error, the rank that hit it and the last complete checkpoint, which is still safe; the partial `.tmp` goes (a
  complete one whose rename into place failed stays, and a re-saved step's previous save is rolled back).
- Before a save, a warning when the disk has less free space than the last checkpoint took.
- A checkpoint that cannot be read (a torn `.distcp`, a damaged `.metadata` or train state) is
  `CheckpointUnreadable` on every training rank: it names the damaged checkpoint, the newest intact one, and how
  to resume from that: move the damaged one aside (its name then no longer matches a step, so nothing reads it).
  `damage()` checks what can be checked without reading tensors: the metadata loads and every shard file holds
  the bytes the metadata places in it.

Both are agreed errors: the training ranks reach them together (DCP's own collectives, or an exchange of each
rank's local error), so a teacher is told before they leave.
"""

import errno
import json
import logging
import shutil
from pathlib import Path
from typing import Callable, Optional

from lingua.errors import DataError, StorageError
from lingua.parallel.collectives import AgreedError

logger = logging.getLogger(__name__)
MARKER = "checkpoint.json"  # a checkpoint's completion marker, written last (lingua/checkpoint.py)


class CheckpointWriteFailed(AgreedError, StorageError):
    """A checkpoint could not be written (the sentence names the path, the error and the last complete one)."""


class CheckpointUnreadable(AgreedError, DataError):
    """A checkpoint cannot be read (the sentence names it, the newest intact one and how to resume from it)."""


def _os_error(err: BaseException) -> Optional[OSError]:
    """The OSError behind `err`: itself, one rank's failure inside DCP's CheckpointException, or its cause."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, OSError):
            return err
        for failure in (getattr(err, "failures", None) or {}).values():
            found = _os_error(failure[0] if isinstance(failure, tuple) else failure)
            if found is not None:
                return found
        err = err.__cause__ or err.__context__
    return None


def failure_words(err: BaseException) -> str:
    """One line for what went wrong: `No space left on device (ENOSPC)`, or the first line of anything else."""
    found = _os_error(err)
    if found is not None and found.errno is not None:
        where = f" on {found.filename}" if found.filename else ""
        return f"{found.strerror or found} ({errno.errorcode.get(found.errno, found.errno)}){where}"
    failures = getattr(err, "failures", None)
    if failures:  # DCP's own words: only the exceptions, never its formatted tracebacks
        first = next(iter(failures.values()))
        err = first[0] if isinstance(first, tuple) else first
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"


def checkpoint_bytes(ckpt: Optional[Path]) -> int:
    """The bytes the files of checkpoint `ckpt` take (0 for None)."""
    return sum(p.stat().st_size for p in Path(ckpt).rglob("*") if p.is_file()) if ckpt else 0


def warn_if_short_of_space(root: Path, last: Optional[Path]) -> None:
    """A warning when the filesystem of `root` has less free space than the last checkpoint took."""
    needed = checkpoint_bytes(last)
    free = shutil.disk_usage(root).free
    if needed and free < needed:
        logger.warning(f"{root} has {free / 2**20:.0f} MiB free but the last checkpoint ({last}) took "
                       f"{needed / 2**20:.0f} MiB: this save may fail; free some space or set checkpoint.dump.keep")


def save_failed(step: int, tmp: Path, words: str, rank: int, last, kept: Optional[str] = None) -> CheckpointWriteFailed:
    """`last`: the newest complete checkpoint (a Path, None) or why it is not known (str); `kept`: where the new
    save's files are when they stay (it failed in or after its rename into place)."""
    safe = last if isinstance(last, str) else f"the last complete checkpoint is {last}" if last else \
        "no complete checkpoint is on disk yet"
    return CheckpointWriteFailed(
        f"the checkpoint of step {step} could not be written to {tmp} ({words}, on train rank {rank}); "
        f"{kept or 'its partial files are removed'} and {safe}; free space (or fix the permission or quota) and "
        f"relaunch: it resumes from there")


def after_failed_rename(tmp: Path, final: Path, latest: Callable[[], Optional[Path]]) -> tuple:
    """Rank 0, once a save failed in or after renaming `tmp` to `final`: the newest complete checkpoint now on disk
    (or why it cannot be told) and where the new save stays (None: it was partial and is removed). A complete `tmp`
    (its marker written) stays: the step's previous save may be stuck in `.old`. Never raises: the others wait."""
    old = final.with_name(final.name + ".old")
    try:
        if not tmp.exists():
            return latest(), f"it is in place at {final} but what follows the rename failed"
        if (tmp / MARKER).is_file():
            return latest(), f"its complete files stay in {tmp}" + (f" and the step's previous save in {old}" *
                                                                   old.exists())
        shutil.rmtree(tmp, ignore_errors=True)
        return latest(), None
    except OSError as err:
        return f"what is on disk cannot be listed ({failure_words(err)})", f"its files stay in {tmp} or {final}"


def damage(ckpt: Path) -> Optional[str]:
    """What is wrong with the files of a complete-looking checkpoint, or None when they hold what the metadata says.
    Never raises an OSError: rank 0 checks alone while the others wait for its word."""
    try:
        return _damage(ckpt)
    except OSError as err:  # a permission, a vanished file: listing or sizing them fails
        return f"its files cannot be checked ({failure_words(err)})"


def _damage(ckpt: Path) -> Optional[str]:
    from torch.distributed.checkpoint import FileSystemReader

    for path in sorted(Path(ckpt).glob("*.json")):  # the marker, params and every rank's train state
        try:
            json.loads(path.read_text())
        except (OSError, ValueError) as err:
            return f"{path.name} cannot be read ({type(err).__name__})"
    try:
        metadata = FileSystemReader(str(ckpt)).read_metadata()
    except Exception as err:  # torn or not a DCP file: whatever the unpickler says
        return f"its .metadata cannot be read ({type(err).__name__})"
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        path = Path(ckpt) / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size < size:
            return f"{name} is truncated ({path.stat().st_size} of {size} bytes)"
    return None


def newest_intact(candidates: list[Path], damaged: Path) -> Optional[Path]:
    """The newest of `candidates` (oldest first) older than `damaged` whose files are whole."""
    older = [p for p in candidates if int(p.name) < int(damaged.name)] if damaged.name.isdigit() else candidates
    return next((p for p in reversed(older) if damage(p) is None), None)


def unreadable(ckpt: Path, why: str, intact: Optional[Path]) -> CheckpointUnreadable:
    if intact is None:
        resume = (f"no earlier checkpoint is intact: move it aside (`mv {ckpt} {ckpt}.damaged`) and relaunch to "
                  f"start from step 0, or set checkpoint.init_ckpt_path to another run's checkpoint")
    else:
        resume = (f"the newest intact one is {intact}; to resume from it, move the damaged one aside "
                  f"(`mv {ckpt} {ckpt}.damaged`) and relaunch")
    return CheckpointUnreadable(f"checkpoint {ckpt} cannot be read: {why}; {resume}")


def other_world_size(ckpt: Path, saved_world: Optional[int], world: int, root: Path, own_path: bool,
                     resuming: bool) -> str:
    """Why `ckpt` (of `saved_world` training ranks) cannot resume a run of `world`, and a fix that works: the same
    rank count, or its weights in a run of its own. A run resumes from its own checkpoint root (`root`) before it
    reads checkpoint.init_ckpt_path, so that key is only suggested with another dump dir (and checkpoint.path, where
    the run set one: `own_path`); `resuming`: False for init_ckpt_path with continue_training_from_init."""
    head = (f"checkpoint {ckpt} was written by {saved_world} training ranks but this run has {world}; the "
            f"data-loader state is per rank, so ")
    if not resuming:
        return head + (f"continue it with {saved_world} training ranks, or take only its weights: drop "
                       f"checkpoint.continue_training_from_init.")
    where = ("dump_dir=<a new folder> checkpoint.path=<a new folder>" if own_path else
             f"dump_dir=<a new folder, e.g. {root.parent}_{world}ranks>")
    return head + (f"resume with {saved_world} training ranks, or start a new run from its weights in a dump dir of "
                   f"its own: {where} checkpoint.init_ckpt_path={ckpt} (in this dump dir, init_ckpt_path is not read: "
                   f"a run resumes from its own checkpoint first).")
