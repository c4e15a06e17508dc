"""The data-wall mode of apps.studies.kd on synthetic runs: the runs it plans, the CE frontier over weight decay,
the wall, the crossings at equal tokens and at equal FLOPs (teacher once), the table, the plot, and the planner's
verdict reading its results.json."""

import argparse
import json
import math
from pathlib import Path

import pytest

from apps.studies.kd import wall_report
from apps.studies.kd.arms import WallRun
from apps.studies.kd.wall import plan_wall_runs, windows_of
from apps.main.train import TrainArgs
from apps.plan.verdict import distill_verdict, read_measurement
from lingua.errors import ConfigError
from tests.unit.apps.studies.kd.test_study import write_run

# Final held-out CE of seed 0 per (arm, E); seed 1 is 0.02 above. CE turns up at E=16: the wall.
FINALS = {
    "ce": {1: 6.0, 2: 5.6, 4: 5.3, 8: 5.25, 16: 5.4},
    "ce_wd10x": {1: 6.05, 2: 5.65, 4: 5.35, 8: 5.2, 16: 5.3},
    "kd_topk64": {1: 5.8, 2: 5.45, 4: 5.2, 8: 5.1, 16: 5.05},
}
U, PER_STEP = 1000, 100  # 10 steps an epoch


def options(**changes) -> argparse.Namespace:
    values = dict(epochs="1,2,4,8,16", wall_seeds="0,1", wall_end_seeds="2", wall_arms="ce,ce_wd10x,kd_topk64,"
                  "kd_sampled64", timeout=100.0, unique_tokens=U, config="c", overrides=[], parallel=2)
    return argparse.Namespace(**{**values, **changes})


def synthetic(tmp_path) -> dict:
    runs = []
    for arm, finals in FINALS.items():
        for e, final in finals.items():
            for seed in (0, 1):
                run = WallRun(arm, seed, tmp_path / f"{arm}_e{e}_{seed}", [], steps=10 * e, wall_s=1.0, epochs=e)
                write_run(run.dump_dir, {run.steps: final + 0.02 * seed}, cloze={"acc": 0.3})
                runs.append(run)
    epochs = wall_report.collect_wall(runs, PER_STEP)
    wall_report.add_frontier(epochs)
    wall_report.add_flops(epochs, 10.0, 50.0, U)  # the teacher's forward: 5x the student's training per token
    crossings = wall_report.compare(epochs)
    return {"mode": "data_wall", "setup": {"unique_tokens": U}, "epochs": epochs, "crossings": crossings,
            "wall": wall_report.wall_of(epochs),
            "compute": {"student": {"params": 7e6, "train_per_token": 10.0},
                        "teacher": {"params": 135e6, "forward_per_token": 50.0}}}


def test_the_runs_every_arm_budget_and_seed_longest_first(tmp_path):
    runs = plan_wall_runs(options(), ["x=1"], 16, tmp_path, tmp_path / "caches")
    assert len(runs) == 4 * (5 * 2 + 2)  # 2 seeds at every E, a third at E=1 and E=16
    assert sorted((r.seed for r in runs if r.arm == "ce" and r.epochs == 16)) == [0, 1, 2]
    assert sorted((r.seed for r in runs if r.arm == "ce" and r.epochs == 4)) == [0, 1]
    assert runs[0].epochs == 16 and runs[-1].epochs == 1
    ce16 = next(r for r in runs if r.arm == "ce_wd10x" and r.epochs == 16)
    assert ce16.steps == 256 and ce16.timeout_s == 1600.0 and ce16.cache_dir == tmp_path / "caches" / "cache_topk64"
    assert ce16.overrides == ["x=1", "distillation.alpha=0.0", "optim.weight_decay=1.0", "distillation.output=topk",
                              "distillation.k=64", "steps=256", "heldout.every=256", "optim.warmup=25"]
    sampled = next(r for r in runs if r.arm == "kd_sampled64")
    assert sampled.cache_dir.name == "cache_sampled64" and "distillation.alpha=0.5" in sampled.overrides


def test_unique_tokens_must_be_whole_steps():
    args = TrainArgs()
    args.data.batch_size, args.data.seq_len = 8, 128
    assert windows_of(16384, args) == 128
    with pytest.raises(ConfigError, match="--unique-tokens 1000 must be a positive multiple of one step's tokens"):
        windows_of(1000, args)


