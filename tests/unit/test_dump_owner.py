"""One run per dump dir (lingua/dump_owner.py): the owner record every rank decides from, without a collective.

The concurrent launch itself (two torchrun jobs into one dump dir) is tests/dist/test_lost.py.
"""

import json
import logging
import os
import socket
import subprocess
import time

import pytest

from lingua.dump_owner import OWNER, DumpDirOwner, holder_gone, launch_key
from lingua.errors import LaunchError
from lingua.parallel.launch_plan import LaunchEnv
from lingua.parallel.rank_status import process_start


def torchrun_launch(rank: int, port: int = 29511) -> LaunchEnv:
    return LaunchEnv(rank, 3, rank, 3, "127.0.0.1", port, "torchrun")


def dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def plant(dump, **fields) -> dict:
    now = time.time()
    record = dict(launch="torchrun:127.0.0.1:1:job=-.0:-", host=socket.gethostname(), pid=os.getpid(), started=process_start(os.getpid()),
                  job=None, restart=0, since=now - 100, heartbeat=now, stale_after_s=60.0)
    record.update(fields)
    (dump / OWNER).write_text(json.dumps(record))
    return record


def test_every_rank_of_a_launch_joins_what_rank_0_took_and_a_clean_exit_releases(tmp_path):
    env = {"TORCHELASTIC_RUN_ID": "none"}
    zero = DumpDirOwner(tmp_path, torchrun_launch(0), 30, env).take()
    assert zero.held and json.loads((tmp_path / OWNER).read_text())["pid"] == os.getpid()
    other = DumpDirOwner(tmp_path, torchrun_launch(2), 30, env).take()
    assert not other.held
    other.release()
    assert (tmp_path / OWNER).exists()  # only the holder removes it
    zero.release()
    assert not (tmp_path / OWNER).exists()
    assert not list(tmp_path.glob(".owner*"))  # no temporary file left


@pytest.mark.parametrize("rank", [0, 1])
def test_a_live_holder_of_another_launch_is_refused_on_every_rank_naming_it(tmp_path, rank):
    plant(tmp_path, job="4242")  # this process: alive, fresh heartbeat
    with pytest.raises(LaunchError) as refused:
        DumpDirOwner(tmp_path, torchrun_launch(rank), 30, {}).take()
    sentence = str(refused.value)
    assert f"dump_dir {tmp_path} is in use by another run" in sentence
    assert f"host {socket.gethostname()}, pid {os.getpid()}, SLURM job 4242, since " in sentence
    assert "\n" not in sentence


@pytest.mark.parametrize("how, fields, why", [
    ("dead pid", dict(pid=None), "its process is gone"),
    ("old heartbeat elsewhere", dict(host="elsewhere", heartbeat=time.time() - 600), "its heartbeat is"),
    ("requeued job", dict(host="elsewhere", job="77", restart=0), "this SLURM job's run before requeue 1"),
    ("requeued job still leaving here", dict(job="77", restart=0), "this SLURM job's run before requeue 1"),
])
def test_a_holder_that_is_gone_is_taken_over_with_a_warning_naming_it(tmp_path, caplog, how, fields, why):
    if fields.get("pid", 1) is None:
        fields["pid"] = dead_pid()
    old = plant(tmp_path, **fields)
    env = {"SLURM_JOB_ID": "77", "SLURM_RESTART_COUNT": "1"}
    with caplog.at_level(logging.WARNING, logger="lingua.dump_owner"):
        owner = DumpDirOwner(tmp_path, torchrun_launch(0), 30, env).take()
    record = json.loads((tmp_path / OWNER).read_text())
    assert owner.held and record["pid"] == os.getpid() and record["launch"] != old["launch"]
    assert record["job"] == "77" and record["restart"] == 1
    warning = caplog.records[-1].getMessage()
    assert f"taking over dump_dir {tmp_path} from a run that is gone (host {old['host']}, pid {old['pid']}" in warning
    assert why in warning
    # A rank other than 0 of the same launch waits for rank 0's record, then joins it.
    assert not DumpDirOwner(tmp_path, torchrun_launch(1), 30, env).take().held


def test_a_live_holder_on_this_host_keeps_the_dir_whatever_its_heartbeat_says(tmp_path):
    record = plant(tmp_path, heartbeat=time.time() - 3600)  # this process: alive, but its heartbeat is old
    assert holder_gone(record, socket.gethostname(), time.time(), {}) is None
    with pytest.raises(LaunchError, match="is in use by another run"):
        DumpDirOwner(tmp_path, torchrun_launch(0), 30, {}).take()


def test_other_ranks_wait_for_rank_0_and_say_so_when_it_never_comes(tmp_path):
    start = time.monotonic()
    with pytest.raises(LaunchError, match="rank 0 of this launch did not take dump_dir"):
        DumpDirOwner(tmp_path, torchrun_launch(1), 0.5, {}).take()
    assert time.monotonic() - start < 5


def test_the_heartbeat_refreshes_the_record_with_the_running_bound(tmp_path, monkeypatch):
    monkeypatch.setattr("lingua.dump_owner.HEARTBEAT_S", 0.0)
    owner = DumpDirOwner(tmp_path, torchrun_launch(0), 600, {}).take()
    first = json.loads((tmp_path / OWNER).read_text())
    assert first["stale_after_s"] == 600 + 60  # starting up: the init timeout, then the running bound
    time.sleep(0.05)
    owner.heartbeat()
    beat = json.loads((tmp_path / OWNER).read_text())
    assert beat["heartbeat"] > first["heartbeat"] and beat["since"] == first["since"] and beat["stale_after_s"] == 60
    assert holder_gone(beat, socket.gethostname(), time.time()) is None


def test_launch_keys_differ_between_launches_and_requeues():
    a, b = torchrun_launch(0, 1000), torchrun_launch(0, 1001)
    assert launch_key(a, {}) != launch_key(b, {})
    assert launch_key(a, {"SLURM_JOB_ID": "5"}) != launch_key(a, {"SLURM_JOB_ID": "5", "SLURM_RESTART_COUNT": "1"})
    assert launch_key(a, {}) == launch_key(torchrun_launch(2, 1000), {})
