"""Submit a training or distillation run to SLURM: dump dir, code snapshot, config, sbatch script.

    python -m lingua.stool config=configs/distill_exps/debug.yaml nodes=2 ngpus=8 partition=gpu \
        -- steps=2000 optim.lr=1e-3

Stool options are `key=value` before `--`; training overrides (`a.b=c`, as for apps.main.train)
follow `--`, or go in `overrides=[a.b=c,steps=10]`. Stool reads the training yaml with OmegaConf only
(dump_dir, enable_distillation, distillation.n_teacher_ranks); the trainer validates the rest.

What lands in <dump_dir>: code/ (apps/ lingua/ setup/ configs/ as submitted; requeued jobs run it),
config.yaml (the yaml plus overrides, which the job reads), stool.yaml, submit.slurm, logs/.
`sbatch <dump_dir>/submit.slurm` relaunches by hand; the trainer resumes from the latest checkpoint.

Preemption: `#SBATCH --signal=USR2@<grace>` reaches every rank; the trainer saves at its agreed
stop point, stops the teacher, runs `scontrol requeue` and exits 0. Under `launcher=submitit` the
trainer runs as a child of submitit's task process, which hands the requeue to submitit (see
`SubmititTrainJob`).
"""

import dataclasses
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

from omegaconf import DictConfig, OmegaConf

from lingua.args import dataclass_from_dict, to_dict

REPO_ROOT = Path(__file__).resolve().parents[1]
UNLIMITED = "UNLIMITED"
SUBMITIT_UNLIMITED_MIN = 365 * 24 * 60  # submitit needs a number even when the partition has no limit


# Scripts whose config has `preemption_grace_s` (stool fills it from signal_grace_s).
GRACE_AWARE_SCRIPTS = ("apps.main.train",)


@dataclass
class StoolArgs:
    script: str = "apps.main.train"  # module run with `python -m` on every rank
    config: str = ""  # the training yaml
    launcher: str = "sbatch"  # "sbatch" | "submitit"
    nodes: int = 1
    ngpus: int = 8  # GPUs per node; 0 = CPU partition
    ntasks_per_node: Optional[int] = None  # ranks per node; default ngpus (required when ngpus=0)
    ncpu: int = 8  # CPUs per task (rank)
    mem: str = ""  # per node, e.g. "200G"; "" = the partition's default
    partition: str = ""  # "" = the cluster's default partition
    qos: str = ""
    account: str = ""
    constraint: str = ""
    exclude: str = ""
    time: int = -1  # minutes; -1 = the partition's limit (from sinfo)
    job_name: str = ""  # "" = the config's name, else the dump dir's name
    sbatch_extra: list[str] = field(default_factory=list)  # extra sbatch options, e.g. "--mail-type=END"
    exports: dict[str, str] = field(default_factory=dict)  # environment variables for every rank
    signal_grace_s: int = 120  # USR2 this long before the kill: one step plus a checkpoint (the trainer checks)
    dump_dir: str = ""  # "" = the training config's dump_dir
    env_activate: str = ""  # shell line run first; "" = activate this interpreter's venv/conda env; "none"
    python: str = ""  # "" = this interpreter
    code_dirs: list[str] = field(default_factory=lambda: ["apps", "lingua", "setup", "configs"])
    dry_run: bool = False  # write everything, print the script, submit nothing
    force: bool = False  # reuse an existing dump dir without asking
    torchrun_per_node: bool = False  # one srun task per node running torchrun, instead of one per rank
    # submitit only: requeues after hitting the time limit (submitit's default of 3 would end a long run;
    # the sbatch path requeues on every USR2). Preemptions by other jobs are never counted.
    max_timeout_requeues: int = 100
    overrides: list[str] = field(default_factory=list)  # training overrides, same as after `--`


