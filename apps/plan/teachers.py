"""Several teachers (`distillation.teachers`): each teacher's ranks as the config gives them, its speed, memory and
forward time per request; the students wait for the slowest.

    python -m apps.plan config=configs/distill_exps/two_teachers_cpu.yaml world_size=16 \\
        teacher_configs=[configs/teachers/llama3_8b.json,configs/teachers/smollm2_135m.json] \\
        teachers_tokens_per_student_token=[1.0,1.1]

Each teacher is planned as one teacher would be (`Planner`, with its own config.json, its tokens per student token
and its measured speed), at the ranks the config gives it: every teacher receives every micro-batch of every
student, so a teacher's replicas each serve students / replicas students, and its load is its replica's time for
one request over the student's compute. The step waits for the slowest teacher (the largest load). The plan does
not move ranks between teachers; it prints, for each, the ranks it would need to keep up with these students.
It plans teachers on their own ranks (a teacher read from its cache, `teachers[i].cache_dir`, is refused in one
sentence), with no cache road and no verdict (the KD studies measured one teacher).
"""

import dataclasses
import math
from typing import Optional

from apps.plan.args import MAX_WAIT_SHARE, PLAN_VERSION, PlanArgs
from apps.plan.planner import Planner
from apps.plan.printing import count
from apps.plan.timing import Timing, max_students_per_replica
from lingua.parallel.launch_plan import LaunchPlan, TeacherLayout


def teacher_planner(args: PlanArgs, index: int, student_vocab: int = -1) -> Planner:
    """The one-teacher planner of teacher `index`: the settings it runs with (its path, ranks, tokenizer, dtype and
    teacher_tp), its config.json, ratio and speed; `student_vocab` where another teacher already gave it (-1: its own
    planner works it out)."""
    pick = lambda values, default: values[index] if values else default  # noqa: E731 (one list per key)
    return Planner(dataclasses.replace(
        args, model=dataclasses.replace(args.model, vocab_size=student_vocab),
        distillation=args.distillation.teacher_args(index), teacher_config=pick(args.teacher_configs, None),
        teacher_tokens_per_student_token=pick(args.teachers_tokens_per_student_token, 1.0),
        teacher_tokens_per_s=pick(args.teachers_tokens_per_s, 0.0)))


def plan_each_teacher(args: PlanArgs) -> list[Planner]:
    """Each teacher's planner, in order, all with the students' one vocabulary: a teacher on the students' tokenizer
    gives it (planned first), else their own tokenizer does (cross_tokenizer, apps/plan/tokenizers.py)."""
    teachers = args.distillation.teachers
    planners, vocab = {}, args.model.vocab_size
    for i in sorted(range(len(teachers)), key=lambda i: teachers[i].cross_tokenizer):
        planners[i] = teacher_planner(args, i, vocab)
        vocab = planners[i].args.model.vocab_size
    return [planners[i] for i in range(len(teachers))]


