"""FSDP2 checkpoint resume and sharded gradient clipping, under torchrun on CPU/gloo.

The first run has 2 training ranks plus a bystander rank outside the training group (as a teacher
would be): a checkpoint barrier or DCP call on the default group would hang it. A second run dies
in the middle of saving a later step. The third (2 ranks) resumes from the last complete checkpoint
and must reproduce the first run's losses.
"""

import json
from pathlib import Path

import pytest

from tests.runs import torchrun

pytestmark = pytest.mark.slow  # every test here launches processes

WORKER = "tests.dist.workers.checkpoint_worker"


def read(out_dir: Path, phase: str) -> list[dict]:
    return [json.loads((out_dir / f"{phase}.rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.timeout(180)
def test_fsdp2_resume_reproduces_losses_and_clip_matches_unsharded(tmp_path):
    ckpt_root, out_dir = tmp_path / "checkpoints", tmp_path / "out"
    out_dir.mkdir()

    first = torchrun(3, ["first", str(ckpt_root), str(out_dir)], timeout=120, module=WORKER)
    assert first.returncode == 0, first.stdout[-6000:]
    ckpt = ckpt_root / "0000000003"
    assert sorted(p.name for p in ckpt_root.iterdir()) == ["0000000003"]
    names = {p.name for p in ckpt.iterdir()}
    assert {".metadata", "params.json", "checkpoint.json", "train_state_00000.json", "train_state_00001.json"} <= names
    assert len([n for n in names if n.endswith(".distcp")]) == 2  # one shard file per training rank
    assert json.loads((ckpt / "checkpoint.json").read_text())["train_world_size"] == 2

    # A real crash in the middle of a 2-rank save of step 6: step 3 must stay the latest, loadable one.
    crashed = torchrun(2, ["crash", str(ckpt_root), str(out_dir)], timeout=120, module=WORKER)
    assert crashed.returncode != 0 and "disk full (injected" in crashed.stdout, crashed.stdout[-6000:]
    # Both ranks agree on the failure (lingua/run/checkpoint_health.py): rank 0 removes the partial 0000000006.tmp.
    assert sorted(p.name for p in ckpt_root.iterdir()) == ["0000000003"]

    resumed = torchrun(2, ["resume", str(ckpt_root), str(out_dir)], timeout=120, module=WORKER)
    assert resumed.returncode == 0, resumed.stdout[-6000:]

    for before, after in zip(read(out_dir, "first"), read(out_dir, "resume")):
        assert after["lr_at_resume"] == pytest.approx(before["lr_at_resume"], abs=1e-12)
        assert after["losses"] == pytest.approx(before["losses"], abs=1e-6)
        assert after["grad_norms"] == pytest.approx(before["grad_norms"], abs=1e-6)
        assert after["checksum"] == pytest.approx(before["checksum"], abs=1e-6)

    for clip in (r["clip"] for r in read(out_dir, "first")):
        assert clip["sharded_norm"] == pytest.approx(clip["reference_norm"], rel=1e-5)
        assert clip["clipped_norm"] == pytest.approx(clip["max_norm"], rel=1e-5)
        assert clip["max_grad_error"] < 1e-6
