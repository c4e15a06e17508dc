"""CheckpointManager on a 1-rank gloo training group: round trip, latest, retention, crash safety, export."""

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from lingua.checkpoint import (
    CheckpointArgs,
    CheckpointManager,
    SaveEvery,
    consolidate_checkpoint,
    read_marker,
)
from lingua.run.checkpoint_health import CheckpointUnreadable, CheckpointWriteFailed
from lingua.errors import UserError
from lingua.optim import OptimArgs, build_optimizer

ROOT = Path(__file__).resolve().parents[3]


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(11, 8)
        self.proj = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)
        self.out = nn.Linear(8, 11, bias=False)

    def forward(self, x):
        return self.out(self.norm(torch.relu(self.proj(self.emb(x)))))


def make(seed: int = 0):
    torch.manual_seed(seed)
    model = Tiny()
    optimizer, scheduler = build_optimizer(model, OptimArgs(lr=1e-2, warmup=2), 100)
    return model, optimizer, scheduler


def train(model, optimizer, scheduler, steps: int, seed: int = 1) -> list[float]:
    gen = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        x = torch.randint(0, 11, (4, 6), generator=gen)
        loss = nn.functional.cross_entropy(model(x).flatten(0, 1), x.roll(-1, 1).flatten())
        loss.backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def manager(root, group, dump=SaveEvery(1, 0), eval=SaveEvery(0, 0), world=1, **kw) -> CheckpointManager:
    return CheckpointManager(CheckpointArgs(dump=dump, eval=eval, **kw), str(root), group, 0, world)


def snapshot(model, optimizer):
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    opt = optimizer.state_dict()
    state = {i: {k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()} for i, s in opt["state"].items()}
    return weights, state, [dict(g) for g in opt["param_groups"]]


def assert_same(snap_a, snap_b):
    weights_a, state_a, groups_a = snap_a
    weights_b, state_b, groups_b = snap_b
    assert weights_a.keys() == weights_b.keys()
    for k in weights_a:
        assert torch.equal(weights_a[k], weights_b[k]), k
    assert state_a.keys() == state_b.keys()
    for i in state_a:
        for k in state_a[i]:
            assert torch.equal(torch.as_tensor(state_a[i][k]), torch.as_tensor(state_b[i][k])), (i, k)
    assert groups_a == groups_b


def save(ckpt, model, optimizer, scheduler, step, kind="dump"):
    state = {"step": step, "scheduler": scheduler.state_dict(), "data": {"position": step * 10}}
    return ckpt.save(model, optimizer, state, step, {"model": {"dim": 8}, "steps": 100}, kind=kind)


@pytest.mark.timeout(60)
def test_round_trip_restores_weights_optimizer_and_train_state(tmp_path, train_group):
    model, optimizer, scheduler = make()
    train(model, optimizer, scheduler, 3)
    ckpt = manager(tmp_path, train_group)
    path = save(ckpt, model, optimizer, scheduler, 3)
    assert path == tmp_path / "0000000003"
    assert json.loads((path / "params.json").read_text()) == {"model": {"dim": 8}, "steps": 100}
    assert (path / "train_state_00000.json").is_file() and (path / ".metadata").is_file()
    assert read_marker(path) == {"step": 3, "kinds": ["dump"], "train_world_size": 1}
    saved = snapshot(model, optimizer)
    expected_next = train(model, optimizer, scheduler, 3, seed=2)

    fresh_model, fresh_opt, fresh_sched = make(seed=123)
    train_state = manager(tmp_path, train_group).load(fresh_model, fresh_opt)
    assert train_state["step"] == 3 and train_state["data"] == {"position": 30}
    fresh_sched.load_state_dict(train_state["scheduler"])
    assert_same(snapshot(fresh_model, fresh_opt), saved)
    assert train(fresh_model, fresh_opt, fresh_sched, 3, seed=2) == expected_next


