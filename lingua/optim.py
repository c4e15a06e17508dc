"""AdamW with two parameter groups, learning-rate schedules, and gradient clipping that works with FSDP2.

`lr_factor(step, args, n_steps)` is the multiplier of `args.lr` for the update numbered `step`
(0 = the first update), as `LambdaLR` calls it. Every schedule ramps linearly over `warmup` updates
to the full learning rate, then:
  constant  stays at 1.
  linear    goes down linearly to `lr_min_ratio` at `n_steps`.
  cosine    follows a cosine down to `lr_min_ratio` at `n_steps` (`cosine_theta` warps its progress,
            `cycle_length` < 1 makes it come back up after reaching the minimum).
  inv_sqrt  decays as sqrt(warmup / step), never below `lr_min_ratio`.
  wsd       warmup-stable-decay: stays at 1, then the last `decay_fraction` of the steps decay to
            `lr_min_ratio` along a 1-sqrt curve (the cooldown shape that works best for WSD).
"""

import logging
import math
from dataclasses import dataclass
from functools import partial
from typing import Iterable

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from lingua.args import require

logger = logging.getLogger(__name__)

SCHEDULERS = ("constant", "linear", "cosine", "inv_sqrt", "wsd")
IMPLEMENTATIONS = ("auto", "fused", "foreach", "for_loop")
FUSED_DEVICE_TYPES = ("cuda", "cpu")  # where torch has fused AdamW kernels (auto picks them)


@dataclass
class OptimArgs:
    lr: float = 3e-4  # AdamW's peak learning rate, reached at the end of warmup
    weight_decay: float = 0.1  # AdamW's decoupled weight decay per step (times the lr)
    epsilon: float = 1e-8  # AdamW's epsilon, added to the second moment's root
    beta1: float = 0.9  # AdamW's first-moment (gradient average) decay per step
    beta2: float = 0.95  # AdamW's second-moment (squared gradient average) decay per step
    clip: float = 1.0  # max global gradient norm; <= 0 measures the norm without clipping
    scheduler: str = "cosine"  # "constant" | "linear" | "cosine" | "inv_sqrt" | "wsd"
    warmup: int = 100  # steps of linear warmup from 0 to optim.lr
    lr_min_ratio: float = 0.1  # the schedule's final lr as a share of optim.lr
    cycle_length: float = 1.0  # cosine: fraction of the post-warmup steps one decay takes
    cosine_theta: float = 1.0  # cosine: progress is raised to this power before the cosine
    decay_fraction: float = 0.1  # wsd: fraction of all steps spent in the final decay
    # AdamW's kernels: "fused" (one kernel per dtype and device), "foreach" (multi-tensor ops) or "for_loop" (ops
    # per parameter). "auto": fused (torch has it for CUDA and the CPU; foreach elsewhere). On the CPU it gives the
    # loop's metrics to fp32 rounding for under half its host time (docs/benchmarks.md, 2026-12-06). Explicit, because
    # torch picks the multi-tensor path only when both foreach and fused are None (DTensor is among its
    # foreach-supported types): the old fused=False with foreach=None meant the per-parameter loop, which took
    # 159 ms of a 139M student's step on an H100's host, the GPU idle (docs/gpu/README.md, 2026-11-27).
    implementation: str = "auto"

    def validate(self) -> None:
        """A known schedule and values AdamW and the schedule can work with."""
        require(self.implementation in IMPLEMENTATIONS, "optim.implementation", self.implementation,
                f"use one of {', '.join(IMPLEMENTATIONS)}")
        require(self.scheduler in SCHEDULERS, "optim.scheduler", self.scheduler, f"use one of {', '.join(SCHEDULERS)}")
        require(math.isfinite(self.lr) and self.lr > 0, "optim.lr", self.lr, "use a positive learning rate")
        require(self.warmup >= 0, "optim.warmup", self.warmup, "use 0 or a positive number of steps")
        require(math.isfinite(self.weight_decay) and self.weight_decay >= 0, "optim.weight_decay", self.weight_decay,
                "use 0 (no decay) or a positive number")
        require(math.isfinite(self.epsilon) and self.epsilon > 0, "optim.epsilon", self.epsilon,
                "use a small positive number such as 1e-8")
        for key in ("beta1", "beta2"):
            require(0.0 <= getattr(self, key) < 1.0, f"optim.{key}", getattr(self, key), "use a value in [0, 1)")
        require(not math.isnan(self.clip), "optim.clip", self.clip,
                "use the max gradient norm, or 0 to measure the norm without clipping")
        for key in ("lr_min_ratio", "decay_fraction"):
            require(0.0 <= getattr(self, key) <= 1.0, f"optim.{key}", getattr(self, key), "use a value in [0, 1]")
        for key in ("cycle_length", "cosine_theta"):
            value = getattr(self, key)
            require(math.isfinite(value) and value > 0, f"optim.{key}", value, "use a positive number")


