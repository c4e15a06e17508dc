"""Run the trainer (or a worker script) under torchrun on CPU/gloo with a hard timeout."""

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def torchrun(nproc: int, module_args: list[str], timeout: float, env: dict | None = None,
             module: str = "apps.main.train", signal_plan=None) -> subprocess.CompletedProcess:
    """`torchrun --nproc-per-node nproc -m module *module_args`; a run past `timeout` is a test failure.

    signal_plan: optional callable(popen) run while the job is alive (e.g. to deliver SIGUSR2).
    """
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()), "--max-restarts", "0",
           "-m", module, *module_args]
    full_env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1",
                    TRANSFORMERS_OFFLINE="1", WANDB_MODE="disabled", TOKENIZERS_PARALLELISM="false")
    full_env.update(env or {})
    proc = subprocess.Popen(cmd, cwd=ROOT, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        if signal_plan is not None:
            signal_plan(proc)
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"HANG: torchrun did not finish within {timeout}s\n{out[-6000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, "")


def worker_pids(parent_pid: int) -> list[int]:
    """Child processes of torchrun (the ranks), in pid order."""
    children = Path(f"/proc/{parent_pid}/task/{parent_pid}/children")
    if not children.exists():
        return []
    return sorted(int(p) for p in children.read_text().split())
