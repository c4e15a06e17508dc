"""Several teachers from their caches: each window's source id through writer, shard and reader (and old shards
without it), the checks that the caches describe the same windows, and the mixing of two caches' targets, which
must be the online mixture's (the same loss, gradients and kd/<i>/* metrics)."""

import contextlib
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from apps.main.train import TrainArgs
from lingua.distillation.args import TeacherArgs
from lingua.distillation.build import launch_teachers
from lingua.loading.stream import active_sources
from lingua.args import parse_args
from lingua.loading.producer import from_wire, to_wire
from lingua.distillation.cache.store import (INDEX, CacheManifest, read_shard, settings_manifest, shard_path,
                                       write_json_atomic, write_shard)
from lingua.distillation.cache.codec import decode_shard, encode_shard
from lingua.distillation.cache.distiller import CacheDistiller
from lingua.distillation.loss.mixture import source_routing
from lingua.distillation.online.distiller import OnlineDistiller
from lingua.distillation.outputs import sparsify_teacher_logits
from lingua.distillation.cache.reader import TeacherCaches, open_training_caches
from lingua.errors import ConfigError, DataError
from lingua.tokenizer import build_tokenizer

ROOT = Path(__file__).resolve().parents[5]
ROWS, SHARDS, SEQ = 4, 2, 12  # windows per shard, shards per cache, data.seq_len


def train_args(tmp_path, *overrides: str) -> TrainArgs:
    """The 2+1 CPU config on two stubbed sources and the byte tokenizer, plus `overrides`."""
    for source in ("pydocs", "code"):
        (tmp_path / "corpus" / source).mkdir(parents=True, exist_ok=True)
        (tmp_path / "corpus" / source / f"{source}.chunk.0.jsonl").write_text('{"text": "a"}\n')
    return parse_args(TrainArgs, [f"config={ROOT / 'configs/distill_exps/debug_cpu.yaml'}",
                                  f"data.root_dir={tmp_path / 'corpus'}", "data.tokenizer.name=bytes",
                                  "data.tokenizer.path=null", "distillation.teacher_path=null", f"data.seq_len={SEQ}",
                                  "model.max_seqlen=16", "data.sources={pydocs: 1.0, code: 1.0}", *overrides])


def cached_teachers(tmp_path, *elements: str) -> TrainArgs:
    args = train_args(tmp_path, "distillation.teachers=[" + ", ".join(elements) + "]")
    args.validate(world_size=2)
    return args


def window_rows(index: int, vocab: int) -> tuple:
    """Shard `index`'s windows, the same in every teacher's cache: tokens, doc_ids, source ids (0 pydocs, 1 code)."""
    generator = torch.Generator().manual_seed(index)
    tokens = torch.randint(0, vocab, (ROWS, SEQ + 1), generator=generator, dtype=torch.int32)
    doc_ids = torch.cumsum(torch.rand(ROWS, SEQ, generator=generator) < 0.2, dim=1).to(torch.int16)
    return tokens, doc_ids, torch.tensor([0, 1, 1, 0][:ROWS], dtype=torch.int32)


def write_cache(cache_dir: Path, args: TrainArgs, teacher: int, seed: int, sources: bool = True, **layout) -> None:
    """A finished cache of teacher `teacher` of `args` (random targets from `seed`), written by the writer's own
    functions; `sources=False` writes it as caches were written before source ids (manifest and shards)."""
    tokenizer = build_tokenizer(args.data.tokenizer)
    kd = args.distillation.teacher_args(teacher)
    layout = {"streams": 1, "sequences_per_stream": ROWS * SHARDS, "shard_sequences": ROWS, **layout}
    manifest = settings_manifest(kd, args.data, args.model.attn_mask, tokenizer, **layout)
    if not sources:
        manifest.source_names = None
    cache_dir.mkdir(parents=True)
    manifest.write(cache_dir)
    generator = torch.Generator().manual_seed(seed)
    for index in range(manifest.n_shards):
        tokens, doc_ids, source_ids = window_rows(index % SHARDS, tokenizer.n_words)
        logits = torch.randn(ROWS, SEQ, tokenizer.n_words, generator=generator) * 3
        outputs = sparsify_teacher_logits(logits, "topk", kd.k, 1.0, torch.bfloat16)
        write_shard(shard_path(cache_dir, index), tokens, doc_ids, outputs, manifest,
                    {"shard": index, "stream": 0, "chunk": index, "loader_state": {}}, source_ids if sources else None)
    write_json_atomic(cache_dir / INDEX, {"tokens": manifest.n_shards * ROWS * SEQ})


