"""Process groups and the Topology object.

Everything distributed starts in `setup_torch_distributed`, which checks the `LaunchPlan` (roles,
bridges, mesh; `lingua/parallel/launch_plan.py`) before any collective, creates the process groups and returns a
`Topology`. Every other component receives it; nothing reads the rank or world size from the
environment after that point. Groups, created by every rank in the same order because `new_group`
is collective:
  - train_group     the students; the FSDP mesh lives on it, and so do checkpoints, metrics, probes.
  - bridge_<i>      teacher replica i's first rank plus the contiguous block of students it serves
                    (student<->teacher traffic); with several teachers a student is in one per teacher.
  - teachers        the teacher ranks (teacher-side coordination).
  - teacher_tp_<i>  the ranks of teacher replica i, for a replica of more than one rank only (its teacher's
                    teacher_tp > 1): the tensor-parallel forward and its requests shared by the replica's first rank.

When a rank dies, the others only see a collective fail with a peer's address: `RankStatus`
(lingua/parallel/rank_status.py) turns that into the rank that stopped first and its log, in one sentence.

The loop's collectives are in `lingua/parallel/collectives.py`, the timeouts and the hang watch in
`lingua/parallel/timeouts.py`, FSDP/compile/activation checkpointing in `lingua/parallel/parallelize.py`.
"""

import dataclasses
import faulthandler
import logging
import os
import signal
import socket
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from lingua.errors import ConfigError, LaunchError
from lingua.parallel import flight_recorder
from lingua.parallel.collectives import comm_logger, log_collective
# DistributedArgs is the `distributed:` config section; it lives with LaunchPlan, torch-free, for stool.
from lingua.parallel.launch_plan import (DistributedArgs, LaunchEnv, LaunchPlan, TeacherLayout, expected_cuda_index,
                                         read_launch_env)
from lingua.parallel.private_api import check_private_apis, private_api
from lingua.parallel.recovery import Restarts, attempt_store, keep_previous_status, unsafe_restart_sentence
from lingua.parallel.timeouts import forget_detail_check_groups, keep_detail_check_groups

logger = logging.getLogger(__name__)


