"""The Distiller: the one object the student loop asks for the KD part of a step.

    distiller = build_distiller(args.enable_distillation, args.distillation, topo, tokenizer,  # (build.py)
                                (args.data.batch_size, args.data.seq_len), args.model.attn_mask, cache, phases)
    distiller.begin_step(step, lr_factor)                      # alpha for this step, fresh stats
    pending = distiller.submit(batch, step, micro_step)        # ask for this micro-batch's teacher targets
    head_loss = distiller.head_loss(labels, pending, n_valid, timer)
    loss = model(input_ids, doc_ids=..., head_loss=head_loss)  # the model calls head_loss(hidden, head_weight)
    flags = distiller.control_flags()                          # device flags for the step's agreed point
    distiller.after_agreement(agreed)                          # raises the teacher's error on every student
    metrics = distiller.step_metrics()                         # loss/ce, loss/total (+ loss/kd, kd/*): tensors
    distiller.stop(step, error=False)                          # drains requests in flight, then STOP
    with distiller.stop_on_agreed_error(current_step): ...     # around the loop: an agreed error drains, sends ERROR

Kinds: `NoDistiller` (enable_distillation=false: every rank trains on CE), `OnlineDistiller` (a
teacher rank behind a bridge, `lingua/distillation/online/client.py`), `SeveralTeachersDistiller` (one bridge per teacher
of `distillation.teachers`, their KD terms mixed by `lingua/distillation/mixture.py`), `CacheDistiller` (the
offline teacher cache, `lingua/distillation/cache/store.py`, whose batches carry the targets) and
`CachedTeachersDistiller` (several teachers' caches, mixed the same way; both kinds of several teachers live in
`lingua/distillation/mixed_distillers.py`). The loop never asks which one it has;
`Distiller` lists all it may ask (what a log line or the summary says is the reporter's business,
apps/main/report.py, from the metrics). The loss of a micro-batch is ((1 - alpha) * CE_sum + alpha * T^2 *
KD_sum) / n_valid, n_valid being the step's count of trained-on tokens, so micro-batches add up to one large
batch. Statistics stay on the device; the loop reads them on log steps only.
"""

import contextlib
import logging
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from lingua.distillation.args import DistillationArgs, alpha_at
from lingua.distillation.online.client import TeacherClient
from lingua.distillation.loss.divergences import distillation_loss
from lingua.distillation.loss.fused import fused_linear_kd_loss
from lingua.distillation.outputs import TeacherOutputs
from lingua.distillation.loss.reference import kd_loss_and_stats
from lingua.parallel.collectives import AgreedError
from lingua.transformer import cross_entropy_sum

logger = logging.getLogger(__name__)

REFERENCE_CHUNK_SIZE = 1024  # positions per chunk of kd_loss when distillation.loss_chunk_size=0 (auto)


