"""Online distillation: the teacher server loop and the student client, over one bridge group each.

Protocol (everything on `topo.bridge_group`: teacher i + its contiguous block of students):

1. Handshake: one all_gather of a fixed-size record from every bridge member. The teacher's says
   ok/error (with the load error's text), its vocab, max positions and tokenizer fingerprint; each
   student's says its vocab, tokenizer fingerprint and the largest batch it will send; both carry
   the settings they must share (`AGREED_SETTINGS`: output format, k, wire dtype, temperature).
   Every rank checks every record the same way, then one all_gather over the world shares each
   rank's verdict, so a bad teacher path (in any bridge), a settings or a vocab mismatch raises the
   same sentence on every rank within seconds, never a watchdog timeout.
2. Request, once per micro-batch: each student gathers one int32 buffer onto the teacher: a header
   (op, step, micro_step, bsz, seqlen, train rank, out-of-range-token flag) then its tokens, padded
   to the largest shape announced at the handshake. The teacher checks the headers agree, runs one
   forward over all rows, and scatters to each student a byte buffer: a status record (with the
   teacher's busy/idle seconds and peak memory), then exactly that student's rows of sparse outputs
   (`lingua.kd_loss.TeacherOutputs`). An error on the teacher travels in the status record, so
   students raise it instead of waiting.
3. STOP: the same exchange with op=STOP; the teacher answers and leaves its loop. The teacher never
   counts steps: a resumed run simply starts sending step N.

Both collectives of a request are posted asynchronously (`submit`), so the teacher's forward runs
while the student computes its own; `handle.wait()` returns the outputs.

Timing on CUDA: NCCL's blocking calls only order streams, the CPU returns at once. So the teacher's
idle time ends when the headers reach the CPU and its busy time when its stream has run the forward,
and a student's wait starts after its own queued work and ends when the response has landed.
"""

import contextlib
import hashlib
import json
import logging
import struct
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from lingua.distributed import HangWatch, PreemptionFlag, Topology, log_collective, set_collective_timeout
from lingua.kd_loss import TeacherOutputs, sparsify_teacher_logits
from lingua.metrics import MemoryMonitor

logger = logging.getLogger(__name__)

OP_FORWARD, OP_STOP, OP_ERROR = 1, 2, 3
OP_NAMES = {OP_FORWARD: "FORWARD", OP_STOP: "STOP", OP_ERROR: "ERROR"}
HEADER_INTS = 8  # op, step, micro_step, bsz, seqlen, train_rank, bad_tokens, 0
RECORD_FIELDS = 16  # int64 fields of a handshake record / response status
MESSAGE_BYTES = 2048
RECORD_BYTES = RECORD_FIELDS * 8 + MESSAGE_BYTES
FORMATS = ("topk", "sampled", "full")
WIRE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
WIRE_NAMES = tuple(WIRE_DTYPES)
# Handshake record: role (1 teacher, 2 student), status, vocab, tokenizer fingerprint, max positions,
# max bsz, max seqlen, global rank, then the agreed settings from this index on.
SETTINGS_FIELD = 8
TEACHER_PREPARE_HINT = (
    "point distillation.teacher_path at a transformers checkpoint directory, or make one: "
    "`python -m setup.prepare_teacher --out {path}` (SmolLM2-135M-Instruct, the demo teacher) or "
    "`python -m setup.make_tiny_teacher --out {path}` (the tiny test teacher)"
)


class TeacherError(RuntimeError):
    """A teacher-side failure every bridge member reports in the same words (load, request, forward)."""


