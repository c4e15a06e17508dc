"""Every launch a refusal suggests passes: each layout of a small grid (world sizes on one node or several, teacher
ranks, tensor parallelism, two teachers, meshes, placements) that the plan refuses is one sentence, and each change
the sentence suggests, read back from its own words as a user would type it, is a launch the plan accepts."""

import dataclasses
import itertools
import json
import re

from apps.main.train import TrainArgs
from lingua.args import parse_args
from lingua.errors import LaunchError
from lingua.parallel.launch_fixes import LayoutError
from lingua.parallel.launch_plan import LaunchPlan, TeacherLayout
from tests.runs import distill_overrides

T = TeacherLayout
LAUNCHES = [(world, world) for world in range(1, 10)] + [(nodes * per, per) for per in (2, 3, 4) for nodes in (2, 3)]
TEACHERS = [(), (T(1),), (T(2),), (T(3),), (T(2, 2),), (T(3, 2),), (T(4, 2),), (T(1), T(1)), (T(2), T(1)),
            (T(2, 2), T(1)), (T(1), T(3))]
MESHES = [(1, -1), (2, -1), (-1, 2), (2, 2), (1, 3)]
PLACEMENTS = ("last", "per_node")
LAUNCH = re.compile(r"torchrun(?: --nnodes \d+)? --nproc-per-node \d+")
SETTING = re.compile(r"(?:set|use|e\.g\.|or) ((?:distributed|distillation)\.[\w.\[\]]+=[\w-]+"
                     r"|enable_distillation=false)")


def applied(fields: dict, fix: str) -> dict:
    """The plan's fields changed as the words `fix` say: a launch, a setting, or "<setting> with <launch>"."""
    if " with " in fix:
        setting, launch = fix.split(" with ")
        return applied(applied(fields, setting), launch)
    changed = dict(fields)
    if launch := re.fullmatch(r"torchrun (?:--nnodes (\d+) )?--nproc-per-node (\d+)", fix):
        nodes, per_node = int(launch[1] or 1), int(launch[2])
        return {**changed, "world_size": nodes * per_node, "local_world_size": per_node}
    key, value = fix.removeprefix("set ").removeprefix("use ").split("=")
    teachers = list(fields["teachers"])
    if key == "enable_distillation" and value == "false":
        changed["teachers"] = ()
    elif key == "distributed.teacher_placement":
        changed["teacher_placement"] = value
    elif key in ("distributed.dp_shard", "distributed.dp_replicate"):
        changed[key.removeprefix("distributed.")] = int(value)
    elif key == "distillation.n_teacher_ranks" and len(teachers) == 1:
        changed["teachers"] = (dataclasses.replace(teachers[0], ranks=int(value)),)
    elif listed := re.fullmatch(r"distillation\.teachers\[(\d+)\]\.n_teacher_ranks", key):
        teachers[int(listed[1])] = dataclasses.replace(teachers[int(listed[1])], ranks=int(value))
        changed["teachers"] = tuple(teachers)
    else:
        raise AssertionError(f"a suggestion this test cannot apply: {fix!r}")
    return changed


def refusals():
    for (world, local), teachers, (replicate, shard), placement in itertools.product(LAUNCHES, TEACHERS, MESHES,
                                                                                     PLACEMENTS):
        fields = dict(world_size=world, local_world_size=local, teachers=teachers, teacher_placement=placement,
                      dp_replicate=replicate, dp_shard=shard)
        try:
            LaunchPlan(**fields)
        except LaunchError as err:
            yield fields, err


def test_every_launch_a_refusal_suggests_passes():
    refused, suggested, fixed, kinds = 0, 0, 0, set()
    for fields, err in refusals():
        sentence = str(err)
        assert isinstance(err, LayoutError) and "\n" not in sentence and sentence.endswith("."), sentence
        refused, fixed = refused + 1, fixed + bool(err.fixes)
        for fix in err.fixes:
            assert fix in sentence, (fix, sentence)
            LaunchPlan(**applied(fields, fix))  # a suggestion the plan refuses raises here, naming itself
            suggested += 1
            kinds.add(fix.split()[0] if fix.startswith("torchrun") else fix.split("=")[0].split()[-1])
        # Nothing the sentence tells the user to launch or set goes untried.
        for named in LAUNCH.findall(sentence) + SETTING.findall(sentence):
            assert any(named in fix for fix in err.fixes), (named, sentence)
    # Most refusals name a change; the rest (a fixed mesh against the teachers' split, two settings at odds) keep
    # their advice in words, with no launch the plan would refuse.
    assert refused > 1000 and fixed > refused * 2 // 3 and suggested > 1000, (refused, fixed, suggested)
    assert kinds >= {"torchrun", "enable_distillation", "distributed.teacher_placement", "distributed.dp_shard",
                     "distillation.n_teacher_ranks", "distillation.teachers[0].n_teacher_ranks"}, kinds


def test_two_ranks_for_two_teacher_ranks_suggests_a_launch_that_works():
    """The launch of the report: 2 processes, distillation.n_teacher_ranks=2. The suggestion once was 3 ranks, which
    then failed ("1 student ranks cannot be split evenly among 2 teachers"); now it is a launch that passes."""
    try:
        LaunchPlan(2, 2, (TeacherLayout(2),))
    except LayoutError as err:
        assert str(err) == ("Distillation needs at least one student rank besides 2 teacher rank(s), but the job has "
                            "2 rank(s). Launch more ranks (e.g. torchrun --nproc-per-node 4) or set "
                            "enable_distillation=false.")
    plan = LaunchPlan(4, 4, (TeacherLayout(2),))
    assert plan.student_ranks == [0, 1] and plan.bridges() == [(2, [0]), (3, [1])]


def test_the_trainers_refusal_suggests_a_launch_its_validation_accepts(tmp_path):
    """Through the trainer's own validation (TrainArgs.validate at the launch's world size), as torchrun runs it."""
    corpus, teacher = tmp_path / "corpus" / "text", tmp_path / "teacher"
    corpus.mkdir(parents=True)
    (corpus / "text.chunk.0.jsonl").write_text('{"text": "a"}\n')
    teacher.mkdir()
    (teacher / "config.json").write_text(json.dumps({"max_position_embeddings": 4096, "num_attention_heads": 4,
                                                     "num_key_value_heads": 2}))
    overrides = distill_overrides(tmp_path / "corpus", teacher, tmp_path / "dump") + ["distillation.n_teacher_ranks=2"]
    args = parse_args(TrainArgs, overrides)
    try:
        args.validate(world_size=2)
        raise AssertionError("2 ranks for 2 teacher ranks validated")
    except LayoutError as err:
        (launch,) = [fix for fix in err.fixes if fix.startswith("torchrun")]
    world = int(launch.split()[-1])
    parse_args(TrainArgs, overrides).validate(world_size=world)
    assert world == 4
