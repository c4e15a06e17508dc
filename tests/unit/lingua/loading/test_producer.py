"""The data producer process (`lingua/loading/producer.py`): the same batches as in-line, its errors as one sentence
with the traceback in the log, and no process left behind, however the rank ends."""

import functools
import logging
import os
import random
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from lingua.data import DataLoader, training_loader
from lingua.loading.producer import BatchProducer, ProducedLoader, from_wire, to_wire
from lingua.distillation.outputs import TeacherOutputs
from lingua.errors import DataError, RunFailed
from tests.runs import ROOT, running
from tests.unit.counting_loader import CountingLoader
from tests.unit.lingua.test_data import TOKENIZER, make_args, random_texts, write_chunks


def corpus(tmp_path, n_docs: int = 60):
    write_chunks(tmp_path, "web", [random_texts(random.Random(3), n_docs, "w"), random_texts(random.Random(4), 9, "v")])
    write_chunks(tmp_path, "code", [random_texts(random.Random(5), n_docs, "c")])
    return {"web": 2.0, "code": 1.0}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("workers", [0, 2])
def test_producer_batches_and_states_equal_the_in_line_ones_across_restores(tmp_path, workers):
    """With tokenizing workers too (documents read and tokenized ahead, handed out in order): the same batches, and
    states (positions, malformed-line counts) as of the last batch handed out."""
    sources = corpus(tmp_path)
    write_chunks(tmp_path, "junk", [[b"junk\n" if i % 3 == 0 else f'{{"text": "j{i} {"x" * i}"}}\n'.encode()
                                     for i in range(40)]])
    sources["junk"] = 1.0
    with DataLoader(make_args(tmp_path, sources, load_async=False), TOKENIZER, 0, 2) as in_line:
        expected = [(next(in_line), in_line.state_dict()) for _ in range(12)]
    assert 0 < expected[3][1]["bad_lines"] < expected[-1][1]["bad_lines"]
    with DataLoader(make_args(tmp_path, sources, load_async=True, prefetch_size=3, workers=workers), TOKENIZER, 0,
                    2) as produced:
        for i in range(12):
            if i in (4, 9):  # a restore (as from a checkpoint) throws away what the producer built ahead
                produced.load_state_dict(expected[i - 1][1])
            batch = next(produced)
            assert produced.state_dict() == expected[i][1], i
            for key, tensor in expected[i][0].items():
                assert batch[key].dtype == tensor.dtype and torch.equal(batch[key], tensor), (i, key)


@pytest.mark.timeout(60)
def test_a_tokenizing_worker_killed_from_outside_is_one_sentence_not_a_wait(tmp_path):
    """The OOM killer takes a tokenizing worker: its pending documents fail the stream with a sentence (a
    multiprocessing.Pool would wait for the lost task forever, and the rank with it)."""
    with DataLoader(make_args(tmp_path, corpus(tmp_path, n_docs=400), load_async=True, workers=1), TOKENIZER, 0,
                    1) as loader:
        stream = loader._make_stream()()  # the producer's stream, here in-process: its pool is reachable
        try:
            next(stream)
            for worker in list(stream.pool._processes.values()):
                os.kill(worker.pid, signal.SIGKILL)
            with pytest.raises(DataError, match="A tokenizing worker of the data producer died"):
                for _ in range(400):  # past what was tokenized ahead
                    next(stream)
        finally:
            stream.close()


def test_tensors_and_teacher_outputs_cross_the_pipe_unchanged():
    outputs = TeacherOutputs("topk", torch.randn(2, 3, 4).bfloat16(), torch.randint(0, 9, (2, 3, 4), dtype=torch.int32),
                         torch.rand(2, 3))
    batch = {"input_ids": torch.arange(6).view(2, 3), "teacher": outputs}
    back = from_wire(to_wire(batch))
    assert torch.equal(back["input_ids"], batch["input_ids"])
    for before, after in zip(outputs.tensors(), back["teacher"].tensors()):
        assert after.dtype == before.dtype and torch.equal(after, before)


@pytest.mark.timeout(30)
def test_a_data_error_in_the_producer_is_its_sentence_alone(tmp_path, caplog):
    """A user's error is its sentence, as in-line: the producer's traceback only at DEBUG (a bug keeps it, below)."""
    caplog.set_level(logging.DEBUG)
    write_chunks(tmp_path, "web", [[b"junk\n", b'{"text": 1}\n']])
    with DataLoader(make_args(tmp_path, {"web": 1.0}, load_async=True), TOKENIZER, 0, 1) as loader:
        with pytest.raises(ValueError, match="^Source 'web' has no valid document in this rank's share") as raised:
            next(loader)
    assert "Traceback" not in str(raised.value)
    shown = "\n".join(r.getMessage() for r in caplog.records if r.levelno >= logging.INFO)
    assert "Traceback" not in shown, shown
    debug = "\n".join(r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG)
    assert "Traceback (most recent call last)" in debug and "lingua/loading/stream.py" in debug, debug
    # The producer's own log lines reached this process's log (its per-file count of skipped lines).
    assert any("web.chunk.0.jsonl" in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)


