"""The student end of a bridge: handshake, then one asynchronous request per micro-batch, then STOP.

    client, = handshake_clients(args, topo, vocab, n_words, (max_bsz, max_seqlen))   # online/distiller.py
    outputs = client.submit(input_ids, step, micro_step).wait()              # TeacherOutputs
    flags = client.response_flags()                                           # at the step's agreed point
    client.stop(step)                                                         # drains, then STOP

No host sync per micro-batch on CUDA: requests are built in pinned host memory and copied without blocking, the
responses' status words stay on the device until the step's agreed point, the wait clock uses CUDA events read on
log steps; requests go out on a side stream, not behind the queued compute (`SideStream`). Where the host truly waits
on CUDA (docs/distillation_internals.md#what-nccl-orders): `complete()`, `wait()` and `drain()` only order streams;
the host blocks at a `read_step`, the step's agreed flags, and `stop()`'s read of the STOP reply's status, which
comes after every earlier reply on the bridge's one communicator. A failed teacher answers with stale but valid
outputs until each student sent ERROR (or STOP), which it does only after completing all it posted: no request is
left in flight but on a student's own unagreed failure (`report_exit` counts them; that exit aborts its groups).
"""

import logging
import time
from typing import Callable, Optional

import torch
import torch.distributed as dist

from lingua.distillation.args import (AgreedPeerStopped, AgreedTeacherError, DistillationArgs, dtype_setting,
                                     teacher_title)
from lingua.distillation.online.bridge import (BAD_TOKENS_FIELD, HEADER_INTS, NAN_WORD, RECORD_BYTES, BridgeSpec,
                                               HandshakeRecord, Op, RequestHeader, ResponseStatus, agreed_settings,
                                               record_ints, teacher_failure, tokenizer_fingerprint)
from lingua.distillation.outputs import TeacherOutputs
from lingua.parallel.collectives import log_collective
from lingua.parallel.host_copies import pins
from lingua.parallel.side_stream import SideStream

logger = logging.getLogger(__name__)
STATUS_WORDS = NAN_WORD + 1  # the response status fields read per step (int64 each): failed, teacher_preempt, ..., NaN


class WaitClock:
    """Student time blocked on the teacher: the host clock on CPU (gloo blocks in wait()); on CUDA (wait() only
    orders the stream) event pairs kept until a log step reads them, unread steps' pairs folded into the total."""

    def __init__(self, device: torch.device, make_event: Optional[Callable[[], object]] = None):
        self.cuda = device.type == "cuda"
        # A timing event recorded on the current stream; tests pass a fake one to run this branch without a GPU.
        self.make_event = make_event or (lambda: torch.cuda.Event(enable_timing=True))
        self.step_s = self.total_s = 0.0  # resolved seconds: this step's, and since launch
        self.step_pairs: list[tuple] = []  # CUDA (start, end) events of this step not read yet
        self.earlier_pairs: list[tuple] = []  # CUDA events of earlier steps not read yet: the total's only

    def new_step(self) -> None:
        self.step_s = 0.0
        self.earlier_pairs += self.step_pairs  # unread, not dropped: the next read adds them to the total
        self.step_pairs = []

    def start(self):
        if self.cuda:
            event = self.make_event()
            event.record()
            return event
        return time.perf_counter()

    def stop(self, start) -> None:
        if self.cuda:
            end = self.make_event()
            end.record()
            self.step_pairs.append((start, end))
            return
        elapsed = time.perf_counter() - start
        self.step_s += elapsed
        self.total_s += elapsed

    def read_step(self) -> float:
        """This step's wait in seconds, every unread pair folded in (CUDA: one sync, on the newest event)."""
        pending = self.earlier_pairs + self.step_pairs
        if not pending:
            return self.step_s
        pending[-1][1].synchronize()
        earlier = sum(a.elapsed_time(b) for a, b in self.earlier_pairs) / 1e3
        this_step = sum(a.elapsed_time(b) for a, b in self.step_pairs) / 1e3
        self.step_s += this_step
        self.total_s += earlier + this_step
        self.earlier_pairs, self.step_pairs = [], []
        return self.step_s