def open_caches(args: TrainArgs, batch_size: int = 3):
    tokenizer = build_tokenizer(args.data.tokenizer)
    return open_training_caches(args.distillation, args.data, args.model.attn_mask, tokenizer, batch_size, 0, 1)


def test_each_windows_source_id_round_trips_and_old_shards_read_without_it(tmp_path):
    from tests.unit.lingua.distillation.cache.test_codec import outputs_of, windows

    tokens, doc_ids = windows()
    outputs, source_ids = outputs_of("topk"), torch.tensor([2, 0, 1], dtype=torch.int32)
    with_ids, without = encode_shard(tokens, doc_ids, outputs, 300, source_ids=source_ids), \
        encode_shard(tokens, doc_ids, outputs, 300)
    assert torch.equal(decode_shard(*with_ids)["source_ids"], source_ids)
    assert "source_ids" not in decode_shard(*without)
    # The new field is the only difference: every other stream is the same bytes.
    assert set(with_ids[0]) - set(without[0]) == {"source_ids"}
    assert all(torch.equal(without[0][name], with_ids[0][name]) for name in without[0])
    # writer -> shard -> reader -> loader, and a cache written without them reads as before.
    args = cached_teachers(tmp_path, f"{{cache_dir: {tmp_path / 'a'}}}", f"{{cache_dir: {tmp_path / 'b'}}}")
    write_cache(tmp_path / "a", args, 0, seed=0)
    write_cache(tmp_path / "b", args, 1, seed=1, sources=False)
    new, old = (CacheManifest.read(tmp_path / name) for name in ("a", "b"))
    assert new.source_names == ["pydocs", "code"] and old.source_names is None
    assert read_shard(shard_path(tmp_path / "a", 1), range(1, 3), new)["source_ids"].tolist() == [1, 1]
    assert "source_ids" not in read_shard(shard_path(tmp_path / "b", 1), range(1, 3), old)
    loader = TeacherCaches([str(tmp_path / "a")], [new], batch_size=3, dp_rank=0, dp_degree=1)
    assert [next(loader)["source_ids"].tolist() for _ in range(3)] == [[0, 1, 1], [0, 0, 1], [1, 0, 0]]
    assert "source_ids" not in next(TeacherCaches([str(tmp_path / "b")], [old], batch_size=3, dp_rank=0, dp_degree=1))


