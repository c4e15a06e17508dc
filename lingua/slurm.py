"""What stool hands to SLURM: the sbatch script (`submit.slurm`) and the submitit executor.

Both launch the same ranks the same way: one srun task per rank (or one torchrun per node), the
rendezvous exported from the first node, USR2 `signal_grace_s` before the time limit, requeue on.
A job recovers by itself: a failed launch step runs again (`max_restarts`, in the job: a fresh rendezvous each
time, resuming from the newest checkpoint), and a job SLURM requeued after a failure (a node failed) starts at most
`max_failure_requeues` more times; the trainer's own requeues after a preemption save leave a marker
(`lingua/parallel/preemption.py`) and are not counted.
Every `args` here is the job's `StoolArgs` (lingua/stool.py); stool imports this module, never the reverse.
"""

import shlex
import signal
import subprocess
from pathlib import Path
from typing import Optional

from omegaconf import DictConfig

from lingua.errors import ConfigError, RunFailed
from lingua.parallel.launch_plan import LaunchPlan

UNLIMITED = "UNLIMITED"
SUBMITIT_UNLIMITED_MIN = 365 * 24 * 60  # submitit needs a number even when the partition has no limit


def sbatch_options(args, dump_dir: Path, time_limit: Optional[str], job_name: str) -> list[str]:
    """The `#SBATCH` options, in order; unset optional ones are left out."""
    logs = dump_dir / "logs"
    lines = [f"--job-name={job_name}", f"--nodes={args.nodes}", f"--ntasks-per-node={args.ntasks_per_node}"]
    if args.ngpus > 0:
        lines.append(f"--gres=gpu:{args.ngpus}")
    lines.append(f"--cpus-per-task={args.ncpu}")
    for name in ("mem", "partition", "qos", "account", "constraint"):
        if getattr(args, name):
            lines.append(f"--{name}={getattr(args, name)}")
    if time_limit is not None:
        lines.append(f"--time={time_limit}")
    if args.exclude:
        lines.append(f"--exclude={args.exclude}")
    lines += [f"--output={logs}/%j.stdout", f"--error={logs}/%j.stderr", f"--signal=USR2@{args.signal_grace_s}",
              "--open-mode=append", "--requeue"]
    lines += [extra.removeprefix("#SBATCH").strip() for extra in args.sbatch_extra]
    return lines


def env_lines(args, code_dir: Path) -> list[str]:
    """Activation, rendezvous and user exports, identical under sbatch and submitit."""
    lines = [args.env_activate] if args.env_activate else []
    lines += [
        'export MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"',
        "# Port from the job id, below the ephemeral range (32768+), reused by a requeue; exports= can override it.",
        "export MASTER_PORT=$((10000 + SLURM_JOB_ID % 20000))",
        f"export OMP_NUM_THREADS={args.ncpu}",
        f'export PYTHONPATH={shlex.quote(str(code_dir))}"${{PYTHONPATH:+:$PYTHONPATH}}"',
    ]
    lines += [f"export {key}={shlex.quote(str(value))}" for key, value in args.exports.items()]
    return lines


def launch_command(args, dump_dir: Path) -> str:
    """srun with one task per rank, or one torchrun per node."""
    config = shlex.quote(str(dump_dir / "config.yaml"))
    python = shlex.quote(args.python)
    common = ["srun", "--kill-on-bad-exit=1", "--distribution=block", "--open-mode=append"]
    if not args.torchrun_per_node:
        return " ".join(common + [
            f"--output={dump_dir}/logs/%j/%j_%t.log", f"--ntasks={args.nodes * args.ntasks_per_node}",
            f"--ntasks-per-node={args.ntasks_per_node}", f"--cpus-per-task={args.ncpu}",
            python, "-u", "-m", args.script, f"config={config}"])
    # torchrun ignores USR2 (it would die of it); slurmstepd signals every process of the step, so the
    # ranks still get it. Static rendezvous keeps rank = node_rank * ntasks_per_node + local_rank.
    torchrun = (f"trap '' USR2; exec {python} -u -m torch.distributed.run --nnodes={args.nodes} "
                f"--nproc-per-node={args.ntasks_per_node} --node-rank=$SLURM_NODEID --master-addr=$MASTER_ADDR "
                f"--master-port=$MASTER_PORT --max-restarts=0 -m {args.script} config={config}")
    return " ".join(common + [
        f"--output={dump_dir}/logs/%j/%j_node%n.log", f"--ntasks={args.nodes}", "--ntasks-per-node=1",
        f"--cpus-per-task={args.ncpu * args.ntasks_per_node}", "bash", "-c", shlex.quote(torchrun)])


