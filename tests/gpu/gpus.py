"""How a GPU check says what it needs: `@needs_gpus(n)` marks a test `cuda` and skips it, saying why, on a
machine with fewer than n CUDA GPUs (this project's own machines have none: `bash setup/gpu_check.sh` runs
the checks where there are)."""

import pytest
import torch


def gpu_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def needs_gpus(n: int):
    """Mark a test `cuda` and `gpus(n)` (the self-check's table and `--list` show n); skip it with the reason where
    fewer than `n` GPUs are visible."""
    have = gpu_count()
    skip = pytest.mark.skipif(have < n, reason=f"needs {n} CUDA GPU{'s' if n > 1 else ''}, {have} visible")

    def mark(test):
        return pytest.mark.cuda(pytest.mark.gpus(n)(skip(test)))
    return mark
