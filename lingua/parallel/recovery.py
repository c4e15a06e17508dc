"""In-job restarts: a crashed generation of ranks is replaced by the launcher's next one, which resumes.

Under `torchrun --max-restarts N` a rank that dies takes its generation down and torchrun starts the next one.
Three things make that work and show it:

  - Each generation's rendezvous is its own. torchrun's workers rendezvous on the launcher's own TCP store
    (TORCHELASTIC_USE_AGENT_STORE), which outlives them, so a restarted rank would read the earlier attempt's
    keys -- gloo's peer addresses, NCCL's unique id -- and fail or wait out its timeout (PyTorch #135712).
    `attempt_store` puts this attempt's keys under a prefix of its restart count, which every rank of one torchrun
    agent shares. Several agents count their restarts apart (one restarted by a membership change counts none),
    so a launch of several nodes uses the c10d rendezvous with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 instead (a
    fresh store per round, hosted by rank 0; lingua.stool launches so), and says at startup when it does not.
  - The previous generation's crash is read from its status files (`CrashRecord`), before this generation's
    ranks replace them; rank 0 adds it to `<dump_dir>/recovery.jsonl` (lingua/parallel/crash_log.py).
  - The same step crashing `CRASH_LOOP` times in a row stops the run with one sentence instead of looping.
"""

from dataclasses import dataclass
from datetime import timedelta
from typing import Optional

import torch.distributed as dist

SAFE_MULTI_NODE = "--rdzv-backend c10d with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"


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
                f"restarts differently (PyTorch #135712); launch several nodes with {SAFE_MULTI_NODE}, as "
                f"`python -m lingua.stool` does.")
    return None
