"""The distillers of several teachers (`distillation.teachers`): their KD terms mixed per position by weight and
per data source (`lingua/distillation/mixture.py`), the targets from each teacher's bridge (online, on its own
ranks) or from each teacher's cache (`lingua/distillation/cache/several.py`). Same routing, weights and kd/<i>/*
metrics on both roads."""

from typing import Callable, Optional

import torch

from lingua.distillation.args import DistillationArgs
from lingua.distillation.online.client import TeacherClient
from lingua.distillation.distiller import KDDistiller, heldout_row
from lingua.distillation.mixture import first_error, mixed_head_loss, mixed_log_metrics, mixing_weights, teacher_metrics
from lingua.distillation.outputs import TeacherOutputs


class MixedTeachersDistiller(KDDistiller):
    """The mixed loss of several teachers' targets, wherever they come from; kd/<i>/* per teacher."""

    def __init__(self, args: DistillationArgs, routing: torch.Tensor, device: torch.device):
        super().__init__(args)
        self.routing = routing.to(device)  # [sources, teachers]
        self.cross = [teacher.cross_tokenizer for teacher in args.teachers]

    def begin_step(self, step: int, lr_factor: float) -> None:
        super().begin_step(step, lr_factor)
        self.teacher_stats = None

    def mixed_loss(self, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                   source_ids: Optional[torch.Tensor], outputs: list[TeacherOutputs], n_valid: int) -> torch.Tensor:
        """A micro-batch's loss from every teacher's targets (`source_ids` None: every row of source 0, which
        only a routing without sources allows: each source's row is the same)."""
        if source_ids is None:
            source_ids = torch.zeros(labels.shape[0], dtype=torch.int32)
        weights = mixing_weights(self.routing, source_ids.to(hidden.device), [o.kd_weight for o in outputs],
                                 tuple(labels.shape))
        loss, ce, stats = mixed_head_loss(hidden, weight, labels, outputs, weights, n_valid, self.alpha, self.args)
        self._add_ce(ce)
        self._add_kd_stats(stats[:, :3].sum(0))
        self.teacher_stats = stats if self.teacher_stats is None else self.teacher_stats + stats
        return loss

    def step_metrics(self) -> dict:
        return {**super().step_metrics(), **teacher_metrics(self.teacher_stats, self.cross)}


class CachedTeachersDistiller(MixedTeachersDistiller):
    """Several teachers' caches (`TeacherCaches`): each batch carries every teacher's targets, nothing to wait for;
    each teacher's held-out numbers are those its cache recorded (`heldout`: (CE, bits per byte) per teacher)."""

    def __init__(self, args: DistillationArgs, routing: torch.Tensor, device: torch.device,
                 heldout: list[tuple[Optional[float], Optional[float]]]):
        super().__init__(args, routing, device)
        self.heldout = heldout

    def teacher_heldout_row(self) -> dict:
        row = {}
        for i, (ce, bpb) in enumerate(self.heldout):
            row.update(heldout_row(ce, bpb, f"eval/{i}/"))
        return row

    def submit(self, batch: dict, step: int, micro_step: int):
        return batch.get("source_ids"), batch["teachers"]

    def head_loss(self, labels: torch.Tensor, pending, n_valid: int, timer) -> Callable:
        source_ids, targets = pending

        def mixed_loss(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
            outputs = [target.to(hidden.device, non_blocking=True) for target in targets]
            return self.mixed_loss(hidden, weight, labels, source_ids, outputs, n_valid)
        return mixed_loss


class SeveralTeachersDistiller(MixedTeachersDistiller):
    """Several teachers (`distillation.teachers`), each behind its own bridge: every micro-batch goes to each, and
    the KD term of a position is mixed over the teachers that teach its source (`lingua/distillation/mixture.py`)."""

    def __init__(self, args: DistillationArgs, clients: list[TeacherClient], prefetch: int, routing: torch.Tensor):
        super().__init__(args, routing, clients[0].device)
        self.clients, self.prefetch = clients, prefetch
        self.blame = 0  # 1 + the index of the teacher whose failure the students agreed on

    @property
    def first_round_trip(self) -> Optional[tuple[float, float]]:
        return self.clients[0].first_round_trip

    def begin_step(self, step: int, lr_factor: float) -> None:
        super().begin_step(step, lr_factor)
        for client in self.clients:
            client.wait_clock.new_step()

    def submit(self, batch: dict, step: int, micro_step: int):
        # As one teacher's: another tokenizer's teacher aligns the window's last position through the label past it.
        next_tokens = batch["labels"][:, -1] if "labels" in batch else None
        handles = [client.submit(batch["input_ids"], step, micro_step,
                                 batch.get("doc_ids") if client.spec.doc_boundaries else None,
                                 next_tokens if client.spec.kd_weight else None)
                   for client in self.clients]
        return batch["source_ids"], handles

    def head_loss(self, labels: torch.Tensor, pending, n_valid: int, timer) -> Callable:
        source_ids, handles = pending

        def mixed_loss(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
            with timer.part("teacher_wait"):
                outputs = [handle.wait().to(hidden.device) for handle in handles]
            return self.mixed_loss(hidden, weight, labels, source_ids, outputs, n_valid)
        return mixed_loss

    def control_flags(self) -> dict:
        flags = [client.response_flags() for client in self.clients]
        return {key: torch.stack([f[key] for f in flags]).amax() for key in flags[0]}

    def after_agreement(self, flags: dict) -> None:
        for kind, key in (("error", "teacher_error"), ("nan", "teacher_nan")):
            if flags.get(key):
                self.blame, error = first_error(self.clients, kind)
                raise error

    def mark_first_step_done(self) -> None:
        for client in self.clients:
            client.mark_first_step_done()

    def announce_pause(self, pause_follows: bool) -> None:
        for client in self.clients:
            client.announce_pause(pause_follows)

    def drain(self) -> None:
        for client in self.clients:
            client.drain()

    def log_metrics(self, timer) -> dict:
        return mixed_log_metrics(self.clients)

    def teacher_heldout_row(self) -> dict:
        row = {}
        for i, client in enumerate(self.clients):
            row.update(heldout_row(client.teacher_heldout_ce, client.teacher_heldout_bpb, f"eval/{i}/"))
        return row

    def stop(self, step: int, error: bool = False) -> None:
        """STOP (or ERROR naming the failed teacher) to every teacher, in teacher order: one that reports an error at
        STOP does not keep the others waiting for theirs."""
        failure = None
        for client in self.clients:
            try:
                client.stop(step, error=error, blame=self.blame)
            except Exception as err:
                failure = failure or err
        if failure is not None:
            raise failure

    def report_exit(self) -> None:
        for client in self.clients:
            client.report_exit()
