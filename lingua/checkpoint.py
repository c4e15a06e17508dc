"""Distributed checkpoints (DCP) on the training group: save, resume, retention, and export to one file.

Layout of `<root>/<step:010d>/`:
  .metadata, __<rank>_0.distcp       DCP shards of {"model": model_state_dict, "optim": optimizer_state_dict}
  train_state_<train_rank:05d>.json  per training rank (step, scheduler, data-loader position, ...)
  params.json                        the full training config, written by train rank 0
  checkpoint.json                    {"step", "kinds", "train_world_size"}: written last, the completion marker

A save goes to `<step:010d>.tmp/` and is renamed into place by train rank 0 once every rank has
written its part, so a crash mid-save leaves only a `.tmp` directory that `latest()` never picks and
the next save removes. Every barrier and DCP call runs on the training group passed in: the teacher
ranks of a distillation job never take part (a checkpoint on the default group hangs the job). A save that
fails (full disk, permission) and a checkpoint that cannot be read are one agreed sentence on every training
rank (lingua/run/checkpoint_health.py); a torn newest checkpoint is named, never skipped silently.

Export: `python -m lingua.checkpoint consolidate <ckpt_dir> <out_file>`.

torch.distributed.checkpoint is imported where it is used: with the DTensor stack it pulls in, it would
cost every rank about a second before its config is even checked (the same holds for DTensor elsewhere).
"""

import argparse
import json
import logging
import os
import re
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from lingua.args import require
from lingua.cli.entry import run_cli
from lingua.run.checkpoint_health import (MARKER, after_failed_rename, damage, failure_words, newest_intact,
                                          other_world_size, save_failed, unreadable, warn_if_short_of_space)
from lingua.errors import DataError, LaunchError, MissingPathError
from lingua.parallel.collectives import first_error, log_collective

logger = logging.getLogger(__name__)

KINDS = ("dump", "eval")
PARAMS = "params.json"
DCP_METADATA = ".metadata"
_FINAL_NAME = re.compile(r"^\d{10}$")
# Leftovers of an interrupted save (.tmp) or of a replaced/deleted checkpoint (.old).
_STALE_SUFFIXES = (".tmp", ".old")


@dataclass
class SaveEvery:
    every: int = 1000  # 0 disables this kind of checkpoint
    keep: int = 0  # how many of the newest checkpoints of this kind to keep; 0 (or Lingua's -1) keeps all
    every_minutes: float = 0.0  # dump only: also once this long after this launch's last save (agreed); 0: steps only

    def validate(self, where: str) -> None:
        require(self.every >= 0, f"{where}.every", self.every, "use a number of steps, or 0 to disable")
        require(self.every_minutes >= 0 and (where == "checkpoint.dump" or not self.every_minutes),
                f"{where}.every_minutes", self.every_minutes, "use minutes >= 0 (0 disables), in checkpoint.dump only")
        require(self.keep >= -1, f"{where}.keep", self.keep, "use 0 or -1 (keep all) or how many to keep")


@dataclass
class CheckpointArgs:
    dump: SaveEvery = field(default_factory=SaveEvery)
    eval: SaveEvery = field(default_factory=SaveEvery)
    path: Optional[str] = None  # checkpoint root; the trainer defaults it to <dump_dir>/checkpoints
    init_ckpt_path: Optional[str] = None  # start from these weights (fresh optimizer) if nothing to resume
    # With init_ckpt_path: also restore its optimizer and train state (continue that run in a new dump dir).
    continue_training_from_init: bool = False

    def validate(self) -> None:
        for kind in KINDS:
            getattr(self, kind).validate(f"checkpoint.{kind}")
        for key in ("path", "init_ckpt_path"):
            require(getattr(self, key) != "", f"checkpoint.{key}", getattr(self, key), "use a directory, or null")


def train_state_name(train_rank: int) -> str:
    return f"train_state_{train_rank:05d}.json"


