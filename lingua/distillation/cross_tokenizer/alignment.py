"""Alignment by text offsets: a student window becomes the teacher's tokens, and each student position learns
which teacher position (if any) predicts the same next text.

    windows = WindowAligner(student_bytes, bos, eos, teacher_hf_tokenizer, teacher_bytes).align_rows(rows, docs, nexts)
    windows[r].ids, windows[r].doc_ids, windows[r].source  # the teacher's sequence; source[i]: position i's target

The student's tokens are spelled to bytes run by run (between specials), each run's text tokenized by the teacher and
its tokens placed by byte offsets. Student position i is aligned when token i + 1 starts where a teacher token
starts: the teacher's output before that token is its target. Documents stay apart (a student bos or eos becomes
the teacher's, each document's text is tokenized alone, a document's first token is aligned only through its own
separator), a position before the student's eos is aligned to the one before the teacher's (the vocabulary map pairs
them by role), and bytes that are not UTF-8 cut the run. Per run, not per token: numpy gathers the bytes and one
`encode_batch` call encodes a request's rows.
"""

from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np

ALIGN_NONE = -1


@dataclass
class TeacherWindow:
    """The teacher's side of one student window."""

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
    """Document ids as the loader numbers them: a new one at a bos, or after an eos; where bos and eos are one token
    (GPT-2's <|endoftext|>), it opens a document after one was closed."""
    if bos_id != eos_id or bos_id is None:  # no token both opens and closes: a new document at a bos or after an eos
        array = np.asarray(tokens, dtype=np.int64)
        bos, eos = (-1 if bos_id is None else bos_id), (-1 if eos_id is None else eos_id)
        starts = np.zeros(len(array), dtype=np.int64)
        starts[1:] = (array[1:] == bos) | (array[:-1] == eos)
        return np.cumsum(starts).tolist()
    doc_ids, current, closed = [], 0, False
    for i, token in enumerate(tokens):
        opens = token == bos_id and (bos_id != eos_id or closed or i == 0)
        if i > 0 and (closed or opens):
            current += 1
        closed = token == eos_id and not opens
        doc_ids.append(current)
    return doc_ids


def _exclusive_cumsum(lengths: np.ndarray) -> np.ndarray:
    """Where each of consecutive pieces of these lengths starts."""
    return np.cumsum(lengths) - lengths


class _ByteTable:
    """Every id's bytes in one flat buffer, so the text of many ids is one numpy gather."""

    def __init__(self, table: Sequence[Optional[bytes]]):
        self.known = np.array([data is not None for data in table] + [False], dtype=bool)  # the last: out of range
        self.lengths = np.array([len(data or b"") for data in table] + [0], dtype=np.int64)
        self.starts = _exclusive_cumsum(self.lengths)
        self.flat = np.frombuffer(b"".join(data or b"" for data in table) + b"\0", dtype=np.uint8)

    def index(self, ids: np.ndarray) -> np.ndarray:
        """Ids with every one outside the table sent to its last (unknown) entry."""
        return np.where((ids >= 0) & (ids < len(self.known) - 1), ids, len(self.known) - 1)

    def spell(self, index: np.ndarray) -> bytes:
        """The bytes of these (indexed) ids, back to back."""
        lengths = self.lengths[index]
        total = int(lengths.sum())
        if total == 0:
            return b""
        offsets = np.repeat(self.starts[index] - _exclusive_cumsum(lengths), lengths)
        return self.flat[offsets + np.arange(total)].tobytes()


@dataclass
class _Run:
    """Student tokens [start, end) with bytes (no special among them), their text and its valid UTF-8 pieces."""

    start: int
    end: int
    text: bytes
    pieces: list[tuple[int, int]]


