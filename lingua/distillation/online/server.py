"""The teacher rank: load the model, handshake with its students, then receive -> handle -> reply until STOP.

Whatever fails while handling a request is answered with its sentence, so students raise it instead of waiting for
a timeout; all but a sticky CUDA error, after which no reply can run (the students learn it as a lost peer or from
their watchdog). A failed teacher stays "errored": it answers every later request with the same status (no forward)
until its students leave with ERROR or STOP, then raises. A tensor-parallel replica's first rank runs this loop, the
others follow it (`_follow`, `replica.py`). On CUDA, idle time ends when the headers reach the CPU, busy time when
the stream has run the forward.
"""

import contextlib
import logging
import time
from typing import NoReturn, Optional

import torch
import torch.distributed as dist

from lingua.evaluation.bits_per_byte import bits_per_byte
from lingua.distillation.args import DistillationArgs
from lingua.distillation.online.bridge import (HEADER_INTS, NAN_WORD, RECORD_BYTES, HandshakeRecord, Op, RequestHeader,
                                               ResponseStatus, agreed_handshake, agreed_settings, own_key, synchronize,
                                               tokenizer_fingerprint)
from lingua.distillation.cross_tokenizer.teacher_side import load_cross_tokenizer
from lingua.distillation.distiller import tokenizer_vocab
from lingua.distillation.outputs import TeacherOutputs
from lingua.distillation.online.replica import ReplicaLink, Round, replica_load_record, share_spec
from lingua.distillation.online.serving_clock import ServingClock, TimeoutSwitch
from lingua.distillation.teacher.model import TeacherModel
from lingua.errors import PeerStopped, TeacherError, UserError, describe, is_sticky_device_error
from lingua.logger import rank_log_file
from lingua.metrics import MemoryMonitor
from lingua.parallel.collectives import log_collective
from lingua.parallel.host_copies import pins, to_device
from lingua.parallel.preemption import PreemptionFlag
from lingua.parallel.rank_status import is_peer_loss

logger = logging.getLogger(__name__)
REPORT_EVERY_S = 30.0
LEAVING = frozenset({Op.STOP, Op.ERROR})  # a student sending either has left its loop: it sends nothing more


def is_bug(err: BaseException) -> bool:
    return not isinstance(err, (UserError, PeerStopped))


def failure_words(err: BaseException) -> str:
    """`err` as the students read it; a bug's words say where its traceback is (this rank's log)."""
    log = rank_log_file()
    return f"{describe(err)}; its traceback is in {log}" if is_bug(err) and log else describe(err)