@dataclass
class TeacherLayout:
    world_size: int
    ntasks_per_node: int
    placement: str  # "last" | "per_node" | "" (no distillation)
    student_ranks: list[int]
    teacher_ranks: list[int]

    def describe(self) -> list[str]:
        """Human-readable lines: which global ranks (node, local rank) are teachers."""
        nodes = self.world_size // self.ntasks_per_node
        lines = [f"ranks: {nodes} node(s) x {self.ntasks_per_node} task(s) = {self.world_size} ranks "
                 f"(block distribution: node i holds ranks {self.ntasks_per_node}*i..)"]
        if not self.teacher_ranks:
            lines.append("distillation off: every rank is a student")
            return lines
        lines.append(f"distillation: {len(self.teacher_ranks)} teacher rank(s), placement {self.placement}")
        for rank in self.teacher_ranks:
            lines.append(f"  teacher: global rank {rank} (node {rank // self.ntasks_per_node}, "
                         f"local rank {rank % self.ntasks_per_node})")
        lines.append(f"  students: global ranks {format_ranks(self.student_ranks)}")
        return lines


def format_ranks(ranks: list[int]) -> str:
    """[0, 1, 2, 4, 5] -> "0-2,4-5"."""
    spans, start = [], None
    for i, rank in enumerate(ranks):
        if start is None:
            start = rank
        if i + 1 == len(ranks) or ranks[i + 1] != rank + 1:
            spans.append(str(start) if start == rank else f"{start}-{rank}")
            start = None
    return ",".join(spans)


# ---------------------------------------------------------------- arguments and training config

def parse_stool_args(argv: list[str]) -> StoolArgs:
    """`key=value` stool options, then optional `--` followed by training overrides."""
    if "--" in argv:
        cut = argv.index("--")
        argv, train_overrides = argv[:cut], argv[cut + 1:]
    else:
        train_overrides = []
    args = dataclass_from_dict(StoolArgs, OmegaConf.from_cli(argv))
    args.overrides = list(args.overrides) + train_overrides
    return args


def resolve_args(args: StoolArgs) -> StoolArgs:
    """Fill the derived defaults and reject settings SLURM would choke on, before anything is written."""
    args = dataclasses.replace(args)
    if not args.config:
        raise ValueError("No training config given; pass config=<path to the training .yaml>.")
    if args.launcher not in ("sbatch", "submitit"):
        raise ValueError(f"launcher={args.launcher!r}; use 'sbatch' or 'submitit'.")
    if args.nodes < 1:
        raise ValueError(f"nodes={args.nodes} must be >= 1.")
    if args.ngpus < 0:
        raise ValueError(f"ngpus={args.ngpus} must be >= 0 (0 = CPU partition).")
    if args.ntasks_per_node is None:
        if args.ngpus == 0:
            raise ValueError("ngpus=0 (CPU partition): set ntasks_per_node=<ranks per node> as well.")
        args.ntasks_per_node = args.ngpus
    if args.ntasks_per_node < 1:
        raise ValueError(f"ntasks_per_node={args.ntasks_per_node} must be >= 1.")
    if args.ncpu < 1:
        raise ValueError(f"ncpu={args.ncpu} (CPUs per task) must be >= 1.")
    if args.signal_grace_s < 1:
        raise ValueError(f"signal_grace_s={args.signal_grace_s} must be >= 1 second.")
    if args.time != -1 and args.time < 1:
        raise ValueError(f"time={args.time}; give minutes >= 1, or -1 for the partition's limit.")
    if args.torchrun_per_node and args.launcher == "submitit":
        raise ValueError("torchrun_per_node is only supported with launcher=sbatch.")
    if "lingua" not in args.code_dirs:
        raise ValueError(f"code_dirs={list(args.code_dirs)} must include 'lingua': the job imports it from the snapshot.")
    if not args.python:
        args.python = sys.executable
    if not args.env_activate:
        args.env_activate = default_env_activation()
    elif args.env_activate == "none":
        args.env_activate = ""
    return args


