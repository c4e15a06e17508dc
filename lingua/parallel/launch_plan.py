"""The launch before torch.distributed exists: who runs where, validated on construction. No torch here.

`read_launch_env()` is the one place that reads rank facts from the environment (torchrun, then srun).
`LaunchPlan` turns a world size and the config into roles, bridges and the students' mesh, like
torchtitan's ParallelDims: a plan that cannot work raises a sentence before any process group
exists. The trainer builds its `Topology` from it, and stool prints the same plan at submission.

The launch's teachers are one `TeacherLayout` each (its ranks, its replica size `tp`, its path), one or more. Their
ranks follow the students (teacher 0's, then teacher 1's), or with one teacher and `teacher_placement=per_node`
they are the last `tp` ranks of each node. A teacher's ranks form replicas of `tp` consecutive ranks on one node
(the teacher sharded tensor-parallel over them; 1 by default: one rank, one teacher); each replica serves a
contiguous block of students through its bridge, whose teacher end is the replica's first rank, and each
teacher's replicas divide all the students among them, so every student has one bridge to each teacher. A
refusal's suggested launch was tried first (`launch_fixes.py`).
"""

import os
from dataclasses import InitVar, dataclass, field
from functools import cached_property
from typing import Optional

from lingua.args import require
from lingua.errors import LaunchError
from lingua.parallel.launch_fixes import (LayoutError, accepts, inferred_mesh, mesh_divisor, mesh_launch, more_ranks,
                                           other_ranks, passing, per_node_fixes, refused, tasks_per_node_fixes)

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


