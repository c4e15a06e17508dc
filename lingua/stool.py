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
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

from omegaconf import DictConfig, OmegaConf

from lingua.args import dataclass_from_dict, require, to_dict
from lingua.cli.entry import run_cli
from lingua.errors import ConfigError, MissingPathError
from lingua.cli.help import exit_with_help
from lingua.parallel.launch_plan import DistributedArgs, LaunchPlan, TeacherLayout, teacher_rank_count
from lingua.slurm import UNLIMITED, build_sbatch_script, submit_sbatch, submit_submitit

REPO_ROOT = Path(__file__).resolve().parents[1]


# Scripts whose config has `preemption_grace_s` (stool fills it from signal_grace_s).
GRACE_AWARE_SCRIPTS = ("apps.main.train",)


@dataclass
class StoolArgs:
    script: str = "apps.main.train"  # module run with `python -m` on every rank
    config: str = ""  # the training config (.yaml) the job runs; required
    launcher: str = "sbatch"  # how the job is submitted: "sbatch" (a script stool writes) | "submitit"
    nodes: int = 1  # nodes of the job (each runs ntasks_per_node ranks)
    ngpus: int = 8  # GPUs per node; 0 = CPU partition
    ntasks_per_node: Optional[int] = None  # ranks per node; default ngpus (required when ngpus=0)
    ncpu: int = 8  # CPUs per task (rank)
    mem: str = ""  # per node, e.g. "200G"; "" = the partition's default
    partition: str = ""  # "" = the cluster's default partition
    qos: str = ""  # SLURM quality of service (--qos); "" = the account's default
    account: str = ""  # SLURM account to charge (--account); "" = your default
    constraint: str = ""  # SLURM node features required (--constraint, e.g. "h100"); "" = any
    exclude: str = ""  # nodes not to run on (--exclude, e.g. "node[01-02]"); "" = none
    time: int = -1  # minutes; -1 = the partition's limit (from sinfo)
    job_name: str = ""  # "" = the config's name, else the dump dir's name
    sbatch_extra: list[str] = field(default_factory=list)  # extra sbatch options, e.g. "--mail-type=END"
    exports: dict[str, str] = field(default_factory=dict)  # environment variables for every rank
    signal_grace_s: int = 120  # USR2 this long before the kill: one step plus a checkpoint (the trainer checks)
    dump_dir: str = ""  # "" = the training config's dump_dir
    env_activate: str = ""  # shell line run first; "" = activate this interpreter's venv/conda env; "none"
    python: str = ""  # "" = this interpreter
    # Folders copied into the job's code snapshot (<dump_dir>/code), which the ranks run from and resolve relative
    # paths against
    code_dirs: list[str] = field(default_factory=lambda: ["apps", "lingua", "setup", "configs"])
    dry_run: bool = False  # write everything, print the script, submit nothing
    force: bool = False  # reuse an existing dump dir without asking
    torchrun_per_node: bool = False  # one srun task per node running torchrun, instead of one per rank
    # submitit only: requeues after hitting the time limit (submitit's default of 3 would end a long run;
    # the sbatch path requeues on every USR2). Preemptions by other jobs are never counted.
    max_timeout_requeues: int = 100
    # In-job restarts: a launch step that fails (a rank died) runs again, resuming from the newest checkpoint;
    # a step that ended with a sentence (exit 2: a config error, a crash loop) does not. 0: none.
    max_restarts: int = 3
    # A job that SLURM requeued after a failure (its node failed) starts at most this many more times; the
    # trainer's own requeues (preemption, time limit) are not counted.
    max_failure_requeues: int = 3
    overrides: list[str] = field(default_factory=list)  # training overrides, same as after `--`


# ---------------------------------------------------------------- arguments and training config

