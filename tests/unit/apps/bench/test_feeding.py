"""`python -m apps.bench.feeding`: its loader measurement, its results and table logic, and (slow) the whole bench at
tiny sizes on the CPU, the GPU mode's step comparison included (the same code path as --device cuda)."""

import json
from pathlib import Path

import pytest

from apps.bench.feeding import ISSUE_TABLE, format_table, loader_rates, main
from apps.bench.feeding_step import run_summary
from lingua.data import DataArgs
from lingua.tokenizer import TokenizerArgs, build_tokenizer

WRITER = {"shards": 2, "tokens_per_shard": 2048, "teacher_params": 1, "tokenize_tokens_per_s": 50_000.0,
          "forward_tokens_per_s": 10_000.0, "encode_1_worker_tokens_per_s": 8_000.0,
          "encode_2_workers_tokens_per_s": 14_400.0, "encode_scaling_2_over_1": 1.8, "write_tokens_per_s": 2e5,
          "encode_workers_auto": 1, "serial_writer_tokens_per_s": 4_000.0, "pipelined_writer_tokens_per_s": 9_000.0,
          "reader_decode_tokens_per_s": 150_000.0}


def loader_row(rate, share):
    return {"tokens_per_s": rate, "wait_share": share, "wait_per_batch_s": 0.001}


RESULTS = {"machine": "2 CPUs", "date": "2026-11-27", "config": "c.yaml", "device": "cpu", "teacher": "random-tiny",
           "loader": {"inline": {"idle": loader_row(1e5, 1.0), "busy": loader_row(5e4, 0.5)},
                      "async": {"idle": loader_row(2e5, 1.0), "busy": loader_row(4e4, 0.25)}, "busy_spin_s": 0.01,
                      "workers": None},
           "writer": WRITER}


def test_the_table_shows_every_rate_the_encode_scaling_and_the_pipeline_against_serial_and_the_teacher():
    table = format_table(RESULTS)
    assert table.splitlines()[0] == "feeding rates, 2 CPUs, 2026-11-27 (tokens/s per rank)"
    assert "| loader, load_async=true, training thread busy | 40,000 | waits 25% of the time |" in table
    assert "| writer: encode, 2 workers | 14,400 | 1.80x one worker |" in table
    assert "| writer, pipelined (1 encode workers) | 9,000 | 2.25x serial, 90% of the teacher's forward |" in table
    assert "| reader: decode, one thread | 150,000 |  |" in table
    assert "then (issue 35" not in table  # no step comparison measured
    without_loader = format_table({key: value for key, value in RESULTS.items() if key != "loader"})
    assert "loader" not in without_loader and "| writer: encode, 2 workers | 14,400 |" in without_loader


def test_the_step_table_gives_then_and_now(tmp_path):
    summary = {"step_s": 0.127, "data_s": 0.001, "data_share": 0.008, "fwd_bwd_s": 0.1, "tokens_per_s": 1, "steps": 3}
    steps = {"139m": {"ce": summary, "kd_cache": {**summary, "fwd_bwd_s": 0.105}, "fwd_bwd_kd_over_ce": 1.05}}
    table = format_table({**RESULTS, "steps": steps})
    assert "| 139m student, CE only: data time / step | 37% | 0.8% of 127 ms |" in table
    assert "| 139m student: fwd+bwd KD / CE | - | 1.05x |" in table
    assert (f"| cache writer / its teacher's forward + top-64 | 8,265 / 288,000 tokens/s | 9,000 / 10,000 tokens/s "
            f"(90%) |") in table and ISSUE_TABLE["writer_tokens_per_s"] == 8265


