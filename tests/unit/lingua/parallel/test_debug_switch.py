"""The debug switch's environment per mode (false / trace / detail / true), the timeout switch with and without
DETAIL, and what a stuck rank says: its stacks on stderr and in its own log, its hang note, its flight recorder.

Each case runs in a fresh interpreter: the switch sets process-wide torch state (debug level, env).
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[4]
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


def debug_env(tmp_path, mode: str, env: dict = None) -> dict:
    """The TORCH_* environment `enable_debug_env` leaves for `mode`, and torch's debug level after it."""
    code = ("import json, os\n"
            "import torch.distributed as dist\n"
            "from lingua.distributed import enable_debug_env\n"
            f"enable_debug_env({str(tmp_path)!r}, {mode!r})\n"
            "out = {k: v for k, v in os.environ.items() if k.startswith('TORCH_')}\n"
            "out['level'] = str(dist.get_debug_level())\n"
            "print(json.dumps(out))\n")
    return printed_json(code, env)


def printed_json(code: str, env: dict = None):
    """Run `code`, which must exit 0 and print its result as JSON on its last line; that result."""
    result = python(code, env=env)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


FLIGHT_RECORDER = {"TORCH_FR_BUFFER_SIZE", "TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DUMP_ON_TIMEOUT",
                   "TORCH_NCCL_DEBUG_INFO_PIPE_FILE", "TORCH_FR_DEBUG_INFO_PIPE_FILE"}


@pytest.mark.parametrize("mode", ["trace", "detail", "true"])
def test_each_debug_mode_sets_its_own_variables(tmp_path, mode):
    env = debug_env(tmp_path, mode)
    traces, detail = mode in ("trace", "true"), mode in ("detail", "true")
    assert env["TORCH_SHOW_CPP_STACKTRACES"] == "1"
    assert (env.get("TORCH_DISTRIBUTED_DEBUG") == "DETAIL") == detail, env
    assert env["level"] == ("DebugLevel.DETAIL" if detail else "DebugLevel.OFF"), env
    assert FLIGHT_RECORDER & set(env) == (FLIGHT_RECORDER if traces else set()), env
    assert (tmp_path / "comm_traces").is_dir() == traces
    # Torch's default error handling (3) stays; the deprecated trace-buffer names are not set.
    assert not {"TORCH_NCCL_ASYNC_ERROR_HANDLING", "TORCH_NCCL_TRACE_BUFFER_SIZE",
                "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"} & set(env), env
    if traces:
        assert env["TORCH_FR_BUFFER_SIZE"] == "20000" and env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
        # NCCL's watchdog dumps where our own dumps go, under the analyzer's prefix (torch appends the rank).
        assert env["TORCH_FR_DUMP_TEMP_FILE"] == str(tmp_path / "comm_traces" / "rank_")
        # The on-demand pipes live apart from the dumps: the analyzer reads every `rank_` file in comm_traces.
        assert env["TORCH_NCCL_DEBUG_INFO_PIPE_FILE"] == env["TORCH_FR_DEBUG_INFO_PIPE_FILE"] == str(
            tmp_path / "logs" / "fr_dump_pipe_")


def test_a_users_own_torch_variables_are_kept(tmp_path):
    env = debug_env(tmp_path, "trace", env={"TORCH_FR_BUFFER_SIZE": "500", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"})
    assert env["TORCH_FR_BUFFER_SIZE"] == "500" and env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"


@pytest.mark.parametrize("given, mode", [("true", "true"), ("false", "false"), ("True", "true"), ("TRACE", "trace"),
                                         ("detail", "detail"), ("'false'", "false")])
def test_the_debug_setting_reads_yaml_booleans_and_words_alike(given, mode):
    from lingua.args import parse_args
    from lingua.parallel.launch_plan import DistributedArgs

    args = parse_args(DistributedArgs, [f"debug={given}"])
    args.validate()
    assert args.debug_mode == mode
    assert args.traces == (mode in ("trace", "true"))
    assert DistributedArgs(debug=True).debug_mode == "true" and DistributedArgs(debug=False).debug_mode == "false"


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


@pytest.mark.parametrize("debug", ["detail", "false"], ids=["DETAIL", "plain"])
def test_timeout_switch_reaches_the_backend_with_and_without_detail(tmp_path, debug):
    # torch's _set_pg_timeout only warns on DETAIL's wrapper and leaves the timeout as it was; here the
    # value is read back from torch itself, through the wrapper, on the world and on a new group.
    code = ("import json, logging, torch\n"
            "import torch.distributed as dist\n"
            "from lingua import distributed as ld\nfrom lingua.parallel import timeouts\n"
            "logging.basicConfig(level=logging.INFO)\n"
            f"args = ld.DistributedArgs(debug={debug!r}, init_timeout_s=100)\n"
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
    detail = debug == "detail"
    backend = "_ProcessGroupWrapper" if detail else "ProcessGroupGloo"
    for group in ("world", "train"):
        assert out[group]["before"] == [backend, 100.0], out
        assert out[group]["after"] == [backend, 7.0], out
        # Under DETAIL the wrapper's own gloo check group (a missing peer is noticed there) switches too.
        assert out[group]["reported"] == ({"gloo": 7.0, "DETAIL checks": 7.0} if detail else {"gloo": 7.0}), out
    assert "only supported for either nccl or gloo" not in result.stderr
    assert "INFO:lingua.distributed:process group destroyed" in result.stderr
