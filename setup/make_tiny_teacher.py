"""A tiny random Hugging Face teacher (byte-level BPE tokenizer + LlamaForCausalLM), built offline in seconds.

    python -m setup.make_tiny_teacher --out data/teachers/tiny --vocab-size 512

For CPU tests and the CPU distillation debug config: it has the same on-disk shape as the real
teacher (config.json, model.safetensors, tokenizer files), so the same loading code serves both.
"""

import argparse
import logging
from pathlib import Path
from typing import Optional

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from lingua.cli.entry import run_cli
from lingua.errors import ConfigError
from setup.atomic_dir import atomic_output_dir

logger = logging.getLogger(__name__)

PAD_TOKEN, BOS_TOKEN, EOS_TOKEN = "<pad>", "<s>", "</s>"
# Byte-level BPE needs every byte in its vocab plus our three special tokens.
MIN_VOCAB_SIZE = 256 + 3

DEFAULT_CORPUS = """\
The quick brown fox jumps over the lazy dog. A teacher model reads the same tokens as its students
and returns, for every position, a probability for each word that could come next. The students
learn from the data and from the teacher at the same time: the data says which word did come next,
the teacher says which words were likely. Knowledge distillation trades a little compute on the
teacher side for a better student at the same size. Training runs for many steps; each step reads a
batch of documents, packs them into windows of tokens, computes a loss and updates the weights.
Checkpoints are saved so that a run can stop and resume where it left off, and the loss curve should
continue as if nothing had happened. The capital of France is Paris. The capital of Italy is Rome.
Numbers such as 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 42, 100 and 2024 appear in text too, as do
punctuation marks (commas, periods; colons: and "quotes") and code like `def f(x): return x + 1`.
"""


def build_tiny_tokenizer(vocab_size: int, corpus_text: Optional[str] = None) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE of exactly `vocab_size` tokens on `corpus_text` (a built-in paragraph if None)."""
    if vocab_size < MIN_VOCAB_SIZE:
        raise ConfigError(
            f"vocab_size={vocab_size} is too small for a byte-level tokenizer; use at least {MIN_VOCAB_SIZE}."
        )
    text = corpus_text if corpus_text is not None else DEFAULT_CORPUS
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[PAD_TOKEN, BOS_TOKEN, EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(text.splitlines(keepends=True), trainer=trainer)
    # A short corpus runs out of merges before vocab_size; filler tokens make the size exact
    # (tests rely on it to build teachers whose vocab differs from a student's).
    n_filler = vocab_size - tokenizer.get_vocab_size()
    tokenizer.add_tokens([f"<unused_{i}>" for i in range(n_filler)])
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token=BOS_TOKEN, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN
    )
    assert len(wrapped) == vocab_size, (len(wrapped), vocab_size)
    return wrapped


def make_tiny_teacher(
    out_dir,
    vocab_size: int = 512,
    hidden_size: int = 64,
    n_layers: int = 2,
    seed: int = 0,
    corpus_text: Optional[str] = None,
    tie_embeddings: bool = False,
    max_shard_size: Optional[str] = None,
    attention_bias: bool = False,
) -> Path:
    """Write a seeded random LlamaForCausalLM and its tokenizer (vocab `vocab_size`) to `out_dir`; return it.
    `tie_embeddings`: the output head shares the embedding (as SmolLM2's does); `max_shard_size` (e.g. "40KB"):
    the weights in several safetensors files and an index, as big checkpoints are saved; `attention_bias`: q, k, v
    and o projections with biases (as Qwen2's q, k, v have)."""
    if hidden_size % 8 != 0:
        raise ConfigError(f"hidden_size={hidden_size} must be a multiple of 8 (4 heads, each of an even size for RoPE).")
    tokenizer = build_tiny_tokenizer(vocab_size, corpus_text)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=4 * hidden_size,
        num_hidden_layers=n_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=tie_embeddings,
        attention_bias=attention_bias,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float32)
    with atomic_output_dir(Path(out_dir)) as tmp_dir:
        model.save_pretrained(tmp_dir, **({'max_shard_size': max_shard_size} if max_shard_size else {}))
        tokenizer.save_pretrained(tmp_dir)
    logger.info(
        "tiny teacher (vocab %d, dim %d, %d layers, %d params) written to %s",
        vocab_size, hidden_size, n_layers, sum(p.numel() for p in model.parameters()), out_dir,
    )
    return Path(out_dir)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="data/teachers/tiny", help="output directory")
    parser.add_argument("--vocab-size", type=int, default=512)
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--n-layers", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--corpus", default=None, help="text file to train the tokenizer on (default: built-in)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    corpus_text = Path(args.corpus).read_text(encoding="utf-8") if args.corpus else None
    out = make_tiny_teacher(args.out, args.vocab_size, args.hidden_size, args.n_layers, args.seed, corpus_text)
    print(out)


if __name__ == "__main__":
    run_cli(main)
