"""The vocabulary map against the tokenizers' own decode: real vocabularies of other families (SmolLM2's
byte-level BPE, Llama 3's tiktoken ranks from quicktok-v1), a byte-level BPE and a SentencePiece-style BPE
trained here, and the byte tokenizer."""

import pytest
import torch

from lingua.distillation.cross_tokenizer.token_bytes import (
    byte_fallback_ids,
    hf_special_ids,
    hf_token_bytes,
    student_token_bytes,
)
from lingua.distillation.cross_tokenizer.vocab_map import build_vocab_map
from lingua.tokenizer import ByteTokenizer

PREFIX = "a"  # decoded after a prefix, so a SentencePiece decoder's strip of one leading space keeps the token's


def decoded_alone(tokenizer, token: int) -> str:
    """The text one token adds, by the tokenizer's own decode (after PREFIX, to keep leading spaces)."""
    prefix = tokenizer.encode(PREFIX, add_bos=False, add_eos=False)
    text = tokenizer.decode(prefix + [token])
    return text[len(PREFIX):] if text.startswith(PREFIX) else "\ufffd"


_DECODED: dict[int, dict[str, set]] = {}


def decode_map(student, teacher_hf, teacher_ids) -> dict[int, set]:
    """teacher id -> the student ids with the same decoded text (an independent map, text tokens only)."""
    if id(student) not in _DECODED:
        _DECODED[id(student)] = student_texts(student)
    by_text = _DECODED[id(student)]
    return {t: by_text.get(decoded_alone(teacher_hf, t), set()) for t in teacher_ids}


def student_texts(student) -> dict[str, set]:
    """decoded text -> the student ids that decode to it (once per student: Llama 3 has 128k)."""
    specials = {student.bos_id, student.eos_id}
    by_text: dict[str, set] = {}
    for s in range(student.n_words):
        if s in specials or (hasattr(student, "n_base") and s >= student.n_base):
            continue
        text = decoded_alone(student, s) if not isinstance(student, ByteTokenizer) else (
            chr(s) if s < 128 else "\ufffd")
        if text and "\ufffd" not in text:
            by_text.setdefault(text, set()).add(s)
    return by_text