@pytest.mark.timeout(60)
def test_a_plain_one_student_checkpoint_loads_into_fsdp_and_back(tmp_path, train_group):
    """A world of one student trains without FSDP (parallelize.py); its checkpoints stay DCP's: they load into an
    FSDP2-sharded model (a relaunch on more students) and a sharded one's load into a plain one, and training
    goes on bit-exactly either way."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    def sharded(seed: int):
        model, optimizer, scheduler = make(seed)
        fully_shard(model, mesh=DeviceMesh.from_group(train_group, "cpu"))
        optimizer, scheduler = build_optimizer(model, OptimArgs(lr=1e-2, warmup=2), 100)  # over the DTensors
        return model, optimizer, scheduler

    for build_from, build_into in ((make, sharded), (sharded, make)):
        root = tmp_path / f"{build_from.__name__}_into_{build_into.__name__}"
        model, optimizer, scheduler = build_from(0)
        train(model, optimizer, scheduler, 3)
        save(manager(root, train_group), model, optimizer, scheduler, 3)
        expected_next = train(model, optimizer, scheduler, 3, seed=2)
        fresh_model, fresh_opt, fresh_sched = build_into(123)
        fresh_sched.load_state_dict(manager(root, train_group).load(fresh_model, fresh_opt)["scheduler"])
        assert train(fresh_model, fresh_opt, fresh_sched, 3, seed=2) == expected_next


@pytest.mark.timeout(60)
def test_load_with_nothing_saved_returns_none(tmp_path, train_group):
    model, optimizer, _ = make()
    assert manager(tmp_path / "missing", train_group).load(model, optimizer) is None
    with pytest.raises(FileNotFoundError, match="not a complete checkpoint"):
        manager(tmp_path, train_group).load(model, optimizer, path=str(tmp_path / "0000000001"))


@pytest.mark.timeout(60)
def test_latest_ignores_tmp_and_incomplete_dirs(tmp_path, train_group):
    model, optimizer, scheduler = make()
    ckpt = manager(tmp_path, train_group)
    save(ckpt, model, optimizer, scheduler, 2)
    (tmp_path / "0000000009.tmp").mkdir()
    (tmp_path / "0000000009.tmp" / ".metadata").write_text("half")
    (tmp_path / "0000000008").mkdir()  # no DCP metadata, no marker
    (tmp_path / "0000000007").mkdir()
    (tmp_path / "0000000007" / ".metadata").write_text("no marker")
    assert ckpt.latest() == tmp_path / "0000000002"
    # The next save removes the stale .tmp left by a crash.
    save(ckpt, model, optimizer, scheduler, 4)
    assert not (tmp_path / "0000000009.tmp").exists()
    assert ckpt.latest() == tmp_path / "0000000004"


@pytest.mark.timeout(60)
def test_retention_keeps_the_newest_of_each_kind(tmp_path, train_group):
    model, optimizer, scheduler = make()
    ckpt = manager(tmp_path, train_group, dump=SaveEvery(1, 2), eval=SaveEvery(2, 1))
    for step in range(1, 6):
        save(ckpt, model, optimizer, scheduler, step)
        if step == 2:
            save(ckpt, model, optimizer, scheduler, step, kind="eval")  # same step: only adds the kind
    names = sorted(p.name for p in tmp_path.iterdir())
    # dump keeps 4 and 5; eval keeps 2 (its newest) although dump no longer does.
    assert names == ["0000000002", "0000000004", "0000000005"]
    assert read_marker(tmp_path / "0000000002")["kinds"] == ["dump", "eval"]
    save(ckpt, model, optimizer, scheduler, 6, kind="eval")
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["0000000004", "0000000005", "0000000006"]


@pytest.mark.timeout(60)
def test_keep_zero_keeps_everything(tmp_path, train_group):
    model, optimizer, scheduler = make()
    ckpt = manager(tmp_path, train_group, dump=SaveEvery(1, 0))
    for step in range(1, 5):
        save(ckpt, model, optimizer, scheduler, step)
    assert len(list(tmp_path.iterdir())) == 4


@pytest.mark.timeout(60)
def test_resave_of_the_same_step_replaces_it(tmp_path, train_group):
    model, optimizer, scheduler = make()
    save(manager(tmp_path, train_group), model, optimizer, scheduler, 3, kind="eval")
    train(model, optimizer, scheduler, 1)
    saved = snapshot(model, optimizer)
    # A new manager (as after a restart) writes the same step again with different weights.
    save(manager(tmp_path, train_group), model, optimizer, scheduler, 3)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["0000000003"]
    assert read_marker(tmp_path / "0000000003")["kinds"] == ["dump", "eval"]
    fresh_model, fresh_opt, _ = make(seed=5)
    manager(tmp_path, train_group).load(fresh_model, fresh_opt)
    assert_same(snapshot(fresh_model, fresh_opt), saved)


@pytest.mark.timeout(60)
def test_failing_save_keeps_the_previous_checkpoint(tmp_path, train_group, monkeypatch):
    model, optimizer, scheduler = make()
    ckpt = manager(tmp_path, train_group)
    save(ckpt, model, optimizer, scheduler, 1)
    saved = snapshot(model, optimizer)
    train(model, optimizer, scheduler, 1)

    real_save = dcp.save

    def crash_mid_write(state, *, checkpoint_id, process_group):
        real_save({"model": state["model"]}, checkpoint_id=checkpoint_id, process_group=process_group)
        raise OSError("disk full")

    monkeypatch.setattr(dcp, "save", crash_mid_write)
    with pytest.raises(CheckpointWriteFailed, match="disk full") as failed:  # an OSError too, and a user's sentence
        save(ckpt, model, optimizer, scheduler, 2)
    monkeypatch.undo()
    assert isinstance(failed.value, OSError) and isinstance(failed.value, UserError)
    assert f"the last complete checkpoint is {tmp_path / '0000000001'}" in str(failed.value)
    assert not (tmp_path / "0000000002.tmp").exists() and not (tmp_path / "0000000002").exists()
    assert ckpt.latest() == tmp_path / "0000000001"
    fresh_model, fresh_opt, _ = make(seed=7)
    assert manager(tmp_path, train_group).load(fresh_model, fresh_opt)["step"] == 1
    assert_same(snapshot(fresh_model, fresh_opt), saved)
    # The retry succeeds and cleans up the leftover.
    save(ckpt, model, optimizer, scheduler, 2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["0000000001", "0000000002"]


@pytest.mark.timeout(60)
def test_other_train_world_size_is_a_readable_error(tmp_path, train_group, caplog):
    model, optimizer, scheduler = make()
    other = CheckpointManager(CheckpointArgs(), str(tmp_path / "checkpoints"), train_group, 0, 2)
    save(manager(tmp_path / "checkpoints", train_group), model, optimizer, scheduler, 1)
    with pytest.raises(ValueError, match=r"written by 1 training ranks but this run has 2") as refused:
        other.load(model, optimizer)
    # The fix it names works: init_ckpt_path in a dump dir of its own (in this one the run would resume first).
    sentence = str(refused.value)
    assert f"dump_dir=<a new folder, e.g. {tmp_path}_2ranks>" in sentence
    init = sentence.split("checkpoint.init_ckpt_path=")[1].split(" ")[0]
    assert init == str(tmp_path / "checkpoints" / "0000000001")
    fresh_model, fresh_opt, _ = make(seed=5)
    new_run = manager(tmp_path.parent / f"{tmp_path.name}_2ranks" / "checkpoints", train_group, init_ckpt_path=init)
    assert new_run.load(fresh_model, fresh_opt) is None and new_run.load_init(fresh_model, fresh_opt) is None
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in fresh_model.state_dict().items())
    # Beside its own checkpoint a run resumes, and says that init_ckpt_path is not read.
    with caplog.at_level(logging.WARNING):
        assert new_run.load(fresh_model, fresh_opt) is None  # nothing of its own yet: load_init's turn
        save(new_run, fresh_model, fresh_opt, scheduler, 1)
        assert new_run.load(fresh_model, fresh_opt)["step"] == 1
    assert f"checkpoint.init_ckpt_path={init} is not read: resuming from " in caplog.text
    # A full resume of another run (continue_training_from_init) is told to take the weights only instead.
    cont = CheckpointManager(CheckpointArgs(init_ckpt_path=init, continue_training_from_init=True),
                             str(tmp_path / "elsewhere"), train_group, 0, 2)
    with pytest.raises(ValueError, match="drop checkpoint.continue_training_from_init"):
        cont.load_init(model, optimizer)


@pytest.mark.timeout(60)
def test_load_weights_only_and_load_init(tmp_path, train_group):
    model, optimizer, scheduler = make()
    train(model, optimizer, scheduler, 2)
    save(manager(tmp_path, train_group), model, optimizer, scheduler, 2)
    weights = {k: v.clone() for k, v in model.state_dict().items()}

    fresh_model, fresh_opt, _ = make(seed=9)
    ckpt = manager(tmp_path / "new_run", train_group, init_ckpt_path=str(tmp_path))
    assert ckpt.load(fresh_model, fresh_opt) is None
    assert ckpt.load_init(fresh_model, fresh_opt) is None  # weights only
    for k, v in fresh_model.state_dict().items():
        assert torch.equal(v, weights[k]), k
    assert fresh_opt.state_dict()["state"] == {}

    cont = manager(tmp_path / "new_run", train_group, init_ckpt_path=str(tmp_path / "0000000002"),
                   continue_training_from_init=True)
    other_model, other_opt, _ = make(seed=11)
    assert cont.load_init(other_model, other_opt)["step"] == 2
    assert_same(snapshot(other_model, other_opt), snapshot(model, optimizer))
    with pytest.raises(FileNotFoundError, match="init_ckpt_path"):
        ckpt.load_weights_only(fresh_model, str(tmp_path / "nowhere"))


@pytest.mark.timeout(120)
def test_consolidate_gives_the_model_tensors(tmp_path, train_group):
    model, optimizer, scheduler = make()
    train(model, optimizer, scheduler, 2)
    path = save(manager(tmp_path / "ckpts", train_group), model, optimizer, scheduler, 2)
    out = tmp_path / "export" / "consolidated.pt"
    consolidate_checkpoint(str(path), str(out))
    weights = torch.load(out, weights_only=True)
    assert weights.keys() == model.state_dict().keys()
    for k, v in model.state_dict().items():
        assert torch.equal(weights[k], v), k
    assert sorted(p.name for p in out.parent.iterdir()) == ["consolidated.pt"]  # no temp file left
    with pytest.raises(FileNotFoundError):
        consolidate_checkpoint(str(tmp_path), str(tmp_path / "x.pt"))


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_consolidate_cli_runs_in_a_fresh_process_without_a_process_group(tmp_path, train_group):
    model, optimizer, scheduler = make()
    train(model, optimizer, scheduler, 2)
    path = save(manager(tmp_path / "ckpts", train_group), model, optimizer, scheduler, 2)
    cli_out = tmp_path / "cli.pt"
    proc = subprocess.run([sys.executable, "-m", "lingua.checkpoint", "consolidate", str(path), str(cli_out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=90)
    assert proc.returncode == 0, proc.stderr
    cli_weights = torch.load(cli_out, weights_only=True)
    assert cli_weights.keys() == model.state_dict().keys()
    assert all(torch.equal(cli_weights[k], v) for k, v in model.state_dict().items())


@pytest.mark.timeout(60)
def test_a_full_disk_in_the_storage_writer_is_one_sentence_and_warns_before_the_next_save(tmp_path, train_group,
                                                                                          monkeypatch, caplog):
    import errno

    from torch.distributed.checkpoint import filesystem

    model, optimizer, scheduler = make()
    ckpt = manager(tmp_path, train_group)
    save(ckpt, model, optimizer, scheduler, 1)

    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(filesystem, "_write_item", disk_full)
    with pytest.raises(CheckpointWriteFailed) as failed:
        save(ckpt, model, optimizer, scheduler, 2)
    monkeypatch.undo()
    sentence = str(failed.value)
    assert sentence == (f"the checkpoint of step 2 could not be written to {tmp_path / '0000000002.tmp'} (No space "
                        f"left on device (ENOSPC), on train rank 0); its partial files are removed and the last "
                        f"complete checkpoint is {tmp_path / '0000000001'}; free space (or fix the permission or quota) "
                        f"and relaunch: it resumes from there")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["0000000001"]
    # Less free space than the last checkpoint took: a warning before the save.
    monkeypatch.setattr("lingua.run.checkpoint_health.shutil.disk_usage", lambda path: shutil._ntuple_diskusage(1, 1, 1))
    with caplog.at_level(logging.WARNING, logger="lingua.run.checkpoint_health"):
        save(ckpt, model, optimizer, scheduler, 2)
    assert any("0 MiB free but the last checkpoint" in r.getMessage() and "0000000001" in r.getMessage()
               for r in caplog.records)


@pytest.mark.timeout(60)
def test_a_torn_shard_of_the_newest_checkpoint_names_it_and_the_newest_intact_one(tmp_path, train_group):
    model, optimizer, scheduler = make()
    ckpt = manager(tmp_path, train_group)
    for step in (1, 2):
        save(ckpt, model, optimizer, scheduler, step)
    shard = next((tmp_path / "0000000002").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    fresh_model, fresh_opt, _ = make(seed=7)
    with pytest.raises(CheckpointUnreadable) as unreadable:
        manager(tmp_path, train_group).load(fresh_model, fresh_opt)
    sentence = str(unreadable.value)
    assert sentence.startswith(f"checkpoint {tmp_path / '0000000002'} cannot be read: {shard.name} is truncated (")
    assert (f"the newest intact one is {tmp_path / '0000000001'}; to resume from it, move the damaged one aside "
            f"(`mv {tmp_path / '0000000002'} {tmp_path / '0000000002'}.damaged`) and relaunch") in sentence
    os.rename(tmp_path / "0000000002", tmp_path / "0000000002.damaged")  # what the sentence says to do
    assert manager(tmp_path, train_group).load(fresh_model, fresh_opt)["step"] == 1
    # Bytes torn inside a file (its size intact): DCP's reader fails, still one sentence.
    shard = next((tmp_path / "0000000001").glob("*.distcp"))
    shard.write_bytes(b"\0" * shard.stat().st_size)
    with pytest.raises(CheckpointUnreadable, match=r"0000000001 cannot be read: .*\(train rank 0\); no earlier"):
        manager(tmp_path, train_group).load(fresh_model, fresh_opt)
