"""`python -m apps.plan.pilot` (apps/plan/pilot.py): the planner's two pilot runs, read from synthetic dump dirs,
give kd_study's token multiplier (a value, or a bound) as a results.json the verdict reads; bad input is one
sentence; and the plan that printed the pilot is then measured here."""

import json
import math
import shlex
import shutil
from pathlib import Path

import pytest

from apps.main.train import TrainArgs
from apps.plan.pilot import main as pilot_main
from apps.plan.printing import verdict_lines
from lingua.args import dump_config, parse_args
from lingua.cli.entry import run_cli
from tests.unit.apps.plan.test_plan import EXAMPLES, SMOLLM2, plan_of

ROOT = Path(__file__).resolve().parents[4]
CONFIG = EXAMPLES["smollm2"][0].split("=", 1)[1]  # the smollm2 example's config: batch 8 x 1024 tokens per micro-batch
PER_GPU = 8 * 1024


@pytest.fixture(autouse=True)
def in_the_repository(monkeypatch):
    monkeypatch.chdir(ROOT)


@pytest.fixture
def teacher_dir(tmp_path) -> Path:
    """A teacher checkpoint directory holding only its config.json (SmolLM2-135M's), as the KD run names it."""
    path = tmp_path / "teacher"
    path.mkdir()
    shutil.copy(ROOT / SMOLLM2, path / "config.json")
    return path