class TeacherHandle:
    """One in-flight request; `wait()` returns this student's TeacherOutputs."""

    def __init__(self, client: "TeacherClient", works, response: torch.Tensor, bsz: int, seqlen: int, step: int):
        self.client, self.works, self.response = client, works, response
        self.bsz, self.seqlen, self.step = bsz, seqlen, step
        self.request_bytes = 0
        self.submitted_at = time.time()
        self.done = False

    def complete(self) -> None:
        """Wait for both collectives (idempotent); on CUDA the compute stream waits for the reply, the host does not."""
        if self.done:
            return
        self.client.side_stream.consume(self.works, [self.response])
        self.done = True
        self.client.in_flight.remove(self)
        # Completed: its status is safe to read now; a posted buffer's scatter may still be writing into it.
        self.client.last_status = self.response[:RECORD_BYTES]
        # Counted when answered (a look-ahead request belongs to the step that consumes it), whole framed buffers.
        self.client.bytes_up += self.request_bytes
        self.client.bytes_down += self.response.numel() * self.response.element_size()

    def wait(self) -> TeacherOutputs:
        client = self.client
        start = client.wait_clock.start()  # after our own queued work: that is compute, not teacher time
        self.complete()
        client.wait_clock.stop(start)
        if client.first_round_trip is None:  # a startup span: one sync on the first response is fine
            client.wait_clock.read_step()
            client.first_round_trip = (self.submitted_at, time.time())
        client.statuses.append((self.response[:RECORD_BYTES], self.step))
        return client.payload(self.response, self.bsz, self.seqlen)


def student_record(args: DistillationArgs, topo, vocab: dict[str, int], n_words: int, max_bsz: int, max_seqlen: int,
                   attn_mask: str = "causal") -> HandshakeRecord:
    return HandshakeRecord("student", topo.global_rank, n_words, tokenizer_fingerprint(vocab),
                           agreed_settings(args, attn_mask), max_bsz=max_bsz, max_seqlen=max_seqlen)


