"""Alignment by byte offsets, checked as properties over random texts: several documents packed into a window
cut anywhere (mid-document, mid-character for the byte tokenizer), unicode, whitespace runs; students of each
kind (bytes, Llama 3's tiktoken, a byte-level BPE, a SentencePiece-style BPE and a real sentencepiece model)
against a byte-level BPE teacher (SmolLM2's, one trained here) and a SentencePiece-style one.

The properties, per window (its tokens and the label past it, as the loader gives them): the teacher's tokens of
each document spell that document's text (by the teacher's own decode); every aligned student position's target
is a teacher position with the same text before it in the same document (sound); every student position whose
next token starts at a character where a teacher token of the same document starts is aligned (complete), the
window's last one included; a position whose next token is the student's eos (or bos) closing its document is
aligned to the teacher position before the teacher's own separator, which the vocabulary map sends to that
student token; documents stay documents on both sides.
"""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lingua.distillation.cross_tokenizer.alignment import ALIGN_NONE, WindowAligner, student_doc_ids, utf8_pieces
from lingua.distillation.cross_tokenizer.teacher_side import CrossTokenizerTeacher
from lingua.distillation.cross_tokenizer.token_bytes import hf_token_bytes, student_token_bytes

PROPERTIES = settings(max_examples=15, deadline=None, derandomize=True, database=None,
                      suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])

TEXT = st.one_of(
    st.text(st.characters(blacklist_categories=("Cs",)), max_size=40),  # any unicode but lone surrogates
    st.text(st.sampled_from(list(" \t\n\r  a b é 🎉 漢 e\u0301 x1.,'")), max_size=40),  # whitespace runs, mixed
    st.lists(st.sampled_from(["the", " quick", "  ", "fox", "\n\n", " déjà", "🎉🚀", "123", " 漢字", "\t"]),
             max_size=12).map("".join),
)
DOCUMENTS = st.lists(TEXT, min_size=1, max_size=3)
CUT = st.tuples(st.floats(0.0, 0.5), st.floats(0.5, 1.0))

STUDENTS = ["bytes", "llama3", "trained_bpe", "trained_sp", "sentencepiece"]
TEACHERS = ["smollm2", "trained_bpe", "trained_sp"]


def window_of(student, documents, cut):
    """The documents packed as the loader packs them (bos, text, eos each), then a slice of it: the window's
    tokens and the label past them (its last token)."""
    tokens = [t for text in documents for t in student.encode(text, add_bos=True, add_eos=True)]
    start, end = int(cut[0] * len(tokens)), max(int(cut[1] * len(tokens)), int(cut[0] * len(tokens)) + 2)
    return tokens[start:end]


def same_text(teacher_text: str, student_text: str) -> bool:
    """Equal, allowing the one leading space a SentencePiece-style decode strips."""
    return teacher_text == student_text or (student_text.startswith(" ") and teacher_text == student_text[1:])


_TABLES: dict[int, list] = {}


def token_bytes_of(tokenizer, hf: bool) -> list:
    """Each tokenizer's bytes table, built once (Llama 3's has 128k entries)."""
    if id(tokenizer) not in _TABLES:
        _TABLES[id(tokenizer)] = hf_token_bytes(tokenizer.tokenizer) if hf else student_token_bytes(tokenizer)
    return _TABLES[id(tokenizer)]


_CROSS: dict[tuple[int, int], CrossTokenizerTeacher] = {}


def cross_of(student, teacher) -> CrossTokenizerTeacher:
    """The pair's aligner and vocabulary map, built once."""
    if (id(student), id(teacher)) not in _CROSS:
        _CROSS[id(student), id(teacher)] = CrossTokenizerTeacher(student, teacher.tokenizer)
    return _CROSS[id(student), id(teacher)]


