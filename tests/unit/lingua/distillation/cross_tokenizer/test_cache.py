"""The cache road of cross-tokenizer distillation in one process: the kd_weight bit in the shard codec, the
manifest's fingerprints, a cache written for a byte-tokenizer student of a BPE teacher holding what the online
teacher would send, the refusals, and the same-tokenizer cache unchanged (shard bytes, manifest fields)."""

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from apps.main.teacher_cache import TeacherCacheArgs
from lingua.distillation.cache.write_job import write_cache
from lingua.args import parse_args
from lingua.distillation.args import DistillationArgs
from lingua.distillation.cache.store import (
    CacheManifest,
    canonical_safetensors,
    read_shard,
    settings_manifest,
    shard_bytes,
    shard_metadata,
    shard_path,
)
from lingua.distillation.cache.reader import open_cache
from lingua.distillation.cache.codec import OLD_ZSTD_LEVEL, CodecError, canonical_sampled, decode_shard, encode_shard
from lingua.distillation.cross_tokenizer.targets import sample_student_ids, student_sampled_targets
from lingua.distillation.cross_tokenizer.teacher_side import load_cross_tokenizer
from lingua.distillation.cache.distiller import CacheDistiller
from lingua.distillation.teacher.model import TeacherModel
from lingua.errors import DataError
from lingua.tokenizer import TokenizerArgs, build_tokenizer
from tests.runs import distill_overrides
from tests.unit.lingua.distillation.cache.test_codec import FIXTURES, assert_bit_equal, outputs_of, windows
from tests.unit.lingua.distillation.cache.test_writer import one_rank
from tests.unit.lingua.distillation.cross_tokenizer.test_targets import random_map

# The manifest keys of a same-tokenizer cache, as every cache before the cross-tokenizer road wrote them.
SAME_TOKENIZER_KEYS = ["teacher_path", "tokenizer_fingerprint", "vocab_size", "output", "k", "temperature",
                       "wire_dtype", "attn_mask", "data", "streams", "sequences_per_stream", "shard_sequences",
                       "teacher_heldout_ce", "teacher_heldout_bpb", "version", "zstd_level",
                       "source_names"]  # the last: the sources a shard's source_ids index (several teachers)
CROSS = {"data.tokenizer.name": "bytes", "data.tokenizer.path": "null", "distillation.cross_tokenizer": "true",
         "model.attn_mask": "doc_causal"}


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 4), seq=st.integers(1, 40), seed=st.integers(0, 1000), share=st.floats(0.0, 1.0))
def test_the_kd_weight_bit_round_trips(rows, seq, seed, share):
    outputs = outputs_of("topk", rows=rows, seq=seq, seed=seed)
    generator = torch.Generator().manual_seed(seed)
    outputs.kd_weight = (torch.rand(rows, seq, generator=generator) < share).float()
    tokens, doc_ids = windows(rows, seq, seed=seed)
    streams, specs = encode_shard(tokens, doc_ids, outputs, vocab_size=300)
    assert "kd_weight" in specs and streams["kd_weight"].numel() <= 100 + rows * seq // 8
    assert_bit_equal(decode_shard(streams, specs)["teacher"], outputs)


@pytest.mark.parametrize("seed", [0, 1])
def test_mapped_sampled_targets_round_trip(seed):
    """Cross-tokenizer sampled targets (student ids, -1 for unmapped draws with -inf values, unaligned rows all -1)
    decode to their canonical order, bit for bit, with the kd_weight bits."""
    generator = torch.Generator().manual_seed(seed)
    vocab_map = random_map(400, 300, generator)
    drawn = sample_student_ids(torch.randn(1, 40, 400, generator=generator) * 3, 8, 1.0, vocab_map,
                               torch.float32, generator)
    source = torch.where(torch.rand(3, 16, generator=generator) < 0.3, -1, torch.randint(0, 40, (3, 16)))
    outputs, kd_weight = student_sampled_targets(drawn, source, torch.bfloat16)
    outputs.kd_weight = kd_weight
    assert (outputs.ids[kd_weight.bool()] == -1).any() and (kd_weight == 0).any()
    streams, specs = encode_shard(*windows(), outputs, vocab_size=300)
    decoded = decode_shard(streams, specs)["teacher"]
    want = canonical_sampled(outputs)
    want.kd_weight = kd_weight
    assert_bit_equal(decoded, want)


