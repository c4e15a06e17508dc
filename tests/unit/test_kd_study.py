"""apps.bench.kd_study's bookkeeping: results.json schema, paired differences, the table and the plot."""

import json

import pytest

from apps.bench import kd_study
from apps.main.train import TrainArgs


def write_run(dump_dir, curve: dict[int, float]) -> None:
    dump_dir.mkdir(parents=True)
    rows = [{"step": step, "loss/ce": 9.0} for step in curve]
    rows += [{"step": step, "eval/loss": loss, "eval/ppl": 1.0} for step, loss in curve.items()]
    (dump_dir / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))


def test_results_pair_each_arm_with_ce_by_seed_and_render(tmp_path):
    finals = {("ce", 0): 6.0, ("ce", 1): 6.2, ("kd_topk64", 0): 5.7, ("kd_topk64", 1): 5.8}
    runs = []
    for (arm, seed), final in finals.items():
        run = kd_study.Run(arm, seed, tmp_path / f"{arm}_{seed}", ["steps=4", *kd_study.ARMS[arm]], wall_s=1.0)
        write_run(run.dump_dir, {2: final + 1.0, 4: final})
        runs.append(run)
    args = TrainArgs(steps=4)
    arms = kd_study.collect(runs, args, tokens_per_step=100)
    assert arms["ce"]["overrides"] == kd_study.ARMS["ce"]  # the arm's own settings, not the shared ones
    seed0 = arms["kd_topk64"]["seeds"]["0"]
    assert seed0["final_heldout_ce"] == 5.7 and seed0["tokens"] == 400
    assert [p["tokens"] for p in seed0["heldout"]] == [200, 400]
    paired = arms["kd_topk64"]["minus_ce_paired"]
    assert paired["mean"] == pytest.approx(-0.35) and (paired["min"], paired["max"]) == pytest.approx((-0.4, -0.3))
    assert "minus_ce_paired" not in arms["ce"]
    assert arms["ce"]["final_heldout_ce"]["mean"] == pytest.approx(6.1)
    results = {"setup": {"tokens_per_run": 400, "teacher": "data/teachers/smollm2-135m-instruct"}, "teacher_heldout_ce": 3.3, "arms": arms}
    table = kd_study.table(results)
    assert "| kd_topk64 | alpha=0.5 | 5.7500 ± 0.0707 | 5.7000, 5.8000 | -0.3500 (range -0.4000 to -0.3000) |" in table
    assert "| teacher | smollm2-135m-instruct | 3.3000 |" in table
    png = kd_study.plot(results, tmp_path)
    assert png.stat().st_size > 10_000


def test_a_run_counts_as_finished_only_with_its_final_eval(tmp_path):
    write_run(tmp_path / "a", {2: 7.0})
    assert not kd_study.run_finished(tmp_path / "a", steps=4)
    assert kd_study.run_finished(tmp_path / "a", steps=2)
    assert not kd_study.run_finished(tmp_path / "missing", steps=2)


def test_bad_arm_eval_cadence_and_missing_inputs_are_one_sentence(tmp_path, corpus):
    with pytest.raises(ValueError, match="unknown arm"):
        kd_study.main(["--arms", "ce,nope", "--out", str(tmp_path)])
    args = TrainArgs(steps=10)
    args.eval.every = 3
    with pytest.raises(ValueError, match="eval.every=3 must divide steps=10"):
        kd_study.check_inputs(args)
    args.eval.every, args.data.root_dir, args.data.sources = 5, str(tmp_path), {"pydocs": 1.0}
    with pytest.raises(ValueError, match="no held-out"):
        kd_study.check_inputs(args)
    args.data.root_dir, args.data.sources = str(corpus), {"text": 1.0}
    args.distillation.teacher_path = str(tmp_path / "no_teacher")
    with pytest.raises(Exception, match="no_teacher"):
        kd_study.check_inputs(args)
