"""The changes a refused launch's sentence suggests, each tried on the plan before it is printed: a suggested launch
always passes (`LaunchPlan` asks these while refusing; they build the changed plan with `suggest=False`). No torch."""

import dataclasses
from typing import Optional

from lingua.errors import LaunchError


class LayoutError(LaunchError):
    """A launch the plan refuses; `fixes`: each concrete change its sentence suggests, tried and accepted first."""

    def __init__(self, sentence: str, fixes: tuple[str, ...] = ()):
        super().__init__(sentence)
        self.fixes = fixes


def launch_words(world_size: int, local_world_size: int) -> str:
    """A launch of `world_size` ranks, `local_world_size` per node, as torchrun's flags."""
    if world_size == local_world_size:
        return f"torchrun --nproc-per-node {world_size}"
    return f"torchrun --nnodes {world_size // local_world_size} --nproc-per-node {local_world_size}"


def refused(problem: str, fixes: tuple[str, ...], opening: str = " (e.g.", closing: str = ")") -> LayoutError:
    """`problem` and its fixes (each tried already) as one sentence: "<problem><opening> a, or b<closing>."."""
    told = f"{opening} {', or '.join(fixes)}{closing}" if fixes else ""
    return LayoutError(f"{problem}{told}.", fixes)


def accepts(plan, changes: dict) -> bool:
    """Whether the plan with these fields changed is a launch that works (never while a fix is being tried)."""
    if not plan.suggests:
        return False
    try:
        dataclasses.replace(plan, suggest=False, **changes)
    except LaunchError:
        return False
    return True


def first_launch(plan, changes: Optional[dict] = None) -> Optional[str]:
    """The smallest launch with more ranks that the plan accepts with `changes` (more ranks on one node, or more nodes
    of as many ranks), as torchrun's flags; None when none within 64."""
    one_node, nodes = plan.world_size == plan.local_world_size, plan.world_size // plan.local_world_size
    for extra in range(1, 65 if plan.suggests else 1):
        world = plan.world_size + extra if one_node else (nodes + extra) * plan.local_world_size
        local = world if one_node else plan.local_world_size
        if accepts(plan, {**(changes or {}), "world_size": world, "local_world_size": local}):
            return launch_words(world, local)
    return None


def passing(plan, *options: tuple[str, dict]) -> tuple[str, ...]:
    """The words of each (words, changed plan fields) option the plan accepts: alone, or "<words> with <a launch of
    more ranks>" where it needs more ranks too."""
    accepted = []
    for words, changes in options:
        if accepts(plan, changes):
            accepted.append(words)
        elif "world_size" not in changes and (launch := first_launch(plan, changes)):
            accepted.append(f"{words} with {launch}")
    return tuple(accepted)


def more_ranks(plan) -> tuple[str, ...]:
    """The smallest launch with more ranks that the plan's settings accept, as torchrun's flags; () if none."""
    launch = first_launch(plan)
    return (launch,) if launch else ()


def other_ranks(plan, i: int, key: str) -> tuple[str, ...]:
    """"`key`=n" for the count of teacher `i`'s ranks nearest its own (whole replicas) that the launch accepts."""
    teacher = plan.teachers[i]
    counts = sorted(range(teacher.tp, plan.world_size, teacher.tp), key=lambda n: (abs(n - teacher.ranks), n))
    for n in counts[:16]:
        changed = plan.teachers[:i] + (dataclasses.replace(teacher, ranks=n),) + plan.teachers[i + 1:]
        if accepts(plan, dict(teachers=changed)):
            return (f"{key}={n}",)
    return ()


def per_node_fixes(plan) -> tuple[str, ...]:
    """A one-teacher per-node placement of the wrong size: its size per node, or the last ranks."""
    teacher, n_nodes = plan.teachers[0], plan.world_size // plan.local_world_size
    count = dataclasses.replace(teacher, ranks=n_nodes * teacher.tp)
    return passing(plan, (f"set distillation.n_teacher_ranks={count.ranks}", dict(teachers=(count,))),
                   ("set distributed.teacher_placement=last", dict(teacher_placement="last")))


def tasks_per_node_fixes(plan, tp: int) -> tuple[str, tuple[str, ...]]:
    """(the words, the fixes) for a replica across nodes: tasks per node that keep each replica on one, or the
    per-node placement."""
    nodes = max(1, plan.world_size // plan.local_world_size)
    sizes = [per for per in range(plan.local_world_size + 1, plan.local_world_size + 8 * tp) if per % tp == 0]
    tasks = tuple(launch_words(nodes * per, per) for per in sizes
                  if accepts(plan, dict(world_size=nodes * per, local_world_size=per)))[:1]
    per_node = passing(plan, ("use distributed.teacher_placement=per_node", dict(teacher_placement="per_node")))
    words = "make the tasks per node a multiple of distillation.teacher_tp"
    words = ", or ".join([f"{words} (e.g. {tasks[0]})" if tasks else words, *per_node])
    return words, tasks + per_node


def mesh_divisor(plan, key: str, size: int, n_students: int) -> tuple[str, ...]:
    """"distributed.`key`=d" for the largest divisor d of the students below `size` that the launch accepts."""
    divisors = [d for d in range(size - 1, 0, -1) if n_students % d == 0]
    return tuple(f"distributed.{key}={d}" for d in divisors if accepts(plan, {key: d}))[:1]


def mesh_launch(plan, n_students: int) -> tuple[str, ...]:
    """The launch with `n_students` students (and the plan's teachers) if it passes."""
    world = n_students + plan.n_teacher_ranks
    local = world if plan.world_size == plan.local_world_size else plan.local_world_size
    fits = world % local == 0 and accepts(plan, dict(world_size=world, local_world_size=local))  # whole nodes
    return (launch_words(world, local),) if fits else ()


def inferred_mesh(plan) -> tuple[str, ...]:
    """"distributed.<dim>=-1" for the first mesh dimension whose inference gives a launch that works."""
    return passing(plan, *[(f"distributed.{key}=-1", {key: -1}) for key in ("dp_shard", "dp_replicate")])[:1]
