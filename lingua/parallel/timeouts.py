"""Collective timeouts in two phases, and the hang watch.

Generous `distributed.init_timeout_s` while loading, compiling and exchanging the first batch; then
`distributed.train_timeout_s` on every group of a rank, bridges included, once the first step went
through. The new value is set on every backend that governs a group -- through `torch.distributed.set_timeout` where
this torch has it, else (and under DETAIL, whose `_ProcessGroupWrapper` and own gloo check group no public
API reaches) backend by backend -- and read back for the log.
`HangWatch` says where a rank is stuck (every thread's stack, the last collectives) shortly before the
timeout in force would fire.
"""

import contextlib
import faulthandler
import logging
import sys
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

from lingua.logger import rank_log_file
from lingua.parallel import watch
from lingua.parallel.collectives import log_collective
from lingua.parallel.private_api import private_api, public_api

logger = logging.getLogger(__name__)
_detail_check_groups: dict[str, list] = {}  # group name -> DETAIL's gloo check group(s), see keep_detail_check_groups


def keep_detail_check_groups() -> None:
    """Under TORCH_DISTRIBUTED_DEBUG=DETAIL, remember the gloo group torch creates next to each process
    group, keyed by group name, so the two-phase switch can change its timeout too.

    DETAIL wraps every backend in a `_ProcessGroupWrapper` whose own gloo group runs a monitored
    barrier before each collective: a missing peer is detected there, under that group's timeout.
    torch keeps no Python handle on it, so we record it as `_create_process_group_wrapper` makes it.
    """
    c10d = dist.distributed_c10d
    create = private_api("detail_wrapper")
    if create is None or getattr(create, "keeps_check_groups", False) or not hasattr(c10d, "ProcessGroupGloo"):
        return

    def create_and_keep(*args, **kwargs):
        gloo, made = c10d.ProcessGroupGloo, []

        def gloo_kept(*gloo_args, **gloo_kwargs):
            made.append(gloo(*gloo_args, **gloo_kwargs))
            return made[-1]

        c10d.ProcessGroupGloo = gloo_kept  # only while torch builds the wrapper; groups are made on one thread
        try:
            wrapper = create(*args, **kwargs)
        finally:
            c10d.ProcessGroupGloo = gloo
        name = kwargs.get("store_prefix", args[1] if len(args) > 1 else None)
        _detail_check_groups.setdefault(str(name), []).extend(made)
        return wrapper

    create_and_keep.keeps_check_groups = True
    c10d._create_process_group_wrapper = create_and_keep


def forget_detail_check_groups() -> None:
    """At process-group teardown: the recorded check groups die with their process groups."""
    _detail_check_groups.clear()


def _timeout_backends(group) -> list[tuple[str, object]]:
    """(label, backend) for every backend whose timeout governs `group`: each device's real backend,
    unwrapped from DETAIL's `_ProcessGroupWrapper` (`wrapped_pg`), then DETAIL's gloo check group."""
    found: list[tuple[str, object]] = []
    for device in getattr(group, "_device_types", [torch.device("cpu")]):
        try:
            backend = group._get_backend(device)
        except RuntimeError:
            continue
        backend = getattr(backend, "wrapped_pg", backend)
        if not any(known is backend for _, known in found):
            found.append((backend.name() if hasattr(backend, "name") else type(backend).__name__, backend))
    for check in _detail_check_groups.get(str(getattr(group, "group_name", "")), []):
        found.append(("DETAIL checks", check))
    labels = [label for label, _ in found]
    return [(f"{label} {labels[:i].count(label) + 1}" if labels.count(label) > 1 else label, backend)
            for i, (label, backend) in enumerate(found)]


def _backend_timeout_s(backend) -> Optional[float]:
    """The timeout a backend will apply, read from its options (None where this torch hides it)."""
    timeout = getattr(getattr(backend, "options", None), "_timeout", None)
    return timeout.total_seconds() if isinstance(timeout, timedelta) else None


def group_timeouts(group) -> dict[str, Optional[float]]:
    """Seconds each backend of `group` will wait, read back from the backends themselves."""
    return {label: _backend_timeout_s(backend) for label, backend in _timeout_backends(group)}


