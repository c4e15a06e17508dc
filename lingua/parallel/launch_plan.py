"""The launch before torch.distributed exists: who runs where, validated on construction. No torch here.

`read_launch_env()` is the one place that reads rank facts from the environment (torchrun, then srun).
`LaunchPlan` turns a world size and the config into roles, bridges and the students' mesh, like
torchtitan's ParallelDims: a plan that cannot work raises a sentence before any process group
exists. The trainer builds its `Topology` from it, and stool prints the same plan at submission.

Ranks are split into students (the first `W - n_teachers`) and teachers (the last `n_teachers`, or
the last `teacher_tp` ranks of each node with `teacher_placement=per_node`). Teachers form replicas of
`teacher_tp` consecutive ranks on one node (the teacher sharded tensor-parallel over them; 1 by default:
one rank, one teacher); each replica serves a contiguous block of students through its bridge, whose
teacher end is the replica's first rank. Several teachers (`distillation.teachers`, `teacher_counts`) take
their ranks in order after the students (teacher 0's, then teacher 1's), each in replicas of its own size
(`teacher_tps`); each teacher's replicas divide all the students among them, so every student has one bridge to
each teacher.
"""

import os
from dataclasses import dataclass, field
from functools import cached_property
from typing import Optional

from lingua.args import require
from lingua.errors import LaunchError

TEACHER_PLACEMENTS = ("last", "per_node")
FSDP_TYPES = ("full_shard", "no_shard")
BACKENDS = ("auto", "nccl", "gloo")
MODEL_DTYPES = ("bf16", "fp32")
# distributed.debug: false | trace (flight recorder dumps, for hangs) | detail (TORCH_DISTRIBUTED_DEBUG=DETAIL, for
# mismatched collectives) | true (both); every mode but false logs each collective of ours. YAML and the command
# line read true/false as booleans: they mean the same as the words.
DEBUG_MODES = ("false", "true", "trace", "detail")
ACTIVATION_CHECKPOINTING = ("none", "full", "selective")
MAX_TIMEOUT_S = 7 * 24 * 3600  # longer is "never" in practice, and huge values overflow the backends' clocks


