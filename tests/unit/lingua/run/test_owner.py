"""One run per dump dir (lingua/run/owner.py): the owner record every rank decides from, without a collective.

The concurrent launch itself (two torchrun jobs into one dump dir) is tests/dist/test_lost.py.
"""

import json
import logging
import os
import signal
import socket
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from lingua.run.owner import OWNER, POLL_S, DumpDirOwner, holder_gone, launch_key
from lingua.errors import LaunchError, PeerStopped
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


@pytest.mark.parametrize("rank", [0, 1])
def test_a_refusal_is_said_even_when_the_launcher_already_stops_this_rank(tmp_path, monkeypatch, rank):
    """Rank 0 refused first and torchrun sent this rank SIGTERM before it looked: it judges the same holder the
    same way and says so, rather than only that the launcher stopped it; with no holder it takes nothing."""
    monkeypatch.setattr("lingua.cli.entry._held_signals", [signal.SIGTERM])
    plant(tmp_path)
    with pytest.raises(LaunchError, match="is in use by another run"):
        DumpDirOwner(tmp_path, torchrun_launch(rank), 30, {}).take()
    (tmp_path / OWNER).unlink()
    with pytest.raises(PeerStopped, match="the launcher stopped this rank"):
        DumpDirOwner(tmp_path, torchrun_launch(rank), 30, {}).take()
    assert not (tmp_path / OWNER).exists()


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
    with caplog.at_level(logging.WARNING, logger="lingua.run.owner"):
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
    monkeypatch.setattr("lingua.run.owner.HEARTBEAT_S", 0.0)
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


def multi_host_launch(rank: int) -> LaunchEnv:
    return LaunchEnv(rank, 3, 0, 1, "10.0.0.1", 29512, "torchrun")  # three hosts, one rank on each


def owner_on(monkeypatch, host: str, dump, launch: LaunchEnv, startup_s: float = 30) -> DumpDirOwner:
    monkeypatch.setattr(socket, "gethostname", lambda: host)
    return DumpDirOwner(dump, launch, startup_s, {})


@pytest.mark.parametrize("how, fields", [
    # Rank 0 shares the holder's host and sees its pid dead; rank 1 elsewhere sees only a fresh heartbeat.
    ("dead on rank 0's host", dict(host="host-a", heartbeat=time.time(), pid=None)),
    # Rank 1 shares the holder's host and sees its pid alive; rank 0 elsewhere sees only an old heartbeat.
    ("alive on rank 1's host", dict(host="host-b", heartbeat=time.time() - 3600, pid=os.getpid())),
])
def test_across_hosts_the_other_ranks_follow_rank_0s_verdict_whatever_they_see_themselves(tmp_path, monkeypatch, how,
                                                                                         fields):
    if fields["pid"] is None:
        fields["pid"] = dead_pid()
    plant(tmp_path, **fields)
    follower = owner_on(monkeypatch, "host-b", tmp_path, multi_host_launch(1))
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(follower.take)
        time.sleep(4 * POLL_S)
        assert not waiting.done(), waiting.exception()  # it neither refused nor joined: it waits for rank 0
        zero = owner_on(monkeypatch, "host-a", tmp_path, multi_host_launch(0)).take()
        assert zero.held
        assert waiting.result(timeout=10) is follower and not follower.held  # joined what rank 0 took


def test_across_hosts_a_refusal_reaches_the_other_ranks_as_the_launcher_stopping_them(tmp_path, monkeypatch):
    plant(tmp_path, host="host-a", heartbeat=time.time() - 3600)  # alive on host-a, heartbeat old: host-a keeps it
    with pytest.raises(LaunchError, match="is in use by another run"):
        owner_on(monkeypatch, "host-a", tmp_path, multi_host_launch(0)).take()
    follower = owner_on(monkeypatch, "host-c", tmp_path, multi_host_launch(2))  # would call that holder gone
    held = []
    monkeypatch.setattr("lingua.cli.entry._held_signals", held)
    threading.Timer(4 * POLL_S, held.append, [signal.SIGTERM]).start()  # torchrun stops it after rank 0 exited
    start = time.monotonic()
    with pytest.raises(PeerStopped, match="the launcher stopped this rank"):
        follower.take()
    assert time.monotonic() - start < 10 and (tmp_path / OWNER).exists()  # nothing taken over


def test_on_one_host_a_holder_elsewhere_is_judged_by_rank_0_alone(tmp_path):
    plant(tmp_path, host="elsewhere")  # fresh heartbeat: rank 0 refuses, by its own clock
    with pytest.raises(LaunchError, match="is in use by another run"):
        DumpDirOwner(tmp_path, torchrun_launch(0), 30, {}).take()
    with pytest.raises(LaunchError, match="rank 0 of this launch did not take"):  # rank 1 waited, never refused
        DumpDirOwner(tmp_path, torchrun_launch(1), 0.5, {}).take()
