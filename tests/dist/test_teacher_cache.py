"""The offline teacher cache: written by apps.main.teacher_cache on 2 ranks, read as the dataset by 2 students."""

import json
import math
import re
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from lingua.distillation.args import WIRE_DTYPES, DistillationArgs
from lingua.run.dump_dir import train_rows
from lingua.distillation.teacher.model import TeacherModel
from lingua.distillation.cache.store import CacheManifest, read_shard, shard_metadata, shard_path
from tests.runs import assert_ok, at_once, distill_overrides, torchrun

pytestmark = pytest.mark.slow  # every test here launches processes

KEYS = ("loss/ce", "loss/kd", "loss/total", "kd/teacher_mass", "kd/top1_agreement", "optim/grad_norm")


def cache_overrides(corpus, teacher, cache_dir, **extra) -> list[str]:
    """The training config's overrides plus the cache layout: 2 streams (for 2 students), shards of 4 windows."""
    return [*distill_overrides(corpus, teacher, cache_dir / "dump", steps=6, grad_acc_steps=2, **extra),
            f"cache_dir={cache_dir}", "streams=2", "shard_sequences=4", "forward_rows=3"]


def from_cache(corpus, teacher, cache_dir, dump, **extra) -> list[str]:
    return distill_overrides(corpus, teacher, dump, steps=6, grad_acc_steps=2, **{
        "distillation.source": "cache", "distillation.cache_dir": str(cache_dir), **extra})


@pytest.fixture(scope="module")
def cache(corpus, tiny_teacher, tmp_path_factory) -> Path:
    cache_dir = tmp_path_factory.mktemp("cache") / "tiny"
    result = torchrun(2, cache_overrides(corpus, tiny_teacher, cache_dir, **{"heldout.every": 3, "heldout.max_batches": 2}),
                      timeout=150, module="apps.main.teacher_cache")
    assert_ok(result)
    assert "teacher cache complete" in result.stdout and "tokens/s, ETA" in result.stdout
    assert heldout_shares(result.stdout) == {0: (2, 4), 1: (2, 4)}  # each rank computed its half of the reference
    return cache_dir


def heldout_shares(stdout: str) -> dict[int, tuple[int, int]]:
    """{rank: (held-out batches it computed, batches in all)} from the cache writer's log lines."""
    return {int(rank): (int(mine), int(total)) for rank, mine, total in
            re.findall(r"cache rank (\d+): held-out CE over (\d+) of (\d+) batch", stdout)}


