"""ULD on both roads in one process: the setting agreed at the handshake, an online teacher's reply carrying the
marked unmapped entries, the cache's codec and manifest carrying them, training from such a cache, the refusals."""

from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from apps.main.teacher_cache import TeacherCacheArgs
from lingua.distillation.cache.write_job import write_cache
from lingua.args import parse_args
from lingua.distillation.args import DistillationArgs
from lingua.distillation.online.bridge import BridgeSpec, check_handshake
from lingua.distillation.cache.reader import open_cache
from lingua.distillation.cache.store import CacheManifest, read_shard, settings_manifest, shard_path
from lingua.distillation.cache.codec import decode_shard, encode_shard
from lingua.distillation.cross_tokenizer.targets import map_topk_rows
from lingua.distillation.cross_tokenizer.teacher_side import load_cross_tokenizer
from lingua.distillation.cache.distiller import CacheDistiller
from lingua.distillation.outputs import TeacherOutputs
from lingua.distillation.online.server import TeacherServer
from lingua.distillation.teacher.model import TeacherModel
from lingua.errors import ConfigError, DataError
from lingua.tokenizer import TokenizerArgs, build_tokenizer
from tests.runs import distill_overrides
from tests.unit.lingua.distillation.cache.test_codec import assert_bit_equal, outputs_of, windows
from tests.unit.lingua.distillation.cache.test_writer import one_rank
from tests.unit.lingua.distillation.cross_tokenizer.test_cache import CROSS
from tests.unit.lingua.distillation.cross_tokenizer.test_online import CROSS as CROSS_ARGS
from tests.unit.lingua.distillation.cross_tokenizer.test_online import records
from tests.unit.lingua.distillation.loss.test_uld import _vocab_map

ULD = {**CROSS, "distillation.uld_weight": "0.5", "distillation.uld_k": "4"}


def test_uld_weight_is_an_agreed_setting():
    uld = replace(CROSS_ARGS, uld_weight=0.5)
    assert check_handshake(records(uld, uld), uld).kd_weight
    with pytest.raises(ConfigError, match=r"distillation\.uld_weight is 0\.5 on the teacher but 0\.0 on the student"):
        check_handshake(records(uld, CROSS_ARGS), uld)


@pytest.mark.parametrize("change,words", [
    (dict(uld_weight=0.5, cross_tokenizer=False), "distillation.uld_weight=0.5; ULD matches the mass a teacher of "
                                                  "another tokenizer cannot map; set distillation.cross_tokenizer=true"),
    (dict(uld_weight=-1.0), "distillation.uld_weight=-1.0; use a finite weight >= 0"),
    (dict(uld_weight=float("nan")), "distillation.uld_weight=nan; use a finite weight >= 0"),
    (dict(uld_weight=0.5, uld_k=0), "distillation.uld_k=0; use a positive number"),
    (dict(uld_weight=0.5, loss_compile=True), "distillation.loss_compile=true; ULD runs in the eager chunk math"),
])
def test_config_refusals(change, words):
    with pytest.raises(ConfigError) as caught:
        replace(CROSS_ARGS, **change).validate(enabled=False)
    assert words in str(caught.value) and "\n" not in str(caught.value)


def test_the_codec_round_trips_marked_entries():
    teacher = outputs_of("topk", rows=3, seq=16, vocab=300, k=8, wire=torch.float32)
    values, ids, rest = map_topk_rows(teacher.values.view(-1, 8), teacher.ids.view(-1, 8), teacher.extra.view(-1),
                                      _vocab_map(3, teacher_v=300, student_v=200), unmapped_entries=True)
    marked = TeacherOutputs("topk", values.to(torch.bfloat16).view(3, 16, 8), ids.view(3, 16, 8), rest.view(3, 16),
                            kd_weight=(torch.rand(3, 16, generator=torch.Generator().manual_seed(0)) < 0.7).float())
    assert (marked.ids < 0).any()
    streams, specs = encode_shard(*windows(vocab=200), marked, vocab_size=200)
    assert_bit_equal(decode_shard(streams, specs)["teacher"], marked)