def default_env_activation() -> str:
    """The line that activates the environment stool runs in (venv, else conda), or ""."""
    if sys.prefix != sys.base_prefix and (Path(sys.prefix) / "bin" / "activate").is_file():
        return f"source {shlex.quote(str(Path(sys.prefix) / 'bin' / 'activate'))}"
    conda_prefix, conda_exe = os.environ.get("CONDA_PREFIX"), os.environ.get("CONDA_EXE")
    if conda_prefix and conda_exe:
        return f'eval "$({shlex.quote(conda_exe)} shell.bash hook)" && conda activate {shlex.quote(conda_prefix)}'
    return ""


def load_train_config(args: StoolArgs, cwd: Optional[Path] = None) -> DictConfig:
    """The training yaml plus overrides, with dump_dir and existing relative paths made absolute.

    The job runs from <dump_dir>/code, so a relative path that exists from the submission directory
    (data, teacher weights) is rewritten to its absolute form; the trainer validates everything else.
    """
    cwd = Path(cwd or os.getcwd())
    path = Path(args.config)
    if not path.is_file():
        raise FileNotFoundError(f"Training config '{path}' does not exist; pass config=<path to a .yaml>.")
    cfg = OmegaConf.merge(OmegaConf.load(path), OmegaConf.from_dotlist(list(args.overrides)))
    dump_dir = args.dump_dir or cfg.get("dump_dir")
    if not dump_dir:
        raise ValueError(f"'{path}' sets no dump_dir; set dump_dir in the yaml or pass dump_dir=<folder> to stool.")
    dump_dir = Path(dump_dir).expanduser()
    dump_dir = dump_dir if dump_dir.is_absolute() else (cwd / dump_dir)
    if re.search(r"\s", str(dump_dir)):
        raise ValueError(f"dump_dir '{dump_dir}' contains whitespace, which #SBATCH --output cannot take; "
                         f"choose a dump_dir without spaces.")
    container = _absolutize_paths(OmegaConf.to_container(cfg, resolve=True), cwd)
    container["dump_dir"] = str(dump_dir.resolve())
    return OmegaConf.create(container)


def _absolutize_paths(node, cwd: Path):
    if isinstance(node, dict):
        return {k: (v if k == "dump_dir" else _absolutize_paths(v, cwd)) for k, v in node.items()}
    if isinstance(node, list):
        return [_absolutize_paths(v, cwd) for v in node]
    looks_like_path = isinstance(node, str) and ("/" in node or node.startswith(".")) and not os.path.isabs(node)
    if looks_like_path and "://" not in node and (cwd / node).exists():
        return str((cwd / node).resolve())
    return node


def teacher_layout(cfg: DictConfig, nodes: int, ntasks_per_node: int) -> tuple[TeacherLayout, Optional[str]]:
    """Where the teachers go, and the teacher_placement to write into the config (None = leave it).

    With one teacher per node (n_teacher_ranks == nodes > 1) each teacher is the last rank of its node,
    so a bridge never leaves its node; otherwise teachers are the last global ranks.
    """
    from lingua.distributed import split_roles  # the trainer's own rule, so the printout cannot drift

    world = nodes * ntasks_per_node
    n_teachers = int(OmegaConf.select(cfg, "distillation.n_teacher_ranks", default=1)) \
        if bool(cfg.get("enable_distillation", False)) else 0
    configured = OmegaConf.select(cfg, "distributed.teacher_placement", default=None)
    write = None
    if configured is not None:
        placement = configured
    elif n_teachers and n_teachers == nodes and nodes > 1:
        placement = write = "per_node"
    else:
        placement = "last"
    students, teachers = split_roles(world, n_teachers, placement, ntasks_per_node)
    return TeacherLayout(world, ntasks_per_node, placement if n_teachers else "", students, teachers), write


# ---------------------------------------------------------------- partition time limit

