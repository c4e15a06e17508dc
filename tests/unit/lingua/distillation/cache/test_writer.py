"""The teacher cache writer's pipeline (lingua/distillation/cache/writer.py): the same bytes as the serial writer,
resumable, one sentence per failed shard, no worker left behind."""

import multiprocessing
import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest
import torch

from apps.main.teacher_cache import TeacherCacheArgs, write_cache
from lingua.args import parse_args
from lingua.distillation.cache.store import CacheManifest, shard_path
from lingua.distillation.cache.writer import (ShardWriteError, ShardWriters, StageClock, WindowReadAhead, _portable,
                                              _tensor)
from lingua.distillation.outputs import TeacherOutputs
from tests.dist.test_lost import nan_teacher
from tests.runs import distill_overrides

ROOT = Path(__file__).resolve().parents[5]


def cache_args(corpus, teacher, cache_dir, workers, steps=6, **extra) -> TeacherCacheArgs:
    """2 streams, shards of 4 windows of 32 tokens, forwards of 3 windows: 6 shards per stream at steps=6."""
    overrides = [*distill_overrides(corpus, teacher, cache_dir / "dump", steps=steps, grad_acc_steps=2, **extra),
                 f"cache_dir={cache_dir}", "streams=2", "shard_sequences=4", "forward_rows=3",
                 f"encode_workers={workers}"]
    return parse_args(TeacherCacheArgs, overrides)


def one_rank() -> SimpleNamespace:
    return SimpleNamespace(distributed=True, device=torch.device("cpu"), global_rank=0, world_size=1,
                           local_world_size=1, group_names={})


def cache_files(cache_dir: Path) -> dict[str, bytes]:
    return {str(p.relative_to(cache_dir)): p.read_bytes() for p in sorted(cache_dir.rglob("*"))
            if p.is_file() and "logs" not in p.parts and "dump" not in p.parts}


def test_the_stage_clock_reports_the_teachers_and_the_hosts_share():
    clock = StageClock()
    clock.start -= 10.0  # 10 s ago
    clock.seconds.update(teacher=7.0, windows=0.5, encode=2.0)
    assert clock.shares() in ("teacher 70% of the time, host 25% (windows 5%, encode+write 20%)",)


def test_read_ahead_keeps_the_order_and_hands_over_the_readers_error():
    clock = StageClock()
    assert list(WindowReadAhead(lambda i: i * i, [3, 1, 2], clock)) == [(3, 9), (1, 1), (2, 4)]
    assert list(WindowReadAhead(lambda i: -i, [5, 6], clock, depth=0)) == [(5, -5), (6, -6)]

    def read(index):
        if index == 2:
            raise FileNotFoundError("no such corpus file")
        return index
    ahead = WindowReadAhead(read, [1, 2, 3], clock)
    got = []
    with pytest.raises(FileNotFoundError, match="no such corpus file"):
        for item in ahead:
            got.append(item)
    ahead.close()
    assert got == [(1, 1)] and not ahead.thread.is_alive()


def test_a_shard_that_fails_in_line_is_one_sentence_naming_it(tmp_path):
    manifest = CacheManifest("t", 0, 512, "topk", 2, 1.0, "fp32", "causal", {}, 1, 4, 4)
    values = torch.full((1, 2, 2), float("nan"))
    outputs = TeacherOutputs("topk", values, torch.zeros(1, 2, 2, dtype=torch.int32), torch.zeros(1, 2))
    writers = ShardWriters(0, StageClock())
    with pytest.raises(ShardWriteError, match=r"^Teacher cache shard 7 \(.*shard_00007.safetensors\) was not written: "
                                              r"The teacher's outputs are not finite"):
        writers.submit(7, shard_path(tmp_path, 7), torch.zeros(1, 3, dtype=torch.int32),
                       torch.zeros(1, 2, dtype=torch.int16), outputs, manifest, {})
    assert not shard_path(tmp_path, 7).exists() and writers.written == 0


def test_a_bug_in_encoding_is_one_sentence_pointing_at_the_log(tmp_path, monkeypatch):
    def broken(*args):
        raise KeyError("codec")
    monkeypatch.setattr("lingua.distillation.cache.writer.write_shard", broken)
    with pytest.raises(ShardWriteError) as raised:
        ShardWriters(0, StageClock()).submit(3, shard_path(tmp_path, 3), torch.zeros(1, 3), torch.zeros(1, 2), None,
                                             None, {})
    assert str(raised.value) == (f"Teacher cache shard 3 ({shard_path(tmp_path, 3)}) was not written: "
                                 f"KeyError: 'codec'. The traceback is in the rank's log (cache_dir/logs); finished shards are kept, so "
                                 f"the same command resumes once it is fixed.")