def plan_teachers(args: PlanArgs, config_path: Optional[str] = None, overrides: tuple[str, ...] = ()) -> dict:
    """The JSON-able plan of several teachers at their configured ranks (module docstring)."""
    teachers, kd, world = args.distillation.teachers, args.distillation, args.world_size
    planners = plan_each_teacher(args)
    tps = [planner.args.distillation.teacher_tp for planner in planners]
    students = world - sum(t.n_teacher_ranks for t in teachers)
    rows = []
    for i, (teacher, planner, tp) in enumerate(zip(teachers, planners, tps)):
        replicas = teacher.n_teacher_ranks // tp
        per_bridge = -(-max(students, 0) // replicas)  # the busiest replica's students
        speeds = planner.speeds
        load = per_bridge * speeds.teacher_gpus_per_student_gpu / tp
        micro_batch_s = args.data.batch_size * args.data.seq_len / speeds.student  # a student's compute, C
        memory = planner.memory(tp, max(per_bridge, 1))
        others = sum(t.n_teacher_ranks for t in teachers) - teacher.n_teacher_ranks
        rows.append({
            "index": i, "path": teacher.path, "config": planner.shape.path, "parameters": planner.shape.parameters(),
            "n_teacher_ranks": teacher.n_teacher_ranks, "teacher_tp": tp, "replicas": replicas,
            "students_per_bridge": per_bridge,
            "teacher_tokens_per_student_token": planner.args.teacher_tokens_per_student_token,
            "teacher_tokens_per_s_per_gpu": round(speeds.teacher, 1), "speed_source": speeds.source,
            "forward_s_per_request": load * micro_batch_s, "load": round(load, 4),
            "memory_gib": memory.gib(), "fits": memory.total <= planner.usable_bytes(),
            "ranks_to_keep_up": ranks_to_keep_up(world - others, tp, max_students_per_replica(tp, speeds, kd.prefetch)),
        })
    slowest = max(rows, key=lambda row: row["load"])
    timing = Timing.of(slowest["load"], kd.prefetch)
    online = {"students": students, "slowest": slowest["index"], "wait_share": round(timing.wait_share, 4),
              "keeps_up": timing.wait_share <= MAX_WAIT_SHARE and all(row["fits"] for row in rows),
              "student_tokens_per_s": round(max(students, 0) * planners[0].speeds.student / (1 + timing.wait))}
    try:
        distributed = dataclasses.replace(args.distributed, teacher_placement="last")
        layouts = tuple(TeacherLayout(t.n_teacher_ranks, tp, t.path or "") for t, tp in zip(teachers, tps))
        plan = LaunchPlan.for_launch(distributed, world, min(args.gpus_per_node, world), layouts)
        lines = plan.describe()
        online["launch_plan"] = lines[:6] + ([f"... {len(lines) - 6} more line(s)"] if len(lines) > 6 else [])
    except ValueError as err:  # the trainer would refuse this launch: its sentence
        online["keeps_up"], online["refusal"] = False, str(err)
    return {"version": PLAN_VERSION, "several_teachers": True,
            "inputs": {"config": config_path, "overrides": list(overrides), "world_size": world,
                       "gpus_per_node": args.gpus_per_node, "gpu_mem_gib": args.gpu_mem_gib,
                       "batch_size": args.data.batch_size, "seq_len": args.data.seq_len, "prefetch": kd.prefetch},
            "student": {"parameters": planners[0].student_params, "vocab": planners[0].args.model.vocab_size},
            "teachers": rows, "online": online, "recommendation": recommendation(rows, online)}


def ranks_to_keep_up(ranks: int, tp: int, most_per_replica: float) -> Optional[int]:
    """The fewest ranks (a multiple of tp) of a teacher sharing `ranks` with the students such that each of its
    replicas serves at most `most_per_replica` of the students left; None where no split of them does."""
    for n in range(tp, ranks, tp):
        if math.ceil((ranks - n) / (n // tp)) <= most_per_replica:
            return n
    return None


def teacher_name(row: dict) -> str:
    return f"teacher {row['index']} ({row['path']})"


def recommendation(rows: list[dict], online: dict) -> str:
    """One sentence: the launch as configured, or what to change first (the trainer's refusal, memory, the slowest)."""
    if "refusal" in online:
        return f"change the teachers' ranks: the launch plan refuses them: {online['refusal']}"
    tight = [row for row in rows if not row["fits"]]
    if tight:
        return (f"{teacher_name(tight[0])} does not fit a GPU at teacher_tp={tight[0]['teacher_tp']}; raise its "
                f"teacher_tp (teachers[{tight[0]['index']}].teacher_tp) or lower data.batch_size")
    slowest = rows[online["slowest"]]
    if online["keeps_up"]:
        return f"distill online as configured; the slowest is {teacher_name(slowest)}"
    if slowest["ranks_to_keep_up"] is None:
        return (f"fewer students or a faster {teacher_name(slowest)}: no split of this world keeps up with it, and "
                f"the students wait {online['wait_share']:.0%} of each step for it")
    return (f"give {teacher_name(slowest)} {slowest['ranks_to_keep_up']} ranks (it has {slowest['n_teacher_ranks']}): "
            f"the students wait {online['wait_share']:.0%} of each step for it")


def milliseconds(seconds: float) -> str:
    return f"{seconds * 1e3:,.0f} ms" if seconds >= 0.1 else f"{seconds * 1e3:.3g} ms"


def format_teachers_plan(plan: dict) -> list[str]:
    """The printed plan of several teachers, one block per teacher, each named."""
    inputs, online = plan["inputs"], plan["online"]
    lines = [f"answer: {plan['recommendation']}",
             f"several teachers: {len(plan['teachers'])} on {inputs['world_size'] - online['students']} ranks, "
             f"{online['students']} students; every teacher receives every micro-batch, the students wait for the "
             f"slowest"]
    for row in plan["teachers"]:
        ratio = row["teacher_tokens_per_student_token"]
        lines += [f"  {teacher_name(row)}: {count(row['parameters'])} parameters, {row['n_teacher_ranks']} rank(s) in "
                  f"{row['replicas']} replica(s) of teacher_tp={row['teacher_tp']}, {row['students_per_bridge']} "
                  f"student(s) per bridge",
                  f"    {ratio:g} teacher token(s) per student token; {row['speed_source']}; forward "
                  f"{milliseconds(row['forward_s_per_request'])} per request, {row['load']:.2f} of a student's "
                  f"compute; {row['memory_gib']['total']:.3g} GiB per rank"
                  + ("" if row["fits"] else " (does not fit)")
                  + (f"; keeps up with {row['ranks_to_keep_up']} rank(s)" if row["ranks_to_keep_up"] else
                     "; no split of this world keeps up")]
    slowest = plan["teachers"][online["slowest"]]
    lines.append(f"slowest: {teacher_name(slowest)}; the students wait {online['wait_share']:.1%} of each step, "
                 f"{count(online['student_tokens_per_s'])} student tokens/s")
    if "refusal" in online:
        lines.append(f"the launch plan refuses this layout: {online['refusal']}")
    else:
        lines += ["launch plan:"] + [f"  {line}" for line in online["launch_plan"]]
    lines += ["no cache road and no verdict: these teachers run on their own ranks, and the KD studies measured one "
              "teacher"]
    return lines
