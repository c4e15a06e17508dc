"""The bytes each token id stands for, for every tokenizer kind: the common ground of two vocabularies. Bytes, not
strings, so a token that is part of a character still has a value and matches its equal on the other side. Byte-level
BPE ("Ġ") is read through its byte-to-character table, SentencePiece pieces ("▁", "<0xE2>") through those two rules.
"""

import json
import re
from typing import Optional

from lingua.errors import ConfigError
from lingua.tokenizer import ByteTokenizer, HFTokenizer, SentencePieceTokenizer, TikTokenTokenizer, Tokenizer

SP_SPACE = "\u2581"  # "▁", SentencePiece's stand-in for a space
SP_BYTE_PIECE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def _decoder_kinds(spec: Optional[dict]) -> set[str]:
    """Every `type` in a tokenizer.json decoder (Sequence decoders nest theirs)."""
    if not spec:
        return set()
    kinds = {spec.get("type", "")}
    for child in spec.get("decoders", None) or []:
        kinds |= _decoder_kinds(child)
    return kinds


def hf_special_ids(tokenizer) -> set[int]:
    """Ids of a transformers tokenizer's special tokens (bos, eos, pad, chat markers, ...)."""
    special = set(tokenizer.all_special_ids)
    special |= {i for i, token in tokenizer.added_tokens_decoder.items() if token.special}
    return special


def hf_token_bytes(tokenizer) -> list[Optional[bytes]]:
    """Bytes of every id of a transformers fast tokenizer (None for special tokens and unreadable ids)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise ConfigError(f"{type(tokenizer).__name__} is not a fast (Rust) tokenizer; cross-tokenizer distillation "
                          f"reads the tokenizer.json of a Hugging Face fast tokenizer: save one with tokenizers.")
    kinds = _decoder_kinds(json.loads(backend.to_str()).get("decoder"))
    vocab = backend.get_vocab(with_added_tokens=True)
    added = {i: token for i, token in tokenizer.added_tokens_decoder.items()}
    special = hf_special_ids(tokenizer)
    table: list[Optional[bytes]] = [None] * (max(max(vocab.values(), default=-1), len(tokenizer) - 1) + 1)
    if "ByteLevel" in kinds:
        from transformers.convert_slow_tokenizer import bytes_to_unicode

        byte_of = {char: byte for byte, char in bytes_to_unicode().items()}
        def piece_bytes(piece):
            return bytes(byte_of[c] for c in piece) if all(c in byte_of for c in piece) else None
    elif kinds & {"Metaspace", "ByteFallback", "Replace"}:
        piece_bytes = _sp_piece_bytes
    else:
        def piece_bytes(piece):  # WordPiece and other decoders: only what decodes alone is trusted
            return None
    for piece, i in vocab.items():
        if i in special:
            continue
        if i in added:  # an added (non-special) token's text is its content, not a vocabulary piece
            table[i] = added[i].content.encode("utf-8")
            continue
        table[i] = piece_bytes(piece)
        if table[i] is None and not kinds & {"ByteLevel"}:
            text = tokenizer.decode([i])
            table[i] = None if "\ufffd" in text or not text else text.encode("utf-8")
    return [b if b else None for b in table]


def sentencepiece_token_bytes(model) -> list[Optional[bytes]]:
    """Bytes of every id of a sentencepiece model (None for control and unknown pieces)."""
    table: list[Optional[bytes]] = []
    for i in range(model.vocab_size()):
        if model.is_control(i) or model.is_unknown(i) or model.is_unused(i):
            table.append(None)
            continue
        table.append(_sp_piece_bytes(model.id_to_piece(i), model.is_byte(i)) or None)
    return table


def _sp_piece_bytes(piece: str, may_be_byte: bool = True) -> bytes:
    """A SentencePiece-style piece's bytes: "<0xNN>" a byte fallback, "▁" a space."""
    byte = SP_BYTE_PIECE.match(piece) if may_be_byte else None
    return bytes([int(byte.group(1), 16)]) if byte else piece.replace(SP_SPACE, " ").encode("utf-8")


def byte_fallback_ids(tokenizer: Tokenizer) -> set[int]:
    """Ids of a student's byte-fallback pieces ("<0xNN>"), which lose to a regular piece with the same bytes."""
    if isinstance(tokenizer, SentencePieceTokenizer):
        return {i for i in range(tokenizer.model.vocab_size()) if tokenizer.model.is_byte(i)}
    if isinstance(tokenizer, HFTokenizer):
        return {i for piece, i in tokenizer.tokenizer.get_vocab().items() if SP_BYTE_PIECE.match(piece)}
    return set()


def student_token_bytes(tokenizer: Tokenizer) -> list[Optional[bytes]]:
    """Bytes of every id below `tokenizer.n_words` (None for bos, eos and the other special ids)."""
    if isinstance(tokenizer, ByteTokenizer):
        table = [bytes([i]) for i in range(256)]
    elif isinstance(tokenizer, TikTokenTokenizer):
        table = [tokenizer.model.decode_single_token_bytes(i) for i in range(tokenizer.n_base)]
    elif isinstance(tokenizer, SentencePieceTokenizer):
        table = sentencepiece_token_bytes(tokenizer.model)
    elif isinstance(tokenizer, HFTokenizer):
        table = hf_token_bytes(tokenizer.tokenizer)
    else:
        raise ConfigError(f"Cross-tokenizer distillation does not know the {type(tokenizer).__name__} tokenizer; "
                          f"use data.tokenizer.name=bytes, tiktoken, sp or hf.")
    table = table[:tokenizer.n_words] + [None] * max(0, tokenizer.n_words - len(table))
    for special in (tokenizer.bos_id, tokenizer.eos_id):
        if special is not None and special < len(table):
            table[special] = None
    return table