def check_window(student, teacher, tokens, label_past: bool = True) -> int:
    """Check the properties on one window: `tokens` and, with `label_past`, its last token is the label past the
    window (else the window has none); return how many positions were aligned."""
    student_bytes = token_bytes_of(student, hf=False)
    teacher_bytes = token_bytes_of(teacher, hf=True)
    aligner = WindowAligner(student_bytes, student.bos_id, student.eos_id, teacher.tokenizer, teacher_bytes)
    docs = student_doc_ids(tokens, student.bos_id, student.eos_id)
    n_positions = len(tokens) - 1 if label_past else len(tokens)
    window = aligner.align(tokens[:n_positions], docs[:n_positions], tokens[-1] if label_past else None)
    separators = {teacher.bos_id, teacher.eos_id} - {None}
    student_of = cross_of(student, teacher).vocab_map.teacher_to_student
    assert len(window.source) == n_positions and len(window.ids) == len(window.doc_ids)
    assert window.doc_ids == sorted(window.doc_ids) and set(window.doc_ids) <= set(docs)

    def spelled(table, ids):
        return b"".join(table[t] or b"" for t in ids)

    runs, representable, teacher_of_doc = {}, {}, {}
    for doc in set(docs):
        run = spelled(student_bytes, [t for t, d in zip(tokens, docs) if d == doc])
        teacher_ids = [t for t, d in zip(window.ids, window.doc_ids) if d == doc and t not in separators]
        valid = "".join(run[a:b].decode() for a, b in utf8_pieces(run))
        runs[doc], teacher_of_doc[doc] = run, teacher_ids
        # The teacher's tokens spell the document's text, unless its vocabulary cannot (SmolLM2 lacks some bytes).
        decoded = teacher.tokenizer.decode(teacher_ids, skip_special_tokens=True)
        round_trip = teacher.tokenizer.decode(teacher.encode(valid, add_bos=False, add_eos=False))
        representable[doc] = len(utf8_pieces(run)) <= 1 and same_text(round_trip, valid)
        if representable[doc]:
            assert same_text(decoded, valid), (decoded, valid)

    prefix = {}  # doc -> bytes of its tokens so far
    for i in range(min(n_positions, len(tokens) - 1)):  # without a label past it, the last position has no next
        doc = docs[i]
        prefix[doc] = prefix.get(doc, b"") + (student_bytes[tokens[i]] or b"")
        nxt, source = tokens[i + 1], window.source[i]
        if docs[i + 1] != doc or (student_bytes[nxt] is None and nxt not in (student.bos_id, student.eos_id)):
            assert source == ALIGN_NONE  # the next token is another document's, or a special without a role
            continue
        if student_bytes[nxt] is None:  # the document ends: the teacher's separator follows the same text
            check_document_end(window, tokens, i, prefix[doc], student_of, teacher, teacher_bytes, separators,
                               representable[doc])
            continue
        before, run = prefix[doc], runs[doc]
        pieces = [(a, b) for a, b in utf8_pieces(run) if a <= len(before) < b]
        if source != ALIGN_NONE:
            # Sound: the teacher position predicts after the same text, in the same document.
            assert window.doc_ids[source] == doc and pieces, (before, utf8_pieces(run))
            if not representable[doc]:
                continue
            teacher_before = [t for j, (t, d) in enumerate(zip(window.ids, window.doc_ids))
                              if d == doc and j <= source and t not in separators]
            student_before = before[pieces[0][0]:]
            spelled_before = spelled(teacher_bytes, teacher_before)
            if spelled_before in (student_before, b" " + student_before):  # byte-level: exact, even mid-character
                continue
            assert same_text(teacher.tokenizer.decode(teacher_before, skip_special_tokens=True),
                             student_before.decode()), (teacher_before, student_before)
        elif pieces and representable[doc] and (run[len(before)] & 0xC0) != 0x80:
            # Complete: no teacher token of this document starts at this character (after its first token).
            a, b = pieces[0]
            if len(before) == a:
                continue  # the first token of a piece is aligned only after a separator
            starts = teacher_char_starts(teacher, teacher_bytes, run[a:b].decode())
            assert len(run[a:len(before)].decode()) not in starts[1:], (run[a:b], before, tokens)
    return window.aligned


def check_document_end(window, tokens, i, before: bytes, student_of, teacher, teacher_bytes, separators,
                       representable: bool) -> None:
    """Student position i predicts its document's end (eos, or GPT-2's bos = eos): aligned, when the document's
    text so far ends in whole characters, to the teacher position right before its separator, whose id the
    vocabulary map sends to the student's token; what the teacher read there is the same text."""
    source = window.source[i]
    pieces = utf8_pieces(before)
    whole = not before or (pieces and pieces[-1][1] == len(before))
    if not whole:  # a window cut inside the document's last character: no teacher token ends there
        assert source == ALIGN_NONE, (before, tokens)
        return
    if source == ALIGN_NONE and not representable:
        return  # the teacher's vocabulary cannot spell the text (SmolLM2 lacks some bytes): it may have no token
    assert source != ALIGN_NONE, (before, tokens)
    separator = window.ids[source + 1]
    assert separator in separators and window.doc_ids[source] == window.doc_ids[source + 1]
    assert int(student_of[separator]) == tokens[i + 1]
    if representable and before:
        teacher_before = [t for j, (t, d) in enumerate(zip(window.ids, window.doc_ids))
                          if d == window.doc_ids[source] and j <= source and t not in separators]
        text = before[pieces[0][0]:]
        spelled = b"".join(teacher_bytes[t] or b"" for t in teacher_before)
        assert spelled in (text, b" " + text) or same_text(
            teacher.tokenizer.decode(teacher_before, skip_special_tokens=True), text.decode()), (teacher_before, text)