def recovery_lines(args, dump_dir: Path) -> list[str]:
    """The cap on failure requeues, before the launch: a requeue without the trainer's marker was SLURM's own."""
    logs, cap = shlex.quote(str(dump_dir / "logs")), args.max_failure_requeues
    return [
        'if [ "${SLURM_RESTART_COUNT:-0}" -gt 0 ] && '
        f'[ ! -e {logs}/requeued_by_preemption.$SLURM_JOB_ID.$((SLURM_RESTART_COUNT - 1)) ]; then',
        f'  echo "$SLURM_RESTART_COUNT" >> {logs}/failure_requeues.$SLURM_JOB_ID',
        "fi",
        f'if [ "$(cat {logs}/failure_requeues.$SLURM_JOB_ID 2>/dev/null | wc -l)" -gt {cap} ]; then',
        f'  echo "stool: job $SLURM_JOB_ID was requeued after a failure more than {cap} times (max_failure_requeues='
        f'{cap}); it stops here: see {logs}" >&2',
        "  exit 1",
        "fi",
    ]


def restart_loop(args, launch: str) -> list[str]:
    """The launch step, run again while it fails (a rank died), at most max_restarts times; exit 2 (one sentence:
    a config error, a crash loop) ends the job at once."""
    return [
        "attempt=0",
        "while true; do",
        launch,  # its own line: `srun ...`
        "rc=$?",
        'if [ "$rc" -eq 0 ] || [ "$rc" -eq 2 ] || [ "$attempt" -ge ' f'{args.max_restarts} ]; then exit "$rc"; fi',
        "attempt=$((attempt + 1))",
        f'echo "stool: the launch step failed (exit $rc); in-job restart $attempt of {args.max_restarts} at $(date -Is)"',
        "done",
    ]


def build_sbatch_script(args, dump_dir: Path, plan: LaunchPlan, time_limit: Optional[str],
                        job_name: str) -> str:
    """The full submit.slurm text (args already passed through `resolve_args`)."""
    code_dir = dump_dir / "code"
    header = ["#!/bin/bash",
              f"# Written by lingua.stool for {args.script} with {dump_dir}/config.yaml.",
              f"# Relaunch by hand (resumes from the latest checkpoint): sbatch {dump_dir}/submit.slurm"]
    header += [f"# {line}" for line in plan.describe()]
    if args.torchrun_per_node:
        header.append("# launch: one torchrun per node (ranks read RANK/LOCAL_RANK/WORLD_SIZE)")
    else:
        header.append("# launch: one srun task per rank (ranks read SLURM_PROCID/SLURM_LOCALID/SLURM_NTASKS)")
    body = [f"#SBATCH {option}" for option in sbatch_options(args, dump_dir, time_limit, job_name)]
    body += [""] + env_lines(args, code_dir)
    body += [
        f"mkdir -p {shlex.quote(str(dump_dir / 'logs'))}/$SLURM_JOB_ID",
        f"cd {shlex.quote(str(code_dir))}",
        'echo "stool: job $SLURM_JOB_ID restart ${SLURM_RESTART_COUNT:-0} on '
        '$(scontrol show hostnames "$SLURM_JOB_NODELIST" | paste -sd " "), master $MASTER_ADDR:$MASTER_PORT, '
        '$(date -Is)"',
        *recovery_lines(args, dump_dir),
        *restart_loop(args, launch_command(args, dump_dir)),
    ]
    return "\n".join(header + body) + "\n"


# ---------------------------------------------------------------- submission

def submit_sbatch(script_path: Path) -> str:
    """sbatch the script; returns the job id."""
    result = subprocess.run(["sbatch", "--parsable", str(script_path)], capture_output=True, text=True, timeout=120)
    if result.returncode != 0:
        raise RunFailed(f"sbatch {script_path} failed: {result.stderr.strip() or result.stdout.strip()}")
    return result.stdout.strip().split(";")[0]