def parse_stool_args(argv: list[str]) -> StoolArgs:
    """`key=value` stool options, then optional `--` followed by training overrides."""
    if "--" in argv:
        cut = argv.index("--")
        argv, train_overrides = argv[:cut], argv[cut + 1:]
    else:
        train_overrides = []
    exit_with_help(StoolArgs, argv, "usage: python -m lingua.stool config=<training yaml> [key=value ...] [-- "
                   "training overrides]  (stool's keys; the training's: python -m apps.main.train --help)")
    args = dataclass_from_dict(StoolArgs, OmegaConf.from_cli(argv))
    args.overrides = list(args.overrides) + train_overrides
    return args


def resolve_args(args: StoolArgs) -> StoolArgs:
    """Fill the derived defaults and reject settings SLURM would choke on, before anything is written."""
    args = dataclasses.replace(args)
    if not args.config:
        raise ConfigError("No training config given; pass config=<path to the training .yaml>.")
    if args.launcher not in ("sbatch", "submitit"):
        raise ConfigError(f"launcher={args.launcher!r}; use 'sbatch' or 'submitit'.")
    if args.nodes < 1:
        raise ConfigError(f"nodes={args.nodes} must be >= 1.")
    if args.ngpus < 0:
        raise ConfigError(f"ngpus={args.ngpus} must be >= 0 (0 = CPU partition).")
    if args.ntasks_per_node is None:
        if args.ngpus == 0:
            raise ConfigError("ngpus=0 (CPU partition): set ntasks_per_node=<ranks per node> as well.")
        args.ntasks_per_node = args.ngpus
    if args.ntasks_per_node < 1:
        raise ConfigError(f"ntasks_per_node={args.ntasks_per_node} must be >= 1.")
    if args.ncpu < 1:
        raise ConfigError(f"ncpu={args.ncpu} (CPUs per task) must be >= 1.")
    if args.signal_grace_s < 1:
        raise ConfigError(f"signal_grace_s={args.signal_grace_s} must be >= 1 second.")
    if args.time != -1 and args.time < 1:
        raise ConfigError(f"time={args.time}; give minutes >= 1, or -1 for the partition's limit.")
    if args.max_restarts < 0 or args.max_failure_requeues < 0:
        raise ConfigError(f"max_restarts={args.max_restarts}, max_failure_requeues={args.max_failure_requeues}: "
                          f"use counts >= 0 (0: none).")
    if args.torchrun_per_node and args.launcher == "submitit":
        raise ConfigError("torchrun_per_node is only supported with launcher=sbatch.")
    if "lingua" not in args.code_dirs:
        raise ConfigError(f"code_dirs={list(args.code_dirs)} must include 'lingua': the job imports it from the "
                          f"snapshot.")
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
        raise MissingPathError(f"Training config '{path}' does not exist; pass config=<path to a .yaml>.")
    cfg = OmegaConf.merge(OmegaConf.load(path), OmegaConf.from_dotlist(list(args.overrides)))
    dump_dir = args.dump_dir or cfg.get("dump_dir")
    if not dump_dir:
        raise ConfigError(f"'{path}' sets no dump_dir; set dump_dir in the yaml or pass dump_dir=<folder> to stool.")
    dump_dir = Path(dump_dir).expanduser()
    dump_dir = dump_dir if dump_dir.is_absolute() else (cwd / dump_dir)
    if re.search(r"\s", str(dump_dir)):
        raise ConfigError(f"dump_dir '{dump_dir}' contains whitespace, which #SBATCH --output cannot take; "
                          f"choose a dump_dir without spaces.")
    container = _absolutize_paths(OmegaConf.to_container(cfg, resolve=True), cwd)
    container["dump_dir"] = str(dump_dir.resolve())
    check_paths_reach_the_job(container, cwd, list(args.code_dirs), dump_dir)
    return OmegaConf.create(container)


# The config's input paths (files and folders the job reads); outputs (checkpoint.path, ...) are created.
INPUT_PATHS = ("data.root_dir", "data.tokenizer.path", "distillation.teacher_path", "distillation.teacher_tokenizer",
               "distillation.cache_dir", "checkpoint.init_ckpt_path", "eval.dataset_dir", "eval.validation.root_dir")
