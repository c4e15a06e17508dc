"""Tokenizers behind one small interface: bytes (no dependencies), tiktoken, sentencepiece, Hugging Face.

    tokenizer = build_tokenizer(TokenizerArgs(name="hf", path="data/teachers/smollm2-135m-instruct"))
    ids = tokenizer.encode("hello", add_bos=True, add_eos=True)

Each one also has a Hugging Face form (`hf_backend()`, built with `tokenizers` and transformers' converters) that
encodes text to the same ids: apps.main.export_hf saves it, so lm-eval and `AutoTokenizer` read any student.
Everything loads from local files; nothing here touches the network.
"""

import base64
import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from lingua.args import require, require_filled
from lingua.errors import ConfigError, MissingPathError

logger = logging.getLogger(__name__)

TOKENIZER_NAMES = ("bytes", "tiktoken", "sp", "hf")


@dataclass
class TokenizerArgs:
    name: str = "bytes"  # "bytes" | "tiktoken" | "sp" | "hf"
    path: Optional[str] = None  # model file (tiktoken/sp) or Hugging Face tokenizer directory (hf)

    def validate(self) -> None:
        """The name is known and, for every tokenizer but bytes, its path points at the right kind of file."""
        require(self.name in TOKENIZER_NAMES, "data.tokenizer.name", self.name, f"use one of {', '.join(TOKENIZER_NAMES)}")
        if self.name == "bytes":
            return
        expected = "a Hugging Face tokenizer directory" if self.name == "hf" else f"a {self.name} model file"
        require(bool(self.path), "data.tokenizer.path", self.path, f"tokenizer {self.name!r} needs {expected}")
        require_filled("data.tokenizer.path", self.path, expected)
        path = Path(self.path)
        if not path.exists():
            raise MissingPathError(f"data.tokenizer.path={self.path!r} does not exist; set it to {expected}.")
        if self.name == "hf":
            require(path.is_dir(), "data.tokenizer.path", self.path, f"it is not a directory; set it to {expected} "
                    f"(the folder with tokenizer.json / tokenizer_config.json)")
        else:
            require(path.is_file(), "data.tokenizer.path", self.path, f"it is not a file; set it to {expected}")


class Tokenizer(ABC):
    """`n_words` is the vocab size the model needs; `bos_id`/`eos_id` are None when the tokenizer has none."""

    n_words: int
    bos_id: Optional[int]
    eos_id: Optional[int]

    @abstractmethod
    def _encode_text(self, text: str) -> list[int]:
        """Token ids of `text` without any special tokens."""

    @abstractmethod
    def decode(self, ids: list[int]) -> str:
        """Text of `ids`; bos/eos and other special tokens are dropped."""

    @abstractmethod
    def hf_backend(self):
        """This tokenizer as a `tokenizers.Tokenizer`: the same ids for any text (no bos/eos added), its special
        tokens (bos and eos among them) as added tokens at their ids."""

    def encode(self, text: str, add_bos: bool, add_eos: bool) -> list[int]:
        """Token ids of `text`, framed by bos/eos when asked and when the tokenizer has them."""
        ids = self._encode_text(text)
        if add_bos and self.bos_id is not None:
            ids = [self.bos_id] + ids
        if add_eos and self.eos_id is not None:
            ids = ids + [self.eos_id]
        return ids


BYTE_SPECIALS = ("<|begin_of_text|>", "<|end_of_text|>")  # ids 256 and 257 in the Hugging Face form


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes are ids 0..255; bos=256, eos=257."""

    def __init__(self):
        self.bos_id = 256
        self.eos_id = 257
        self.n_words = 258

    def _encode_text(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def hf_backend(self):
        """Byte-level BPE without merges: each byte is its own id, as GPT-2's byte alphabet spells it."""
        from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
        from transformers.convert_slow_tokenizer import bytes_to_unicode

        vocab = {char: byte for byte, char in bytes_to_unicode().items()}
        backend = Tokenizer(models.BPE(vocab, [], fuse_unk=False))
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        backend.decoder = decoders.ByteLevel()
        backend.add_special_tokens([AddedToken(text, normalized=False, special=True) for text in BYTE_SPECIALS])
        return backend


# The Llama 3 pre-tokenizer split; tiktoken files in the Llama 3 format expect it.
TIKTOKEN_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
TIKTOKEN_N_SPECIAL = 256  # as in Llama 3: bos, eos and reserved specials after the BPE ranks