@dataclass
class Topology:
    """Who is who. Built once by `setup_torch_distributed`, passed to every component."""

    plan: LaunchPlan
    global_rank: int
    local_rank: int
    hostname: str
    device: torch.device
    backend: str
    train_group: Optional[dist.ProcessGroup] = None
    teacher_group: Optional[dist.ProcessGroup] = None
    bridge_group: Optional[dist.ProcessGroup] = None  # a student's with several teachers: the viewed teacher's
    bridge_groups: tuple = ()  # a student's bridge to each teacher, in teacher order (a teacher rank's own one)
    teacher_view: int = 0  # which of several teachers `my_bridge`, `my_teacher` and `bridge_group` speak of
    teacher_tp_group: Optional[dist.ProcessGroup] = None  # my teacher replica's ranks (teacher_tp > 1 only)
    mesh: Optional[DeviceMesh] = None
    group_names: dict = field(default_factory=dict)  # id(group) -> descriptive name, for logs
    setup_spans: dict = field(default_factory=dict)  # startup phase -> (start, end) wall-clock, from setup
    restarts: Restarts = field(default_factory=Restarts)  # the launcher's in-job restarts (torchrun), read once
    recovered: Optional[dict] = None  # the previous generation's crash, as every rank agreed at startup (recovery.py)

    @property
    def role(self) -> str:
        return self.plan.role(self.global_rank)

    @property
    def world_size(self) -> int:
        return self.plan.world_size

    @property
    def local_world_size(self) -> int:
        return self.plan.local_world_size

    @property
    def student_ranks(self) -> list[int]:
        return self.plan.student_ranks

    @property
    def teacher_ranks(self) -> list[int]:
        return self.plan.teacher_ranks

    @property
    def is_student(self) -> bool:
        return self.role == "student"

    @property
    def is_teacher(self) -> bool:
        return self.role == "teacher"

    @property
    def train_rank(self) -> int:
        """Index among students = rank in the train group = data-parallel rank (-1 on teachers)."""
        return self.student_ranks.index(self.global_rank) if self.is_student else -1

    @property
    def train_world_size(self) -> int:
        """Number of students = data-parallel degree (0 on teachers)."""
        return len(self.student_ranks) if self.is_student else 0

    @property
    def is_train_master(self) -> bool:
        return self.train_rank == 0

    @property
    def my_bridge(self) -> int:
        """Index of my bridge (= index of its teacher replica; a student's to the viewed teacher), -1 without
        distillation."""
        return self.plan.bridge_index(self.global_rank, self.teacher_view)

    def for_teacher(self, teacher: int) -> "Topology":
        """This topology as teacher `teacher` of several sees it: a student's bridge to it (the same groups)."""
        return dataclasses.replace(self, teacher_view=teacher, bridge_group=self.bridge_groups[teacher])

    @property
    def my_teacher(self) -> int:
        """Global rank of the teacher rank on my bridge (my replica's first rank, on a teacher); -1 without
        distillation."""
        return self.plan.bridges()[self.my_bridge][0] if self.my_bridge >= 0 else -1

    @property
    def teacher_tp(self) -> int:
        """Ranks per replica of the first teacher (every teacher's, with one; 1 = each rank a whole teacher)."""
        return self.plan.teacher_tp

    @property
    def replica_ranks(self) -> list[int]:
        """The global ranks of my teacher replica, its first rank (the one on the bridge) first; [] on a student."""
        return self.plan.replicas()[self.my_bridge][0] if self.is_teacher else []

    @property
    def is_replica_leader(self) -> bool:
        """Whether this teacher rank talks to the students for its replica (always, with teacher_tp=1)."""
        return self.is_teacher and self.replica_ranks[0] == self.global_rank

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def all_groups(self) -> list:
        """Every group this rank belongs to, world first."""
        groups = [dist.group.WORLD, self.train_group, self.teacher_group, self.bridge_group, *self.bridge_groups,
                  self.teacher_tp_group]
        if self.mesh is not None:
            groups += [self.mesh.get_group(i) for i in range(self.mesh.ndim)]
        seen, unique = set(), []
        for g in groups:
            if g is not None and id(g) not in seen:
                seen.add(id(g))
                unique.append(g)
        return unique

    def group_name(self, group) -> str:
        return self.group_names.get(id(group), "?")

    def group_members(self) -> dict[str, list[int]]:
        """Name -> global ranks of every group this rank belongs to (who a timed-out collective waited for)."""
        return {self.group_name(group): dist.get_process_group_ranks(group) for group in self.all_groups()}


def read_restarts(launch: LaunchEnv) -> Restarts:
    """The launcher's restart facts, read from its environment here only (torchrun sets them; 0 elsewhere)."""
    env = os.environ
    if launch.launcher != "torchrun" or "TORCHELASTIC_RESTART_COUNT" not in env:
        return Restarts()
    return Restarts(count=int(env["TORCHELASTIC_RESTART_COUNT"]), max=int(env.get("TORCHELASTIC_MAX_RESTARTS", 0)),
                    agent_store=env.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
                    agents=int(env.get("GROUP_WORLD_SIZE", 1)))


def init_method_for(launch: LaunchEnv) -> str:
    """The rendezvous address: the launcher's MASTER_ADDR/PORT, or a private port for one process."""
    if launch.launcher == "single":
        # One process: a private TCP store, no environment variables needed or written.
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            return f"tcp://127.0.0.1:{sock.getsockname()[1]}"
    if launch.master_addr is None or launch.master_port is None:
        raise LaunchError("MASTER_ADDR and MASTER_PORT must be set when launching several ranks.")
    return f"tcp://{launch.master_addr}:{launch.master_port}"


def choose_device(args: DistributedArgs, local_rank: int, local_world_size: int = 1) -> tuple[torch.device, str]:
    backend = args.backend
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        if not torch.cuda.is_available():
            raise LaunchError("distributed.backend=nccl needs CUDA; use backend=gloo (or auto) on CPU.")
        index = expected_cuda_index(local_rank, local_world_size, torch.cuda.device_count())
        return torch.device("cuda", index), backend
    if backend != "gloo":
        raise ConfigError(f"distributed.backend={args.backend!r}; use auto, nccl or gloo.")
    return torch.device("cpu"), backend


