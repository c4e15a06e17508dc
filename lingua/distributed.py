"""Process groups, the Topology object, FSDP2 parallelisation and the few collectives the loop needs.

Everything distributed starts in `setup_torch_distributed`, which returns a `Topology`. Every other
component receives it; nothing reads the rank or world size from the environment after that point.

Ranks are split into students (the first `W - n_teachers`) and teachers (the last `n_teachers`, or
the last rank of each node with `teacher_placement=per_node`). Groups, created by every rank in the
same order because `new_group` is collective:
  - train_group     the students; the FSDP mesh lives on it, and so do checkpoints, metrics, probes.
  - bridge_<i>      teacher i plus the contiguous block of students it serves (student<->teacher traffic).
  - teachers        the teacher ranks (teacher-side coordination).
"""

import faulthandler
import logging
import os
import signal
import socket
import sys
import time
from dataclasses import dataclass, field
from datetime import timedelta
from functools import partial
from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

logger = logging.getLogger(__name__)
comm_logger = logging.getLogger("lingua.comm")  # per-collective lines; DEBUG level only with distributed.debug
_comm_sequence: dict[str, int] = {}
_detail_check_groups: dict[str, list] = {}  # group name -> DETAIL's gloo check group(s), see keep_detail_check_groups


@dataclass
class DistributedArgs:
    # Mesh over the training (student) ranks; -1 = infer from the training world size.
    dp_replicate: int = 1
    dp_shard: int = -1
    fsdp_type: str = "full_shard"  # "full_shard" | "no_shard"
    model_dtype: str = "bf16"  # parameter dtype under FSDP mixed precision: "bf16" | "fp32"
    compile: bool = False
    activation_checkpointing: str = "none"  # "none" | "full" | "selective"
    backend: str = "auto"  # "auto" (nccl on GPU, gloo on CPU) | "nccl" | "gloo"
    teacher_placement: str = "last"  # "last" global ranks | "per_node" (last local rank of each node)
    # Two-phase timeouts: generous while loading/compiling, short once the first step went through.
    init_timeout_s: float = 600.0
    train_timeout_s: float = 300.0
    debug: bool = False  # DETAIL checks, flight recorder dumps, per-collective logs, stack dumps
    matmul_allow_tf32: bool = True


@dataclass
class Topology:
    """Who is who. Built once by `setup_torch_distributed`, passed to every component."""

    role: str  # "student" | "teacher"
    global_rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    hostname: str
    device: torch.device
    backend: str
    student_ranks: list[int]
    teacher_ranks: list[int]
    train_rank: int = -1  # index among students (-1 on teachers)
    train_world_size: int = 0
    dp_rank: int = -1
    dp_degree: int = 0
    train_group: Optional[dist.ProcessGroup] = None
    teacher_group: Optional[dist.ProcessGroup] = None
    bridge_group: Optional[dist.ProcessGroup] = None
    my_bridge: int = -1  # index of my bridge (= index of its teacher)
    my_teacher: int = -1  # global rank of the teacher serving me (or me, on a teacher)
    bridge_students: list[int] = field(default_factory=list)  # global ranks of my bridge's students
    mesh: Optional[DeviceMesh] = None
    group_names: dict = field(default_factory=dict)  # id(group) -> descriptive name, for logs
    setup_spans: dict = field(default_factory=dict)  # startup phase -> (start, end) wall-clock, from setup

    @property
    def is_student(self) -> bool:
        return self.role == "student"

    @property
    def is_teacher(self) -> bool:
        return self.role == "teacher"

    @property
    def is_train_master(self) -> bool:
        return self.train_rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


@dataclass(frozen=True)
class LaunchEnv:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: Optional[str]
    master_port: Optional[int]
    launcher: str  # "torchrun" | "slurm" | "single"