@pytest.mark.timeout(30)
def test_a_crash_in_the_producer_is_one_sentence(caplog):
    producer = BatchProducer(functools.partial(iter, None), size=2)  # make_stream raises TypeError: a bug
    try:
        with pytest.raises(RunFailed, match=r"^The data producer process \(pid \d+\) failed: TypeError: 'NoneType' "
                                            r"object is not iterable; its traceback is in this rank's log"):
            producer.get()
    finally:
        producer.close()
    assert any("Traceback" in r.getMessage() for r in caplog.records if r.levelno == logging.ERROR)


@pytest.mark.timeout(30)
def test_a_killed_producer_is_one_sentence_not_a_hang(tmp_path):
    loader = DataLoader(make_args(tmp_path, corpus(tmp_path), load_async=True, prefetch_size=2), TOKENIZER, 0, 1)
    with loader:
        next(loader)
        os.kill(loader._producer.process.pid, signal.SIGKILL)
        with pytest.raises(RunFailed, match=r"^The data producer process \(pid \d+\) was killed by SIGKILL"):
            for _ in range(10_000):  # what already crossed the pipe (up to its 64 KiB buffer) still arrives
                next(loader)


@pytest.mark.timeout(30)
def test_the_cache_road_loader_runs_in_the_producer_and_resumes_there(tmp_path):
    loader = ProducedLoader(CountingLoader(), size=2)
    with pytest.raises(ValueError, match="not a counting state"):
        loader.load_state_dict({"kind": "other"})  # checked here, in the rank
    try:
        first = [next(loader) for _ in range(3)]
        assert [int(b["value"]) for b in first] == [0, 1, 2] and loader.state_dict() == {"kind": "count", "next": 3}
        assert all(int(b["pid"]) != os.getpid() for b in first)  # built in the producer
        loader.load_state_dict({"kind": "count", "next": 1})
        assert int(next(loader)["value"]) == 1 and loader.state_dict()["next"] == 2
    finally:
        loader.close()


def test_training_loader_runs_a_cache_in_the_producer_only_when_async(tmp_path):
    cache = CountingLoader()
    assert training_loader(make_args(tmp_path, {}, load_async=False), TOKENIZER, 0, 1, cache) is cache
    assert isinstance(training_loader(make_args(tmp_path, {}, load_async=True), TOKENIZER, 0, 1, cache),
                      ProducedLoader)


RANK = textwrap.dedent("""
    import signal, sys, time
    from lingua.data import DataLoader
    from tests.unit.lingua.test_data import TOKENIZER, make_args
    flag = []
    signal.signal(signal.SIGUSR1, lambda *_: flag.append(1))  # the rank's preemption handler: it only sets a flag
    loader = DataLoader(make_args(sys.argv[1], {"web": 2.0, "code": 1.0}, load_async=True, prefetch_size=2,
                                  workers=1), TOKENIZER, 0, 1)
    with loader:
        next(loader)
        pid = loader._producer.process.pid
        print(pid, open(f"/proc/{pid}/task/{pid}/children").read(), flush=True)  # the producer, its worker
        while not flag:
            next(loader)
            time.sleep(0.01)
        for _ in range(5):  # after the preemption signal: the data still flows, then a clean exit
            next(loader)
    print("saved", flush=True)
""")


@pytest.mark.slow  # launches python: a rank with a producer
@pytest.mark.timeout(90)
@pytest.mark.parametrize("how", ["SIGKILL", "SIGTERM", "SIGINT to the group", "SIGUSR1 to the group"])
def test_no_producer_outlives_its_rank(tmp_path, how):
    """Ctrl-C reaches the whole process group, SLURM's preemption signal every process of the job step; SIGTERM and
    SIGKILL the rank alone. The producer and its tokenizing worker end with the rank each time, and the rank exits
    (no wait on them)."""
    corpus(tmp_path)
    rank = subprocess.Popen([sys.executable, "-c", RANK, str(tmp_path)], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        producer, *workers = map(int, rank.stdout.readline().split())
        assert running(producer) and len(workers) == 1 and running(workers[0])
        name = how.split()[0]
        if how.endswith("to the group"):
            os.killpg(rank.pid, getattr(signal, name))
        else:
            os.kill(rank.pid, getattr(signal, name))
        out, err = rank.communicate(timeout=30)
        deadline = time.time() + 10
        while any(map(running, [producer, *workers])) and time.time() < deadline:
            time.sleep(0.05)
        assert not running(producer), f"the producer {producer} outlived its rank ({how})"
        assert not running(workers[0]), f"the producer's tokenizing worker {workers[0]} outlived it ({how})"
        if name == "SIGUSR1":
            assert rank.returncode == 0 and "saved" in out, err
        elif name == "SIGINT":
            assert "KeyboardInterrupt" in err and rank.returncode == -signal.SIGINT, err  # Python exits by the signal
        else:
            assert rank.returncode == -getattr(signal, name), err
    finally:
        if rank.poll() is None:
            os.killpg(rank.pid, signal.SIGKILL)
