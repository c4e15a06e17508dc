"""The GPU self-check's own run where there is no GPU: every check listed as skipped with its reason, exit 1."""

import os
import subprocess
import sys

import pytest
import torch

from tests.runs import ROOT


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: the self-check would run the checks")
@pytest.mark.timeout(300)
def test_without_a_gpu_every_check_is_listed_skipped_and_the_check_fails():
    result = subprocess.run([sys.executable, "-m", "apps.debug.gpu_check"], cwd=ROOT, capture_output=True, text=True,
                            timeout=240, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    out = result.stdout
    assert result.returncode == 1, out[-3000:] + result.stderr[-3000:]
    assert "no CUDA GPU visible" in out.splitlines()[0]
    table = out[out.index("GPU self-check"):]
    rows = [line for line in table.splitlines() if line.startswith(("passed", "FAILED", "skipped"))]
    assert len(rows) >= 9 and all(line.startswith("skipped") for line in rows), table
    assert "test_no_host_sync_per_micro_batch_with_a_teacher" in table and "needs 2 CUDA GPUs, 0 visible" in table
    assert "nothing was checked" in out