def read_launch_env() -> LaunchEnv:
    """The one place that reads rank facts from the environment (torchrun, then srun).

    Several SLURM tasks that cannot meet (no MASTER_ADDR, or a batch shell that is not an srun task)
    are a readable error: falling back to one process would run N lone rank 0s in one dump_dir.
    """
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:
        return LaunchEnv(
            int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", 0)),
            int(env.get("LOCAL_WORLD_SIZE", env["WORLD_SIZE"])), env.get("MASTER_ADDR"),
            int(env["MASTER_PORT"]) if "MASTER_PORT" in env else None, "torchrun",
        )
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        # In an srun step the step's own counts apply; the batch shell has SLURM_NTASKS but is one process.
        ntasks = int(env.get("SLURM_STEP_NUM_TASKS", env["SLURM_NTASKS"]))
        if ntasks > 1:
            if "SLURM_STEP_ID" not in env and "SLURM_STEPID" not in env:
                raise ValueError(
                    f"This SLURM job has {ntasks} tasks but this process was not started by srun, so it would "
                    f"wait for ranks that never come; start one process per rank with srun (MASTER_ADDR and "
                    f"MASTER_PORT exported), use torchrun, or submit with `python -m lingua.stool`."
                )
            if "MASTER_ADDR" not in env:
                raise ValueError(
                    f"srun started {ntasks} tasks but MASTER_ADDR is not set, so they cannot find each other; "
                    f"export MASTER_ADDR (the first node's hostname) and MASTER_PORT before srun, or submit "
                    f"with `python -m lingua.stool`, whose submit.slurm exports both."
                )
            per_node = env.get("SLURM_STEP_TASKS_PER_NODE",
                               env.get("SLURM_NTASKS_PER_NODE", env.get("SLURM_TASKS_PER_NODE", "1")))
            return LaunchEnv(
                int(env["SLURM_PROCID"]), ntasks, int(env.get("SLURM_LOCALID", 0)),
                int(per_node.split("(")[0].split(",")[0]), env["MASTER_ADDR"], int(env.get("MASTER_PORT", 29500)),
                "slurm",
            )
    return LaunchEnv(0, 1, 0, 1, None, None, "single")


def init_method_for(launch: LaunchEnv) -> str:
    """The rendezvous address: the launcher's MASTER_ADDR/PORT, or a private port for one process."""
    if launch.launcher == "single":
        # One process: a private TCP store, no environment variables needed or written.
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            return f"tcp://127.0.0.1:{sock.getsockname()[1]}"
    if launch.master_addr is None or launch.master_port is None:
        raise ValueError("MASTER_ADDR and MASTER_PORT must be set when launching several ranks.")
    return f"tcp://{launch.master_addr}:{launch.master_port}"


def resolve_mesh_dims(args: DistributedArgs, n_students: int) -> tuple[int, int]:
    """(dp_replicate, dp_shard) for `n_students`, inferring one -1; readable error if they don't fit."""
    replicate, shard = args.dp_replicate, args.dp_shard
    if args.fsdp_type not in ("full_shard", "no_shard"):
        raise ValueError(f"distributed.fsdp_type={args.fsdp_type!r}; use 'full_shard' or 'no_shard'.")
    if replicate == -1 and shard == -1:
        raise ValueError("Only one of distributed.dp_replicate / distributed.dp_shard may be -1.")
    for name, value in (("dp_replicate", replicate), ("dp_shard", shard)):
        if value == 0 or value < -1:
            raise ValueError(f"distributed.{name}={value}; use a positive size or -1 to infer it.")
    if replicate == -1:
        if n_students % shard:
            raise ValueError(
                f"{n_students} training ranks cannot be split into dp_shard={shard} groups; "
                f"set distributed.dp_shard to a divisor of {n_students}."
            )
        replicate = n_students // shard
    if shard == -1:
        if n_students % replicate:
            raise ValueError(
                f"{n_students} training ranks cannot be split into dp_replicate={replicate} groups; "
                f"set distributed.dp_replicate to a divisor of {n_students}."
            )
        shard = n_students // replicate
    if replicate * shard != n_students:
        raise ValueError(
            f"Mesh dp_replicate={replicate} x dp_shard={shard} = {replicate * shard} ranks, but there are "
            f"{n_students} training ranks. Set one of them to -1 to infer it, or launch with "
            f"{replicate * shard} student ranks."
        )
    return replicate, shard


