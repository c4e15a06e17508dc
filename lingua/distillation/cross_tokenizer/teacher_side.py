"""What a teacher rank (or a cache writer) does with a batch of student windows when the tokenizers differ.

    cross = CrossTokenizerTeacher(student_tokenizer, teacher_hf_tokenizer, max_positions=teacher.max_positions)
    batch = cross.teacher_batch(input_ids, doc_ids)            # student [N, S] -> the teacher's [N, L] grid
    hidden = teacher.hidden_states(batch.tokens, batch.doc_ids)  # its own forward on its own tokens
    outputs = cross.student_targets(teacher, hidden, batch, "topk", k, wire_dtype)  # in the student's [N, S]

The teacher's length L is the longest teacher row of the batch, capped at the teacher's max positions: a longer
row is cut there (its positions whose target lies past the cut become unaligned), a shorter one is padded on the
right with the teacher's pad token (else its eos) in a document of its own, which a causal teacher's earlier
positions never see. L differs from S: a byte-level student has ~4 times more tokens than a BPE teacher, a BPE
student fewer than a byte-level teacher.
"""

from dataclasses import dataclass
from typing import Optional

import torch

from lingua.evaluation.bits_per_byte import batches_target_bytes, byte_lengths
from lingua.data import IGNORE_INDEX
from lingua.distillation.online.bridge import tokenizer_fingerprint
from lingua.distillation.cross_tokenizer.alignment import WindowAligner
from lingua.distillation.cross_tokenizer.targets import (
    sample_student_ids,
    student_sampled_targets,
    student_topk_targets,
)
from lingua.distillation.cross_tokenizer.token_bytes import byte_fallback_ids, hf_token_bytes, student_token_bytes
from lingua.distillation.cross_tokenizer.vocab_map import VocabMap, build_vocab_map
from lingua.distillation.outputs import TeacherOutputs
from lingua.errors import ConfigError
from lingua.tokenizer import Tokenizer, TokenizerArgs, build_tokenizer


@dataclass
class TeacherBatch:
    """The teacher's side of a batch: tokens and doc_ids [N, L], and per student position [N, S] the flat index
    (row * L + column) of its target among the teacher's positions, or -1."""

    tokens: torch.Tensor
    doc_ids: torch.Tensor
    source: torch.Tensor

    @property
    def aligned_share(self) -> float:
        """The share of student positions with a target (`kd/aligned`)."""
        return float((self.source >= 0).float().mean()) if self.source.numel() else 0.0