@pytest.mark.parametrize("teacher", ["smollm2", "trained_bpe", "trained_sp"])
@pytest.mark.parametrize("student", ["bytes", "llama3", "trained_sp", "trained_bpe"])
def test_vocab_map_agrees_with_decode(cross_tokenizers, teacher, student):
    """Every teacher token that decodes to whole characters maps to a student token with the same decoded text,
    or, when no student token decodes to it, stays unmapped; specials never map."""
    student_tok, teacher_tok = cross_tokenizers[student], cross_tokenizers[teacher]
    vocab_map = build_vocab_map(student_token_bytes(student_tok), hf_token_bytes(teacher_tok.tokenizer),
                                byte_fallback_ids(student_tok))
    table = vocab_map.teacher_to_student
    special = hf_special_ids(teacher_tok.tokenizer)
    assert all(table[t] == -1 for t in special)
    assert not set(table.tolist()) & {student_tok.bos_id, student_tok.eos_id}
    # A spread of ids over the whole vocabulary (all of it for the small ones).
    step = max(1, teacher_tok.n_words // 1500)
    ids = [t for t in range(0, teacher_tok.n_words, step) if t not in special]
    texts = {t: decoded_alone(teacher_tok, t) for t in ids}
    whole = [t for t in ids if texts[t] and "\ufffd" not in texts[t]]
    expected = decode_map(student_tok, teacher_tok, whole)
    for t in whole:
        if expected[t]:
            assert int(table[t]) in expected[t], (t, texts[t], int(table[t]))
        else:
            assert int(table[t]) == -1, (t, texts[t], int(table[t]))
    assert any(expected[t] for t in whole)  # the check compared real matches, not only misses


@pytest.mark.parametrize("teacher", ["smollm2", "trained_bpe", "trained_sp"])
def test_byte_tokens_map_to_the_byte_tokenizer(cross_tokenizers, teacher):
    """Parts of a character (byte-level "Ã", byte fallback "<0xC3>") map through their byte to the byte tokenizer,
    and every single-byte teacher token does."""
    teacher_tok = cross_tokenizers[teacher]
    teacher_bytes = hf_token_bytes(teacher_tok.tokenizer)
    table = build_vocab_map(student_token_bytes(ByteTokenizer()), teacher_bytes).teacher_to_student
    single = [t for t, b in enumerate(teacher_bytes) if b is not None and len(b) == 1]
    # SmolLM2's vocabulary lacks 21 bytes (never-valid UTF-8 lead bytes and a few control characters).
    assert len({teacher_bytes[t] for t in single}) == (235 if teacher == "smollm2" else 256)
    assert all(int(table[t]) == teacher_bytes[t][0] for t in single)
    assert all(int(table[t]) == -1 for t, b in enumerate(teacher_bytes) if b is not None and len(b) > 1)


def test_sentencepiece_spaces_and_duplicates(cross_tokenizers):
    """"▁word" is " word"; a SentencePiece student with a byte piece beside a letter gets the letter's id (what its
    encoder produces)."""
    sp = cross_tokenizers["trained_sp"]
    assert sp.encode("xe", add_bos=False, add_eos=False)[-1] == sp.tokenizer.get_vocab()["e"]
    sp_bytes = student_token_bytes(sp)
    vocab = sp.tokenizer.get_vocab()
    spaced = [piece for piece in vocab if piece.startswith("\u2581") and len(piece) > 2]
    assert spaced and all(sp_bytes[vocab[p]] == p.replace("\u2581", " ").encode() for p in spaced)
    assert sp_bytes[vocab["<0x41>"]] == b"A"
    vocab_map = build_vocab_map(sp_bytes, hf_token_bytes(cross_tokenizers["smollm2"].tokenizer), byte_fallback_ids(sp))
    smol = cross_tokenizers["smollm2"].tokenizer.get_vocab()
    assert int(vocab_map.teacher_to_student[smol["e"]]) == vocab["e"] != vocab["<0x65>"]


def test_fingerprint_names_the_map(cross_tokenizers):
    teacher_bytes = hf_token_bytes(cross_tokenizers["smollm2"].tokenizer)
    a = build_vocab_map(student_token_bytes(ByteTokenizer()), teacher_bytes)
    b = build_vocab_map(student_token_bytes(ByteTokenizer()), teacher_bytes)
    c = build_vocab_map(student_token_bytes(cross_tokenizers["llama3"]), teacher_bytes)
    assert a.fingerprint() == b.fingerprint() != c.fingerprint()
    assert torch.equal(a.teacher_to_student, b.teacher_to_student)
    assert 235 == a.mapped < c.mapped


@pytest.mark.parametrize("student,teacher", [
    ("bytes", "smollm2"),  # distinct bos and eos on both sides, named differently
    ("sentencepiece", "trained_bpe"),  # a teacher whose bos is its eos
    ("trained_bpe", "smollm2"),  # a student whose bos is its eos
    ("llama3", "trained_sp"),
])
def test_eos_and_bos_map_by_role(cross_tokenizers, teacher, student):
    """The pair's map (CrossTokenizerTeacher's) sends the teacher's eos to the student's eos and its bos to the
    student's bos, whatever their strings (<|im_end|> to the byte tokenizer's 257, </s> to <|endoftext|>); a teacher
    whose bos is its eos sends it to the student's eos. The teacher's other specials stay unmapped, and the map
    differs from the bytes-only one exactly there."""
    from lingua.distillation.cross_tokenizer.teacher_side import CrossTokenizerTeacher

    student_tok, teacher_tok = cross_tokenizers[student], cross_tokenizers[teacher]
    cross = CrossTokenizerTeacher(student_tok, teacher_tok.tokenizer)
    table = cross.vocab_map.teacher_to_student
    bytes_only = build_vocab_map(cross.aligner.student_bytes, cross.aligner.teacher_bytes,
                                 byte_fallback_ids(student_tok)).teacher_to_student
    teacher_bos, teacher_eos = teacher_tok.tokenizer.bos_token_id, teacher_tok.tokenizer.eos_token_id
    assert int(table[teacher_eos]) == student_tok.eos_id
    if teacher_bos != teacher_eos:
        assert int(table[teacher_bos]) == student_tok.bos_id
    others = hf_special_ids(teacher_tok.tokenizer) - {teacher_bos, teacher_eos}
    assert all(int(table[t]) == -1 for t in others)
    changed = (table != bytes_only).nonzero().flatten().tolist()
    assert set(changed) == {teacher_bos, teacher_eos}