def test_a_kd_weight_that_is_not_a_mask_is_refused_at_write_time():
    outputs = outputs_of("topk")
    outputs.kd_weight = torch.full(outputs.extra.shape, 0.5)
    with pytest.raises(CodecError, match="a kd_weight other than 0 or 1"):
        encode_shard(*windows(), outputs, vocab_size=300)


@pytest.mark.parametrize("format", ["topk", "sampled"])
def test_a_same_tokenizer_shard_keeps_its_bytes(format):
    """The fixture shards were written before the cross-tokenizer road (metadata keys sorted since), at the zstd
    level of their time: re-coded today at that level, the same bytes, and no kd_weight stream."""
    path = FIXTURES / f"{format}64.safetensors"
    manifest = CacheManifest(teacher_path="smollm2", tokenizer_fingerprint=0, vocab_size=49152, output=format, k=64,
                             temperature=1.0, wire_dtype="bf16", attn_mask="doc_causal", data={"seq_len": 128},
                             streams=1, sequences_per_stream=32, shard_sequences=32, zstd_level=OLD_ZSTD_LEVEL)
    batch = read_shard(path, range(0, 32), manifest)
    assert batch["teacher"].kd_weight is None
    metadata = {key: value for key, value in shard_metadata(path).items() if key != "codec"}
    tokens = torch.cat([batch["input_ids"], batch["labels"][:, -1:]], dim=1)
    assert shard_bytes(tokens, batch["doc_ids"], batch["teacher"], manifest, metadata) == \
        canonical_safetensors(path.read_bytes())


def test_a_same_tokenizer_manifest_keeps_its_fields(tmp_path):
    manifest = settings_manifest(DistillationArgs(teacher_path="t"), parse_args(TeacherCacheArgs, []).data, "causal",
                                 build_tokenizer(TokenizerArgs("bytes")), streams=2)
    manifest.write(tmp_path)
    assert list(json.loads((tmp_path / "cache.json").read_text())) == SAME_TOKENIZER_KEYS
    assert CacheManifest.read(tmp_path) == manifest


def test_a_cache_keeps_its_zstd_level(tmp_path, corpus, tiny_teacher):
    """A manifest written before the level was recorded reads as level 19 (what it was written at), and a writer
    resuming a cache finishes it at the cache's level whatever zstd_level says now: one level per cache."""
    from lingua.distillation.cache.write_job import settle_manifest

    manifest = settings_manifest(DistillationArgs(teacher_path="t"), parse_args(TeacherCacheArgs, []).data, "causal",
                                 build_tokenizer(TokenizerArgs("bytes")), streams=2)
    assert manifest.zstd_level == parse_args(TeacherCacheArgs, []).zstd_level == 1
    manifest.write(tmp_path)
    values = json.loads((tmp_path / "cache.json").read_text())
    del values["zstd_level"]
    (tmp_path / "cache.json").write_text(json.dumps(values))
    assert CacheManifest.read(tmp_path).zstd_level == OLD_ZSTD_LEVEL == 19
    settle_manifest(tmp_path, manifest)
    assert manifest.zstd_level == 19
    for level in (0, 23):
        with pytest.raises(ValueError, match=f"zstd_level={level}; use a zstd level from 1"):
            parse_args(TeacherCacheArgs, [*distill_overrides(corpus, tiny_teacher, tmp_path / "dump"),
                                          f"cache_dir={tmp_path}", f"zstd_level={level}"]).validate()


@pytest.fixture(scope="module")
def cross_cache(corpus, tiny_teacher, tmp_path_factory, train_group) -> tuple[Path, TeacherCacheArgs]:
    """A byte-tokenizer student's cache from the tiny BPE teacher: 1 rank, 2 streams of 3 shards of 4 windows,
    forwards of 3 windows, the serial writer (no processes)."""
    cache_dir = tmp_path_factory.mktemp("cross") / "cache"
    overrides = [*distill_overrides(corpus, tiny_teacher, cache_dir / "dump", steps=3, grad_acc_steps=2, **CROSS),
                 f"cache_dir={cache_dir}", "streams=2", "shard_sequences=4", "forward_rows=3", "encode_workers=0",
                 "heldout.every=2"]
    args = parse_args(TeacherCacheArgs, overrides)
    write_cache(args, one_rank())
    return cache_dir, args