class CrossTokenizerTeacher:
    """The vocabulary map and the aligner of one (student tokenizer, teacher tokenizer) pair, built once."""

    def __init__(self, student: Tokenizer, teacher_tokenizer, max_positions: Optional[int] = None):
        self.student = student
        self.teacher_fingerprint = tokenizer_fingerprint(teacher_tokenizer.get_vocab())  # a cache's manifest records it
        student_bytes = student_token_bytes(student)
        teacher_bytes = hf_token_bytes(teacher_tokenizer)
        self.aligner = WindowAligner(student_bytes, student.bos_id, student.eos_id, teacher_tokenizer, teacher_bytes)
        # The separators the aligner writes for the student's eos and bos are theirs in the targets (by role).
        roles = [(self.aligner.closing, student.eos_id), (self.aligner.opening, student.bos_id)]
        self.vocab_map: VocabMap = build_vocab_map(student_bytes, teacher_bytes, byte_fallback_ids(student), roles)
        self.max_positions = max_positions or None
        pad = teacher_tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else teacher_tokenizer.eos_token_id if \
            teacher_tokenizer.eos_token_id is not None else 0

    def teacher_batch(self, input_ids: torch.Tensor, doc_ids: Optional[torch.Tensor] = None,
                      next_tokens: Optional[torch.Tensor] = None) -> TeacherBatch:
        """Align each student row (CPU work, on the teacher's side) and lay the teacher rows out as one grid.
        `next_tokens` [N]: each row's label past the window (the labels' last column; negative: none), so the
        row's last position can be aligned too."""
        rows = self.aligner.align_rows(input_ids.tolist(), None if doc_ids is None else doc_ids.tolist(),
                                       None if next_tokens is None else next_tokens.tolist())
        length = max([len(w.ids) for w in rows] + [1])
        if self.max_positions is not None:
            length = min(length, self.max_positions)
        tokens = torch.full((len(rows), length), self.pad_id, dtype=torch.int64)
        docs = torch.zeros((len(rows), length), dtype=torch.int32)
        source = torch.full(tuple(input_ids.shape), -1, dtype=torch.int64)
        for r, window in enumerate(rows):
            n = min(len(window.ids), length)
            tokens[r, :n] = torch.tensor(window.ids[:n], dtype=torch.int64)
            docs[r, :n] = torch.tensor(window.doc_ids[:n], dtype=torch.int32)
            docs[r, n:] = (window.doc_ids[n - 1] + 1) if n else 0  # padding: a document of its own
            row_source = torch.tensor(window.source, dtype=torch.int64)
            source[r] = torch.where((row_source >= 0) & (row_source < length), row_source + r * length, -1)
        return TeacherBatch(tokens, docs, source)

    def own_heldout(self, batches: list[dict]) -> tuple[list[dict], int]:
        """The students' held-out windows in the teacher's own tokens (the same text, cut to max_positions), as
        held-out batches of the same shape kind, and the UTF-8 bytes of their targets: the teacher's bits per byte
        (its CE per token is over other tokens than the students')."""
        windows = []
        for batch in batches:
            for row, labels in zip(batch["input_ids"], batch["labels"]):
                n_targets = int((labels != IGNORE_INDEX).sum())  # a prefix: padding follows the window's targets
                if n_targets:
                    window = self.aligner.align(row[:n_targets].tolist() + [int(labels[n_targets - 1])])
                    length = min(len(window.ids), (self.max_positions or len(window.ids)) + 1)
                    windows.append((window.ids[:length], window.doc_ids[:length]))
        size = max((batch["labels"].shape[0] for batch in batches), default=1)
        own = []
        for start in range(0, len(windows), size):
            chunk = windows[start:start + size]
            width = max(len(ids) for ids, _ in chunk) - 1
            input_ids = torch.full((len(chunk), max(width, 1)), self.pad_id, dtype=torch.int64)
            labels = torch.full_like(input_ids, IGNORE_INDEX)
            doc_ids = torch.zeros(input_ids.shape, dtype=torch.int32)
            for r, (ids, docs) in enumerate(chunk):
                n = len(ids) - 1
                input_ids[r, :n], labels[r, :n] = torch.tensor(ids[:-1]), torch.tensor(ids[1:])
                doc_ids[r, :n] = torch.tensor(docs[:-1], dtype=torch.int32)
                doc_ids[r, n:] = (docs[n - 1] + 1) if n else 0  # padding: a document of its own
            own.append(dict(input_ids=input_ids, labels=labels, doc_ids=doc_ids))
        return own, batches_target_bytes(own, byte_lengths(self.aligner.teacher_bytes))

    def student_targets(self, teacher, hidden: torch.Tensor, batch: Optional[TeacherBatch], output: str, k: int,
                        wire_dtype: torch.dtype, generator=None,
                        unmapped_entries: bool = False) -> Optional[TeacherOutputs]:
        """What an online teacher rank sends and a cache stores: the teacher's (a TeacherModel) outputs from its
        `hidden` states over the batch's [N, L] grid, in the student's ids and [N, S] positions, with kd_weight.
        topk: every teacher id's top-k in fp32 (so masses that map to one student id add up exactly), then mapped;
        sampled: drawn from the probabilities added up per student id (`targets.sample_student_ids`). A follower
        of a tensor-parallel replica takes part in the head's collectives and gets None (its batch may be None)."""
        if output == "sampled":
            def sample(logits, rng):
                return sample_student_ids(logits, k, teacher.args.temperature, self.vocab_map, torch.float32, rng)
            drawn = teacher.sparse_outputs(hidden, "sampled", k, torch.float32, teacher.vocab_size, generator, sample)
            outputs, kd_weight = student_sampled_targets(drawn, batch.source.to(drawn.values.device), wire_dtype)
        else:
            teacher_topk = teacher.sparse_outputs(hidden, "topk", k, torch.float32, teacher.vocab_size, generator)
            if teacher_topk is None:  # a follower: the top-k went to the replica's first rank
                return None
            outputs, kd_weight = self.student_outputs(teacher_topk, batch, wire_dtype, unmapped_entries)
        outputs.kd_weight = kd_weight
        return outputs

    def student_outputs(self, teacher_outputs: TeacherOutputs, batch: TeacherBatch,
                        wire_dtype: torch.dtype = torch.bfloat16,
                        unmapped_entries: bool = False) -> tuple[TeacherOutputs, torch.Tensor]:
        """The teacher's top-k over its [N, L] positions as student targets [N, S, k] and kd_weight [N, S]; with
        `unmapped_entries` (distillation.uld_weight > 0) also its unmapped entries, marked (`uld.py`)."""
        return student_topk_targets(teacher_outputs, batch.source.to(teacher_outputs.values.device), self.vocab_map,
                                    wire_dtype, unmapped_entries)


def load_cross_tokenizer(student_args: TokenizerArgs, teacher_tokenizer_path: Optional[str], teacher_tokenizer,
                         max_positions: Optional[int], key: str = "distillation.teacher_tokenizer") -> CrossTokenizerTeacher:
    """What a teacher rank builds at load: the students' tokenizer (from the config every rank shares) and its own,
    read from `teacher_tokenizer_path` (distillation.teacher_tokenizer) or else the loaded teacher's."""
    if teacher_tokenizer_path is not None:
        from transformers import AutoTokenizer

        try:
            teacher_tokenizer = AutoTokenizer.from_pretrained(teacher_tokenizer_path)
        except Exception as err:  # a missing folder, no tokenizer.json, an unknown hub id, ...
            raise ConfigError(f"{key}={teacher_tokenizer_path!r} cannot be read as a Hugging "
                              f"Face tokenizer ({type(err).__name__}: {str(err).splitlines()[0][:200]}); point it at "
                              f"the folder with the teacher's tokenizer.json, or leave it unset to use the "
                              f"teacher's own.") from None
    return CrossTokenizerTeacher(build_tokenizer(student_args), teacher_tokenizer, max_positions)