def test_frontier_wall_and_crossings(tmp_path):
    results = synthetic(tmp_path)
    epochs = results["epochs"]
    assert [epochs[e]["frontier"]["arm"] for e in ("1", "2", "4", "8", "16")] == \
        ["ce", "ce", "ce", "ce_wd10x", "ce_wd10x"]
    assert results["wall"] == {"best_epochs": 8, "best_heldout_ce": pytest.approx(5.21), "largest_epochs": 16,
                               "at_largest": pytest.approx(5.31), "stopped_improving": True}
    kd1, kd8, kd16 = (epochs[e]["arms"]["kd_topk64"] for e in ("1", "8", "16"))
    # E=1: 5.8 is half-way from 6.0 (E=1) to 5.6 (E=2) on the frontier: sqrt(2) x the tokens, on both seeds.
    assert kd1["token_multiplier"]["mean"] == pytest.approx(math.sqrt(2))
    assert kd16["token_multiplier"]["per_seed"]["0"] == {"value": None, "at_least": 1.0}  # CE never gets there
    assert kd1["minus_frontier_equal_tokens"]["mean"] == pytest.approx(-0.2)
    # Equal FLOPs: KD at E costs 10 E U + 50 U; at E=8 that is 13 CE epochs, the best CE within it E=8's 5.2.
    assert kd8["best_ce_at_no_more_flops"] == {"epochs": 13.0, "final_heldout_ce": pytest.approx(5.21)}
    # Within 2.83 epochs (half-way from 2 to 4 in log-epochs) the frontier reaches half-way from 5.6 to 5.3.
    assert wall_report.best_ce_within([(1, 6.0), (2, 5.6), (4, 5.3)], 2 ** 1.5) == pytest.approx(5.45)
    assert wall_report.best_ce_within([(1, 6.0), (2, 5.6), (4, 5.3), (8, 5.5)], 6.0) == 5.3  # past the wall: its lowest
    assert wall_report.best_ce_within([(2, 5.6)], 1.5) is None
    assert kd8["minus_ce_equal_flops"]["mean"] == pytest.approx(-0.1)
    assert kd8["flops"] == {"student": 80000.0, "teacher_once": 50000.0, "total": 130000.0}
    assert epochs["8"]["arms"]["ce"]["flops"]["teacher_once"] == 0.0
    crossings = results["crossings"]["kd_topk64"]
    assert crossings["equal_tokens"]["epochs"] == 1 and crossings["equal_flops"]["epochs"] == 8
    table = wall_report.table({**results, "setup": {"unique_tokens": U}})
    assert "| 8 | ce_wd10x (frontier) | 8.0k | 5.2100 ± 0.0141 | 5.2000, 5.2200 |" in table
    assert ("kd_topk64 at equal FLOPs (teacher once): KD minus CE -0.1000 nats from E=8 (paired seeds -0.1000 to "
            "-0.1000).") in table  # CE-only at those FLOPs would read 13 epochs: measured, up to 16
    assert kd8["ce_epochs_at_equal_flops"] == 13.0
    assert "CE frontier: lowest at E=8 (5.2100); at E=16 5.3100: it had stopped improving (the data wall)." in table
    assert wall_report.plot(results, tmp_path).stat().st_size > 10_000


def test_the_planners_verdict_reads_the_wall_results(tmp_path):
    path = tmp_path / "results.json"
    path.write_text(json.dumps(synthetic(tmp_path)))
    at_16 = read_measurement(str(path), "topk", epochs=14.0)  # KD below CE at every budget from 16 on, CE walled
    assert (at_16["kind"], at_16["epochs"], at_16["bound"]) == ("data_wall", 16.0, "beyond")
    # Finite: the largest multiplier the study measured for the arm (a lower bound where CE never got there).
    assert math.isfinite(at_16["multiplier"]) and at_16["multiplier"] == at_16["best"]["multiplier"] >= 2
    verdict = distill_verdict(50.0, 10.0, 16 * U, U, 1, "cache", at_16, 7_000_000, 135_000_000)
    assert verdict["verdict"] == "distill from a cache shared by at least 1 run(s) (you plan 1)"
    at_1 = read_measurement(str(path), "topk", epochs=1.2)
    assert at_1["epochs"] == 1.0 and at_1["multiplier"] == pytest.approx(math.sqrt(2)) and at_1["tokens"] == U


def test_kd_below_only_the_later_ce_budgets_is_not_beyond_ce(tmp_path, monkeypatch):
    """KD at E=16 under CE's E=16 but above CE's best (E=8, cheaper): CE-only reaches it, so not "beyond"."""
    monkeypatch.setitem(FINALS, "ce", {1: 6.0, 2: 5.6, 4: 5.3, 8: 5.2, 16: 5.3})
    monkeypatch.setitem(FINALS, "ce_wd10x", {1: 6.05, 2: 5.65, 4: 5.35, 8: 5.22, 16: 5.32})
    monkeypatch.setitem(FINALS, "kd_topk64", {1: 5.8, 2: 5.45, 4: 5.3, 8: 5.27, 16: 5.25})
    path = tmp_path / "results.json"
    path.write_text(json.dumps(synthetic(tmp_path)))
    at_16 = read_measurement(str(path), "topk", epochs=16.0)
    assert at_16["bound"] != "beyond" and at_16["multiplier"] is not None
    verdict = distill_verdict(50.0, 10.0, 16 * U, U, 1, "cache", at_16, 7_000_000, 135_000_000)
    assert verdict["verdict"].startswith("do not distill")