def lr_factor(step: int, args: OptimArgs, n_steps: int) -> float:
    """Multiplier of `args.lr` for update number `step` (0-based); see the module docstring."""
    assert args.scheduler in SCHEDULERS, args.scheduler  # OptimArgs.validate() names the choices
    if step < args.warmup:
        # (step + 1) so that the very first update already moves the weights.
        return (step + 1) / args.warmup
    min_ratio = args.lr_min_ratio
    progress = min(1.0, (step - args.warmup) / max(1, n_steps - args.warmup))
    if args.scheduler == "constant":
        return 1.0
    if args.scheduler == "linear":
        return 1.0 - progress * (1.0 - min_ratio)
    if args.scheduler == "cosine":
        phase = progress ** args.cosine_theta / args.cycle_length
        return min_ratio + 0.5 * (1.0 - min_ratio) * (1.0 + math.cos(math.pi * phase))
    if args.scheduler == "inv_sqrt":
        warmup = max(args.warmup, 1)
        return max(min_ratio, math.sqrt(warmup / max(step, warmup)))
    decay_steps = round(args.decay_fraction * n_steps)
    decay_start = max(args.warmup, n_steps - decay_steps)
    if step < decay_start or decay_steps == 0:
        return 1.0
    decay_progress = min(1.0, (step - decay_start) / max(1, n_steps - decay_start))
    return min_ratio + (1.0 - min_ratio) * (1.0 - math.sqrt(decay_progress))


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on matrices (>= 2-D, embeddings included), none on norms, biases and other 1-D params.

    Embeddings are decayed like any other matrix: with tied embeddings they are also the output
    projection, and decaying them is what GPT-2/Llama-style recipes do.
    """
    decay, no_decay = [], []
    for param in model.parameters():
        if param.requires_grad:
            (decay if param.ndim >= 2 else no_decay).append(param)
    groups = [{"params": decay, "weight_decay": weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


def build_optimizer(model: nn.Module, args: OptimArgs, n_steps: int) -> tuple[torch.optim.Optimizer, LambdaLR]:
    """AdamW over `model` (two weight-decay groups) and its LambdaLR schedule over `n_steps` updates."""
    args.validate()
    assert n_steps >= 1, n_steps  # TrainArgs.validate() checks steps
    implementation = args.implementation
    if implementation == "auto":
        fused_here = all(p.device.type in FUSED_DEVICE_TYPES for p in model.parameters())
        implementation = "fused" if fused_here else "foreach"
    optimizer = torch.optim.AdamW(
        param_groups(model, args.weight_decay), lr=args.lr, betas=(args.beta1, args.beta2), eps=args.epsilon,
        foreach=implementation == "foreach", fused=implementation == "fused",
    )
    # partial (not a lambda) keeps the scheduler's state_dict JSON-serialisable.
    scheduler = LambdaLR(optimizer, partial(lr_factor, args=args, n_steps=n_steps))
    return optimizer, scheduler


def clip_grad_norm_(parameters: Iterable[torch.Tensor], max_norm: float) -> torch.Tensor:
    """Clip gradients to a global L2 norm of `max_norm` (skip clipping if <= 0); return the norm before,
    as a 0-d tensor on the gradients' device (reading it is a host sync: the trainer does on log steps).

    Works for plain tensors and for FSDP2-sharded DTensor grads, where the norm of the local shards is
    reduced over the mesh (the training group) by DTensor itself.
    """
    params = [p for p in parameters if p.grad is not None]
    if not params:
        return torch.zeros(())
    from torch.distributed.tensor import DTensor  # here, not at import: see lingua/checkpoint.py's docstring

    total_norm = torch.nn.utils.get_total_norm([p.grad for p in params], norm_type=2.0)
    if isinstance(total_norm, DTensor):
        total_norm = total_norm.full_tensor()
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total_norm)
    return total_norm