TEACHER_INPUT_PATHS = ("path", "tokenizer", "cache_dir")  # of each distillation.teachers[i]
HUB_ID_KEYS = ("teacher_path", "teacher_tokenizer", "path", "tokenizer")  # a teacher's "org/name" may be a hub id


def check_paths_reach_the_job(config: dict, cwd: Path, code_dirs: list[str], dump_dir: Path) -> None:
    """Refuse, in one sentence and before anything is written or queued, an input path left relative (it exists
    neither from `cwd`, where _absolutize_paths would have made it absolute, nor inside the job's code snapshot,
    which the job runs from): it would fail only after the job waited in the queue. A hub id ("org/name") is not
    a path."""
    def select(node, dotted: str):
        for part in dotted.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        return node

    teachers = select(config, "distillation.teachers") or []
    keyed = [(key, select(config, key)) for key in INPUT_PATHS] + [
        (f"distillation.teachers[{i}].{key}", teacher.get(key)) for i, teacher in enumerate(teachers)
        if isinstance(teacher, dict) for key in TEACHER_INPUT_PATHS]
    for key, value in keyed:
        if not isinstance(value, str) or not value or os.path.isabs(value) or value.startswith("~"):
            continue
        hub_id = key.startswith("distillation.") and key.rsplit(".", 1)[-1] in HUB_ID_KEYS \
            and value.count("/") == 1 and not value.startswith(".")
        in_snapshot = Path(value).parts[0] in code_dirs and (REPO_ROOT / value).exists()
        if not (hub_id or in_snapshot):
            raise MissingPathError(
                f"{key}={value!r} is a relative path that exists neither from here ({cwd}) nor in the job's code "
                f"snapshot ({dump_dir / 'code'}), which the job runs from; pass it as an absolute path, or run stool "
                f"from the folder it is relative to.")


def _absolutize_paths(node, cwd: Path):
    if isinstance(node, dict):
        return {k: (v if k == "dump_dir" else _absolutize_paths(v, cwd)) for k, v in node.items()}
    if isinstance(node, list):
        return [_absolutize_paths(v, cwd) for v in node]
    looks_like_path = isinstance(node, str) and ("/" in node or node.startswith(".")) and not os.path.isabs(node)
    if looks_like_path and "://" not in node and (cwd / node).exists():
        return str((cwd / node).resolve())
    return node


def launch_plan(cfg: DictConfig, nodes: int, ntasks_per_node: int) -> tuple[LaunchPlan, Optional[str]]:
    """The trainer's own LaunchPlan for this allocation (so the printout cannot drift, and a plan that
    cannot work is refused before anything is written), and the teacher_placement to write into the
    config (None = leave it). With one teacher (replica of distillation.teacher_tp ranks) per node
    (n_teacher_ranks == nodes x teacher_tp, nodes > 1) each is the last rank(s) of its node, so a bridge never
    leaves its node; otherwise teachers are the last ranks."""
    teachers = config_teachers(cfg)
    distributed = OmegaConf.merge(OmegaConf.structured(DistributedArgs), cfg.get("distributed") or {})
    write = None
    if OmegaConf.select(cfg, "distributed.teacher_placement", default=None) is None and nodes > 1 \
            and len(teachers) == 1 and teachers[0].ranks == nodes * teachers[0].tp:
        distributed.teacher_placement = write = "per_node"
    plan = LaunchPlan.for_launch(OmegaConf.to_object(distributed), nodes * ntasks_per_node, ntasks_per_node, teachers)
    return plan, write