def teacher_char_starts(teacher, teacher_bytes, text: str) -> list[int]:
    """Character offsets where the teacher's tokens of `text` start, by its own offsets; a token that begins
    with a UTF-8 continuation byte starts inside a character and is left out (its offset is the character's)."""
    encoding = teacher.tokenizer.backend_tokenizer.encode(text, add_special_tokens=False)
    return [start for t, (start, _) in zip(encoding.ids, encoding.offsets)
            if not (teacher_bytes[t] and teacher_bytes[t][0] & 0xC0 == 0x80)]


@pytest.mark.parametrize("teacher", TEACHERS)
@pytest.mark.parametrize("student", STUDENTS)
@PROPERTIES
@given(documents=DOCUMENTS, cut=CUT)
def test_alignment_properties(cross_tokenizers, student, teacher, documents, cut):
    student_tok, teacher_tok = cross_tokenizers[student], cross_tokenizers[teacher]
    check_window(student_tok, teacher_tok, window_of(student_tok, documents, cut))


def test_alignment_of_known_text(cross_tokenizers):
    """Two documents, byte student, SmolLM2 teacher: the positions and targets, spelled out."""
    student, teacher = cross_tokenizers["bytes"], cross_tokenizers["smollm2"]
    aligner = WindowAligner(token_bytes_of(student, False), student.bos_id, student.eos_id, teacher.tokenizer,
                            token_bytes_of(teacher, True))
    tokens = student.encode("Hi there", True, True) + student.encode("ok", True, True)
    window = aligner.align(tokens)
    pieces = teacher.tokenizer.convert_ids_to_tokens(window.ids)
    assert pieces == ["<|im_start|>", "Hi", "Ġthere", "<|im_end|>", "<|im_start|>", "ok", "<|im_end|>"]
    assert window.doc_ids == [0, 0, 0, 0, 1, 1, 1]
    # Student positions: bos H i ' ' t h e r e eos bos o k eos. Position 0 (bos) predicts "H": the teacher's bos
    # predicts "Hi"; position 2 ("i") predicts " t": "Hi" predicts " there"; position 8 ("e") predicts the eos:
    # " there" predicts <|im_end|>; "ok" after the second bos, and its end. The last eos has no label past it.
    assert window.source == [0, -1, 1, -1, -1, -1, -1, -1, 2, -1, 4, -1, 5, -1]
    student_of = cross_of(student, teacher).vocab_map.teacher_to_student
    assert int(student_of[teacher.eos_id]) == student.eos_id and int(student_of[teacher.bos_id]) == student.bos_id


def test_the_label_past_the_window_aligns_its_last_position(cross_tokenizers):
    """The window "[bos] Hi" cut before " there": with the label past it (" "), the teacher reads "Hi " and its
    "Hi" predicts " there" where the student's "i" predicts " "; without it, the last position has no target. With
    the document's eos as that label, "there" predicts the end. Given document ids, the label's is numbered on."""
    student, teacher = cross_tokenizers["bytes"], cross_tokenizers["smollm2"]
    aligner = cross_of(student, teacher).aligner
    tokens = student.encode("Hi there", True, True)
    assert aligner.align(tokens[:3]).source == [0, -1, -1]
    window = aligner.align(tokens[:3], next_token=tokens[3])
    assert window.source == [0, -1, 1] and teacher.tokenizer.convert_ids_to_tokens(window.ids)[:2] == [
        "<|im_start|>", "Hi"]
    assert aligner.align(tokens[:-1], next_token=tokens[-1]).source[-1] == 2  # " there" predicts <|im_end|>
    assert aligner.align(tokens[:-1], next_token=-100).source[-1] == -1  # no label (held-out padding)
    two = tokens + student.encode("ok", True, True)
    window = aligner.align(two[:10], [7] * 10, next_token=two[10])  # the label is the next document's bos
    assert window.doc_ids == [7, 7, 7, 7, 8] and window.source[-1] == -1  # eos predicts another document