class Distiller:
    """What the student loop asks of the KD part of a step; the defaults are those of a run without teacher
    traffic (no requests, nothing to agree on, nothing to drain)."""

    prefetch = 0  # requests submitted ahead of the micro-batch being computed
    teacher_heldout_ce: Optional[float] = None  # the teacher's own held-out CE, when known (logged with the eval)
    teacher_heldout_bpb: Optional[float] = None  # the same in bits per byte
    first_round_trip: Optional[tuple[float, float]] = None  # wall-clock (submit, done) of the first request

    def __init__(self, args: DistillationArgs):
        self.args = args

    def teacher_heldout_row(self) -> dict:
        """The teacher's own held-out numbers for the first eval row, each where known: eval/teacher_loss and
        eval/teacher_bpb (with several teachers eval/<i>/teacher_loss and eval/<i>/teacher_bpb, as kd/<i>/...)."""
        return heldout_row(self.teacher_heldout_ce, self.teacher_heldout_bpb)

    def begin_step(self, step: int, lr_factor: float) -> None:
        """A new step: fresh statistics (and the KD weight for this step)."""
        self.ce_sum: Optional[torch.Tensor] = None  # the step's CE (divided by n_valid), summed over micro-batches

    def submit(self, batch: dict, step: int, micro_step: int):
        """Ask for a micro-batch's teacher targets; returns what `head_loss` takes as `pending`."""
        return None

    def head_loss(self, labels: torch.Tensor, pending, n_valid: int, timer) -> Callable:
        """The loss of a micro-batch as a function of the model's final hidden states and its head weight."""
        raise NotImplementedError

    def step_metrics(self) -> dict:
        """This step's loss metrics as device tensors (read on log steps only)."""
        raise NotImplementedError

    def control_flags(self) -> dict:
        """Device flags for the step's agreed control point (the teacher's error and preemption bits)."""
        return {}

    def after_agreement(self, flags: dict) -> None:
        """Acts on the agreed flags that concern the teacher (its error is raised here, on every student)."""

    def mark_first_step_done(self) -> None:
        """This launch's first step is over (the teacher may switch to the training timeout)."""

    def announce_pause(self, pause_follows: bool) -> None:
        """Whether the step about to run is followed by a long pause of the students (an in-process checkpoint
        evaluation); a teacher rank is told with every request posted during the step."""

    def log_metrics(self, timer) -> dict:
        """Extra keys of a log row (teacher wait and the teacher's clocks, with a teacher)."""
        return {}

    def drain(self) -> None:
        """Wait for every request in flight (before a save, STOP or an agreed error)."""

    def stop(self, step: int, error: bool = False) -> None:
        """The end of this launch (or an agreed error): the teacher leaves its loop."""

    def report_exit(self) -> None:
        """As the loop is left, on every path: say how many teacher requests were left unwaited."""

    @contextlib.contextmanager
    def stop_on_agreed_error(self, current_step: Callable[[], int]):
        """An error the students raise together (`AgreedError`: a non-finite loss, different loop lengths, a
        teacher's failure) reaches the teacher too, as an ERROR request after the requests in flight, before it
        propagates. Any other error is this rank's own: it leaves without talking to the teacher (its peers may
        be blocked in a collective it never joins) and its process groups are aborted on the way out."""
        try:
            yield
        except AgreedError:
            self.stop(current_step(), error=True)
            raise
        finally:
            self.report_exit()

    def _add_ce(self, ce: torch.Tensor) -> None:
        ce = ce.detach().double()
        self.ce_sum = ce if self.ce_sum is None else self.ce_sum + ce


