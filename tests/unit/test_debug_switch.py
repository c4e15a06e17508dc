"""The debug switch's environment, the timeout switch with and without it, and the two ways a stuck
rank prints its Python stack.

Each case runs in a fresh interpreter: the switch sets process-wide torch state (debug level, env).
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.timeout(120), pytest.mark.slow]  # every case is a fresh python process


def python(code: str, env: dict = None) -> subprocess.CompletedProcess:
    import os

    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=100,
                          env={**{k: v for k, v in os.environ.items() if not k.startswith(("TORCH_", "RANK"))},
                               **(env or {})})


def survives(code: str, last_words: str) -> subprocess.CompletedProcess:
    """Run `code`; it must exit 0 having printed `last_words` (a stack dump does not kill the process)."""
    result = python(code)
    assert result.returncode == 0 and last_words in result.stdout, result.stderr
    return result


def test_debug_env_sets_current_and_older_flight_recorder_names(tmp_path):
    code = ("import json, os\n"
            "from lingua.distributed import enable_debug_env\n"
            f"enable_debug_env({str(tmp_path)!r})\n"
            "print(json.dumps({k: v for k, v in os.environ.items() if k.startswith('TORCH_')}))\n")
    result = python(code, env={"TORCH_FR_BUFFER_SIZE": "500"})  # a user's own value is kept
    assert result.returncode == 0, result.stderr
    env = json.loads(result.stdout.strip().splitlines()[-1])
    traces = str(tmp_path / "comm_traces" / "rank_")
    assert env["TORCH_DISTRIBUTED_DEBUG"] == "DETAIL" and env["TORCH_SHOW_CPP_STACKTRACES"] == "1"
    assert env["TORCH_FR_BUFFER_SIZE"] == "500" and env["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "20000"
    assert env["TORCH_FR_DUMP_TEMP_FILE"] == env["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] == traces
    assert env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1" and env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
    assert (tmp_path / "comm_traces").is_dir()


def test_hang_watch_prints_the_stack_shortly_before_the_timeout():
    code = ("import time\n"
            "from lingua.parallel.timeouts import HangWatch\n"
            "def waiting_in_a_collective():\n"
            "    HangWatch(fraction=0.5).arm(2.0)\n"  # dump after 1 s, before the (pretend) 2 s timeout
            "    time.sleep(2.5)\n"
            "waiting_in_a_collective()\n"
            "print('survived')\n")
    result = survives(code, "survived")
    assert "Timeout (0:00:01)!" in result.stderr and "waiting_in_a_collective" in result.stderr, result.stderr


def test_sigusr1_prints_every_stack_and_the_rank_goes_on():
    code = ("import os, signal, time\n"
            "from lingua.distributed import clean_up, setup_torch_distributed\nfrom lingua.parallel.launch_plan import DistributedArgs\n"
            "topo = setup_torch_distributed(DistributedArgs())\n"
            "def training_step():\n"
            "    os.kill(os.getpid(), signal.SIGUSR1)\n"
            "    time.sleep(0.5)\n"
            "training_step()\n"
            "clean_up()\n"
            "print('still running')\n")
    result = survives(code, "still running")
    assert "training_step" in result.stderr and "File " in result.stderr, result.stderr


@pytest.mark.parametrize("debug", [True, False], ids=["DETAIL", "plain"])
def test_timeout_switch_reaches_the_backend_with_and_without_detail(tmp_path, debug):
    # torch's _set_pg_timeout only warns on DETAIL's wrapper and leaves the timeout as it was; here the
    # value is read back from torch itself, through the wrapper, on the world and on a new group.
    code = ("import json, logging, torch\n"
            "import torch.distributed as dist\n"
            "from lingua import distributed as ld\nfrom lingua.parallel import timeouts\n"
            "logging.basicConfig(level=logging.INFO)\n"
            f"args = ld.DistributedArgs(debug={debug}, init_timeout_s=100)\n"
            f"topo = ld.setup_torch_distributed(args, dump_dir={str(tmp_path)!r})\n"
            "def from_torch(group):\n"
            "    backend = group._get_backend(torch.device('cpu'))\n"
            "    real = getattr(backend, 'wrapped_pg', backend)\n"
            "    return [type(backend).__name__, real.options._timeout.total_seconds()]\n"
            "out = {}\n"
            "for name, group in (('world', dist.group.WORLD), ('train', topo.train_group)):\n"
            "    before = from_torch(group)\n"
            "    reported = timeouts.set_group_timeout(group, 7)\n"
            "    out[name] = dict(before=before, after=from_torch(group), reported=reported)\n"
            "ld.clean_up()\n"
            "print(json.dumps(out))\n")
    result = python(code)
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout.strip().splitlines()[-1])
    backend = "_ProcessGroupWrapper" if debug else "ProcessGroupGloo"
    for group in ("world", "train"):
        assert out[group]["before"] == [backend, 100.0], out
        assert out[group]["after"] == [backend, 7.0], out
        # Under DETAIL the wrapper's own gloo check group (a missing peer is noticed there) switches too.
        assert out[group]["reported"] == ({"gloo": 7.0, "DETAIL checks": 7.0} if debug else {"gloo": 7.0}), out
    assert "only supported for either nccl or gloo" not in result.stderr
    assert "INFO:lingua.distributed:process group destroyed" in result.stderr
