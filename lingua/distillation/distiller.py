"""The Distiller: the one object the student loop asks for the KD part of a step, through six members.

    distiller, cache = build_distiller(args.enable_distillation, args.distillation, topo, tokenizer, args.data,
                                       args.model.attn_mask, phases)                  # (build.py)
    with distiller.session(current_step):                 # STOP to the teachers at the end; ERROR on an agreed error
        distiller.begin_step(step, lr_factor, pause_follows)        # alpha for this step, fresh statistics
        head_loss = distiller.head_loss(labels, pending, n_valid, timer)  # pending: `submit`'s (MicroBatchFeed)
        loss = model(input_ids, doc_ids=..., head_loss=head_loss)   # the model calls head_loss(hidden, head_weight)
        metrics = distiller.step_metrics()                          # loss/ce, loss/total (+ loss/kd, kd/*): tensors
        flags = distiller.agree(flags, group, device)               # the control point, the teachers' flags with them
        distiller.drain()                                           # requests in flight answered before a save

Kinds: `NoDistiller` (enable_distillation=false: CE only) and `KDDistiller`, the KD loss of the run's teachers, one or
several (a lone teacher is a list of one and keeps the one-teacher metric names; several are mixed per position by
`loss/mixture.py` and add kd/<i>/*), on two roads: `OnlineDistiller` (`online/distiller.py`) and `CacheDistiller`
(`cache/distiller.py`). A road overrides the hooks below the seam (submit, targets, control_flags, after_agreement,
mark_first_step_done, announce_pause, drain, stop, report_exit, log_metrics); the loop never asks which road it has.
The loss of a micro-batch is ((1 - alpha) * CE_sum + alpha * T^2 * KD_sum) / n_valid, n_valid being the step's count
of trained-on tokens, so micro-batches add up to one large batch. Statistics stay on the device.
"""

import contextlib
import hashlib
import json
import logging
from typing import Callable, Optional

import torch

from lingua.distillation.args import DistillationArgs, alpha_at
from lingua.distillation.loss.divergences import distillation_loss
from lingua.distillation.loss.mixture import (TEACHER_METRICS, head_loss_path, mixing_weights, teacher_metrics,
                                              teachers_head_loss)
from lingua.distillation.loss.research import add_stats
from lingua.distillation.outputs import TeacherOutputs
from lingua.parallel.collectives import AgreedError, agree_flags
from lingua.parallel.host_copies import to_device

logger = logging.getLogger(__name__)


