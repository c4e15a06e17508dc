"""2 students + 2 teachers under torchrun on CPU/gloo: a different teacher per data source, online and from each
teacher's cache, and a failing teacher named on every rank."""

from types import SimpleNamespace

import pytest

from apps.debug.postmortem import analyse
from lingua.data import DataArgs, DataLoader
from lingua.rundir import RunDir, train_rows
from lingua.tokenizer import TokenizerArgs, build_tokenizer
from tests.runs import assert_ok, distill_overrides, rank_exit_codes, rank_outputs, torchrun, write_corpus

pytestmark = pytest.mark.slow  # every test here launches processes

STEPS = 3


@pytest.fixture(scope="module")
def two_sources(tmp_path_factory):
    """The test corpus's "text" source and a "code" source (the same generator, another seed)."""
    root = write_corpus(tmp_path_factory.mktemp("two_sources"))
    (write_corpus(tmp_path_factory.mktemp("code"), seed=1) / "text").rename(root / "code")
    for path in (root / "code").iterdir():
        path.rename(path.with_name(path.name.replace("text.", "code.")))
    return root


@pytest.fixture(scope="module")
def second_teacher(tmp_path_factory):
    from setup.make_tiny_teacher import make_tiny_teacher

    return make_tiny_teacher(tmp_path_factory.mktemp("teacher_1") / "tiny-llama-1", seed=1)


def two_teacher_overrides(corpus, teacher_0, teacher_1, dump, **extra) -> list[str]:
    teachers = (f"[{{path: {teacher_0}, sources: [text]}}, {{path: {teacher_1}, sources: [code], weight: 2.0}}]")
    overrides = distill_overrides(corpus, teacher_0, dump, steps=STEPS, **{"data.sources": "{text: 1.0, code: 1.0}",
                                                                          "distillation.teachers": teachers, **extra})
    return [o for o in overrides if not o.startswith("distillation.teacher_path=")]


def text_share_per_step(corpus, tokenizer_path) -> list[float]:
    """Each step's share of rows from "text", over both students: their loaders, rebuilt here, say."""
    args = DataArgs(root_dir=str(corpus), sources={"text": 1.0, "code": 1.0}, batch_size=2, seq_len=32,
                    load_async=False, tokenizer=TokenizerArgs("hf", str(tokenizer_path)))
    tokenizer = build_tokenizer(args.tokenizer)
    loaders = [DataLoader(args, tokenizer, rank, 2) for rank in (0, 1)]
    return [sum(float((next(loader)["source_ids"] == 0).float().mean()) for loader in loaders) / 2
            for _ in range(STEPS)]


@pytest.fixture(scope="module")
def online_run(two_sources, tiny_teacher, second_teacher, tmp_path_factory):
    """(the launch's result, its dump dir): 2 students, teacher 0 for "text", teacher 1 for "code"."""
    dump = tmp_path_factory.mktemp("online") / "run"
    return torchrun(4, two_teacher_overrides(two_sources, tiny_teacher, second_teacher, dump), timeout=120), dump


@pytest.mark.timeout(150)
def test_each_source_learns_from_its_own_teacher(online_run, two_sources, tiny_teacher, second_teacher):
    result, dump = online_run
    assert_ok(result)
    assert result.stdout.count(f"STOP received after {STEPS} requests") == 2, result.stdout[-4000:]
    assert f"teacher 1 ({second_teacher}) on rank 3 ready" in result.stdout
    rows = train_rows(dump)
    assert sorted(rows) == list(range(1, STEPS + 1))
    shares = text_share_per_step(two_sources, tiny_teacher)
    assert 0 < sum(shares) < len(shares), shares  # both sources show up
    for step, share in zip(sorted(rows), shares):
        row = rows[step]
        # Every position of a text row is teacher 0's alone, every code position teacher 1's: the weights say so,
        # whatever teacher 1's larger weight (a position's weights are normalised over its teachers).
        assert row["kd/0/weight"] == pytest.approx(share, abs=1e-6)
        assert row["kd/1/weight"] == pytest.approx(1 - share, abs=1e-6)
        assert row["loss/kd"] == pytest.approx(row["kd/0/loss"] + row["kd/1/loss"], rel=1e-5)
        assert (row["kd/0/loss"] > 0) == (share > 0) and (row["kd/1/loss"] > 0) == (share < 1)
        assert row["loss/total"] == pytest.approx(0.5 * row["loss/ce"] + 0.5 * row["loss/kd"], rel=1e-5)
        assert row["kd/bytes_up"] == row["kd/0/bytes_up"] + row["kd/1/bytes_up"] > 0
    config = (dump / "config.yaml").read_text()
    assert str(second_teacher) in config and "sources:" in config