def parse_slurm_time(text: str) -> Optional[int]:
    """SLURM time ("infinite", "30", "30:00", "2:00:00", "1-12:00:00") -> minutes; None = no limit."""
    text = text.strip().lower()
    if text in ("infinite", "unlimited"):
        return None
    match = re.fullmatch(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?", text)
    if not match:
        raise ValueError(f"Cannot parse the SLURM time limit '{text}'; pass time=<minutes> to stool.")
    days, a, b, c = match.groups()
    if days is not None:  # days-hours[:minutes[:seconds]]
        minutes = int(days) * 1440 + int(a) * 60 + int(b or 0) + (1 if c and int(c) else 0)
    elif c is not None:  # hours:minutes:seconds
        minutes = int(a) * 60 + int(b) + (1 if int(c) else 0)
    elif b is not None:  # minutes:seconds
        minutes = int(a) + (1 if int(b) else 0)
    else:
        minutes = int(a)
    return minutes


def partition_time_limit(partition: str, run: Callable = subprocess.run) -> Optional[int]:
    """The partition's (or the default partition's) time limit in minutes via sinfo; None = infinite."""
    result = run(["sinfo", "-h", "-o", "%P %l"], capture_output=True, text=True, timeout=60)
    if result.returncode != 0:
        raise RuntimeError(f"sinfo failed: {result.stderr.strip()}")
    rows = [line.split() for line in result.stdout.splitlines() if len(line.split()) == 2]
    for name, limit in rows:
        is_default = name.endswith("*")
        if (partition and name.rstrip("*") == partition) or (not partition and is_default):
            return parse_slurm_time(limit)
    names = ", ".join(name for name, _ in rows) or "none"
    if not partition:
        raise ValueError(f"The cluster has no default partition (sinfo lists: {names}); pass partition=<name>.")
    raise ValueError(f"Partition '{partition}' does not exist (sinfo lists: {names}); pass partition=<name>.")


def resolve_time(args: StoolArgs, query: Callable[[str], Optional[int]] = partition_time_limit) -> Optional[str]:
    """The --time value: minutes, "UNLIMITED", or None (sinfo unavailable: the partition default applies)."""
    if args.time != -1:
        return str(args.time)
    try:
        limit = query(args.partition)
    except (FileNotFoundError, RuntimeError) as err:
        print(f"stool: could not query the partition time limit ({err}); writing no --time line.")
        return None
    return UNLIMITED if limit is None else str(limit)


# ---------------------------------------------------------------- dump dir and code snapshot

def confirm_reuse(dump_dir: Path, force: bool, input_fn: Callable[[str], str] = input,
                  interactive: Optional[bool] = None) -> None:
    """Ask before reusing a non-empty dump dir (code/, config.yaml, submit.slurm are replaced)."""
    if force or not dump_dir.exists() or not any(dump_dir.iterdir()):
        return
    interactive = sys.stdin.isatty() if interactive is None else interactive
    if not interactive:
        raise ValueError(f"Dump dir {dump_dir} already exists and there is no terminal to confirm; pass force=true "
                         f"to reuse it (checkpoints are kept, so the job resumes) or choose another dump_dir.")
    answer = input_fn(f"Dump dir {dump_dir} exists. Replace its code/, config.yaml and submit.slurm? Checkpoints, "
                      f"metrics and logs are kept, so the job resumes from the latest checkpoint. [y/N] ")
    if answer.strip().lower() not in ("y", "yes"):
        raise SystemExit("stool: aborted; nothing was written or submitted.")


def list_code_files(root: Path, code_dirs: list[str]) -> list[str]:
    """Files to snapshot: git-tracked plus untracked-but-not-ignored ones inside a git checkout, else all."""
    result = subprocess.run(["git", "-C", str(root), "ls-files", "-z", "--cached", "--others", "--exclude-standard",
                             "--", *code_dirs], capture_output=True, text=True)
    if result.returncode == 0:
        files = sorted({f for f in result.stdout.split("\0") if f})
        return [f for f in files if (root / f).is_file()]
    files = []
    for directory in code_dirs:
        for path in sorted((root / directory).rglob("*")):
            if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc":
                files.append(str(path.relative_to(root)))
    return files


def snapshot_code(root: Path, code_dirs: list[str], dest: Path) -> int:
    """Copy the code into dest (replacing it), so a requeued job runs what was submitted."""
    missing = [d for d in code_dirs if not (root / d).is_dir()]
    if missing:
        raise FileNotFoundError(f"code_dirs {missing} do not exist under {root}; fix code_dirs=[...].")
    if dest.exists():
        shutil.rmtree(dest)
    files = list_code_files(root, code_dirs)
    for rel in files:
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(root / rel, target)
    return len(files)


# ---------------------------------------------------------------- the sbatch script

def sbatch_options(args: StoolArgs, dump_dir: Path, time_limit: Optional[str], job_name: str) -> list[str]:
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


def env_lines(args: StoolArgs, code_dir: Path) -> list[str]:
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


def launch_command(args: StoolArgs, dump_dir: Path) -> str:
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


def build_sbatch_script(args: StoolArgs, dump_dir: Path, layout: TeacherLayout, time_limit: Optional[str],
                        job_name: str) -> str:
    """The full submit.slurm text (args already passed through `resolve_args`)."""
    code_dir = dump_dir / "code"
    header = ["#!/bin/bash",
              f"# Written by lingua.stool for {args.script} with {dump_dir}/config.yaml.",
              f"# Relaunch by hand (resumes from the latest checkpoint): sbatch {dump_dir}/submit.slurm"]
    header += [f"# {line}" for line in layout.describe()]
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
        launch_command(args, dump_dir),
    ]
    return "\n".join(header + body) + "\n"


