"""Optional torch.profiler trace and CUDA memory snapshot over a few chosen training steps.

    with maybe_run_profiler(dump_dir, model, args.profiling, rank, is_master, topo.train_group) as profiler:
        for step in ...:
            ...
            if profiler is not None:
                profiler.step()

Outputs: `dump_dir/<trace_folder>/profile_<rank>/trace_step<N>.json.gz` (open in Perfetto or
chrome://tracing) and, on CUDA, `dump_dir/<trace_folder>/memory_snapshot/rank<rank>_step<N>.pickle`
(drag into https://pytorch.org/memory_viz). `python -m apps.debug.trace_summary TRACE` prints where the traced
steps' time went: GPU busy share, top kernels, the host's outermost ops, its waits, the longest GPU idle gaps.
"""

import contextlib
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
from torch import nn
from torch.autograd.profiler import record_function

from lingua.args import require
from lingua.parallel.collectives import make_dir_for_group

logger = logging.getLogger(__name__)


@dataclass
class ProfilerArgs:
    run: bool = False  # record a memory snapshot and a torch profiler trace (rank 0's windows below)
    trace_folder: str = "profiling"  # folder, inside the dump dir, for the traces and snapshots
    # The memory snapshot records steps [mem_warmup, mem_warmup + mem_steps); the trace records
    # [profile_warmup, profile_warmup + profile_steps). Keep the windows apart: recording memory
    # history slows the steps it covers.
    mem_warmup: int = 100
    mem_steps: int = 2  # steps the memory snapshot records (from step mem_warmup)
    profile_warmup: int = 102  # steps before the profiler trace starts
    profile_steps: int = 2  # steps the profiler trace records

    def validate(self) -> None:
        """Recording windows that start at a step >= 0 and last at least one step."""
        require(bool(self.trace_folder), "profiling.trace_folder", self.trace_folder, "name a folder under dump_dir")
        for key in ("mem_warmup", "profile_warmup"):
            require(getattr(self, key) >= 0, f"profiling.{key}", getattr(self, key), "use 0 or more steps before recording")
        for key in ("mem_steps", "profile_steps"):
            require(getattr(self, key) >= 1, f"profiling.{key}", getattr(self, key),
                    "record at least 1 step, or set profiling.run=false")


def _is_compiled(module: nn.Module) -> bool:
    # torch.compile(m) wraps it in a module holding `_orig_mod`; m.compile() sets `_compiled_call_impl`.
    return any(hasattr(m, "_orig_mod") or getattr(m, "_compiled_call_impl", None) is not None
               for m in module.modules())


class BlockLabels:
    """Names each block of the model's ModuleLists (e.g. "layers.3") as a range in the trace."""

    def __init__(self, module: nn.Module):
        self.blocks = [(f"{parent_name}.{child_name}" if parent_name else child_name, child)
                       for parent_name, parent in module.named_modules() if isinstance(parent, nn.ModuleList)
                       for child_name, child in parent.named_children()]
        self.handles: list = []
        self.open_ranges: list[record_function] = []

    def install(self) -> None:
        for name, block in self.blocks:
            self.handles.append(block.register_forward_pre_hook(self._enter(name)))
            self.handles.append(block.register_forward_hook(self._exit))

    def _enter(self, name: str):
        def hook(module, args):
            label = record_function(f"block {name}")
            label.__enter__()
            self.open_ranges.append(label)
        return hook

    def _exit(self, module, args, output):
        if self.open_ranges:
            self.open_ranges.pop().__exit__(None, None, None)

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []
        # A forward that raised leaves its range open; close it so the trace stays well formed.
        while self.open_ranges:
            self.open_ranges.pop().__exit__(None, None, None)


class StepProfiler:
    """Counts training steps and switches the trace and the memory recording on and off."""

    def __init__(self, trace_dir: Path, module: nn.Module, args: ProfilerArgs, rank: int):
        self.args = args
        self.rank = rank
        self.steps_done = 0
        self.trace_dir = trace_dir / f"profile_{rank}"
        self.trace_dir.mkdir(parents=True, exist_ok=True)
        self.memory_dir: Optional[Path] = None
        self.recording_memory = False
        if torch.cuda.is_available():
            self.memory_dir = trace_dir / "memory_snapshot"
            self.memory_dir.mkdir(parents=True, exist_ok=True)
        # Hooks on a compiled model would force a recompile inside the traced window.
        self.labels = None if _is_compiled(module) else BlockLabels(module)
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        warmup = min(1, args.profile_warmup)  # one untraced profiler warm-up step hides CUPTI start-up cost
        self.torch_profiler = torch.profiler.profile(
            activities=activities,
            schedule=torch.profiler.schedule(wait=args.profile_warmup - warmup, warmup=warmup,
                                             active=args.profile_steps, repeat=1),
            on_trace_ready=self._export_trace,
            record_shapes=True,
        )

    def _export_trace(self, prof: torch.profiler.profile) -> None:
        path = self.trace_dir / f"trace_step{self.args.profile_warmup + self.args.profile_steps}.json.gz"
        prof.export_chrome_trace(str(path))
        logger.info(f"profiler trace of steps [{self.args.profile_warmup}, "
                    f"{self.args.profile_warmup + self.args.profile_steps}) written to {path} (where the time went: "
                    f"python -m apps.debug.trace_summary {path})")

    def _update_windows(self) -> None:
        args, step = self.args, self.steps_done
        if self.memory_dir is not None:
            if step == args.mem_warmup:
                torch.cuda.memory._record_memory_history(max_entries=100_000)
                self.recording_memory = True
            elif step == args.mem_warmup + args.mem_steps and self.recording_memory:
                self._dump_memory_snapshot()
        if self.labels is not None:
            if step == args.profile_warmup:
                self.labels.install()
            elif step == args.profile_warmup + args.profile_steps:
                self.labels.remove()

    def _dump_memory_snapshot(self) -> None:
        path = self.memory_dir / f"rank{self.rank}_step{self.steps_done}.pickle"
        torch.cuda.memory._dump_snapshot(str(path))
        torch.cuda.memory._record_memory_history(enabled=None)
        self.recording_memory = False
        logger.info(f"memory snapshot up to step {self.steps_done} written to {path}")

    def start(self) -> None:
        self.torch_profiler.__enter__()
        self._update_windows()

    def step(self) -> None:
        """Call once at the end of every training step."""
        self.steps_done += 1
        self.torch_profiler.step()
        self._update_windows()

    def stop(self) -> None:
        """Stop everything; a window cut short by the end of training is still written."""
        self.torch_profiler.__exit__(None, None, None)
        if self.labels is not None:
            self.labels.remove()
        if self.recording_memory:
            self._dump_memory_snapshot()


@contextlib.contextmanager
def maybe_run_profiler(dump_dir: str, module: nn.Module, args: ProfilerArgs, rank: int, is_master: bool, group):
    """Yield a `StepProfiler` when `args.run` (call `.step()` after every step), else None.

    The master creates `dump_dir/<trace_folder>` and the ranks of `group` wait for it; `group` may be
    None only in a single process without torch.distributed.
    """
    if not args.run:
        yield None
        return
    args.validate()
    trace_dir = make_dir_for_group(Path(dump_dir) / args.trace_folder, is_master, group,
                                   "maybe_run_profiler's trace dir")
    logger.info(f"profiling on: trace of steps [{args.profile_warmup}, {args.profile_warmup + args.profile_steps})"
                f" into {trace_dir}")
    profiler = StepProfiler(trace_dir, module, args, rank)
    profiler.start()
    try:
        yield profiler
    finally:
        profiler.stop()
