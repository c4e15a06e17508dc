"""LaunchPlan at cluster scale: set/dict lookups instead of list scans, the same answers as the scans gave."""

import itertools
import time

import pytest

from lingua.parallel.launch_plan import LaunchPlan, TeacherLayout


def scanned_role_and_bridge(plan: LaunchPlan, rank: int) -> tuple[str, int]:
    """What role() and bridge_index() answered before their lookups were cached: a scan of the lists."""
    role = "teacher" if rank in plan.teacher_ranks else "student"
    for i, (ranks, students) in enumerate(plan.replicas()):
        if rank in ranks or rank in students:
            return role, i
    return role, -1


def valid_plans():
    """Every plan that constructs over small launches: placements, node sizes, teacher counts, replica sizes."""
    for world, local, n_teachers, placement, tp in itertools.product(
            (4, 8, 12, 16), (1, 2, 4, 8), (0, 1, 2, 4, 8), ("last", "per_node"), (1, 2, 4)):
        if world % local:
            continue
        try:
            yield LaunchPlan(world, local, (TeacherLayout(n_teachers, tp),) if n_teachers else (), placement)
        except ValueError:
            continue


def test_cached_lookups_answer_what_the_scans_answered():
    plans = list(valid_plans())
    assert len(plans) > 50  # the product above is not all refusals
    for plan in plans:
        for rank in range(plan.world_size):
            assert (plan.role(rank), plan.bridge_index(rank)) == scanned_role_and_bridge(plan, rank), (plan, rank)


def cpu_seconds_for_every_rank(world: int) -> float:
    """CPU time to build a half-teacher plan of TP-4 replicas and ask every rank its role and bridge (best of 3)."""
    best = float("inf")
    for _ in range(3):
        start = time.process_time()
        plan = LaunchPlan(world, 8, (TeacherLayout(world // 2, 4),), "last")
        for rank in range(world):
            plan.role(rank), plan.bridge_index(rank)
        plan.bridges(), plan.mesh_grid()
        best = min(best, time.process_time() - start)
    return best


def test_a_16k_rank_plan_costs_linear_not_quadratic_time():
    """16x the ranks: linear work costs ~16x, the old per-rank scans ~256x. The bound is CPU time (not wall time,
    which other processes on the machine inflate), relative to the same work at 1,024 ranks, and 4x above linear."""
    small, large = cpu_seconds_for_every_rank(1024), cpu_seconds_for_every_rank(16384)
    assert large < 64 * max(small, 1e-4), (small, large)


@pytest.mark.parametrize("world", [1024, 16384])
@pytest.mark.parametrize("placement, tp", [("last", 4), ("last", 8), ("per_node", 2), ("per_node", 1)])
def test_replicas_stay_inside_nodes_at_scale(world, placement, tp):
    nodes = world // 8
    n_teachers = nodes * tp if placement == "per_node" else world // 2
    plan = LaunchPlan(world, 8, (TeacherLayout(n_teachers, tp),) if n_teachers else (), placement)
    replicas = plan.replicas()
    assert len(replicas) == n_teachers // tp
    assert all(len({rank // 8 for rank in ranks}) == 1 for ranks, _ in replicas)
    assert sorted(r for ranks, students in replicas for r in ranks + students) == list(range(world))
    if placement == "per_node":  # a replica and its students share their node: the bridge never leaves it
        assert all({rank // 8 for rank in ranks + students} == {ranks[0] // 8} for ranks, students in replicas)