# ---------------------------------------------------------------- submission

def submit_sbatch(script_path: Path) -> str:
    """sbatch the script; returns the job id."""
    result = subprocess.run(["sbatch", "--parsable", str(script_path)], capture_output=True, text=True, timeout=120)
    if result.returncode != 0:
        raise RuntimeError(f"sbatch {script_path} failed: {result.stderr.strip() or result.stdout.strip()}")
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

    def __init__(self, script: str, python: str, dump_dir: str, steps: Optional[int]):
        self.script, self.python, self.dump_dir, self.steps = script, python, dump_dir, steps

    def command(self) -> list[str]:
        return [self.python, "-u", "-m", self.script, f"config={Path(self.dump_dir) / 'config.yaml'}"]

    def __call__(self) -> int:
        preempted = []
        submitit_handler = signal.signal(signal.SIGUSR2, lambda signum, frame: preempted.append(signum))
        returncode = subprocess.run(self.command(), cwd=Path(self.dump_dir) / "code").returncode
        signal.signal(signal.SIGUSR2, submitit_handler)
        if returncode != 0:
            raise RuntimeError(f"{' '.join(self.command())} exited with code {returncode}; "
                               f"see the task logs in {self.dump_dir}/submitit/.")
        if preempted and not self.finished() and callable(submitit_handler):
            submitit_handler(signal.SIGUSR2, None)  # rank 0: checkpoint() + scontrol requeue + exit
        return returncode

    def finished(self) -> bool:
        """Whether the latest checkpoint is the final step (then a late USR2 needs no requeue)."""
        steps = sorted(int(p.name) for p in (Path(self.dump_dir) / "checkpoints").glob("[0-9]" * 10))
        return self.steps is not None and bool(steps) and steps[-1] >= self.steps

    def checkpoint(self, *args, **kwargs):
        """submitit's preemption hook: the trainer already saved, so requeue this same job."""
        from submitit.helpers import DelayedSubmission

        return DelayedSubmission(self, *args, **kwargs)


