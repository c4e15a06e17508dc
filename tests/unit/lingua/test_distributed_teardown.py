"""How a rank leaves torch.distributed (`clean_up`): destroy on a normal exit, abort on an exceptional one
(NCCL's destroy would wait for work still posted), destroy again where abort is not available.

Each case runs in a fresh interpreter: process groups are process-wide torch state.
"""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]

SCENARIOS = """
import logging, sys
import torch.distributed as dist
from lingua import distributed as ld
logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(message)s")
args = ld.DistributedArgs(debug={debug})

def leave(error):
    ld.setup_torch_distributed(args, dump_dir={dump!r})
    ld.clean_up(error)
    print("initialized after:", dist.is_initialized())

print("== normal"); leave(None)
print("== failed"); leave(RuntimeError("boom"))
def no_abort(group=None):
    raise RuntimeError("Backend gloo does not implement abort")
dist.distributed_c10d._abort_process_group = no_abort
print("== failed, abort refused"); leave(RuntimeError("boom"))
"""


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("debug", [False, True], ids=["plain", "DETAIL"])
def test_clean_up_destroys_on_a_normal_exit_and_aborts_on_a_failure(tmp_path, debug):
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCH_", "RANK"))}
    result = subprocess.run([sys.executable, "-c", SCENARIOS.format(debug=debug, dump=str(tmp_path))], cwd=ROOT,
                            capture_output=True, text=True, timeout=100, env=env)
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stdout.splitlines() if line.startswith(("==", "initialized", "process", "abort"))]
    assert lines == [
        "== normal", "process group destroyed", "initialized after: False",
        "== failed", "process groups aborted", "initialized after: False",
        "== failed, abort refused",
        "aborting the process groups failed (RuntimeError: Backend gloo does not implement abort); destroying them",
        "process group destroyed", "initialized after: False",
    ], result.stdout