@pytest.mark.bench  # a study end to end: the bench tier
@pytest.mark.slow
def test_the_wall_study_end_to_end_with_the_trainings_faked(smollm2_teacher, tmp_path, monkeypatch):
    """main(--wall): caches, every run, the report from disk, then --report-only gives the same numbers."""
    from apps.studies.kd import study, wall

    data_root = tmp_path / "corpus"
    (data_root / "pydocs").mkdir(parents=True)
    (data_root / "pydocs" / "pydocs.val.jsonl").write_text('{"text": "held out"}\n')
    launched = []

    def fake_run_all(runs, config, parallel, cloze):
        for run in runs:
            launched.append((run.arm, run.epochs, run.seed))
            write_run(run.dump_dir, {run.steps: FINALS.get(run.arm, FINALS["kd_topk64"])[run.epochs] + run.seed / 50},
                      cloze={"acc": 0.3})
        return []

    monkeypatch.setattr(wall, "build_cache", lambda *a, **k: None)
    monkeypatch.setattr(wall, "run_all", fake_run_all)
    argv = ["--wall", "--unique-tokens", "2048", "--out", str(tmp_path / "wall"),
            f"distillation.teacher_path={smollm2_teacher}", f"data.tokenizer.path={smollm2_teacher}",
            f"data.root_dir={data_root}"]
    results = study.main(argv)
    assert len(launched) == 48 and results["mode"] == "data_wall" and results["wall"]["stopped_improving"]
    assert results["setup"]["steps_per_epoch"] == 2 and results["epochs"]["16"]["arms"]["ce"]["tokens"] == 32768
    assert sorted(results["epochs"]["16"]["arms"]["ce"]["seeds"]) == ["0", "1", "2"]
    ratio = results["compute"]["teacher"]["forward_per_token"] / results["compute"]["student"]["train_per_token"]
    kd = results["epochs"]["4"]["arms"]["kd_topk64"]
    assert kd["ce_epochs_at_equal_flops"] == pytest.approx(4 + ratio)  # the teacher once over U
    assert (tmp_path / "wall" / "kd_wall.png").is_file() and "kd_topk64" in (tmp_path / "wall" / "table.md").read_text()
    again = study.main(argv + ["--report-only"])
    assert len(launched) == 48 and again["epochs"] == json.loads(json.dumps(results["epochs"]))


WALL_RESULTS = Path(__file__).resolve().parents[5] / "docs" / "kd_study" / "wall" / "results.json"


@pytest.mark.skipif(not WALL_RESULTS.is_file(), reason="the data-wall study's results are not committed yet "
                    "(docs/kd_study/wall.md: run it, copy results.json, table.md and kd_wall.png there)")
def test_the_verdict_reproduces_what_the_committed_wall_study_measured():
    """At each measured E, one run reading the cache: the verdict says distill exactly where the study measured KD
    below the best CE-only run of no more FLOPs on every seed, and CE wins where every seed says so."""
    results = json.loads(WALL_RESULTS.read_text())
    compute, unique = results["compute"], results["setup"]["unique_tokens"]
    largest = max(int(e) for e in results["epochs"])
    checked = 0
    for e, budget in results["epochs"].items():
        for name, output in (("kd_topk64", "topk"), ("kd_sampled64", "sampled")):
            arm = budget["arms"].get(name)
            diff = arm and arm.get("minus_ce_equal_flops")
            provisional = arm and arm["ce_epochs_at_equal_flops"] > largest and not results["wall"]["stopped_improving"]
            if not diff or provisional or (diff["min"] < 0) != (diff["max"] < 0):
                continue  # not measured, beyond the CE budgets run, or the seeds disagree
            measured = read_measurement(str(WALL_RESULTS), output, epochs=float(e))
            verdict = distill_verdict(compute["teacher"]["forward_per_token"], compute["student"]["train_per_token"],
                                      int(e) * unique, unique, 1, "cache", measured, compute["student"]["params"],
                                      compute["teacher"]["params"])
            assert verdict["verdict"].startswith("distill") == (diff["mean"] < 0), (name, e, verdict, diff)
            checked += 1
    assert checked > 0