def _float_bits(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


def _bits_float(bits: int) -> float:
    return struct.unpack("<d", struct.pack("<q", bits))[0]


# What teacher and students must agree on, each as (name, encode args -> int64, decode int64 -> value).
AGREED_SETTINGS = (
    ("output", lambda a: FORMATS.index(a.output), lambda v: FORMATS[v]),
    ("k", lambda a: a.k, int),  # top-k ids, or samples per position for "sampled"
    ("wire_dtype", lambda a: WIRE_NAMES.index(a.wire_dtype), lambda v: WIRE_NAMES[v]),
    ("temperature", lambda a: _float_bits(a.temperature), _bits_float),  # applied by the teacher, used by the loss
)


@dataclass
class DistillationArgs:
    teacher_path: Optional[str] = None  # local directory (or hub id when online) of a transformers causal LM
    n_teacher_ranks: int = 1
    output: str = "topk"  # "topk" | "sampled" | "full"
    k: int = 64  # top-k ids, or samples per position for "sampled"
    temperature: float = 1.0
    alpha: float = 0.5  # loss = (1 - alpha) * CE + alpha * T^2 * KD
    alpha_schedule: str = "constant"  # "constant" | "lr" (alpha follows the lr schedule's factor)
    divergence: str = "fkl"  # "fkl" | "rkl" | "jsd"
    jsd_beta: float = 0.5
    teacher_dtype: str = "auto"  # "auto" (bf16 on GPU, fp32 on CPU) | "bf16" | "fp32" | "fp16"
    attn_implementation: Optional[str] = "sdpa"
    wire_dtype: str = "bf16"  # dtype of the values sent to students: "bf16" | "fp16" | "fp32"
    loss_chunk_size: int = 1024  # positions per chunk in the student's KD loss
    logits_chunk_rows: int = 4  # teacher rows per lm_head chunk (bounds the teacher's logits memory)
    seed: int = 0  # for the "sampled" output


def validate_distillation_args(args: DistillationArgs) -> None:
    """Readable errors for distillation settings, before anything distributed happens."""
    if args.output not in FORMATS:
        raise ValueError(f"distillation.output={args.output!r}; use one of {', '.join(FORMATS)}.")
    if args.wire_dtype not in WIRE_DTYPES:
        raise ValueError(f"distillation.wire_dtype={args.wire_dtype!r}; use one of {', '.join(WIRE_DTYPES)}.")
    if args.divergence not in ("fkl", "rkl", "jsd"):
        raise ValueError(f"distillation.divergence={args.divergence!r}; use fkl, rkl or jsd.")
    if args.output == "sampled" and args.divergence != "fkl":
        raise ValueError("distillation.output=sampled estimates the forward KL only; set distillation.divergence=fkl.")
    if not 0.0 <= args.alpha <= 1.0:
        raise ValueError(f"distillation.alpha={args.alpha} must be in [0, 1].")
    if args.temperature <= 0:
        raise ValueError(f"distillation.temperature={args.temperature} must be positive.")
    if args.output != "full" and args.k < 1:
        raise ValueError(f"distillation.k={args.k} must be >= 1.")
    if not args.teacher_path:
        raise ValueError("Distillation is on but distillation.teacher_path is empty; set it or enable_distillation=false.")


def tokenizer_fingerprint(vocab: dict[str, int]) -> int:
    """A 63-bit hash of a token -> id map: equal iff students and teacher tokenize identically."""
    digest = hashlib.sha256(json.dumps(sorted(vocab.items())).encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _pack_record(fields: list[int], message: str = "") -> torch.Tensor:
    record = torch.zeros(RECORD_BYTES, dtype=torch.uint8)
    ints = torch.zeros(RECORD_FIELDS, dtype=torch.int64)
    ints[: len(fields)] = torch.tensor(fields, dtype=torch.int64)
    record[: RECORD_FIELDS * 8] = ints.view(torch.uint8)
    encoded = message.encode()[:MESSAGE_BYTES]
    record[RECORD_FIELDS * 8: RECORD_FIELDS * 8 + len(encoded)] = torch.tensor(list(encoded), dtype=torch.uint8)
    return record


def _unpack_record(record: torch.Tensor) -> tuple[list[int], str]:
    record = record.cpu()
    fields = record[: RECORD_FIELDS * 8].clone().view(torch.int64).tolist()
    message = bytes(record[RECORD_FIELDS * 8:].tolist()).rstrip(b"\0").decode(errors="replace")
    return fields, message


def _segments(spec: list[tuple[tuple[int, ...], torch.dtype]]) -> list[tuple[int, int]]:
    """(offset, nbytes) of each wire tensor inside a response payload, 8-byte aligned."""
    out, offset = [], 0
    for shape, dtype in spec:
        nbytes = torch.Size(shape).numel() * torch.tensor([], dtype=dtype).element_size()
        out.append((offset, nbytes))
        offset += (nbytes + 7) // 8 * 8
    return out


@dataclass
class BridgeSpec:
    """What both sides agreed at the handshake: buffer shapes and output format."""

    max_bsz: int
    max_seqlen: int
    vocab_size: int
    output: str
    k: int
    wire_dtype: torch.dtype

    def payload_spec(self):
        return TeacherOutputs.wire_spec(self.output, self.max_bsz, self.max_seqlen, self.k, self.vocab_size, self.wire_dtype)

    def response_bytes(self) -> int:
        segments = _segments(self.payload_spec())
        last_offset, last_nbytes = segments[-1]
        return RECORD_BYTES + (last_offset + last_nbytes + 7) // 8 * 8

    def request_ints(self) -> int:
        return HEADER_INTS + self.max_bsz * self.max_seqlen


def settings_fields(args: DistillationArgs) -> list[int]:
    """This rank's agreed settings as handshake record fields (from SETTINGS_FIELD on)."""
    return [encode(args) for _, encode, _ in AGREED_SETTINGS]


def _settings(fields: list[int]) -> dict:
    return {name: decode(fields[SETTINGS_FIELD + i]) for i, (name, _, decode) in enumerate(AGREED_SETTINGS)}


def agreed_handshake(topo: Topology, my_record: torch.Tensor, args: DistillationArgs) -> BridgeSpec:
    """Handshake on my bridge, then every rank's verdict over the world: a failure in one bridge
    (teacher 1 could not load) stops the ranks of every bridge with its sentence, not only its own."""
    try:
        bridge_ranks = dist.get_process_group_ranks(topo.bridge_group)
        spec, error = check_handshake(_handshake(topo, my_record), bridge_ranks, topo.my_teacher, args), None
    except (TeacherError, ValueError) as err:
        spec, error = None, err
    verdicts: list[Optional[str]] = [None] * topo.world_size
    mine = None if error is None else f"{type(error).__name__}: {error}"
    log_collective("all_gather_object handshake verdicts", dist.group.WORLD)
    dist.all_gather_object(verdicts, mine, group=dist.group.WORLD)
    if error is not None:
        raise error
    # A teacher's verdict first: it is the root cause the students of its bridge only repeat.
    failed = sorted((rank not in topo.teacher_ranks, rank, verdict) for rank, verdict in enumerate(verdicts) if verdict)
    if failed:
        _, rank, verdict = failed[0]
        raise TeacherError(f"the handshake failed in another bridge (rank {rank}): {verdict}")
    return spec


def _handshake(topo: Topology, my_record: torch.Tensor) -> list[tuple[list[int], str]]:
    """All-gather every bridge member's record; returns them in bridge-group rank order."""
    my_record = my_record.to(topo.device)  # input and outputs on the backend's device (NCCL: the GPU)
    records = [torch.empty_like(my_record) for _ in range(dist.get_world_size(topo.bridge_group))]
    log_collective("all_gather handshake", topo.bridge_group, my_record)
    dist.all_gather(records, my_record, group=topo.bridge_group)
    return [_unpack_record(r) for r in records]


def check_handshake(records: list[tuple[list[int], str]], bridge_ranks: list[int], teacher_rank: int,
                    args: DistillationArgs) -> BridgeSpec:
    """The same checks on every bridge member (records in bridge order), so every rank raises the same sentence."""
    t_fields, t_message = records[bridge_ranks.index(teacher_rank)]
    _, t_status, t_vocab, t_fingerprint, t_max_pos = t_fields[:5]
    if t_status != 0:
        raise TeacherError(f"Teacher rank {teacher_rank} failed to load: {t_message}")
    served = _settings(t_fields)
    students = [(rank, fields) for rank, (fields, _) in zip(bridge_ranks, records) if rank != teacher_rank]
    for rank, fields in students:
        asked = _settings(fields)
        differ = [name for name in served if asked[name] != served[name]
                  and not (name == "k" and served["output"] == asked["output"] == "full")]  # full sends no ids
        if differ:
            detail = ", ".join(f"distillation.{name} is {served[name]} on the teacher but {asked[name]} on the student"
                               for name in differ)
            raise ValueError(f"Teacher rank {teacher_rank} and student rank {rank} disagree: {detail}; give every "
                             f"rank the same distillation settings (one config for the whole job).")
    max_bsz = max_seqlen = 0
    for rank, (_, _, s_vocab, s_fingerprint, _, s_bsz, s_seqlen, *_) in students:
        if s_fingerprint != t_fingerprint or s_vocab > t_vocab:
            same_size = ", the same size but different tokens" if s_vocab == t_vocab else ""
            raise ValueError(
                f"Student rank {rank}'s tokenizer (vocab {s_vocab}) does not match the teacher's "
                f"(vocab {t_vocab}{same_size}) at {args.teacher_path}. Students must use the teacher's tokenizer: "
                f"set data.tokenizer.name=hf data.tokenizer.path={args.teacher_path}."
            )
        max_bsz, max_seqlen = max(max_bsz, s_bsz), max(max_seqlen, s_seqlen)
    if max_seqlen > t_max_pos > 0:
        raise ValueError(
            f"Students send sequences of {max_seqlen} tokens but the teacher supports at most {t_max_pos} "
            f"positions; set data.seq_len <= {t_max_pos}."
        )
    # Students' logits cover their tokenizer's vocab; teacher rows beyond it are padding and are cut.
    student_vocab = students[0][1][2]
    return BridgeSpec(max_bsz, max_seqlen, student_vocab, served["output"], served["k"],
                      WIRE_DTYPES[served["wire_dtype"]])


def _synchronize(device: torch.device) -> None:
    """Block the CPU until `device`'s current stream has run (a no-op on CPU, where nothing is queued)."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


# ---------------------------------------------------------------- student side

class TeacherHandle:
    """One in-flight request. `wait()` returns this student's TeacherOutputs (on its device)."""

    def __init__(self, client: "TeacherClient", works, response: torch.Tensor, bsz: int, seqlen: int, step: int):
        self.client, self.works, self.response = client, works, response
        self.bsz, self.seqlen, self.step = bsz, seqlen, step
        self.submitted_at = time.time()
        self.wait_s = 0.0

    def wait(self) -> TeacherOutputs:
        device = self.client.topo.device
        _synchronize(device)  # our own queued forward is compute, not teacher time
        start = time.perf_counter()
        for work in self.works:
            work.wait()
        _synchronize(device)  # on NCCL wait() only orders our stream after the transfer: block until it landed
        self.wait_s = time.perf_counter() - start
        self.client.total_wait_s += self.wait_s
        if self.client.first_round_trip is None:
            self.client.first_round_trip = (self.submitted_at, time.time())
        return self.client._decode(self.response, self.bsz, self.seqlen, self.step)


class TeacherClient:
    """Student side of the bridge. Build it right after the student model (it runs the handshake)."""

    def __init__(self, args: DistillationArgs, topo: Topology, vocab: dict[str, int], n_words: int,
                 max_bsz: int, max_seqlen: int):
        assert topo.is_student and topo.bridge_group is not None
        self.args, self.topo = args, topo
        self.teacher_rank = topo.my_teacher
        record = _pack_record([2, 0, n_words, tokenizer_fingerprint(vocab), 0, max_bsz, max_seqlen, topo.global_rank,
                               *settings_fields(args)])
        self.spec = agreed_handshake(topo, record, args)
        self.n_words = n_words
        self.total_wait_s = 0.0
        self.first_round_trip: Optional[tuple[float, float]] = None  # wall-clock (submit, done)
        # The teacher's cumulative serving clock and peak memory, as of its latest response.
        self.teacher_busy_s = self.teacher_idle_s = self.teacher_peak_gib = 0.0
        self.teacher_preempt = False  # the teacher received a preemption signal
        self.bytes_up = self.bytes_down = 0  # sizes of the buffers this rank handed to gather / got from scatter
        self.stopped = False
        logger.info(
            f"teacher rank {self.teacher_rank} ready: output={self.spec.output} k={self.spec.k} "
            f"vocab={self.spec.vocab_size} buffers [{self.spec.max_bsz} x {self.spec.max_seqlen}]"
        )

    @property
    def teacher_busy(self) -> float:
        """Fraction of the teacher's time since the handshake spent computing (vs waiting for requests)."""
        return self.teacher_busy_s / max(self.teacher_busy_s + self.teacher_idle_s, 1e-9)

    def metrics(self) -> dict[str, float]:
        """Bridge metrics for a log row; all cumulative since launch, so a window is a difference of two rows."""
        return {"kd/teacher_busy": self.teacher_busy, "kd/teacher_busy_s": self.teacher_busy_s,
                "kd/teacher_idle_s": self.teacher_idle_s, "kd/teacher_peak_gib": self.teacher_peak_gib,
                "kd/bytes_up": self.bytes_up, "kd/bytes_down": self.bytes_down}

    def _post(self, op: int, step: int, micro_step: int, tokens: Optional[torch.Tensor]) -> TeacherHandle:
        bsz, seqlen = (0, 0) if tokens is None else tuple(tokens.shape)
        if bsz > self.spec.max_bsz or seqlen > self.spec.max_seqlen:
            raise ValueError(
                f"Batch of shape [{bsz}, {seqlen}] is larger than the [{self.spec.max_bsz}, {self.spec.max_seqlen}] "
                f"announced to the teacher at the handshake."
            )
        request = torch.zeros(self.spec.request_ints(), dtype=torch.int32, device=self.topo.device)
        request[:6] = torch.tensor([op, step, micro_step, bsz, seqlen, self.topo.train_rank], dtype=torch.int32)
        if tokens is not None:
            # Out-of-range ids are flagged in the header, computed on the device (no host sync per
            # micro-batch); the teacher refuses the request, so every student of the bridge raises together.
            request[6] = ((tokens < 0) | (tokens >= self.n_words)).any()
            grid = request[HEADER_INTS:].view(self.spec.max_bsz, self.spec.max_seqlen)
            grid[:bsz, :seqlen] = tokens.to(device=self.topo.device, dtype=torch.int32)
        response = torch.empty(self.spec.response_bytes(), dtype=torch.uint8, device=self.topo.device)
        group = self.topo.bridge_group
        log_collective(f"gather+scatter request op={OP_NAMES[op]} step={step}.{micro_step}", group, request, response)
        up = dist.gather(request, None, dst=self.teacher_rank, group=group, async_op=True)
        down = dist.scatter(response, None, src=self.teacher_rank, group=group, async_op=True)
        # What goes over the bridge is the whole framed buffer (header/status, padding), not only the payload.
        self.bytes_up += request.numel() * request.element_size()
        self.bytes_down += response.numel() * response.element_size()
        return TeacherHandle(self, [up, down], response, bsz, seqlen, step)

    def submit(self, input_ids: torch.Tensor, step: int, micro_step: int) -> TeacherHandle:
        """Send one micro-batch of tokens [bsz, seqlen]; returns a handle whose wait() gives outputs."""
        return self._post(OP_FORWARD, step, micro_step, input_ids)

    def stop(self, step: int, error: bool = False) -> None:
        """Tell the teacher to leave its loop (end of training, preemption, agreed error)."""
        if self.stopped:
            return
        handle = self._post(OP_ERROR if error else OP_STOP, step, 0, None)
        handle.works[0].wait()
        handle.works[1].wait()
        self.stopped = True
        fields, message = _unpack_record(handle.response[:RECORD_BYTES])
        if fields[0] != 0 and not error:
            raise TeacherError(f"Teacher rank {self.teacher_rank} reported at STOP: {message}")
        logger.info(f"sent STOP to teacher rank {self.teacher_rank} at step {step}")

    def _decode(self, response: torch.Tensor, bsz: int, seqlen: int, step: int) -> TeacherOutputs:
        fields, message = _unpack_record(response[:RECORD_BYTES])
        if fields[0] != 0:
            raise TeacherError(f"Teacher rank {self.teacher_rank} failed at step {step}: {message}")
        self.teacher_preempt = self.teacher_preempt or bool(fields[1])
        self.teacher_busy_s, self.teacher_idle_s = fields[2] / 1e6, fields[3] / 1e6
        self.teacher_peak_gib = fields[4] / 2**30
        payload = response[RECORD_BYTES:]
        tensors = []
        for (shape, dtype), (offset, nbytes) in zip(self.spec.payload_spec(), _segments(self.spec.payload_spec())):
            t = payload[offset: offset + nbytes].view(dtype).view(shape)
            tensors.append(t[:bsz, :seqlen])
        return TeacherOutputs.from_tensors(self.spec.output, tensors)


# ---------------------------------------------------------------- teacher side

def _teacher_dtype(args: DistillationArgs, device: torch.device) -> torch.dtype:
    if args.teacher_dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    names = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}
    if args.teacher_dtype not in names:
        raise ValueError(f"distillation.teacher_dtype={args.teacher_dtype!r}; use auto, bf16, fp32 or fp16.")
    return names[args.teacher_dtype]


def _short_reason(err: BaseException, limit: int = 400) -> str:
    """An exception as one line, cut to `limit` characters (transformers' messages can list every model type)."""
    text = " ".join(f"{type(err).__name__}: {err}".split()).rstrip(".")  # the sentence goes on after it
    return text if len(text) <= limit else text[: limit - 3] + "..."


def load_teacher(args: DistillationArgs, device: torch.device):
    """(model, tokenizer) from a local directory or a hub id; any failure is one sentence naming the path,
    the reason and how to prepare a teacher."""
    from huggingface_hub import is_offline_mode
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a progress bar per rank garbles the logs

    path = args.teacher_path
    local = Path(path).expanduser()
    hint = TEACHER_PREPARE_HINT.format(path=path)
    # "org/name" that is not on disk may be a hub id; anything else must be a local directory.
    hub_like = not path.startswith((".", "/", "~")) and path.count("/") == 1 and not local.exists()
    if not hub_like and not local.is_dir():
        what = "is a file, not a directory" if local.exists() else "does not exist"
        raise FileNotFoundError(f"teacher path '{path}' {what}; {hint}.")
    source = path if hub_like else str(local)
    dtype = _teacher_dtype(args, device)
    kwargs = dict(dtype=dtype)
    if args.attn_implementation:
        kwargs["attn_implementation"] = args.attn_implementation
    try:
        model = AutoModelForCausalLM.from_pretrained(source, **kwargs)
        tokenizer = AutoTokenizer.from_pretrained(source)
    except Exception as err:  # empty dir, truncated safetensors, missing tokenizer, unknown hub id, ...
        if hub_like:
            offline = ", and the Hugging Face hub is offline (HF_HUB_OFFLINE)" if is_offline_mode() else ""
            raise FileNotFoundError(
                f"teacher path '{path}' is neither a local directory (nothing at {local.resolve()}) nor a hub model "
                f"that could be loaded{offline}: {_short_reason(err)}; {hint}."
            ) from err
        raise ValueError(f"teacher directory '{path}' could not be loaded ({_short_reason(err)}); {hint}.") from err
    model = model.to(device).eval()
    model.requires_grad_(False)
    return model, tokenizer


class TeacherServer:
    """Teacher side: load, handshake, then answer requests until every student sent STOP."""

    def __init__(self, args: DistillationArgs, topo: Topology, preemption: Optional[PreemptionFlag] = None,
                 inject_load_failure: bool = False, phases=None):
        assert topo.is_teacher
        self.args, self.topo = args, topo
        self.model = None
        status, message, vocab, fingerprint, max_pos = 0, "", 0, 0, 0
        start, start_wall = time.perf_counter(), time.time()
        try:
            if inject_load_failure:
                raise RuntimeError("injected teacher load failure (inject_failure=teacher_load:...)")
            self.model, tokenizer = load_teacher(args, topo.device)
            vocab = int(self.model.get_output_embeddings().weight.shape[0])
            fingerprint = tokenizer_fingerprint(tokenizer.get_vocab())
            max_pos = int(getattr(self.model.config, "max_position_embeddings", 0) or 0)
            logger.info(f"teacher {args.teacher_path} loaded in {time.perf_counter() - start:.1f}s "
                        f"(vocab {vocab}, {sum(p.numel() for p in self.model.parameters()) / 1e6:.1f}M params)")
        except Exception as err:  # every rank must hear about it, not only this one
            status, message = 1, f"{type(err).__name__}: {err}"
            logger.error(f"teacher failed to load: {message}")
        if phases is not None:
            phases.record("teacher_load", start_wall, time.time())
        record = _pack_record([1, status, vocab, fingerprint, max_pos, 0, 0, topo.global_rank, *settings_fields(args)],
                              message)
        with phases.span("teacher_handshake") if phases is not None else contextlib.nullcontext():
            self.spec = agreed_handshake(topo, record, args)
        self.bridge_ranks = dist.get_process_group_ranks(topo.bridge_group)
        self.generator = torch.Generator(device=topo.device).manual_seed(args.seed + topo.global_rank)
        self.memory = MemoryMonitor(topo.device)
        self.busy_s = self.idle_s = 0.0
        self.requests = 0
        # A signal on the teacher cannot stop anything by itself: it rides on every response, and the
        # students fold it into their agreed control bits.
        self.preemption = preemption or PreemptionFlag()

    def serve(self, timeouts: Optional[tuple[float, float]] = None) -> None:
        """The loop. Returns after a STOP; raises (after telling the students) on any error.

        `timeouts` = (init, train) seconds. The generous one holds through the students' whole first
        step (checkpoint load, compile, the first backward, optimizer, a save): every group switches
        to the short one when a request of a later step than the first request's (or a STOP)
        arrives -- the step comes from the headers, so a resumed run works the same. Each wait arms
        a stack dump shortly before the timeout in force, so a teacher stuck waiting says where.
        """
        spec, group, device = self.spec, self.topo.bridge_group, self.topo.device
        hang_watch = HangWatch() if timeouts is not None else None
        timeout_s = timeouts[0] if timeouts is not None else None
        first_step, in_training = None, False  # the step of this launch's first request; short timeout on?
        n = len(self.bridge_ranks)
        mine = self.bridge_ranks.index(self.topo.global_rank)
        gather_list = [torch.empty(spec.request_ints(), dtype=torch.int32, device=device) for _ in range(n)]
        request = torch.zeros(spec.request_ints(), dtype=torch.int32, device=device)
        # Allocated once: a request writes only its rows and students read only theirs. The teacher's own
        # slot is a throwaway; a separate output buffer avoids aliasing the scatter input.
        responses = [torch.zeros(spec.response_bytes(), dtype=torch.uint8, device=device) for _ in range(n)]
        scatter_out = torch.empty_like(responses[mine])
        last_report = mark = time.perf_counter()  # mark: where the previous request's work ended
        while True:
            if hang_watch is not None:
                hang_watch.arm(timeout_s)
            log_collective("gather request (teacher)", group, request)
            dist.gather(request, gather_list, dst=self.topo.global_rank, group=group)
            students = [(r, gather_list[i]) for i, r in enumerate(self.bridge_ranks) if i != mine]
            work_start, ops, step, error = None, set(), None, None
            # Everything between the gather and the scatter is guarded: whatever fails here (bad headers,
            # the forward, out of memory, a CUDA error surfacing at the sync), the students get its sentence.
            try:
                # One copy to the CPU for all headers; on NCCL this is where the wait for the request really ends.
                header_rows = torch.stack([buf[:HEADER_INTS] for _, buf in students]).tolist()
                work_start = time.perf_counter()
                headers = {r: h for (r, _), h in zip(students, header_rows)}
                ops = {h[0] for h in headers.values()}
                step = header_rows[0][1]
                if first_step is None:
                    first_step = step
                if timeouts is not None and not in_training and (step > first_step or OP_STOP in ops):
                    # The students finished their first step (they only send a later one after it): short from now on.
                    in_training, timeout_s = True, timeouts[1]
                    set_collective_timeout(self.topo, timeout_s)
                error = self._check_headers(headers, students)
                if error is None and ops == {OP_FORWARD}:
                    self._forward(students, headers, responses)
                _synchronize(device)  # on CUDA the forward was only queued: busy until it has run
                peak_bytes = int(self.memory.get_peak_stats()["mem/peak_gib"] * 2**30)
            except Exception as err:
                where = "a request" if step is None else f"step {step}"
                error, peak_bytes = f"teacher failed serving {where}: {type(err).__name__}: {err}", 0
            now = time.perf_counter()
            work_start = work_start or now
            self.idle_s += work_start - mark
            self.busy_s += now - work_start
            status = 0 if error is None else 1
            record = _pack_record([status, int(self.preemption.requested), int(self.busy_s * 1e6),
                                   int(self.idle_s * 1e6), peak_bytes], error or "").to(device)
            for buf in responses:
                buf[:RECORD_BYTES] = record
            log_collective("scatter responses (teacher)", group, responses[mine])
            dist.scatter(scatter_out, responses, src=self.topo.global_rank, group=group)
            mark = time.perf_counter()
            self.busy_s += mark - now  # packing and sending the responses is serving time too
            self.requests += 1
            if hang_watch is not None and (error is not None or ops == {OP_STOP}):
                hang_watch.cancel()
            if error is not None:
                raise TeacherError(error)
            busy = self.busy_s / max(self.busy_s + self.idle_s, 1e-9)
            if ops == {OP_STOP}:
                logger.info(f"STOP received after {self.requests - 1} requests; teacher busy {100 * busy:.0f}% of the time")
                return
            if time.perf_counter() - last_report > 30:
                last_report = time.perf_counter()
                # Whether the teacher is the bottleneck shows on the students' side (their wait share).
                logger.info(f"served {self.requests} requests; busy {100 * busy:.0f}% of the time")

    def _check_headers(self, headers: dict[int, list[int]], students) -> Optional[str]:
        ops = {h[0] for h in headers.values()}
        if OP_ERROR in ops:
            failed = [r for r, h in headers.items() if h[0] == OP_ERROR]
            return f"student rank(s) {failed} stopped on an error at step {headers[failed[0]][1]}"
        keys = {(h[0], h[1], h[2]) for h in headers.values()}
        if len(keys) > 1:
            detail = "; ".join(f"rank {r}: op={OP_NAMES.get(h[0], h[0])} step={h[1]} micro_step={h[2]}"
                               for r, h in sorted(headers.items()))
            return f"students sent mismatched requests ({detail})"
        for r, h in headers.items():
            if h[3] > self.spec.max_bsz or h[4] > self.spec.max_seqlen:
                return f"student rank {r} sent shape [{h[3]}, {h[4]}] beyond the agreed [{self.spec.max_bsz}, {self.spec.max_seqlen}]"
        for r, buf in students:
            if headers[r][6]:  # flagged by the student's device-side check; only this error path syncs
                bsz, seqlen = headers[r][3], headers[r][4]
                tokens = buf[HEADER_INTS:].view(self.spec.max_bsz, self.spec.max_seqlen)[:bsz, :seqlen]
                return (f"student rank {r} sent token ids outside [0, {self.spec.vocab_size}) at step {headers[r][1]} "
                        f"(got [{int(tokens.min())}, {int(tokens.max())}]); its data must use the teacher's tokenizer")
        return None

    @torch.inference_mode()
    def _forward(self, students, headers: dict[int, list[int]], responses) -> None:
        spec = self.spec
        shapes = [(headers[r][3], headers[r][4]) for r, _ in students]
        seqlen = max(s for _, s in shapes)
        rows = [buf[HEADER_INTS:].view(spec.max_bsz, spec.max_seqlen)[:b, :seqlen] for (_, buf), (b, _) in zip(students, shapes)]
        # Right padding is invisible to a causal model's earlier positions: one forward for all students.
        tokens = torch.cat(rows).long()
        hidden = self._hidden_states(tokens)
        row = 0
        for (rank, _), (bsz, slen), index in zip(students, shapes, [self.bridge_ranks.index(r) for r, _ in students]):
            outputs = self._sparse_outputs(hidden[row: row + bsz, :slen])
            row += bsz
            payload = responses[index][RECORD_BYTES:]
            for t, (shape, dtype), (offset, nbytes) in zip(outputs.tensors(), spec.payload_spec(), _segments(spec.payload_spec())):
                dest = payload[offset: offset + nbytes].view(dtype).view(shape)
                dest[: t.shape[0], : t.shape[1]] = t

    def _hidden_states(self, tokens: torch.Tensor) -> torch.Tensor:
        decoder = self.model.get_decoder()
        return decoder(input_ids=tokens).last_hidden_state

    def _sparse_outputs(self, hidden: torch.Tensor) -> TeacherOutputs:
        """lm_head + sparsification a few rows at a time, so [rows, S, V] logits never exist at once."""
        head = self.model.get_output_embeddings()
        softcap = getattr(self.model.config, "final_logit_softcapping", None)
        parts = []
        for start in range(0, hidden.shape[0], max(1, self.args.logits_chunk_rows)):
            logits = head(hidden[start: start + self.args.logits_chunk_rows]).float()
            if softcap:
                logits = torch.tanh(logits / softcap) * softcap
            logits = logits[..., : self.spec.vocab_size]
            parts.append(sparsify_teacher_logits(
                logits, self.spec.output, self.spec.k, self.args.temperature, self.spec.wire_dtype, self.generator
            ))
        return TeacherOutputs.from_tensors(self.spec.output, [torch.cat(ts) for ts in zip(*(p.tensors() for p in parts))])
