"""In-job restarts: a crashed generation of ranks is replaced by the launcher's next one, which resumes.

Under `torchrun --max-restarts N` a rank that dies takes its generation down and torchrun starts the next one.
Three things make that work and show it:

  - Each generation's rendezvous is its own. torchrun's workers rendezvous on the launcher's own TCP store
    (TORCHELASTIC_USE_AGENT_STORE), which outlives them, so a restarted rank would read the earlier attempt's
    keys -- gloo's peer addresses, NCCL's unique id -- and fail or wait out its timeout (PyTorch #135712).
    `attempt_store` puts this attempt's keys under a prefix of its restart count, which every rank of one torchrun
    agent shares. Several agents count their restarts apart (one restarted by a membership change counts none),
    so a launch of several nodes uses the c10d rendezvous with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 instead (a
    fresh store per round, hosted by rank 0), and says at startup when it does not. (lingua.stool's jobs rerun
    their whole launch step instead: a fresh rendezvous each time, lingua/slurm.py.)
  - The previous generation's crash is read from its status files (`CrashRecord`), before this generation's
    ranks replace them (`read_crash`); every rank learns it from rank 0 (`agree_on_recovery`), and the train
    master adds it to `<dump_dir>/recovery.jsonl` with the steps redone and the seconds to the next step (`RecoveryLog`).
  - The same step crashing `CRASH_LOOP` times in a row stops the run with one sentence instead of looping.
"""

import json
import logging
import os
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Optional

import torch.distributed as dist

from lingua.errors import CrashLoop
from lingua.parallel.collectives import log_collective
from lingua.parallel.rank_status import first_stopped
from lingua.run.dump_dir import RunDir, read_jsonl

logger = logging.getLogger(__name__)

CRASH_LOOP = 3  # crashes in a row at one step that stop the run
SAFE_MULTI_NODE = "--rdzv-backend c10d and TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"


@dataclass(frozen=True)
class Restarts:
    """torchrun's in-job restarts as this rank's agent counts them (all 0 without torchrun)."""

    count: int = 0  # restarts of this agent's workers before this generation (TORCHELASTIC_RESTART_COUNT)
    max: int = 0  # --max-restarts
    agent_store: bool = False  # the workers rendezvous on the launcher's own TCP store, which outlives them
    agents: int = 1  # torchrun agents (nodes) in the launch

    @property
    def restarted(self) -> bool:
        return self.count > 0


def attempt_store(launch, restarts: Restarts, timeout: timedelta) -> Optional[dist.Store]:
    """The store this generation rendezvous on when it shares the launcher's: a client of it under a prefix of this
    attempt (no key of an earlier attempt can be read). None elsewhere: the usual tcp:// address (a fresh store)."""
    if launch.launcher != "torchrun" or not restarts.agent_store:
        return None
    store = dist.TCPStore(launch.master_addr, launch.master_port, launch.world_size, is_master=False, timeout=timeout)
    return dist.PrefixStore(f"lingua/attempt_{restarts.count}", store)


def unsafe_restart_sentence(restarts: Restarts) -> Optional[str]:
    """The one sentence for a launch whose restarts may not find each other (several agents on a shared store)."""
    if restarts.max > 0 and restarts.agent_store and restarts.agents > 1:
        return (f"this launch restarts ranks (--max-restarts {restarts.max}) on {restarts.agents} torchrun agents that "
                f"share the launcher's store, where a restarted generation can wait for peers that count their "
                f"restarts differently (PyTorch #135712); launch several nodes with {SAFE_MULTI_NODE} (a fresh "
                f"store per restart, as in docs/gpu.md), or through `python -m lingua.stool`.")
    return None


def keep_previous_status(dump_dir, rank: int) -> None:
    """Before the rendezvous: this rank's status file of the previous process (how it ended) moves aside, where the
    new generation's rank 0 reads it (`read_crash`); with none, an older one is removed (it would be read again)."""
    run_dir = RunDir(dump_dir)
    try:
        os.replace(run_dir.status(rank), run_dir.previous_status(rank))
    except FileNotFoundError:
        run_dir.previous_status(rank).unlink(missing_ok=True)


def read_crash(dump_dir, world_size: int, host: str) -> Optional[dict]:
    """The previous generation's crash from its ranks' status files, or None when it ended cleanly (or there was
    none): the step it was at, the rank that stopped first and how, and when the crash was seen first."""
    run_dir = RunDir(dump_dir)
    records = {rank: _read_json(run_dir.previous_status(rank)) for rank in range(world_size)}
    ended = [rec for rec in records.values() if rec]
    if not ended or all(rec["state"] == "done" for rec in ended):
        return None
    found = first_stopped(records, host)
    if found is None:  # every process of that generation is gone now: one that never wrote its end was killed
        running = sorted((rec.get("heartbeat") or rec["time"], rank) for rank, rec in records.items()
                         if rec and rec["state"] == "running")
        found = (running[0][1], "its process is gone") if running else None
    steps = [rec["step"] for rec in ended if rec.get("step") is not None]
    seen = [rec["time"] for rec in ended if rec["state"] != "running"] or [max(rec["time"] for rec in ended)]
    first = records.get(found[0]) if found else None
    return dict(step=max(steps) if steps else None, first_rank=found[0] if found else None,
                role=(first or {}).get("role"), how=found[1] if found else "unknown", time=min(seen),
                crash_loop=any(rec.get("error", "").startswith(CrashLoop.__name__) for rec in ended))