def test_the_cache_holds_what_the_online_teacher_sends(cross_cache):
    """Every shard's student-side targets equal, bit for bit, what an online teacher rank computes for the same
    windows (CrossTokenizerTeacher, the teacher's forward, top-k in fp32, mapped to the student's ids)."""
    cache_dir, args = cross_cache
    manifest = CacheManifest.read(cache_dir)
    cross = load_cross_tokenizer(args.data.tokenizer, None, TeacherModel(args.distillation, torch.device("cpu"))
                                 .tokenizer, None)
    assert manifest.cross_tokenizer and manifest.vocab_size == 258 and manifest.teacher_heldout_ce is None
    assert manifest.teacher_tokenizer_fingerprint == cross.teacher_fingerprint
    assert manifest.vocab_map_fingerprint == cross.vocab_map.fingerprint()
    assert set(CacheManifest.__dataclass_fields__) == set(json.loads((cache_dir / "cache.json").read_text()))
    teacher = TeacherModel(args.distillation, torch.device("cpu"))
    aligned_shares, last_aligned = [], False
    for index in range(manifest.n_shards):
        batch = read_shard(shard_path(cache_dir, index), range(0, 4), manifest)
        cached = batch["teacher"]
        for start in (0, 3):  # the writer's forwards of forward_rows=3 windows
            rows = slice(start, start + 3)
            aligned = cross.teacher_batch(batch["input_ids"][rows], batch["doc_ids"][rows], batch["labels"][rows, -1])
            hidden = teacher.hidden_states(aligned.tokens, aligned.doc_ids)
            topk = teacher.sparse_outputs(hidden, "topk", manifest.k, torch.float32, teacher.vocab_size, None)
            online, kd_weight = cross.student_outputs(topk, aligned, torch.bfloat16)
            online.kd_weight = kd_weight
            assert_bit_equal(replace(cached, **{name: getattr(cached, name)[rows] for name in
                                                ("values", "ids", "extra", "kd_weight")}), online)
        aligned_shares.append(cached.kd_weight.mean().item())
        last_aligned = last_aligned or bool(cached.kd_weight[:, -1].any())
    assert all(0.0 < share <= 1.0 for share in aligned_shares) and min(aligned_shares) < 1.0
    assert last_aligned  # the writer read the label past each window: some windows' last position has a target


def test_a_sampled_cache_holds_the_online_draws_and_trains(corpus, tiny_teacher, tmp_path):
    """output=sampled: each shard holds, in the codec's canonical order, what an online teacher rank draws for the
    same windows with the writer's generator (student ids, -1 for unmapped draws), and a student trains on it."""
    cache_dir = tmp_path / "cache"
    overrides = [*distill_overrides(corpus, tiny_teacher, tmp_path / "dump", steps=3, grad_acc_steps=2, **CROSS),
                 f"cache_dir={cache_dir}", "streams=1", "shard_sequences=4", "forward_rows=2", "encode_workers=0",
                 "distillation.output=sampled", "distillation.k=8"]
    args = parse_args(TeacherCacheArgs, overrides)
    write_cache(args, one_rank())
    manifest = CacheManifest.read(cache_dir)
    assert manifest.cross_tokenizer and manifest.output == "sampled"
    teacher = TeacherModel(args.distillation, torch.device("cpu"))
    cross = load_cross_tokenizer(args.data.tokenizer, None, teacher.tokenizer, None)
    for index in range(manifest.n_shards):
        batch = read_shard(shard_path(cache_dir, index), range(0, 4), manifest)
        generator = torch.Generator().manual_seed(args.distillation.seed * 1_000_003 + index)  # the writer's
        parts = []
        for rows in (slice(0, 2), slice(2, 4)):  # the writer's forwards of forward_rows=2 windows
            aligned = cross.teacher_batch(batch["input_ids"][rows], batch["doc_ids"][rows], batch["labels"][rows, -1])
            hidden = teacher.hidden_states(aligned.tokens, aligned.doc_ids)
            parts.append(cross.student_targets(teacher, hidden, aligned, "sampled", 8, torch.bfloat16, generator))
        online = canonical_sampled(replace(parts[0], **{name: torch.cat([getattr(p, name) for p in parts]) for name
                                                        in ("values", "ids", "extra")}))
        online.kd_weight = torch.cat([p.kd_weight for p in parts])
        assert_bit_equal(batch["teacher"], online)
        aligned_ids = batch["teacher"].ids[batch["teacher"].kd_weight.bool()]
        assert ((aligned_ids >= -1) & (aligned_ids < 258)).all() and (aligned_ids >= 0).any()
    train = replace(args.distillation, source="cache", cache_dir=str(cache_dir))
    wanted = settings_manifest(train, args.data, args.model.attn_mask, build_tokenizer(args.data.tokenizer))
    loader = open_cache(str(cache_dir), wanted, batch_size=2, dp_rank=0, dp_degree=1)
    batch = next(loader)
    distiller = CacheDistiller(train)
    distiller.begin_step(0, 1.0)
    hidden = torch.randn(*batch["input_ids"].shape, 16, requires_grad=True)
    loss = distiller.head_loss(batch["labels"], distiller.submit(batch, 0, 0), batch["labels"].numel(), None)(
        hidden, torch.randn(258, 16))
    loss.backward()
    assert torch.isfinite(loss) and hidden.grad.isfinite().all() and hidden.grad.abs().sum() > 0
    assert distiller.step_metrics()["kd/aligned"].item() == pytest.approx(batch["teachers"][0].kd_weight.mean().item())


