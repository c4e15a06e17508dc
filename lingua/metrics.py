"""Metrics: the jsonl/wandb logger, local memory stats, MFU and the console progress line.

Nothing in this module talks to other ranks: averaging across ranks is the training loop's job
(`dist_mean_dict(..., group=topo.train_group)`), and only the train master builds a `MetricLogger`.
"""

import json
import logging
import math
import os
import resource
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, TextIO

import torch

from lingua.args import require
from lingua.logger import CONSOLES

logger = logging.getLogger(__name__)

WANDB_MODES = ("online", "offline", "disabled")
GIB = 1024**3


def host_peak_rss_gib() -> float:
    """This process's peak resident host memory so far, in GiB (Linux reports ru_maxrss in KiB, macOS in bytes)."""
    scale = 1 if sys.platform == "darwin" else 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale / GIB


@dataclass
class WandbArgs:
    project: Optional[str] = None  # wandb project to log to; null = no wandb
    entity: Optional[str] = None  # wandb team or user; null = your default
    name: Optional[str] = None  # wandb run name; null = the run's name
    group: Optional[str] = None  # wandb group, to see related runs together; null = none
    tags: Optional[list[str]] = None  # wandb tags of the run; null = none
    mode: str = "online"  # "online" | "offline" | "disabled"; the WANDB_MODE env var wins when set
    dir: Optional[str] = None  # where wandb keeps its files; default: the dump dir

    def validate(self) -> None:
        require(self.mode in WANDB_MODES, "logging.wandb.mode", self.mode, f"use one of {', '.join(WANDB_MODES)}")


@dataclass
class LoggingArgs:
    freq: int = 10  # log every `freq` steps
    wandb: Optional[WandbArgs] = None  # None = jsonl only
    # The console: "brief" (rank 0's lines less start-up detail, every rank's warnings) or "all" (every rank's every
    # line); logs/rank_<r>.log holds every line either way.
    console: str = "brief"

    def validate(self) -> None:
        require(self.freq >= 1, "logging.freq", self.freq, "log every N >= 1 steps")
        require(self.console in CONSOLES, "logging.console", self.console, f"use one of {', '.join(CONSOLES)}")
        if self.wandb is not None:
            self.wandb.validate()


def _jsonable(value: Any) -> Any:
    """Turn tensors and numpy scalars into plain Python numbers for json.dumps."""
    if isinstance(value, torch.Tensor):
        return value.item() if value.numel() == 1 else value.tolist()
    if hasattr(value, "item"):
        return value.item()
    raise TypeError(f"metric value of type {type(value).__name__} is not JSON serialisable")


class MetricLogger:
    """Appends one JSON object per `log` call to `path`, and mirrors it to wandb when configured.

    The wandb run id is kept in `run_dir/wandb_run_id` so that a restarted job continues the same run.
    """

    def __init__(self, path: str, wandb_args: Optional[WandbArgs], config: dict, run_dir: str):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # Append: a restarted job keeps the history written before the restart.
        self.file: Optional[TextIO] = open(self.path, "a")
        self.wandb_run = None
        if wandb_args is not None:
            self.wandb_run = self._init_wandb(wandb_args, config, Path(run_dir))

    @staticmethod
    def _init_wandb(args: WandbArgs, config: dict, run_dir: Path):
        import wandb  # imported here: it is slow to import and only the train master needs it

        args.validate()
        mode = os.environ.get("WANDB_MODE") or args.mode
        if mode == "disabled":
            logger.info("wandb disabled; metrics go to the jsonl file only")
            return None
        run_dir.mkdir(parents=True, exist_ok=True)
        id_file = run_dir / "wandb_run_id"
        run_id = id_file.read_text().strip() if id_file.exists() else ""
        if not run_id:
            run_id = uuid.uuid4().hex[:12]
            id_file.write_text(run_id + "\n")
        wandb_dir = Path(args.dir) if args.dir else run_dir
        wandb_dir.mkdir(parents=True, exist_ok=True)
        run = wandb.init(
            id=run_id,
            resume="allow",
            project=args.project,
            entity=args.entity,
            name=args.name,
            group=args.group,
            tags=args.tags,
            mode=mode,
            dir=str(wandb_dir),
            config=config,
            # Our own log files already hold stdout; wrapping the streams would also hide the TTY.
            settings=wandb.Settings(console="off", save_code=False, silent=True),
        )
        # Plot against our "step": after a restart from an older checkpoint wandb's own counter
        # would otherwise drop every row whose step went backwards.
        run.define_metric("*", step_metric="step")
        logger.info(f"wandb run {run_id} ({mode}) in {wandb_dir}")
        return run

    def log(self, metrics: dict) -> None:
        """Write one jsonl line (with a "time" stamp if missing) and send it to wandb."""
        assert self.file is not None, "MetricLogger.log called after close()"
        line = json.dumps({"time": time.time(), **metrics}, default=_jsonable)
        self.file.write(line + "\n")
        self.file.flush()
        if self.wandb_run is not None:
            self.wandb_run.log(json.loads(line))  # the same plain numbers as the file

    def close(self) -> None:
        """Close the file and finish the wandb run; safe to call twice."""
        if self.file is not None:
            self.file.close()
            self.file = None
        if self.wandb_run is not None:
            self.wandb_run.finish()
            self.wandb_run = None

    def __enter__(self) -> "MetricLogger":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class MemoryMonitor:
    """Peak memory of this process on its own device. Local only: never talks to other ranks.

    CUDA: peak allocated/reserved since the last `reset_peak_stats()`, allocator retries and OOMs.
    CPU: peak resident set size of the process (since start; the kernel offers no reset).
    """

    def __init__(self, device):
        self.device = torch.device(device)
        self.is_cuda = self.device.type == "cuda"
        if self.is_cuda:
            if self.device.index is None:
                self.device = torch.device("cuda", torch.cuda.current_device())
            props = torch.cuda.get_device_properties(self.device)
            self.device_name = props.name
            self.capacity_gib = props.total_memory / GIB
            self.reset_peak_stats()
        else:
            self.device_name = "cpu"
            self.capacity_gib = None

    def reset_peak_stats(self) -> None:
        """Start a new peak window (CUDA); a no-op on CPU."""
        if self.is_cuda:
            torch.cuda.reset_peak_memory_stats(self.device)

    def get_peak_stats(self) -> dict[str, float]:
        """{"mem/peak_gib": ..., ...}: peak allocated GiB plus device-specific details."""
        if not self.is_cuda:
            return {"mem/peak_gib": host_peak_rss_gib()}
        stats = torch.cuda.memory_stats(self.device)
        peak_alloc = stats.get("allocated_bytes.all.peak", 0) / GIB
        peak_reserved = stats.get("reserved_bytes.all.peak", 0) / GIB
        return {
            "mem/peak_gib": peak_alloc,
            "mem/peak_reserved_gib": peak_reserved,
            "mem/peak_reserved_pct": 100.0 * peak_reserved / self.capacity_gib,
            "mem/alloc_retries": stats.get("num_alloc_retries", 0),
            "mem/ooms": stats.get("num_ooms", 0),
        }


