"""The student end of a bridge: handshake, then one asynchronous request per micro-batch, then STOP.

    client = TeacherClient(args, topo, vocab, n_words, max_bsz, max_seqlen)   # runs the handshake
    handle = client.submit(input_ids, step, micro_step)                       # gather + scatter posted
    outputs = handle.wait()                                                   # TeacherOutputs
    client.stop(step)

Both collectives of a request are posted asynchronously, so the teacher's forward runs while the
student computes. On CUDA a student's wait starts after its own queued work and ends when the
response has landed, so neither side's clock absorbs the other's compute.
"""

import logging
import time
from typing import Optional

import torch
import torch.distributed as dist

from lingua.bridge import (
    HEADER_INTS, RECORD_BYTES, HandshakeRecord, Op, RequestHeader, ResponseStatus, agreed_handshake, agreed_settings,
    synchronize, tokenizer_fingerprint,
)
from lingua.collectives import log_collective
from lingua.distillation import DistillationArgs, TeacherError
from lingua.kd_loss import TeacherOutputs

logger = logging.getLogger(__name__)


class TeacherHandle:
    """One in-flight request. `wait()` returns this student's TeacherOutputs (on its device)."""

    def __init__(self, client: "TeacherClient", works, response: torch.Tensor, bsz: int, seqlen: int, step: int):
        self.client, self.works, self.response = client, works, response
        self.bsz, self.seqlen, self.step = bsz, seqlen, step
        self.submitted_at = time.time()
        self.wait_s = 0.0

    def wait(self) -> TeacherOutputs:
        device = self.client.topo.device
        synchronize(device)  # our own queued forward is compute, not teacher time
        start = time.perf_counter()
        for work in self.works:
            work.wait()
        synchronize(device)  # on NCCL wait() only orders our stream after the transfer: block until it landed
        self.wait_s = time.perf_counter() - start
        self.client.total_wait_s += self.wait_s
        if self.client.first_round_trip is None:
            self.client.first_round_trip = (self.submitted_at, time.time())
        return self.client._decode(self.response, self.bsz, self.seqlen, self.step)


class TeacherClient:
    """Student side of the bridge. Build it right after the student model (it runs the handshake)."""

    def __init__(self, args: DistillationArgs, topo, vocab: dict[str, int], n_words: int,
                 max_bsz: int, max_seqlen: int):
        assert topo.is_student and topo.bridge_group is not None
        self.args, self.topo = args, topo
        self.teacher_rank = topo.my_teacher
        mine = HandshakeRecord("student", topo.global_rank, n_words, tokenizer_fingerprint(vocab), agreed_settings(args),
                               max_bsz=max_bsz, max_seqlen=max_seqlen)
        self.spec = agreed_handshake(topo, mine, args)
        self.n_words = n_words
        self.total_wait_s = 0.0
        self.first_round_trip: Optional[tuple[float, float]] = None  # wall-clock (submit, done)
        self.teacher = ResponseStatus()  # the teacher's latest status: its clocks, peak memory, preemption bit
        self.teacher_preempt = False  # the teacher received a preemption signal (sticky)
        self.bytes_up = self.bytes_down = 0  # sizes of the buffers this rank handed to gather / got from scatter
        self.stopped = False
        logger.info(
            f"teacher rank {self.teacher_rank} ready: output={self.spec.output} k={self.spec.k} "
            f"vocab={self.spec.vocab_size} buffers [{self.spec.max_bsz} x {self.spec.max_seqlen}]"
        )

    @property
    def teacher_busy(self) -> float:
        """Fraction of the teacher's time since the handshake spent computing (vs waiting for requests)."""
        return self.teacher.busy_s / max(self.teacher.busy_s + self.teacher.idle_s, 1e-9)

    def metrics(self) -> dict[str, float]:
        """Bridge metrics for a log row; all cumulative since launch, so a window is a difference of two rows."""
        return {"kd/teacher_busy": self.teacher_busy, "kd/teacher_busy_s": self.teacher.busy_s,
                "kd/teacher_idle_s": self.teacher.idle_s, "kd/teacher_peak_gib": self.teacher.peak_bytes / 2**30,
                "kd/bytes_up": self.bytes_up, "kd/bytes_down": self.bytes_down}

    def _post(self, op: Op, step: int, micro_step: int, tokens: Optional[torch.Tensor]) -> TeacherHandle:
        bsz, seqlen = (0, 0) if tokens is None else tuple(tokens.shape)
        if bsz > self.spec.max_bsz or seqlen > self.spec.max_seqlen:
            raise ValueError(
                f"Batch of shape [{bsz}, {seqlen}] is larger than the [{self.spec.max_bsz}, {self.spec.max_seqlen}] "
                f"announced to the teacher at the handshake."
            )
        header = RequestHeader(op, step, micro_step, bsz, seqlen, self.topo.train_rank)
        request = torch.zeros(self.spec.request_ints(), dtype=torch.int32, device=self.topo.device)
        request[:HEADER_INTS] = torch.tensor(header.to_ints(), dtype=torch.int32)
        if tokens is not None:
            # Out-of-range ids are flagged in the header, computed on the device (no host sync per
            # micro-batch); the teacher refuses the request, so every student of the bridge raises together.
            request[HEADER_INTS - 2] = ((tokens < 0) | (tokens >= self.n_words)).any()
            self.spec.token_grid(request)[:bsz, :seqlen] = tokens.to(device=self.topo.device, dtype=torch.int32)
        response = torch.empty(self.spec.response_bytes(), dtype=torch.uint8, device=self.topo.device)
        group = self.topo.bridge_group
        log_collective(f"gather+scatter request op={op.name} step={step}.{micro_step}", group, request, response)
        up = dist.gather(request, None, dst=self.teacher_rank, group=group, async_op=True)
        down = dist.scatter(response, None, src=self.teacher_rank, group=group, async_op=True)
        # What goes over the bridge is the whole framed buffer (header/status, padding), not only the payload.
        self.bytes_up += request.numel() * request.element_size()
        self.bytes_down += response.numel() * response.element_size()
        return TeacherHandle(self, [up, down], response, bsz, seqlen, step)

    def submit(self, input_ids: torch.Tensor, step: int, micro_step: int) -> TeacherHandle:
        """Send one micro-batch of tokens [bsz, seqlen]; returns a handle whose wait() gives outputs."""
        return self._post(Op.FORWARD, step, micro_step, input_ids)

    def stop(self, step: int, error: bool = False) -> None:
        """Tell the teacher to leave its loop (end of training, preemption, agreed error)."""
        if self.stopped:
            return
        handle = self._post(Op.ERROR if error else Op.STOP, step, 0, None)
        for work in handle.works:
            work.wait()
        self.stopped = True
        status = ResponseStatus.unpack(handle.response[:RECORD_BYTES])
        if not status.ok and not error:
            raise TeacherError(f"Teacher rank {self.teacher_rank} reported at STOP: {status.message}")
        logger.info(f"sent STOP to teacher rank {self.teacher_rank} at step {step}")

    def _decode(self, response: torch.Tensor, bsz: int, seqlen: int, step: int) -> TeacherOutputs:
        status = ResponseStatus.unpack(response[:RECORD_BYTES])
        if not status.ok:
            raise TeacherError(f"Teacher rank {self.teacher_rank} failed at step {step}: {status.message}")
        self.teacher = status
        self.teacher_preempt = self.teacher_preempt or status.teacher_preempt
        tensors = [view[:bsz, :seqlen] for view in self.spec.payload_views(response)]
        return TeacherOutputs.from_tensors(self.spec.output, tensors)