def submitit_executor(args: StoolArgs, dump_dir: Path, layout: TeacherLayout, time_limit: Optional[str],
                      job_name: str):
    """A submitit SlurmExecutor with the same resources, environment and dump dir as submit.slurm."""
    import submitit

    if time_limit is None:
        raise ValueError("submitit needs a time limit and sinfo could not provide one; pass time=<minutes>.")
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
        slurm_setup=[f"# {line}" for line in layout.describe()] + env_lines(args, dump_dir / "code"),
        slurm_additional_parameters=additional,
    )
    for name in ("partition", "qos", "account", "constraint", "exclude"):
        if getattr(args, name):
            params[f"slurm_{name}"] = getattr(args, name)
    if args.ngpus > 0:
        params["slurm_gres"] = f"gpu:{args.ngpus}"
    executor.update_parameters(**params)
    return executor


def submit_submitit(args: StoolArgs, dump_dir: Path, cfg: DictConfig, layout: TeacherLayout,
                    time_limit: Optional[str], job_name: str) -> str:
    """Submit `SubmititTrainJob` through submitit; returns the job id."""
    executor = submitit_executor(args, dump_dir, layout, time_limit, job_name)
    steps = cfg.get("steps")
    job = executor.submit(SubmititTrainJob(args.script, args.python, str(dump_dir), int(steps) if steps else None))
    return str(job.job_id)


def write_dump_dir(args: StoolArgs, cfg: DictConfig, dump_dir: Path) -> None:
    """code/ snapshot, config.yaml (what the job reads) and stool.yaml (how it was launched)."""
    dump_dir.mkdir(parents=True, exist_ok=True)
    (dump_dir / "logs").mkdir(exist_ok=True)
    n_files = snapshot_code(REPO_ROOT, list(args.code_dirs), dump_dir / "code")
    print(f"stool: copied {n_files} files of {', '.join(args.code_dirs)} to {dump_dir / 'code'}")
    (dump_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg))
    (dump_dir / "stool.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create(to_dict(args))))


def launch(args: StoolArgs, input_fn: Callable[[str], str] = input, interactive: Optional[bool] = None,
           time_query: Callable[[str], Optional[int]] = partition_time_limit) -> Optional[str]:
    """Prepare the dump dir and submit (or, with dry_run, only write and print). Returns the job id."""
    args = resolve_args(args)
    cfg = load_train_config(args)
    dump_dir = Path(cfg.dump_dir)
    layout, placement = teacher_layout(cfg, args.nodes, args.ntasks_per_node)
    if placement is not None:
        OmegaConf.update(cfg, "distributed.teacher_placement", placement, force_add=True)
    if args.script in GRACE_AWARE_SCRIPTS:  # the trainer warns if a step plus a save outlast the grace
        OmegaConf.update(cfg, "preemption_grace_s", args.signal_grace_s, force_add=True)
    job_name = args.job_name or str(cfg.get("name") or dump_dir.name)
    time_limit = resolve_time(args, time_query)
    confirm_reuse(dump_dir, args.force, input_fn, interactive)

    write_dump_dir(args, cfg, dump_dir)
    print("stool: " + "\nstool: ".join(layout.describe()))
    # Written under submitit too: `sbatch submit.slurm` is the by-hand relaunch for both launchers.
    script_path = dump_dir / "submit.slurm"
    script_path.write_text(build_sbatch_script(args, dump_dir, layout, time_limit, job_name))
    if args.launcher == "submitit":
        if args.dry_run:
            print(f"stool: dry run; would submit {args.script} through submitit into {dump_dir / 'submitit'}")
            return None
        job_id = submit_submitit(args, dump_dir, cfg, layout, time_limit, job_name)
        print(f"stool: submitted job {job_id} through submitit; logs in {dump_dir / 'submitit'}/, "
              f"relaunch by hand with: sbatch {script_path}")
        return job_id

    if args.dry_run:
        print(f"stool: dry run; wrote {script_path} (not submitted):\n{script_path.read_text()}")
        return None
    job_id = submit_sbatch(script_path)
    print(f"stool: submitted job {job_id}; per-rank logs in {dump_dir}/logs/{job_id}/, "
          f"relaunch with: sbatch {script_path}")
    return job_id


def main(argv: Optional[list[str]] = None) -> None:
    launch(parse_stool_args(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    main()
