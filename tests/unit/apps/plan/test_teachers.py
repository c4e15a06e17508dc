"""apps.plan with several teachers (`distillation.teachers`, apps/plan/teachers.py): each teacher planned at its
configured ranks with its own config, tokens per student token and speed; the students wait for the slowest; the
printed plan names each teacher; the per-teacher keys' refusals."""

import json
from pathlib import Path

import pytest

from apps.plan.args import PlanArgs
from apps.plan.cli import main
from apps.plan.teachers import plan_teachers, ranks_to_keep_up, teacher_planner
from apps.plan.timing import Timing
from lingua.args import parse_args
from lingua.errors import ConfigError

ROOT = Path(__file__).resolve().parents[4]


@pytest.fixture
def teacher_dirs(tmp_path) -> tuple[str, str]:
    """Two teacher directories holding only a config.json (the planner reads nothing else): SmolLM2 and Llama 3 8B."""
    dirs = []
    for name, config in (("small", "smollm2_135m.json"), ("big", "llama3_8b.json")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text((ROOT / "configs" / "teachers" / config).read_text())
        dirs.append(str(tmp_path / name))
    return tuple(dirs)


def argv_of(teacher_dirs, ranks=(1, 1), cross=(False, False), world=8, *extra) -> list[str]:
    teachers = ", ".join(f"{{path: {path}, n_teacher_ranks: {n}, cross_tokenizer: {str(c).lower()}}}"
                         for path, n, c in zip(teacher_dirs, ranks, cross))
    return [f"config={ROOT}/configs/distill_exps/debug.yaml", f"world_size={world}", "out=null",
            "enable_distillation=true", "distillation.teacher_path=null", f"distillation.teachers=[{teachers}]", *extra]


def args_of(argv: list[str]) -> PlanArgs:
    args = parse_args(PlanArgs, argv)
    args.validate_plan()
    return args


def test_each_teacher_is_planned_as_one_and_the_students_wait_for_the_slowest(teacher_dirs):
    """Measured speeds make the loads exact: a teacher's load is its replica's students times the student's speed
    over its own, over teacher_tp; the step's wait is the slowest teacher's; a cross-tokenizer teacher's ratio
    divides its measured speed in student tokens."""
    argv = argv_of(teacher_dirs, (1, 2), (False, True), 8, "student_tokens_per_s=1000",
                   "teachers_tokens_per_s=[20000,4000]", "teachers_tokens_per_student_token=[1.0,2.0]")
    args = args_of(argv)
    plan = plan_teachers(args)
    small, big = plan["teachers"]
    assert plan["online"]["students"] == 5 and (small["replicas"], big["replicas"]) == (1, 2)
    assert small["load"] == pytest.approx(5 * 1000 / 20000) and big["load"] == pytest.approx(3 * 1000 / (4000 / 2))
    assert big["teacher_tokens_per_s_per_gpu"] == 2000 and big["teacher_tokens_per_student_token"] == 2.0
    assert plan["online"]["slowest"] == 1
    assert plan["online"]["wait_share"] == pytest.approx(Timing.of(1.5, args.distillation.prefetch).wait_share, abs=1e-4)
    seconds_per_micro_batch = args.data.batch_size * args.data.seq_len / 1000
    assert big["forward_s_per_request"] == pytest.approx(1.5 * seconds_per_micro_batch)
    # The same teacher alone: its one-teacher planner gives the same speed and parameters.
    alone = teacher_planner(args, 1, plan_teachers(args)["student"]["vocab"])  # the students' vocabulary, as planned
    assert alone.speeds.teacher == pytest.approx(2000) and alone.shape.parameters() == big["parameters"]
    assert big["memory_gib"] == alone.memory(1, 3).gib()


def test_a_layout_that_keeps_up_and_one_that_does_not(teacher_dirs):
    fast = plan_teachers(args_of(argv_of(teacher_dirs, (1, 1), (False, False), 8, "student_tokens_per_s=1000",
                                         "teachers_tokens_per_s=[20000,10000]")))
    assert fast["online"]["keeps_up"] and fast["online"]["wait_share"] == 0
    assert fast["recommendation"] == f"distill online as configured; the slowest is teacher 1 ({teacher_dirs[1]})"
    assert fast["online"]["launch_plan"]
    slow = plan_teachers(args_of(argv_of(teacher_dirs, (1, 1), (False, False), 8, "student_tokens_per_s=1000",
                                         "teachers_tokens_per_s=[2000,10000]")))
    assert not slow["online"]["keeps_up"] and slow["online"]["slowest"] == 0
    # Teacher 0 needs 0.5 GPU per student GPU: at 3 ranks its replicas serve 2 of the 4 students left each.
    assert slow["teachers"][0]["ranks_to_keep_up"] == 3 and slow["teachers"][1]["ranks_to_keep_up"] == 1
    assert slow["recommendation"].startswith(f"give teacher 0 ({teacher_dirs[0]}) 3 ranks (it has 1): the students "
                                             f"wait 67% of each step")


def test_ranks_to_keep_up():
    assert ranks_to_keep_up(7, 1, 2.1) == 3  # 3 replicas for the 4 students left
    assert ranks_to_keep_up(8, 2, 1.0) == 6  # 2 replicas of 2 ranks serve 2 of 4 students each; 3 serve 1 of 2
    assert ranks_to_keep_up(4, 1, 0.5) is None  # fewer than one student per replica: no split keeps up


def test_a_launch_the_trainer_refuses_is_its_sentence(teacher_dirs):
    plan = plan_teachers(args_of(argv_of(teacher_dirs, (2, 1), (False, False), 8)))
    assert "5 student ranks cannot be split evenly among teacher 0's 2 replica(s)" in plan["online"]["refusal"]
    assert plan["recommendation"].startswith("change the teachers' ranks: the launch plan refuses them: ")


def test_the_printed_plan_names_each_teacher(teacher_dirs, tmp_path, capsys):
    out = tmp_path / "plan.json"
    plan = main(argv_of(teacher_dirs, (1, 1), (False, True), 8, "teachers_tokens_per_student_token=[1,1.12]")[:-1]
                + [f"out={out}", "teachers_tokens_per_student_token=[1,1.12]"])
    printed = capsys.readouterr().out
    for row in plan["teachers"]:
        assert f"teacher {row['index']} ({row['path']})" in printed
    assert "1.12 teacher token(s) per student token" in printed and "slowest: teacher " in printed
    assert json.loads(out.read_text())["teachers"][1]["teacher_tokens_per_student_token"] == 1.12


@pytest.mark.parametrize("extra,words", [
    (["teacher_configs=[a.json]"], "teacher_configs=['a.json']; give one value per teacher of distillation.teachers (2)"),
    (["teachers_tokens_per_student_token=[1.0,1.3]"], "teachers_tokens_per_student_token[1]=1.3; use the measured "
                                                      "ratio of a cross-tokenizer teacher"),
    (["teacher_config=x.json"], "teacher_config='x.json'; with distillation.teachers give one value per teacher in "
                                "teacher_configs"),
    (["teacher_tokens_per_student_token=1.2"], "with distillation.teachers give one ratio per teacher in "
                                               "teachers_tokens_per_student_token"),
])
def test_the_per_teacher_keys_are_refused_in_one_sentence(teacher_dirs, extra, words):
    with pytest.raises(ConfigError) as caught:
        args_of(argv_of(teacher_dirs, (1, 1), (False, False), 8, *extra))
    assert words in str(caught.value) and "\n" not in str(caught.value)


def test_a_teacher_from_its_cache_and_a_teacher_of_its_own_tp(teacher_dirs):
    """A teacher read from its cache has no ranks to plan: one sentence. A teacher's own teacher_tp sizes its
    replicas (and its memory per rank) while the other keeps the shared one."""
    with pytest.raises(ConfigError, match=r"^distillation\.teachers\[1\]\.cache_dir='/c'; apps\.plan plans teachers "):
        args_of(argv_of(teacher_dirs, (1, 1), (False, False), 8)[:-1]
                + [f"distillation.teachers=[{{path: {teacher_dirs[0]}}}, {{cache_dir: /c}}]"])
    argv = argv_of(teacher_dirs, (1, 2), (False, False), 8)[:-1] + [
        f"distillation.teachers=[{{path: {teacher_dirs[0]}}}, {{path: {teacher_dirs[1]}, n_teacher_ranks: 2, "
        f"teacher_tp: 2}}]"]
    plan = plan_teachers(args_of(argv))
    small, big = plan["teachers"]
    assert (small["teacher_tp"], small["replicas"]) == (1, 1) and (big["teacher_tp"], big["replicas"]) == (2, 1)
    assert big["memory_gib"] == teacher_planner(args_of(argv), 1).memory(2, 5).gib()
    assert "launch_plan" in plan["online"], plan["online"]


def test_the_per_teacher_keys_need_several_teachers():
    with pytest.raises(ConfigError, match=r"^teachers_tokens_per_s=\[1000\.0\]; it is for several teachers"):
        args_of([f"config={ROOT}/configs/distill_exps/debug.yaml", "world_size=8", "out=null",
                 "teachers_tokens_per_s=[1000]"])


def test_the_docs_show_the_several_teachers_plan(monkeypatch, capsys):
    """docs/planner_examples.md's several-teachers example prints what the planner prints."""
    import re
    import shlex

    monkeypatch.chdir(ROOT)
    text = (ROOT / "docs" / "planner_examples.md").read_text()
    (block,) = re.findall(r"```text\n\$ (python -m apps\.plan .*?)```", text, re.S)
    command, printed = block.split("\n", 1)
    main(shlex.split(command)[3:])
    assert capsys.readouterr().out == printed


@pytest.mark.parametrize("own,words", [
    ("teacher_tp: 2", "distillation.teachers[1].n_teacher_ranks=1; use a positive multiple of "
                      "distillation.teachers[1].teacher_tp=2"),
    ("teacher_tp: 0", "distillation.teachers[1].teacher_tp=0; use 1 (one rank per replica)"),
    ("teacher_dtype: fp8", "distillation.teachers[1].teacher_dtype='fp8'; use one of"),
])
def test_a_teachers_own_layout_is_checked_before_it_is_planned(teacher_dirs, own, words):
    """The planner validates the distillation keys without their launch (validate(enabled=False)); a teacher's own
    teacher_tp that does not divide its ranks is its sentence there too, not a division by zero."""
    argv = argv_of(teacher_dirs, (1, 1), (False, False), 8)[:-1] + [
        f"distillation.teachers=[{{path: {teacher_dirs[0]}}}, {{path: {teacher_dirs[1]}, {own}}}]"]
    with pytest.raises(ConfigError) as caught:
        args_of(argv)
    assert str(caught.value).startswith(words), str(caught.value)
