"""Launching a trainer under torchrun for a benchmark, and sampling its ranks from /proc while it runs."""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

from lingua.errors import RunFailed

ROOT = Path(__file__).resolve().parents[2]
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds_between(samples: list[tuple[float, float]], start: float, end: float) -> Optional[float]:
    """CPU seconds a process used between two wall-clock times, interpolated from its (time, cpu_s) samples."""

    def cpu_at(t: float) -> Optional[float]:
        for (t0, c0), (t1, c1) in zip(samples, samples[1:]):
            if t0 <= t <= t1:
                return c0 + (c1 - c0) * (t - t0) / (t1 - t0) if t1 > t0 else c1
        return None

    first, last = cpu_at(start), cpu_at(end)
    return last - first if first is not None and last is not None else None


def torchrun_command(nproc: int, module: str, args: list[str]) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
            "--max-restarts", "0", "-m", module, *args]


def trainer_command(nproc: int, config: str, overrides: list[str]) -> list[str]:
    return torchrun_command(nproc, "apps.main.train", [f"config={config}", *overrides])


def _children(pid: int) -> list[int]:
    try:
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def proc_status_bytes(field: str, pid="self") -> Optional[int]:
    """A memory field of /proc/<pid>/status (VmHWM, VmRSS, RssAnon; kB there) in bytes; None when the process
    is gone or the field is missing."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    match = re.search(rf"^{field}:\s+(\d+) kB", status, re.MULTILINE)
    return int(match.group(1)) * 1024 if match else None


def _cpu_seconds(pid: int) -> Optional[float]:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()  # after "(comm)": state is field 3, utime 14, stime 15
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def launch(command: list[str], log_path: Path, timeout_s: float, omp_threads: int, poll_s: float = 0.2,
           extra_env: Optional[dict] = None):
    """Run torchrun, sampling its ranks from /proc.

    Returns (exit code, wall seconds, pid -> peak RSS bytes, pid -> [(unix time, CPU seconds)]).
    """
    env = dict(os.environ, OMP_NUM_THREADS=str(omp_threads), PYTHONUNBUFFERED="1", WANDB_MODE="disabled",
               TOKENIZERS_PARALLELISM="false")
    env.setdefault("HF_HUB_OFFLINE", "1")  # teachers are local directories; never wait on the network
    env.update(extra_env or {})
    peaks: dict[int, int] = {}
    cpu_samples: dict[int, list[tuple[float, float]]] = {}
    start = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            while proc.poll() is None:
                if time.perf_counter() - start > timeout_s:
                    raise RunFailed(f"the run did not finish within {timeout_s:.0f}s; raise --timeout or lower --steps "
                                    f"(log: {log_path}).")
                for pid in _children(proc.pid):
                    rss = proc_status_bytes("VmHWM", pid)
                    if rss is not None:
                        peaks[pid] = max(peaks.get(pid, 0), rss)
                    cpu = _cpu_seconds(pid)
                    if cpu is not None:
                        cpu_samples.setdefault(pid, []).append((time.time(), cpu))
                time.sleep(poll_s)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)  # our own torchrun's session: its ranks, nothing else
                proc.wait()
    return proc.returncode, time.perf_counter() - start, peaks, cpu_samples
