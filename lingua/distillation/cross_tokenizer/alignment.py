"""Alignment by text offsets: a student window becomes the teacher's tokens, and each student position learns
which teacher position (if any) predicts the same next text.

    aligner = WindowAligner(student_bytes, student.bos_id, student.eos_id, teacher_hf_tokenizer, teacher_bytes)
    window = aligner.align(tokens)            # one student window (its token ids), optionally its doc ids
    window.ids, window.doc_ids                # the teacher's sequence and its documents
    window.source[i]                          # teacher index whose output is position i's target, or -1

The student's tokens are detokenized to bytes run by run (a run = tokens between special tokens); each run's
text is tokenized by the teacher (its own tokenizer, no special tokens added) and the teacher's tokens get
byte offsets in it (from their own bytes when they spell the text exactly, else from the tokenizer's character
offsets). Student position i predicts token i + 1; it is aligned when token i + 1 starts at a byte where a
teacher token starts, and then the teacher's output at the position before that token is its target (both
predict the same text after the same text). Offsets are bytes of UTF-8 rather than characters, which agree at
every character boundary and also place tokens that are parts of a character (byte tokenizers, byte fallback).

Document boundaries: a student bos becomes the teacher's bos (its eos when it has none), a student eos the
teacher's eos, so documents stay apart on both sides (each document's text is tokenized alone, never merged
with its neighbour's); the first token of a document is aligned through that separator, and teacher documents
take the student's document ids. A position whose next token is the student's eos (or bos) in the same document
is aligned to the teacher position before its separator: the vocabulary map sends the teacher's eos to the
student's (by role, `vocab_map.py`), so "the document ends here" is distilled. Bytes that are not UTF-8 (a window
cut inside a character) cut the run: the text on each side is tokenized alone, and no position across a cut is
aligned. The window's last position predicts the label just past the window: given it (`next_token`, the label
stream's last token) the aligner reads it too, and that position is aligned when a teacher token starts there.
"""

from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np

ALIGN_NONE = -1


@dataclass
class TeacherWindow:
    """The teacher's side of one student window (see the module docstring)."""

    ids: list[int] = field(default_factory=list)
    doc_ids: list[int] = field(default_factory=list)
    source: list[int] = field(default_factory=list)

    @property
    def aligned(self) -> int:
        """How many student positions have a target."""
        return sum(1 for s in self.source if s != ALIGN_NONE)


def utf8_pieces(data: bytes) -> list[tuple[int, int]]:
    """The maximal runs of `data` that are valid UTF-8, as (start, end) byte ranges."""
    pieces, pos = [], 0
    while pos < len(data):
        try:
            data[pos:].decode("utf-8")
            pieces.append((pos, len(data)))
            break
        except UnicodeDecodeError as err:
            if err.start > 0:
                pieces.append((pos, pos + err.start))
            pos += err.end
    return pieces


def char_to_byte_offsets(text: str) -> np.ndarray:
    """[len(text) + 1] int64: the UTF-8 byte offset at which each character starts (and the end)."""
    code_points = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
    widths = 1 + (code_points >= 0x80) + (code_points >= 0x800) + (code_points >= 0x10000)
    return np.concatenate([[0], np.cumsum(widths, dtype=np.int64)])


def student_doc_ids(tokens: Sequence[int], bos_id: Optional[int], eos_id: Optional[int]) -> list[int]:
    """Document ids as the loader numbers them (each document is [bos] text [eos]): a new one at a bos, or after an
    eos. Where bos and eos are one token (GPT-2's <|endoftext|>), it opens a document after one was closed."""
    doc_ids, current, closed = [], 0, False
    for i, token in enumerate(tokens):
        opens = token == bos_id and (bos_id != eos_id or closed or i == 0)
        if i > 0 and (closed or opens):
            current += 1
        closed = token == eos_id and not opens
        doc_ids.append(current)
    return doc_ids