def test_an_online_teacher_replies_with_the_marked_entries(corpus, tiny_teacher):
    """`TeacherServer._cross_forward_rows` with distillation.uld_weight > 0 writes what the vocabulary map gives with
    the unmapped entries into each student's reply; with 0, today's targets."""
    args = DistillationArgs(teacher_path=str(tiny_teacher), k=8, teacher_dtype="fp32", cross_tokenizer=True)
    teacher = TeacherModel(args, torch.device("cpu"))
    student = TokenizerArgs("bytes")
    cross = load_cross_tokenizer(student, None, teacher.tokenizer, None)
    texts = ["The teacher reads this text, in bytes: ", "Another window, with other words in it."]
    tokens = torch.tensor([build_tokenizer(student).encode(text, add_bos=True, add_eos=False)[:32] for text in texts])
    for uld_weight in (0.5, 0.0):
        spec = BridgeSpec(2, tokens.shape[1], 258, "topk", 8, torch.bfloat16, kd_weight=True)
        server = SimpleNamespace(cross=cross, teacher=teacher, spec=spec, args=replace(args, uld_weight=uld_weight),
                                 leader=True, link=None, generator=None, bridge_ranks=[0, 2], nan_flags={},
                                 responses=[torch.zeros(spec.response_bytes(), dtype=torch.uint8)])
        server._write = lambda rank, outputs: TeacherServer._write(server, rank, outputs)
        headers = {0: SimpleNamespace(bsz=2, seqlen=tokens.shape[1])}
        TeacherServer._cross_forward_rows(server, [(0, None)], headers, tokens, None)
        sent = TeacherOutputs.from_tensors("topk", spec.payload_views(server.responses[0]))
        batch = cross.teacher_batch(tokens)
        topk = teacher.sparse_outputs(teacher.hidden_states(batch.tokens, None), "topk", 8, torch.float32,
                                      teacher.vocab_size, None)
        expected, kd_weight = cross.student_outputs(topk, batch, torch.bfloat16, unmapped_entries=uld_weight > 0)
        expected.kd_weight = kd_weight
        assert_bit_equal(sent, expected)
        assert bool((sent.ids < 0).any()) == (uld_weight > 0)


@pytest.fixture(scope="module")
def uld_cache(corpus, tiny_teacher, tmp_path_factory, train_group) -> tuple[Path, TeacherCacheArgs]:
    """A byte-tokenizer student's ULD cache from the tiny BPE teacher (1 rank, 1 stream of 2 shards of 4 windows)."""
    cache_dir = tmp_path_factory.mktemp("uld") / "cache"
    overrides = [*distill_overrides(corpus, tiny_teacher, cache_dir / "dump", steps=2, grad_acc_steps=2, **ULD),
                 f"cache_dir={cache_dir}", "streams=1", "shard_sequences=4", "forward_rows=4", "encode_workers=0"]
    args = parse_args(TeacherCacheArgs, overrides)
    write_cache(args, one_rank())
    return cache_dir, args


def test_the_cache_carries_the_marked_entries_and_trains_with_uld(uld_cache):
    cache_dir, args = uld_cache
    manifest = CacheManifest.read(cache_dir)
    assert manifest.unmapped_entries and manifest.cross_tokenizer
    cached = read_shard(shard_path(cache_dir, 0), range(0, 4), manifest)["teacher"]
    assert (cached.ids < 0).any() and bool((cached.values[..., 1:] <= cached.values[..., :-1]).all())
    train = replace(args.distillation, source="cache", cache_dir=str(cache_dir))
    wanted = settings_manifest(train, args.data, args.model.attn_mask, build_tokenizer(args.data.tokenizer))
    batch = next(open_cache(str(cache_dir), wanted, batch_size=2, dp_rank=0, dp_degree=1))
    generator = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(*batch["input_ids"].shape, 16, generator=generator), torch.randn(258, 16)
    kd = {}
    for uld_weight, fused_loss in ((0.5, True), (0.5, False), (0.0, True)):
        distiller = CacheDistiller(replace(train, uld_weight=uld_weight, fused_loss=fused_loss))
        distiller.begin_step(0, 1.0)
        teacher = batch["teachers"][0]
        if uld_weight == 0:  # today's targets: the same windows without the marked entries
            ids = teacher.ids
            teacher = replace(teacher, values=torch.where(ids < 0, float("-inf"), teacher.values.float()).to(
                teacher.values.dtype), ids=torch.where(ids < 0, ~ids, ids))
        loss = distiller.head_loss(batch["labels"], distiller.submit({**batch, "teachers": [teacher]}, 0, 0),
                                   batch["labels"].numel(), None)(hidden, weight)
        kd[uld_weight, fused_loss] = distiller.step_metrics()["loss/kd"].item()
        assert torch.isfinite(loss)
    # The fused loss and the reference (distillation.fused_loss=false) agree; the ULD term adds to the same targets' KD.
    assert kd[0.5, True] == pytest.approx(kd[0.5, False], rel=1e-5)
    assert kd[0.5, True] > kd[0.0, True] + 1e-3 > 0


def test_a_cache_without_the_entries_or_uld_off_on_one_with_them_is_one_sentence(uld_cache, tmp_path):
    cache_dir, args = uld_cache
    train = replace(args.distillation, source="cache", cache_dir=str(cache_dir), uld_weight=0.0)
    wanted = settings_manifest(train, args.data, args.model.attn_mask, build_tokenizer(args.data.tokenizer))
    with pytest.raises(DataError, match=r"unmapped_entries is True in the cache but False here \(the teacher's "
                                        r"unmapped entries that ULD reads: distillation\.uld_weight > 0\)\. Train "):
        open_cache(str(cache_dir), wanted, 2, 0, 1)
    without = tmp_path / "without"
    without.mkdir()
    replace(CacheManifest.read(cache_dir), unmapped_entries=False).write(without)
    with pytest.raises(DataError, match=r"unmapped_entries is False in the cache but True here"):
        open_cache(str(without), replace(wanted, unmapped_entries=True), 2, 0, 1)