def enable_debug_env(dump_dir: Optional[str], mode: str = "true") -> None:
    """The debug switch (`distributed.debug`): torch reads these at process-group creation, so set them before it.
    A value the user exported already is kept.

    trace   the flight recorder: a bigger buffer, NCCL's watchdog dumping it on a timeout to
            <dump_dir>/comm_traces/rank_<r> (where our own dumps go on every backend, see
            lingua/parallel/flight_recorder.py), and a named pipe per rank that dumps a live NCCL hang on demand
            (`echo > <dump_dir>/logs/fr_dump_pipe_<r>.pipe`). No DETAIL: its monitored barrier before every
            collective would catch a missing peer first, so no NCCL work is queued and nothing is recorded.
    detail  TORCH_DISTRIBUTED_DEBUG=DETAIL: a collective that differs between ranks becomes an error naming both.
    true    both. Every mode logs each collective of ours (`lingua.comm`) and C++ stacks with torch errors.
    TORCH_NCCL_ASYNC_ERROR_HANDLING stays at torch's default (3: tear the process down without aborting the
    communicators, since an abort can itself hang); the watchdog writes its dump before that in every mode.
    """
    run = Path(dump_dir or ".")
    settings = {"TORCH_SHOW_CPP_STACKTRACES": "1"}
    if mode in ("trace", "true"):
        (run / "logs").mkdir(parents=True, exist_ok=True)
        dumps = flight_recorder.trace_dir(run)
        dumps.mkdir(parents=True, exist_ok=True)
        pipe = str(run / "logs" / "fr_dump_pipe_")  # torch appends "<rank>.pipe"; not in comm_traces (not a dump)
        settings.update({
            "TORCH_FR_BUFFER_SIZE": "20000",  # torch's default keeps 2,000 collectives
            "TORCH_FR_DUMP_TEMP_FILE": str(dumps / flight_recorder.TRACE_PREFIX),
            "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
            "TORCH_NCCL_DEBUG_INFO_PIPE_FILE": pipe,
            "TORCH_FR_DEBUG_INFO_PIPE_FILE": pipe,  # the same pipe under the name newer torch reads
        })
    if mode in ("detail", "true"):
        settings["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
    for key, value in settings.items():
        os.environ.setdefault(key, value)
    dist.set_debug_level_from_env()
    comm_logger.setLevel(logging.DEBUG)


def setup_torch_distributed(args: DistributedArgs, teachers: tuple[TeacherLayout, ...] = (),
                            dump_dir: Optional[str] = None) -> Topology:
    """Initialise torch.distributed and build the Topology of a launch with these teachers (one `TeacherLayout` per
    teacher with ranks of its own: its ranks, replica size and path). Config errors raise before any collective."""
    launch = read_launch_env()
    plan = LaunchPlan.for_launch(args, launch.world_size, launch.local_world_size, teachers)
    device, backend = choose_device(args, launch.local_rank, launch.local_world_size)
    check_private_apis()  # a torch that renamed one: its sentence now, not an AttributeError mid-run
    if backend == "nccl":
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = args.matmul_allow_tf32
        torch.backends.cudnn.allow_tf32 = args.matmul_allow_tf32
    if args.debug_mode != "false":
        enable_debug_env(dump_dir, args.debug_mode)
    if dist.get_debug_level() == dist.DebugLevel.DETAIL:  # ours or the user's own TORCH_DISTRIBUTED_DEBUG
        keep_detail_check_groups()
    faulthandler.enable()
    # `kill -USR1 <pid>` prints every stack (faulthandler, from C), then reaches the rank's watch thread through the
    # Python handler's wakeup fd (lingua/parallel/watch.py): the handler itself does nothing.
    signal.signal(signal.SIGUSR1, lambda signum, frame: None)
    faulthandler.register(signal.SIGUSR1, all_threads=True, chain=True)
    if dump_dir:  # before the rendezvous: once it is through, every status file is this launch's (the last one's aside)
        keep_previous_status(dump_dir, launch.rank)

    restarts = read_restarts(launch)
    if launch.rank == 0 and (unsafe := unsafe_restart_sentence(restarts)):
        logger.warning(unsafe)
    timeout = timedelta(seconds=args.init_timeout_s)
    init_start = time.time()
    # Under torchrun's shared store, a store of this attempt's own keys (PyTorch #135712); else the usual address.
    store = attempt_store(launch, restarts, timeout)
    rendezvous = dict(store=store) if store is not None else dict(init_method=init_method_for(launch))
    init_kwargs = dict(backend=backend, rank=launch.rank, world_size=launch.world_size, timeout=timeout, **rendezvous)
    if backend == "nccl":
        init_kwargs["device_id"] = device  # eager NCCL init: no lazy "devices unknown" barrier later
    dist.init_process_group(**init_kwargs)
    spans = {"process_group_init": (init_start, time.time())}

    rank = launch.rank
    group_names: dict[int, str] = {id(dist.group.WORLD): "world"}

    def make_group(ranks: list[int], name: str) -> Optional[dist.ProcessGroup]:
        # Collective over the world: every rank calls this, in the same order, for every group.
        group = dist.new_group(ranks, timeout=timeout, group_desc=name)
        if rank in ranks:
            group_names[id(group)] = name
            return group
        return None

    groups_start = time.time()
    train_group = make_group(plan.student_ranks, "train")
    teacher_group = make_group(plan.teacher_ranks, "teachers") if plan.teacher_ranks else None
    teacher_tp_group, bridge_groups = None, []
    for i, (teacher, block) in enumerate(plan.bridges()):
        group = make_group(sorted(block + [teacher]), f"bridge_{i}")
        if rank == teacher or rank in block:  # in teacher order: a student's bridge to each teacher
            bridge_groups.append(group)
    bridge_group = bridge_groups[0] if bridge_groups else None
    for i, (replica, _) in enumerate(plan.replicas()):
        if len(replica) > 1:  # a replica of one rank (teacher_tp=1) needs no group: the launch is as it always was
            group = make_group(replica, f"teacher_tp_{i}")
            if rank in replica:
                teacher_tp_group = group
    mesh = _build_mesh(plan, device.type, rank, make_group, train_group)
    spans["mesh"] = (groups_start, time.time())  # every group and the students' mesh

    return Topology(plan=plan, global_rank=rank, local_rank=launch.local_rank, hostname=socket.gethostname(),
                    device=device, backend=backend, train_group=train_group, teacher_group=teacher_group,
                    bridge_group=bridge_group, bridge_groups=tuple(bridge_groups), teacher_tp_group=teacher_tp_group,
                    mesh=mesh, group_names=group_names, setup_spans=spans, restarts=restarts)


def _build_mesh(plan: LaunchPlan, device_type: str, rank: int, make_group, train_group) -> Optional[DeviceMesh]:
    """The students' FSDP mesh from explicit groups, so teachers never join a mesh collective."""
    grid = torch.tensor(plan.mesh_grid(), dtype=torch.int)
    replicate = grid.shape[0]
    if replicate == 1:
        # One shard group = all students = the train group: no extra communicator needed.
        if rank not in plan.student_ranks:
            return None
        return DeviceMesh.from_group(train_group, device_type, mesh=grid.view(-1), mesh_dim_names=("dp_shard",))
    my_groups = {}
    for dim, lines in (("dp_replicate", grid.t()), ("dp_shard", grid)):
        for line in lines.tolist():
            group = make_group(line, f"train_{dim}")
            if rank in line:
                my_groups[dim] = group
    if rank not in plan.student_ranks:
        return None
    return DeviceMesh.from_group(
        [my_groups["dp_replicate"], my_groups["dp_shard"]], device_type, mesh=grid,
        mesh_dim_names=("dp_replicate", "dp_shard"),
    )


def log_rank_device_map(topo: Topology) -> None:
    """Each rank logs its own line; rank 0 prints the whole table once. Then every rank checks the
    whole table (so all raise the same sentence): a rank not on its expected GPU, or two ranks of
    one host on the same physical GPU (NCCL would then guess and mismatch a collective), is an error."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "<unset>")
    row = dict(rank=topo.global_rank, local_rank=topo.local_rank, role=topo.role, host=topo.hostname,
               cuda_visible=visible, device=str(topo.device), bridge=topo.my_bridge, gpu_uuid="", problem="")
    if topo.device.type == "cuda":
        current = torch.cuda.current_device()
        props = torch.cuda.get_device_properties(current)
        row["device"] = f"cuda:{current} ({props.name})"
        row["gpu_uuid"] = str(getattr(props, "uuid", "") or getattr(props, "pci_bus_id", "") or f"index{current}")
        try:
            expected = expected_cuda_index(topo.local_rank, topo.local_world_size, torch.cuda.device_count())
            if current != expected:
                row["problem"] = f"bound to cuda:{current}, expected cuda:{expected}"
        except LaunchError as err:
            row["problem"] = str(err)
    logger.info("rank map: " + " ".join(f"{k}={v}" for k, v in row.items() if k not in ("gpu_uuid", "problem")))
    rows = [row]
    if topo.distributed:
        rows = [None] * topo.world_size
        log_collective("all_gather_object rank map", dist.group.WORLD)
        dist.all_gather_object(rows, row, group=dist.group.WORLD)  # at init every rank is here
    if topo.global_rank == 0 and topo.distributed:
        header = f"{'rank':>4} {'local':>5} {'role':<7} {'host':<20} {'bridge':>6} {'CUDA_VISIBLE_DEVICES':<20} device"
        lines = [header] + [
            f"{r['rank']:>4} {r['local_rank']:>5} {r['role']:<7} {r['host'][:20]:<20} {r['bridge']:>6} "
            f"{r['cuda_visible'][:20]:<20} {r['device']}" for r in rows
        ]
        logger.info("rank -> host -> device map:\n" + "\n".join(lines))
    problems = device_map_problems(rows)
    if problems:
        raise LaunchError("GPU binding is wrong: " + "; ".join(problems) + ". Check CUDA_VISIBLE_DEVICES and the "
                          "launcher's GPU binding (torchrun: one process per GPU; srun: --gpus-per-task or none).")


def device_map_problems(rows: list[dict]) -> list[str]:
    """Readable problems in a gathered rank map: per-rank binding errors, then GPUs shared by two ranks."""
    problems = [f"rank {r['rank']} (local rank {r['local_rank']} on {r['host']}) {r['problem']}" for r in rows
                if r.get("problem")]
    owners: dict[tuple[str, str], list[int]] = {}
    for r in rows:
        if r.get("gpu_uuid"):
            owners.setdefault((r["host"], r["gpu_uuid"]), []).append(r["rank"])
    problems += [f"ranks {ranks} on {host} share one GPU ({uuid})" for (host, uuid), ranks in owners.items()
                 if len(ranks) > 1]
    return problems


def clean_up(error: Optional[BaseException] = None) -> None:
    """Leave torch.distributed on every exit path (normal, error, preemption), and say so: the line in each
    rank's log proves that rank got out.

    A normal exit (`error` None) destroys the process groups ("process group destroyed"). An exceptional one
    aborts them ("process groups aborted"): work may still be posted (a student failing on its own leaves its
    look-ahead requests; a rank that lost a peer, the collective it lost it in), and NCCL's destroy waits for
    pending work, until the watchdog fires, where abort cancels it. gloo drops such work either way, so on CPU
    the two differ only in the line. A torch or backend without abort destroys instead."""
    if dist.is_initialized():
        if error is None or not _abort_process_groups():
            try:
                dist.destroy_process_group()
                logger.info("process group destroyed")
            except Exception as err:  # on the way out: report, never mask the exception that brought us here
                logger.warning(f"destroying the process group failed: {type(err).__name__}: {err}")
    forget_detail_check_groups()


def _abort_process_groups() -> bool:
    """Abort every process group of this rank, the world's included; False when this torch cannot."""
    abort = private_api("abort")  # NCCL and gloo; checked at startup (lingua/parallel/private_api.py)
    if abort is None:
        return False
    try:
        abort()
    except Exception as err:  # a backend that does not implement abort: destroy instead
        logger.warning(f"aborting the process groups failed ({type(err).__name__}: {err}); destroying them")
        return False
    logger.info("process groups aborted")
    return True
