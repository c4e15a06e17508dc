"""The online road's distiller: each online teacher behind its own bridge, every micro-batch sent to each (the
routing only weighs the answers: no rank decides alone to skip a collective); a teacher read from its cache beside
them has its targets in the batch (`batch["teachers"]`).

    clients = handshake_clients(args, topo, vocab, n_words, max_batch)   # one bridge per online teacher, one verdict
    distiller = OnlineDistiller(args, clients, prefetch, routing, heldout)
"""

from typing import Optional

import torch

from lingua.distillation.args import AgreedPeerStopped, DistillationArgs
from lingua.distillation.distiller import KDDistiller
from lingua.distillation.online.bridge import agreed_handshakes
from lingua.distillation.online.client import TeacherClient, student_record
from lingua.distillation.outputs import TeacherOutputs


class OnlineDistiller(KDDistiller):
    """Teacher ranks serve this student's bridges (one per online teacher, in `args.online_teachers()` order); their
    sparse outputs, and any cached teacher's from the batch, feed the KD loss."""

    def __init__(self, args: DistillationArgs, clients: list[TeacherClient], prefetch: int, routing: torch.Tensor,
                 heldout: list[tuple[Optional[float], Optional[float]]]):
        online = args.online_teachers()
        heldout = list(heldout)
        for i, client in zip(online, clients):
            heldout[i] = (client.teacher_heldout_ce, client.teacher_heldout_bpb)
        super().__init__(args, routing, clients[0].device, heldout)
        self.clients, self.prefetch = clients, prefetch
        self.client_of = {i: client for i, client in zip(online, clients)}  # teacher index -> its bridge
        self.blame = 0  # with several teachers, 1 + the index of the one whose failure the students agreed on

    @property
    def first_round_trip(self) -> Optional[tuple[float, float]]:
        return self.clients[0].first_round_trip

    def begin_step(self, step: int, lr_factor: float, pause_follows: bool = False) -> None:
        super().begin_step(step, lr_factor, pause_follows)
        for client in self.clients:
            client.wait_clock.new_step()

    def submit(self, batch: dict, step: int, micro_step: int):
        # Another tokenizer's teacher aligns the window's last position through the label just past it.
        next_tokens = batch["labels"][:, -1] if "labels" in batch else None
        handles = [client.submit(batch["input_ids"], step, micro_step,
                                 batch.get("doc_ids") if client.spec.doc_boundaries else None,
                                 next_tokens if client.spec.kd_weight else None)
                   for client in self.clients]
        return batch.get("source_ids"), handles, batch.get("teachers", [])

    def targets(self, pending, device: torch.device, timer) -> tuple[Optional[torch.Tensor], list[TeacherOutputs]]:
        source_ids, handles, cached = pending
        handles, cached = iter(handles), iter(cached)
        with timer.part("teacher_wait"):
            outputs = [next(handles).wait().to(device) if i in self.client_of else
                       next(cached).to(device, non_blocking=True) for i in range(len(self.cross))]
        return source_ids, outputs

    def control_flags(self) -> dict:
        flags = [client.response_flags() for client in self.clients]
        return {key: torch.stack([f[key] for f in flags]).amax() for key in flags[0]}

    def after_agreement(self, flags: dict) -> None:
        for kind, key in (("error", "teacher_error"), ("nan", "teacher_nan")):
            if flags.get(key):
                blame, error = first_error(self.clients, kind)
                self.blame = blame if self.several else 0  # a lone teacher's ERROR names no index
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
        """This step's wait, then cumulative since launch (a benchmark differences two rows): the total wait and
        each bridge's metrics, with several teachers as kd/<i>/..., busy as the busiest's, bytes summed."""
        out = {"speed/teacher_wait_s": sum(c.wait_clock.read_step() for c in self.clients),
               "speed/teacher_wait_total_s": sum(c.wait_clock.total_s for c in self.clients)}
        if not self.several:
            return {**out, **self.clients[0].metrics()}
        for i, client in self.client_of.items():
            out.update({key.replace("kd/", f"kd/{i}/", 1): value for key, value in client.metrics().items()})
        out["kd/teacher_busy"] = max(out[f"kd/{i}/teacher_busy"] for i in self.client_of)
        for key in ("kd/bytes_up", "kd/bytes_down"):
            out[key] = sum(out[key.replace("kd/", f"kd/{i}/", 1)] for i in self.client_of)
        return out

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


def handshake_clients(args: DistillationArgs, topo, vocab: dict, n_words: int, max_batch: tuple[int, int],
                      attn_mask: str = "causal") -> list[TeacherClient]:
    """One TeacherClient per online teacher: every bridge's handshake, then one world-wide verdict."""
    online = args.online_teachers()
    views = [topo.for_teacher(j) for j in range(len(online))]
    each = [args.teacher_args(i) for i in online]
    records = [student_record(a, view, vocab, n_words, *max_batch, attn_mask) for a, view in zip(each, views)]
    specs = agreed_handshakes(topo, list(zip(views, records, each)))
    return [TeacherClient(a, view, vocab, n_words, *max_batch, attn_mask, spec=spec)
            for a, view, spec in zip(each, views, specs)]


def first_error(clients: list[TeacherClient], kind: str) -> tuple[int, Exception]:
    """(1 + index, sentence) of the first teacher whose responses carried the agreed error ("error" or "nan"),
    or (0, a stop saying another bridge's teacher failed) when none of this student's did."""
    for i, client in enumerate(clients):
        error = client.agreed_error(kind)
        if error is not None:
            return i + 1, error
    what = "failed; its students' logs name the reason" if kind == "error" else \
        "sent outputs that are not finite; its students' logs name it"
    return 0, AgreedPeerStopped(f"a teacher in another bridge {what}")