@pytest.mark.timeout(240)  # the module's cache is written while this test sets up (a 150 s launch bound)
def test_cached_outputs_equal_a_fresh_teacher_forward_of_the_cached_tokens(cache, tiny_teacher):
    manifest = CacheManifest.read(cache)
    # 6 steps x 2 micro-batches x 2 windows per stream, in shards of 4: 6 shards per stream, 12 in all.
    assert (manifest.streams, manifest.sequences_per_stream, manifest.n_shards) == (2, 24, 12)
    assert json.loads((cache / "index.json").read_text())["tokens"] == 12 * 4 * 32
    assert manifest.teacher_heldout_ce is not None and 0 < manifest.teacher_heldout_ce < 10
    assert manifest.teacher_heldout_bpb is not None and 0 < manifest.teacher_heldout_bpb < 10
    teacher = TeacherModel(DistillationArgs(teacher_path=str(tiny_teacher), teacher_dtype="fp32"), torch.device("cpu"))
    for index in (0, 5, 11):
        batch = read_shard(shard_path(cache, index), range(0, 4), manifest)
        assert batch["teacher"].ids.dtype == torch.int32 and batch["input_ids"].shape == (4, 32)
        hidden = teacher.hidden_states(batch["input_ids"])
        fresh = teacher.sparse_outputs(hidden, "topk", manifest.k, WIRE_DTYPES[manifest.wire_dtype], 512)
        for got, want in zip(batch["teacher"].tensors(), fresh.tensors()):
            assert torch.equal(got, want.to(got.dtype)), index
        assert torch.equal(batch["labels"][:, :-1], batch["input_ids"][:, 1:])
        metadata = shard_metadata(shard_path(cache, index))
        assert (metadata["stream"], metadata["chunk"]) == (index % 2, index // 2)


@pytest.mark.timeout(300)
def test_training_from_the_cache_equals_online_training_and_resumes_exactly(cache, corpus, tiny_teacher, tmp_path,
                                                                           online_kd_run):
    evals = {"heldout.every": 3, "heldout.max_batches": 2}
    online = online_kd_run  # the same run online: steps=6, grad_acc_steps=2 and these evals (tests/dist/conftest.py)
    # From the cache, interrupted after 4 steps (a checkpoint is written on exit), then resumed to the end.
    cached = tmp_path / "cached"
    first = torchrun(2, from_cache(corpus, tiny_teacher, cache, cached, exit_after_steps=4, **evals), timeout=150)
    assert_ok(first)
    assert "role=teacher" not in first.stdout  # every rank is a student
    # Resumed with the shards read and decoded in a producer process per rank: the same numbers.
    resumed = torchrun(2, from_cache(corpus, tiny_teacher, cache, cached, **evals, **{"data.load_async": "true"}),
                       timeout=150)
    assert_ok(resumed)
    assert "resumed from step 4" in resumed.stdout
    assert resumed.stdout.count("data-producer process started") == 2, resumed.stdout[-3000:]
    a, b = train_rows(online), train_rows(cached)
    for step in range(1, 7):
        assert [b[step][k] for k in KEYS] == [a[step][k] for k in KEYS], step
    cached_evals = [json.loads(line) for line in (cached / "metrics.jsonl").read_text().splitlines()
                    if "eval/loss" in line]
    online_evals = [json.loads(line) for line in (online / "metrics.jsonl").read_text().splitlines()
                    if "eval/loss" in line]
    assert [r["step"] for r in cached_evals] == [r["step"] for r in online_evals] == [3, 6]
    assert [r["eval/loss"] for r in cached_evals] == [r["eval/loss"] for r in online_evals]
    assert [r["eval/bpb"] for r in cached_evals] == [r["eval/bpb"] for r in online_evals]
    assert all(math.isfinite(r["eval/bpb"]) and 0 < r["eval/bpb"] for r in online_evals)
    # The teacher's own held-out CE (and its bits per byte), logged once per launch with its first eval, is the
    # same number either way.
    assert cached_evals[0]["eval/teacher_loss"] == pytest.approx(online_evals[0]["eval/teacher_loss"], rel=1e-6)
    assert cached_evals[0]["eval/teacher_bpb"] == pytest.approx(online_evals[0]["eval/teacher_bpb"], rel=1e-6)
    assert "eval/teacher_loss" not in online_evals[1] and "eval/teacher_bpb" not in online_evals[1]


@pytest.mark.timeout(200)
def test_a_cache_with_other_settings_or_a_damaged_shard_is_one_sentence(cache, corpus, tiny_teacher, tmp_path):
    start = time.time()

    def damaged_copy(name: str) -> Path:
        """The cache with its own copy of the shards (the rest linked), one of which the test then damages."""
        damaged = tmp_path / name
        damaged.mkdir()
        for item in cache.iterdir():
            (damaged / item.name).symlink_to(item) if item.name != "shards" else None
        (damaged / "shards").mkdir()
        for shard in (cache / "shards").iterdir():
            (damaged / "shards" / shard.name).write_bytes(shard.read_bytes())
        return damaged / "shards" / "shard_00003.safetensors"

    truncated, missing = damaged_copy("truncated"), damaged_copy("missing")
    truncated.write_bytes(truncated.read_bytes()[:-100])
    missing.unlink()
    wide = tmp_path / "wide"
    cache_command = dict(timeout=60, module="apps.main.teacher_cache")
    # Five independent launches, two at a time.
    other, rewrite, refused, damaged, absent = at_once(lambda launch: torchrun(**launch), [
        dict(nproc=2, module_args=from_cache(corpus, tiny_teacher, cache, tmp_path / "k", **{
            "distillation.k": 4, "distillation.temperature": 2.0}), timeout=60),
        # Writing into the same cache_dir with other settings is refused too, before any shard is touched.
        dict(nproc=1, module_args=cache_overrides(corpus, tiny_teacher, cache, **{"distillation.k": 4}),
             **cache_command),
        # A top-k wider than the vocabulary: refused before the teacher loads, nothing written (as at the handshake).
        dict(nproc=1, module_args=cache_overrides(corpus, tiny_teacher, wide, **{"distillation.k": 513}),
             **cache_command),
        dict(nproc=2, module_args=from_cache(corpus, tiny_teacher, truncated.parents[1], tmp_path / "d"), timeout=60),
        dict(nproc=2, module_args=from_cache(corpus, tiny_teacher, missing.parents[1], tmp_path / "m"), timeout=60),
    ])
    assert other.returncode != 0
    sentence = (f"error: The teacher cache in {cache} was written with other settings: k is 8 in the cache but 4 here; "
                f"temperature is 1.0 in the cache but 2.0 here.")
    assert other.stdout.count(sentence) == 2, other.stdout[-3000:]
    assert rewrite.returncode != 0 and "already holds a teacher cache written with other settings: k is 8 in the " \
        "cache but 4 here" in rewrite.stdout, rewrite.stdout[-3000:]
    assert refused.returncode != 0 and not (wide / "cache.json").exists()
    assert [line for line in refused.stdout.splitlines() if line.startswith("error: ")] == [
        "error: distillation.k=513 is more than the 512 token ids the top-k is taken from (the data tokenizer's "
        "vocabulary, which the students train on); set distillation.k <= 512."], refused.stdout[-3000:]
    assert damaged.returncode != 0
    assert damaged.stdout.count(f"error: Teacher cache shard {truncated} is damaged (") == 2, damaged.stdout[-3000:]
    assert absent.stdout.count(f"error: Teacher cache shard {missing} is missing; run the cache command again") == 2
    assert not re.search(r"\[rank\d\]: Traceback", absent.stdout) and time.time() - start < 150  # torchrun's own may print


@pytest.mark.timeout(200)
def test_an_interrupted_cache_resumes_with_the_same_shards(cache, corpus, tiny_teacher, tmp_path):
    """Shards deleted (as if never written), a half-written .tmp left: a rerun writes exactly those again (same
    tensors, same metadata), reading its streams from the finished shards' loader states."""
    partial = tmp_path / "partial"
    partial.mkdir()
    (partial / "cache.json").write_text((cache / "cache.json").read_text())
    (partial / "shards").mkdir()
    kept = (0, 1, 2, 7, 8)
    for index in kept:
        source = shard_path(cache, index)
        (partial / "shards" / source.name).write_bytes(source.read_bytes())
    (partial / "shards" / "shard_00004.safetensors.tmp").write_bytes(b"half a shard")
    result = torchrun(2, cache_overrides(corpus, tiny_teacher, partial), timeout=150, module="apps.main.teacher_cache")
    assert_ok(result)
    assert "6 shard(s) of 12, 3 already written, 3 to write" in result.stdout  # rank 0: 0, 2, 8 kept
    for index in range(12):
        assert shard_metadata(shard_path(partial, index)) == shard_metadata(shard_path(cache, index)), index
        with safe_open(str(shard_path(partial, index)), "pt") as new, safe_open(str(shard_path(cache, index)), "pt") as old:
            assert sorted(new.keys()) == sorted(old.keys())
            assert all(torch.equal(new.get_tensor(key), old.get_tensor(key)) for key in old.keys()), index
    assert (partial / "index.json").is_file()


@pytest.mark.timeout(400)
def test_a_cache_written_by_tensor_parallel_replicas_equals_the_one_rank_cache(cache, corpus, tiny_teacher, tmp_path):
    """4 ranks as 2 replicas of distillation.teacher_tp=2: the same shards as 2 ranks of one teacher each (tokens
    equal, bf16 values within one rounding step, the rest mass within fp32's, the same held-out reference, its
    batches split over the replicas), and the same ids but where two candidates tie: the sharded forward's
    logits differ by ~1e-6 (another summation order), enough to swap two ids whose log-probs are that close
    (one position in 1,536 in the runs measured)."""
    sharded = tmp_path / "tp2"
    result = torchrun(4, cache_overrides(corpus, tiny_teacher, sharded, **{"heldout.every": 3, "heldout.max_batches": 2,
                                                                           "distillation.teacher_tp": 2}),
                      timeout=300, module="apps.main.teacher_cache")
    assert_ok(result)
    assert result.stdout.count("6 shard(s) of 12, 0 already written, 6 to write") == 4
    for replica in (0, 1):
        assert f"tensor-parallel replica {replica} of 2 ranks, not writing" in result.stdout
    # Each replica computed half the held-out batches (both of its ranks, the sharded forward needs them).
    assert heldout_shares(result.stdout) == {rank: (2, 4) for rank in range(4)}
    manifest, reference = CacheManifest.read(sharded), CacheManifest.read(cache)
    assert manifest.teacher_heldout_ce == pytest.approx(reference.teacher_heldout_ce, rel=1e-5)
    swapped = positions = 0
    for index in range(manifest.n_shards):
        assert shard_metadata(shard_path(sharded, index)) == shard_metadata(shard_path(cache, index)), index
        got, want = (read_shard(shard_path(c, index), range(0, 4), manifest) for c in (sharded, cache))
        assert torch.equal(got["input_ids"], want["input_ids"])
        values, expected = got["teacher"].values.float(), want["teacher"].values.float()
        step = 2 ** -7 * expected.abs()  # bf16: 8 significant bits
        assert ((values - expected).abs() <= step).all(), index
        assert torch.allclose(got["teacher"].extra, want["teacher"].extra, atol=1e-6), index
        differ = (got["teacher"].ids != want["teacher"].ids).any(-1)
        for row, position in differ.nonzero().tolist():  # ties: each id keeps its log-prob, the k-th may change
            mine = dict(zip(got["teacher"].ids[row, position].tolist(), values[row, position].tolist()))
            theirs = dict(zip(want["teacher"].ids[row, position].tolist(), expected[row, position].tolist()))
            last = min(theirs.values())
            assert len(mine.keys() & theirs.keys()) >= manifest.k - 1, (index, row, position, mine, theirs)
            assert all(abs(mine[i] - theirs.get(i, last)) <= 2 ** -7 * abs(last) for i in mine), (mine, theirs)
        swapped, positions = swapped + int(differ.sum()), positions + differ.numel()
    assert swapped <= positions // 100, (swapped, positions)