class TeacherServer:
    """Teacher side: load, handshake, then answer until the students sent STOP (or ERROR). Every rank of a replica
    builds one; the first answers the students, the others follow it. `teacher_names`: with several teachers, each
    one's name, so that an ERROR's sentence names the failed one."""

    def __init__(self, args: DistillationArgs, topo, preemption: Optional[PreemptionFlag] = None, phases=None,
                 attn_mask: str = "causal", heldout=None, student_tokenizer=None, teacher_names: tuple[str, ...] = ()):
        assert topo.is_teacher
        self.args, self.topo, self.teacher_names = args, topo, teacher_names
        self.leader = topo.is_replica_leader  # always, with teacher_tp=1
        self.teacher: Optional[TeacherModel] = None
        self.cross = None  # distillation.cross_tokenizer: the students' tokenizer, the vocabulary map, the aligner
        record = HandshakeRecord("teacher", topo.global_rank, 0, 0, agreed_settings(args, attn_mask))
        start, start_wall = time.perf_counter(), time.time()
        tensor_parallel = topo.teacher_tp_group is not None
        load_error: Optional[Exception] = None
        try:
            self.teacher = TeacherModel(args, topo.device, tp_group=topo.teacher_tp_group)
            record.vocab, record.max_positions = self.teacher.vocab_size, self.teacher.max_positions
            record.tokenizer_fingerprint = tokenizer_fingerprint(self.teacher.tokenizer.get_vocab())
            if args.cross_tokenizer:  # announce the students' tokenizer it aligns from; its rows are cut, not refused
                self.cross = load_cross_tokenizer(student_tokenizer, args.teacher_tokenizer, self.teacher.tokenizer,
                                                  self.teacher.max_positions,
                                                  own_key(args, "teacher_tokenizer", "tokenizer"))
                record.vocab, record.max_positions = self.cross.student.n_words, 0
                record.tokenizer_fingerprint = tokenizer_fingerprint(tokenizer_vocab(self.cross.student))
                logger.info(f"cross-tokenizer: {self.cross.vocab_map.mapped} of the teacher's "
                            f"{len(self.cross.vocab_map.teacher_to_student)} ids are student tokens "
                            f"(map {self.cross.vocab_map.fingerprint()})")
            shard = self.teacher.shard
            logger.info(f"teacher {args.teacher_path} loaded in {time.perf_counter() - start:.1f}s "
                        f"(vocab {record.vocab}, {self.teacher.n_params / 1e6:.1f}M params in "
                        f"{str(self.teacher.model.dtype).removeprefix('torch.')})"
                        + (f", tensor-parallel over ranks {topo.replica_ranks}: vocabulary rows "
                           f"{shard.start}-{shard.end - 1} and {self.teacher.n_local_params / 1e6:.1f}M params here"
                           if shard is not None else ""))
            if heldout is not None and not tensor_parallel:
                record.heldout_ce, record.heldout_bpb = self._heldout_ce(heldout, attn_mask)
        except Exception as err:  # every rank must hear about it, not only this one
            load_error = err
            record.loaded, record.bug, record.message = False, is_bug(err), failure_words(err)
            logger.error(f"teacher failed to load: {record.message}")
        if tensor_parallel:
            record = replica_load_record(topo, record)  # no rank of the replica goes on alone
            if heldout is not None and record.loaded:  # collective: a failure here ends this rank (peers follow)
                record.heldout_ce, record.heldout_bpb = self._heldout_ce(heldout, attn_mask)
        if phases is not None:
            phases.record("teacher_load", start_wall, time.time())
        with phases.span("teacher_handshake") if phases is not None else contextlib.nullcontext():
            try:
                self.spec = agreed_handshake(topo, record if self.leader else None, args)
            except Exception:
                if load_error is not None and is_bug(load_error):  # this rank's own bug with its traceback and
                    raise load_error from load_error.__cause__   # cause; the others name this rank
                raise
            if tensor_parallel:
                self.spec = share_spec(topo, self.spec, args)
        # The replica's first rank seeds the draws of output=sampled: every rank of a replica draws the same.
        self.generator = torch.Generator(device=topo.device).manual_seed(args.seed + topo.replica_ranks[0])
        self.memory = MemoryMonitor(topo.device)
        self.clock = ServingClock(topo.device)
        self.requests = self.tokens = 0
        # A signal on the teacher rides on every response; the students fold it into their agreed control bits.
        self.preemption = preemption or PreemptionFlag()
        self.student_ranks = topo.plan.bridges()[topo.my_bridge][1]
        self.link = ReplicaLink(topo, self.spec, len(self.student_ranks)) if tensor_parallel else None
        self.replica_flags: Optional[torch.Tensor] = None  # this request's (preempt, peak) over the replica
        self.nan_flags: dict[int, torch.Tensor] = {}
        if not self.leader:
            return
        self.bridge_ranks = dist.get_process_group_ranks(topo.bridge_group)
        self.mine = self.bridge_ranks.index(topo.global_rank)
        device, n = topo.device, len(self.bridge_ranks)
        self.gathered = [torch.empty(self.spec.request_ints(), dtype=torch.int32, device=device) for _ in range(n)]
        self.request = torch.zeros(self.spec.request_ints(), dtype=torch.int32, device=device)
        # Allocated once: a request writes only its rows, and a separate output buffer avoids aliasing the scatter.
        self.responses = [torch.zeros(self.spec.response_bytes(), dtype=torch.uint8, device=device) for _ in range(n)]
        self.scatter_out = torch.empty_like(self.responses[self.mine])

    def _heldout_ce(self, heldout, attn_mask: str) -> tuple[Optional[float], float]:
        """The teacher's CE and bits per byte on the students' held-out (batches, vocab, bytes): a reference line. A
        cross-tokenizer teacher scores the text in its own tokens: its CE per token does not compare (None)."""
        batches, vocab_size, n_bytes = heldout
        if self.cross is not None:
            batches, n_bytes = self.cross.own_heldout(batches)
            vocab_size = self.teacher.vocab_size
        loss_sum, tokens = self.teacher.heldout_ce(batches, vocab_size, doc_causal=attn_mask == "doc_causal")
        bpb = bits_per_byte(loss_sum, n_bytes)
        logger.info(f"teacher's held-out CE: {loss_sum / max(tokens, 1):.4f} over {tokens:,} tokens"
                    f"{' of its own' if self.cross is not None else ''}, {bpb:.4f} bits per byte")
        return (None if self.cross is not None else loss_sum / max(tokens, 1)), bpb

    def _throughput(self) -> str:
        busy = max(self.clock.busy_s, 1e-9)
        return (f"{self.tokens:,} tokens at {self.tokens / busy:,.0f} tokens/s of busy time, forward and outputs "
                f"{100 * self.clock.forward_s / busy:.1f}% of it; peak memory "
                f"{self.memory.get_peak_stats()['mem/peak_gib']:.2f} GiB on this rank")

    def serve(self, timeouts: Optional[tuple[float, float]] = None) -> None:
        """Receive -> handle -> reply until STOP; after an error, `_serve_errored`. `timeouts`: (init, train) seconds
        for the `TimeoutSwitch`; None keeps the groups' timeout."""
        switch = TimeoutSwitch(self.topo, timeouts)
        self.clock = ServingClock(self.topo.device)
        if not self.leader:
            return self._follow(switch)
        last_report = time.perf_counter()
        while True:
            switch.arm()
            self._receive()
            status, ops, failure = self._handle(switch)
            self._reply(status)
            self.requests += 1
            if failure is not None:
                self._serve_errored(status, ops, switch, failure)
            if ops == {Op.STOP}:
                switch.cancel()
                self._release_replica(status)
                logger.info(f"STOP received after {self.requests - 1} requests; teacher busy "
                            f"{100 * self.clock.busy_fraction:.0f}% of the time; {self._throughput()}")
                return
            if time.perf_counter() - last_report > REPORT_EVERY_S:
                last_report = time.perf_counter()
                # Whether the teacher is the bottleneck shows on the students' side (their wait share).
                logger.info(f"served {self.requests} requests; busy {100 * self.clock.busy_fraction:.0f}% of the time")

    def _follow(self, switch: TimeoutSwitch) -> None:
        """A replica's follower: the leader's rounds until LEAVE (raising the error the leader answered, if any)."""
        while True:
            switch.arm()
            op, payload = self.link.next_round()
            self.clock.request_arrived()
            if op == Round.LEAVE:
                switch.cancel()
                logger.info(f"leaving with the replica's first rank after {self.requests} requests; "
                            f"{self._throughput()}")
                if payload is not None:  # the replica's error, as the students see it
                    raise payload
                return
            students = list(zip(self.student_ranks, payload))
            headers = self._headers(students)
            switch.observe(headers.values())
            self._forward(students, headers)
            self.link.replica_flags(self.preemption.requested, self._peak_bytes())
            self.requests += 1
            self.clock.worked()

    def _peak_bytes(self) -> int:
        return int(self.memory.get_peak_stats()["mem/peak_gib"] * 2**30)

    def _receive(self) -> None:
        log_collective("gather request (teacher)", self.topo.bridge_group, self.request)
        dist.gather(self.request, self.gathered, dst=self.topo.global_rank, group=self.topo.bridge_group)

    def _serve_errored(self, status: ResponseStatus, ops: set, switch: TimeoutSwitch, failure: Exception) -> NoReturn:
        """Answer every later request with the error `status` (no forward: stale but valid outputs) until the
        students leave, then raise `failure`. They send ERROR (or STOP) in one round, after completing every request
        they posted, so none is left waiting when this rank leaves."""
        answered = 0
        while not ops & LEAVING:
            switch.arm()
            self._receive()
            ops = {header.op for header in self._headers(self._students()).values()}
            self._reply(status)
            answered += 1
        switch.cancel()
        self._release_replica(status, failure)  # followers wait for the leader's next round until the students left
        synchronize(self.topo.device)  # NCCL only queued the replies: the abort after this raise would cancel them
        logger.info(f"answered {answered} more request(s) with the error, until the students left "
                    f"({', '.join(sorted(Op(op).name for op in ops & LEAVING))})")
        raise failure

    @staticmethod
    def _headers(students) -> dict[int, RequestHeader]:
        """Each student's request header; one copy to the CPU for all (on NCCL: where the wait ends)."""
        rows = torch.stack([buf[:HEADER_INTS] for _, buf in students]).tolist()
        return {rank: RequestHeader.from_ints(row) for (rank, _), row in zip(students, rows)}

    def _students(self) -> list[tuple[int, torch.Tensor]]:
        return [(rank, self.gathered[i]) for i, rank in enumerate(self.bridge_ranks) if i != self.mine]

    def _handle(self, switch: TimeoutSwitch) -> tuple[ResponseStatus, set, Optional[Exception]]:
        """(the status to send, the request's ops, the error to raise once answered or None). Whatever fails between
        the gather and the scatter is answered with its sentence; a sticky CUDA error leaves at once, unanswered."""
        students = self._students()
        arrived, ops, step, failure, error, peak_bytes, forwarded = False, set(), None, None, None, 0, False
        self.replica_flags, self.nan_flags = None, {}  # nan_flags: response index -> device flag of its outputs
        try:
            headers = self._headers(students)
            self.clock.request_arrived()
            arrived = True
            ops = {h.op for h in headers.values()}
            step = headers[students[0][0]].step
            switch.observe(headers.values(), stop=Op.STOP in ops)
            failure = self._check_headers(headers, students)
            error = None if failure is None else failure_words(failure)
            if failure is None and ops == {Op.FORWARD}:
                forwarded = True
                if self.link is not None:
                    self.link.share_forward([buf for _, buf in students])
                self._forward(students, headers)
            peak_bytes = self._peak_bytes()
            if forwarded and self.link is not None:
                self.replica_flags = self.link.replica_flags(self.preemption.requested, peak_bytes)
        except Exception as err:
            if is_sticky_device_error(err):
                raise  # the context is poisoned: a reply would fail too (or hang), so leave without one
            if forwarded and self.link is not None:
                if is_peer_loss(err):
                    raise  # a rank of the replica stopped: every rank ends with the sentence naming it
                self.link.broken = True  # the others wait in a collective of this forward: no more rounds
            where = "a request" if step is None else f"step {step}"
            failure, error, peak_bytes = err, f"teacher failed serving {where}: {failure_words(err)}", 0
        if not arrived:
            self.clock.request_arrived()
        self.clock.worked()
        status = ResponseStatus(ok=failure is None, teacher_preempt=self.preemption.requested, busy_s=self.clock.busy_s,
                                idle_s=self.clock.idle_s, peak_bytes=peak_bytes, forward_s=self.clock.forward_s,
                                message=error or "", bug=failure is not None and is_bug(failure))
        return status, ops, failure

    def _release_replica(self, status: ResponseStatus, failure: Optional[Exception] = None) -> None:
        """A replica's other ranks leave with this status; after a forward that failed on this rank they are stuck
        in one of its collectives and learn it when this process is gone."""
        if self.link is not None and not self.link.broken:
            self.link.share_leave(status, peer_stopped=isinstance(failure, PeerStopped))

    def _reply(self, status: ResponseStatus) -> None:
        record = status.pack(pin=pins(self.topo.device)).to(self.topo.device, non_blocking=True)
        for i, buf in enumerate(self.responses):
            buf[:RECORD_BYTES] = record
            if i in self.nan_flags:  # the teacher's check of its own outputs, read by the students with the status
                buf[:RECORD_BYTES].view(torch.int64)[NAN_WORD] = self.nan_flags[i]
            if self.replica_flags is not None:  # any rank of the replica preempted, its largest peak memory
                ReplicaLink.write_flags(buf, self.replica_flags)
        log_collective("scatter responses (teacher)", self.topo.bridge_group, self.responses[self.mine])
        dist.scatter(self.scatter_out, self.responses, src=self.topo.global_rank, group=self.topo.bridge_group)
        self.clock.worked()  # packing and sending the responses is serving time too

    def _check_headers(self, headers: dict[int, RequestHeader], students) -> Optional[Exception]:
        """None, or the error to answer with: the students' own agreed error, a bug (requests that differ or
        exceed the agreed shapes), or a user error (token ids out of range)."""
        ops = {h.op for h in headers.values()}
        if Op.ERROR in ops:
            failed = [r for r, h in headers.items() if h.op == Op.ERROR]
            blame = headers[failed[0]].micro_step  # several teachers: 1 + the failed teacher's index, 0 for none
            cause = f": {self.teacher_names[blame - 1]} failed" if 0 < blame <= len(self.teacher_names) else ""
            return PeerStopped(f"student rank(s) {failed} stopped on an error at step {headers[failed[0]].step}"
                               f"{cause}")
        if len({(h.op, h.step, h.micro_step) for h in headers.values()}) > 1:
            detail = "; ".join(f"rank {r}: {h.describe()}" for r, h in sorted(headers.items()))
            return RuntimeError(f"students sent mismatched requests ({detail})")
        for r, h in headers.items():
            if h.bsz > self.spec.max_bsz or h.seqlen > self.spec.max_seqlen:
                return RuntimeError(f"student rank {r} sent shape [{h.bsz}, {h.seqlen}] beyond the agreed "
                                    f"[{self.spec.max_bsz}, {self.spec.max_seqlen}]")
        for r, buf in students:
            h = headers[r]
            if h.bad_tokens:  # flagged by the student's device-side check; only this error path syncs
                tokens = self.spec.token_grid(buf)[:h.bsz, :h.seqlen]
                return TeacherError(f"student rank {r} sent token ids outside [0, {self.spec.vocab_size}) at step "
                                    f"{h.step} (got [{int(tokens.min())}, {int(tokens.max())}]); its data must use "
                                    f"the teacher's tokenizer")
        return None

    def _forward(self, students, headers: dict[int, RequestHeader]) -> None:
        """One forward over every student's rows, each student's outputs into its response (a follower's part goes
        to the replica's first rank)."""
        with self.clock.forward(), self.teacher.no_grad():
            self._forward_rows(students, headers)
        self.tokens += sum(h.bsz * h.seqlen for h in headers.values())

    def _forward_rows(self, students, headers: dict[int, RequestHeader]) -> None:
        seqlen = max(headers[r].seqlen for r, _ in students)
        # Right padding is invisible to a causal model's earlier positions: one forward for all students.
        tokens = torch.cat([self.spec.token_grid(buf)[:headers[r].bsz, :seqlen] for r, buf in students]).long()
        doc_ids = torch.cat([self.spec.doc_grid(buf)[:headers[r].bsz, :seqlen] for r, buf in students]) \
            if self.spec.doc_boundaries else None
        if self.cross is not None:
            next_tokens = torch.cat([self.spec.next_tokens(buf)[:headers[r].bsz] for r, buf in students])
            return self._cross_forward_rows(students, headers, tokens, doc_ids, next_tokens)
        hidden = self.teacher.hidden_states(tokens, doc_ids)
        row = 0
        for rank, _ in students:
            header = headers[rank]
            outputs = self.teacher.sparse_outputs(hidden[row: row + header.bsz, :header.seqlen], self.spec.output,
                                                  self.spec.k, self.spec.wire_dtype, self.spec.vocab_size,
                                                  self.generator)
            row += header.bsz
            if outputs is not None:  # None on a follower: its part of the outputs went to the replica's first rank
                self._write(rank, outputs)

    def _write(self, rank: int, outputs: TeacherOutputs) -> None:
        """Student `rank`'s outputs into its response, with the flag of the teacher's check of them."""
        index = self.bridge_ranks.index(rank)
        self.nan_flags[index] = outputs.nan_flag()
        for source, dest in zip(outputs.tensors(), self.spec.payload_views(self.responses[index])):
            dest[: source.shape[0], : source.shape[1]] = source

    def _cross_forward_rows(self, students, headers: dict[int, RequestHeader], tokens: torch.Tensor,
                            doc_ids: Optional[torch.Tensor], next_tokens: Optional[torch.Tensor] = None) -> None:
        """Cross-tokenizer: the students' rows (and the labels past them) aligned to the teacher's tokens on the
        leader's host, one forward on those, each student's outputs mapped back to its positions with kd_weight."""
        batch = teacher_tokens = teacher_docs = None
        if self.leader:  # a tensor-parallel replica's followers get the teacher's tokens, not the text to align
            batch = self.cross.teacher_batch(tokens.cpu(), None if doc_ids is None else doc_ids.cpu(),
                                             None if next_tokens is None else next_tokens.cpu())
            teacher_tokens, teacher_docs = batch.tokens, batch.doc_ids
        if self.link is not None:
            teacher_tokens, teacher_docs = self.link.share_teacher_tokens(teacher_tokens, teacher_docs)
        device = tokens.device
        # Aligned on the host (the leader's): pinned, sent without blocking; a follower's are on the device already.
        hidden = self.teacher.hidden_states(to_device(teacher_tokens, device),
                                            to_device(teacher_docs, device) if doc_ids is not None else None)
        outputs = self.cross.student_targets(self.teacher, hidden, batch, self.spec.output, self.spec.k,
                                             self.spec.wire_dtype, self.generator, self.args.uld_weight > 0)
        if outputs is None:  # a follower: its part of the outputs went to the replica's first rank
            return
        row = 0
        for rank, _ in students:
            header = headers[rank]
            self._write(rank, TeacherOutputs.from_tensors(
                self.spec.output, [t[row: row + header.bsz, :header.seqlen] for t in outputs.tensors()]))
            row += header.bsz
