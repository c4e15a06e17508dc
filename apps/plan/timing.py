"""Time: speeds, layouts of teacher replicas and the students' wait with look-ahead (`Timing`)."""

import math
from dataclasses import dataclass

from apps.plan.args import MAX_WAIT_SHARE
from apps.plan.sizes import TeacherShape


@dataclass(frozen=True)
class Speeds:
    student: float  # tokens/s of one student GPU
    teacher: float  # tokens/s of one teacher GPU (a replica of t ranks: t times this)
    source: str

    @property
    def teacher_gpus_per_student_gpu(self) -> float:
        return self.student / self.teacher


@dataclass(frozen=True)
class Layout:
    """Replicas of `teacher_tp` ranks, each serving an equal block of the other ranks."""

    world_size: int
    teacher_tp: int
    replicas: int
    placement: str  # "last" | "per_node"

    @property
    def teacher_ranks(self) -> int:
        return self.replicas * self.teacher_tp

    @property
    def students(self) -> int:
        return self.world_size - self.teacher_ranks

    @property
    def students_per_bridge(self) -> int:
        return self.students // self.replicas

    def load(self, speeds: Speeds) -> float:
        """L / C: a replica's time for one request of all its students over one student's compute for it."""
        return self.students_per_bridge * speeds.teacher_gpus_per_student_gpu / self.teacher_tp


@dataclass(frozen=True)
class Timing:
    load: float  # L / C
    wait: float  # a student's wait per micro-batch over C
    wait_share: float  # of the student's step
    teacher_busy: float  # share of the replica's time spent computing

    @classmethod
    def of(cls, load: float, prefetch: int) -> "Timing":
        """With look-ahead the teacher's forward hides behind the student's whole step: wait = max(0, L - C); without
        it only behind the forward (a third of the training FLOPs): max(0, L - C/3)."""
        hidden = 1.0 if prefetch else 1 / 3
        wait = max(0.0, load - hidden)
        return cls(load, wait, wait / (1 + wait), load / (1 + wait))


def max_students_per_replica(tp: int, speeds: Speeds, prefetch: int) -> float:
    """Students one replica of `tp` ranks keeps under MAX_WAIT_SHARE (wait / (C + wait) <= share)."""
    hidden = 1.0 if prefetch else 1 / 3
    allowed_load = hidden + MAX_WAIT_SHARE / (1 - MAX_WAIT_SHARE)
    return allowed_load * tp / speeds.teacher_gpus_per_student_gpu


def divisors(n: int) -> list[int]:
    """Every divisor of n, ascending (O(sqrt n))."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def candidate_layouts(world_size: int, gpus_per_node: int, tp: int) -> list[Layout]:
    """Layouts of replicas of `tp` ranks that split `world_size` evenly: one per node (per_node, on more than one
    node: on one it is `last`), or any replica count dividing the world with a student left for each (last); a few
    dozen, never one per rank."""
    layouts = []
    if tp < gpus_per_node < world_size:
        layouts.append(Layout(world_size, tp, world_size // gpus_per_node, "per_node"))
    layouts += [Layout(world_size, tp, replicas, "last") for replicas in divisors(world_size)
                if world_size // replicas - tp >= 1]
    return layouts


def tensor_parallel_sizes(shape: TeacherShape, gpus_per_node: int) -> list[int]:
    """teacher_tp values that give each rank whole heads and stay inside a node."""
    return [t for t in divisors(gpus_per_node) if shape.heads % t == 0 and shape.kv_heads % t == 0]
