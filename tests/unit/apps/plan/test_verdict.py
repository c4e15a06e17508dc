"""The planner's verdict (apps/plan/verdict.py): should a planned run distill at all? The break-even arithmetic by
hand, the effective-data law, this repository's one-pass study reproduced, a data-wall measurement, errors."""

import json
import math
from pathlib import Path

import pytest

from apps.plan.args import PlanArgs
from apps.plan.planner import Planner
from apps.plan.verdict import break_even, cache_overhead, distill_verdict, effective_tokens
from lingua.args import parse_args
from tests.unit.apps.plan.test_plan import run  # the planner's command line, exit code and streams

ROOT = Path(__file__).resolve().parents[4]
STUDY = json.loads((ROOT / "docs" / "kd_study" / "results.json").read_text())
# The one-pass study as a plan: its config and teacher, its tokens per run, the 6 runs that read its top-64 cache.
AS_STUDIED = ["config=configs/distill_exps/kd_study.yaml", "world_size=2", "gpus_per_node=2",
              "teacher_config=configs/teachers/smollm2_135m.json",
              f"tokens_per_run={STUDY['setup']['tokens_per_run']}",
              f"planned_runs={STUDY['caches']['topk64']['runs_reading']}"]


@pytest.fixture(autouse=True)
def in_the_repository(monkeypatch):
    monkeypatch.chdir(ROOT)


def verdict_of(argv: list[str]) -> dict:
    args = parse_args(PlanArgs, argv + ["out=null"])
    args.validate_plan()
    return Planner(args).plan()["verdict"]


def test_effective_data_law_and_break_even_by_hand():
    # Fresh data: every token counts; 1 + overhead.
    assert effective_tokens(8e6, 0) == 8e6 and effective_tokens(3e6, 4e6) == 3e6
    assert break_even(1.0, 4e6, 0) == 2.0 and break_even(0.5, 1e6, 8e6) == 1.5  # the wall not reached: fresh
    # U = 1M read 4 times (R = 3 repetitions): 1 + 15.4 (1 - exp(-3/15.4)) = 1 + 15.4 x 0.17701 = 3.7259 U.
    assert effective_tokens(4e6, 1e6) == pytest.approx(3.7259e6, rel=1e-4)
    # Overhead 1 online doubles the CE tokens to 8M (R = 7): 1 + 15.4 x 0.36525 = 6.6251 U; 6.6251 / 3.7259 = 1.7781.
    assert break_even(1.0, 4e6, 1e6) == pytest.approx(1.7781, abs=1e-4)
    # A cache written once over U and read by 4 epochs of 2 runs: 1 x 1M / 4M / 2 = 0.125; 4.5M is worth 4.1308 U.
    assert cache_overhead(1.0, 4e6, 1e6, 2) == 0.125
    assert break_even(0.125, 4e6, 1e6) == pytest.approx(4.1308 / 3.7259, abs=1e-4)
    assert break_even(1.0, 4e6, 1e6, r_star=1e9) == pytest.approx(2.0, abs=1e-6)  # no decay: repeats are fresh


SETTINGS = {"output": "topk", "k": 64, "alpha": 0.5, "temperature": 1.0, "divergence": "fkl", "vocab": 49152}


def measured(multiplier, kind="one_pass", low=None, high=None, bound=None) -> dict:
    return {"source": "x", "owner": "your", "why": "kd_measurement= names it", "arm": "kd_topk64", "kind": kind,
            "epochs": 1.0, "epoch_range": [1.0, 1.0], "tokens": 1e6, "unique_tokens": 0, "multiplier": multiplier,
            "bound": bound, "low": low, "high": high, "best": {"multiplier": multiplier, "epochs": 1.0},
            "settings": SETTINGS, "student": 7e6, "teacher": 135e6}


def test_the_three_sentences():
    # ratio 1, fresh: online needs 2x; a cache read by N runs needs 1 + 1/N.
    args = dict(teacher_flops=1.0, student_flops=1.0, tokens=1e6, unique=0.0, student=7_000_000, teacher=135_000_000)
    assert distill_verdict(runs=1, road="online", measured=measured(2.5), **args)["verdict"] == "distill online"
    cache = distill_verdict(runs=4, road="cache", measured=measured(1.3), **args)
    assert cache["min_cache_runs"] == 4 and cache["verdict"] == "distill from a cache shared by at least 4 run(s) " \
        "(you plan 4)"
    short = distill_verdict(runs=3, road="online", measured=measured(1.3), **args)
    assert short["verdict"] == "do not distill: train CE-only on more tokens (a cache would pay if shared by at " \
        "least 4 runs; you plan 3)"
    never = distill_verdict(runs=3, road="online", measured=measured(1.0, bound="at_most"), **args)
    assert never["min_cache_runs"] is None and never["verdict"] == "do not distill: train CE-only on more tokens"
    assert never["unmeasured"] == [] and never["measured_here"]