class WindowAligner:
    """Aligns student windows to a teacher's tokenizer; built once per (student, teacher) pair."""

    def __init__(self, student_bytes: Sequence[Optional[bytes]], student_bos: Optional[int],
                 student_eos: Optional[int], teacher_tokenizer, teacher_bytes: Sequence[Optional[bytes]]):
        self.student_bytes = student_bytes
        self.student_bos, self.student_eos = student_bos, student_eos
        self.backend = teacher_tokenizer.backend_tokenizer
        self.teacher_bytes = teacher_bytes
        self.student_table, self.teacher_table = _ByteTable(student_bytes), _ByteTable(teacher_bytes)
        bos, eos = teacher_tokenizer.bos_token_id, teacher_tokenizer.eos_token_id
        self.opening, self.closing = (bos if bos is not None else eos), eos  # a document's teacher separators
        # A teacher whose tokens spell its text (byte-level BPE) needs no character offsets: its encoder skips them
        # (a quarter of its time), and a piece it cannot spell is encoded again with them.
        probe = "Probe: a  b\n\tc, 12.5 déjà 漢字"
        self.spells_text = self.teacher_table.spell(self.teacher_table.index(np.asarray(
            self.backend.encode(probe, add_special_tokens=False).ids, dtype=np.int64))) == probe.encode("utf-8")

    def _separator(self, token: int, opens: bool) -> Optional[int]:
        """The teacher's separator for a student special token that opens or closes a document, else None."""
        if token == self.student_bos and (opens or self.student_bos != self.student_eos):
            return self.opening
        return self.closing if token == self.student_eos else None

    def window_tokens(self, tokens: Sequence[int], doc_ids: Optional[Sequence[int]],
                      next_token: Optional[int]) -> tuple[list[int], list[int]]:
        """The window's tokens and the label past it (a negative `next_token` is none), with their document ids."""
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
        """`align_rows` of one window."""
        return self.align_rows([tokens], None if doc_ids is None else [doc_ids], [next_token])[0]

    def align_rows(self, rows: Sequence[Sequence[int]], doc_ids: Optional[Sequence[Sequence[int]]] = None,
                   next_tokens: Optional[Sequence[Optional[int]]] = None) -> list[TeacherWindow]:
        """`align` for each row, the teacher's encoder called once for all of their text."""
        prepared = []
        for r, row in enumerate(rows):
            tokens, docs = self.window_tokens(row, None if doc_ids is None else doc_ids[r],
                                              None if next_tokens is None else next_tokens[r])
            tokens = np.asarray(tokens, dtype=np.int64)
            prepared.append((len(row), tokens, docs, self._runs(tokens)))
        strings = [run.text[a:b].decode("utf-8") for *_, runs in prepared for run in runs for a, b in run.pieces]
        encode = self.backend.encode_batch_fast if self.spells_text else self.backend.encode_batch
        encodings = iter(encode(strings, add_special_tokens=False) if strings else [])
        return [self._assemble(n_positions, tokens, docs, runs, encodings)
                for n_positions, tokens, docs, runs in prepared]

    def _runs(self, tokens: np.ndarray) -> list[_Run]:
        """The window's runs of text, each spelled out with its valid UTF-8 pieces."""
        text = self.student_table.known[self.student_table.index(tokens)]
        edges = np.flatnonzero(np.diff(np.concatenate([[False], text, [False]]).astype(np.int8)))
        runs = []
        for start, end in zip(edges[0::2].tolist(), edges[1::2].tolist()):
            data = self.student_table.spell(tokens[start:end])
            runs.append(_Run(start, end, data, utf8_pieces(data)))
        return runs

    def _assemble(self, n_positions: int, tokens: np.ndarray, docs: list[int], runs: list[_Run],
                  encodings) -> TeacherWindow:
        """The teacher's window from the runs' encodings and the specials between them."""
        window = TeacherWindow()
        source = np.full(len(tokens), ALIGN_NONE, dtype=np.int64)
        separator_of: dict[int, int] = {}  # student index of a special token -> teacher index of its separator
        run_end: dict[int, int] = {}  # student index of a run's last token -> teacher index of the run's last token
        runs_at = {run.start: run for run in runs}
        i = 0
        while i < len(tokens):
            run = runs_at.get(i)
            if run is not None:  # its first token is aligned only through a separator of its own document
                opening = separator_of.get(i - 1) if i > 0 and docs[i] == docs[i - 1] else None
                self._place_run(run, tokens, window, source, int(docs[i]), opening, run_end, encodings)
                i = run.end
                continue
            separator = self._separator(int(tokens[i]), opens=i == 0 or docs[i] != docs[i - 1])
            if separator is not None:  # each student special its own, in its document (bos = eos for GPT-2)
                if i > 0 and docs[i] == docs[i - 1]:  # "the document ends here": what precedes both is the same
                    source[i - 1] = separator_of.get(i - 1, run_end.get(i - 1, ALIGN_NONE))
                window.ids.append(separator)
                window.doc_ids.append(int(docs[i]))
                separator_of[i] = len(window.ids) - 1
            i += 1
        window.source = source[:n_positions].tolist()
        return window

    def _piece_starts(self, piece: bytes, encoding) -> np.ndarray:
        """Where each teacher token of a piece starts, in bytes (-1: inside a character)."""
        index = self.teacher_table.index(np.asarray(encoding.ids, dtype=np.int64))
        lengths = self.teacher_table.lengths[index]
        if self.teacher_table.known[index].all() and int(lengths.sum()) == len(piece) \
                and self.teacher_table.spell(index) == piece:
            return _exclusive_cumsum(lengths)
        # Normalizers, a prefixed space, bytes missing from the vocabulary or specials from the text: the tokenizer's
        # character offsets. A token whose bytes begin inside a character (a continuation byte) reports that
        # character's start, which is not where it starts: it gets no offset of its own (-1).
        string = piece.decode("utf-8")
        if self.spells_text:  # encoded without offsets: again with them (the same ids)
            encoding = self.backend.encode(string, add_special_tokens=False)
        chars = np.minimum(np.asarray([start for start, _ in encoding.offsets], dtype=np.int64), len(string))
        starts = char_to_byte_offsets(string)[chars] if len(chars) else np.zeros(0, dtype=np.int64)
        first_byte = self.teacher_table.flat[self.teacher_table.starts[index]]  # the flat buffer ends in a spare 0
        inside = self.teacher_table.known[index] & (lengths > 0) & ((first_byte & 0xC0) == 0x80)
        return np.where(inside, -1, starts)

    def _place_run(self, run: _Run, tokens: np.ndarray, window: TeacherWindow, source: np.ndarray, doc: int,
                   separator: Optional[int], run_end: dict[int, int], encodings) -> None:
        """Append the teacher's tokens of one run and set the targets of the positions whose next token is in it."""
        keys, values, ids = [], [], []
        for piece_start, piece_end in run.pieces:
            encoding = next(encodings)
            ids = encoding.ids
            base = len(window.ids)
            starts = self._piece_starts(run.text[piece_start:piece_end], encoding)
            predictors = base + np.arange(len(ids), dtype=np.int64) - 1
            if len(ids):  # a piece's first token: predicted by the document's separator only
                predictors[0] = separator if piece_start == 0 and separator is not None and separator == base - 1 \
                    else ALIGN_NONE
            placed = starts >= 0  # inside a character: no offset of its own
            keys.append(piece_start + starts[placed])
            values.append(predictors[placed])
            window.ids.extend(ids)
            window.doc_ids.extend([doc] * len(ids))
        if run.pieces and run.pieces[-1][1] == len(run.text) and ids:  # the last piece's tokens end where the run does
            run_end[run.end - 1] = len(window.ids) - 1
        first = max(run.start, 1)
        # A byte offset's first teacher token wins (a later piece, or a normalizer's repeated offset).
        offsets, first_at = np.unique(np.concatenate(keys or [np.zeros(0, dtype=np.int64)]), return_index=True)
        if not len(offsets) or first >= run.end:
            return
        predictor = np.concatenate(values)[first_at]
        lengths = self.student_table.lengths[self.student_table.index(tokens[run.start:run.end])]
        wanted = _exclusive_cumsum(lengths)[first - run.start:]  # where tokens first..end-1 start in the run
        at = np.minimum(np.searchsorted(offsets, wanted), len(offsets) - 1)
        source[first - 1:run.end - 1] = np.where(offsets[at] == wanted, predictor[at], ALIGN_NONE)
