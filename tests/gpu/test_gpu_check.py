"""The GPU self-check's own run where there is no GPU: every check listed as skipped with its reason and the GPUs it
needs, exit 1, the table written to the folder it names; `--quick` lists the in-process checks only."""

import os
import subprocess
import sys

import pytest
import torch

from tests.runs import ROOT


def self_checks(*runs: list[str]) -> list[subprocess.CompletedProcess]:
    """Each `python -m apps.debug.gpu_check *args`, all at once: each is one process importing and collecting,
    so on 2 cores two take the time of one."""
    procs = [subprocess.Popen([sys.executable, "-m", "apps.debug.gpu_check", *args], cwd=ROOT, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=dict(os.environ, HF_HUB_OFFLINE="1"))
             for args in runs]
    try:
        outputs = [proc.communicate(timeout=240) for proc in procs]
        return [subprocess.CompletedProcess(proc.args, proc.returncode, *out) for proc, out in zip(procs, outputs)]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def table_rows(out: str) -> list[str]:
    table = out[out.index("GPU self-check ("):]
    return [line for line in table.splitlines() if line.startswith(("passed", "FAILED", "skipped"))]


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: the self-check would run the checks")
@pytest.mark.timeout(400)
def test_without_a_gpu_every_check_is_listed_skipped_and_the_check_fails(tmp_path):
    result, quick = self_checks(["--out", str(tmp_path / "full")], ["--quick", "--out", str(tmp_path / "quick")])
    out = result.stdout
    assert result.returncode == 1, out[-3000:] + result.stderr[-3000:]
    first, second = out.splitlines()[:2]
    assert first == f"GPU self-check: table and logs in {tmp_path / 'full'}" and "no CUDA GPU visible" in second
    rows = table_rows(out)
    assert len(rows) >= 9 and all(line.startswith("skipped") for line in rows), out
    assert "test_no_host_sync_per_micro_batch_with_a_teacher" in out and "needs 2 CUDA GPUs, 0 visible" in out
    for gpus, check in ((1, "training_from_a_cache"), (2, "with_a_cross_tokenizer_teacher"), (3, "with_several_teachers")):
        assert f"{gpus:>4}  test_no_host_sync_{check}" in out, out  # each check says the GPUs it needs
    assert "test_three_students_and_a_teacher_in_bf16_compiled_with_look_ahead" in out
    assert "nothing was checked" in out
    written = (tmp_path / "full" / "table.txt").read_text()
    assert "no CUDA GPU visible" in written and all(row in written for row in rows)
    assert (tmp_path / "full" / "junit.xml").is_file()
    assert quick.returncode == 1 and "(--quick)" in quick.stdout.splitlines()[0]
    quick_rows = table_rows(quick.stdout)
    assert 0 < len(quick_rows) < len(rows)
    assert "test_no_host_sync_per_micro_batch_with_a_teacher" not in quick.stdout  # it launches torchrun
    assert "test_bf16_teacher_logits_leave_the_gemm_in_fp32" in quick.stdout
