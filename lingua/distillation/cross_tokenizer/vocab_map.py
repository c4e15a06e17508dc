"""The vocabulary map: teacher id -> the student id with the same bytes, or -1 (several student tokens, part of one,
a special); several teacher ids may map to one student id. The teacher's eos and bos map to the student's by role
(eos first, so a teacher whose bos is its eos sends "the document ends" to the student's eos).
"""

import hashlib
from dataclasses import dataclass, field
from typing import Collection, Optional, Sequence

import torch

from lingua.parallel.host_copies import to_device


@dataclass
class VocabMap:
    """teacher_to_student: int64 [teacher vocabulary], a student id or -1."""

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


def build_vocab_map(student_bytes: Sequence[Optional[bytes]], teacher_bytes: Sequence[Optional[bytes]],
                    student_fallback_ids: Collection[int] = (),
                    roles: Sequence[tuple[Optional[int], Optional[int]]] = ()) -> VocabMap:
    """The map from teacher ids to student ids by equal bytes (`token_bytes.py`'s tables, None = a special), then
    the specials paired by `roles`: (teacher id, student id) pairs, a teacher id keeping its first, None skipped."""
    fallback = frozenset(student_fallback_ids)
    # Where ids share bytes, a regular piece wins over a byte fallback ("A" over "<0x41>": what the student's encoder
    # produces), then the lowest id.
    by_bytes: dict[bytes, int] = {}
    for i, data in enumerate(student_bytes):
        if data and (data not in by_bytes or (by_bytes[data] in fallback and i not in fallback)):
            by_bytes[data] = i
    table = [by_bytes.get(data, -1) if data else -1 for data in teacher_bytes]
    paired: set[int] = set()
    for teacher_id, student_id in roles:
        if teacher_id is not None and student_id is not None and 0 <= teacher_id < len(table) \
                and 0 <= student_id < len(student_bytes) and teacher_id not in paired:
            table[teacher_id] = student_id
            paired.add(teacher_id)
    return VocabMap(torch.tensor(table, dtype=torch.int64), len(student_bytes))