def test_one_cache_is_a_list_of_one_and_each_cache_reads_its_own_stream(tmp_path):
    """The reader's rows are each shard's rows in order, across shard ends and into a second epoch; two caches read
    in step give each cache the batches it gives alone, and one position resumes both."""
    args = cached_teachers(tmp_path, f"{{cache_dir: {tmp_path / 'a'}}}", f"{{cache_dir: {tmp_path / 'b'}}}")
    write_cache(tmp_path / "a", args, 0, seed=0)
    write_cache(tmp_path / "b", args, 1, seed=1)
    dirs = [str(tmp_path / "a"), str(tmp_path / "b")]
    manifests = [CacheManifest.read(Path(d)) for d in dirs]
    shards = [[read_shard(shard_path(d, i), range(0, ROWS), m) for i in range(SHARDS)] for d, m in zip(dirs, manifests)]
    rows = [(i, r) for _ in range(2) for i in range(SHARDS) for r in range(ROWS)][:9]  # 3 batches of 3
    alone = [TeacherCaches([d], [m], batch_size=3, dp_rank=0, dp_degree=1) for d, m in zip(dirs, manifests)]
    both = TeacherCaches(dirs, manifests, batch_size=3, dp_rank=0, dp_degree=1)
    for start in range(0, 9, 3):
        batch, singles = next(both), [next(reader) for reader in alone]
        expected = torch.stack([shards[0][i]["input_ids"][r] for i, r in rows[start:start + 3]])
        assert torch.equal(batch["input_ids"], expected) and torch.equal(singles[0]["input_ids"], expected)
        for c in range(2):
            assert torch.equal(batch["teachers"][c].values, singles[c]["teachers"][0].values)
            values = torch.stack([shards[c][i]["teacher"].values[r] for i, r in rows[start:start + 3]])
            assert torch.equal(batch["teachers"][c].values, values)
    assert both.state_dict() == alone[0].state_dict() == {"kind": "teacher_cache", "dp_rank": 0, "dp_degree": 1,
                                                          "bad_lines": 0, "shard": 0, "row": 1, "epoch": 1}


def test_two_caches_train_as_the_online_mixture(tmp_path):
    """The students' batches from two caches (teacher 0 teaches pydocs, teacher 1 every source at weight 2) give
    the loss, gradients and metrics that the online distiller gives for the same targets from its bridges, and that
    one cached teacher beside one online teacher gives (the online one's targets from its bridge, the cached one's
    from the batch)."""
    args = cached_teachers(tmp_path, f"{{cache_dir: {tmp_path / 'a'}, sources: [pydocs]}}",
                           f"{{cache_dir: {tmp_path / 'b'}, weight: 2.0}}")
    assert args.distillation.source == "cache"
    assert launch_teachers(args.enable_distillation, args.distillation) == ()  # no teacher ranks
    write_cache(tmp_path / "a", args, 0, seed=0)
    write_cache(tmp_path / "b", args, 1, seed=1)
    caches = open_caches(args)
    assert isinstance(caches, TeacherCaches)
    batch = from_wire(to_wire(next(caches)))  # as the data producer process hands it over
    assert batch["source_ids"].tolist() == [0, 1, 1] and len(batch["teachers"]) == 2
    assert not torch.equal(batch["teachers"][0].values, batch["teachers"][1].values)
    routing = source_routing(args.distillation.teachers, ["pydocs", "code"])
    cached = CacheDistiller(args.distillation, routing, torch.device("cpu"), [(2.5, 1.25), (None, None)])
    # Each cache's recorded held-out reference under its teacher's index (none recorded: no key).
    assert cached.teacher_heldout_row() == {"eval/0/teacher_loss": 2.5, "eval/0/teacher_bpb": 1.25}
    handles = [SimpleNamespace(wait=lambda t=t: t) for t in batch["teachers"]]
    clients = [SimpleNamespace(device="cpu", wait_clock=SimpleNamespace(new_step=lambda: None),
                               announce_pause=lambda pause_follows: None,
                               teacher_heldout_ce=None, teacher_heldout_bpb=None,
                               spec=SimpleNamespace(doc_boundaries=False, kd_weight=False),
                               submit=lambda *a, h=h: h) for h in handles]
    teachers = args.distillation.teachers
    online_args = replace(args.distillation, teachers=[replace(t, cache_dir=None, path="t") for t in teachers])
    online = OnlineDistiller(online_args, clients, 0, routing, [(None, None)] * 2)
    mixed_args = replace(args.distillation, teachers=[teachers[0], replace(teachers[1], cache_dir=None, path="t")])
    mixed = OnlineDistiller(mixed_args, clients[1:], 0, routing, [(2.5, 1.25), (None, None)])
    assert mixed.teacher_heldout_row() == {"eval/0/teacher_loss": 2.5, "eval/0/teacher_bpb": 1.25}
    timer = SimpleNamespace(part=lambda name: contextlib.nullcontext())
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(3, SEQ, 8, generator=generator, dtype=torch.float64)
    head = torch.randn(build_tokenizer(args.data.tokenizer).n_words, 8, generator=generator, dtype=torch.float64)
    results = []
    for distiller in (cached, online, mixed):
        distiller.begin_step(1, 1.0)
        x, w = hidden.clone().requires_grad_(), head.clone().requires_grad_()
        n_valid = batch["labels"].numel()
        mine = {**batch, "teachers": batch["teachers"][:1]} if distiller is mixed else batch  # cached ones only
        loss = distiller.head_loss(batch["labels"], distiller.submit(mine, 1, 0), n_valid, timer)(x, w)
        results.append((loss, torch.autograd.grad(loss, (x, w)), distiller.step_metrics()))
    (loss_c, grads_c, metrics_c) = results[0]
    for loss_o, grads_o, metrics_o in results[1:]:
        assert loss_c.item() == loss_o.item()
        assert all(torch.equal(a, b) for a, b in zip(grads_c, grads_o))
        assert metrics_c.keys() == metrics_o.keys() and {"kd/0/loss", "kd/1/loss", "kd/0/weight"} <= metrics_c.keys()
        assert all(float(metrics_c[key]) == float(metrics_o[key]) for key in metrics_c)
    # Row 0 (pydocs): 1:2 over both teachers; rows 1-2 (code): teacher 1 alone.
    assert float(metrics_c["kd/0/weight"]) == pytest.approx(1 / 3 * 1 / 3)
    assert float(metrics_c["loss/kd"]) == pytest.approx(float(metrics_c["kd/0/loss"] + metrics_c["kd/1/loss"]))
    # Resuming: the caches are read in step, from one position.
    state = caches.state_dict()
    after = next(caches)
    caches.load_state_dict(state)
    assert torch.equal(next(caches)["input_ids"], after["input_ids"])