def _write_json(path: Path, obj) -> None:
    """Write `obj` as JSON and fsync it, so a checkpoint renamed into place is on disk."""
    with open(path, "w") as f:
        json.dump(obj, f, indent=2)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    # Makes renames/creations inside `path` durable; some filesystems refuse, which is harmless.
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def is_complete(ckpt_dir: Path) -> bool:
    """True for a finished checkpoint directory (DCP metadata and the completion marker present)."""
    ckpt_dir = Path(ckpt_dir)
    return (ckpt_dir / DCP_METADATA).is_file() and (ckpt_dir / MARKER).is_file()


def read_marker(ckpt_dir: Path) -> dict:
    with open(Path(ckpt_dir) / MARKER) as f:
        return json.load(f)


def complete_checkpoints(root: Path) -> list[Path]:
    """Finished checkpoints under `root`, oldest step first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and _FINAL_NAME.match(p.name) and is_complete(p)]
    return sorted(found, key=lambda p: int(p.name))


def _remove_dir(path: Path) -> None:
    """Rename to `.old` first, so a crash mid-delete leaves a stale dir, never a half-deleted checkpoint."""
    trash = path.with_name(path.name + ".old")
    if trash.exists():
        shutil.rmtree(trash)
    os.rename(path, trash)
    shutil.rmtree(trash)


class CheckpointManager:
    """Saves and loads checkpoints under `root` for the ranks of `group` (the training group): `train_rank` of
    `train_world_size`. Filesystem bookkeeping (renames, retention, stale cleanup) is done by train rank 0 only."""

    def __init__(self, args: CheckpointArgs, root: str, group: dist.ProcessGroup, train_rank: int,
                 train_world_size: int):
        assert group is not None, "CheckpointManager needs the training group, never the default group"
        assert 0 <= train_rank < train_world_size, (train_rank, train_world_size)
        self.args, self.root, self.group = args, Path(root), group
        self.train_rank, self.train_world_size = train_rank, train_world_size
        self._last_saved_step: Optional[int] = None  # the step whose weights this manager wrote last
        self.step_on_disk: Optional[int] = None  # the step of the checkpoint saved or loaded last
        self.last_save_time = time.monotonic()  # this launch's start, then its last save (dump.every_minutes)

    def minutes_due(self) -> bool:
        """dump.every_minutes passed since the last save on this rank's clock: a flag to agree on (`agree_flags`)."""
        return 0 < 60 * self.args.dump.every_minutes <= time.monotonic() - self.last_save_time

    def should_save(self, step: int, stop_now: bool = False, last_step: bool = False, timed: bool = False) -> list[str]:
        """The kinds of checkpoint due after `step`: "dump" every dump.every steps, when the students agreed that
        dump.every_minutes passed (`timed`), when stopping early (`stop_now`: preemption, exit_after_steps) and
        after the last step unless that step is on disk already; "eval" every checkpoint.eval.every steps."""
        kinds = []
        dump_every = self.args.dump.every
        if (dump_every and step % dump_every == 0) or timed or stop_now or (last_step and step != self.step_on_disk):
            kinds.append("dump")
        if self.eval_due(step):
            kinds.append("eval")
        return kinds

    def eval_due(self, step: int) -> bool:
        """Whether an "eval" checkpoint is saved after `step` (every checkpoint.eval.every steps, the last step
        included only when it falls on one; stopping early adds none): known before the step runs."""
        return bool(self.args.eval.every) and step % self.args.eval.every == 0

    @property
    def is_master(self) -> bool:
        return self.train_rank == 0

    def final_dir(self, step: int) -> Path:
        return self.root / f"{step:010d}"

    def save(self, model: nn.Module, optimizer: torch.optim.Optimizer, train_state: dict, step: int, config: dict,
             kind: str = "dump") -> Path:
        """Write a checkpoint of `step` (collective over the training group); return its directory.

        `train_state` is this rank's JSON-serialisable state; `config` the resolved training config.
        Saving the step this manager has just saved again (e.g. an eval checkpoint on a dump step)
        only records the extra kind instead of writing the same state twice.
        """
        if kind not in KINDS:
            raise ValueError(f"checkpoint kind {kind!r} is unknown; use one of {', '.join(KINDS)}.")
        start = time.perf_counter()
        final = self.final_dir(step)
        tmp, error = final.with_name(final.name + ".tmp"), None
        if step == self._last_saved_step:
            if self.is_master:
                try:
                    self._add_kind(final, kind)
                    self._apply_retention()
                except OSError as err:  # rank 0 alone: the others must hear it, not wait
                    error = (failure_words(err), self.train_rank, *after_failed_rename(tmp, final, self.latest))
            self._agree_written("re-save kind", error, step, tmp)
            return final

        if self.is_master:
            try:
                self.root.mkdir(parents=True, exist_ok=True)
                self._remove_stale()
                warn_if_short_of_space(self.root, self.latest())
                tmp.mkdir()
            except OSError as err:
                error = failure_words(err), self.train_rank
        self._agree_written("tmp dir", error, step, tmp)  # nobody writes into tmp before rank 0 created it

        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.api import CheckpointException
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, optim_state = get_state_dict(model, optimizer)
        log_collective("dcp.save", self.group)
        try:  # DCP's own failures reach every rank at once (CheckpointException); our files are agreed below
            dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(tmp), process_group=self.group)
            _write_json(tmp / train_state_name(self.train_rank), train_state)
            if self.is_master:
                _write_json(tmp / PARAMS, config)
        except (OSError, CheckpointException) as err:
            error = failure_words(err), min(getattr(err, "failures", None) or [self.train_rank])  # DCP: who failed
        self._agree_written("shards written", error, step, tmp)  # every rank's shards and train state are on disk

        if self.is_master:
            try:
                self._put_in_place(tmp, final, step, kind)
                logger.info(f"saved {kind} checkpoint of step {step} to {final} in {time.perf_counter() - start:.1f}s")
            except OSError as err:  # rank 0 tells what is on disk now: the others must not look while it moves
                error = (failure_words(err), self.train_rank, *after_failed_rename(tmp, final, self.latest))
        self._agree_written("rename", error, step, tmp)  # the checkpoint is in place for everyone before anyone moves on
        self._last_saved_step = self.step_on_disk = step
        self.last_save_time = time.monotonic()
        return final

    def _put_in_place(self, tmp: Path, final: Path, step: int, kind: str) -> None:
        """Rank 0: the completion marker, then `tmp` renamed to `final` (replacing an older save of that step)."""
        kinds = {kind}
        if is_complete(final):
            # Re-save of a step (e.g. after a resume): keep the kinds it was already counted under.
            kinds |= set(read_marker(final).get("kinds", []))
        _write_json(tmp / MARKER, dict(step=step, kinds=sorted(kinds), train_world_size=self.train_world_size))
        if final.exists():
            # Two renames, never a moment without a copy on disk; a crash between them leaves .old/.tmp.
            old = final.with_name(final.name + ".old")
            if old.exists():
                shutil.rmtree(old)
            os.rename(final, old)
            try:
                os.rename(tmp, final)
            except OSError:
                os.rename(old, final)  # roll back: the step's previous save is in place again, the new one in tmp
                raise
            shutil.rmtree(old)
        else:
            os.rename(tmp, final)
        _fsync_dir(self.root)
        self._apply_retention()

    def _agree_written(self, why: str, error: Optional[tuple], step: int, tmp: Path) -> None:
        """A barrier that also tells every rank whether a rank failed its part of the save (`error`: the words, the
        train rank that failed, after a rename rank 0's `after_failed_rename`); if one did, every rank raises the
        same sentence (`CheckpointWriteFailed`)."""
        failed = first_error(error, self.group, f"checkpoint {why}")
        if failed is None:
            return
        words, rank, *after = failed[1]
        if not after:  # nothing was renamed: every rank sees the same checkpoints
            if self.is_master:
                shutil.rmtree(tmp, ignore_errors=True)
            after = self.latest(), None
        raise save_failed(step, tmp, words, rank, *after) from None

    def _add_kind(self, final: Path, kind: str) -> None:
        assert is_complete(final), f"{final} was saved by this manager but is not complete"
        marker = read_marker(final)
        marker["kinds"] = sorted(set(marker.get("kinds", [])) | {kind})
        staged = final / (MARKER + ".tmp")
        _write_json(staged, marker)
        os.replace(staged, final / MARKER)

    def _remove_stale(self) -> None:
        for path in self.root.iterdir():
            if path.is_dir() and path.name.endswith(_STALE_SUFFIXES):
                logger.info(f"removing leftover of an interrupted checkpoint operation: {path}")
                shutil.rmtree(path)

    def _apply_retention(self) -> None:
        """Delete checkpoints that no kind keeps any more (each kind keeps its newest `keep`)."""
        checkpoints = [(p, set(read_marker(p).get("kinds", []))) for p in complete_checkpoints(self.root)]
        kept = set()
        for kind in KINDS:
            keep = getattr(self.args, kind).keep
            of_kind = [p for p, kinds in checkpoints if kind in kinds]
            kept.update(of_kind[-keep:] if keep > 0 else of_kind)
        for path, _ in checkpoints:
            if path not in kept:
                logger.info(f"retention: deleting checkpoint {path}")
                _remove_dir(path)

    def latest(self) -> Optional[Path]:
        """The newest complete checkpoint under the root, or None."""
        found = complete_checkpoints(self.root)
        return found[-1] if found else None

    def _resolve(self, path: Optional[str]) -> Optional[Path]:
        if path is None:
            return self.latest()
        path = Path(path)
        if not is_complete(path):
            raise MissingPathError(
                f"{path} is not a complete checkpoint (it needs {DCP_METADATA} and {MARKER}); "
                f"point to a <step> directory under a checkpoint root, e.g. {self.root}/0000001000."
            )
        return path

    def load(self, model: nn.Module, optimizer: torch.optim.Optimizer, path: Optional[str] = None) -> Optional[dict]:
        """Restore model and optimizer from `path` (default: the latest checkpoint) on the training group.

        Returns this rank's train state, or None if there is nothing to resume from.
        """
        ckpt = self._resolve(path)
        if ckpt is None:
            logger.info(f"no checkpoint to resume from in {self.root}")
            return None
        # Rank 0 checks the files (cheap: no tensor is read) and tells the others: a torn checkpoint is a sentence.
        damaged = first_error(damage(ckpt) if self.is_master else None, self.group, "checkpoint intact")
        if damaged is not None:
            raise unreadable(ckpt, damaged[1], newest_intact(complete_checkpoints(self.root), ckpt))
        if path is None and self.args.init_ckpt_path and self.is_master:  # it resumes from its own checkpoint first
            logger.warning(f"checkpoint.init_ckpt_path={self.args.init_ckpt_path} is not read: resuming from {ckpt}")
        saved_world = read_marker(ckpt).get("train_world_size")
        if saved_world != self.train_world_size:
            raise LaunchError(other_world_size(ckpt, saved_world, self.train_world_size, self.root,
                                               own_path=bool(self.args.path), resuming=path is None))
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.api import CheckpointException
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        start = time.perf_counter()
        self._last_saved_step = None  # the weights now come from disk: a save of any step writes them out
        model_state, optim_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optim": optim_state}
        log_collective("dcp.load", self.group)
        error, train_state = None, None
        try:  # what the size check cannot see (bytes torn inside a file): DCP's reader fails on every rank at once
            dcp.load(state, checkpoint_id=str(ckpt), process_group=self.group)
            with open(ckpt / train_state_name(self.train_rank)) as f:
                train_state = json.load(f)
        except (OSError, ValueError, CheckpointException) as err:
            error = failure_words(err)
        failed = first_error(error, self.group, "checkpoint read")
        if failed is not None:
            raise unreadable(ckpt, f"{failed[1]} (train rank {failed[0]})",
                             newest_intact(complete_checkpoints(self.root), ckpt))
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        self.step_on_disk = read_marker(ckpt).get("step")
        logger.info(f"loaded checkpoint {ckpt} in {time.perf_counter() - start:.1f}s")
        return train_state

    def _resolve_init(self, path: str) -> Path:
        """A checkpoint dir as given, or the latest one if `path` is a checkpoint root."""
        path = Path(path)
        ckpt = path if is_complete(path) else (complete_checkpoints(path) or [None])[-1]
        if ckpt is None:
            raise MissingPathError(
                f"checkpoint.init_ckpt_path={path} holds no complete checkpoint; point it to a <step> "
                "directory written by this trainer (or to the checkpoint root that contains them)."
            )
        return ckpt

    def load_weights_only(self, model: nn.Module, path: str) -> Path:
        """Load only the model weights from `path` (a checkpoint dir, or a root: its latest); return the dir used.

        Any number of training ranks can read it (DCP reshards); the optimizer is left fresh.
        """
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

        ckpt = self._resolve_init(path)
        state = {"model": get_model_state_dict(model)}
        log_collective("dcp.load weights only", self.group)
        dcp.load(state, checkpoint_id=str(ckpt), process_group=self.group)
        set_model_state_dict(model, state["model"])
        logger.info(f"initialised model weights from {ckpt}")
        return ckpt

    def load_init(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> Optional[dict]:
        """Start from `args.init_ckpt_path`: weights only, or (continue_training_from_init) a full resume.

        Returns the train state of a full resume, None otherwise (also when no init path is set).
        """
        if not self.args.init_ckpt_path:
            return None
        if self.args.continue_training_from_init:
            return self.load(model, optimizer, path=str(self._resolve_init(self.args.init_ckpt_path)))
        self.load_weights_only(model, self.args.init_ckpt_path)
        return None


def consolidate_checkpoint(ckpt_dir: str, out_file: str) -> Path:
    """Turn a DCP checkpoint dir into one `torch.save` file of the model weights (plain tensors).

    Single process, no process group. Keys are the model's parameter/buffer names. Peak memory is
    the whole checkpoint (weights and optimizer state), read by `dcp_to_torch_save`.
    """
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    ckpt_dir, out_file = Path(ckpt_dir), Path(out_file)
    if not (ckpt_dir / DCP_METADATA).is_file():
        raise MissingPathError(f"{ckpt_dir} is not a DCP checkpoint (no {DCP_METADATA}); "
                               "pass a <step> directory from a checkpoint root.")
    out_file.parent.mkdir(parents=True, exist_ok=True)
    # The full conversion lands next to the output (same filesystem), then only the weights are kept.
    fd, full_path = tempfile.mkstemp(prefix=out_file.name + ".", suffix=".full", dir=out_file.parent)
    os.close(fd)
    try:
        dcp_to_torch_save(ckpt_dir, full_path)
        full = torch.load(full_path, map_location="cpu", mmap=True, weights_only=True)
        if "model" not in full:
            raise DataError(f"{ckpt_dir} has no 'model' entry; it was not written by lingua.checkpoint.")
        weights = full["model"]
        torch.save(weights, out_file)
    finally:
        os.remove(full_path)
    logger.info(f"consolidated {len(weights)} tensors from {ckpt_dir} into {out_file}")
    return out_file


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m lingua.checkpoint", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    consolidate = commands.add_parser("consolidate", help="DCP checkpoint dir -> one torch.save file of weights")
    consolidate.add_argument("ckpt_dir")
    consolidate.add_argument("out_file")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command == "consolidate":
        consolidate_checkpoint(args.ckpt_dir, args.out_file)


if __name__ == "__main__":
    run_cli(main)
