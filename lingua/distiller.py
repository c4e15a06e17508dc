"""The Distiller: the one object the student loop asks for the KD part of a step.

    distiller = build_distiller(args, topo, tokenizer, phases)
    distiller.begin_step(step, lr_factor)                    # alpha for this step
    pending = distiller.submit(input_ids, step, micro_step)  # ask for this micro-batch's teacher targets
    loss = distiller.loss(ce, logits, pending, mask, weight, timer)   # CE alone, or (1-a) CE + a T^2 KD
    metrics = distiller.step_metrics(ce_sum)                 # loss/total (+ loss/kd, kd/* with a teacher)
    distiller.stop(step, error=False)                        # at the end, or on an agreed error

Kinds: `NoDistiller` (enable_distillation=false: every rank trains on CE) and `OnlineDistiller`
(a teacher rank behind a bridge, `lingua/teacher_client.py`). The loop never asks which one it has.
"""

import contextlib
import logging
from typing import Callable, Optional

import torch

from lingua.collectives import AgreedError
from lingua.distillation import DistillationArgs
from lingua.kd_loss import alpha_at, distillation_loss, kd_loss
from lingua.teacher_client import TeacherClient

logger = logging.getLogger(__name__)

TEACHER_BOUND_SHARE = 0.3  # warn when students wait on the teacher more than this share of a step


class NoDistiller:
    """enable_distillation=false: no teacher, the loss is the CE the loop computed."""

    teacher_preempt = False  # a teacher's preemption signal, folded into the students' agreed flags
    first_round_trip: Optional[tuple[float, float]] = None  # wall-clock (submit, done) of the first request

    def begin_step(self, step: int, lr_factor: float) -> None:
        pass

    def submit(self, input_ids: torch.Tensor, step: int, micro_step: int):
        return None

    def loss(self, ce: torch.Tensor, logits: torch.Tensor, pending, mask: torch.Tensor, weight: float, timer):
        return ce

    def step_metrics(self, ce: float) -> dict:
        return {"loss/total": ce}

    def log_metrics(self, timer) -> dict:
        """Extra keys of a log row (teacher wait and the teacher's clocks, with a teacher)."""
        return {}

    def log_words(self, row: dict) -> tuple[str, str]:
        """(loss words, speed words) for the log line."""
        return "", ""

    def check_bottleneck(self, row: dict) -> None:
        pass

    def stop(self, step: int, error: bool = False) -> None:
        pass

    @contextlib.contextmanager
    def stop_on_agreed_error(self, current_step: Callable[[], int]):
        """An error the students raise together (`AgreedError`: a non-finite loss, different loop lengths)
        reaches the teacher too, as an ERROR request, before it propagates."""
        try:
            yield
        except AgreedError:
            self.stop(current_step(), error=True)
            raise

    def summary(self, last_row: dict) -> tuple[str, list[str]]:
        """(words after "final CE x", extra lines) for the end-of-run summary."""
        return "", []


class OnlineDistiller(NoDistiller):
    """A teacher rank serves this student's bridge; its sparse outputs feed the KD loss."""

    def __init__(self, args: DistillationArgs, client: TeacherClient):
        self.args, self.client = args, client
        self.alpha = args.alpha
        self.totals: dict[str, float] = {}
        self.warned_teacher_bound = False  # once per launch: the progress line keeps showing the share

    @property
    def teacher_preempt(self) -> bool:
        return self.client.teacher_preempt

    @property
    def first_round_trip(self) -> Optional[tuple[float, float]]:
        return self.client.first_round_trip

    def begin_step(self, step: int, lr_factor: float) -> None:
        self.alpha = alpha_at(step, self.args.alpha, self.args.alpha_schedule, lr_factor)
        self.totals = dict(kd=0.0, teacher_mass=0.0, top1_agreement=0.0)

    def submit(self, input_ids: torch.Tensor, step: int, micro_step: int):
        return self.client.submit(input_ids, step, micro_step)

    def loss(self, ce: torch.Tensor, logits: torch.Tensor, pending, mask: torch.Tensor, weight: float, timer):
        """(1 - alpha) * CE + alpha * T^2 * KD, KD weighted by this micro-batch's share of the step's tokens."""
        with timer.part("teacher_wait"):
            teacher_outputs = pending.wait().to(logits.device)
        args = self.args
        kd, stats = kd_loss(logits, teacher_outputs, mask, args.temperature, args.divergence, args.jsd_beta,
                            args.loss_chunk_size)
        for key in self.totals:
            self.totals[key] += stats[key] * weight
        return distillation_loss(ce, kd * weight, self.alpha, args.temperature)

    def step_metrics(self, ce: float) -> dict:
        return {"loss/kd": self.totals["kd"], "kd/teacher_mass": self.totals["teacher_mass"],
                "kd/top1_agreement": self.totals["top1_agreement"], "kd/alpha": self.alpha,
                "loss/total": distillation_loss(ce, self.totals["kd"], self.alpha, self.args.temperature)}

    def log_metrics(self, timer) -> dict:
        # Teacher busy/idle seconds, its peak memory and this rank's bridge bytes, cumulative since launch
        # (a benchmark differences two rows).
        return {"speed/teacher_wait_s": timer.seconds.get("teacher_wait", 0.0), **self.client.metrics()}

    def log_words(self, row: dict) -> tuple[str, str]:
        wait_share = row.get("speed/teacher_wait_s", 0.0) / row["speed/step_time_s"]
        return (f" kd {row['loss/kd']:.4f} agree {row['kd/top1_agreement']:.3f}",
                f" teacher wait {100 * wait_share:.0f}%")

    def check_bottleneck(self, row: dict) -> None:
        wait_share = row.get("speed/teacher_wait_s", 0.0) / row["speed/step_time_s"]
        if wait_share > TEACHER_BOUND_SHARE and not self.warned_teacher_bound:
            self.warned_teacher_bound = True
            logger.warning(f"students spend {100 * wait_share:.0f}% of the step waiting on the teacher: the teacher "
                           f"is the bottleneck (add teacher ranks or use a smaller teacher)")

    def stop(self, step: int, error: bool = False) -> None:
        self.client.stop(step, error=error)

    def summary(self, last_row: dict) -> tuple[str, list[str]]:
        return (f", KD {last_row.get('loss/kd', float('nan')):.4f}, teacher-student top-1 agreement "
                f"{last_row.get('kd/top1_agreement', float('nan')):.3f}",
                [f"time waiting on the teacher: {self.client.total_wait_s:.1f}s on this rank "
                f"(teacher busy {100 * self.client.teacher_busy:.0f}%)"])


def tokenizer_vocab(tokenizer) -> dict:
    """The token -> id map used to check that students and teacher share a tokenizer."""
    hf = getattr(tokenizer, "tokenizer", None)
    if hf is not None and hasattr(hf, "get_vocab"):
        return hf.get_vocab()
    return {f"<{type(tokenizer).__name__}:{tokenizer.n_words}>": 0}


def build_distiller(enable_distillation: bool, args: DistillationArgs, topo, tokenizer, max_bsz: int,
                    max_seqlen: int, phases=None):
    """The Distiller for this student: none, or the online bridge (its handshake runs here)."""
    if not enable_distillation:
        return NoDistiller()
    with phases.span("teacher_handshake") if phases is not None else contextlib.nullcontext():
        client = TeacherClient(args, topo, tokenizer_vocab(tokenizer), tokenizer.n_words, max_bsz, max_seqlen)
    return OnlineDistiller(args, client)
