"""What a teacher rank (or a cache writer) does with a batch of student windows when the tokenizers differ.

    cross = CrossTokenizerTeacher(student_tokenizer, teacher_hf_tokenizer, max_positions=teacher.max_positions)
    batch = cross.teacher_batch(input_ids, doc_ids)            # student [N, S] -> the teacher's [N, L] grid
    outputs = cross.student_targets(teacher, teacher.hidden_states(batch.tokens, batch.doc_ids), batch, "topk", k, dt)

L is the longest teacher row, capped at the teacher's max positions (a longer row is cut, its targets past the cut
unaligned); shorter rows are padded with the teacher's pad token (else its eos) in a document of their own.
"""

from dataclasses import dataclass
from typing import Optional

import torch

from lingua.evaluation.bits_per_byte import batches_target_bytes, byte_lengths
from lingua.data import IGNORE_INDEX
from lingua.distillation.cross_tokenizer.alignment import WindowAligner
from lingua.distillation.distiller import tokenizer_fingerprint
from lingua.distillation.cross_tokenizer.targets import (sample_student_ids, student_sampled_targets,
                                                         student_topk_targets)
from lingua.distillation.cross_tokenizer.token_bytes import byte_fallback_ids, hf_token_bytes, student_token_bytes
from lingua.distillation.cross_tokenizer.vocab_map import VocabMap, build_vocab_map
from lingua.distillation.outputs import TeacherOutputs
from lingua.errors import ConfigError
from lingua.parallel.host_copies import to_device
from lingua.tokenizer import Tokenizer, TokenizerArgs, build_tokenizer


@dataclass
class TeacherBatch:
    """The teacher's tokens and doc_ids [N, L], and per student position [N, S] its target's flat index, or -1."""

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
        """Align each student row (on the teacher's CPU) into one grid; `next_tokens` [N]: each row's label past
        the window (negative: none), so its last position can be aligned too."""
        rows = self.aligner.align_rows(input_ids.tolist(), None if doc_ids is None else doc_ids.tolist(),
                                       None if next_tokens is None else next_tokens.tolist())
        length = max([len(w.ids) for w in rows] + [1])
        if self.max_positions is not None:
            length = min(length, self.max_positions)
        tokens, docs = self._grid([(w.ids, w.doc_ids) for w in rows], length)
        source = torch.full(tuple(input_ids.shape), -1, dtype=torch.int64)
        for r, window in enumerate(rows):
            row_source = torch.tensor(window.source, dtype=torch.int64)
            source[r] = torch.where((row_source >= 0) & (row_source < length), row_source + r * length, -1)
        return TeacherBatch(tokens, docs, source)

    def _grid(self, rows: list, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Teacher rows (ids, doc_ids) cut or padded to `length`: tokens and doc_ids [rows, length]."""
        tokens = torch.full((len(rows), length), self.pad_id, dtype=torch.int64)
        docs = torch.zeros((len(rows), length), dtype=torch.int32)
        for r, (ids, doc_ids) in enumerate(rows):
            n = min(len(ids), length)
            tokens[r, :n] = torch.tensor(ids[:n], dtype=torch.int64)
            docs[r, :n] = torch.tensor(doc_ids[:n], dtype=torch.int32)
            docs[r, n:] = (doc_ids[n - 1] + 1) if n else 0  # padding: a document of its own
        return tokens, docs

    def own_heldout(self, batches: list[dict]) -> tuple[list[dict], int]:
        """The students' held-out windows in the teacher's own tokens (cut to max_positions) as held-out batches,
        and the UTF-8 bytes of their targets: the teacher's bits per byte."""
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
            input_ids, doc_ids = self._grid([(ids[:-1], docs[:-1]) for ids, docs in chunk], max(width, 1))
            labels = torch.full_like(input_ids, IGNORE_INDEX)
            for r, (ids, _) in enumerate(chunk):
                labels[r, :len(ids) - 1] = torch.tensor(ids[1:])
            own.append(dict(input_ids=input_ids, labels=labels, doc_ids=doc_ids))
        return own, batches_target_bytes(own, byte_lengths(self.aligner.teacher_bytes))

    def student_targets(self, teacher, hidden: torch.Tensor, batch: Optional[TeacherBatch], output: str, k: int,
                        wire_dtype: torch.dtype, generator=None,
                        unmapped_entries: bool = False) -> Optional[TeacherOutputs]:
        """What a teacher rank sends and a cache stores: the TeacherModel's outputs from `hidden` over the batch's
        grid in the student's ids and [N, S] positions, with kd_weight (top-k in fp32, so masses mapping to one
        student id add up exactly). A follower of a tensor-parallel replica gets None (its batch may be None)."""
        if output == "sampled":
            def sample(logits, rng):
                return sample_student_ids(logits, k, teacher.args.temperature, self.vocab_map, torch.float32, rng)
            drawn = teacher.sparse_outputs(hidden, "sampled", k, torch.float32, teacher.vocab_size, generator, sample)
            source = to_device(batch.source, drawn.values.device)  # aligned on the host: pinned, not blocking
            outputs, kd_weight = student_sampled_targets(drawn, source, wire_dtype)
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
        """The teacher's top-k over its [N, L] positions as student targets [N, S, k] and kd_weight [N, S]."""
        source = to_device(batch.source, teacher_outputs.values.device)  # aligned on the host: pinned, not blocking
        return student_topk_targets(teacher_outputs, source, self.vocab_map, wire_dtype, unmapped_entries)


def load_cross_tokenizer(student_args: TokenizerArgs, teacher_tokenizer_path: Optional[str], teacher_tokenizer,
                         max_positions: Optional[int], key: str = "distillation.teacher_tokenizer") -> CrossTokenizerTeacher:
    """The pair a teacher rank builds at load: the students' tokenizer and its own (`teacher_tokenizer_path`, else
    the loaded teacher's)."""
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