class Distiller:
    """What the student loop asks of the KD part of a step; the hooks' defaults are those of a run without teacher
    traffic (no requests, nothing to agree on, nothing to drain)."""

    prefetch = 0  # requests submitted ahead of the micro-batch being computed (MicroBatchFeed reads it)
    first_round_trip: Optional[tuple[float, float]] = None  # wall-clock (submit, done) of the first request
    phases = None  # the PhaseLog the first round trip is recorded in (build_distiller sets it)
    first_step_done = False  # this launch's first control point is behind

    def __init__(self, args: DistillationArgs):
        self.args = args
        self.loss_path = head_loss_path(args)  # fused or research, chosen once

    # ---------------------------------------------------------------- the seam: what the loop calls

    def begin_step(self, step: int, lr_factor: float, pause_follows: bool = False) -> None:
        """A new step: fresh statistics, the KD weight for this step, and whether a long pause of the students (an
        in-process checkpoint evaluation) follows it, which every request of the step tells the teacher."""
        self.announce_pause(pause_follows)
        self.stats: Optional[dict] = None  # the step's loss statistics by name (divided by n_valid), summed

    def head_loss(self, labels: torch.Tensor, pending, n_valid: int, timer) -> Callable:
        """The loss of a micro-batch as a function of the model's final hidden states and its head weight."""
        raise NotImplementedError

    def step_metrics(self) -> dict:
        """This step's loss metrics as device tensors (read on log steps only)."""
        raise NotImplementedError

    def agree(self, flags: dict, group, device) -> dict:
        """The step's control point: the loop's `flags` and the teachers' (`control_flags`) agreed by every student
        in one collective, then acted on alike by all: a teacher failure agreed on is raised, and after the launch's
        first step the teachers may switch to the training timeout. Returns the agreed flags."""
        agreed = agree_flags({**flags, **self.control_flags()}, group, device)
        self.after_agreement(agreed)
        if not self.first_step_done:
            self.first_step_done = True
            self.mark_first_step_done()
            if self.first_round_trip is not None and self.phases is not None:
                self.phases.record("first_teacher_round_trip", *self.first_round_trip)
        return agreed

    def drain(self) -> None:
        """Wait for every request in flight (before a save, STOP or an agreed error)."""

    @contextlib.contextmanager
    def session(self, current_step: Callable[[], int]):
        """Around the student loop: the teachers hear STOP when it ends. An error the students raise together
        (`AgreedError`: a non-finite loss, different loop lengths, a teacher's failure) reaches the teachers too, as
        ERROR after the requests in flight, before it propagates. Any other error is this rank's own: it leaves
        without talking to the teachers (its peers may be blocked in a collective it never joins)."""
        try:
            yield
            self.stop(current_step())
        except AgreedError:
            self.stop(current_step(), error=True)
            raise
        finally:
            self.report_exit()

    # ---------------------------------------------------------------- what the feed, the reporter and the eval ask

    def submit(self, batch: dict, step: int, micro_step: int):
        """Ask for a micro-batch's teacher targets; returns what `head_loss` takes as `pending`."""
        return None

    def teacher_heldout_row(self) -> dict:
        """The teachers' own held-out numbers for the first eval row, where known (eval/teacher_loss, eval/teacher_bpb;
        with several teachers eval/<i>/teacher_loss, eval/<i>/teacher_bpb)."""
        return {}

    def log_metrics(self, timer) -> dict:
        """Extra keys of a log row (teacher wait and the teacher's clocks, with a teacher)."""
        return {}

    # ---------------------------------------------------------------- the roads' hooks

    def control_flags(self) -> dict:
        """Device flags for the step's agreed control point (the teachers' error and preemption bits)."""
        return {}

    def after_agreement(self, flags: dict) -> None:
        """Acts on the agreed flags that concern the teachers (an error is raised here, on every student)."""

    def mark_first_step_done(self) -> None:
        """This launch's first step is over (the teachers may switch to the training timeout)."""

    def announce_pause(self, pause_follows: bool) -> None:
        """Whether a long pause of the students follows the step about to run."""

    def stop(self, step: int, error: bool = False) -> None:
        """The end of this launch (or an agreed error): the teachers leave their loops."""

    def report_exit(self) -> None:
        """As the loop is left, on every path: say how many teacher requests were left unwaited."""

    def _add_stats(self, stats: dict) -> None:
        """A micro-batch's statistics by name into the step's (CE in float64, as it was always summed)."""
        stats = {**stats, "ce": stats["ce"].detach().double()}
        self.stats = stats if self.stats is None else add_stats(self.stats, stats)

    def _loss_metrics(self, kd: Optional[torch.Tensor] = None, alpha: float = 0.0) -> dict:
        """loss/ce, loss/<term> for each term the loss adds as it is (a statistic that is neither CE nor a
        teacher's: the z-loss's "z"), and loss/total (CE, or (1 - alpha) * CE + alpha * T^2 * KD, plus the terms)."""
        terms = {f"loss/{name}": value for name, value in self.stats.items()
                 if name != "ce" and name not in TEACHER_METRICS}
        ce = self.stats["ce"]
        total = ce if kd is None else distillation_loss(ce, kd, alpha, self.args.temperature)
        return {"loss/ce": ce, **terms, "loss/total": sum(terms.values(), total)}


