"""A stand-in for apps.main.train with the same SLURM contract, to prove stool's requeue plumbing alone.

    python -m tests.slurm.fake_trainer config=<dump_dir>/config.yaml     (one process per rank, under srun)

Reads `dump_dir`, `steps`, `step_s` and optionally `resumed_step_s` (default `step_s`) from the yaml; resumes
from the newest <dump_dir>/checkpoints/<step:010d>/; "trains" by sleeping `step_s` per step (`resumed_step_s`
once SLURM has restarted the job: a test that signals only the first run lets the requeued one run through
without pausing), rank 0 appending
{"step", "time", "restart"} to metrics.jsonl. On USR2 every rank stops at the end of its step:
rank 0 writes the checkpoint of that step and, unless submitit is in charge, runs
`scontrol requeue $SLURM_JOB_ID`; every rank exits 0. At the end rank 0 writes the final checkpoint.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from omegaconf import OmegaConf

from lingua.parallel.preemption import sigterm_ignored


def latest_step(ckpt_root: Path) -> int:
    steps = [int(p.name) for p in ckpt_root.glob("[0-9]" * 10) if (p / "state.json").exists()]
    return max(steps, default=0)


def save(ckpt_root: Path, step: int) -> None:
    folder = ckpt_root / f"{step:010d}"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "state.json").write_text(json.dumps({"step": step}))


def main() -> None:
    cfg = OmegaConf.load(dict(a.split("=", 1) for a in sys.argv[1:])["config"])
    # torchrun sets RANK; one srun task per rank gives SLURM_PROCID.
    rank = int(os.environ.get("RANK", os.environ["SLURM_PROCID"]))
    restart = int(os.environ.get("SLURM_RESTART_COUNT", 0))
    dump_dir = Path(cfg.dump_dir)
    ckpt_root = dump_dir / "checkpoints"
    preempted = []
    signal.signal(signal.SIGUSR2, lambda signum, frame: preempted.append(signum))

    step_s = cfg.step_s if restart == 0 else cfg.get("resumed_step_s", cfg.step_s)
    step = latest_step(ckpt_root)
    print(f"rank {rank} start restart={restart} resumed_from={step} master={os.environ.get('MASTER_ADDR')}:"
          f"{os.environ.get('MASTER_PORT')} cwd={os.getcwd()}", flush=True)
    while step < cfg.steps:
        time.sleep(step_s)
        step += 1
        if rank == 0:
            with open(dump_dir / "metrics.jsonl", "a") as f:
                f.write(json.dumps({"step": step, "time": time.time(), "restart": restart}) + "\n")
        if preempted:
            print(f"rank {rank} got USR2, stopping at step {step}", flush=True)
            if rank == 0:
                save(ckpt_root, step)
                if os.environ.get("SLURM_JOB_ID") and not os.environ.get("SUBMITIT_EXECUTOR"):
                    with sigterm_ignored():  # as the trainer: the requeue's SIGTERM must not kill scontrol first
                        subprocess.run(["scontrol", "requeue", os.environ["SLURM_JOB_ID"]], check=True)
                    print("rank 0 requeued the job", flush=True)
            return
    if rank == 0:
        save(ckpt_root, step)
    print(f"rank {rank} finished at step {step}", flush=True)


if __name__ == "__main__":
    main()