def config_teachers(cfg: DictConfig) -> tuple[TeacherLayout, ...]:
    """The launch's teachers as the trainer lays them out (`launch_teachers`), read from the raw config (no torch
    here): the one-teacher keys' teacher, or each listed one with ranks of its own; a teacher read from its cache has
    none, and training from caches alone (source=cache, or every listed teacher names its cache_dir) runs none."""
    select = OmegaConf.select
    if not cfg.get("enable_distillation", False) or select(cfg, "distillation.source", default="online") != "online":
        return ()
    shared_tp = int(select(cfg, "distillation.teacher_tp", default=1))
    require(shared_tp >= 1, "distillation.teacher_tp", shared_tp,
            "use 1 (one rank per teacher) or the number of ranks to shard each teacher over")
    listed = select(cfg, "distillation.teachers", default=None) or []
    if not listed:
        ranks = teacher_rank_count(True, int(select(cfg, "distillation.n_teacher_ranks", default=1)))
        return (TeacherLayout(ranks, shared_tp, str(select(cfg, "distillation.teacher_path", default=None) or "")),)
    layouts = []
    for i, teacher in enumerate(listed):
        if select(teacher, "cache_dir", default=None):
            continue
        ranks, tp = int(select(teacher, "n_teacher_ranks", default=1)), select(teacher, "teacher_tp", default=None)
        tp = shared_tp if tp is None else int(tp)
        require(ranks >= 1, f"distillation.teachers[{i}].n_teacher_ranks", ranks, "use a positive number of ranks")
        require(tp >= 1, f"distillation.teachers[{i}].teacher_tp", tp,
                "use 1 (one rank per replica) or the number of ranks to shard this teacher over")
        layouts.append(TeacherLayout(ranks, tp, str(select(teacher, "path", default=None) or "")))
    return tuple(layouts)


# ---------------------------------------------------------------- partition time limit

def parse_slurm_time(text: str) -> Optional[int]:
    """SLURM time ("infinite", "30", "30:00", "2:00:00", "1-12:00:00") -> minutes; None = no limit."""
    text = text.strip().lower()
    if text in ("infinite", "unlimited"):
        return None
    match = re.fullmatch(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?", text)
    if not match:
        raise ConfigError(f"Cannot parse the SLURM time limit '{text}'; pass time=<minutes> to stool.")
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
        raise ConfigError(f"The cluster has no default partition (sinfo lists: {names}); pass partition=<name>.")
    raise ConfigError(f"Partition '{partition}' does not exist (sinfo lists: {names}); pass partition=<name>.")


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
        raise ConfigError(f"Dump dir {dump_dir} already exists and there is no terminal to confirm; pass force=true "
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
        raise MissingPathError(f"code_dirs {missing} do not exist under {root}; fix code_dirs=[...].")
    if dest.exists():
        shutil.rmtree(dest)
    files = list_code_files(root, code_dirs)
    for rel in files:
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(root / rel, target)
    return len(files)


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
    plan, placement = launch_plan(cfg, args.nodes, args.ntasks_per_node)
    if placement is not None:
        OmegaConf.update(cfg, "distributed.teacher_placement", placement, force_add=True)
    if args.script in GRACE_AWARE_SCRIPTS:  # the trainer warns if a step plus a save outlast the grace
        OmegaConf.update(cfg, "preemption_grace_s", args.signal_grace_s, force_add=True)
    job_name = args.job_name or str(cfg.get("name") or dump_dir.name)
    time_limit = resolve_time(args, time_query)
    confirm_reuse(dump_dir, args.force, input_fn, interactive)

    write_dump_dir(args, cfg, dump_dir)
    print("stool: " + "\nstool: ".join(plan.describe()))
    # Written under submitit too: `sbatch submit.slurm` is the by-hand relaunch for both launchers.
    script_path = dump_dir / "submit.slurm"
    script_path.write_text(build_sbatch_script(args, dump_dir, plan, time_limit, job_name))
    if args.launcher == "submitit":
        if args.dry_run:
            print(f"stool: dry run; would submit {args.script} through submitit into {dump_dir / 'submitit'}")
            return None
        job_id = submit_submitit(args, dump_dir, cfg, plan, time_limit, job_name)
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
    run_cli(main)