def _read_json(path: Path) -> Optional[dict]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def crash_loop_sentence(history: list[dict], crash: dict, dump_dir) -> Optional[str]:
    """The sentence that stops a run whose last CRASH_LOOP crashes were at one step, or None."""
    last = [row for row in history if not row.get("stop")][-(CRASH_LOOP - 1):] + [crash]
    if crash.get("step") is None or len(last) < CRASH_LOOP or any(row.get("step") != crash["step"] for row in last):
        return None
    rank, log = crash["first_rank"], RunDir(dump_dir).rank_log(crash["first_rank"])
    return (f"the run crashed at step {crash['step']} {CRASH_LOOP} times in a row, the last time first on rank {rank} "
            f"({crash['role']}, {crash['how']}), so it stops instead of restarting again: fix what {log} shows, then "
            f"relaunch (it resumes from its newest checkpoint).")


def agree_on_recovery(topo, dump_dir) -> Optional[dict]:
    """At startup, every rank: the previous generation's crash as rank 0 read it (one broadcast on the world), or
    None. A run crashing at one step again and again raises `CrashLoop` on every rank; the train master adds each
    crash to recovery.jsonl (`RecoveryLog`)."""
    crash = None
    if topo.global_rank == 0:
        crash = read_crash(dump_dir, topo.world_size, topo.hostname)
        history = read_jsonl(RunDir(dump_dir).recovery)
        if crash is not None and crash["crash_loop"]:
            # Torchrun restarting the ranks that stopped for a crash loop: stop again. A new launch starts afresh.
            crash = dict(crash, stop=history[-1].get("stop")) if topo.restarts.restarted and history else None
        elif crash is not None:  # recorded now: a generation that crashes again before its first step counts too
            crash["stop"] = crash_loop_sentence(history, crash, dump_dir)
            with open(RunDir(dump_dir).recovery, "a") as f:
                f.write(json.dumps(dict(crash, resumed_from=None, steps_redone=None, recovery_s=None)) + "\n")
    if topo.distributed:
        box = [crash]
        log_collective("broadcast_object_list recovery", dist.group.WORLD)
        dist.broadcast_object_list(box, src=0, group=dist.group.WORLD)  # every rank decides as rank 0 read
        crash = box[0]
    if crash is not None and crash.get("stop"):
        raise CrashLoop(crash["stop"])
    if crash is not None and topo.global_rank == 0:
        logger.warning(f"restarted after a crash at step {crash['step']}: rank {crash['first_rank']} "
                       f"({crash['role']}) stopped first ({crash['how']})")
    return crash


class RecoveryLog:
    """The train master's record of recoveries: this generation's row in recovery.jsonl once its first step is
    done (steps redone, seconds from the crash), and the fields every metrics row of a recovered run carries."""

    def __init__(self, dump_dir, crash: Optional[dict], active: bool):
        self.path = RunDir(dump_dir).recovery
        self.crash, self.active = crash, active
        self.resumed_from: Optional[int] = None
        self.fields: dict = {}

    def first_step_done(self, step: int) -> None:
        """After this generation's first step (`step`, resumed from step - 1): record the crash it recovered from."""
        if self.resumed_from is not None:
            return
        self.resumed_from = step - 1
        if not self.active:
            return
        history = read_jsonl(self.path)
        if self.crash is not None and history and history[-1].get("time") == self.crash["time"]:
            done_before = (self.crash["step"] or 1) - 1  # the crashed step itself was in progress
            row = history[-1] = dict(history[-1], resumed_from=self.resumed_from, recovered_at=time.time(),
                                     steps_redone=max(done_before - self.resumed_from, 0),
                                     recovery_s=round(time.time() - self.crash["time"], 3))
            tmp = self.path.with_name(self.path.name + ".tmp")
            tmp.write_text("".join(json.dumps(r) + "\n" for r in history))
            tmp.replace(self.path)
            logger.info(f"recovered: resumed from step {self.resumed_from}, {row['steps_redone']} step(s) redone, "
                        f"{row['recovery_s']:.1f}s from the crash to this step")
        crashes = [row for row in history if not row.get("stop")]
        if crashes:
            self.fields = {"recovery/restarts": len(crashes),
                           "recovery/steps_redone": sum(row["steps_redone"] or 0 for row in crashes),
                           "recovery/last_s": crashes[-1]["recovery_s"]}

    def summary_line(self) -> Optional[str]:
        """`recovered from N crash(es): ...` for the summary, or None."""
        crashes = [row for row in read_jsonl(self.path) if not row.get("stop")] if self.active else []
        if not crashes:
            return None
        each = "; ".join(f"step {row['step']}, rank {row['first_rank']} ({row['role']}) first, "
                         f"{row['steps_redone'] or 0} redone, {row['recovery_s'] or 0:.0f}s" for row in crashes)
        return f"recovered from {len(crashes)} crash(es) ({self.path.name}): {each}"