def test_shard_tensors_cross_to_a_worker_bit_for_bit():
    for tensor in (torch.randn(3, 4).bfloat16(), torch.arange(12, dtype=torch.int32).view(2, 6),
                   torch.randn(2, 3, 4), torch.zeros(0, 5, dtype=torch.int16)):
        back = _tensor(pickle.loads(pickle.dumps(_portable(tensor))))
        assert back.dtype == tensor.dtype and back.shape == tensor.shape
        assert torch.equal(back.view(-1).view(torch.uint8), tensor.reshape(-1).view(torch.uint8))


@pytest.mark.slow  # starts encode worker processes
@pytest.mark.timeout(180)
def test_a_pipelined_cache_is_byte_identical_to_a_serial_one_and_resumes_alike(corpus, tiny_teacher, tmp_path,
                                                                              train_group, caplog):
    serial, pipelined = tmp_path / "serial", tmp_path / "pipelined"
    write_cache(cache_args(corpus, tiny_teacher, serial, workers=0), one_rank())
    caplog.set_level("INFO")
    write_cache(cache_args(corpus, tiny_teacher, pipelined, workers=2), one_rank())
    assert "2 encode worker(s), windows read ahead" in caplog.text
    assert "12/12 shards, 1,536 tokens" in caplog.text and "% of the time, host " in caplog.text
    want = cache_files(serial)
    assert len(want) == 12 + 2 and want == cache_files(pipelined)  # shards, cache.json, index.json (no timing field)
    # Killed mid-way: shards missing here and there, a half-written .tmp; the pipelined rerun writes the same bytes.
    for index in (1, 4, 5, 10):
        shard_path(pipelined, index).unlink()
    (pipelined / "index.json").unlink()
    shard_path(pipelined, 4).with_suffix(".safetensors.tmp").write_bytes(b"half a shard")
    write_cache(cache_args(corpus, tiny_teacher, pipelined, workers=2), one_rank())
    assert cache_files(pipelined) == want
    assert not multiprocessing.active_children()


@pytest.mark.slow  # starts encode worker processes
@pytest.mark.timeout(180)
def test_a_failing_encode_worker_is_one_sentence_and_leaves_no_worker(corpus, tiny_teacher, tmp_path, train_group):
    broken = nan_teacher(tiny_teacher, tmp_path / "nan-teacher")
    start = time.time()
    with pytest.raises(ShardWriteError) as raised:
        write_cache(cache_args(corpus, broken, tmp_path / "cache", workers=2), one_rank())
    sentence = str(raised.value)
    assert sentence.startswith("Teacher cache shard 0 (") and "\n" not in sentence, sentence
    assert ("shard_00000.safetensors) was not written: The teacher's outputs are not finite (NaN log-probs)"
            in sentence), sentence
    assert not multiprocessing.active_children() and time.time() - start < 120
    assert not list((tmp_path / "cache" / "shards").glob("*.safetensors"))


def writer_tree(writer: subprocess.Popen, want: int) -> list[psutil.Process]:
    """The writer's descendants once `want` of them are up (its encode workers, the resource tracker)."""
    deadline = time.time() + 90
    while time.time() < deadline and writer.poll() is None:
        children = psutil.Process(writer.pid).children(recursive=True)
        if len(children) >= want:
            return children
        time.sleep(0.2)
    raise AssertionError(f"the writer did not start {want} encode workers: {writer.communicate()[0][-3000:]}")


@pytest.mark.slow  # launches the writer
@pytest.mark.timeout(240)
@pytest.mark.parametrize("stop", ["ctrl-c", "sigterm"])
def test_ctrl_c_or_sigterm_leave_no_encode_worker(corpus, tiny_teacher, tmp_path, stop):
    """Ctrl-C (SIGINT to the terminal's whole process group) or torchrun's SIGTERM (to the writer alone) while
    shards are being encoded: the writer stops and every worker is gone within seconds."""
    overrides = [*distill_overrides(corpus, tiny_teacher, tmp_path / "dump", steps=4000, grad_acc_steps=2),
                 f"cache_dir={tmp_path / 'cache'}", "streams=1", "shard_sequences=4", "encode_workers=2"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    writer = subprocess.Popen([sys.executable, "-m", "apps.main.teacher_cache", *overrides], cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        children = writer_tree(writer, want=2)
        deadline = time.time() + 90
        while not list((tmp_path / "cache" / "shards").glob("*.safetensors")) and time.time() < deadline:
            time.sleep(0.2)  # the workers are writing shards
        if stop == "ctrl-c":
            os.killpg(writer.pid, signal.SIGINT)
        else:
            writer.send_signal(signal.SIGTERM)
        output = writer.communicate(timeout=60)[0]
    finally:
        if writer.poll() is None:
            os.killpg(writer.pid, signal.SIGKILL)
    assert writer.returncode != 0, output[-3000:]
    gone, alive = psutil.wait_procs(children, timeout=15)
    assert not alive, (alive, output[-3000:])
    assert "Traceback" not in output or stop == "ctrl-c", output[-3000:]  # the workers print nothing of their own