def fake_run(dump_dir: Path, overrides: list[str], tokens_per_step: int, heldout: dict[int, float]) -> Path:
    """A dump dir as apps.main.train leaves it: config.yaml, training rows (cumulative tokens over the students)
    and in-loop held-out rows in metrics.jsonl."""
    args = parse_args(TrainArgs, [f"config={CONFIG}", *overrides, f"dump_dir={dump_dir}"])
    dump_config(args, dump_dir / "config.yaml")
    rows = [{"step": step, "tokens": step * tokens_per_step, "loss/ce": 9.0} for step in range(10, args.steps + 1, 10)]
    rows += [{"step": step, "eval/loss": value} for step, value in heldout.items()]
    (dump_dir / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return dump_dir


def ce_curve(steps: int = 100, every: int = 5) -> dict[int, float]:
    """A CE-only curve that falls by 0.01 nat a step: 3.95 at step 5 ... 3.0 at step 100."""
    return {step: 4.0 - 0.01 * step for step in range(every, steps + 1, every)}


def pilots(tmp_path: Path, teacher_dir: Path, kd_final: float, ce_overrides=(), kd_students: int = 4) -> list[str]:
    """The CE pilot (8 GPUs, 100 steps) and a KD pilot (kd_students students, 100 steps) ending at kd_final."""
    ce = fake_run(tmp_path / "ce", ["enable_distillation=false", "steps=100", "heldout.every=5", *ce_overrides],
                  8 * PER_GPU, ce_curve())
    kd = fake_run(tmp_path / "kd", ["enable_distillation=true", f"distillation.teacher_path={teacher_dir}",
                                    "steps=100", "heldout.every=100"], kd_students * PER_GPU, {100: kd_final})
    return [f"ce={ce}", f"kd={kd}", f"out={tmp_path / 'pilot.json'}"]


def test_the_multiplier_is_read_on_the_ce_curve_as_by_hand(tmp_path, teacher_dir, capsys):
    results = pilot_main(pilots(tmp_path, teacher_dir, kd_final=3.32))
    # KD: 100 steps x 4 students x 8k tokens = 3.28M. CE's eval at step s has s x 8 x 8k tokens = s/50 of KD's.
    # 3.32 lies between step 65 (1.3x, 3.35) and step 70 (1.4x, 3.30): 60% of the way, in log-tokens.
    by_hand = math.exp(math.log(1.3) + 0.6 * (math.log(1.4) - math.log(1.3)))
    arm = results["arms"]["kd_topk64"]
    assert arm["tokens"] == 100 * 4 * PER_GPU and results["setup"]["tokens_per_run"] == 100 * 4 * PER_GPU
    assert arm["token_multiplier"]["mean"] == pytest.approx(by_hand)
    assert arm["token_multiplier"]["per_seed"]["42"]["between"] == pytest.approx([1.3, 1.4])
    assert arm["ce_tokens_equivalent"] == pytest.approx(by_hand * 100 * 4 * PER_GPU)
    ce_arm = results["arms"]["ce"]
    assert ce_arm["tokens"] == 100 * 8 * PER_GPU and len(ce_arm["seeds"]["42"]["heldout"]) == 20
    # The sizes as the planner counts them: SmolLM2-135M, and the debug student at the teacher's vocabulary.
    assert results["compute"]["teacher"]["params"] == 134_515_008
    assert results["compute"]["student"]["params"] == 73_933_312
    written = json.loads((tmp_path / "pilot.json").read_text())
    assert written["mode"] == "pilot"
    assert written["arms"]["kd_topk64"]["token_multiplier"]["mean"] == pytest.approx(by_hand)
    assert f"CE-only reaches it at {by_hand:.3g}x the tokens" in capsys.readouterr().out


@pytest.mark.parametrize("kd_final, bound", [(2.5, {"value": None, "at_least": 2.0}),  # below CE's last eval (2x)
                                             (4.5, {"value": None, "at_most": 0.1})])  # above its first (0.1x)
def test_a_ce_curve_that_never_reaches_kd_gives_a_bound(kd_final, bound, tmp_path, teacher_dir):
    arm = pilot_main(pilots(tmp_path, teacher_dir, kd_final))["arms"]["kd_topk64"]
    assert arm["token_multiplier"]["mean"] is None and arm["token_multiplier"]["per_seed"] == {"42": bound}


def refusal(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exit_:
        run_cli(lambda: pilot_main(argv))
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1 and err.startswith("error: ")
    return err.strip()


def test_bad_input_is_one_sentence(tmp_path, teacher_dir, capsys):
    argv = pilots(tmp_path, teacher_dir, kd_final=3.32)
    assert refusal([f"ce={tmp_path / 'nowhere'}", *argv[1:]], capsys) == \
        f"error: ce={tmp_path / 'nowhere'} does not exist; pass the dump_dir of the planner's CE pilot run."
    assert refusal(argv[:1], capsys) == \
        "error: kd= is missing; pass the dump_dir of the planner's KD pilot run (python -m apps.plan prints both)."
    kd_as_ce = argv[1].replace("kd=", "ce=", 1)
    assert refusal([kd_as_ce, *argv[1:]], capsys) == \
        f"error: {kd_as_ce} distilled (enable_distillation=true); pass the CE-only pilot's dump_dir."

    # No held-out CE logged: the training rows only.
    metrics = tmp_path / "ce" / "metrics.jsonl"
    kept = metrics.read_text()
    metrics.write_text("".join(line + "\n" for line in kept.splitlines() if "eval/loss" not in line))
    assert refusal(argv, capsys) == (
        f"error: ce={tmp_path / 'ce'} logged no held-out CE (no eval/loss rows in metrics.jsonl, no heldout rows in "
        f"metrics.validation.jsonl); rerun it with heldout.every=<steps> as the plan prints.")
    metrics.write_text(kept)

    # Runs of different configs.
    other = tmp_path / "other"
    other.mkdir()
    argv = pilots(other, teacher_dir, kd_final=3.32, ce_overrides=["model.dim=256"])
    assert refusal(argv, capsys) == (
        "error: ce= and kd= were trained with different configs (model.dim: 256 vs 512); run both pilots from the "
        "plan's config as it prints them.")

    other = tmp_path / "numerics"
    other.mkdir()
    argv = pilots(other, teacher_dir, kd_final=3.32, ce_overrides=["distributed.model_dtype=fp32"])
    assert refusal(argv, capsys).startswith("error: ce= and kd= were trained with different configs "
                                            "(distributed.model_dtype: 'fp32' vs 'bf16')")

    # A file that is not a pilot's results is never replaced.
    (tmp_path / "notes.json").write_text("{}")
    argv = [f"ce={tmp_path / 'ce'}", f"kd={tmp_path / 'kd'}", f"out={tmp_path / 'notes.json'}"]
    assert refusal(argv, capsys) == \
        f"error: out={tmp_path / 'notes.json'} exists and is not a pilot's results.json; name another file."
    assert (tmp_path / "notes.json").read_text() == "{}"


def test_the_plan_that_printed_the_pilot_is_measured_by_it(tmp_path, teacher_dir):
    before = plan_of(EXAMPLES["smollm2"])
    assert not before["verdict"]["measured_here"]
    ce_command, kd_command, read_command = before["verdict"]["pilot"]
    assert read_command == "python -m apps.plan.pilot ce=dumps/distill_debug_pilot_ce " \
        "kd=dumps/distill_debug_pilot_kd teacher_config=configs/teachers/smollm2_135m.json " \
        "out=dumps/distill_debug_pilot.json"
    # The two runs exactly as the plan prints them (their dump dirs here), the KD run's teacher a local directory.
    ce_args = [a for a in shlex.split(ce_command) if "=" in a and a.split("=")[0] not in ("config", "dump_dir")]
    kd_args = [a for a in shlex.split(kd_command) if "=" in a and a.split("=")[0] not in ("config", "dump_dir")]
    students = before["online"]["students"]
    ce_steps = int(next(a for a in ce_args if a.startswith("steps=")).split("=")[1])
    kd_steps = int(next(a for a in kd_args if a.startswith("steps=")).split("=")[1])
    every = int(next(a for a in ce_args if a.startswith("heldout.every=")).split("=")[1])
    assert "data.batch_size=4" in ce_args  # KD's global batch (4 students x 8 rows) on the 8 GPUs: 4 rows each
    ce = fake_run(tmp_path / "ce", ce_args, students * PER_GPU,
                  {step: 4.0 - step / ce_steps for step in range(every, ce_steps + 1, every)})
    kd = fake_run(tmp_path / "kd", [*kd_args, f"distillation.teacher_path={teacher_dir}"], students * PER_GPU,
                  {kd_steps: 3.3})
    pilot_main([f"ce={ce}", f"kd={kd}", f"out={tmp_path / 'pilot.json'}"])

    after = plan_of(EXAMPLES["smollm2"] + [f"kd_measurement={tmp_path / 'pilot.json'}"])
    verdict = after["verdict"]
    assert verdict["unmeasured"] == [] and verdict["measured_here"] and "pilot" not in verdict
    assert not verdict["verdict"].startswith("not measured here")
    assert verdict["measured"]["pilot"] and verdict["measured"]["tokens"] == kd_steps * students * PER_GPU
    assert verdict["measured"]["settings"]["output"] == "topk" and verdict["measured"]["settings"]["vocab"] == 49152
    assert not after["recommendation"].startswith("pilot first")
    printed = verdict_lines(verdict)
    assert f"kd_topk64 of {tmp_path / 'pilot.json'} (your pilot: student 73.9M, teacher 135M" in printed[2]
    assert printed[3] == f"  worth: {verdict['worth']:.3g}x"  # one seed: its value, no range
    assert not any("not measured here" in line for line in printed)

    # The same pilot read for a plan twice as long is not that plan's pilot: its tokens are named.
    longer = plan_of(EXAMPLES["smollm2"] + ["steps=4000", f"kd_measurement={tmp_path / 'pilot.json'}"])
    assert longer["verdict"]["unmeasured"] == [["pilot tokens", kd_steps * students * PER_GPU,
                                                200 * students * PER_GPU]]


def to_checkpoint_evals(dump_dir: Path) -> None:
    """Move a run's held-out CE from metrics.jsonl's in-loop rows to metrics.validation.jsonl's checkpoint evals."""
    rows = [json.loads(line) for line in (dump_dir / "metrics.jsonl").read_text().splitlines()]
    (dump_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows if "eval/loss" not in r))
    (dump_dir / "metrics.validation.jsonl").write_text("".join(
        json.dumps({"created_at": "2026-11-27T00:00:00+00:00", "global_step": r["step"],
                    "heldout": {"ce": r["eval/loss"], "tokens": 1000}}) + "\n" for r in rows if "eval/loss" in r))


def test_checkpoint_evals_are_read_when_both_runs_log_there(tmp_path, teacher_dir, capsys):
    argv = pilots(tmp_path, teacher_dir, kd_final=3.32)
    to_checkpoint_evals(tmp_path / "kd")
    # One run in-loop, the other at checkpoints: not the same measurement, refused.
    assert refusal(argv, capsys) == ("error: ce= logged its held-out CE in metrics.jsonl and kd= in "
                                     "metrics.validation.jsonl; evaluate both the same way (heldout.every=<steps> on "
                                     "both, as the plan prints).")
    to_checkpoint_evals(tmp_path / "ce")
    results = pilot_main(argv)
    assert results["setup"]["pilot"]["heldout_source"] == "metrics.validation.jsonl"
    assert results["arms"]["kd_topk64"]["token_multiplier"]["mean"] == pytest.approx(1.3 ** 0.4 * 1.4 ** 0.6)


def test_a_kd_run_that_did_not_distill_or_finish_is_refused(tmp_path, teacher_dir, capsys):
    ce = fake_run(tmp_path / "ce", ["enable_distillation=false", "steps=100", "heldout.every=5"], 8 * PER_GPU,
                  ce_curve())
    assert refusal([f"ce={ce}", f"kd={ce}"], capsys) == \
        f"error: kd={ce} did not distill (enable_distillation=false); pass the KD pilot's dump_dir."
    kd = fake_run(tmp_path / "kd", ["enable_distillation=true", f"distillation.teacher_path={teacher_dir}",
                                    "steps=100", "heldout.every=50"], 4 * PER_GPU, {50: 3.4})
    assert refusal([f"ce={ce}", f"kd={kd}"], capsys) == (
        f"error: kd={kd}'s last held-out CE is at step 50 of its 100; let it finish with heldout.every dividing "
        f"steps (the plan prints heldout.every=steps).")
