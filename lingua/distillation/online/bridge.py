"""The bridge protocol between a teacher and its students (`topo.bridge_group`): the wire records and the handshake,
walked through in docs/distillation_internals.md ("What the teacher sends").

Handshake once (`agreed_handshakes`: every member's `HandshakeRecord`, the same `check_handshake` on every rank, then
every rank's verdict over the world, so a failure in any bridge is the same sentence everywhere); then per
micro-batch one gather of each student's `RequestHeader` and tokens and one scatter of each student's
`ResponseStatus` and outputs (`BridgeSpec`); then STOP or ERROR, sent by the students only after completing every
request they posted. A teacher that failed answers every later request with its error until then. Records are
fixed-size (int64 fields, then MESSAGE_BYTES of UTF-8), so the collectives always move the same shapes.
"""

import logging
import struct
from dataclasses import dataclass, field, fields
from enum import IntEnum
from typing import Optional

import torch
import torch.distributed as dist

from lingua.distillation.args import WIRE_DTYPES, DistillationArgs, check_seq_len_fits_teacher, teacher_title
from lingua.distillation.distiller import tokenizer_fingerprint
from lingua.distillation.outputs import FORMATS, TeacherOutputs
from lingua.errors import ConfigError, PeerStopped, TeacherError, UserError, describe
from lingua.parallel.collectives import log_collective

logger = logging.getLogger(__name__)

RECORD_INTS = 16  # int64 fields of a response status (and the default of a record)
HANDSHAKE_INTS = 20  # int64 fields of a handshake record (its settings outgrew 16; responses keep their size)
MESSAGE_BYTES = 2048
RECORD_BYTES = RECORD_INTS * 8 + MESSAGE_BYTES
HANDSHAKE_BYTES = HANDSHAKE_INTS * 8 + MESSAGE_BYTES
NAN_WORD = 6  # int64 field of a ResponseStatus after the packed ones: the teacher's outputs held NaN (a device copy)
WIRE_NAMES = tuple(WIRE_DTYPES)


class Op(IntEnum):
    FORWARD = 1  # run the forward on these tokens
    STOP = 2  # training is over (or preempted): answer and leave the loop
    ERROR = 3  # the students agreed on an error: answer and raise it


class Failure(IntEnum):
    """The `failed` word of a handshake record or a response status: whether, and how, the teacher failed."""

    NONE = 0
    USER = 1  # a user error (lingua/errors.py): every rank raises its sentence
    BUG = 2  # anything else: the teacher raises it with its traceback, its students name the teacher


def failure_word(failed: bool, bug: bool) -> int:
    return Failure.NONE if not failed else Failure.BUG if bug else Failure.USER


def teacher_failure(sentence: str, bug: bool) -> Exception:
    """A teacher's user error in its words, or for a bug (traceback in the teacher's log) a stop naming it."""
    return PeerStopped(sentence) if bug else TeacherError(sentence)


def pack_record(ints: list[int], message: str = "", pin: bool = False, n_ints: int = RECORD_INTS) -> torch.Tensor:
    """`n_ints` int64 fields then the message, one uint8 host tensor (pinned with `pin`: a non-blocking copy)."""
    record = torch.zeros(n_ints * 8 + MESSAGE_BYTES, dtype=torch.uint8, pin_memory=pin)
    values = torch.zeros(n_ints, dtype=torch.int64)
    values[: len(ints)] = torch.tensor(ints, dtype=torch.int64)
    record[: n_ints * 8] = values.view(torch.uint8)
    encoded = message.encode()[:MESSAGE_BYTES]
    record[n_ints * 8: n_ints * 8 + len(encoded)] = torch.tensor(list(encoded), dtype=torch.uint8)
    return record


def record_ints(record: torch.Tensor, n_ints: int = RECORD_INTS) -> list[int]:
    return record[: n_ints * 8].cpu().clone().view(torch.int64).tolist()


def record_message(record: torch.Tensor, n_ints: int = RECORD_INTS) -> str:
    return bytes(record[n_ints * 8:].cpu().tolist()).rstrip(b"\0").decode(errors="replace")


