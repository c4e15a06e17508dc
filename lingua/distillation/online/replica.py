"""A tensor-parallel teacher replica (distillation.teacher_tp > 1) as one teacher: its first rank (the leader) is the
bridge's teacher end, the others (followers) talk only to it, over `topo.teacher_tp_group`: one all-gather of the
load records (`replica_load_record`), one broadcast of the agreed spec (`share_spec`), then per request one
broadcast of a round (`ReplicaLink`: FORWARD with the students' requests, or LEAVE with their status) and one reduce
of the preemption flags and peak memory. A follower that fails inside the forward leaves the others blocked in one
of its collectives: gloo fails them with a lost peer naming it; on NCCL the watchdog ends them (docs/gpu_failures.md).
"""

import logging
from enum import IntEnum
from typing import Optional

import torch
import torch.distributed as dist

from lingua.distillation.args import WIRE_DTYPES, DistillationArgs
from lingua.distillation.online.bridge import (RECORD_BYTES, BridgeSpec, HandshakeRecord, ResponseStatus,
                                               exchange_records, teacher_failure)
from lingua.errors import PeerStopped
from lingua.parallel.collectives import log_collective
from lingua.parallel.host_copies import pins, to_device

logger = logging.getLogger(__name__)

CONTROL_INTS = 4  # round op, LEAVE's "the students stopped" bit, then room to grow; int32
STATUS_INTS = RECORD_BYTES // 4  # the LEAVE round's status record, as int32
PREEMPT_WORD, PEAK_WORD = 1, 4  # int64 fields of a ResponseStatus record (see ResponseStatus.pack)


class Round(IntEnum):
    FORWARD = 1  # the students' requests follow: run the forward
    LEAVE = 2  # the status follows: leave the loop (raise its message when it is an error)


def replica_load_record(topo, mine: HandshakeRecord) -> HandshakeRecord:
    """This rank's load record, "not loaded" with the reason of any rank of the replica that failed."""
    failed = [r for r in exchange_records(topo, mine, topo.teacher_tp_group, "replica load records") if not r.loaded]
    if failed and mine.loaded:
        first = failed[0]
        mine.loaded, mine.bug = False, first.bug
        mine.message = f"tensor-parallel rank {first.global_rank} of its replica: {first.message}"
    return mine


def share_spec(topo, spec: Optional[BridgeSpec], args: DistillationArgs) -> BridgeSpec:
    """The leader's bridge spec on every rank (followers add their own settings, which the handshake checked)."""
    fields = [spec.max_bsz, spec.max_seqlen, spec.vocab_size, int(spec.doc_boundaries), int(spec.kd_weight)] \
        if spec is not None else [0] * 5
    shapes = torch.tensor(fields, dtype=torch.int64, device=topo.device)
    log_collective("broadcast bridge spec", topo.teacher_tp_group, shapes)
    dist.broadcast(shapes, src=topo.replica_ranks[0], group=topo.teacher_tp_group)
    if spec is not None:
        return spec
    max_bsz, max_seqlen, vocab_size, doc_boundaries, kd_weight = shapes.tolist()
    return BridgeSpec(max_bsz, max_seqlen, vocab_size, args.output, args.k, WIRE_DTYPES[args.wire_dtype],
                      doc_boundaries=bool(doc_boundaries), kd_weight=bool(kd_weight))


class ReplicaLink:

    def __init__(self, topo, spec: BridgeSpec, n_students: int):
        self.group, self.leader = topo.teacher_tp_group, topo.replica_ranks[0]
        self.request_ints = spec.request_ints()
        self.round = torch.zeros(CONTROL_INTS + STATUS_INTS + n_students * self.request_ints, dtype=torch.int32,
                                 device=topo.device)
        self.flags = torch.zeros(2, dtype=torch.int64, device=topo.device)  # preemption flag, peak bytes
        self.broken = False  # a forward failed on the leader: the others wait in one of its collectives

    def _broadcast(self, what: str) -> None:
        log_collective(f"broadcast round ({what})", self.group, self.round)
        dist.broadcast(self.round, src=self.leader, group=self.group)

    # ---- the leader

    def share_forward(self, requests: list[torch.Tensor]) -> None:
        self.round[0].fill_(int(Round.FORWARD))  # on the device: a Python number written into it is a blocking copy
        torch.cat(requests, out=self.round[CONTROL_INTS + STATUS_INTS:])
        self._broadcast("forward")

    def share_leave(self, status: ResponseStatus, peer_stopped: bool = False) -> None:
        """`peer_stopped`: the status's error is the students' own stop, not the teacher's."""
        self.round[0].fill_(int(Round.LEAVE))
        self.round[1].fill_(int(peer_stopped))
        record = status.pack(pin=pins(self.round.device)).view(torch.int32)
        self.round[CONTROL_INTS:CONTROL_INTS + STATUS_INTS].copy_(record, non_blocking=True)
        self._broadcast("leave")

    def replica_flags(self, preempt: bool, peak_bytes: int) -> Optional[torch.Tensor]:
        """After a forward: the max over the replica of (preemption flag, peak bytes) on the leader, None elsewhere."""
        self.flags[0].fill_(int(preempt))  # device-side writes: no host sync after the queued forward
        self.flags[1].fill_(int(peak_bytes))
        log_collective("reduce(max) replica flags", self.group, self.flags)
        dist.reduce(self.flags, dst=self.leader, op=dist.ReduceOp.MAX, group=self.group)
        return self.flags if dist.get_rank() == self.leader else None

    def share_teacher_tokens(self, tokens: Optional[torch.Tensor], doc_ids: Optional[torch.Tensor]
                             ) -> tuple[torch.Tensor, torch.Tensor]:
        """Cross-tokenizer: the teacher's [N, L] tokens and document ids the leader aligned (None on a follower)."""
        shape = torch.zeros(2, dtype=torch.int64, device=self.flags.device)
        if tokens is not None:
            shape[0].fill_(tokens.shape[0])
            shape[1].fill_(tokens.shape[1])
        log_collective("broadcast teacher grid shape", self.group, shape)
        dist.broadcast(shape, src=self.leader, group=self.group)
        if tokens is not None:
            grid = to_device(torch.stack([tokens.long(), doc_ids.long()]), self.flags.device)  # aligned on the host
        else:
            grid = torch.empty((2, *shape.tolist()), dtype=torch.int64, device=self.flags.device)
        log_collective("broadcast teacher tokens", self.group, grid)
        dist.broadcast(grid, src=self.leader, group=self.group)
        return grid[0], grid[1].int()

    @staticmethod
    def write_flags(response: torch.Tensor, flags: torch.Tensor) -> None:
        words = response[:RECORD_BYTES].view(torch.int64)
        words[PREEMPT_WORD] = flags[0]
        words[PEAK_WORD] = flags[1]

    # ---- a follower

    def next_round(self) -> tuple[Round, object]:
        """(FORWARD, the request buffers) or (LEAVE, None after a STOP, else the error to raise)."""
        self._broadcast("receive")
        op = Round(int(self.round[0]))
        if op == Round.FORWARD:
            return op, list(self.round[CONTROL_INTS + STATUS_INTS:].split(self.request_ints))
        status = ResponseStatus.unpack(self.round[CONTROL_INTS:CONTROL_INTS + STATUS_INTS].view(torch.uint8))
        if status.ok:
            return op, None
        if int(self.round[1]):  # the students stopped on an error of theirs
            return op, PeerStopped(status.message)
        return op, teacher_failure(f"Teacher rank {self.leader} (this replica's first rank) failed: {status.message}",
                                   status.bug)
