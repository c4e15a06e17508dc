"""A save that fails in or after its rename into place (lingua/checkpoint.py `_put_in_place`): no complete copy is
deleted, a re-saved step's previous save is rolled back, and the sentence names what truly is on disk. Also a
checkpoint whose files cannot even be listed on load is one agreed sentence, not rank 0's lone traceback."""

import os
import pathlib
import shutil

import pytest
import torch

import lingua.checkpoint as checkpoint
from lingua.checkpoint import MARKER
from lingua.run.checkpoint_health import CheckpointUnreadable, CheckpointWriteFailed, damage
from tests.unit.lingua.test_checkpoint import make, manager, save, snapshot, train

STEP = "0000000002"


def fail_when(monkeypatch, module, name, hit):
    """`module.name(path, ...)` raises EACCES where `hit(path, ...)` says so, and runs as usual elsewhere."""
    real = getattr(module, name)

    def maybe_fail(*args, **kwargs):
        if hit(*(pathlib.Path(a).name if isinstance(a, (str, os.PathLike)) else a for a in args)):
            raise PermissionError(13, "Permission denied", str(args[0]))
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, maybe_fail)


# (where it fails, how to inject it, where the new save ends up, where the step's previous save ends up,
#  the newest complete checkpoint the sentence names, what it says of the new save)
POINTS = [
    ("marker", lambda mp: fail_when(mp, checkpoint, "_write_json", lambda p, *_: p == MARKER),
     None, STEP, STEP, "its partial files are removed"),
    ("final set aside", lambda mp: fail_when(mp, os, "rename", lambda a, b, *_: (a, b) == (STEP, STEP + ".old")),
     STEP + ".tmp", STEP, STEP, "its complete files stay in {root}/0000000002.tmp"),
    ("into place", lambda mp: fail_when(mp, os, "rename", lambda a, b, *_: a == STEP + ".tmp"),
     STEP + ".tmp", STEP, STEP, "its complete files stay in {root}/0000000002.tmp"),
    ("into place, and its roll back", lambda mp: fail_when(mp, os, "rename", lambda a, b, *_: b == STEP),
     STEP + ".tmp", STEP + ".old", "0000000001",
     "its complete files stay in {root}/0000000002.tmp and the step's previous save in {root}/0000000002.old"),
    ("previous save's removal", lambda mp: fail_when(mp, shutil, "rmtree", lambda p, *_: p == STEP + ".old"),
     STEP, None, STEP, "it is in place at {root}/0000000002 but what follows the rename failed"),
    ("directory sync", lambda mp: fail_when(mp, checkpoint, "_fsync_dir", lambda p: True),
     STEP, None, STEP, "it is in place at {root}/0000000002 but what follows the rename failed"),
    ("retention", lambda mp: fail_when(mp, os, "rename", lambda a, b, *_: a == "0000000001"),
     STEP, None, STEP, "it is in place at {root}/0000000002 but what follows the rename failed"),
]


def weights(path, group):
    model, optimizer, _ = make(seed=7)
    manager(path.parent, group).load(model, optimizer, path=str(path))
    return snapshot(model, optimizer)[0]


def same(a, b) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("point, inject, new_at, previous_at, last, says", POINTS, ids=[p[0] for p in POINTS])
def test_a_resave_failing_in_its_rename_phase_keeps_every_complete_copy(tmp_path, train_group, monkeypatch, point,
                                                                        inject, new_at, previous_at, last, says):
    model, optimizer, scheduler = make()
    first = manager(tmp_path, train_group)
    for step in (1, 2):
        save(first, model, optimizer, scheduler, step)
    previous = snapshot(model, optimizer)[0]
    train(model, optimizer, scheduler, 2)
    new = snapshot(model, optimizer)[0]
    again = manager(tmp_path, train_group, dump=checkpoint.SaveEvery(1, 1))  # a resumed run re-saves step 2
    inject(monkeypatch)
    with pytest.raises(CheckpointWriteFailed) as failed:
        save(again, model, optimizer, scheduler, 2)
    monkeypatch.undo()
    sentence = str(failed.value)
    assert sentence.startswith(f"the checkpoint of step 2 could not be written to {tmp_path / STEP}.tmp (Permission "
                               f"denied (EACCES) on "), sentence
    assert f"{says.format(root=tmp_path)} and the last complete checkpoint is {tmp_path / last}; free space" in sentence
    assert checkpoint.complete_checkpoints(tmp_path)[-1] == tmp_path / last
    if new_at is not None:
        assert same(weights(tmp_path / new_at, train_group), new)
    else:
        assert not (tmp_path / f"{STEP}.tmp").exists()
    if previous_at is not None:
        assert same(weights(tmp_path / previous_at, train_group), previous)
    # The next save cleans up what stayed.
    save(manager(tmp_path, train_group), model, optimizer, scheduler, 3)
    assert not [p.name for p in tmp_path.iterdir() if p.name.endswith((".tmp", ".old"))]


@pytest.mark.timeout(60)
def test_checkpoint_files_that_cannot_be_listed_are_one_sentence_on_load(tmp_path, train_group, monkeypatch):
    model, optimizer, scheduler = make()
    ckpt = manager(tmp_path, train_group)
    save(ckpt, model, optimizer, scheduler, 1)
    real_is_file = pathlib.Path.is_file

    def is_file(path):
        if path.suffix == ".distcp":
            raise PermissionError(13, "Permission denied", str(path))
        return real_is_file(path)

    monkeypatch.setattr(pathlib.Path, "is_file", is_file)
    assert damage(tmp_path / "0000000001").startswith("its files cannot be checked (Permission denied (EACCES) on ")
    with pytest.raises(CheckpointUnreadable, match=r"0000000001 cannot be read: its files cannot be checked \("
                                                   r"Permission denied \(EACCES\) on .*\.distcp\); no earlier"):
        manager(tmp_path, train_group).load(*make(seed=7)[:2])


@pytest.mark.timeout(60)
def test_recording_another_kind_of_the_step_just_saved_fails_in_one_sentence(tmp_path, train_group, monkeypatch):
    model, optimizer, scheduler = make()
    ckpt = manager(tmp_path, train_group)
    save(ckpt, model, optimizer, scheduler, 1)
    fail_when(monkeypatch, checkpoint, "_write_json", lambda p, *_: p == MARKER + ".tmp")
    with pytest.raises(CheckpointWriteFailed) as failed:
        save(ckpt, model, optimizer, scheduler, 1, kind="eval")  # only adds the kind to the marker
    assert (f"it is in place at {tmp_path / '0000000001'} but what follows the rename failed and the last complete "
            f"checkpoint is {tmp_path / '0000000001'}; free space") in str(failed.value)
    assert checkpoint.read_marker(tmp_path / "0000000001")["kinds"] == ["dump"]