def test_a_runs_summary_is_the_median_of_its_steady_steps(tmp_path):
    rows = [{"step": s, "speed/step_time_s": 1.0 if s > 5 else 9.0, "speed/data_time_s": 0.1 * (s % 3),
             "stragglers/fwd_bwd_max_s": 0.5, "speed/tokens_per_s": 100.0} for s in range(1, 10)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = run_summary(tmp_path / "metrics.jsonl")
    assert summary["steps"] == 4 and summary["step_s"] == 1.0 and summary["fwd_bwd_s"] == 0.5
    assert summary["data_s"] == pytest.approx(0.05)  # steps 6..9: 0, 0.1, 0.2, 0


def test_the_loader_is_measured_in_line_and_async_idle_and_busy(corpus):
    data = DataArgs(root_dir=str(corpus), sources={"text": 1.0}, batch_size=2, seq_len=32,
                    tokenizer=TokenizerArgs(name="bytes"))
    rates = loader_rates(data, build_tokenizer(data.tokenizer), batches=3, rounds=1)
    for mode in ("inline", "async"):
        for consumer in ("idle", "busy"):
            assert rates[mode][consumer]["tokens_per_s"] > 0 and 0 <= rates[mode][consumer]["wait_share"] <= 1
    assert rates["busy_spin_s"] > 0 and rates["workers"] == getattr(data, "workers", None)  # the config's, where it has one
    assert rates["inline"]["busy"]["wait_share"] < rates["inline"]["idle"]["wait_share"]  # it spun part of the time


@pytest.mark.bench  # the feeding bench end to end: the bench tier
@pytest.mark.slow  # launches the cache writer and two trainers, starts encode workers
@pytest.mark.timeout(240)
def test_the_bench_runs_at_tiny_sizes_with_the_step_comparison(corpus, tiny_teacher, tmp_path, capsys):
    config = tmp_path / "tiny.yaml"  # the test corpus's one source, the tiny teacher and its tokenizer
    config.write_text(f"enable_distillation: true\ndistillation: {{teacher_path: {tiny_teacher}, k: 8, teacher_dtype: "
                      f"fp32}}\ndata: {{root_dir: {corpus}, sources: {{text: 1.0}}, seq_len: 32, batch_size: 2, "
                      f"tokenizer: {{name: hf, path: {tiny_teacher}}}}}\ndistributed: {{model_dtype: fp32}}\n")
    main(["--out", str(tmp_path), "--config", str(config), "--batches", "3", "--shards", "2", "--rounds", "1",
          "--steps", "7", "--students", "tiny", "--compare-steps", "--teacher", "config", "shard_sequences=4"])
    results = json.loads((tmp_path / "results.json").read_text())
    writer, steps = results["writer"], results["steps"]["tiny"]
    assert writer["shards"] == 2 and writer["tokens_per_shard"] == 4 * 32
    for key in ("tokenize", "forward", "encode_1_worker", "encode_2_workers", "write", "serial_writer",
                "pipelined_writer", "reader_decode"):
        assert writer[f"{key}_tokens_per_s"] > 0, key
    for mode in ("ce", "kd_cache"):
        assert steps[mode]["steps"] == 2 and 0 <= steps[mode]["data_share"] < 1 and steps[mode]["fwd_bwd_s"] > 0
    assert steps["fwd_bwd_kd_over_ce"] > 0
    assert "| tiny student: fwd+bwd KD / CE |" in capsys.readouterr().out


def test_a_failed_step_run_keeps_the_other_rows(monkeypatch, tmp_path):
    """One student's failed launch (out of memory on a small card, say) is its row's reason; the other student's
    rows and the writer's are kept, and a failed cache writer leaves every step row with its reason."""
    from argparse import Namespace

    from apps.bench import feeding_step as feed_step
    from apps.main.teacher_cache import TeacherCacheArgs
    from lingua.errors import RunFailed

    def fake_launch(module, overrides, what, timeout_s=300):
        if what.startswith("small"):
            raise RunFailed("the small ce run failed: error: out of memory")
        if module == "apps.main.train":  # a run's metrics: three steady steps
            dump = Path(next(item for item in overrides if item.startswith("dump_dir="))[len("dump_dir="):])
            dump.mkdir(parents=True)
            row = {"speed/step_time_s": 1.0, "speed/data_time_s": 0.01, "stragglers/fwd_bwd_max_s": 0.9,
                   "speed/tokens_per_s": 10.0}
            (dump / "metrics.jsonl").write_text("".join(json.dumps({"step": s, **row}) + "\n" for s in range(1, 9)))
        return ""

    monkeypatch.setattr(feed_step, "launch", fake_launch)
    monkeypatch.setitem(feed_step.STUDENTS, "small", {"dim": 8})
    options = Namespace(overrides=[], config="c.yaml", steps=3, device="cpu", students="small,tiny")
    steps = feed_step.step_comparison(options, TeacherCacheArgs(), tmp_path)
    assert steps["small"] == {"failed": "the small ce run failed: error: out of memory"}
    assert steps["tiny"]["fwd_bwd_kd_over_ce"] == 1.0
    table = feed_step.format_step_table({"writer": WRITER, "steps": steps}, ISSUE_TABLE)
    assert "| small student | - | the small ce run failed: error: out of memory |" in table
    assert "| tiny student: fwd+bwd KD / CE | - | 1.00x |" in table

    def writer_fails(module, overrides, what, timeout_s=300):
        raise RunFailed("the cache writer failed: error: disk full")

    monkeypatch.setattr(feed_step, "launch", writer_fails)
    assert feed_step.step_comparison(options, TeacherCacheArgs(), tmp_path / "again") == {
        "small": {"failed": "the cache writer failed: error: disk full"},
        "tiny": {"failed": "the cache writer failed: error: disk full"}}
