"""The vocabulary map: which student id each teacher id is, built once from the two tokenizers' bytes.

    vocab_map = build_vocab_map(student_token_bytes(student), hf_token_bytes(teacher), byte_fallback_ids(student))
    vocab_map.teacher_to_student[t]   # the student id whose bytes equal teacher id t's, or -1 (unmapped)

A teacher id maps when its bytes are exactly one student token's bytes; teacher tokens that are several student
tokens (or part of one) stay unmapped: their probability goes to the "rest" bucket of the student's targets
(`targets.py`). Several teacher ids may map to one student id (their probabilities add up there). Special tokens
have no bytes: the teacher's eos and bos map to the student's by role (`roles`, eos first, so a teacher whose bos
is its eos sends "the document ends" to the student's eos); its other specials stay unmapped.
"""

import hashlib
from dataclasses import dataclass, field
from typing import Collection, Optional, Sequence

import torch

from lingua.parallel.host_copies import to_device


@dataclass
class VocabMap:
    """teacher_to_student: int64 [teacher vocabulary], a student id or -1; student_vocab_size: the student's V."""

    teacher_to_student: torch.Tensor
    student_vocab_size: int
    # The map on each device it was asked for, copied once: a copy per request would wait for the queued forward.
    _on_device: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def table(self, device: torch.device) -> torch.Tensor:
        """teacher_to_student on `device` (host: the map itself; elsewhere one copy, kept)."""
        device = torch.device(device)
        if device == self.teacher_to_student.device:
            return self.teacher_to_student
        if device not in self._on_device:
            self._on_device[device] = to_device(self.teacher_to_student, device)
        return self._on_device[device]

    @property
    def mapped(self) -> int:
        """How many teacher ids have a student id."""
        return int((self.teacher_to_student >= 0).sum())

    def fingerprint(self) -> str:
        """A short hash of the map, so two ranks (or a cache and its reader) can check they built the same one."""
        digest = hashlib.sha256(self.teacher_to_student.numpy().tobytes())
        digest.update(str(self.student_vocab_size).encode())
        return digest.hexdigest()[:16]


def _student_ids_by_bytes(student_bytes: Sequence[Optional[bytes]], fallback_ids: Collection[int]) -> dict[bytes, int]:
    """bytes -> student id. Where several ids share bytes (a SentencePiece byte fallback "<0x41>" beside "A"),
    a regular piece wins over a byte-fallback one (it is what the student's encoder produces), then the lowest id."""
    chosen: dict[bytes, int] = {}
    for i, data in enumerate(student_bytes):
        if data and (data not in chosen or (chosen[data] in fallback_ids and i not in fallback_ids)):
            chosen[data] = i
    return chosen


def build_vocab_map(student_bytes: Sequence[Optional[bytes]], teacher_bytes: Sequence[Optional[bytes]],
                    student_fallback_ids: Collection[int] = (),
                    roles: Sequence[tuple[Optional[int], Optional[int]]] = ()) -> VocabMap:
    """The map from teacher ids to student ids by equal bytes (`token_bytes.py` gives both tables and the student's
    byte-fallback ids; None = a special token), then the specials paired by role: (teacher id, student id) pairs,
    e.g. [(teacher eos, student eos), (teacher bos, student bos)]; a teacher id keeps its first pair, a None
    side is skipped."""
    by_bytes = _student_ids_by_bytes(student_bytes, frozenset(student_fallback_ids))
    table = [by_bytes.get(data, -1) if data else -1 for data in teacher_bytes]
    paired: set[int] = set()
    for teacher_id, student_id in roles:
        if teacher_id is not None and student_id is not None and 0 <= teacher_id < len(table) \
                and 0 <= student_id < len(student_bytes) and teacher_id not in paired:
            table[teacher_id] = student_id
            paired.add(teacher_id)
    return VocabMap(torch.tensor(table, dtype=torch.int64), len(student_bytes))