# Dense bf16 tensor-core peak FLOP/s, matched by substring of the device name (first match wins).
PEAK_BF16_FLOPS = (
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("H200 NVL", 835e12),
    ("H100", 989e12),  # SXM; "NVIDIA H100 80GB HBM3"
    ("H800", 989e12),
    ("H200", 989e12),
    ("GH200", 989e12),
    ("B200", 2250e12),
    ("A100", 312e12),
    ("A800", 312e12),
    ("L40S", 362e12),
    ("L40", 181e12),
    ("L4", 121e12),
    ("MI300X", 1307e12),
    ("MI250X", 383e12),
)


def peak_bf16_flops(device) -> Optional[float]:
    """Peak dense bf16 FLOP/s of `device`, or None on CPU or an unknown accelerator."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(device)
    for key, flops in PEAK_BF16_FLOPS:
        if key in name:
            return flops
    return None


def estimate_mfu(flops_per_token: float, tokens_per_second: float, device) -> Optional[float]:
    """Model FLOPs utilisation in [0, 1]: achieved / peak bf16 FLOP/s of one device.

    `tokens_per_second` must be this device's throughput (not the whole job's).
    """
    peak = peak_bf16_flops(device)
    if peak is None:
        return None
    return flops_per_token * tokens_per_second / peak


def format_duration(seconds: float) -> str:
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m"
    if minutes:
        return f"{minutes}m{secs:02d}s"
    return f"{secs}s"


def _format_count(value: float) -> str:
    for scale, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= scale:
            return f"{value / scale:.1f}{suffix}"
    return f"{value:.0f}"


class ProgressLine:
    """One status line: rewritten in place on a terminal, one log record per update otherwise.

        step 12/100 | loss 3.21 | 4.1k tok/s | teacher wait 12% | ETA 1m05s
    """

    def __init__(self, total_steps: int, stream: TextIO = sys.stderr):
        self.total_steps = total_steps
        self.stream = stream
        self.is_tty = bool(getattr(stream, "isatty", lambda: False)())
        self.first_step: Optional[int] = None
        self.first_time = 0.0
        self.line_open = False

    def eta(self, step: int) -> Optional[str]:
        """Time left at `step`, from the pace since the first step seen (None until there is one)."""
        now = time.monotonic()
        if self.first_step is None:
            self.first_step, self.first_time = step, now
        done = step - self.first_step
        if done <= 0 or step >= self.total_steps:
            return None
        return format_duration((now - self.first_time) / done * (self.total_steps - step))

    def format(self, step: int, metrics: dict) -> str:
        """The status text for `step`."""
        eta = self.eta(step)
        parts = [f"step {step}/{self.total_steps}"]
        loss = metrics.get("loss/total", metrics.get("loss/ce"))
        if loss is not None and math.isfinite(float(loss)):
            parts.append(f"loss {float(loss):.3f}")
        if metrics.get("speed/tokens_per_s") is not None:
            parts.append(f"{_format_count(float(metrics['speed/tokens_per_s']))} tok/s")
        wait, step_time = metrics.get("speed/teacher_wait_s"), metrics.get("speed/step_time_s")
        if wait is not None and step_time:
            parts.append(f"teacher wait {100.0 * float(wait) / float(step_time):.0f}%")
        if eta is not None:
            parts.append(f"ETA {eta}")
        return " | ".join(parts)

    def update(self, step: int, metrics: dict) -> None:
        """Show the status for `step` from the metric keys of the shared metrics contract."""
        line = self.format(step, metrics)
        if self.is_tty:
            # \r back to column 0, \x1b[K clears what a longer previous line left behind.
            self.stream.write("\r" + line + "\x1b[K")
            self.stream.flush()
            self.line_open = True
        else:
            logger.info(line)

    def clear(self) -> None:
        """Erase the in-place line so a log record can be printed; the next update() redraws it."""
        if self.line_open:
            self.stream.write("\r\x1b[K")
            self.stream.flush()
            self.line_open = False

    def close(self) -> None:
        """End the in-place line so later output starts on a fresh line."""
        if self.line_open:
            self.stream.write("\n")
            self.stream.flush()
            self.line_open = False