class SubmititTrainJob:
    """What submitit runs on every task: the training command as a child process, from the snapshot.

    Why a child and not in-process: submitit's USR2 handler requeues the job on rank 0 at once, which
    would kill the ranks before the trainer's collective save. This process replaces that handler with
    one that only notes the signal; SLURM signals every process of the step, so the trainer (the child)
    gets USR2 too, saves at its agreed point, stops the teacher and exits 0 (it does not call
    `scontrol requeue` when SUBMITIT_EXECUTOR is set). Then rank 0 hands over to submitit's own
    preemption path: `checkpoint()` returns this same job, submitit pickles it, runs `scontrol requeue`
    and exits; the requeued job starts the trainer again, which resumes from the checkpoint.
    """

    def __init__(self, script: str, python: str, dump_dir: str, steps: Optional[int], max_restarts: int = 0):
        self.script, self.python, self.dump_dir, self.steps = script, python, dump_dir, steps
        self.max_restarts = max_restarts  # in-job restarts, as the sbatch script's loop (exit 2 is never rerun)

    def command(self) -> list[str]:
        return [self.python, "-u", "-m", self.script, f"config={Path(self.dump_dir) / 'config.yaml'}"]

    def __call__(self) -> int:
        preempted = []
        submitit_handler = signal.signal(signal.SIGUSR2, lambda signum, frame: preempted.append(signum))
        returncode = subprocess.run(self.command(), cwd=Path(self.dump_dir) / "code").returncode
        for _ in range(self.max_restarts):  # every task's trainer failed with the rank that died: all run again
            if returncode in (0, 2) or preempted:
                break
            returncode = subprocess.run(self.command(), cwd=Path(self.dump_dir) / "code").returncode
        signal.signal(signal.SIGUSR2, submitit_handler)
        if returncode != 0:
            raise RunFailed(f"{' '.join(self.command())} exited with code {returncode}; "
                            f"see the task logs in {self.dump_dir}/submitit/.")
        if preempted and not self.finished() and callable(submitit_handler):
            # Rank 0: checkpoint() + `scontrol requeue` + exit. The requeue sends this step SIGTERM at once; ignored
            # from here on (scontrol inherits it), it can no longer kill scontrol before it exits 0, which made
            # submitit raise after the requeue (no "Requeued job" line, an error result for a requeued job).
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            submitit_handler(signal.SIGUSR2, None)
        return returncode

    def finished(self) -> bool:
        """Whether the latest checkpoint is the final step (then a late USR2 needs no requeue)."""
        steps = sorted(int(p.name) for p in (Path(self.dump_dir) / "checkpoints").glob("[0-9]" * 10))
        return self.steps is not None and bool(steps) and steps[-1] >= self.steps

    def checkpoint(self, *args, **kwargs):
        """submitit's preemption hook: the trainer already saved, so requeue this same job."""
        from submitit.helpers import DelayedSubmission

        return DelayedSubmission(self, *args, **kwargs)


def submitit_executor(args, dump_dir: Path, plan: LaunchPlan, time_limit: Optional[str],
                      job_name: str):
    """A submitit SlurmExecutor with the same resources, environment and dump dir as submit.slurm."""
    import submitit

    if time_limit is None:
        raise ConfigError("submitit needs a time limit and sinfo could not provide one; pass time=<minutes>.")
    additional = {"requeue": True, "chdir": str(dump_dir / "code")}
    if time_limit == UNLIMITED:
        additional["time"] = UNLIMITED
    if args.mem:
        additional["mem"] = args.mem
    for extra in args.sbatch_extra:
        key, _, value = extra.removeprefix("#SBATCH").strip().removeprefix("--").partition("=")
        additional[key] = value if value else True
    executor = submitit.AutoExecutor(folder=str(dump_dir / "submitit"), cluster="slurm",
                                     slurm_python=shlex.quote(args.python),
                                     slurm_max_num_timeout=args.max_timeout_requeues)
    params = dict(
        name=job_name, nodes=args.nodes, tasks_per_node=args.ntasks_per_node, cpus_per_task=args.ncpu,
        timeout_min=SUBMITIT_UNLIMITED_MIN if time_limit == UNLIMITED else int(time_limit),
        slurm_signal_delay_s=args.signal_grace_s, slurm_srun_args=["--kill-on-bad-exit=1", "--distribution=block"],
        slurm_setup=[f"# {line}" for line in plan.describe()] + env_lines(args, dump_dir / "code"),
        slurm_additional_parameters=additional,
    )
    for name in ("partition", "qos", "account", "constraint", "exclude"):
        if getattr(args, name):
            params[f"slurm_{name}"] = getattr(args, name)
    if args.ngpus > 0:
        params["slurm_gres"] = f"gpu:{args.ngpus}"
    executor.update_parameters(**params)
    return executor


def submit_submitit(args, dump_dir: Path, cfg: DictConfig, plan: LaunchPlan,
                    time_limit: Optional[str], job_name: str) -> str:
    """Submit `SubmititTrainJob` through submitit; returns the job id."""
    executor = submitit_executor(args, dump_dir, plan, time_limit, job_name)
    steps = cfg.get("steps")
    job = executor.submit(SubmititTrainJob(args.script, args.python, str(dump_dir), int(steps) if steps else None,
                                           args.max_restarts))
    return str(job.job_id)
