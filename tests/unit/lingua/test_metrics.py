"""MetricLogger (jsonl + offline wandb with a stable run id), MemoryMonitor, MFU and ProgressLine."""

import io
import json
import logging
import math

import pytest
import torch

from lingua.metrics import MemoryMonitor, MetricLogger, ProgressLine, WandbArgs, estimate_mfu


@pytest.mark.timeout(30)
def test_metric_logger_appends_valid_json_lines(tmp_path):
    path = tmp_path / "metrics.jsonl"
    with MetricLogger(str(path), None, config={}, run_dir=str(tmp_path)) as metric_logger:
        metric_logger.log({"step": 1, "loss/total": torch.tensor(2.5), "tokens": 512})
        # Flushed per line: a reader sees the line before close().
        assert len(path.read_text().splitlines()) == 1
        metric_logger.log({"step": 2, "loss/total": 2.25, "tokens": 1024})
    # A restart appends to the same file.
    with MetricLogger(str(path), None, config={}, run_dir=str(tmp_path)) as metric_logger:
        metric_logger.log({"step": 3, "eval/loss": 2.0})
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2, 3]
    assert rows[0]["loss/total"] == 2.5 and rows[1]["tokens"] == 1024 and rows[2]["eval/loss"] == 2.0
    assert all(isinstance(row["time"], float) for row in rows)


@pytest.mark.timeout(60)
def test_wandb_offline_reuses_run_id(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    args = WandbArgs(project="lingua-test", mode="offline", dir=str(tmp_path / "wandb"))
    run_dir = tmp_path / "dump"
    first = MetricLogger(str(run_dir / "metrics.jsonl"), args, config={"model": {"dim": 8}}, run_dir=str(run_dir))
    run_id = first.wandb_run.id
    first.log({"step": 1, "loss/total": 3.0})
    first.close()
    assert (run_dir / "wandb_run_id").read_text().strip() == run_id
    offline_runs = list((tmp_path / "wandb" / "wandb").glob(f"offline-run-*-{run_id}"))
    assert len(offline_runs) == 1 and any(offline_runs[0].iterdir())

    second = MetricLogger(str(run_dir / "metrics.jsonl"), args, config={"model": {"dim": 8}}, run_dir=str(run_dir))
    assert second.wandb_run.id == run_id
    second.log({"step": 2, "loss/total": 2.0})
    second.close()
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == 2


def test_wandb_bad_mode_is_a_readable_error(tmp_path):
    with pytest.raises(ValueError, match="logging.wandb.mode"):
        MetricLogger(str(tmp_path / "m.jsonl"), WandbArgs(mode="sometimes"), config={}, run_dir=str(tmp_path))


def test_memory_monitor_cpu_reports_peak_rss():
    stats = MemoryMonitor(torch.device("cpu")).get_peak_stats()
    # A Python process with torch loaded holds far more than 10 MiB and far less than 1 TiB.
    assert 0.01 < stats["mem/peak_gib"] < 1024


def test_estimate_mfu_is_none_on_cpu():
    assert estimate_mfu(6e9, 1e4, torch.device("cpu")) is None


def test_progress_line_non_tty_logs_plain_lines(caplog):
    stream = io.StringIO()
    progress = ProgressLine(total_steps=100, stream=stream)
    metrics = {"loss/total": 3.2109, "speed/tokens_per_s": 4100.0, "speed/teacher_wait_s": 0.06,
               "speed/step_time_s": 0.5}
    with caplog.at_level(logging.INFO, logger="lingua.metrics"):
        progress.update(10, metrics)
        progress.update(12, metrics)
        progress.close()
    lines = [record.getMessage() for record in caplog.records]
    assert lines[0] == "step 10/100 | loss 3.211 | 4.1k tok/s | teacher wait 12%"
    assert lines[1].startswith("step 12/100 | loss 3.211 | 4.1k tok/s | teacher wait 12% | ETA ")
    assert stream.getvalue() == ""  # nothing written to the stream itself when it is not a TTY


def test_progress_line_tty_rewrites_one_line():
    class FakeTTY(io.StringIO):
        def isatty(self):
            return True

    stream = FakeTTY()
    progress = ProgressLine(total_steps=5, stream=stream)
    progress.update(1, {"loss/ce": math.log(2)})
    progress.update(2, {"loss/ce": 0.5})
    progress.close()
    text = stream.getvalue()
    assert text.count("\r") == 2 and text.endswith("\n") and text.count("\n") == 1
    assert "step 2/5 | loss 0.500" in text


def test_progress_line_clear_erases_the_live_line_and_eta_needs_two_steps():
    class FakeTTY(io.StringIO):
        def isatty(self):
            return True

    stream = FakeTTY()
    progress = ProgressLine(total_steps=10, stream=stream)
    assert progress.eta(2) is None  # one step seen: no pace yet
    progress.update(4, {"loss/ce": 1.0})
    progress.clear()
    assert stream.getvalue().endswith("\r\x1b[K") and not progress.line_open
    progress.close()
    assert not stream.getvalue().endswith("\n")  # nothing open to end after clear()
    assert progress.eta(10) is None  # the last step has nothing left


@pytest.mark.parametrize("name, peak", [("NVIDIA H100 80GB HBM3", 989e12), ("NVIDIA H100 PCIe", 756e12),
                                        ("NVIDIA A100-SXM4-80GB", 312e12), ("NVIDIA L40S", 362e12),
                                        ("NVIDIA L4", 121e12), ("Some Future GPU", None)])
def test_mfu_is_achieved_over_the_device_peak(monkeypatch, name, peak):
    """MFU = FLOPs per token x this device's tokens/s / its peak bf16 FLOP/s (a GPU is faked by name)."""
    from apps.main.transformer import get_num_flop_per_token

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    flops_per_token = get_num_flop_per_token(1_000_000_000, n_layers=16, dim=2048, seq_len=4096)
    assert flops_per_token == 6e9 + 12 * 16 * 2048 * 4096
    mfu = estimate_mfu(flops_per_token, 5_000, torch.device("cuda", 0))
    if peak is None:
        assert mfu is None
    else:
        assert mfu == pytest.approx(flops_per_token * 5_000 / peak)
        assert 0 < mfu < 1