def _float_bits(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


def _bits_float(bits: int) -> float:
    return struct.unpack("<d", struct.pack("<q", bits))[0]


ATTN_MASKS = ("causal", "doc_causal")

# What teacher and students must agree on: (name, the config key it comes from, encode -> int64, decode).
AGREED_SETTINGS = (
    ("output", "distillation.output", FORMATS.index, lambda v: FORMATS[v]),
    ("k", "distillation.k", int, int),  # top-k ids, or samples per position for "sampled"
    ("wire_dtype", "distillation.wire_dtype", WIRE_NAMES.index, lambda v: WIRE_NAMES[v]),
    ("temperature", "distillation.temperature", _float_bits, _bits_float),  # applied by the teacher, used by the loss
    # doc_causal: requests carry document ids and the teacher attends within documents, like the student.
    ("attn_mask", "model.attn_mask", ATTN_MASKS.index, lambda v: ATTN_MASKS[v]),
    # The teacher aligns the students' text to its own tokenizer; replies carry a kd_weight per position.
    ("cross_tokenizer", "distillation.cross_tokenizer", int, bool),
    # > 0: cross-tokenizer replies also carry the teacher's unmapped entries, marked, for ULD (`uld.py`).
    ("uld_weight", "distillation.uld_weight", _float_bits, _bits_float),
)


def agreed_settings(args: DistillationArgs, attn_mask: str = "causal") -> dict:
    return {"output": args.output, "k": args.k, "wire_dtype": args.wire_dtype, "temperature": args.temperature,
            "attn_mask": attn_mask, "cross_tokenizer": args.cross_tokenizer, "uld_weight": args.uld_weight}


@dataclass
class HandshakeRecord:
    role: str  # "teacher" | "student"
    global_rank: int
    vocab: int  # teacher: rows of its output head; student: its tokenizer's size
    tokenizer_fingerprint: int
    settings: dict  # AGREED_SETTINGS name -> value
    loaded: bool = True  # teacher: False when it failed to load (`message` says why)
    bug: bool = False  # teacher: its load failed on a bug, not on a user error
    max_positions: int = 0  # teacher: the longest sequence it supports (0 = unknown)
    max_bsz: int = 0  # student: the largest batch it will send
    max_seqlen: int = 0
    heldout_ce: Optional[float] = None  # teacher: its own CE on the students' held-out windows, when asked
    heldout_bpb: Optional[float] = None  # teacher: the same in bits per byte
    message: str = ""

    ROLES = ("", "teacher", "student")  # wire codes 1 and 2

    def pack(self) -> torch.Tensor:
        settings = [encode(self.settings[name]) for name, _, encode, _ in AGREED_SETTINGS]
        heldout = [_float_bits(float("nan") if value is None else value) for value in (self.heldout_ce,
                                                                                        self.heldout_bpb)]
        return pack_record([self.ROLES.index(self.role), failure_word(not self.loaded, self.bug), self.vocab,
                            self.tokenizer_fingerprint, self.max_positions, self.max_bsz, self.max_seqlen,
                            self.global_rank, *settings, *heldout], self.message, n_ints=HANDSHAKE_INTS)

    @classmethod
    def unpack(cls, record: torch.Tensor) -> "HandshakeRecord":
        fields = record_ints(record, HANDSHAKE_INTS)
        role, failed, vocab, fingerprint, max_pos, max_bsz, max_seqlen, rank, *rest = fields
        settings = {name: decode(value) for (name, _, _, decode), value in zip(AGREED_SETTINGS, rest)}
        heldout_ce, heldout_bpb = (_bits_float(bits) for bits in rest[len(AGREED_SETTINGS):len(AGREED_SETTINGS) + 2])
        return cls(cls.ROLES[role], rank, vocab, fingerprint, settings, loaded=not failed, bug=failed == Failure.BUG,
                   max_positions=max_pos, max_bsz=max_bsz, max_seqlen=max_seqlen,
                   heldout_ce=None if heldout_ce != heldout_ce else heldout_ce,
                   heldout_bpb=None if heldout_bpb != heldout_bpb else heldout_bpb,
                   message=record_message(record, HANDSHAKE_INTS) if failed else "")


@dataclass
class ResponseStatus:
    ok: bool = True
    teacher_preempt: bool = False  # the teacher received a preemption signal
    busy_s: float = 0.0  # the teacher's serving time since the handshake
    idle_s: float = 0.0  # the teacher's waiting time since the handshake
    peak_bytes: int = 0  # the teacher's peak memory (a replica's: the largest of its ranks')
    forward_s: float = 0.0  # the part of busy_s spent in the forward and the outputs (the rest is the protocol)
    message: str = ""  # the error, when not ok
    bug: bool = False  # the error is a bug on the teacher, not a user error

    def pack(self, pin: bool = False) -> torch.Tensor:
        return pack_record([failure_word(not self.ok, self.bug), int(self.teacher_preempt), int(self.busy_s * 1e6),
                            int(self.idle_s * 1e6), self.peak_bytes, int(self.forward_s * 1e6)], self.message, pin)

    @classmethod
    def unpack(cls, record: torch.Tensor) -> "ResponseStatus":
        failed, preempt, busy_us, idle_us, peak_bytes, forward_us, *_ = record_ints(record)
        return cls(not failed, bool(preempt), busy_us / 1e6, idle_us / 1e6, peak_bytes, forward_us / 1e6,
                   record_message(record) if failed else "", bug=failed == Failure.BUG)


@dataclass
class RequestHeader:
    op: int
    step: int
    micro_step: int
    bsz: int
    seqlen: int
    train_rank: int
    bad_tokens: int = 0  # 1 when a token id is outside [0, vocab): the teacher refuses the request
    # 1 after this launch's first step, 0 again during a step the students follow with a long pause: which
    # timeout the teacher waits under (serving_clock.TimeoutSwitch).
    in_training: int = 0

    def to_ints(self) -> list[int]:
        return [getattr(self, f.name) for f in fields(self)]

    @classmethod
    def from_ints(cls, ints: list[int]) -> "RequestHeader":
        return cls(*ints[:HEADER_INTS])

    def describe(self) -> str:
        return f"op={Op(self.op).name if self.op in Op._value2member_map_ else self.op} step={self.step} " \
               f"micro_step={self.micro_step}"


HEADER_INTS = len(fields(RequestHeader))
BAD_TOKENS_FIELD = [f.name for f in fields(RequestHeader)].index("bad_tokens")


@dataclass
class BridgeSpec:
    max_bsz: int
    max_seqlen: int
    vocab_size: int
    output: str
    k: int
    wire_dtype: torch.dtype
    doc_boundaries: bool = False  # requests carry [max_bsz, max_seqlen] document ids after the tokens
    kd_weight: bool = False  # cross-tokenizer: responses carry each position's KD weight after the top-k
    teacher_heldout_ce: Optional[float] = None  # the teacher's own held-out CE, if it computed one
    teacher_heldout_bpb: Optional[float] = None  # the same in bits per byte
    segments: list = field(init=False, repr=False)  # (offset, nbytes) of each payload tensor, 8-byte aligned

    def __post_init__(self):
        self.segments, offset = [], 0
        for shape, dtype in self.payload_spec():
            nbytes = torch.Size(shape).numel() * torch.tensor([], dtype=dtype).element_size()
            self.segments.append((offset, nbytes))
            offset += (nbytes + 7) // 8 * 8

    def payload_spec(self):
        return TeacherOutputs.wire_spec(self.output, self.max_bsz, self.max_seqlen, self.k, self.vocab_size,
                                        self.wire_dtype, self.kd_weight)

    def response_bytes(self) -> int:
        last_offset, last_nbytes = self.segments[-1]
        return RECORD_BYTES + (last_offset + last_nbytes + 7) // 8 * 8

    def request_ints(self) -> int:
        grid = self.max_bsz * self.max_seqlen
        # cross-tokenizer: each row's label past the window, so the teacher aligns the window's last position too
        return HEADER_INTS + grid * (2 if self.doc_boundaries else 1) + (self.max_bsz if self.kd_weight else 0)

    def payload_views(self, response: torch.Tensor) -> list[torch.Tensor]:
        payload = response[RECORD_BYTES:]
        return [payload[offset: offset + nbytes].view(dtype).view(shape)
                for (shape, dtype), (offset, nbytes) in zip(self.payload_spec(), self.segments)]

    def token_grid(self, request: torch.Tensor) -> torch.Tensor:
        return request[HEADER_INTS: HEADER_INTS + self.max_bsz * self.max_seqlen].view(self.max_bsz, self.max_seqlen)

    def doc_grid(self, request: torch.Tensor) -> torch.Tensor:
        assert self.doc_boundaries, "this bridge sends no document ids"
        start = HEADER_INTS + self.max_bsz * self.max_seqlen
        return request[start: start + self.max_bsz * self.max_seqlen].view(self.max_bsz, self.max_seqlen)

    def next_tokens(self, request: torch.Tensor) -> torch.Tensor:
        """Each row's label past the window (-1: none), sent by cross-tokenizer students."""
        assert self.kd_weight, "only a cross-tokenizer bridge sends the labels past the windows"
        return request[self.request_ints() - self.max_bsz:]


def synchronize(device: torch.device) -> None:
    """Block the CPU until `device`'s current stream has run (CPU: nothing is queued)."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def agreed_handshake(topo, mine: Optional[HandshakeRecord], args: DistillationArgs) -> Optional[BridgeSpec]:
    """`agreed_handshakes` over this rank's one bridge (`mine` None: a replica's rank off the bridge; returns None)."""
    return agreed_handshakes(topo, [(topo, mine, args)])[0]


def agreed_handshakes(topo, bridges: list[tuple]) -> list[Optional[BridgeSpec]]:
    """Handshake on each of this rank's bridges ((topology view, record, args) in teacher order), then every rank's
    verdict over the world: a failure in one bridge stops every rank with its sentence. A replica's rank off the
    bridge (record None) only shares the verdicts, and raises its own replica's sentence."""
    specs, error = [], None
    try:
        # Every bridge's records first: a refusal on one must not leave another's members waiting in an exchange.
        records = [exchange_records(view, mine) if mine is not None else None for view, mine, _ in bridges]
        specs = [check_handshake(r, args) if r is not None else None for r, (_, _, args) in zip(records, bridges)]
    except Exception as err:  # a bug in the checks too: the other ranks must not wait for this one's verdict
        error = err
    # (whether it is a bug, its words) of each rank that failed
    verdicts: list[Optional[tuple[bool, str]]] = [None] * topo.world_size
    verdict = None if error is None else (not isinstance(error, UserError), describe(error))
    log_collective("all_gather_object handshake verdicts", dist.group.WORLD)
    dist.all_gather_object(verdicts, verdict, group=dist.group.WORLD)
    if error is not None:
        raise error
    # A teacher's verdict first: it is the root cause the students of its bridge only repeat.
    failed = sorted((rank not in topo.teacher_ranks, rank, v) for rank, v in enumerate(verdicts) if v)
    if failed:
        _, rank, (bug, words) = failed[0]
        if bridges[0][1] is None and topo.plan.bridge_index(rank) == topo.my_bridge:
            raise teacher_failure(f"the handshake of this teacher replica failed (rank {rank}): {words}", bug)
        raise teacher_failure(f"the handshake failed in another bridge (rank {rank}): {words}", bug)
    return specs