@dataclass
class DistributedArgs:
    # Mesh over the training (student) ranks; -1 = infer from the training world size.
    dp_replicate: int = 1
    dp_shard: int = -1  # student ranks each FSDP group shards the model over; -1 = all the rest
    fsdp_type: str = "full_shard"  # "full_shard" (FSDP shards weights, grads, optimizer) | "no_shard" (DDP-like)
    model_dtype: str = "bf16"  # parameter dtype under FSDP mixed precision: "bf16" | "fp32"
    compile: bool = False  # torch.compile the student's blocks (a slower first step, faster steps on a GPU)
    activation_checkpointing: str = "none"  # "none" | "full" | "selective"
    # Meta Lingua's names, accepted so its configs run unchanged (folded by `validate`).
    selective_activation_checkpointing: Optional[bool] = None  # Lingua's: true = activation_checkpointing=selective
    tp_size: int = 1  # Lingua's student tensor parallelism: above 1 is refused (shard with dp_shard / dp_replicate)
    backend: str = "auto"  # "auto" (nccl on GPU, gloo on CPU) | "nccl" | "gloo"
    teacher_placement: str = "last"  # "last" global ranks | "per_node" (last local rank of each node)
    # Two-phase timeouts: generous while loading/compiling, short once the first step went through.
    init_timeout_s: float = 600.0
    train_timeout_s: float = 300.0  # seconds a collective may wait once the first step is done
    debug: str = "false"  # one of DEBUG_MODES (see `debug_mode`); true/false may come as booleans
    matmul_allow_tf32: bool = True  # fp32 matmuls may use TF32 tensor cores (Ampere and later GPUs)
    # With grad_acc_steps > 1: False keeps FSDP's unsharded gradients across a step's micro-batches and
    # reduce-scatters once, after the last (grad_acc_steps - 1 fewer reduce-scatters per step), at the cost
    # of one unsharded gradient copy of the model per rank in FSDP2's reduce_dtype, fp32 (parallelize.py):
    # 4 bytes per parameter whatever model_dtype (twice the bf16 parameters; 4.8 GB for a 1.2B model), plus a
    # block's model_dtype gradient of the current micro-batch until FSDP adds it in.
    reduce_every_micro_batch: bool = True

    def validate(self) -> None:
        """Known choices, mesh sizes that can be inferred, and timeouts the backends can apply."""
        require(self.debug_mode in DEBUG_MODES, "distributed.debug", self.debug,
                "use false, trace (flight recorder dumps and per-collective logs, for hangs), detail "
                "(TORCH_DISTRIBUTED_DEBUG=DETAIL, for mismatched collectives) or true (both)")
        for key, allowed in (("backend", BACKENDS), ("fsdp_type", FSDP_TYPES), ("model_dtype", MODEL_DTYPES),
                             ("activation_checkpointing", ACTIVATION_CHECKPOINTING),
                             ("teacher_placement", TEACHER_PLACEMENTS)):
            require(getattr(self, key) in allowed, f"distributed.{key}", getattr(self, key),
                    f"use one of {', '.join(allowed)}")
        for key in ("dp_replicate", "dp_shard"):
            value = getattr(self, key)
            require(value == -1 or value >= 1, f"distributed.{key}", value, "use a positive size or -1 to infer it")
        require(self.tp_size == 1, "distributed.tp_size", self.tp_size,
                "student tensor parallelism is not available here; set distributed.tp_size=1 and shard the student "
                "with FSDP over distributed.dp_shard (and distributed.dp_replicate)")
        if self.selective_activation_checkpointing:  # Lingua's switch, one meaning with ours
            require(self.activation_checkpointing in ("none", "selective"), "distributed.activation_checkpointing",
                    self.activation_checkpointing, "distributed.selective_activation_checkpointing=true asks for "
                    "selective; set one of the two")
            self.activation_checkpointing = "selective"
        require(self.dp_replicate != -1 or self.dp_shard != -1, "distributed.dp_replicate", self.dp_replicate,
                "only one of distributed.dp_replicate / distributed.dp_shard may be -1")
        for key in ("init_timeout_s", "train_timeout_s"):
            value = getattr(self, key)
            require(0 < value <= MAX_TIMEOUT_S, f"distributed.{key}", value,
                    f"use a positive number of seconds (at most {MAX_TIMEOUT_S}, a week)")

    @property
    def debug_mode(self) -> str:
        """`debug` as one lower-case word: OmegaConf turns a YAML `true` into "True" for this string field, and
        code may pass a Python bool."""
        return str(self.debug).strip().lower()

    @property
    def traces(self) -> bool:
        """Flight recorder dumps into <dump_dir>/comm_traces (debug=trace or true)."""
        return self.debug_mode in ("trace", "true")


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
                raise LaunchError(
                    f"This SLURM job has {ntasks} tasks but this process was not started by srun, so it would "
                    f"wait for ranks that never come; start one process per rank with srun (MASTER_ADDR and "
                    f"MASTER_PORT exported), use torchrun, or submit with `python -m lingua.stool`."
                )
            if "MASTER_ADDR" not in env:
                raise LaunchError(
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


def teacher_rank_count(enable_distillation: bool, n_teacher_ranks: int) -> int:
    """How many ranks of a launch are teachers: distillation.n_teacher_ranks (at least 1) with distillation on."""
    if not enable_distillation:
        return 0
    require(n_teacher_ranks >= 1, "distillation.n_teacher_ranks", n_teacher_ranks,
            "distillation needs at least one teacher rank; use 1 or more, or set enable_distillation=false")
    return n_teacher_ranks


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


def resolve_mesh_dims(dp_replicate: int, dp_shard: int, n_students: int) -> tuple[int, int]:
    """(dp_replicate, dp_shard) for `n_students`, inferring one -1; readable error if they don't fit."""
    replicate, shard = dp_replicate, dp_shard
    # DistributedArgs.validate() names the setting; here a bad size is our bug.
    assert {replicate, shard} != {-1} and all(v == -1 or v >= 1 for v in (replicate, shard)), (replicate, shard)
    if replicate == -1:
        if n_students % shard:
            raise LaunchError(
                f"{n_students} training ranks cannot be split into dp_shard={shard} groups; "
                f"set distributed.dp_shard to a divisor of {n_students}."
            )
        replicate = n_students // shard
    if shard == -1:
        if n_students % replicate:
            raise LaunchError(
                f"{n_students} training ranks cannot be split into dp_replicate={replicate} groups; "
                f"set distributed.dp_replicate to a divisor of {n_students}."
            )
        shard = n_students // replicate
    if replicate * shard != n_students:
        raise LaunchError(
            f"Mesh dp_replicate={replicate} x dp_shard={shard} = {replicate * shard} ranks, but there are "
            f"{n_students} training ranks. Set one of them to -1 to infer it, or launch with "
            f"{replicate * shard} student ranks."
        )
    return replicate, shard


def split_roles(world_size: int, n_teachers: int, placement: str, local_world_size: int,
                teacher_tp: int = 1, one_teacher: bool = True) -> tuple[list[int], list[int]]:
    """(student global ranks, teacher global ranks), validated before any collective (`one_teacher` False: the
    students' split among several teachers' replicas is checked per teacher, by the LaunchPlan)."""
    assert n_teachers >= 0 and placement in TEACHER_PLACEMENTS and teacher_tp >= 1, (n_teachers, placement, teacher_tp)
    if n_teachers == 0:
        return list(range(world_size)), []
    if world_size - n_teachers < 1:
        raise LaunchError(
            f"Distillation needs at least one student rank besides {n_teachers} teacher rank(s), but the job "
            f"has {world_size} rank(s). Launch more ranks (e.g. torchrun --nproc-per-node {n_teachers + 1}) "
            f"or set enable_distillation=false."
        )
    if n_teachers % teacher_tp:
        raise LaunchError(f"distillation.n_teacher_ranks={n_teachers} cannot be split into teacher replicas of "
                         f"distillation.teacher_tp={teacher_tp} ranks; use a multiple of {teacher_tp}.")
    if placement == "last":
        teachers = list(range(world_size - n_teachers, world_size))
    else:
        n_nodes = world_size // local_world_size
        if n_teachers != n_nodes * teacher_tp or world_size % local_world_size:
            if teacher_tp == 1:
                raise LaunchError(
                    f"teacher_placement=per_node needs one teacher per node ({n_nodes} nodes), "
                    f"but distillation.n_teacher_ranks={n_teachers}."
                )
            raise LaunchError(
                f"teacher_placement=per_node needs one teacher replica of distillation.teacher_tp={teacher_tp} ranks "
                f"per node ({n_nodes} nodes x {teacher_tp} = {n_nodes * teacher_tp} teacher ranks), but "
                f"distillation.n_teacher_ranks={n_teachers}."
            )
        teachers = [node * local_world_size + local for node in range(n_nodes)
                    for local in range(local_world_size - teacher_tp, local_world_size)]
    tensor_parallel_replicas(teachers, teacher_tp, local_world_size)  # a replica that spans nodes is refused here
    teacher_set = set(teachers)  # a set: at 16k ranks a list lookup per rank is quadratic
    students = [r for r in range(world_size) if r not in teacher_set]
    n_replicas = n_teachers // teacher_tp
    if one_teacher and len(students) % n_replicas:
        if teacher_tp == 1:
            raise LaunchError(
                f"{len(students)} student ranks cannot be split evenly among {n_teachers} teachers; "
                f"launch a number of students divisible by distillation.n_teacher_ranks."
            )
        raise LaunchError(
            f"{len(students)} student ranks cannot be split evenly among {n_replicas} teacher replicas "
            f"({n_teachers} teacher ranks / distillation.teacher_tp={teacher_tp}); launch a number of students "
            f"divisible by {n_replicas}."
        )
    return students, teachers


def tensor_parallel_replicas(ranks: list[int], teacher_tp: int, local_world_size: int) -> list[list[int]]:
    """`ranks` cut into replicas of `teacher_tp` consecutive ranks; a replica whose ranks are not all on one
    node is refused (tensor parallelism talks every layer: it belongs on a node's fast links)."""
    assert len(ranks) % teacher_tp == 0, (ranks, teacher_tp)  # split_roles / the cache writer checked the count
    replicas = [ranks[i:i + teacher_tp] for i in range(0, len(ranks), teacher_tp)]
    for replica in replicas:
        nodes = sorted({rank // local_world_size for rank in replica})
        if len(nodes) > 1:
            raise LaunchError(
                f"The teacher replica of global ranks {format_ranks(replica)} (distillation.teacher_tp={teacher_tp}) "
                f"would span nodes {' and '.join(map(str, nodes))} ({local_world_size} tasks per node); a replica must "
                f"stay on one node: make the tasks per node a multiple of distillation.teacher_tp, or use "
                f"distributed.teacher_placement=per_node."
            )
    return replicas


def expected_cuda_index(local_rank: int, local_world_size: int, n_devices: int) -> int:
    """The GPU a local rank should bind: its own index when it sees the node's GPUs, 0 when the
    launcher gave each task one GPU (srun --gpus-per-task / --gpu-bind); else a readable error."""
    if n_devices == 1 and local_world_size > 1:
        return 0
    if local_rank >= n_devices:
        raise LaunchError(
            f"Local rank {local_rank} has no GPU: only {n_devices} visible to it for {local_world_size} local "
            f"ranks (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}). Launch at most "
            f"{n_devices} processes per node, or give each task its own GPU."
        )
    return local_rank


@dataclass(frozen=True)
class LaunchPlan:
    """Roles, bridges and the students' mesh of a launch of `world_size` ranks; raises if it cannot work."""

    world_size: int
    local_world_size: int
    n_teachers: int = 0
    teacher_placement: str = "last"
    dp_replicate: int = 1
    dp_shard: int = -1
    fsdp_type: str = "full_shard"
    teacher_tp: int = 1  # ranks per teacher replica (distillation.teacher_tp)
    teacher_counts: tuple[int, ...] = ()  # ranks of each of several teachers, in order; () = one teacher
    teacher_paths: tuple[str, ...] = ()  # the checkpoint of each of several teachers, for sentences naming them
    teacher_tps: tuple[int, ...] = ()  # ranks per replica of each of several teachers; () = teacher_tp for each
    student_ranks: list[int] = field(init=False)
    teacher_ranks: list[int] = field(init=False)
    mesh_dims: tuple[int, int] = field(init=False)  # (dp_replicate, dp_shard), -1s resolved

    def __post_init__(self):
        assert self.fsdp_type in FSDP_TYPES, self.fsdp_type  # DistributedArgs.validate() names the choices
        if self.teacher_counts and self.teacher_placement != "last":
            raise LaunchError("Several teachers (distillation.teachers) take the last ranks, one teacher after the "
                              "other; set distributed.teacher_placement=last.")
        # Several teachers' replica sizes are checked per teacher (_check_several_teachers), one size for all here.
        students, teachers = split_roles(self.world_size, self.n_teachers, self.teacher_placement,
                                         self.local_world_size, 1 if self.teacher_tps else self.teacher_tp,
                                         one_teacher=not self.teacher_counts)
        object.__setattr__(self, "student_ranks", students)
        object.__setattr__(self, "teacher_ranks", teachers)
        object.__setattr__(self, "mesh_dims", resolve_mesh_dims(self.dp_replicate, self.dp_shard, len(students)))
        if self.teacher_counts:
            self._check_several_teachers()

    def _check_several_teachers(self) -> None:
        """Several teachers: their ranks after the students, and each teacher's replicas divide the students."""
        assert sum(self.teacher_counts) == self.n_teachers, (self.teacher_counts, self.n_teachers)
        assert not self.teacher_tps or len(self.teacher_tps) == len(self.teacher_counts), self.teacher_tps
        for i, ranks in enumerate(self.teacher_models):
            tp = self.teacher_tp_of(i)
            if len(ranks) % tp:
                raise LaunchError(f"Teacher {i}'s {len(ranks)} rank(s) cannot be split into replicas of its teacher_tp="
                                  f"{tp} ranks; set distillation.teachers[{i}].n_teacher_ranks to a multiple of {tp}.")
            tensor_parallel_replicas(ranks, tp, self.local_world_size)  # a replica that spans nodes is refused here
            n_replicas = len(ranks) // tp
            if len(self.student_ranks) % n_replicas:
                raise LaunchError(f"{len(self.student_ranks)} student ranks cannot be split evenly among teacher {i}'s "
                                  f"{n_replicas} replica(s); set distillation.teachers[{i}].n_teacher_ranks so that "
                                  f"its replicas divide the students.")

    @classmethod
    def for_launch(cls, args: DistributedArgs, n_teachers: int, world_size: int, local_world_size: int,
                   teacher_tp: int = 1, teacher_counts: tuple[int, ...] = (),
                   teacher_paths: tuple[str, ...] = (), teacher_tps: tuple[int, ...] = ()) -> "LaunchPlan":
        """The plan of `args` for a launch of `world_size` ranks (`args` are validated first); `teacher_counts`
        the ranks of each of several teachers (their sum is `n_teachers`), `teacher_paths` their checkpoints,
        `teacher_tps` their replica sizes (() = teacher_tp for each)."""
        args.validate()
        several = len(teacher_counts) > 1
        return cls(world_size, local_world_size, n_teachers, args.teacher_placement, args.dp_replicate,
                   args.dp_shard, args.fsdp_type, teacher_tp, tuple(teacher_counts) if several else (),
                   tuple(teacher_paths) if several else (), tuple(teacher_tps) if several else ())

    def teacher_tp_of(self, teacher: int) -> int:
        """Ranks per replica of teacher `teacher` (its own teacher_tp with several teachers, else teacher_tp)."""
        return self.teacher_tps[teacher] if self.teacher_tps else self.teacher_tp

    def rank_words(self, rank: int) -> str:
        """How a sentence names a rank's role: "student", "teacher", or with several teachers "teacher 1 (<path>)"."""
        if not self.teacher_counts or self.role(rank) != "teacher":
            return self.role(rank)
        index = next(i for i, ranks in enumerate(self.teacher_models) if rank in ranks)
        return f"teacher {index}" + (f" ({self.teacher_paths[index]})" if index < len(self.teacher_paths) else "")

    @cached_property
    def teacher_models(self) -> list[list[int]]:
        """The teacher ranks of each teacher (one list with one teacher), in rank order."""
        if not self.teacher_counts:
            return [self.teacher_ranks] if self.teacher_ranks else []
        starts = [sum(self.teacher_counts[:i]) for i in range(len(self.teacher_counts))]
        return [self.teacher_ranks[start:start + n] for start, n in zip(starts, self.teacher_counts)]

    def teacher_of_bridge(self, bridge: int) -> int:
        """Which teacher (index in `teacher_models`) the replica of bridge `bridge` belongs to."""
        first = self.replicas()[bridge][0][0]
        return next(i for i, ranks in enumerate(self.teacher_models) if first in ranks)

    @cached_property
    def _teacher_set(self) -> frozenset[int]:
        return frozenset(self.teacher_ranks)

    @cached_property
    def _bridge_of_rank(self) -> dict[int, list[int]]:
        """Replica indices of every rank of a bridge, built once: a teacher rank's one, a student's one per teacher."""
        out: dict[int, list[int]] = {}
        for i, (ranks, students) in enumerate(self.replicas()):
            for rank in ranks + students:
                out.setdefault(rank, []).append(i)
        return out

    def role(self, rank: int) -> str:
        return "teacher" if rank in self._teacher_set else "student"

    def replicas(self) -> list[tuple[list[int], list[int]]]:
        """(the teacher_tp ranks of a teacher replica, the contiguous block of students it serves), in teacher order
        (with several teachers: teacher 0's replicas, then teacher 1's, each teacher's covering every student)."""
        out = []
        for i, model_ranks in enumerate(self.teacher_models):
            groups = tensor_parallel_replicas(model_ranks, self.teacher_tp_of(i), self.local_world_size)
            per_replica = len(self.student_ranks) // len(groups)
            out += [(ranks, self.student_ranks[i * per_replica:(i + 1) * per_replica]) for i, ranks in enumerate(groups)]
        return out

    def bridges(self) -> list[tuple[int, list[int]]]:
        """(the replica's first rank, which talks to the students, and its students), one per replica."""
        return [(ranks[0], students) for ranks, students in self.replicas()]

    def bridge_index(self, rank: int, teacher: int = 0) -> int:
        """Index of the replica `rank` belongs to or is served by (every rank of a replica counts, not only the
        one on the bridge), -1 without distillation; a student has one per teacher (`teacher` picks it)."""
        bridges = self._bridge_of_rank.get(rank)
        if not bridges:
            return -1
        return bridges[teacher] if len(bridges) > 1 else bridges[0]

    def mesh_grid(self) -> list[list[int]]:
        """Student global ranks as [dp_replicate][dp_shard]; no_shard replicates over every student."""
        replicate, shard = self.mesh_dims
        if self.fsdp_type == "no_shard":
            replicate, shard = replicate * shard, 1
        return [self.student_ranks[r * shard:(r + 1) * shard] for r in range(replicate)]

    def describe(self) -> list[str]:
        """Human-readable lines: nodes, which global ranks (node, local rank) are teachers, the mesh."""
        nodes = self.world_size // self.local_world_size
        lines = [f"ranks: {nodes} node(s) x {self.local_world_size} task(s) = {self.world_size} ranks "
                 f"(block distribution: node i holds ranks {self.local_world_size}*i..)"]
        if not self.teacher_ranks:
            lines.append("distillation off: every rank is a student")
            return lines
        lines.append(f"distillation: {len(self.teacher_ranks)} teacher rank(s), placement {self.teacher_placement}")
        for i, ranks in enumerate(self.teacher_models if self.teacher_counts else []):
            lines.append(f"  teacher {i}: global ranks {format_ranks(ranks)}")
        replicas = self.replicas()
        for rank in [ranks[0] for ranks, _ in replicas if len(ranks) == 1]:  # one rank, one whole teacher
            lines.append(f"  teacher: global rank {rank} (node {rank // self.local_world_size}, "
                         f"local rank {rank % self.local_world_size})")
        for i, (ranks, students) in enumerate(replicas):
            if len(ranks) == 1:
                continue
            local = [rank % self.local_world_size for rank in ranks]
            lines.append(f"  teacher replica {i}: global ranks {format_ranks(ranks)} (node "
                         f"{ranks[0] // self.local_world_size}, local ranks {format_ranks(local)}), tensor-parallel "
                         f"over {len(ranks)}, serving students {format_ranks(students)}")
        lines.append(f"  students: global ranks {format_ranks(self.student_ranks)}")
        return lines
