"""apps.debug.gpu_bench (`bash setup/gpu_check.sh --bench`): both loss shapes' commands and the feeding bench's, the
summary, the budget, a failed or timed-out part."""

import subprocess
from pathlib import Path
import sys

import pytest

from apps.debug import gpu_bench


def part_out(tmp_path, command):
    """The folder a part writes: loss_V<vocab> for the loss bench, feed for the feeding bench."""
    return tmp_path / (f"loss_V{command[command.index('--vocab') + 1]}" if "--vocab" in command else "feed")


@pytest.mark.timeout(20)
def test_both_shapes_and_the_feeding_bench_run_within_the_budget_and_the_summary_keeps_their_tables(tmp_path, capsys):
    commands, timeouts = [], []

    def fake_run(command, cwd, timeout):
        commands.append(command)
        timeouts.append(timeout)
        out = part_out(tmp_path, command)
        out.mkdir()
        (out / "table.md").write_text(f"| table of {out.name} |\n")
        return subprocess.CompletedProcess(command, 0)

    assert gpu_bench.main(["--out", str(tmp_path)], run=fake_run) == 0
    loss, feed = commands[:2], commands[2]
    assert [(c[c.index("--vocab") + 1], c[c.index("--dim") + 1]) for c in loss] == [("128256", "2048"),
                                                                                    ("49152", "576")]
    for command in loss:
        assert command[:3] == [sys.executable, "-m", "apps.bench.loss_step"]
        flags = dict(zip(command[3::2], command[4::2]))
        assert flags["--device"] == "cuda" and flags["--dtype"] == "bfloat16" and flags["--against"] == "liger"
        assert flags["--tokens"] == "8192" and flags["--k"] == "64"
        assert flags["--compiled"] == "ce,kd_topk_t1"  # the compiled twins beside the eager CE and KD
    assert feed[:3] == [sys.executable, "-m", "apps.bench.feeding"] and feed[feed.index("--device") + 1] == "cuda"
    # Each part gets at most what is left of the budget, and the budget is under 10 minutes.
    assert timeouts[:2] == [gpu_bench.SHAPE_TIMEOUT_S] * 2 and timeouts[2] <= gpu_bench.BUDGET_S < 600
    summary = (tmp_path / "bench.md").read_text()
    assert all(f"| table of {name} |" in summary for name in ("loss_V128256", "loss_V49152", "feed"))
    assert summary in capsys.readouterr().out


@pytest.mark.timeout(20)
def test_a_part_that_times_out_or_fails_is_named_and_the_exit_status_says_so(tmp_path, monkeypatch):
    def fake_run(command, cwd, timeout):
        if "128256" in command:
            raise subprocess.TimeoutExpired(command, timeout)
        return subprocess.CompletedProcess(command, 3)

    assert gpu_bench.main(["--out", str(tmp_path)], run=fake_run) == 1
    assert (tmp_path / "bench.md").read_text().count("FAILED or timed out") == 3
    # A spent budget runs nothing more: the part is marked, not started.
    monkeypatch.setattr(gpu_bench, "BUDGET_S", 0)
    started = []
    assert gpu_bench.main(["--out", str(tmp_path / "spent")], run=lambda *a, **k: started.append(a)) == 1
    assert started == [] and (tmp_path / "spent" / "bench.md").read_text().count("FAILED or timed out") == 3


def test_a_smaller_budget_caps_every_part(tmp_path):
    """--budget-s (a lent machine's few minutes) bounds each part's limit, the feeding bench's included."""
    timeouts = []

    def fake_run(command, cwd, timeout):
        timeouts.append(timeout)
        out = Path(command[command.index("--out") + 1])
        out.mkdir(parents=True, exist_ok=True)
        (out / "table.md").write_text("| a | b |\n")
        return subprocess.CompletedProcess(command, 0)

    assert gpu_bench.main(["--out", str(tmp_path), "--budget-s", "120"], run=fake_run) == 0
    assert len(timeouts) == 3 and all(t <= 120 for t in timeouts)