def test_training_reads_the_kd_weight_and_logs_kd_aligned(cross_cache):
    cache_dir, args = cross_cache
    train = replace(args.distillation, source="cache", cache_dir=str(cache_dir))
    wanted = settings_manifest(train, args.data, args.model.attn_mask, build_tokenizer(args.data.tokenizer))
    loader = open_cache(str(cache_dir), wanted, batch_size=2, dp_rank=0, dp_degree=2)
    batch = next(loader)
    assert batch["teachers"][0].kd_weight.shape == batch["input_ids"].shape
    distiller = CacheDistiller(train)
    distiller.begin_step(0, 1.0)
    generator = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(*batch["input_ids"].shape, 16, generator=generator), torch.randn(258, 16)
    loss = distiller.head_loss(batch["labels"], distiller.submit(batch, 0, 0),
                               batch["labels"].numel(), None)(hidden, weight)
    metrics = distiller.step_metrics()
    assert torch.isfinite(loss) and metrics["kd/aligned"].item() == pytest.approx(
        batch["teachers"][0].kd_weight.mean().item())


def test_a_cache_for_another_student_tokenizer_or_without_cross_tokenizer_is_one_sentence(cross_cache, tiny_teacher):
    cache_dir, args = cross_cache
    manifest = CacheManifest.read(cache_dir)
    train = replace(args.distillation, source="cache", cache_dir=str(cache_dir))
    other = build_tokenizer(TokenizerArgs("hf", str(tiny_teacher)))
    wanted = settings_manifest(train, args.data, args.model.attn_mask, other)
    with pytest.raises(DataError) as caught:
        open_cache(str(cache_dir), wanted, 2, 0, 2)
    assert str(caught.value) == (
        f"The teacher cache in {cache_dir} was written with other settings: tokenizer_fingerprint is "
        f"{manifest.tokenizer_fingerprint} in the cache but {wanted.tokenizer_fingerprint} here (the students' "
        f"tokenizer, data.tokenizer: the targets are in its ids); vocab_size is 258 in the cache but 512 here. "
        f"Train with the cache's settings, or write a new cache for these: write it with `torchrun "
        f"--nproc-per-node N -m apps.main.teacher_cache config=<config> cache_dir=<new dir>`.")
    plain = settings_manifest(replace(train, cross_tokenizer=False), args.data, args.model.attn_mask,
                              build_tokenizer(args.data.tokenizer))
    with pytest.raises(DataError, match=r"cross_tokenizer is True in the cache but False here "
                                        r"\(distillation\.cross_tokenizer\)\. Train with"):
        open_cache(str(cache_dir), plain, 2, 0, 2)


def test_a_writer_rerun_with_another_teacher_tokenizer_is_one_sentence(cross_cache):
    """Finishing a cross-tokenizer cache with another teacher tokenizer (another vocabulary map) is refused."""
    from lingua.distillation.cache.write_job import settle_manifest

    cache_dir, _ = cross_cache
    planned = replace(CacheManifest.read(cache_dir), teacher_tokenizer_fingerprint=1, vocab_map_fingerprint="0" * 16)
    with pytest.raises(DataError) as caught:
        settle_manifest(cache_dir, planned)
    manifest = CacheManifest.read(cache_dir)
    assert (f"teacher_tokenizer_fingerprint is {manifest.teacher_tokenizer_fingerprint} in the cache but 1 here; "
            f"vocab_map_fingerprint is {manifest.vocab_map_fingerprint} in the cache but {'0' * 16} here. Use another "
            f"cache_dir") in str(caught.value)
