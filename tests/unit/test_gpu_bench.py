"""apps.debug.gpu_bench (`bash setup/gpu_check.sh --bench`): both shapes' commands, the summary, a failed shape."""

import subprocess
import sys

import pytest

from apps.debug import gpu_bench


@pytest.mark.timeout(20)
def test_both_shapes_run_the_liger_bench_and_the_summary_keeps_their_tables(tmp_path, capsys):
    commands = []

    def fake_run(command, cwd, timeout):
        commands.append(command)
        assert timeout == gpu_bench.SHAPE_TIMEOUT_S and 2 * timeout < 600  # the mode stays under 10 minutes
        out = tmp_path / f"loss_V{command[command.index('--vocab') + 1]}"
        out.mkdir()
        (out / "table.md").write_text(f"| table of V={command[command.index('--vocab') + 1]} |\n")
        return subprocess.CompletedProcess(command, 0)

    assert gpu_bench.main(["--out", str(tmp_path)], run=fake_run) == 0
    assert [(c[c.index("--vocab") + 1], c[c.index("--dim") + 1]) for c in commands] == [("128256", "2048"),
                                                                                        ("49152", "576")]
    for command in commands:
        assert command[:3] == [sys.executable, "-m", "apps.bench.loss_step"]
        flags = dict(zip(command[3::2], command[4::2]))
        assert flags["--device"] == "cuda" and flags["--dtype"] == "bfloat16" and flags["--against"] == "liger"
        assert flags["--tokens"] == "8192" and flags["--k"] == "64"
        assert flags["--compiled"] == "ce,kd_topk_t1"  # the compiled twins beside the eager CE and KD
    summary = (tmp_path / "bench.md").read_text()
    assert "| table of V=128256 |" in summary and "| table of V=49152 |" in summary
    assert summary in capsys.readouterr().out


@pytest.mark.timeout(20)
def test_a_shape_that_times_out_or_fails_is_named_and_the_exit_status_says_so(tmp_path):
    def fake_run(command, cwd, timeout):
        if "128256" in command:
            raise subprocess.TimeoutExpired(command, timeout)
        return subprocess.CompletedProcess(command, 3)

    assert gpu_bench.main(["--out", str(tmp_path)], run=fake_run) == 1
    assert (tmp_path / "bench.md").read_text().count("FAILED or timed out") == 2