class NoDistiller(Distiller):
    """enable_distillation=false: no teacher, the loss is the student's CE, fused with the output head like the KD
    loss (no [tokens, vocab] logits), so a CE baseline pays what the KD run pays for its head."""

    def head_loss(self, labels: torch.Tensor, pending, n_valid: int, timer) -> Callable:
        def ce_loss(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
            if not self.args.fused_loss:  # the reference: logits, then CE
                ce = cross_entropy_sum(F.linear(hidden, weight), labels) / max(n_valid, 1)
                self._add_ce(ce)
                return ce
            loss, sums = fused_linear_kd_loss(hidden, weight, labels, None, max(n_valid, 1), 0.0, 1.0,
                                              chunk_size=self.args.loss_chunk_size,
                                              weight_grad=self.args.loss_weight_grad,
                                              compiled=self.args.compiles_loss(False, hidden.device))
            self._add_ce(sums[0] / max(n_valid, 1))
            return loss
        return ce_loss

    def step_metrics(self) -> dict:
        return {"loss/ce": self.ce_sum, "loss/total": self.ce_sum}


class KDDistiller(Distiller):
    """The KD loss mixing shared by every teacher source; a subclass says where a micro-batch's targets come from."""

    def __init__(self, args: DistillationArgs):
        super().__init__(args)
        self.alpha = args.alpha

    def begin_step(self, step: int, lr_factor: float) -> None:
        super().begin_step(step, lr_factor)
        self.alpha = alpha_at(step, self.args.alpha, self.args.alpha_schedule, lr_factor)
        self.kd_stats = None  # (kd, teacher_mass, top1_agreement), each weighted by its micro-batch's share

    def targets(self, pending, device: torch.device, timer) -> TeacherOutputs:
        """The teacher outputs of a micro-batch, on `device`."""
        raise NotImplementedError
    def head_loss(self, labels: torch.Tensor, pending, n_valid: int, timer) -> Callable:
        """(1 - alpha) * CE + alpha * T^2 * KD; the targets are asked for only when the head is reached, so an
        online teacher's forward overlaps the student's trunk even without look-ahead."""
        args = self.args

        def distillation_head_loss(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
            if args.fused_loss:
                return self._fused_head_loss(hidden, weight, labels, pending, n_valid, timer)
            logits = F.linear(hidden, weight)
            mask = labels != -100
            weight_of_batch = mask.sum() / max(n_valid, 1)  # this micro-batch's share of the step's tokens
            ce = cross_entropy_sum(logits, labels) / max(n_valid, 1)
            teacher_outputs = self.targets(pending, logits.device, timer)
            kd, stats = kd_loss_and_stats(logits, teacher_outputs, mask, args.temperature, args.divergence,
                                          args.jsd_beta, args.loss_chunk_size or REFERENCE_CHUNK_SIZE,
                                          kd_weight=teacher_outputs.kd_weight, uld_weight=args.uld_weight,
                                          uld_k=args.uld_k)
            self._add_ce(ce)
            self._add_kd_stats(self._with_aligned(stats.double() * weight_of_batch, teacher_outputs, labels,
                                                  n_valid))
            return distillation_loss(ce, kd * weight_of_batch, self.alpha, args.temperature)
        return distillation_head_loss

    def _fused_head_loss(self, hidden, weight, labels, pending, n_valid: int, timer) -> torch.Tensor:
        """The same loss and statistics without [tokens, vocab] logits: `fused_linear_kd_loss` walks the head in
        chunks and computes both gradients in its forward."""
        args, normalizer = self.args, max(n_valid, 1)
        teacher_outputs = self.targets(pending, hidden.device, timer)
        loss, sums = fused_linear_kd_loss(hidden, weight, labels, teacher_outputs, normalizer, self.alpha,
                                          args.temperature, args.divergence, args.jsd_beta, args.loss_chunk_size,
                                          kd_weight=teacher_outputs.kd_weight, weight_grad=args.loss_weight_grad,
                                          compiled=args.compiles_loss(True, hidden.device), uld_weight=args.uld_weight,
                                          uld_k=args.uld_k)
        sums = sums.double() / normalizer  # (CE, KD, teacher mass, top-1 agreement) summed over positions
        self._add_ce(sums[0])
        self._add_kd_stats(self._with_aligned(sums[1:], teacher_outputs, labels, n_valid))
        return loss

    @staticmethod
    def _with_aligned(stats: torch.Tensor, teacher_outputs: TeacherOutputs, labels: torch.Tensor,
                      n_valid: int) -> torch.Tensor:
        """Cross-tokenizer targets add a fourth statistic: the share of the step's positions with a target."""
        if teacher_outputs.kd_weight is None:
            return stats
        aligned = (teacher_outputs.kd_weight * (labels != -100)).sum().double() / max(n_valid, 1)
        return torch.cat([stats, aligned.reshape(1).to(stats.device)])

    def _add_kd_stats(self, stats: torch.Tensor) -> None:
        self.kd_stats = stats if self.kd_stats is None else self.kd_stats + stats

    def step_metrics(self) -> dict:
        kd, mass, agreement, *aligned = self.kd_stats.unbind()
        return {"loss/ce": self.ce_sum, "loss/kd": kd, "kd/teacher_mass": mass, "kd/top1_agreement": agreement,
                "kd/alpha": self.alpha, "loss/total": distillation_loss(self.ce_sum, kd, self.alpha,
                                                                        self.args.temperature),
                **({"kd/aligned": aligned[0]} if aligned else {})}


class CacheDistiller(KDDistiller):
    """Targets from the offline teacher cache: they come with each batch (`batch["teacher"]`), nothing to wait for."""

    def __init__(self, args: DistillationArgs, teacher_heldout_ce: Optional[float],
                 teacher_heldout_bpb: Optional[float] = None):
        super().__init__(args)
        self.teacher_heldout_ce, self.teacher_heldout_bpb = teacher_heldout_ce, teacher_heldout_bpb

    def submit(self, batch: dict, step: int, micro_step: int):
        return batch["teacher"]

    def targets(self, pending, device: torch.device, timer) -> TeacherOutputs:
        return pending.to(device, non_blocking=True)


class OnlineDistiller(KDDistiller):
    """A teacher rank serves this student's bridge; its sparse outputs feed the KD loss."""

    def __init__(self, args: DistillationArgs, client: TeacherClient, prefetch: int):
        super().__init__(args)
        self.client = client
        self.prefetch = prefetch
        self.teacher_heldout_ce, self.teacher_heldout_bpb = client.teacher_heldout_ce, client.teacher_heldout_bpb

    @property
    def first_round_trip(self) -> Optional[tuple[float, float]]:
        return self.client.first_round_trip

    def begin_step(self, step: int, lr_factor: float) -> None:
        super().begin_step(step, lr_factor)
        self.client.wait_clock.new_step()

    def submit(self, batch: dict, step: int, micro_step: int):
        doc_ids = batch.get("doc_ids") if self.client.spec.doc_boundaries else None
        # Another tokenizer's teacher aligns the window's last position through the label just past it.
        next_tokens = batch["labels"][:, -1] if self.client.spec.kd_weight and "labels" in batch else None
        return self.client.submit(batch["input_ids"], step, micro_step, doc_ids, next_tokens)

    def targets(self, pending, device: torch.device, timer) -> TeacherOutputs:
        with timer.part("teacher_wait"):
            return pending.wait().to(device)

    def control_flags(self) -> dict:
        return self.client.response_flags()

    def after_agreement(self, flags: dict) -> None:
        if flags.get("teacher_error"):
            self.client.raise_teacher_error()
        if flags.get("teacher_nan"):
            self.client.raise_teacher_nan()

    def mark_first_step_done(self) -> None:
        self.client.mark_first_step_done()

    def announce_pause(self, pause_follows: bool) -> None:
        self.client.announce_pause(pause_follows)

    def drain(self) -> None:
        self.client.drain()

    def log_metrics(self, timer) -> dict:
        # This step's wait; this rank's total wait, the teacher's busy/idle seconds, its peak memory and this
        # rank's bridge bytes, cumulative since launch (a benchmark differences two rows).
        return {"speed/teacher_wait_s": self.client.wait_clock.read_step(),
                "speed/teacher_wait_total_s": self.client.wait_clock.total_s, **self.client.metrics()}

    def stop(self, step: int, error: bool = False) -> None:
        self.client.stop(step, error=error)

    def report_exit(self) -> None:
        self.client.report_exit()


def heldout_row(ce: Optional[float], bpb: Optional[float], prefix: str = "eval/") -> dict:
    """A teacher's held-out CE and bits per byte as eval keys (<prefix>teacher_loss, <prefix>teacher_bpb), where
    known (a cross-tokenizer teacher's CE per token is in its own tokens: None)."""
    return {f"{prefix}{name}": value for name, value in (("teacher_loss", ce), ("teacher_bpb", bpb))
            if value is not None}


def tokenizer_vocab(tokenizer) -> dict:
    """The token -> id map used to check that students and teacher share a tokenizer."""
    hf = getattr(tokenizer, "tokenizer", None)
    if hf is not None and hasattr(hf, "get_vocab"):
        return hf.get_vocab()
    return {f"<{type(tokenizer).__name__}:{tokenizer.n_words}>": 0}
