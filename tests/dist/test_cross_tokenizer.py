"""Cross-tokenizer distillation online: 2 byte-tokenizer students + 1 tiny teacher with its own BPE tokenizer."""

import math

import pytest

from lingua.run.dump_dir import read_metrics, train_rows
from tests.runs import assert_ok, distill_overrides, torchrun

pytestmark = pytest.mark.slow  # launches torchrun


@pytest.mark.timeout(150)
def test_a_byte_student_learns_from_a_bpe_teacher(corpus, tiny_teacher, tmp_path):
    """The handshake accepts the other tokenizer, the teacher aligns (with document ids: doc_causal), and every
    logged step has a share of aligned positions in (0, 1] and finite losses. The students' held-out CE runs; the
    teacher's reference is in bits per byte only (it scores the same text in its own tokens)."""
    dump = tmp_path / "run"
    result = torchrun(3, distill_overrides(corpus, tiny_teacher, dump, steps=4, **{
        "data.tokenizer.name": "bytes", "data.tokenizer.path": "null", "distillation.cross_tokenizer": "true",
        "model.attn_mask": "doc_causal", "heldout.every": 2}), timeout=120)
    assert_ok(result)
    assert "cross-tokenizer: 258 of the teacher's 512 ids are student tokens" in result.stdout
    assert "tokens of its own" in result.stdout
    rows = train_rows(dump)
    assert sorted(rows) == [1, 2, 3, 4]
    for row in rows.values():
        assert 0.0 < row["kd/aligned"] <= 1.0, row
        assert all(math.isfinite(row[key]) and row[key] >= 0 for key in ("loss/ce", "loss/kd", "loss/total")), row
        assert 0.0 < row["kd/teacher_mass"] <= row["kd/aligned"] + 1e-6, row  # mass is counted where aligned only
    evals = [row for row in read_metrics(dump) if "eval/loss" in row]
    assert [row["step"] for row in evals] == [2, 4] and all(math.isfinite(row["eval/bpb"]) for row in evals)
    # Bits per byte compare across the two tokenizers; the teacher's CE per token (over its own tokens) does not.
    assert math.isfinite(evals[0]["eval/teacher_bpb"]) and evals[0]["eval/teacher_bpb"] > 0
    assert not any("eval/teacher_loss" in row for row in evals) and "eval/teacher_bpb" not in evals[1]


@pytest.mark.timeout(240)
def test_a_byte_student_trains_from_a_cache_of_a_bpe_teacher(corpus, tiny_teacher, tmp_path):
    """The cache road: 2 writer ranks align and store the student-side targets; 2 students train from them,
    every logged step with a share of aligned positions in (0, 1] and finite losses."""
    cross = {"data.tokenizer.name": "bytes", "data.tokenizer.path": "null", "distillation.cross_tokenizer": "true",
             "model.attn_mask": "doc_causal"}
    cache_dir = tmp_path / "cache"
    written = torchrun(2, [*distill_overrides(corpus, tiny_teacher, tmp_path / "writer", steps=4, **cross),
                           f"cache_dir={cache_dir}", "streams=2", "shard_sequences=4", "encode_workers=0"],
                       timeout=100, module="apps.main.teacher_cache")
    assert_ok(written)
    assert "cross-tokenizer: 258 of the teacher's 512 ids are student tokens" in written.stdout
    assert "teacher cache complete" in written.stdout
    dump = tmp_path / "run"
    result = torchrun(2, distill_overrides(corpus, tiny_teacher, dump, steps=4, **cross, **{
        "distillation.source": "cache", "distillation.cache_dir": str(cache_dir)}), timeout=100)
    assert_ok(result)
    rows = train_rows(dump)
    assert sorted(rows) == [1, 2, 3, 4]
    for row in rows.values():
        assert 0.0 < row["kd/aligned"] <= 1.0, row
        assert all(math.isfinite(row[key]) and row[key] >= 0 for key in ("loss/ce", "loss/kd", "loss/total")), row