@pytest.mark.timeout(150)
def test_a_failing_second_teacher_is_named_on_every_rank(two_sources, tiny_teacher, second_teacher, tmp_path):
    dump, logs = tmp_path / "run", tmp_path / "torchrun"
    overrides = two_teacher_overrides(two_sources, tiny_teacher, second_teacher, dump,
                                      inject_failure="teacher_serve:1@2", **{"distributed.train_timeout_s": 300})
    result = torchrun(4, overrides, timeout=120, log_dir=logs)
    assert rank_exit_codes(result.stdout) == {0: 1, 1: 1, 2: 1, 3: 1}, result.stdout[-4000:]
    run_dir, outputs = RunDir(dump), rank_outputs(logs)
    failure = (f"Teacher 1 ({second_teacher}) on rank 3 failed at step 2: teacher failed serving step 2: RuntimeError: "
               f"injected teacher failure (inject_failure=teacher_serve:...); its traceback is in {run_dir.rank_log(3)}")
    for rank in (0, 1):
        assert errors(outputs, rank) == [f"error: {failure}"], outputs[rank]
    # Teacher 0 stops with the students' ERROR, which names teacher 1; teacher 1 raises its own failure.
    assert errors(outputs, 2) == [f"error: student rank(s) [0, 1] stopped on an error at step 2: teacher 1 "
                                  f"({second_teacher}) failed"], outputs[2]
    assert run_dir.rank_log(3).read_text().rstrip().endswith(
        "RuntimeError: injected teacher failure (inject_failure=teacher_serve:...)")
    assert "answered 0 more request(s) with the error, until the students left (ERROR)" in \
        run_dir.rank_log(2).read_text()
    for rank in (0, 1):
        assert run_dir.rank_log(rank).read_text().rstrip().endswith("lingua.distributed: process groups aborted")
    assert sorted(train_rows(dump)) == [1]
    # The post-mortem names the first failure: teacher 1's rank.
    report = analyse(dump)
    assert report["first"]["rank"] == 3 and report["first"]["role"] == "teacher", report["first"]


def write_cache_here(corpus, teacher, cache_dir) -> None:
    """A teacher's cache for the 2 students of `two_teacher_overrides`, written in this process by the cache
    writer's own pieces (the serial writer): no launch, so the test pays for one torchrun only."""
    import torch

    from apps.main.teacher_cache import StreamReader, TeacherCacheArgs, planned_manifest, write_shards
    from lingua.args import parse_args
    from lingua.distillation.cache import INDEX, write_json_atomic
    from lingua.distillation.teacher import TeacherModel

    overrides = distill_overrides(corpus, teacher, cache_dir / "dump", steps=STEPS,
                                  **{"data.sources": "{text: 1.0, code: 1.0}"})
    args = parse_args(TeacherCacheArgs, [*overrides, f"cache_dir={cache_dir}", "streams=2", "shard_sequences=2",
                                         "encode_workers=0"])
    tokenizer, cpu = build_tokenizer(args.data.tokenizer), torch.device("cpu")
    manifest = planned_manifest(args, tokenizer)
    cache_dir.mkdir(parents=True)
    manifest.write(cache_dir)
    write_shards(args, StreamReader(args, tokenizer, cache_dir, manifest), TeacherModel(args.distillation, cpu),
                 manifest, list(range(manifest.n_shards)), True, SimpleNamespace(device=cpu, global_rank=0))
    write_json_atomic(cache_dir / INDEX, {"tokens": manifest.n_shards * manifest.shard_sequences * args.data.seq_len})


@pytest.mark.timeout(150)
def test_two_teachers_caches_train_as_the_online_teachers(online_run, two_sources, tiny_teacher, second_teacher,
                                                          tmp_path):
    """The online run's routing from each teacher's cache (2 students, no teacher ranks): the same losses, KD
    statistics and gradient norms, step for step."""
    for name, teacher in (("cache_0", tiny_teacher), ("cache_1", second_teacher)):
        write_cache_here(two_sources, teacher, tmp_path / name)
    teachers = (f"[{{cache_dir: {tmp_path / 'cache_0'}, sources: [text]}}, "
                f"{{cache_dir: {tmp_path / 'cache_1'}, sources: [code], weight: 2.0}}]")
    dump = tmp_path / "run"
    result = torchrun(2, two_teacher_overrides(two_sources, tiny_teacher, second_teacher, dump,
                                               **{"distillation.teachers": teachers}), timeout=120)
    assert_ok(result)
    online, cached = train_rows(online_run[1]), train_rows(dump)
    assert sorted(cached) == sorted(online) == list(range(1, STEPS + 1))
    keys = [key for key in online[1] if key.startswith(("loss/", "optim/", "kd/teacher_mass", "kd/top1"))
            or key.split("/")[-1] in ("loss", "weight", "teacher_mass", "top1_agreement") and key.startswith("kd/")]
    assert {"kd/0/loss", "kd/1/loss", "kd/0/weight", "kd/1/weight", "loss/kd"} <= set(keys)
    for step in cached:
        assert {key: cached[step][key] for key in keys} == {key: online[step][key] for key in keys}, step
        assert "kd/bytes_up" not in cached[step]  # no bridge
    for i in (0, 1):  # each teacher taught some of the steps' rows
        assert sum(row[f"kd/{i}/loss"] for row in cached.values()) > 0
    assert cached[STEPS]["loss/total"] < cached[1]["loss/total"]  # it learns


def errors(outputs: dict, rank: int) -> list[str]:
    return [line for stream in ("stdout", "stderr") for line in outputs[rank].get(stream, "").splitlines()
            if line.startswith("error: ")]