def test_an_empty_document_lends_no_target_across_documents(cross_tokenizers):
    """GPT-2 style tokenizers (bos = eos) on both sides, documents "" and "0": the window cut after the first
    <|endoftext|> reads "E E 0 E", which numbers as an empty document then "0" (hypothesis found it). The empty
    document is the teacher's own [E E], and the E closing it predicts "0" of the next document: no target; the
    empty document's end is distilled (its opening E predicts its closing one). Numbered as the loader knows it
    (the first E closed a document cut before the window), the second E opens "0" and aligns it."""
    student, teacher = cross_tokenizers["trained_bpe"], cross_tokenizers["trained_bpe"]
    aligner = cross_of(student, teacher).aligner
    end = student.eos_id
    zero = student.encode("0", add_bos=False, add_eos=False)
    tokens = [end, end] + zero + [end]
    assert student.bos_id == end and len(zero) == 1 and student_doc_ids(tokens, end, end) == [0, 0, 1, 1]
    window = aligner.align(tokens[:-1], [0, 0, 1], next_token=end)
    assert window.ids == [teacher.eos_id, teacher.eos_id] + zero + [teacher.eos_id]  # the same tokenizer
    assert window.doc_ids == [0, 0, 1, 1] and window.source == [0, ALIGN_NONE, 2]  # "0" predicts its end
    by_loader = aligner.align(tokens[:-1], [0, 1, 1], next_token=end)
    assert by_loader.doc_ids == [0, 1, 1, 1] and by_loader.source == [ALIGN_NONE, 1, 2]


@pytest.mark.parametrize("teacher", ["trained_bpe", "trained_sp"])
@pytest.mark.parametrize("student", ["trained_bpe", "bytes"])
def test_empty_documents_hold_the_properties_at_every_cut(cross_tokenizers, student, teacher):
    """Empty documents among others, every window start, GPT-2 style (bos = eos) or not on either side."""
    student_tok, teacher_tok = cross_tokenizers[student], cross_tokenizers[teacher]
    for documents in (["", "0"], ["ab", "", "", "c d"]):
        stream = [t for text in documents for t in student_tok.encode(text, add_bos=True, add_eos=True)]
        for start in range(len(stream) - 1):
            check_window(student_tok, teacher_tok, stream[start:])


@pytest.mark.parametrize("student", STUDENTS)
def test_a_document_end_is_distilled_for_every_student(cross_tokenizers, student):
    """Every document's last text position is aligned to the teacher's position before its eos, and that eos
    maps to the student's eos, for each kind of student against SmolLM2."""
    student_tok, teacher = cross_tokenizers[student], cross_tokenizers["smollm2"]
    cross = cross_of(student_tok, teacher)
    for text in CORPUS_SAMPLES:
        tokens = student_tok.encode(text, True, True)
        window = cross.aligner.align(tokens)
        source = window.source[-2]
        assert source >= 0 and window.ids[source + 1] == teacher.eos_id
        assert int(cross.vocab_map.teacher_to_student[teacher.eos_id]) == student_tok.eos_id


def test_alignment_rate_over_random_texts(cross_tokenizers):
    """Across many windows a real teacher aligns a good share of the byte tokenizer's positions (one per teacher
    token) and most of Llama 3's (a vocabulary of the same family)."""
    rates = {}
    for student in ("bytes", "llama3"):
        aligned = total = 0
        for text in CORPUS_SAMPLES:
            tokens = cross_tokenizers[student].encode(text, True, True)
            aligned += check_window(cross_tokenizers[student], cross_tokenizers["smollm2"], tokens, label_past=False)
            total += len(tokens)
        rates[student] = aligned / total
    assert 0.15 < rates["bytes"] < 0.5 and rates["llama3"] > 0.6, rates


CORPUS_SAMPLES = [
    "Knowledge distillation trains a small student to match a large teacher.",
    "def f(x):\n    return x * 2  # doubles\n",
    "Les élèves apprennent à prédire le prochain mot.",
    "Numbers 12345 and 3.14159, emoji 🎉, and CJK 漢字.",
]


@pytest.mark.parametrize("teacher", ["smollm2", "trained_sp"])
def test_a_request_s_rows_align_as_each_alone(cross_tokenizers, teacher):
    """A request's rows go to the teacher's encoder in one call (without character offsets where its tokens spell
    the text, as SmolLM2's byte-level BPE does; with them for the SentencePiece-style one, which adds a space):
    each row's window is the one it gets alone, with and without its document ids and the label past it."""
    student, teacher_tok = cross_tokenizers["llama3"], cross_tokenizers[teacher]
    aligner = cross_of(student, teacher_tok).aligner
    assert aligner.spells_text == (teacher == "smollm2")
    stream = [t for text in CORPUS_SAMPLES * 3 for t in student.encode(text, True, True)]
    rows = [stream[start:start + 17] for start in range(0, len(stream) - 17, 7)]
    docs = [student_doc_ids(row, student.bos_id, student.eos_id) for row in rows]
    together = aligner.align_rows([row[:-1] for row in rows], [d[:-1] for d in docs], [row[-1] for row in rows])
    assert together == [aligner.align(row[:-1], d[:-1], row[-1]) for row, d in zip(rows, docs)]
    assert aligner.align_rows(rows) == [aligner.align(row) for row in rows]