def test_the_one_pass_study_says_ce_wins_as_it_measured():
    verdict = verdict_of(AS_STUDIED)
    compute = STUDY["compute"]
    # The planner's FLOP counts are the study's: the teacher's forward is 6.4x the 7M student's training per token.
    ratio = compute["teacher"]["forward_per_token"] / compute["student"]["train_per_token"]
    assert verdict["teacher_over_student_flops"] == pytest.approx(ratio, rel=1e-3) and 6.3 < ratio < 6.5
    assert verdict["unmeasured"] == []  # the same student, teacher, tokens, k, alpha, T: nothing to transfer
    assert verdict["measured"]["arm"] == "kd_topk64" and verdict["expected"] == pytest.approx(1.18, abs=0.01)
    # The cache shared by its 6 runs: 6.4 / 6 = 1.07 of overhead, 2.07x to break even; KD was worth 1.18x. CE-only at
    # 2x the tokens (5.69) beat KD from the cache (6.04) for about the same FLOPs, as the study measured.
    assert verdict["break_even"]["fresh_cache"] == pytest.approx(1 + ratio / 6, abs=1e-3)
    assert verdict["verdict"].startswith("do not distill: train CE-only on more tokens")
    assert verdict["min_cache_runs"] == math.floor(ratio / (verdict["expected"] - 1)) + 1
    arms = STUDY["arms"]
    assert arms["ce_2x"]["final_heldout_ce"]["mean"] < arms["kd_topk64"]["final_heldout_ce"]["mean"]
    assert arms["ce_2x"]["flops"]["total_cache"] < arms["kd_topk64"]["flops"]["total_cache"]


def test_the_sampled_arm_is_read_for_a_sampled_plan():
    verdict = verdict_of(AS_STUDIED + ["distillation.output=sampled"])
    assert verdict["measured"]["arm"] == "kd_sampled64"
    assert verdict["expected"] == pytest.approx(STUDY["arms"]["kd_sampled64"]["token_multiplier"]["mean"])


def wall_results(path: Path, multipliers: dict) -> Path:
    """A data-wall study's results.json as apps.studies.kd --wall writes it (only what the verdict reads)."""
    compute = STUDY["compute"]
    epochs = {str(e): {"arms": {"kd_topk64": {"token_multiplier": {
        "mean": m, "min": m, "max": m, "per_seed": {"0": {"value": m} if m else {"value": None, "at_least": 2.0}}}}}}
        for e, m in multipliers.items()}
    setup = {"unique_tokens": 61440, "config": STUDY["setup"]["config"], "student": STUDY["setup"]["student"]}
    path.write_text(json.dumps({"mode": "data_wall", "setup": setup, "compute": compute, "epochs": epochs}))
    return path


def test_a_data_wall_measurement_is_read_at_the_nearest_epochs(tmp_path):
    path = wall_results(tmp_path / "wall.json", {1: 1.1, 4: 1.5, 16: None})
    base = AS_STUDIED[:4] + ["tokens_per_run=245760", "planned_runs=1", f"kd_measurement={path}"]
    at_4 = verdict_of(base + ["unique_tokens=61440"])  # 4 epochs
    assert at_4["measured"]["epochs"] == 4 and at_4["expected"] == 1.5
    # Over the same unique data the study's CE curve holds the repeats: break-even 1 + overhead, cache read 4 times.
    assert at_4["break_even"]["compared"] == "tokens over the same unique data"
    # 6.4 / (4 epochs x N runs): 2.6, 1.8, 1.53 for 1-3 runs, 1.40 from 4 runs.
    assert at_4["min_cache_runs"] == 4 and at_4["verdict"].startswith("do not distill")
    assert at_4["unmeasured"] == [] and at_4["measured_here"]
    at_16 = verdict_of(base + ["unique_tokens=15360"])  # 16 epochs: KD below every CE budget, at least 2x
    assert at_16["measured"]["bound"] == "at_least" and at_16["expected"] == 2.0
    # 1 + 6.4 / 16 = 1.4 to break even; but a quarter of the study's U, read 16 times, is not what it measured.
    assert at_16["verdict"] == "not measured here: on the nearest measurement, distill from a cache shared by at " \
        "least 1 run(s) (you plan 1)"
    assert at_16["unmeasured"] == [["tokens", 61440 * 16, 245760], ["U/V", 1.25, 0.312]]


@pytest.mark.parametrize("argv, sentence", [
    (["unique_tokens=-1"], "error: unique_tokens=-1.0; use the unique training tokens there are"),
    (["repeat_decay=0"], "error: repeat_decay=0.0; use a positive number of repetitions"),
    (["show=plan"], "error: show='plan'; use all or verdict."),
    (["kd_measurement=/no/results.json"], "error: kd_measurement=/no/results.json does not exist; pass the "
                                           "results.json of a `python -m apps.studies.kd` run"),
    (["kd_measurement=configs/teachers/llama3_8b.json"], "error: kd_measurement=configs/teachers/llama3_8b.json is "
                                                         "not a results.json written by apps.studies.kd"),
])
def test_bad_verdict_input_is_one_sentence(argv, sentence, monkeypatch, capsys):
    code, printed, err = run(AS_STUDIED + ["out=null"] + argv, monkeypatch, capsys)
    assert code == 2 and err.startswith(sentence) and err.count("\n") == 1 and printed == ""


def test_show_verdict_prints_only_the_verdict(monkeypatch, capsys):
    code, printed, _ = run(AS_STUDIED + ["out=null", "show=verdict"], monkeypatch, capsys)
    lines = printed.splitlines()
    assert code == 0 and lines[0].startswith("answer: do not distill: train CE-only") and len(lines) == 5
    assert lines[1].startswith("distill? the teacher's forward is 6.4")