def set_group_timeout(group, seconds: float) -> dict[str, Optional[float]]:
    """Set every backend of `group` (gloo or NCCL, wrapped by DETAIL or not) to `seconds`; returns
    what each backend reports afterwards. The public `torch.distributed.set_timeout` where this torch has one
    (2.14+), unless DETAIL wraps the backends: torch's own setters skip the wrapper and its check group."""
    timeout = timedelta(seconds=seconds)
    public = public_api("set_backend_timeout")
    if public is not None and dist.get_debug_level() != dist.DebugLevel.DETAIL:
        public(timeout, group=group)
        return group_timeouts(group)
    for _, backend in _timeout_backends(group):
        setter = getattr(backend, "_set_default_timeout", None) or getattr(backend, "set_timeout", None)
        try:
            if setter is not None:
                setter(timeout)
        except RuntimeError:  # a backend that cannot switch keeps its timeout; the read-back shows it
            continue
    return group_timeouts(group)


def set_collective_timeout(topo, seconds: float) -> None:
    """Switch every group of this rank (bridges included) to a new timeout (the two-phase scheme).
    The log line reports what the backends read back, not what was asked."""
    if not topo.distributed:
        return
    groups = topo.all_groups()
    effective = {}
    for group in groups:
        name = topo.group_names.get(id(group)) or getattr(group, "group_desc", "?")
        for label, value in set_group_timeout(group, seconds).items():
            effective[f"{name} ({label})"] = value
    values = set(effective.values())
    if len(values) == 1 and None not in values:
        logger.info(f"collective timeout set to {values.pop():.0f}s on {len(groups)} groups "
                    f"({len(effective)} backends, read back)")
    else:
        logger.warning(f"collective timeout: asked for {seconds:.0f}s, the backends report " + ", ".join(
            f"{key}={'unknown' if v is None else f'{v:.0f}s'}" for key, v in effective.items()))


def enter_training_timeout(topo, seconds: float) -> None:
    """Students, after their first full step: a barrier on each group only students use (train and
    mesh groups), then the short timeout on every group. The bridge needs no barrier: the teacher
    switches by itself when the first request of a later step (or a STOP) reaches it."""
    if not topo.distributed:
        return
    for group in topo.all_groups():
        if (group is dist.group.WORLD or group is topo.teacher_group
                or any(group is bridge for bridge in (topo.bridge_group, *getattr(topo, "bridge_groups", ())))):
            continue
        log_collective("barrier before the training timeout", group)
        dist.barrier(group=group)
    set_collective_timeout(topo, seconds)


@contextlib.contextmanager
def generous_timeout(topo, generous_s: float, restore_s: float, hang_watch=None, step: Optional[int] = None):
    """Around a long pause every student knows of in advance (an in-process checkpoint evaluation, during which
    the other students wait in a collective and a teacher waits for the next request): every group of this rank
    and its hang watch on `generous_s`, then back to `restore_s` (the timeout in force before), on any exit."""
    set_collective_timeout(topo, generous_s)
    if hang_watch is not None:
        hang_watch.arm(generous_s, step)
    try:
        yield
    finally:
        set_collective_timeout(topo, restore_s)
        if hang_watch is not None:
            hang_watch.arm(restore_s, step)


class HangWatch:
    """Says where a step or wait is stuck shortly before the collective timeout would end it.

    `arm(timeout_s, step)` re-arms faulthandler's single timer, which writes every thread's stack from C (even
    while the GIL is held) into the rank's log (on stderr before the log is open: the console keeps sentences), and the rank's watch thread (`lingua/parallel/watch.py`, when one
    runs), which logs where the main thread is, appends the stacks to the rank's log, notes it in the status
    file and, with `distributed.debug=trace`, dumps the flight recorder. Cheap, so always on.
    """

    def __init__(self, fraction: float = 0.9):
        self.fraction = fraction
        self.log = None  # the rank's log, open for faulthandler (which needs a file it can write from C)

    def arm(self, timeout_s: float, step: Optional[int] = None) -> None:
        delay = max(1.0, timeout_s * self.fraction)
        if self.log is None and rank_log_file() is not None:
            self.log = open(rank_log_file(), "a")
        faulthandler.dump_traceback_later(delay, repeat=False, file=self.log or sys.stderr)
        watch.arm(delay, timeout_s, step)

    @staticmethod
    def cancel() -> None:
        faulthandler.cancel_dump_traceback_later()
        watch.cancel()

    def __enter__(self) -> "HangWatch":
        return self

    def __exit__(self, *exc) -> None:
        self.cancel()
        if self.log is not None:
            self.log.close()
            self.log = None