def test_caches_of_other_windows_are_one_sentence(tmp_path):
    args = cached_teachers(tmp_path, f"{{cache_dir: {tmp_path / 'a'}}}", f"{{cache_dir: {tmp_path / 'b'}}}")
    write_cache(tmp_path / "a", args, 0, seed=0)
    write_cache(tmp_path / "b", args, 1, seed=1, shard_sequences=2, sequences_per_stream=ROWS * SHARDS)
    with pytest.raises(DataError) as err:
        open_caches(args)
    assert str(err.value).startswith(f"The teacher caches {tmp_path / 'a'} and {tmp_path / 'b'} do not describe the "
                                     f"same windows: shard_sequences is 2 in {tmp_path / 'b'} but 4 in "
                                     f"{tmp_path / 'a'}.") and "\n" not in str(err.value)
    # Same layout, other windows (as from other data files): found when the shard is read.
    write_cache(tmp_path / "c", args, 1, seed=1)
    victim = shard_path(tmp_path / "c", 0)
    manifest = CacheManifest.read(tmp_path / "c")
    shard = read_shard(victim, range(0, ROWS), manifest)
    tokens = torch.cat([shard["input_ids"], shard["labels"][:, -1:]], dim=1).flip(0)  # the rows in another order
    write_shard(victim, tokens, shard["doc_ids"], shard["teacher"], manifest, {"loader_state": {}},
                shard["source_ids"])
    caches = open_caches(replace(args, distillation=replace(args.distillation, teachers=[
        args.distillation.teachers[0], replace(args.distillation.teachers[1], cache_dir=str(tmp_path / "c"))])))
    with pytest.raises(DataError, match=rf"^The teacher cache shards {tmp_path / 'a'}/shards/shard_00000.safetensors "
                                        rf"and {tmp_path / 'c'}/shards/shard_00000.safetensors hold different windows"):
        next(caches)