def spanning_replica(replicas: list[list[int]], local_world_size: int) -> Optional[tuple[list[int], list[int]]]:
    """(the first replica whose ranks are on more than one node, those nodes), or None."""
    for replica in replicas:
        nodes = sorted({rank // local_world_size for rank in replica})
        if len(nodes) > 1:
            return replica, nodes
    return None


def span_sentence(replica: list[int], nodes: list[int], teacher_tp: int, local_world_size: int, fix: str) -> str:
    return (f"The teacher replica of global ranks {format_ranks(replica)} (distillation.teacher_tp={teacher_tp}) would "
            f"span nodes {' and '.join(map(str, nodes))} ({local_world_size} tasks per node); a replica must stay on "
            f"one node: {fix}.")


def tensor_parallel_replicas(ranks: list[int], teacher_tp: int, local_world_size: int) -> list[list[int]]:
    """`ranks` cut into replicas of `teacher_tp` consecutive ranks; a replica whose ranks are not all on one
    node is refused (tensor parallelism talks every layer: it belongs on a node's fast links)."""
    assert len(ranks) % teacher_tp == 0, (ranks, teacher_tp)  # the LaunchPlan / the cache writer checked the count
    replicas = [ranks[i:i + teacher_tp] for i in range(0, len(ranks), teacher_tp)]
    spanning = spanning_replica(replicas, local_world_size)
    if spanning is not None:
        raise LaunchError(span_sentence(*spanning, teacher_tp, local_world_size,
                                        "make the tasks per node a multiple of distillation.teacher_tp"))
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
class TeacherLayout:
    """A teacher on ranks of its own: how many (whole replicas of `tp` consecutive ranks on one node, the teacher
    sharded tensor-parallel over a replica), and its checkpoint, which names it beside other teachers."""

    ranks: int
    tp: int = 1
    path: str = ""


@dataclass(frozen=True)
class LaunchPlan:
    """Roles, bridges and the students' mesh of a launch of `world_size` ranks; raises if it cannot work."""

    world_size: int
    local_world_size: int
    teachers: tuple[TeacherLayout, ...] = ()  # each teacher with ranks of its own, in rank order after the students
    teacher_placement: str = "last"
    dp_replicate: int = 1
    dp_shard: int = -1
    fsdp_type: str = "full_shard"
    suggest: InitVar[bool] = True  # a refusal names the changes that pass (lingua/parallel/launch_fixes.py)
    student_ranks: list[int] = field(init=False)
    teacher_ranks: list[int] = field(init=False)
    mesh_dims: tuple[int, int] = field(init=False)  # (dp_replicate, dp_shard), -1s resolved

    def __post_init__(self, suggest: bool):
        assert self.fsdp_type in FSDP_TYPES, self.fsdp_type  # DistributedArgs.validate() names the choices
        assert self.teacher_placement in TEACHER_PLACEMENTS, self.teacher_placement
        assert all(t.ranks >= 1 and t.tp >= 1 for t in self.teachers), self.teachers  # the config was validated
        object.__setattr__(self, "suggests", suggest)
        teachers = self._place_teachers()
        teacher_set = set(teachers)  # a set: at 16k ranks a list lookup per rank is quadratic
        object.__setattr__(self, "teacher_ranks", teachers)
        object.__setattr__(self, "student_ranks", [r for r in range(self.world_size) if r not in teacher_set])
        for i, ranks in enumerate(self.teacher_models):
            self._check_replicas(i, ranks)
        object.__setattr__(self, "mesh_dims", self._mesh_dims(len(self.student_ranks)))

    @classmethod
    def for_launch(cls, args: DistributedArgs, world_size: int, local_world_size: int,
                   teachers: tuple[TeacherLayout, ...] = ()) -> "LaunchPlan":
        """The plan of `args` (validated first) for a launch of `world_size` ranks and these teachers."""
        args.validate()
        return cls(world_size, local_world_size, tuple(teachers), args.teacher_placement, args.dp_replicate,
                   args.dp_shard, args.fsdp_type)

    @property
    def n_teacher_ranks(self) -> int:
        return sum(t.ranks for t in self.teachers)

    @property
    def teacher_tp(self) -> int:
        """Ranks per replica of the first teacher (every teacher's, with one); 1 without teacher ranks."""
        return self.teachers[0].tp if self.teachers else 1

    def _place_teachers(self) -> list[int]:
        """The teacher ranks: the last ones, teacher after teacher, or the last of each node (one teacher)."""
        n, named = self.n_teacher_ranks, len(self.teachers) > 1
        if n == 0:
            return []
        if named and self.teacher_placement != "last":
            raise refused("Several teachers (distillation.teachers) take the last ranks, one teacher after the other",
                          passing(self, ("set distributed.teacher_placement=last", dict(teacher_placement="last"))),
                          ";", "")
        if self.world_size - n < 1:
            more, off = more_ranks(self), ("enable_distillation=false",) if accepts(self, dict(teachers=())) else ()
            launch = f"Launch more ranks (e.g. {more[0]})" if more else "Launch more ranks"
            raise LayoutError(f"Distillation needs at least one student rank besides {n} teacher rank(s), but the job "
                              f"has {self.world_size} rank(s). {launch}{' or set ' + off[0] if off else ''}.",
                              more + off)
        for i, teacher in enumerate(self.teachers):
            if teacher.ranks % teacher.tp == 0:
                continue
            key = f"distillation.teachers[{i}].n_teacher_ranks" if named else "distillation.n_teacher_ranks"
            if named:
                raise refused(f"Teacher {i}'s {teacher.ranks} rank(s) cannot be split into replicas of its teacher_tp="
                              f"{teacher.tp} ranks; set {key} to a multiple of {teacher.tp}", other_ranks(self, i, key))
            raise refused(f"{key}={n} cannot be split into teacher replicas of distillation.teacher_tp={teacher.tp} "
                          f"ranks; use a multiple of {teacher.tp}", other_ranks(self, i, key))
        if self.teacher_placement == "last":
            return list(range(self.world_size - n, self.world_size))
        local, tp = self.local_world_size, self.teacher_tp
        n_nodes = self.world_size // local
        if n != n_nodes * tp or self.world_size % local:
            per_node = ("one teacher per node" if tp == 1 else
                        f"one teacher replica of distillation.teacher_tp={tp} ranks per node")
            count = f"({n_nodes} nodes)" if tp == 1 else f"({n_nodes} nodes x {tp} = {n_nodes * tp} teacher ranks)"
            raise refused(f"teacher_placement=per_node needs {per_node} {count}, but distillation.n_teacher_ranks={n}",
                          per_node_fixes(self), ";", "")
        return [node * local + rank for node in range(n_nodes) for rank in range(local - tp, local)]

    def _check_replicas(self, i: int, ranks: list[int]) -> None:
        """Teacher `i`'s replicas stay on a node each, and divide all the students among them."""
        teacher, named, students = self.teachers[i], len(self.teachers) > 1, len(self.student_ranks)
        spanning = spanning_replica([ranks[j:j + teacher.tp] for j in range(0, len(ranks), teacher.tp)],
                                    self.local_world_size)
        if spanning is not None:
            words, fixes = tasks_per_node_fixes(self, teacher.tp)
            raise LayoutError(span_sentence(*spanning, teacher.tp, self.local_world_size, words), fixes)
        n_replicas = len(ranks) // teacher.tp
        if students % n_replicas == 0:
            return
        if named:
            key = f"distillation.teachers[{i}].n_teacher_ranks"
            raise refused(f"{students} student ranks cannot be split evenly among teacher {i}'s {n_replicas} "
                          f"replica(s); set {key} so that its replicas divide the students",
                          other_ranks(self, i, key) + more_ranks(self))
        if teacher.tp == 1:
            raise refused(f"{students} student ranks cannot be split evenly among {len(ranks)} teachers; launch a "
                          f"number of students divisible by distillation.n_teacher_ranks", more_ranks(self))
        raise refused(f"{students} student ranks cannot be split evenly among {n_replicas} teacher replicas "
                      f"({len(ranks)} teacher ranks / distillation.teacher_tp={teacher.tp}); launch a number of "
                      f"students divisible by {n_replicas}", more_ranks(self))

    def _mesh_dims(self, n_students: int) -> tuple[int, int]:
        """(dp_replicate, dp_shard) for the students, inferring one -1; a sentence if they don't fit."""
        replicate, shard = self.dp_replicate, self.dp_shard
        # DistributedArgs.validate() names the setting; here a bad size is our bug.
        assert {replicate, shard} != {-1} and all(v == -1 or v >= 1 for v in (replicate, shard)), (replicate, shard)
        for key, size, other in (("dp_shard", shard, replicate), ("dp_replicate", replicate, shard)):
            if other == -1 and n_students % size:
                raise refused(f"{n_students} training ranks cannot be split into {key}={size} groups; set "
                              f"distributed.{key} to a divisor of {n_students}",
                              mesh_divisor(self, key, size, n_students))
        replicate = n_students // shard if replicate == -1 else replicate
        shard = n_students // replicate if shard == -1 else shard
        if replicate * shard != n_students:
            inferred, launch = inferred_mesh(self), mesh_launch(self, replicate * shard)
            infer = f" (e.g. {inferred[0]})" if inferred else ""
            student_launch = f", or launch with {replicate * shard} student ranks ({launch[0]})" if launch else ""
            raise LayoutError(f"Mesh dp_replicate={replicate} x dp_shard={shard} = {replicate * shard} ranks, but "
                              f"there are {n_students} training ranks. Set one of them to -1 to infer it{infer}"
                              f"{student_launch}.", inferred + launch)
        return replicate, shard

    def teacher_tp_of(self, teacher: int) -> int:
        """Ranks per replica of teacher `teacher`."""
        return self.teachers[teacher].tp

    def rank_words(self, rank: int) -> str:
        """How a sentence names a rank's role: "student", "teacher", or beside other teachers "teacher 1 (<path>)"."""
        if len(self.teachers) < 2 or self.role(rank) != "teacher":
            return self.role(rank)
        index = next(i for i, ranks in enumerate(self.teacher_models) if rank in ranks)
        return f"teacher {index}" + (f" ({self.teachers[index].path})" if self.teachers[index].path else "")

    @cached_property
    def teacher_models(self) -> list[list[int]]:
        """The teacher ranks of each teacher, in rank order."""
        starts = [sum(t.ranks for t in self.teachers[:i]) for i in range(len(self.teachers))]
        return [self.teacher_ranks[start:start + t.ranks] for start, t in zip(starts, self.teachers)]

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
        for i, ranks in enumerate(self.teacher_models if len(self.teachers) > 1 else []):
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