class NoDistiller(Distiller):
    """enable_distillation=false: no teacher, the loss is the student's CE, fused with the output head like the KD
    loss (no [tokens, vocab] logits), so a CE baseline pays what the KD run pays for its head."""

    def head_loss(self, labels: torch.Tensor, pending, n_valid: int, timer) -> Callable:
        def ce_loss(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
            loss, stats = self.loss_path(hidden, weight, labels, [], max(n_valid, 1), 0.0, self.args)
            self._add_stats(stats)
            return loss
        return ce_loss

    def step_metrics(self) -> dict:
        return self._loss_metrics()


class KDDistiller(Distiller):
    """The KD loss of the teachers (`distillation.teachers`): each position's KD term mixed over the teachers that
    teach its source (`loss/mixture.py`). A subclass says where a micro-batch's targets come from (`targets`).
    `routing`: [sources, teachers] (`source_routing`); `heldout`: each teacher's own (CE, bits per byte) if known."""

    def __init__(self, args: DistillationArgs, routing: Optional[torch.Tensor] = None, device: str = "cpu",
                 heldout: Optional[list[tuple[Optional[float], Optional[float]]]] = None):
        super().__init__(args)
        self.alpha = args.alpha
        teachers = args.teachers or [args.lone_teacher()]  # validated args hold the list; a caller's may not yet
        self.several = len(teachers) > 1  # each teacher's metrics under kd/<i>/ beside the mixture's kd/
        self.mixed = self.several or any(t.sources for t in teachers)  # KD weights mixed per position by source
        self.routing = None if routing is None else routing.to(device)
        heldout = heldout or [(None, None)] * len(teachers)
        self.cross = [teacher.cross_tokenizer for teacher in teachers]
        self.uld = [cross and args.uld_weight > 0 for cross in self.cross]  # ULD reads a cross teacher's marks
        self.heldout = heldout

    def teacher_heldout_row(self) -> dict:
        row = {}
        for i, (ce, bpb) in enumerate(self.heldout):  # a cross-tokenizer teacher's CE is in its own tokens: None
            prefix = f"eval/{i}/" if self.several else "eval/"
            row.update({prefix + name: value for name, value in (("teacher_loss", ce), ("teacher_bpb", bpb))
                        if value is not None})
        return row

    def begin_step(self, step: int, lr_factor: float, pause_follows: bool = False) -> None:
        super().begin_step(step, lr_factor, pause_follows)
        self.alpha = alpha_at(step, self.args.alpha, self.args.alpha_schedule, lr_factor)
        self.kd_stats = None  # the mixture's kd, teacher_mass, top1_agreement: each micro-batch's sum over teachers

    def targets(self, pending, device: torch.device, timer) -> tuple[Optional[torch.Tensor], list[TeacherOutputs]]:
        """(the rows' source ids or None, every teacher's outputs on `device`) of a micro-batch."""
        raise NotImplementedError

    def head_loss(self, labels: torch.Tensor, pending, n_valid: int, timer) -> Callable:
        """(1 - alpha) * CE + alpha * T^2 * KD; the targets are asked for only when the head is reached, so an
        online teacher's forward overlaps the student's trunk even without look-ahead."""

        def distillation_head_loss(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
            source_ids, outputs = self.targets(pending, hidden.device, timer)
            loss, stats = teachers_head_loss(self.loss_path, hidden, weight, labels, outputs,
                                             self._weights(source_ids, outputs, labels, hidden.device), n_valid,
                                             self.alpha, self.args, self.uld)
            self._add_stats(stats)
            kd_stats = {name: stats[name].sum() for name in ("kd", "teacher_mass", "top1_agreement")}
            self.kd_stats = kd_stats if self.kd_stats is None else add_stats(self.kd_stats, kd_stats)
            return loss
        return distillation_head_loss

    def _weights(self, source_ids: Optional[torch.Tensor], outputs: list[TeacherOutputs], labels: torch.Tensor,
                 device: torch.device) -> list[Optional[torch.Tensor]]:
        """Each teacher's KD weight per position: a teacher alone on every source, its own kd_weight (None: every
        position); else mixed by source and alignment (`source_ids` None: every row of source 0, which only a routing
        without sources allows: each source's row is the same)."""
        if not self.mixed:
            return [outputs[0].kd_weight]
        if source_ids is None:
            source_ids = torch.zeros(labels.shape[0], dtype=torch.int32, device=device)
        # The batch's source ids are pinned on CUDA: a blocking copy here would wait for the whole trunk forward.
        return mixing_weights(self.routing, to_device(source_ids, device), [o.kd_weight for o in outputs],
                              tuple(labels.shape))

    def step_metrics(self) -> dict:
        kd = self.kd_stats["kd"]
        loss = self._loss_metrics(kd, self.alpha)
        metrics = {"loss/ce": loss.pop("loss/ce"), "loss/kd": kd, "kd/teacher_mass": self.kd_stats["teacher_mass"],
                   "kd/top1_agreement": self.kd_stats["top1_agreement"], "kd/alpha": self.alpha, **loss}
        if self.several:
            return {**metrics, **teacher_metrics(self.stats, self.cross)}
        return {**metrics, **({"kd/aligned": self.stats["aligned"][0]} if self.cross[0] else {})}


def tokenizer_fingerprint(vocab: dict[str, int]) -> int:
    """A 63-bit hash of a token -> id map: equal iff students and teacher tokenize identically."""
    digest = hashlib.sha256(json.dumps(sorted(vocab.items())).encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def tokenizer_vocab(tokenizer) -> dict:
    """The token -> id map used to check that students and teacher share a tokenizer."""
    hf = getattr(tokenizer, "tokenizer", None)
    if hf is not None and hasattr(hf, "get_vocab"):
        return hf.get_vocab()
    return {f"<{type(tokenizer).__name__}:{tokenizer.n_words}>": 0}
