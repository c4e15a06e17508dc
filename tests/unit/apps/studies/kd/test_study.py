"""apps.studies.kd's bookkeeping on small synthetic results: results.json schema, pairing by seed, the token
multiplier's interpolation, the conditional 4x CE arm, FLOP figures, cloze collection, the table and the plot."""

import json
import math

import pytest

from apps.studies.kd import arms as kd_arms
from apps.studies.kd import disk as kd_disk
from apps.studies.kd import launch as kd_launch
from apps.studies.kd import render as kd_render
from apps.studies.kd import results as kd_results
from apps.studies.kd import study as kd_study_cmd
from apps.main.train import TrainArgs
from lingua.errors import ConfigError, DataError


def write_run(dump_dir, curve: dict[int, float], cloze: dict | None = None) -> None:
    dump_dir.mkdir(parents=True)
    rows = [{"step": step, "loss/ce": 9.0} for step in curve]
    rows += [{"step": step, "eval/loss": loss, "eval/ppl": 1.0} for step, loss in curve.items()]
    (dump_dir / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    if cloze is not None:  # the final checkpoint and its eval.json, as apps.main.eval writes them
        step_dir = dump_dir / "checkpoints" / f"{max(curve):010d}"
        step_dir.mkdir(parents=True)
        (step_dir / "params.json").write_text("{}")
        tasks = {kd_arms.CLOZE_TASK: {"acc": cloze["acc"], "acc_norm": cloze["acc"] - 0.01, "n_samples": 271}}
        (step_dir / "eval.json").write_text(json.dumps({"tasks": tasks}))


def make_runs(tmp_path, finals: dict, steps: int = 4, cloze: bool = False) -> list:
    """Runs of (arm, seed) -> final held-out CE; an arm's steps are `steps` x its multiple."""
    runs = []
    for (arm, seed), final in finals.items():
        arm_steps = steps * kd_arms.ARMS[arm].multiple
        run = kd_arms.Run(arm, seed, tmp_path / "runs" / f"{arm}_{seed}", [], steps=arm_steps, wall_s=1.0)
        write_run(run.dump_dir, {arm_steps // 2: final + 1.0, arm_steps: final},
                  cloze={"acc": 0.25 + final / 100} if cloze else None)
        runs.append(run)
    return runs


def synthetic_results(tmp_path, finals: dict, cloze: bool = True) -> dict:
    """A whole results dict as `report` builds it (FLOPs from fixed per-token figures, no model built)."""
    arms = kd_results.collect(make_runs(tmp_path, finals, cloze=cloze), tokens_per_step=100)
    kd_results.token_multipliers(arms)
    caches = {"topk64": {"dir": str(tmp_path / "cache_topk64"), "tokens": 400, "teacher_flops": 400 * 50.0,
                         "runs_reading": sum(len(a["seeds"]) for n, a in arms.items() if n.startswith("kd_topk64"))}}
    if "kd_sampled64" in arms:
        caches["sampled64"] = {"dir": "", "tokens": 400, "teacher_flops": 400 * 50.0,
                               "runs_reading": len(arms["kd_sampled64"]["seeds"])}
    kd_results.add_flops(arms, 10.0, 50.0, caches)
    return {"setup": {"tokens_per_run": 400, "teacher": "data/teachers/smollm2-135m-instruct",
                      "ce_4x": {"needed": False, "ran": False, "reason": "not needed"}},
            "teacher_heldout_ce": 3.3, "arms": arms, "caches": caches,
            "compute": {"student": {"train_per_token": 10.0}, "teacher": {"forward_per_token": 50.0}}}


def test_results_pair_each_arm_with_ce_by_seed_and_render(tmp_path):
    finals = {("ce", 0): 6.0, ("ce", 1): 6.2, ("kd_topk64", 0): 5.7, ("kd_topk64", 1): 5.8}
    arms = kd_results.collect(make_runs(tmp_path, finals), tokens_per_step=100)
    assert arms["ce"]["overrides"] == list(kd_arms.ARMS["ce"].overrides)  # the arm's own settings, not the shared ones
    assert arms["kd_topk64"]["overrides"] == ["distillation.alpha=0.5", *kd_arms.CACHES["topk64"]]
    assert arms["ce"]["source"] == "corpus" and arms["kd_topk64"]["source"] == "cache_topk64"
    seed0 = arms["kd_topk64"]["seeds"]["0"]
    assert seed0["final_heldout_ce"] == 5.7 and seed0["tokens"] == 400
    assert [p["tokens"] for p in seed0["heldout"]] == [200, 400]
    paired = arms["kd_topk64"]["minus_ce_paired"]
    assert paired["mean"] == pytest.approx(-0.35) and (paired["min"], paired["max"]) == pytest.approx((-0.4, -0.3))
    assert "minus_ce_paired" not in arms["ce"]
    assert arms["ce"]["final_heldout_ce"]["mean"] == pytest.approx(6.1)
    results = {"setup": {"tokens_per_run": 400, "teacher": "data/teachers/smollm2-135m-instruct"},
               "teacher_heldout_ce": 3.3, "arms": arms}
    table = kd_render.table(results)
    assert ("| kd_topk64 | alpha=0.5 output=topk k=64 | 400 | 5.7500 ± 0.0707 | 5.7000, 5.8000 "
            "| -0.3500 (-0.4000 to -0.3000) |") in table
    assert "| teacher | smollm2-135m-instruct | | 3.3000 |" in table
    png = kd_render.plot(results, tmp_path)
    assert png.stat().st_size > 10_000


def test_results_schema_keeps_todays_keys_and_adds_multiplier_cloze_and_flops(tmp_path):
    finals = {("ce", 0): 6.0, ("ce_2x", 0): 5.6, ("kd_topk64", 0): 5.8, ("kd_sampled64", 0): 5.9}
    results = synthetic_results(tmp_path, finals)
    json.loads(json.dumps(results))  # serialisable as results.json
    for name, arm in results["arms"].items():
        for seed in arm["seeds"].values():
            assert {"final_heldout_ce", "heldout", "tokens", "cloze_acc", "cloze_acc_norm", "flops"} <= set(seed)
            assert set(seed["flops"]) == {"student", "teacher_online", "teacher_cache_amortized", "total_online",
                                          "total_cache"}
        assert {"final_heldout_ce", "cloze_acc", "flops", "tokens"} <= set(arm)
        assert ("token_multiplier" in arm) == name.startswith("kd_")
    tm = results["arms"]["kd_topk64"]["token_multiplier"]
    assert set(tm) == {"mean", "min", "max", "per_seed"} and set(tm["per_seed"]) == {"0"}
    assert results["arms"]["ce_2x"]["tokens"] == 800 and results["arms"]["ce_2x"]["seeds"]["0"]["heldout"][-1]["tokens"] == 800


@pytest.mark.parametrize("kd, expected", [
    (5.8, {"value": math.sqrt(2), "between": [1.0, 2.0]}),  # half-way in CE between 1x and 2x -> sqrt(2) in log-tokens
    (6.0, {"value": 1.0, "between": [1.0, 1.0]}),  # exactly the 1x CE
    (5.6, {"value": 2.0, "between": [2.0, 2.0]}),  # exactly the 2x CE
    (5.5, {"value": 2 ** 1.5, "between": [2.0, 4.0]}),  # between 2x and 4x
    (5.2, {"value": None, "at_least": 4.0}),  # below every CE budget: a lower bound
    (6.3, {"value": None, "at_most": 1.0}),  # KD worse than CE: no extrapolation below 1x
])
def test_multiplier_interpolates_in_log_tokens_between_the_bracketing_budgets(kd, expected):
    got = kd_results.interpolate_multiplier({1.0: 6.0, 2.0: 5.6, 4.0: 5.4}, kd)
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        assert got[key] == (pytest.approx(value) if value is not None else None)


def test_multiplier_bounds_with_only_the_budgets_run():
    assert kd_results.interpolate_multiplier({1.0: 6.0, 2.0: 5.6}, 5.5) == {"value": None, "at_least": 2.0}
    # A CE curve that rises again (data repetition) brackets on its first crossing only.
    assert kd_results.interpolate_multiplier({1.0: 6.0, 2.0: 5.6, 4.0: 5.7}, 5.5) == {"value": None, "at_least": 4.0}
    assert kd_results.interpolate_multiplier({}, 5.5) == {"value": None}


def test_token_multiplier_per_seed_and_its_spread_on_every_kd_arm(tmp_path):
    finals = {("ce", 0): 6.0, ("ce", 1): 6.2, ("ce_2x", 0): 5.6, ("ce_2x", 1): 5.8,
              ("kd_topk64", 0): 5.8, ("kd_topk64", 1): 5.8, ("kd_topk64_lr", 0): 5.5, ("kd_topk64_lr", 1): 6.3}
    arms = kd_results.collect(make_runs(tmp_path, finals), tokens_per_step=100)
    kd_results.token_multipliers(arms)
    tm = arms["kd_topk64"]["token_multiplier"]
    assert tm["per_seed"]["0"]["value"] == pytest.approx(math.sqrt(2))  # 5.8 half-way from 6.0 to 5.6
    assert tm["per_seed"]["1"]["value"] == pytest.approx(2.0)  # seed 1's own curve: 5.8 is its 2x final
    assert (tm["min"], tm["max"], tm["mean"]) == pytest.approx((math.sqrt(2), 2.0, (math.sqrt(2) + 2) / 2))
    assert arms["kd_topk64"]["ce_tokens_equivalent"] == pytest.approx(tm["mean"] * 400)
    mixed = arms["kd_topk64_lr"]["token_multiplier"]
    assert mixed["per_seed"] == {"0": {"value": None, "at_least": 2.0}, "1": {"value": None, "at_most": 1.0}}
    assert mixed["mean"] is None and arms["kd_topk64_lr"]["ce_tokens_equivalent"] is None
    assert kd_render.format_multiplier(mixed) == ">2x on 1/2 seeds; <1x on 1/2 seeds"
    assert kd_render.format_multiplier(tm) == "1.71x (1.41-2.00)"
    assert "token_multiplier" not in arms["ce_2x"]


def test_the_4x_ce_arm_runs_only_when_the_2x_budget_does_not_reach_a_kd_result(tmp_path):
    reached = {("ce", 0): 6.0, ("ce_2x", 0): 5.6, ("kd_topk64", 0): 5.8, ("kd_sampled64", 0): 5.7}
    needed, reason = kd_results.conditional_arm_needed(kd_results.collect(make_runs(tmp_path / "a", reached), 100))
    assert not needed and "above" in reason
    beyond = {**reached, ("kd_sampled64", 0): 5.5}
    needed, reason = kd_results.conditional_arm_needed(kd_results.collect(make_runs(tmp_path / "b", beyond), 100))
    assert needed and "kd_sampled64 seed 0 (5.5000 < 5.6000)" in reason
    needed, reason = kd_results.conditional_arm_needed(kd_results.collect(make_runs(tmp_path / "c", {("ce", 0): 6.0}), 100))
    assert not needed and "ce_2x was not run" in reason
    # auto: phase one holds every CE arm but 4x; a forced list holds exactly its multiples.
    assert [n for n in kd_arms.ARMS if kd_arms.ARMS[n].is_ce and kd_arms.ce_arm_wanted(n, None)] == ["ce", "ce_2x"]
    assert [n for n in kd_arms.ARMS if kd_arms.ARMS[n].is_ce
            and kd_arms.ce_arm_wanted(n, kd_arms.parse_multiples("1,2,4"))] == ["ce", "ce_2x", "ce_4x"]
    with pytest.raises(ConfigError, match="ce-multiples"):
        kd_arms.parse_multiples("1,3")


def test_flops_count_the_teacher_online_per_token_and_the_cache_once_per_reader(tmp_path):
    finals = {("ce", 0): 6.0, ("ce_2x", 0): 5.6, ("kd_topk64", 0): 5.8, ("kd_topk64", 1): 5.8,
              ("kd_topk64_lr", 0): 5.9}
    results = synthetic_results(tmp_path, finals)
    arms = results["arms"]
    assert arms["ce"]["flops"] == {"student": 4000.0, "teacher_online": 0.0, "teacher_cache_amortized": 0.0,
                                   "total_online": 4000.0, "total_cache": 4000.0}
    assert arms["ce_2x"]["flops"]["total_cache"] == 8000.0
    kd = arms["kd_topk64"]["seeds"]["1"]["flops"]
    # 3 runs read the top-64 cache (kd_topk64 x 2 seeds, kd_topk64_lr x 1): each carries a third of its build.
    assert kd == {"student": 4000.0, "teacher_online": 20000.0, "teacher_cache_amortized": pytest.approx(20000 / 3),
                  "total_online": 24000.0, "total_cache": pytest.approx(4000 + 20000 / 3)}
    assert kd_results.curve_flops("kd_topk64", 200, results, "online") == 200 * 60.0
    assert kd_results.curve_flops("kd_topk64", 200, results, "cache") == pytest.approx(2000 + 20000 / 3)
    assert kd_results.curve_flops("ce_2x", 800, results, "cache") == 8000.0
    table = kd_render.table(results)
    assert "| kd_topk64 | 4.00e+03 | 2.00e+04 | 6.67e+03 (1/3 of 2.00e+04) | 2.40e+04 | 1.07e+04 | 5.8000 |" in table


@pytest.mark.bench  # the study's FLOPs from the real teacher: the bench tier
@pytest.mark.slow
def test_real_flop_formulas_use_the_trainers_count_and_the_teachers_parameters(smollm2_teacher):
    args = kd_arms.study_args(kd_arms.CONFIG, [f"distillation.teacher_path={smollm2_teacher}",
                                                 f"data.tokenizer.path={smollm2_teacher}"])
    student = kd_results.student_flops_per_token(args)
    assert 6e6 < student["params"] < 8e6  # the 7M student (49k x 128 tied embedding + 4 layers)
    assert student["train_per_token"] == 6 * student["matmul_params"] + 12 * 4 * 128 * 128
    teacher = kd_results.teacher_flops_per_token(args.distillation.teacher_path, 128)
    assert teacher["params"] == pytest.approx(134.5e6, rel=2e-3)  # SmolLM2-135M
    assert teacher["forward_per_token"] == pytest.approx(2 * teacher["params"] + 4 * 30 * 576 * 128)
    assert kd_disk.cache_bytes_per_token("topk", 64, "bf16", 49152) == {"bridge": 388, "cache_shard": 266}
    assert kd_disk.cache_bytes_per_token("sampled", 64, "bf16", 49152)["bridge"] == 388


def test_cloze_is_read_from_the_final_checkpoints_eval_json(tmp_path):
    finals = {("ce", 0): 6.0, ("ce", 1): 6.2}
    runs = make_runs(tmp_path, finals, cloze=True)
    arms = kd_results.collect(runs, tokens_per_step=100)
    assert arms["ce"]["seeds"]["0"]["cloze_acc"] == pytest.approx(0.31)
    assert arms["ce"]["seeds"]["1"]["cloze_n"] == 271
    assert arms["ce"]["cloze_acc"]["mean"] == pytest.approx(0.311)
    assert kd_disk.cloze_done(runs[0].dump_dir, 4) and not kd_disk.cloze_done(runs[0].dump_dir, 8)
    # A run with no eval.json yet: trained, so only its cloze stage is pending.
    (runs[1].dump_dir / "checkpoints" / f"{4:010d}" / "eval.json").unlink()
    todo = kd_launch.pending(runs, cloze=True)
    assert [(r.seed, r.stage) for r in todo] == [(1, "cloze")]
    assert "cloze_acc" not in kd_results.collect(runs[1:], 100)["ce"]["seeds"]["1"]
    assert kd_launch.pending(runs, cloze=False) == []


def test_plot_and_table_with_2x_and_4x_ce_arms_and_every_kd_arm(tmp_path):
    finals = {(arm, seed): base - 0.02 * seed for arm, base in
              (("ce", 6.0), ("ce_2x", 5.7), ("ce_4x", 5.5), ("kd_topk64", 5.8), ("kd_topk64_lr", 5.85),
               ("kd_sampled64", 5.45)) for seed in (0, 1, 2)}
    results = synthetic_results(tmp_path, finals)
    results["setup"]["ce_4x"] = {"needed": True, "ran": True, "reason": "x"}
    png = kd_render.plot(results, tmp_path)
    assert png.stat().st_size > 20_000
    table = kd_render.table(results)
    assert "| ce_4x | enable_distillation=false steps=16 | 1.6k |" in table
    assert "| kd_sampled64 |" in table and ">4x" in table
    summary = kd_render.summary_lines(results)
    assert summary[0].startswith("kd_topk64 at 400 tokens = CE-only at")
    assert any("kd_sampled64 minus kd_topk64, paired by seed: -0.3500" in line for line in summary)


def test_a_run_counts_as_finished_only_with_its_final_eval(tmp_path):
    write_run(tmp_path / "a", {2: 7.0})
    assert not kd_disk.run_finished(tmp_path / "a", steps=4)
    assert kd_disk.run_finished(tmp_path / "a", steps=2)
    assert not kd_disk.run_finished(tmp_path / "missing", steps=2)


def test_runs_are_planned_with_their_multiples_caches_and_timeouts(tmp_path):
    runs = kd_study_cmd.plan_runs(["ce", "ce_4x", "kd_sampled64"], [0, 1], tmp_path, tmp_path / "caches", ["x=1"], 240, 100.0)
    by = {(r.arm, r.seed): r for r in runs}
    assert by[("ce_4x", 1)].steps == 960 and by[("ce_4x", 1)].timeout_s == 400.0
    assert by[("ce_4x", 1)].overrides == ["x=1", "enable_distillation=false", "steps=960"]
    assert by[("ce", 0)].cache_dir is None and "source=cache" not in " ".join(kd_launch.train_command(by[("ce", 0)], "c"))
    sampled = by[("kd_sampled64", 0)]
    assert sampled.cache_dir == tmp_path / "caches" / "cache_sampled64"
    assert "distillation.output=sampled" in sampled.overrides
    command = kd_launch.train_command(sampled, "c")
    assert f"distillation.cache_dir={sampled.cache_dir}" in command and "model.seed=0" in command


def test_bad_arm_eval_cadence_and_missing_inputs_are_one_sentence(tmp_path, corpus):
    with pytest.raises(ConfigError, match="unknown arm"):
        kd_study_cmd.main(["--arms", "ce,nope", "--out", str(tmp_path)])
    args = TrainArgs(steps=10)
    args.heldout.every = 3
    with pytest.raises(ConfigError, match="heldout.every=3 must divide steps=10"):
        kd_arms.check_inputs(args)
    args.heldout.every, args.data.root_dir, args.data.sources = 5, str(tmp_path), {"pydocs": 1.0}
    with pytest.raises(DataError, match="no held-out"):
        kd_arms.check_inputs(args)
    args.data.root_dir, args.data.sources = str(corpus), {"text": 1.0}
    args.distillation.teacher_path = str(tmp_path / "no_teacher")
    with pytest.raises(Exception, match="no_teacher"):
        kd_arms.check_inputs(args)


@pytest.mark.bench  # a study end to end: the bench tier
@pytest.mark.slow
def test_the_study_runs_ce_4x_only_when_needed_and_reports_from_disk(smollm2_teacher, tmp_path, monkeypatch):
    """main() end to end with the trainings faked: phase one, the 4x decision, phase two, the report, --report-only."""
    data_root = tmp_path / "corpus"
    (data_root / "pydocs").mkdir(parents=True)
    (data_root / "pydocs" / "pydocs.val.jsonl").write_text('{"text": "held out"}\n')  # check_inputs wants one
    finals = {"ce": 6.0, "ce_2x": 5.6, "ce_4x": 5.3, "kd_topk64": 5.8, "kd_topk64_lr": 5.9, "kd_sampled64": 5.5}
    phases = []

    def fake_phase(runs, config, parallel, cloze):
        phases.append(sorted({run.arm for run in runs}))
        for run in runs:
            write_run(run.dump_dir, {run.steps // 2: finals[run.arm] + 0.5, run.steps: finals[run.arm]},
                      cloze={"acc": 0.3})
        return []

    monkeypatch.setattr(kd_study_cmd, "build_cache", lambda *a, **k: None)
    monkeypatch.setattr(kd_study_cmd, "run_phase", fake_phase)
    argv = ["--seeds", "0,1", "--steps", "4", "--out", str(tmp_path / "study"),
            f"distillation.teacher_path={smollm2_teacher}", f"data.tokenizer.path={smollm2_teacher}",
            f"data.root_dir={data_root}"]
    results = kd_study_cmd.main(argv)
    assert phases == [["ce", "ce_2x", "kd_sampled64", "kd_topk64", "kd_topk64_lr"], ["ce_4x"]]
    assert results["setup"]["ce_4x"]["needed"] and "kd_sampled64 seed 0" in results["setup"]["ce_4x"]["reason"]
    assert list(results["arms"]) == ["ce", "ce_2x", "ce_4x", "kd_topk64", "kd_topk64_lr", "kd_sampled64"]
    tm = results["arms"]["kd_sampled64"]["token_multiplier"]
    assert tm["per_seed"]["1"]["between"] == [2.0, 4.0] and tm["mean"] == pytest.approx(2 ** (1 + 1 / 3))
    kd_flops = results["arms"]["kd_topk64"]["flops"]  # no cache on disk: the online teacher is still counted
    assert kd_flops["teacher_online"] > 0 and kd_flops["teacher_cache_amortized"] == 0
    assert (tmp_path / "study" / "kd_study.png").is_file() and "ce_4x" in (tmp_path / "study" / "table.md").read_text()
    again = kd_study_cmd.main(argv + ["--report-only"])
    assert again["arms"] == json.loads(json.dumps(results["arms"])) and again["setup"]["ce_4x"]["ran"]
