"""The cache road's distiller: every teacher's targets come with each batch (`TeacherCaches`), nothing to wait for."""

from typing import Optional

import torch

from lingua.distillation.distiller import KDDistiller
from lingua.distillation.outputs import TeacherOutputs


class CacheDistiller(KDDistiller):
    """Targets from the teachers' caches (`batch["teachers"]`, one per teacher); each teacher's held-out numbers are
    those its cache recorded."""

    def submit(self, batch: dict, step: int, micro_step: int):
        return batch.get("source_ids"), batch["teachers"]

    def targets(self, pending, device: torch.device, timer) -> tuple[Optional[torch.Tensor], list[TeacherOutputs]]:
        source_ids, targets = pending
        return source_ids, [target.to(device, non_blocking=True) for target in targets]
