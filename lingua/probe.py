"""Activation and gradient probe: summary statistics of module outputs on chosen steps.

    probe = ActivationProbe(model, dump_dir, rank=topo.train_rank, is_master=..., group=topo.train_group)
    with probe.capture(step):
        loss = loss_fn(model(x), y)
        loss.backward()

writes, for every probed module, one "act" and one "grad" line per step to
`dump_dir/probe/probe.<rank>.jsonl`: {"step", "module", "kind", "mean", "std", "absmax", "zero_frac"}.
"""

import contextlib
import json
import logging
from pathlib import Path
from typing import Optional

import torch
from torch import nn

from lingua.parallel.collectives import make_dir_for_group

logger = logging.getLogger(__name__)

STAT_NAMES = ("mean", "std", "absmax", "zero_frac")


def is_probed_module(module: nn.Module, parent: Optional[nn.Module]) -> bool:
    """Linear and embedding layers, normalisation layers, and the blocks of any ModuleList."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        return True
    if "Norm" in type(module).__name__:
        return True
    return isinstance(parent, nn.ModuleList)


def tensor_stats(tensor: torch.Tensor) -> Optional[torch.Tensor]:
    """[mean, std, absmax, zero_frac] as one float32 tensor on the tensor's device (no host sync).

    Reductions run on the native dtype (accumulating in float) so a large bf16 activation such as
    the logits is never copied to float32.
    """
    from torch.distributed.tensor import DTensor  # here, not at import: see lingua/checkpoint.py's docstring

    if isinstance(tensor, DTensor):
        tensor = tensor.to_local()
    tensor = tensor.detach()
    if not tensor.is_floating_point() or tensor.numel() == 0:
        return None
    std, mean = torch.std_mean(tensor, correction=0)
    low, high = torch.aminmax(tensor)
    absmax = torch.maximum(low.abs(), high.abs())
    zero_frac = 1.0 - torch.count_nonzero(tensor).float() / tensor.numel()
    return torch.stack([mean.float(), std.float(), absmax.float(), zero_frac.float()])


def _first_tensor(output) -> Optional[torch.Tensor]:
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, (tuple, list)):
        for item in output:
            if isinstance(item, torch.Tensor):
                return item
    return None


class ActivationProbe:
    """Records output ("act") and output-gradient ("grad") statistics of Linear, norm and block modules.

    Statistics are computed on what this rank holds: for a DTensor output that is the local shard
    (`to_local()`), so with tensor/sequence parallelism each rank's lines describe its own shard.
    Each module's first call inside a capture window is recorded (later calls of the same module,
    e.g. activation-checkpoint recomputation or extra micro-batches, are ignored). Under
    torch.compile, adding and removing the hooks makes the probed step recompile.
    """

    def __init__(self, model: nn.Module, dump_dir: str, rank: int, is_master: bool, group, every: int = 1):
        self.model = model
        self.every = every  # probe every `every` training steps (`should_run`)
        self.rank = rank
        self.probe_dir = Path(dump_dir) / "probe"
        self.path = self.probe_dir / f"probe.{rank}.jsonl"
        self.modules: list[tuple[str, nn.Module]] = []
        for parent_name, parent in model.named_modules():
            for child_name, module in parent.named_children():
                if is_probed_module(module, parent):
                    self.modules.append((f"{parent_name}.{child_name}" if parent_name else child_name, module))
        make_dir_for_group(self.probe_dir, is_master, group, "ActivationProbe's probe dir")
        self.step: Optional[int] = None
        self.records: dict[tuple[str, str], torch.Tensor] = {}
        self.handles: list = []

    def _forward_hook(self, name: str):
        def hook(module, args, output):
            tensor = _first_tensor(output)
            if tensor is None or (name, "act") in self.records:
                return
            stats = tensor_stats(tensor)
            if stats is None:
                return
            self.records[(name, "act")] = stats
            if tensor.requires_grad:
                self.handles.append(tensor.register_hook(self._grad_hook(name)))
        return hook

    def _grad_hook(self, name: str):
        def hook(grad):
            if (name, "grad") not in self.records and grad is not None:
                stats = tensor_stats(grad)
                if stats is not None:
                    self.records[(name, "grad")] = stats
        return hook

    def should_run(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0

    @contextlib.contextmanager
    def capture(self, step: int):
        """Hook every probed module while the body runs (forward and backward), then `write()`."""
        assert not self.handles, "ActivationProbe.capture is not re-entrant"
        self.step = step
        self.records = {}
        self.handles = [module.register_forward_hook(self._forward_hook(name)) for name, module in self.modules]
        try:
            yield self
        finally:
            for handle in self.handles:
                handle.remove()
            self.handles = []
            self.write()

    def write(self) -> None:
        """Append the records of the current step to `probe.<rank>.jsonl` (one host sync) and clear them."""
        if not self.records:
            return
        keys = list(self.records)
        device = self.records[keys[0]].device
        values = torch.stack([self.records[key].to(device) for key in keys]).cpu().tolist()
        # Dump dirs may be node-local: every rank makes sure its own directory exists.
        self.probe_dir.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a") as f:
            for (name, kind), stats in zip(keys, values):
                row = {"step": self.step, "module": name, "kind": kind, **dict(zip(STAT_NAMES, stats))}
                f.write(json.dumps(row) + "\n")
        logger.debug(f"probe: wrote {len(keys)} records for step {self.step} to {self.path}")
        self.records = {}