def test_a_cache_for_other_settings_or_without_sources_is_one_sentence(tmp_path):
    args = cached_teachers(tmp_path, f"{{cache_dir: {tmp_path / 'a'}, sources: [code]}}",
                           f"{{cache_dir: {tmp_path / 'b'}}}")
    write_cache(tmp_path / "a", args, 0, seed=0)
    write_cache(tmp_path / "b", args, 1, seed=1, sources=False)
    with pytest.raises(DataError, match=rf"^The teacher cache in {tmp_path / 'b'} was written before caches stored "
                                        r"each window's data source, which distillation.teachers\[i\].sources routes "
                                        r"by; rewrite it"):
        open_caches(args)
    # Mixed by weight alone (no sources), the same old cache trains.
    by_weight = cached_teachers(tmp_path, f"{{cache_dir: {tmp_path / 'a'}}}", f"{{cache_dir: {tmp_path / 'b'}}}")
    assert "source_ids" in next(open_caches(by_weight))
    # Other KD settings, or targets written for another student tokenizer: the cache, the teacher and the value.
    tokenizer = build_tokenizer(by_weight.data.tokenizer)
    with pytest.raises(DataError, match=rf"^The teacher cache in {tmp_path / 'a'} \(distillation.teachers\[0\]\) was "
                                        r"written with other settings: k is 16 in the cache but 8 here"):
        open_training_caches(replace(by_weight.distillation, k=8), by_weight.data, "causal", tokenizer, 3, 0, 1)
    manifest = CacheManifest.read(tmp_path / "b")
    manifest.tokenizer_fingerprint += 1
    manifest.write(tmp_path / "b")
    with pytest.raises(DataError, match=rf"^The teacher cache in {tmp_path / 'b'} \(distillation.teachers\[1\]\) was "
                                        rf"written with other settings: tokenizer_fingerprint is "
                                        rf"{manifest.tokenizer_fingerprint} in the cache but \d+ here \(the students' "
                                        r"tokenizer, data.tokenizer: the targets are in its ids\)"):
        open_caches(by_weight)


def test_cached_teachers_settings_and_the_launch(tmp_path):
    from omegaconf import OmegaConf

    from lingua.stool import launch_plan

    one = train_args(tmp_path, f"distillation.teachers=[{{cache_dir: {tmp_path / 'a'}}}]")
    one.validate()  # one cached teacher trains from its cache, as source=cache with cache_dir does
    cached = [TeacherArgs(cache_dir=str(tmp_path / "a"))]
    assert (one.distillation.source, one.distillation.teachers) == ("cache", cached)
    assert launch_teachers(one.enable_distillation, one.distillation) == ()
    mixed = train_args(tmp_path, f"distillation.teachers=[{{cache_dir: {tmp_path}}}, {{path: {tmp_path}}}]")
    mixed.validate()  # a cached teacher beside an online one: only the online one has ranks
    assert mixed.distillation.source == "online"
    assert [t.ranks for t in launch_teachers(mixed.enable_distillation, mixed.distillation)] == [1]
    cfg = OmegaConf.create({"enable_distillation": True, "distillation": {
        "teachers": [{"cache_dir": "a", "sources": ["x"]}, {"cache_dir": "b"}]}})
    plan, _ = launch_plan(cfg, nodes=1, ntasks_per_node=2)
    assert plan.student_ranks == [0, 1] and plan.teacher_models == []
    cfg.distillation.teachers[1] = {"path": "b"}
    plan, _ = launch_plan(cfg, nodes=1, ntasks_per_node=3)
    assert plan.student_ranks == [0, 1] and plan.teacher_models == [[2]]


