"""Held-out CE in bits per byte: hand computations for the byte tokenizer and an HF byte-level BPE, special tokens
at 0 bytes, and the in-loop Evaluator's eval/bpb against a direct forward."""

import json
import math
from types import SimpleNamespace

import pytest
import torch

from apps.main.eval import EvalArgs, Evaluator
from lingua.evaluation.bits_per_byte import bits_per_byte, target_bytes, token_byte_lengths
from lingua.data import DataArgs
from lingua.distillation.args import DistillationArgs
from lingua.distillation.cache.store import MANIFEST, CacheManifest
from lingua.distillation.cache.distiller import CacheDistiller
from lingua.evaluation.heldout import iterate_eval_batches
from lingua.tokenizer import TokenizerArgs, build_tokenizer
from tests.unit.apps.main.test_export_hf import build, tiny_args

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
TEXT = "héllo wörld: naïve café, 日本語 🙂\n    return x  # ok"  # 1- to 4-byte characters


def hand_bits_per_byte(logits: torch.Tensor, targets: list[int], n_bytes: int) -> float:
    """-sum log2 p(target) / bytes, straight from the definition."""
    log2_probs = logits.double().log_softmax(-1) / math.log(2)
    return -sum(log2_probs[i, t].item() for i, t in enumerate(targets)) / n_bytes


def scored_ce_sum(logits: torch.Tensor, labels: torch.Tensor) -> float:
    return torch.nn.functional.cross_entropy(logits.double(), labels, ignore_index=-100, reduction="sum").item()


def test_byte_tokenizer_bpb_is_ce_over_ln2_per_byte_and_eos_counts_zero_bytes():
    tokenizer = build_tokenizer(TokenizerArgs("bytes"))
    lengths = token_byte_lengths(tokenizer)
    assert lengths.tolist() == [1] * 256 + [0, 0]  # bos (256) and eos (257) stand for no text
    ids = list(TEXT.encode("utf-8"))
    logits = torch.randn(len(ids) + 3, tokenizer.n_words, generator=torch.Generator().manual_seed(0))
    labels = torch.tensor(ids + [-100, -100, -100])  # a padded window's tail is not scored
    n_bytes = target_bytes(labels, lengths)
    assert n_bytes == len(TEXT.encode("utf-8"))
    bpb = bits_per_byte(scored_ce_sum(logits, labels), n_bytes)
    # One token per byte: bits per byte is the mean CE per token in bits.
    assert bpb == pytest.approx(scored_ce_sum(logits, labels) / len(ids) / math.log(2), rel=1e-12)
    assert bpb == pytest.approx(hand_bits_per_byte(logits, ids, len(ids)), rel=1e-12)
    # An EOS target adds its CE to the sum and no bytes.
    with_eos = torch.tensor(ids + [tokenizer.eos_id, -100, -100])
    assert target_bytes(with_eos, lengths) == n_bytes
    assert bits_per_byte(scored_ce_sum(logits, with_eos), n_bytes) == pytest.approx(
        hand_bits_per_byte(logits, ids + [tokenizer.eos_id], len(ids)), rel=1e-12)


def test_hf_byte_level_bpe_bpb_counts_the_bytes_of_the_text_and_specials_zero(tiny_teacher):
    tokenizer = build_tokenizer(TokenizerArgs("hf", str(tiny_teacher)))
    lengths = token_byte_lengths(tokenizer)
    hf = tokenizer.tokenizer
    specials = {hf.bos_token_id, hf.eos_token_id, hf.pad_token_id}
    assert len(specials) == 3 and all(lengths[i] == 0 for i in specials)
    ids = tokenizer.encode(TEXT, add_bos=True, add_eos=True)
    assert ids[0] == tokenizer.bos_id and ids[-1] == tokenizer.eos_id and len(ids) < len(TEXT.encode("utf-8"))
    labels = torch.tensor(ids)
    # Every token of the text is a target here (BOS too): their bytes are the text's, BOS and EOS add none.
    assert target_bytes(labels, lengths) == len(TEXT.encode("utf-8"))
    assert target_bytes(torch.tensor(sorted(specials) + [-100]), lengths) == 0
    logits = torch.randn(len(ids), tokenizer.n_words, generator=torch.Generator().manual_seed(1))
    bpb = bits_per_byte(scored_ce_sum(logits, labels), target_bytes(labels, lengths))
    assert bpb == pytest.approx(hand_bits_per_byte(logits, ids, len(TEXT.encode("utf-8"))), rel=1e-12)
    # Several bytes per token: fewer bits per byte than bits per token.
    assert bpb < scored_ce_sum(logits, labels) / len(ids) / math.log(2)