class TeacherClient:
    """Student side of a bridge. `spec`: what the handshake agreed for it (`handshake_clients` makes every
    bridge's client after one handshake of all)."""

    def __init__(self, args: DistillationArgs, topo, vocab: dict[str, int], n_words: int,
                 max_bsz: int, max_seqlen: int, attn_mask: str = "causal", *, spec: BridgeSpec):
        assert topo.is_student and topo.bridge_group is not None
        self.args, self.topo = args, topo
        self.teacher_rank = topo.my_teacher
        self.title = teacher_title(args, self.teacher_rank)  # "Teacher rank 2", or with several its index and path
        self.spec = spec
        self.teacher_heldout_ce, self.teacher_heldout_bpb = self.spec.teacher_heldout_ce, self.spec.teacher_heldout_bpb
        self.n_words = n_words
        self.device = topo.device
        self.pin = pins(self.device)  # pinned host buffers: the copy to the GPU does not block
        self.wait_clock = WaitClock(self.device)
        self.side_stream = SideStream(self.device)  # requests leave when posted, not after queued compute
        self.first_round_trip: Optional[tuple[float, float]] = None  # wall-clock (submit, done)
        self.in_flight: list[TeacherHandle] = []
        self.statuses: list[tuple[torch.Tensor, int]] = []  # (status record on the device, step), read per step
        self.checked: list[tuple[torch.Tensor, int]] = []  # the statuses of the last agreed step
        self.last_status: Optional[torch.Tensor] = None  # the last completed response's status, read on log steps
        self.in_training = False  # after this launch's first step (the teacher's timeout follows it)
        self.pause_follows = False  # during a step followed by a long pause: requests say in_training=0 again
        self.bytes_up = self.bytes_down = 0  # the buffers of answered requests: handed to gather / got from scatter
        self.stopped = False
        logger.info(f"{self.title[0].lower()}{self.title[1:]} ready: output={self.spec.output} k={self.spec.k} "
                    f"vocab={self.spec.vocab_size} buffers [{self.spec.max_bsz} x {self.spec.max_seqlen}]"
                    + (" with document ids" if self.spec.doc_boundaries else ""))

    def metrics(self) -> dict[str, float]:
        """Bridge metrics for a log row, cumulative since launch, from the last completed response's status (one
        host read; requests posted ahead may still be in flight)."""
        status = ResponseStatus() if self.last_status is None else ResponseStatus.unpack(self.last_status)
        return {"kd/teacher_busy": status.busy_s / max(status.busy_s + status.idle_s, 1e-9),
                "kd/teacher_busy_s": status.busy_s, "kd/teacher_idle_s": status.idle_s,
                "kd/teacher_forward_s": status.forward_s,
                "kd/teacher_peak_gib": status.peak_bytes / 2**30, "kd/bytes_up": self.bytes_up,
                "kd/bytes_down": self.bytes_down}

    def _request(self, header: RequestHeader, tokens: Optional[torch.Tensor], doc_ids: Optional[torch.Tensor],
                 next_tokens: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The request buffer, built on the host (pinned on CUDA; `submit` copies it to the device without blocking).
        Token tensors still on the device are read here, on the caller's stream, which wrote them."""
        request = torch.zeros(self.spec.request_ints(), dtype=torch.int32, pin_memory=self.pin)
        request[:HEADER_INTS] = torch.tensor(header.to_ints(), dtype=torch.int32)
        if tokens is not None:
            tokens = tokens.cpu()  # a no-op for loader batches, which stay on the host until here
            # Out-of-range ids are flagged for the teacher, which refuses the request: every student raises together.
            request[BAD_TOKENS_FIELD] = ((tokens < 0) | (tokens >= self.n_words)).any()
            self.spec.token_grid(request)[: header.bsz, : header.seqlen] = tokens
            if self.spec.doc_boundaries:
                self.spec.doc_grid(request)[: header.bsz, : header.seqlen] = doc_ids.cpu()
            if self.spec.kd_weight:  # a label outside the vocabulary (-100: none) leaves the last position unaligned
                nexts = torch.full((header.bsz,), -1) if next_tokens is None else next_tokens.cpu()
                self.spec.next_tokens(request)[: header.bsz] = torch.where((nexts >= 0) & (nexts < self.n_words),
                                                                           nexts, -1)
        return request

    def submit(self, tokens: Optional[torch.Tensor], step: int, micro_step: int, doc_ids: Optional[torch.Tensor] = None,
               next_tokens: Optional[torch.Tensor] = None, op: Op = Op.FORWARD) -> TeacherHandle:
        """Post one micro-batch of tokens [bsz, seqlen] (best on the host), with doc boundaries its document ids,
        cross-tokenizer each row's label past the window [bsz] (no tokens: a STOP or ERROR)."""
        bsz, seqlen = (0, 0) if tokens is None else tuple(tokens.shape)
        if bsz > self.spec.max_bsz or seqlen > self.spec.max_seqlen:
            raise ValueError(f"Batch of shape [{bsz}, {seqlen}] is larger than the [{self.spec.max_bsz}, "
                             f"{self.spec.max_seqlen}] announced to the teacher at the handshake.")
        if self.spec.doc_boundaries and tokens is not None and doc_ids is None:
            raise ValueError("This bridge agreed on document boundaries (model.attn_mask=doc_causal) but the "
                             "batch has no doc_ids.")
        header = RequestHeader(op, step, micro_step, bsz, seqlen, self.topo.train_rank,
                               in_training=int(self.in_training and not self.pause_follows))
        group = self.topo.bridge_group
        request = self._request(header, tokens, doc_ids, next_tokens)
        with self.side_stream.posting():  # on NCCL: behind this request's copy only, not the queued compute
            request = request.to(self.device, non_blocking=True)
            response = torch.empty(self.spec.response_bytes(), dtype=torch.uint8, device=self.device)
            log_collective(f"gather+scatter request op={op.name} step={step}.{micro_step}", group, request, response)
            up = dist.gather(request, None, dst=self.teacher_rank, group=group, async_op=True)
            down = dist.scatter(response, None, src=self.teacher_rank, group=group, async_op=True)
        handle = TeacherHandle(self, [up, down], response, bsz, seqlen, step)
        handle.request_bytes = request.numel() * request.element_size()
        self.in_flight.append(handle)
        return handle

    def payload(self, response: torch.Tensor, bsz: int, seqlen: int) -> TeacherOutputs:
        return TeacherOutputs.from_tensors(self.spec.output,
                                           [view[:bsz, :seqlen] for view in self.spec.payload_views(response)])

    def response_flags(self) -> dict[str, torch.Tensor]:
        """Whether any response since the last call reported an error, a preemption or NaN (device tensors)."""
        if not self.statuses:
            zero = torch.zeros((), dtype=torch.int64, device=self.device)
            return {"teacher_error": zero, "teacher_preempt": zero, "teacher_nan": zero}
        words = torch.stack([record[: STATUS_WORDS * 8].view(torch.int64) for record, _ in self.statuses]).amax(dim=0)
        self.checked, self.statuses = self.statuses, []
        return {"teacher_error": words[0], "teacher_preempt": words[1], "teacher_nan": words[NAN_WORD]}

    def agreed_error(self, kind: str) -> Optional[Exception]:
        """After the students agreed that a response failed (`kind` "error") or held NaN ("nan"): this bridge's
        teacher's sentence, if it sent one (statuses decoded only here, on the error path)."""
        for record, step in self.checked:
            status = ResponseStatus.unpack(record)
            if kind == "nan" and record_ints(record)[NAN_WORD]:
                return AgreedTeacherError(
                    f"{self.title}'s outputs are not finite (NaN) at step {step}: its weights or "
                    f"its forward in {dtype_setting(self.args)}={self.args.teacher_dtype} are broken, not the "
                    f"students; check the teacher at {self.args.teacher_path} (its own check of its outputs)")
            if kind == "error" and not status.ok:
                sentence = f"{self.title} failed at step {step}: {status.message}"
                return AgreedPeerStopped(sentence) if status.bug else AgreedTeacherError(sentence)
        return None

    def mark_first_step_done(self) -> None:
        self.in_training = True

    def announce_pause(self, pause_follows: bool) -> None:
        """Whether the step about to run is followed by a long pause (an in-process checkpoint evaluation): its
        requests say so, and the teacher waits across it under the generous timeout."""
        self.pause_follows = pause_follows

    def drain(self) -> None:
        """Complete every request still in flight (before STOP, a preemption save, an agreed error). On CUDA the host
        does not wait: the compute stream comes after every reply, so what reads the device next finds them all."""
        for handle in list(self.in_flight):
            handle.complete()

    def stop(self, step: int, error: bool = False, blame: int = 0) -> None:
        """Drain, then tell the teacher to leave its loop. `blame`: 1 + the index of the teacher whose failure the
        students agreed on (0: none), sent in the ERROR's micro_step so that every teacher's sentence names it."""
        if self.stopped:
            return
        self.drain()
        handle = self.submit(None, step, blame if error else 0, op=Op.ERROR if error else Op.STOP)
        handle.complete()
        self.stopped = True
        # The host waits here (a copy to the CPU), for STOP's reply and so every earlier one on this communicator.
        status = ResponseStatus.unpack(handle.response[:RECORD_BYTES])
        if not status.ok and not error:
            raise teacher_failure(f"{self.title} reported at STOP: {status.message}", status.bug)
        logger.info(f"sent {'ERROR' if error else 'STOP'} to teacher rank {self.teacher_rank} at step {step}")

    def report_exit(self) -> int:
        """Count and log the posted requests never completed: 0 on every path but a student failing on its own,
        which must not wait for a teacher its peers may never reach (its aborted groups cancel them)."""
        unwaited = len(self.in_flight)
        (logger.warning if unwaited else logger.info)(f"teacher requests left unwaited at exit: {unwaited}")
        return unwaited
