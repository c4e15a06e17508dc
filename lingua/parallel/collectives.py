"""The few collectives of the training loop, each on the group it is given, and the per-collective log.

Every function here takes its group explicitly (the collective rule): `group=None` means "no group"
only in a single process; in a job it would silently mean the world, so it is refused.
`agree_flags`, `agree_count` and `first_error` are how ranks agree before they diverge: any decision that changes
which collectives a rank issues (stop, save, fail, loop lengths) goes through one of them first.
`dist_mean_dict` reduces values by key: it checks first, with one small all_reduce, that every rank holds the same
keys, so a key on some ranks only is one sentence on every rank (`KeyMismatch`), never a hang or a mixed-up mean.
"""

import hashlib
import logging
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from lingua.errors import DataError, UserError

logger = logging.getLogger(__name__)
comm_logger = logging.getLogger("lingua.comm")  # per-collective lines; DEBUG level only with distributed.debug
_comm_sequence: dict[str, int] = {}
_last_op: dict[str, str] = {}  # group name -> our last op on it, kept at any log level (the timeout sentence)


def log_collective(op: str, group, *tensors) -> None:
    """One DEBUG line per collective of ours: group name, op, shapes, per-group sequence number. The op is
    remembered per group whatever the log level (`last_logged_collective`)."""
    name = getattr(group, "group_desc", None) or str(id(group))
    _last_op["world" if name == "default_pg" else name] = op
    if not comm_logger.isEnabledFor(logging.DEBUG):
        return
    seq = _comm_sequence[name] = _comm_sequence.get(name, 0) + 1
    shapes = ", ".join(f"{tuple(t.shape)}:{str(t.dtype).replace('torch.', '')}" for t in tensors)
    comm_logger.debug(f"collective #{seq} on {name}: {op} [{shapes}]")


def last_logged_collective(group_name: str):
    """Our last op logged on a group (by its Topology name), or None: where a rank without a flight recorder was."""
    return _last_op.get(group_name)


def _require_group(group, what: str) -> None:
    """group=None is "no group" only in a single process; in a job it would silently mean the world."""
    if group is None and dist.is_initialized() and dist.get_world_size() > 1:
        raise ValueError(f"{what} needs the group to reduce over (e.g. topo.train_group), not None.")


def _alone(group) -> bool:
    return group is None or dist.get_world_size(group) == 1


def dist_mean_dict(values: dict, group, device: torch.device, what: str = "metric") -> dict[str, float]:
    """Mean of each value (Python numbers or device scalars) over `group`: one all_reduce, one host read (after
    `check_same_keys`, which raises `KeyMismatch` on every rank where some rank holds other keys)."""
    _require_group(group, "dist_mean_dict")
    keys = sorted(values)
    tensor = torch.stack([torch.as_tensor(values[k], dtype=torch.float64, device=device).reshape(()) for k in keys])
    if not _alone(group):
        check_same_keys(keys, group, device, what)
        log_collective("all_reduce(sum) dist_mean_dict", group, tensor)
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
        tensor /= dist.get_world_size(group)
    return dict(zip(keys, tensor.tolist()))


def _keys_digest(keys: list[str]) -> int:
    """63 bits of a hash of the sorted keys, the same in every process (Python's hash() is salted per process)."""
    return int.from_bytes(hashlib.blake2b("\0".join(keys).encode(), digest_size=8).digest(), "big") >> 1


def check_same_keys(keys: list[str], group, device: torch.device, what: str) -> None:
    """Every rank of `group` holds the same keys, or `KeyMismatch` on every rank at once: one all_reduce of the
    keys' digest (max and min), and only when they differ a gather of the names, for the sentence."""
    digest = _keys_digest(sorted(keys))
    extremes = torch.tensor([digest, -digest], dtype=torch.int64, device=device)
    log_collective("all_reduce(max) check_same_keys", group, extremes)
    dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=group)
    highest, lowest = extremes.tolist()
    if highest == -lowest:  # all ranks agree on this, so all return or all gather below
        return
    every: list = [None] * dist.get_world_size(group)
    log_collective("all_gather_object check_same_keys", group)
    dist.all_gather_object(every, sorted(keys), group=group)
    raise KeyMismatch(key_mismatch_sentence(every, dist.get_process_group_ranks(group), what))