def load_bpe_ranks(path: str) -> dict[bytes, int]:
    """Read a `.tiktoken` file (one 'base64-token rank' per line) without tiktoken's path-keyed cache."""
    ranks = {}
    for line_no, line in enumerate(Path(path).read_bytes().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
        except ValueError:
            raise ConfigError(f"{path}:{line_no} is not a tiktoken BPE line ('<base64 token> <rank>'); "
                              f"point data.tokenizer.path at a .tiktoken file.") from None
    return ranks


class TikTokenTokenizer(Tokenizer):
    """A tiktoken BPE from a local ranks file; bos/eos and reserved specials follow the base vocab."""

    def __init__(self, path: str):
        import tiktoken

        ranks = load_bpe_ranks(path)
        n_base = len(ranks)
        specials = ["<|begin_of_text|>", "<|end_of_text|>"] + [
            f"<|reserved_special_token_{i}|>" for i in range(TIKTOKEN_N_SPECIAL - 2)]
        self.model = tiktoken.Encoding(
            name=Path(path).stem, pat_str=TIKTOKEN_PATTERN, mergeable_ranks=ranks,
            special_tokens={token: n_base + i for i, token in enumerate(specials)})
        self.path, self.specials = path, specials
        self.n_base = n_base
        self.bos_id = n_base
        self.eos_id = n_base + 1
        self.n_words = n_base + TIKTOKEN_N_SPECIAL

    def _encode_text(self, text: str) -> list[int]:
        # Special-token text inside documents is encoded as plain text, never as a control token.
        return self.model.encode_ordinary(text)

    def decode(self, ids: list[int]) -> str:
        return self.model.decode([i for i in ids if i < self.n_base])

    def hf_backend(self):
        """transformers' TikTokenConverter on the same ranks file, pattern and specials (Llama 3's tokenizer.json
        was made this way)."""
        from transformers.convert_slow_tokenizer import TikTokenConverter

        class LocalRanks(TikTokenConverter):
            def load_tiktoken_bpe(self, path: str) -> dict[bytes, int]:
                return load_bpe_ranks(path)  # tiktoken's own loader caches by path, keyed in a shared folder

        converter = LocalRanks(vocab_file=self.path, pattern=TIKTOKEN_PATTERN, extra_special_tokens=self.specials)
        return converter.converted()


class SentencePieceTokenizer(Tokenizer):
    """A local sentencepiece `.model` file."""

    def __init__(self, path: str):
        import sentencepiece

        self.model = sentencepiece.SentencePieceProcessor(model_file=path)
        self.path = path
        self.n_words = self.model.vocab_size()
        # sentencepiece reports a disabled special token as -1.
        self.bos_id = self.model.bos_id() if self.model.bos_id() >= 0 else None
        self.eos_id = self.model.eos_id() if self.model.eos_id() >= 0 else None

    def _encode_text(self, text: str) -> list[int]:
        return self.model.encode(text, out_type=int)

    def decode(self, ids: list[int]) -> str:
        return self.model.decode(list(ids))

    def hf_backend(self):
        """The model's pieces as a `tokenizers` BPE (merges from the piece scores, transformers' generate_merges) or
        Unigram, behind sentencepiece's own normalization: its charsmap, extra whitespace removal, the dummy
        prefix and spaces as "\u2581". Pieces that sentencepiece never reads from text (control, unknown, byte and
        unused ones: "<s>", "<0x41>" written in a document) get no merges (BPE), or a score below any spelling of
        them in single characters (Unigram; `hf_form_problem` names a model that lacks one of those)."""
        from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers
        from transformers.convert_slow_tokenizer import generate_merges

        proto = sentencepiece_proto(self.path)
        trainer, normalizer = proto.trainer_spec, proto.normalizer_spec
        pieces = [(piece.piece, piece.score) for piece in proto.pieces]
        not_from_text = {piece.piece for piece in proto.pieces if piece.type not in (SP_NORMAL, SP_USER_DEFINED)}
        if trainer.model_type == SP_MODEL_TYPES["unigram"]:
            floor = min(score for piece, score in pieces if piece not in not_from_text) - 1e6
            model = models.Unigram([(piece, floor if piece in not_from_text else score) for piece, score in pieces],
                                   unk_id=trainer.unk_id, byte_fallback=trainer.byte_fallback)
        else:
            vocab = {piece: i for i, (piece, _) in enumerate(pieces)}
            model = models.BPE(vocab, generate_merges(vocab, pieces, skip_tokens=not_from_text),
                               unk_token=trainer.unk_piece, fuse_unk=True, byte_fallback=trainer.byte_fallback)
        backend = Tokenizer(model)
        steps = [normalizers.Precompiled(normalizer.precompiled_charsmap)] if normalizer.precompiled_charsmap else []
        if normalizer.remove_extra_whitespaces:
            steps += [normalizers.Replace(Regex("^ +| +$"), ""), normalizers.Replace(Regex(" {2,}"), " ")]
        if normalizer.add_dummy_prefix:
            steps.append(normalizers.Prepend("\u2581"))
        backend.normalizer = normalizers.Sequence(steps + [normalizers.Replace(" ", "\u2581")])
        backend.decoder = decoders.Sequence(
            [decoders.Replace("\u2581", " ")] + ([decoders.ByteFallback()] if trainer.byte_fallback else [])
            + [decoders.Fuse()] + ([decoders.Strip(" ", 1, 0)] if normalizer.add_dummy_prefix else []))
        # Control pieces (bos, eos) are special; user-defined ones are matched in text, as sentencepiece does.
        backend.add_tokens([AddedToken(piece.piece, normalized=False, special=piece.type == SP_CONTROL)
                            for piece in proto.pieces if piece.type in (SP_CONTROL, SP_USER_DEFINED)])
        return backend


SP_MODEL_TYPES = {"unigram": 1, "bpe": 2, "word": 3, "char": 4}  # sentencepiece's TrainerSpec.ModelType
SP_NORMAL, SP_CONTROL, SP_USER_DEFINED = 1, 3, 4  # sentencepiece's ModelProto.SentencePiece.Type


def sentencepiece_proto(path: str):
    """The ModelProto of a sentencepiece `.model` file (its pieces, trainer and normalizer settings)."""
    from sentencepiece import sentencepiece_model_pb2

    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(Path(path).read_bytes())
    return proto


def hf_form_problem(args: TokenizerArgs) -> Optional[str]:
    """Why the tokenizer of `args` has no Hugging Face form that encodes as it does (lm-eval reads that form), or
    None; reads the sentencepiece model's settings only, so a config check can call it."""
    args.validate()
    if args.name != "sp":
        return None
    proto = sentencepiece_proto(args.path)
    model_type = next((name for name, number in SP_MODEL_TYPES.items() if number == proto.trainer_spec.model_type),
                      proto.trainer_spec.model_type)
    if model_type not in ("unigram", "bpe"):
        return f"the sentencepiece model {args.path} is a {model_type!r} model (only bpe and unigram models convert)"
    if proto.trainer_spec.treat_whitespace_as_suffix:
        return (f"the sentencepiece model {args.path} was trained with treat_whitespace_as_suffix, which its "
                f"Hugging Face form cannot follow")
    if model_type == "unigram":  # a Unigram path may take any piece: those never read from text need a spelling
        singles = {piece.piece for piece in proto.pieces if piece.type == SP_NORMAL and len(piece.piece) == 1}
        for piece in proto.pieces:
            missing = [char for char in piece.piece if char not in singles]
            if piece.type not in (SP_NORMAL, SP_USER_DEFINED) and missing:
                return (f"the sentencepiece unigram model {args.path} has no piece for {missing[0]!r}, so its Hugging "
                        f"Face form would read {piece.piece!r} written in a document as that special piece")
    return None


class HFTokenizer(Tokenizer):
    """`AutoTokenizer` from a local directory; `tokenizer` is the underlying transformers object."""

    def __init__(self, path: str):
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        # len() counts added tokens too, which the model must be able to embed.
        self.n_words = len(self.tokenizer)
        self.bos_id = self.tokenizer.bos_token_id
        self.eos_id = self.tokenizer.eos_token_id

    def _encode_text(self, text: str) -> list[int]:
        if self.tokenizer is None:  # unpickled in a data producer: the Rust backend alone
            return self.backend.encode(text, add_special_tokens=False).ids
        if getattr(self.tokenizer, "is_fast", False):
            return self.tokenizer.backend_tokenizer.encode(text, add_special_tokens=False).ids
        return self.tokenizer.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            return self.backend.decode(list(ids), skip_special_tokens=True)
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def hf_backend(self):
        """The fast tokenizer's own Rust backend (a slow one has none: export saves the directory as it is)."""
        if self.tokenizer is None:
            return self.backend
        return self.tokenizer.backend_tokenizer if getattr(self.tokenizer, "is_fast", False) else None

    def __getstate__(self) -> dict:
        # A fast tokenizer travels to a data producer process as its Rust backend: unpickling it there imports
        # neither transformers nor torch (seconds of start-up per rank).
        if not getattr(self.tokenizer, "is_fast", False):
            return self.__dict__
        return {**self.__dict__, "tokenizer": None, "backend": self.tokenizer.backend_tokenizer}


def model_vocab_size(tokenizer: Tokenizer, vocab_size: int) -> int:
    """The model's vocabulary size: the tokenizer's, which a model.vocab_size set in the config must equal."""
    if vocab_size not in (-1, tokenizer.n_words):
        raise ConfigError(f"model.vocab_size={vocab_size} but the tokenizer has {tokenizer.n_words} "
                          f"tokens; leave model.vocab_size=-1 to take it from the tokenizer.")
    return tokenizer.n_words


def build_tokenizer(args: TokenizerArgs) -> Tokenizer:
    """The tokenizer named by `args` (checked by `args.validate()` first)."""
    args.validate()
    if args.name == "bytes":
        return ByteTokenizer()
    tokenizer = {"tiktoken": TikTokenTokenizer, "sp": SentencePieceTokenizer, "hf": HFTokenizer}[args.name](args.path)
    logger.info(f"tokenizer {args.name} from {args.path}: {tokenizer.n_words} words, "
                f"bos={tokenizer.bos_id}, eos={tokenizer.eos_id}")
    return tokenizer