def split_roles(world_size: int, n_teachers: int, placement: str, local_world_size: int) -> tuple[list[int], list[int]]:
    """(student global ranks, teacher global ranks), validated before any collective."""
    if n_teachers < 0:
        raise ValueError(f"distillation.n_teacher_ranks={n_teachers} must be >= 0.")
    if n_teachers == 0:
        return list(range(world_size)), []
    if world_size - n_teachers < 1:
        raise ValueError(
            f"Distillation needs at least one student rank besides {n_teachers} teacher rank(s), but the job "
            f"has {world_size} rank(s). Launch more ranks (e.g. torchrun --nproc-per-node {n_teachers + 1}) "
            f"or set enable_distillation=false."
        )
    if placement == "last":
        teachers = list(range(world_size - n_teachers, world_size))
    elif placement == "per_node":
        n_nodes = world_size // local_world_size
        if n_teachers != n_nodes or world_size % local_world_size:
            raise ValueError(
                f"teacher_placement=per_node needs one teacher per node ({n_nodes} nodes), "
                f"but distillation.n_teacher_ranks={n_teachers}."
            )
        teachers = [(node + 1) * local_world_size - 1 for node in range(n_nodes)]
    else:
        raise ValueError(f"distributed.teacher_placement={placement!r}; use 'last' or 'per_node'.")
    students = [r for r in range(world_size) if r not in teachers]
    if len(students) % n_teachers:
        raise ValueError(
            f"{len(students)} student ranks cannot be split evenly among {n_teachers} teachers; "
            f"launch a number of students divisible by distillation.n_teacher_ranks."
        )
    return students, teachers


def expected_cuda_index(local_rank: int, local_world_size: int, n_devices: int) -> int:
    """The GPU a local rank should bind: its own index when it sees the node's GPUs, 0 when the
    launcher gave each task one GPU (srun --gpus-per-task / --gpu-bind); else a readable error."""
    if n_devices == 1 and local_world_size > 1:
        return 0
    if local_rank >= n_devices:
        raise ValueError(
            f"Local rank {local_rank} has no GPU: only {n_devices} visible to it for {local_world_size} local "
            f"ranks (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}). Launch at most "
            f"{n_devices} processes per node, or give each task its own GPU."
        )
    return local_rank


def choose_device(args: DistributedArgs, local_rank: int, local_world_size: int = 1) -> tuple[torch.device, str]:
    backend = args.backend
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        if not torch.cuda.is_available():
            raise ValueError("distributed.backend=nccl needs CUDA; use backend=gloo (or auto) on CPU.")
        index = expected_cuda_index(local_rank, local_world_size, torch.cuda.device_count())
        return torch.device("cuda", index), backend
    if backend != "gloo":
        raise ValueError(f"distributed.backend={args.backend!r}; use auto, nccl or gloo.")
    return torch.device("cpu"), backend


def enable_debug_env(dump_dir: Optional[str]) -> None:
    """The debug switch: torch reads these at process-group creation, so set them before it."""
    trace_dir = os.path.join(dump_dir or ".", "comm_traces")
    os.makedirs(trace_dir, exist_ok=True)
    settings = {
        "TORCH_DISTRIBUTED_DEBUG": "DETAIL",  # mismatched collectives become errors naming the op
        "TORCH_SHOW_CPP_STACKTRACES": "1",
        # Flight recorder, under both the current and the older names.
        "TORCH_FR_BUFFER_SIZE": "20000",
        "TORCH_NCCL_TRACE_BUFFER_SIZE": "20000",
        "TORCH_FR_DUMP_TEMP_FILE": os.path.join(trace_dir, "rank_"),
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": os.path.join(trace_dir, "rank_"),
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        # Tear down on error (not block) so the watchdog gets to write the dump.
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
    }
    for key, value in settings.items():
        os.environ.setdefault(key, value)
    dist.set_debug_level_from_env()
    comm_logger.setLevel(logging.DEBUG)