def key_mismatch_sentence(keys_per_rank: list[list[str]], ranks: list[int], what: str) -> str:
    """"metric 'kd/x' is on rank 1 only (not on rank 0): ..." for each key some ranks lack, in key order."""
    held = [set(keys) for keys in keys_per_rank]
    parts = []
    for key in sorted(set().union(*held)):
        on = [r for r, keys in zip(ranks, held) if key in keys]
        if len(on) < len(ranks):
            off = [r for r in ranks if r not in on]
            parts.append(f"{what} '{key}' is on rank{'s' if len(on) > 1 else ''} {', '.join(map(str, on))} only "
                         f"(not on rank{'s' if len(off) > 1 else ''} {', '.join(map(str, off))})")
    return (f"{'; '.join(parts)}: every rank must report the same {what} keys to average them, so report each "
            f"on every rank (e.g. 0.0 where it does not apply).")


def dist_gather_floats(values: list[float], group, device: torch.device) -> list[list[float]]:
    """Every rank's list of floats (same length on all ranks), in group-rank order."""
    _require_group(group, "dist_gather_floats")
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    if _alone(group):
        return [tensor.tolist()]
    out = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    log_collective("all_gather dist_gather_floats", group, tensor)
    dist.all_gather(out, tensor, group=group)
    return [t.tolist() for t in out]


def agree_flags(flags: dict, group, device: torch.device) -> dict[str, bool]:
    """A flag is set everywhere if it is set on any rank of `group` (one small all_reduce).

    This is the single point per step where ranks decide to stop, save or fail together. Flags may be
    Python bools or device tensors (a non-finite loss, a teacher's status bit): they are stacked on the
    device, so the step's one host read is the agreed result.
    """
    _require_group(group, "agree_flags")
    keys = sorted(flags)
    tensor = torch.stack([torch.as_tensor(flags[k], device=device).reshape(()).to(torch.int32) for k in keys])
    if not _alone(group):
        log_collective(f"all_reduce(max) agree_flags {keys}", group, tensor)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
    return {k: bool(v) for k, v in zip(keys, tensor.tolist())}


class AgreedError(Exception):
    """An error every rank of a group raises at the same point, because they agreed on it (so a peer that
    talks to other ranks, like a student to its teacher, can tell them before raising)."""


class KeyMismatch(AgreedError, UserError, ValueError):
    """Ranks hold different keys for a reduction by key (a metric logged on some students only); raised on every
    rank of the group at once (it is agreed)."""


class CountMismatch(AgreedError, DataError):
    """Ranks hold different loop lengths (eval batches with heldout.uneven=error); raised on every rank of the
    group at once (it is agreed)."""


def agree_count(count: int, group, device: torch.device, what: str, mode: str = "equal") -> int:
    """Agree on a loop length across `group` before entering the loop.

    mode="equal": every rank must have the same count, else an error naming each rank's count.
    mode="min": every rank runs the smallest count (a warning names the ranks that differ).
    """
    counts = [int(c[0]) for c in dist_gather_floats([float(count)], group, device)]
    if len(set(counts)) == 1:
        return counts[0]
    ranks = dist.get_process_group_ranks(group) if group is not None else [0]
    detail = ", ".join(f"rank {r}: {c}" for r, c in zip(ranks, counts))
    if mode == "equal":
        raise CountMismatch(f"Ranks disagree on the number of {what} ({detail}); refusing to enter a loop that would hang.")
    logger.warning(f"ranks hold different numbers of {what} ({detail}); every rank runs {min(counts)}")
    return min(counts)


def make_dir_for_group(path: Path, is_master: bool, group, what: str) -> Path:
    """The master creates `path`; every rank of `group` waits until it exists (one barrier on `group`).

    `group` may be None only in a single process without torch.distributed.
    """
    if is_master:
        Path(path).mkdir(parents=True, exist_ok=True)
    if group is not None:
        log_collective(f"barrier {what}", group)
        dist.barrier(group=group)
    elif dist.is_available() and dist.is_initialized():
        raise ValueError(f"{what} needs the process group of the ranks that use it (e.g. topo.train_group); "
                         f"it never synchronises on the default group.")
    return Path(path)


def first_error(error: Optional[object], group, what: str) -> Optional[tuple[int, object]]:
    """(group rank, its `error`) of the first rank of `group` whose local step failed (`error` not None), or None: every
    rank learns it at once, so all raise together instead of some waiting in the next collective. Also a barrier."""
    _require_group(group, "first_error")
    if _alone(group):
        return None if error is None else (0, error)
    errors: list = [None] * dist.get_world_size(group)
    log_collective(f"all_gather_object {what}", group)
    dist.all_gather_object(errors, error, group=group)
    return next(((rank, words) for rank, words in enumerate(errors) if words is not None), None)