def test_cached_routing_follows_the_caches_source_order_and_a_resume_in_another_order_is_refused(tmp_path):
    """A shard's source ids index its cache's source_names: with data.sources listed in another order, the code
    teacher still teaches the code windows; a cache write resumed with the sources reordered is one sentence."""
    from lingua.distillation.cache.write_job import settle_manifest
    from lingua.distillation.build import build_distiller

    args = cached_teachers(tmp_path, f"{{cache_dir: {tmp_path / 'a'}}}", f"{{cache_dir: {tmp_path / 'b'}, sources: [code]}}")
    for teacher, seed in ((0, 1), (1, 2)):
        write_cache(tmp_path / "ab"[teacher], args, teacher, seed)
    students = replace(args.data, batch_size=3, sources=dict(reversed(args.data.sources.items())))
    assert active_sources(students.sources) == ["code", "pydocs"]  # the students' own order, reversed
    topo = SimpleNamespace(device=torch.device("cpu"), train_rank=0, train_world_size=1)
    distiller, caches = build_distiller(True, args.distillation, topo, build_tokenizer(args.data.tokenizer), students,
                                        args.model.attn_mask)
    assert caches.manifest.source_names == ["pydocs", "code"]
    code = caches.manifest.source_names.index("code")
    assert distiller.routing[code].tolist() == [1.0, 1.0] and distiller.routing[1 - code].tolist() == [1.0, 0.0]
    caches.close()
    planned = CacheManifest.read(tmp_path / "a")
    planned.source_names = ["code", "pydocs"]
    with pytest.raises(DataError, match="source_names is \\['pydocs', 'code'\\] in the cache but \\['code', 'pydocs'\\]"):
        settle_manifest(tmp_path / "a", planned)
    planned = CacheManifest.read(tmp_path / "a")
    old = CacheManifest(**{**planned.__dict__, "source_names": None})
    old.write(tmp_path / "a")  # started by a writer before source ids: finished without them
    settle_manifest(tmp_path / "a", planned)
    assert planned.source_names is None


@pytest.mark.parametrize("own", ["teacher_tp: 2", "teacher_dtype: bf16"])
def test_a_cached_teachers_own_dtype_or_tp_is_one_sentence(tmp_path, own):
    """A teacher read from its cache runs on no ranks: a dtype or tp of its own would mean nothing."""
    with pytest.raises(ConfigError, match=rf"^distillation\.teachers\[1\]\.{own.split(':')[0]}=.*runs on no ranks"):
        cached_teachers(tmp_path, f"{{cache_dir: {tmp_path / 'a'}}}", f"{{cache_dir: {tmp_path / 'b'}, {own}}}")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("load_async", [True, False])
def test_a_shard_with_flipped_bytes_is_its_sentence_alone(tmp_path, caplog, capfd, load_async):
    """zstd's checksum catches bytes flipped inside a shard whose size and header are intact (the cheap startup check
    passes): the read is one sentence naming the shard, in the producer process as in-line, and no traceback in
    the log or on the console (a truncated or missing shard is a sentence at startup)."""
    import logging

    from lingua.loading.producer import ProducedLoader

    caplog.set_level(logging.INFO)
    args = cached_teachers(tmp_path, f"{{cache_dir: {tmp_path / 'a'}}}")
    write_cache(tmp_path / "a", args, 0, seed=0)
    shard = shard_path(tmp_path / "a", 1)
    data = bytearray(shard.read_bytes())
    header_end = 8 + int.from_bytes(data[:8], "little")
    middle = (header_end + len(data)) // 2
    data[middle:middle + 16] = bytes(b ^ 0xFF for b in data[middle:middle + 16])  # same size, same header
    shard.write_bytes(bytes(data))
    manifest = CacheManifest.read(tmp_path / "a")
    reader = TeacherCaches([str(tmp_path / "a")], [manifest], batch_size=ROWS, dp_rank=0, dp_degree=1)
    loader = ProducedLoader(reader, size=2) if load_async else reader
    try:
        next(loader)  # shard 0 is intact
        with pytest.raises(DataError) as raised:
            next(loader)
    finally:
        loader.close() if load_async else None
    assert str(raised.value).startswith(f"Teacher cache shard {shard} is damaged (")
    assert str(raised.value).endswith("delete it and run the cache command again to rewrite it.")
    out, err = capfd.readouterr()
    logged = "\n".join(record.getMessage() for record in caplog.records)
    assert "Traceback" not in logged + out + err, logged + out + err
