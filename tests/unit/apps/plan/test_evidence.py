"""The planner's verdict states its evidence (apps/plan/evidence.py, verdict.py): a finite, measured worth; "not
measured here" with the nearest measurement and a pilot outside what was measured; no jump at one epoch; one
recommendation per plan."""

import json
import shlex
from pathlib import Path

import pytest

from apps.main.train import TrainArgs
from apps.plan.args import PlanArgs
from apps.plan.cli import training_overrides
from apps.plan.planner import Planner
from apps.plan.printing import format_plan
from apps.plan.verdict import distill_verdict, read_measurement
from lingua.args import parse_args
from tests.unit.apps.plan.test_plan import plan_of
from tests.unit.apps.plan.test_verdict import AS_STUDIED

ROOT = Path(__file__).resolve().parents[4]
WALL = json.loads((ROOT / "docs" / "kd_study" / "wall" / "results.json").read_text())
U = WALL["setup"]["unique_tokens"]
STUDENT, TEACHER = WALL["compute"]["student"]["params"], WALL["compute"]["teacher"]["params"]
LLAMA_8B_TO_1B_ON_8 = ["config=configs/llama_1B.yaml", "world_size=8", "teacher_config=configs/teachers/llama3_8b.json"]


@pytest.fixture(autouse=True)
def in_the_repository(monkeypatch):
    monkeypatch.chdir(ROOT)


def test_the_worth_is_finite_and_a_teacher_1000x_the_student_is_not_paid_back():
    at_16 = read_measurement(None, "topk", 16.0, unique=U)  # KD below every CE budget, CE walled: "beyond"
    assert at_16["bound"] == "beyond" and at_16["multiplier"] == 8.0 == at_16["best"]["multiplier"]
    assert at_16["best"]["epochs"] == 2.0  # KD at E=2 beat CE at 16 epochs, 8x its tokens: the largest measured
    expensive = distill_verdict(1000.0, 1.0, 16 * U, U, 1, "online", at_16, STUDENT, TEACHER)
    # Online needs 1001x, a cache read 16 epochs by n runs 1 + 1000 / (16 n): below 8x from 9 runs on.
    assert expensive["worth"] == 8.0 and expensive["min_cache_runs"] == 9
    assert expensive["verdict"] == "do not distill: train CE-only on more tokens (a cache would pay if shared by at " \
        "least 9 runs; you plan 1)"
    cheap = distill_verdict(5.0, 1.0, 16 * U, U, 1, "online", at_16, STUDENT, TEACHER)
    assert cheap["verdict"] == "distill online"  # 6x needed, 8x measured: the teacher is paid back


def test_outside_the_measurement_is_not_measured_here_with_the_nearest_one_and_a_pilot():
    knobs = ["distillation.output=full", "distillation.k=32", "distillation.alpha=0.9", "distillation.temperature=2.0",
             "distillation.divergence=rkl"]
    argv = AS_STUDIED + knobs + ["out=null"]
    args = parse_args(PlanArgs, argv)
    args.validate_plan()
    plan = Planner(args, "configs/distill_exps/kd_study.yaml", training_overrides(argv)).plan()  # as main makes it
    verdict = plan["verdict"]
    assert verdict["unmeasured"] == [["output", "topk", "full"], ["k", 64, 32], ["alpha", 0.5, 0.9],
                                     ["temperature", 1.0, 2.0], ["divergence", "fkl", "rkl"]]
    assert verdict["verdict"].startswith("not measured here: on the nearest measurement, do not distill")
    printed = format_plan(plan)
    reads = next(line for line in printed if line.startswith("  reads "))
    assert "kd_topk64 of docs/kd_study/results.json (this repository's one-pass study: student 7.08M" in reads
    assert "output topk, k 64, alpha 0.5, temperature 1.0, divergence fkl" in reads
    assert "  not measured here: output topk measured, full planned; k 64 measured, 32 planned; alpha 0.5 measured, " \
        "0.9 planned; temperature 1 measured, 2 planned; divergence fkl measured, rkl planned; the multiplier may " \
        "not transfer" in printed
    ce, kd, read = verdict["pilot"]
    assert [line.strip() for line in printed if line.startswith("    torchrun") and "apps.main.train" in line] == [ce, kd]
    # Then apps.plan.pilot reads both runs into the results.json the plan is rerun with.
    assert read == "python -m apps.plan.pilot ce=dumps/kd_study_pilot_ce kd=dumps/kd_study_pilot_kd " \
        "teacher_config=configs/teachers/smollm2_135m.json out=dumps/kd_study_pilot.json"
    assert printed[printed.index(f"    {read}") + 1] == "    then rerun this plan with kd_measurement=" \
        "dumps/kd_study_pilot.json"
    for command, distilled in ((ce, False), (kd, True)):  # both are training command lines the trainer parses
        argv = shlex.split(command.split(" -m apps.main.train ", 1)[1])
        args = parse_args(TrainArgs, argv)
        assert args.enable_distillation == distilled and args.distillation.k == 32 and args.distillation.alpha == 0.9
        assert args.distillation.output == "full" and args.distillation.divergence == "rkl"
    assert shlex.split(ce)[:4] == ["torchrun", "--nproc-per-node", "2", "-m"]
    # CE-only on both GPUs at KD's global batch (1 student x 8 rows = 2 ranks x 4): twice the steps, twice the tokens.
    assert "enable_distillation=false data.batch_size=4 steps=200 " in ce and " steps=100 " in kd
    assert "the pilot's CE-only run takes the same global batch" in "\n".join(printed)
    assert "distillation.n_teacher_ranks=1" in kd
    # Epochs past the wall study's 16: not measured, the nearest (E=16) read and named.
    far = plan_of(AS_STUDIED[:4] + ["tokens_per_run=245760", "unique_tokens=6144"])  # 40 epochs
    assert far["verdict"]["measured"]["epochs"] == 16.0 and ["epochs", "1-16", 40.0] in far["verdict"]["unmeasured"]
    assert far["recommendation"].startswith("pilot first")