def setup_torch_distributed(args: DistributedArgs, n_teachers: int = 0, dump_dir: Optional[str] = None) -> Topology:
    """Initialise torch.distributed and build the Topology. Config errors raise before any collective."""
    launch = read_launch_env()
    students, teachers = split_roles(launch.world_size, n_teachers, args.teacher_placement, launch.local_world_size)
    replicate, shard = resolve_mesh_dims(args, len(students))
    device, backend = choose_device(args, launch.local_rank, launch.local_world_size)
    if backend == "nccl":
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = args.matmul_allow_tf32
        torch.backends.cudnn.allow_tf32 = args.matmul_allow_tf32
    if args.debug:
        enable_debug_env(dump_dir)
    if dist.get_debug_level() == dist.DebugLevel.DETAIL:  # ours or the user's own TORCH_DISTRIBUTED_DEBUG
        keep_detail_check_groups()
    faulthandler.enable()
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 <pid>` prints every stack

    timeout = timedelta(seconds=args.init_timeout_s)
    init_start = time.time()
    init_kwargs = dict(backend=backend, init_method=init_method_for(launch), rank=launch.rank,
                       world_size=launch.world_size, timeout=timeout)
    if backend == "nccl":
        init_kwargs["device_id"] = device  # eager NCCL init: no lazy "devices unknown" barrier later
    dist.init_process_group(**init_kwargs)
    spans = {"process_group_init": (init_start, time.time())}

    rank = launch.rank
    role = "teacher" if rank in teachers else "student"
    group_names: dict[int, str] = {id(dist.group.WORLD): "world"}

    def make_group(ranks: list[int], name: str) -> Optional[dist.ProcessGroup]:
        # Collective over the world: every rank calls this, in the same order, for every group.
        group = dist.new_group(ranks, timeout=timeout, group_desc=name)
        if rank in ranks:
            group_names[id(group)] = name
            return group
        return None

    groups_start = time.time()
    train_group = make_group(students, "train")
    teacher_group = make_group(teachers, "teachers") if teachers else None
    bridge_group, my_bridge, bridge_students = None, -1, []
    per_teacher = len(students) // len(teachers) if teachers else 0
    for i, teacher in enumerate(teachers):
        block = students[i * per_teacher:(i + 1) * per_teacher]
        group = make_group(sorted(block + [teacher]), f"bridge_{i}")
        if rank == teacher or rank in block:
            bridge_group, my_bridge, bridge_students = group, i, block

    mesh = _build_mesh(students, replicate, shard, args.fsdp_type, device.type, rank, make_group, train_group)
    spans["mesh"] = (groups_start, time.time())  # every group and the students' mesh

    topo = Topology(
        role=role, global_rank=rank, world_size=launch.world_size, local_rank=launch.local_rank,
        local_world_size=launch.local_world_size, hostname=socket.gethostname(), device=device,
        backend=backend, student_ranks=students, teacher_ranks=teachers,
        train_group=train_group, teacher_group=teacher_group, bridge_group=bridge_group,
        my_bridge=my_bridge, my_teacher=teachers[my_bridge] if my_bridge >= 0 else -1,
        bridge_students=bridge_students, mesh=mesh, group_names=group_names, setup_spans=spans,
    )
    if role == "student":
        topo.train_rank = students.index(rank)
        topo.train_world_size = len(students)
        topo.dp_rank, topo.dp_degree = topo.train_rank, len(students)
    return topo


def _build_mesh(students, replicate, shard, fsdp_type, device_type, rank, make_group, train_group):
    """The students' FSDP mesh from explicit groups, so teachers never join a mesh collective."""
    if fsdp_type == "no_shard":
        replicate, shard = replicate * shard, 1
    grid = torch.tensor(students, dtype=torch.int).view(replicate, shard)
    if replicate == 1:
        # One shard group = all students = the train group: no extra communicator needed.
        if rank not in students:
            return None
        return DeviceMesh.from_group(train_group, device_type, mesh=grid.view(-1), mesh_dim_names=("dp_shard",))
    my_groups = {}
    for dim, lines in (("dp_replicate", grid.t()), ("dp_shard", grid)):
        for line in lines.tolist():
            group = make_group(line, f"train_{dim}")
            if rank in line:
                my_groups[dim] = group
    if rank not in students:
        return None
    return DeviceMesh.from_group(
        [my_groups["dp_replicate"], my_groups["dp_shard"]], device_type, mesh=grid,
        mesh_dim_names=("dp_replicate", "dp_shard"),
    )


def log_rank_device_map(topo: Topology) -> None:
    """Each rank logs its own line; rank 0 prints the whole table once. Then every rank checks the
    whole table (so all raise the same sentence): a rank not on its expected GPU, or two ranks of
    one host on the same physical GPU (seed 004's mapping bug), is an error."""
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
        except ValueError as err:
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
        raise ValueError("GPU binding is wrong: " + "; ".join(problems) + ". Check CUDA_VISIBLE_DEVICES and the "
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


def group_name(topo: Topology, group) -> str:
    return topo.group_names.get(id(group), "?")


def all_groups(topo: Topology) -> list:
    """Every group this rank belongs to, world first."""
    groups = [dist.group.WORLD, topo.train_group, topo.teacher_group, topo.bridge_group]
    if topo.mesh is not None:
        groups += [topo.mesh.get_group(i) for i in range(topo.mesh.ndim)]
    seen, unique = set(), []
    for g in groups:
        if g is not None and id(g) not in seen:
            seen.add(id(g))
            unique.append(g)
    return unique


def keep_detail_check_groups() -> None:
    """Under TORCH_DISTRIBUTED_DEBUG=DETAIL, remember the gloo group torch creates next to each process
    group, keyed by group name, so the two-phase switch can change its timeout too.

    DETAIL wraps every backend in a `_ProcessGroupWrapper` whose own gloo group runs a monitored
    barrier before each collective: a missing peer is detected there, under that group's timeout.
    torch keeps no Python handle on it, so we record it as `_create_process_group_wrapper` makes it.
    """
    c10d = dist.distributed_c10d
    create = getattr(c10d, "_create_process_group_wrapper", None)
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
    what each backend reports afterwards. torch's own `_set_pg_timeout` skips DETAIL's wrapper."""
    timeout = timedelta(seconds=seconds)
    for _, backend in _timeout_backends(group):
        setter = getattr(backend, "_set_default_timeout", None) or getattr(backend, "set_timeout", None)
        try:
            if setter is not None:
                setter(timeout)
        except RuntimeError:  # a backend that cannot switch keeps its timeout; the read-back shows it
            continue
    return group_timeouts(group)


def set_collective_timeout(topo: Topology, seconds: float) -> None:
    """Switch every group of this rank (bridges included) to a new timeout (the two-phase scheme).
    The log line reports what the backends read back, not what was asked."""
    if not topo.distributed:
        return
    groups = all_groups(topo)
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


def enter_training_timeout(topo: Topology, seconds: float) -> None:
    """Students, after their first full step: a barrier on each group only students use (train and
    mesh groups), then the short timeout on every group. The bridge needs no barrier: the teacher
    switches by itself when the first request of a later step (or a STOP) reaches it."""
    if not topo.distributed:
        return
    for group in all_groups(topo):
        if group is dist.group.WORLD or group is topo.bridge_group or group is topo.teacher_group:
            continue
        log_collective("barrier before the training timeout", group)
        dist.barrier(group=group)
    set_collective_timeout(topo, seconds)


def clean_up() -> None:
    """Destroy the process group on every exit path (normal, error, preemption), and say so: the
    line in each rank's log proves that rank got out."""
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
            logger.info("process group destroyed")
        except Exception as err:  # on the way out: report, never mask the exception that brought us here
            logger.warning(f"destroying the process group failed: {type(err).__name__}: {err}")
    _detail_check_groups.clear()


def log_collective(op: str, group, *tensors) -> None:
    """One DEBUG line per collective of ours: group name, op, shapes, per-group sequence number."""
    if not comm_logger.isEnabledFor(logging.DEBUG):
        return
    name = getattr(group, "group_desc", None) or str(id(group))
    seq = _comm_sequence[name] = _comm_sequence.get(name, 0) + 1
    shapes = ", ".join(f"{tuple(t.shape)}:{str(t.dtype).replace('torch.', '')}" for t in tensors)
    comm_logger.debug(f"collective #{seq} on {name}: {op} [{shapes}]")


class HangWatch:
    """Prints every thread's Python stack if a step is still running shortly before the collective timeout.

    `arm(seconds)` re-arms the single faulthandler timer; it is cheap, so it is always on.
    """

    def __init__(self, fraction: float = 0.9):
        self.fraction = fraction

    def arm(self, timeout_s: float) -> None:
        faulthandler.dump_traceback_later(max(1.0, timeout_s * self.fraction), repeat=False)

    @staticmethod
    def cancel() -> None:
        faulthandler.cancel_dump_traceback_later()


# ---- the few collectives of the training loop; each takes its group explicitly ----

def _require_group(group, what: str) -> None:
    """group=None is "no group" only in a single process; in a job it would silently mean the world."""
    if group is None and dist.is_initialized() and dist.get_world_size() > 1:
        raise ValueError(f"{what} needs the group to reduce over (e.g. topo.train_group), not None.")


def dist_mean_dict(values: dict[str, float], group, device: torch.device) -> dict[str, float]:
    """Mean of each value over `group` (one all_reduce for the whole dict)."""
    _require_group(group, "dist_mean_dict")
    if group is None or dist.get_world_size(group) == 1:
        return dict(values)
    keys = sorted(values)
    tensor = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64, device=device)
    log_collective("all_reduce(sum) dist_mean_dict", group, tensor)
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    tensor /= dist.get_world_size(group)
    return dict(zip(keys, tensor.tolist()))


def dist_max(value: float, group, device: torch.device) -> float:
    """Max of a scalar over `group`."""
    _require_group(group, "dist_max")
    if group is None or dist.get_world_size(group) == 1:
        return float(value)
    tensor = torch.tensor([float(value)], dtype=torch.float64, device=device)
    log_collective("all_reduce(max) dist_max", group, tensor)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
    return tensor.item()


def dist_gather_floats(values: list[float], group, device: torch.device) -> list[list[float]]:
    """Every rank's list of floats (same length on all ranks), in group-rank order."""
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    if group is None or dist.get_world_size(group) == 1:
        return [tensor.tolist()]
    out = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    log_collective("all_gather dist_gather_floats", group, tensor)
    dist.all_gather(out, tensor, group=group)
    return [t.tolist() for t in out]


def agree_flags(flags: dict[str, bool], group, device: torch.device) -> dict[str, bool]:
    """A flag is set everywhere if it is set on any rank of `group` (one small all_reduce).

    This is the single point per step where ranks decide to stop, save or fail together.
    """
    if group is None or dist.get_world_size(group) == 1:
        return dict(flags)
    keys = sorted(flags)
    tensor = torch.tensor([int(bool(flags[k])) for k in keys], dtype=torch.int32, device=device)
    log_collective(f"all_reduce(max) agree_flags {keys}", group, tensor)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
    return {k: bool(v) for k, v in zip(keys, tensor.tolist())}


class CountMismatch(ValueError):
    """Ranks hold different loop lengths; raised on every rank of the group at once (it is agreed)."""


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


# ---- FSDP2 / compile / activation checkpointing ----

def parallelize_model(model: torch.nn.Module, topo: Topology, args: DistributedArgs, no_recompute_ops=None):
    """Activation checkpointing, torch.compile and FSDP2 (per block, then the root) over the mesh."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if args.activation_checkpointing not in ("none", "full", "selective"):
        raise ValueError(
            f"distributed.activation_checkpointing={args.activation_checkpointing!r}; use none, full or selective."
        )
    if args.model_dtype not in ("bf16", "fp32"):
        raise ValueError(f"distributed.model_dtype={args.model_dtype!r}; use bf16 or fp32.")
    if args.activation_checkpointing != "none":
        _apply_activation_checkpointing(model, args.activation_checkpointing, no_recompute_ops)
    if args.compile:
        for i, block in enumerate(model.layers):
            model.layers[i] = torch.compile(block)
    if topo.mesh is None:
        return model
    param_dtype = torch.bfloat16 if args.model_dtype == "bf16" else torch.float32
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    shard = partial(fully_shard, mesh=topo.mesh, mp_policy=policy)
    n_layers = len(model.layers)
    for i, block in enumerate(model.layers):
        # The last block's params are needed right away by the root's backward: don't reshard them.
        shard(block, reshard_after_forward=i < n_layers - 1)
    shard(model, reshard_after_forward=True)
    return model


def _apply_activation_checkpointing(model, mode: str, no_recompute_ops) -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    context_fn = None
    if mode == "selective":
        save_ops = set(no_recompute_ops or ())

        def policy(ctx, op, *args, **kwargs):
            return CheckpointPolicy.MUST_SAVE if op in save_ops else CheckpointPolicy.PREFER_RECOMPUTE

        context_fn = partial(create_selective_checkpoint_contexts, policy)
    for i, block in enumerate(model.layers):
        kwargs = dict(preserve_rng_state=False)
        if context_fn is not None:
            kwargs["context_fn"] = context_fn
        model.layers[i] = checkpoint_wrapper(block, **kwargs)


# ---- preemption: handlers only set a local flag; the decision is agreed in the loop ----

class PreemptionFlag:
    """SIGUSR2/SIGTERM set `requested`; the training loop agrees on it across ranks before acting.

    The handlers stay installed until the process exits: a late signal during shutdown is ignored
    rather than killing a rank that is saving or leaving its last barrier.
    """

    def __init__(self, signals=(signal.SIGUSR2, signal.SIGTERM)):
        self.requested = False
        self.signal_name: Optional[str] = None
        self._previous = {}
        for sig in signals:
            self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        self.requested = True
        self.signal_name = signal.Signals(signum).name
        # Logging from a signal handler can deadlock on the handler lock; write raw bytes.
        os.write(sys.stderr.fileno(), f"received {self.signal_name}: will save and stop at the next agreed point\n".encode())

    def ignore_further(self) -> None:
        """After the stop is decided, later signals are moot: ignore them through interpreter exit
        (Python resets its own handlers to the default action at shutdown, which would kill us)."""
        for sig in self._previous:
            signal.signal(sig, signal.SIG_IGN)