class WindowAligner:
    """Aligns student windows to a teacher's tokenizer; built once per (student, teacher) pair."""

    def __init__(self, student_bytes: Sequence[Optional[bytes]], student_bos: Optional[int],
                 student_eos: Optional[int], teacher_tokenizer, teacher_bytes: Sequence[Optional[bytes]]):
        self.student_bytes = student_bytes
        self.student_bos, self.student_eos = student_bos, student_eos
        self.backend = teacher_tokenizer.backend_tokenizer
        self.teacher_bytes = teacher_bytes
        bos, eos = teacher_tokenizer.bos_token_id, teacher_tokenizer.eos_token_id
        self.opening, self.closing = (bos if bos is not None else eos), eos  # a document's teacher separators

    def _separator(self, token: int, opens: bool) -> Optional[int]:
        """The teacher's token for a student special one: an opening bos (or the one token that is both, where
        it opens a document), a closing eos; None for other specials."""
        if token == self.student_bos and (opens or self.student_bos != self.student_eos):
            return self.opening
        return self.closing if token == self.student_eos else None

    def _bytes_of(self, token: int) -> Optional[bytes]:
        return self.student_bytes[token] if 0 <= token < len(self.student_bytes) else None

    def teacher_tokens(self, text: bytes) -> tuple[list[int], list[int]]:
        """The teacher's ids for UTF-8 `text` and the byte offset where each starts (-1: inside a character, where
        only character offsets are known)."""
        string = text.decode("utf-8")
        encoding = self.backend.encode(string, add_special_tokens=False)
        ids = encoding.ids
        spelled = [self.teacher_bytes[t] if 0 <= t < len(self.teacher_bytes) else None for t in ids]
        if all(spelled) and b"".join(spelled) == text:
            starts = np.concatenate([[0], np.cumsum([len(b) for b in spelled])[:-1]]).tolist() if ids else []
            return ids, starts
        # Normalizers, a prefixed space, bytes missing from the vocabulary or specials from the text: the tokenizer's
        # character offsets. A token whose bytes begin inside a character (a continuation byte) reports that
        # character's start, which is not where it starts: it gets no offset of its own (-1).
        byte_at = char_to_byte_offsets(string)
        return ids, [-1 if spelled[k] and spelled[k][0] & 0xC0 == 0x80 else int(byte_at[min(start, len(string))])
                     for k, (start, _) in enumerate(encoding.offsets)]

    def window_tokens(self, tokens: Sequence[int], doc_ids: Optional[Sequence[int]],
                      next_token: Optional[int]) -> tuple[list[int], list[int]]:
        """The student tokens the aligner reads and their document ids: the window, and the label past it when
        given (a negative `next_token` is none), numbered as the loader numbers documents."""
        tokens = [int(t) for t in tokens]
        extended = tokens + ([int(next_token)] if tokens and next_token is not None and next_token >= 0 else [])
        numbered = student_doc_ids(extended, self.student_bos, self.student_eos)
        if doc_ids is None:
            return extended, numbered
        docs = [int(d) for d in doc_ids]
        if len(extended) > len(tokens):  # the label's document: the window's last, or the one after it
            docs.append(docs[-1] + numbered[-1] - numbered[-2])
        return extended, docs

    def align(self, tokens: Sequence[int], doc_ids: Optional[Sequence[int]] = None,
              next_token: Optional[int] = None) -> TeacherWindow:
        """The teacher's sequence for student `tokens` (and the label past them, `next_token`) and each student
        position's target index (module docstring)."""
        n_positions = len(tokens)
        tokens, docs = self.window_tokens(tokens, doc_ids, next_token)
        window = TeacherWindow(source=[ALIGN_NONE] * len(tokens))
        separator_of: dict[int, int] = {}  # student index of a special token -> teacher index of its separator
        run_end: dict[int, int] = {}  # student index of a run's last token -> teacher index of the run's last token
        i = 0
        while i < len(tokens):
            if self._bytes_of(tokens[i]) is None:
                separator = self._separator(tokens[i], opens=i == 0 or docs[i] != docs[i - 1])
                if separator is not None:  # each student special its own, in its document (bos = eos for GPT-2)
                    if i > 0 and docs[i] == docs[i - 1]:  # "the document ends here": what precedes both is the same
                        window.source[i - 1] = separator_of.get(i - 1, run_end.get(i - 1, ALIGN_NONE))
                    window.ids.append(separator)
                    window.doc_ids.append(int(docs[i]))
                    separator_of[i] = len(window.ids) - 1
                i += 1
                continue
            end = i
            starts, offset = [], 0
            while end < len(tokens) and self._bytes_of(tokens[end]) is not None:
                starts.append(offset)
                offset += len(self._bytes_of(tokens[end]))
                end += 1
            run = b"".join(self._bytes_of(t) for t in tokens[i:end])
            predictor_at = self._tokenize_run(run, window, int(docs[i]), separator_of.get(i - 1))
            for m in range(max(i, 1), end):
                window.source[m - 1] = predictor_at.get(starts[m - i], ALIGN_NONE)
            run_end[end - 1] = predictor_at.get(len(run), ALIGN_NONE)
            i = end
        window.source = window.source[:n_positions]
        return window

    def _tokenize_run(self, run: bytes, window: TeacherWindow, doc: int, separator: Optional[int]) -> dict[int, int]:
        """Append the teacher's tokens of one run; return {byte offset in the run: index of the teacher position
        that predicts the token starting there} for the offsets that have one, the run's end included (its last
        teacher token, when the run ends in whole characters)."""
        predictor_at: dict[int, int] = {}
        pieces, ids = utf8_pieces(run), []
        for piece_start, piece_end in pieces:
            ids, starts = self.teacher_tokens(run[piece_start:piece_end])
            base = len(window.ids)
            window.ids.extend(ids)
            window.doc_ids.extend([doc] * len(ids))
            for k, start in enumerate(starts):
                offset = piece_start + start
                if start < 0 or offset in predictor_at:  # inside a character, or a later piece at the same start
                    continue
                if k > 0:
                    predictor_at[offset] = base + k - 1
                elif piece_start == 0 and separator is not None and separator == base - 1:
                    predictor_at[offset] = separator
                else:
                    predictor_at[offset] = ALIGN_NONE
        if pieces and pieces[-1][1] == len(run) and ids:  # the last piece's tokens end where the run does
            predictor_at[len(run)] = len(window.ids) - 1
        return predictor_at