@pytest.mark.parametrize("side", [0.999, 1.01])
def test_no_jump_at_one_epoch(side):
    """unique_tokens set reads the data-wall study at any epochs, so one epoch and just past it read the same."""
    tokens = 32 * 16384  # the study's student, teacher and settings; only the epochs move
    base = AS_STUDIED[:4] + [f"tokens_per_run={tokens}", "planned_runs=1"]
    at_1 = plan_of(base + [f"unique_tokens={tokens}"])["verdict"]
    near = plan_of(base + [f"unique_tokens={tokens / side}"])["verdict"]
    assert at_1["measured"]["source"] == near["measured"]["source"] == "docs/kd_study/wall/results.json"
    assert at_1["measured"]["why"] == "unique_tokens is set: finite data, the data-wall study at its nearest epochs"
    assert at_1["measured"]["epochs"] == near["measured"]["epochs"] == 1.0
    assert at_1["worth"] == near["worth"] == pytest.approx(1.57, abs=0.01)
    assert abs(at_1["needed_on_road"] - near["needed_on_road"]) < 0.1
    assert at_1["verdict"].split(": on the nearest measurement, ")[1] == \
        near["verdict"].split(": on the nearest measurement, ")[1]
    fresh = plan_of(base)["verdict"]  # unique_tokens=0: fresh data, the one-pass study, and it says so
    assert fresh["measured"]["source"] == "docs/kd_study/results.json"
    assert fresh["measured"]["why"] == "unique_tokens=0: every token fresh, the one-pass study"


def test_one_plan_gives_one_answer_on_its_first_line():
    # The case: the cache is the cheaper road, the nearest measurement says CE-only; one sentence says both,
    # on the first line, with the pilot's GPU-hours, and no later line says anything else.
    plan = plan_of(LLAMA_8B_TO_1B_ON_8)
    assert plan["cache"]["cheaper"] == "cache" and not plan["verdict"]["measured_here"]
    printed = format_plan(plan)
    assert printed[0] == f"answer: {plan['recommendation']}"
    assert plan["recommendation"] == (
        f"pilot first ({plan['verdict']['pilot_gpu_hours']:.3g} GPU-hours, commands below): break-even 2.47x the CE "
        f"tokens, the nearest measurement 1.18x, so do not distill unless the pilot measures more than 2.47x; to "
        f"distill: from a cache (written once with teacher_tp=1: 47.4 GPU-hours; then 32.3 a run on 8 GPUs; online "
        f"94.7 a run)")
    assert not any(line.lstrip().startswith(("recommendation:", "verdict:")) for line in printed)
    # Measured here (the one-pass study as a plan): CE-only, and why the cheaper road does not pay.
    studied = plan_of(AS_STUDIED)
    assert studied["verdict"]["measured_here"] and studied["verdict"]["pays_on"] is None
    assert studied["recommendation"].startswith("do not distill: train CE-only on all 2 GPUs (")
    assert (f"GPU-hours a run); break-even {studied['verdict']['needed_on_road']:.3g}x the CE tokens "
            f"{'from a cache' if studied['cache']['cheaper'] == 'cache' else 'online'} (the cheaper road), measured "
            f"1.18x") in studied["recommendation"]
    # Shared by enough runs, the cache pays: the recommendation is that road.
    shared = plan_of(AS_STUDIED[:-1] + ["planned_runs=40"])
    assert shared["verdict"]["pays_on"] == "cache" and shared["recommendation"].startswith(
        "distill from a cache (written once with teacher_tp=")