def test_bits_per_byte_of_nothing_scored_is_zero_like_the_mean_ce():
    assert bits_per_byte(0.0, 0) == 0.0


@torch.no_grad()
def test_in_loop_eval_logs_bpb_of_the_scored_targets(corpus):
    """The Evaluator's eval/bpb over a single rank's batches equals the CE of a plain forward in bits over the
    bytes of the labelled targets (EOS at 0 bytes); eval/loss is unchanged beside it."""
    data = DataArgs(root_dir=str(corpus), sources={"text": 1.0}, batch_size=8, seq_len=32, add_eos=True,
                    tokenizer=TokenizerArgs("bytes"))
    tokenizer = build_tokenizer(data.tokenizer)
    torch.manual_seed(0)
    model = build(tiny_args(max_seqlen=32))
    topo = SimpleNamespace(train_rank=0, train_world_size=1, train_group=None, device=torch.device("cpu"))
    evaluator = Evaluator(EvalArgs(every=1, max_batches=6), data, tokenizer, topo,
                          teacher=CacheDistiller(DistillationArgs(), heldout=[(2.5, 3.5)]))
    row = evaluator.run(model, step=1)

    ce_sum = tokens = n_bytes = 0
    for batch in iterate_eval_batches(data, tokenizer, 0, 1, max_batches=6):
        logits = model(batch["input_ids"])
        ce_sum += scored_ce_sum(logits.flatten(0, 1), batch["labels"].flatten())
        labels = batch["labels"][batch["labels"] != -100]
        tokens += labels.numel()
        n_bytes += int((labels < 256).sum())  # the bytes; EOS (257) is text's end, not text
    assert 0 < n_bytes < tokens  # EOS targets were scored
    assert row["eval/loss"] == pytest.approx(ce_sum / tokens, rel=1e-5)
    assert row["eval/bpb"] == pytest.approx(ce_sum / math.log(2) / n_bytes, rel=1e-5)
    assert (row["eval/teacher_loss"], row["eval/teacher_bpb"]) == (2.5, 3.5)
    again = evaluator.run(model, step=2)  # the teacher's reference is logged once
    assert "eval/teacher_bpb" not in again and again["eval/bpb"] == pytest.approx(row["eval/bpb"], rel=1e-12)


def test_a_cache_manifest_written_before_bpb_reads_without_the_teacher_bpb(tmp_path):
    manifest = CacheManifest(teacher_path="t", tokenizer_fingerprint=1, vocab_size=258, output="topk", k=4,
                             temperature=1.0, wire_dtype="bf16", attn_mask="causal", data={}, streams=1,
                             sequences_per_stream=4, shard_sequences=4, teacher_heldout_ce=3.0, teacher_heldout_bpb=4.0)
    manifest.write(tmp_path)
    assert CacheManifest.read(tmp_path).teacher_heldout_bpb == 4.0
    older = json.loads((tmp_path / MANIFEST).read_text())
    del older["teacher_heldout_bpb"]
    (tmp_path / MANIFEST).write_text(json.dumps(older))
    read = CacheManifest.read(tmp_path)
    assert (read.teacher_heldout_ce, read.teacher_heldout_bpb) == (3.0, None)  # eval/teacher_bpb is left out
    assert CacheDistiller(DistillationArgs(), heldout=[(read.teacher_heldout_ce, read.teacher_heldout_bpb)]
                          ).teacher_heldout_row() == {"eval/teacher_loss": 3.0}