def exchange_records(topo, mine: HandshakeRecord, group=None, what: str = "handshake") -> list[HandshakeRecord]:
    """Every member's record, all-gathered on `group` (default: the bridge's) in its rank order."""
    group = group or topo.bridge_group
    packed = mine.pack().to(topo.device)  # input and outputs on the backend's device (NCCL: the GPU)
    gathered = [torch.empty_like(packed) for _ in range(dist.get_world_size(group))]
    log_collective(f"all_gather {what}", group, packed)
    dist.all_gather(gathered, packed, group=group)
    return [HandshakeRecord.unpack(r) for r in gathered]


def check_handshake(records: list[HandshakeRecord], args: DistillationArgs) -> BridgeSpec:
    """The same checks on the same records on every bridge member: every rank raises the same sentence."""
    teacher = next(r for r in records if r.role == "teacher")
    title = teacher_title(args, teacher.global_rank)
    if not teacher.loaded:
        raise teacher_failure(f"{title} failed to load: {teacher.message}", teacher.bug)
    served = teacher.settings
    students = [r for r in records if r.role == "student"]
    for student in students:
        asked = student.settings
        differ = [(name, key) for name, key, _, _ in AGREED_SETTINGS if asked[name] != served[name]
                  and not (name == "k" and served["output"] == asked["output"] == "full")]  # full sends no ids
        if differ:
            detail = ", ".join(f"{key} is {served[name]} on the teacher but {asked[name]} on the student"
                               for name, key in differ)
            raise ConfigError(f"{title} and student rank {student.global_rank} disagree: {detail}; give every rank "
                              f"the same distillation settings (one config for the whole job).")
    for student in students:
        same_tokenizer = student.tokenizer_fingerprint == teacher.tokenizer_fingerprint
        if served["cross_tokenizer"] and not (same_tokenizer and student.vocab == teacher.vocab):
            raise ConfigError(
                f"{title} aligns from a student tokenizer (vocab {teacher.vocab}) that is not student rank "
                f"{student.global_rank}'s (vocab {student.vocab}); give every rank the same data.tokenizer (one config "
                f"for the whole job).")
        if not served["cross_tokenizer"] and not (same_tokenizer and student.vocab <= teacher.vocab):
            same_size = ", the same size but different tokens" if student.vocab == teacher.vocab else ""
            raise ConfigError(
                f"Student rank {student.global_rank}'s tokenizer (vocab {student.vocab}) does not match the teacher's "
                f"(vocab {teacher.vocab}{same_size}) at {args.teacher_path}. Use the teacher's tokenizer (set "
                f"data.tokenizer.name=hf data.tokenizer.path={args.teacher_path}), or keep yours and set "
                f"{own_key(args, 'cross_tokenizer', 'cross_tokenizer')}=true.")
    max_bsz, max_seqlen = max(s.max_bsz for s in students), max(s.max_seqlen for s in students)
    # Checked at startup already when the teacher's config.json is on disk; a hub teacher is checked here.
    check_seq_len_fits_teacher(max_seqlen, teacher.max_positions, f"teacher rank {teacher.global_rank}")
    # Students' logits cover their tokenizer's vocab; teacher rows beyond it are padding and are cut.
    vocab = students[0].vocab
    check_k_fits_vocab(served["output"], served["k"], vocab, teacher)
    return BridgeSpec(max_bsz, max_seqlen, vocab, served["output"], served["k"],
                      WIRE_DTYPES[served["wire_dtype"]], doc_boundaries=served["attn_mask"] == "doc_causal",
                      kd_weight=served["cross_tokenizer"], teacher_heldout_ce=teacher.heldout_ce,
                      teacher_heldout_bpb=teacher.heldout_bpb)


def own_key(args: DistillationArgs, shared: str, own: str) -> str:
    """A teacher's key: `distillation.<shared>`, or with several teachers its element's `teachers[i].<own>`."""
    index = getattr(args, "index", None)
    return f"distillation.{shared}" if index is None else f"distillation.teachers[{index}].{own}"


def check_k_fits_vocab(output: str, k: int, vocab: int, teacher: HandshakeRecord) -> None:
    """Top-k ids come from the outputs cut to the students' `vocab`: a larger k is refused before any buffer sized
    by it exists (`sampled` draws with replacement, `full` sends no ids)."""
    if output == "topk" and k > vocab:
        raise ConfigError(f"distillation.k={k} is more than the {vocab} token ids the top-k is taken from (the "
                         f"students' vocabulary; teacher rank {teacher.global_rank} has {teacher.vocab}); set "
                         f"distillation.k <= {vocab}.")
