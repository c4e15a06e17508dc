"""Nothing lost when the disk, the checkpoint or the launch goes wrong (2 students + 1 tiny teacher, gloo):
a second launch into a live run's dump dir, a full disk during a save, a torn checkpoint, a teacher with a NaN
weight, a diverging student. Each ends in one sentence per rank, never a traceback, and leaves what was safe."""

import hashlib
import json
import os
import re
import shutil
import signal
import time

import pytest

from lingua.run.owner import OWNER
from lingua.run.dump_dir import read_metrics, train_rows
from tests.runs import (assert_stopped_to_resume, base_overrides, distill_overrides, rank_exit_codes, rank_pid, torchrun,
                        wait_for_step)

pytestmark = pytest.mark.slow  # every test here launches processes

LIMIT_S = 90  # one launch, startup included, on a loaded 2-core machine


def sentences(stdout: str) -> list[str]:
    return [line[line.index("error: "):] for line in stdout.splitlines() if "error: " in line
            and line.lstrip().startswith("error: ")]


def assert_no_traceback(stdout: str) -> None:
    """No rank printed a traceback (torchrun's own, for a launch whose ranks failed, is torchrun's way)."""
    ranks = re.sub(r"Traceback \(most recent call last\):\n  File \"<frozen runpy>\".*?ChildFailedError:", "", stdout,
                   flags=re.S)
    assert "Traceback" not in ranks and 'File "' not in ranks, stdout[-6000:]


@pytest.mark.timeout(3 * LIMIT_S)
def test_a_second_launch_into_a_live_dump_dir_refuses_and_the_first_is_untouched(corpus, tiny_teacher, tmp_path):
    dump = tmp_path / "run"
    second, holder = [], {}

    def launch_again_then_preempt(proc):
        wait_for_step(dump, 2, timeout=LIMIT_S)
        holder.update(json.loads((dump / OWNER).read_text()))
        second.append(torchrun(3, distill_overrides(corpus, tiny_teacher, dump, steps=4), timeout=LIMIT_S))
        holder["reached"] = max(train_rows(dump))
        wait_for_step(dump, holder["reached"] + 1, timeout=LIMIT_S)  # the first run trains on, untouched
        os.kill(rank_pid(dump, 0), signal.SIGUSR2)  # and stops as a preempted run does: save, STOP, exit to resume

    first = torchrun(3, distill_overrides(corpus, tiny_teacher, dump, steps=100000), timeout=2 * LIMIT_S,
                     signal_plan=launch_again_then_preempt)
    assert_stopped_to_resume(first, steps=100000)
    refused = second[0]
    since = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(holder["since"]))
    expected = (rf"error: dump_dir {re.escape(str(dump))} is in use by another run \(host {holder['host']}, pid "
                rf"{holder['pid']}, since {since} \(heartbeat \d+s ago\)\); wait for it to end, or give this run "
                rf"another dump_dir \(a holder that is gone is taken over once its process is dead or its heartbeat "
                rf"is \d+s old\)")
    assert len(sentences(refused.stdout)) == 1, refused.stdout[-6000:]  # every rank fails alike, one says it
    assert all(re.fullmatch(expected, s) for s in sentences(refused.stdout)), refused.stdout[-6000:]
    assert rank_exit_codes(refused.stdout) == {0: 2, 1: 2, 2: 2}, refused.stdout[-6000:]
    assert "process_group_init" not in refused.stdout
    assert_no_traceback(refused.stdout)
    # The first run's files are its own: each step logged once, in order, its last step checkpointed, the dir freed.
    steps = [row["step"] for row in read_metrics(dump) if "loss/ce" in row]
    assert steps == list(range(1, len(steps) + 1)) and steps[-1] > holder["reached"], steps
    assert [p.name for p in (dump / "checkpoints").iterdir()] == [f"{steps[-1]:010d}"]
    assert not (dump / OWNER).exists()


def file_hashes(root) -> dict[str, str]:
    """Every file under `root` (hidden ones too) and its content's hash."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.rglob("*"))
            if p.is_file()}


@pytest.mark.timeout(3 * LIMIT_S)
def test_a_launch_into_another_models_dump_dir_is_one_sentence_and_changes_no_file(corpus, tiny_teacher, tmp_path):
    """The distillation config launched into the dump dir of a plain run (another tokenizer, width and name): one
    sentence naming what differs, said once and in torchrun's report, and every file there as it was."""
    dump = tmp_path / "run"
    assert torchrun(2, base_overrides(corpus, dump, steps=2, name="plain_bytes"), timeout=LIMIT_S).returncode == 0
    before = file_hashes(dump)
    assert "config.yaml" in before and any(name.startswith("logs/rank_") for name in before), sorted(before)
    refused = torchrun(3, distill_overrides(corpus, tiny_teacher, dump, **{"model.dim": 64}), timeout=LIMIT_S)
    ckpt = dump / "checkpoints" / f"{2:010d}"
    expected = (f"error: dump_dir {dump} holds a run of another model (its newest checkpoint {ckpt}: model.dim=32 "
                f"there, 64 here; a vocabulary of 258 tokens (tokenizer bytes) there, 512 (tokenizer hf {tiny_teacher}) "
                f"here; the run's name 'plain_bytes' there, 'lingua' here), which this config cannot resume; pick "
                f"another dump_dir for this config (nothing in this one was changed)")
    assert sentences(refused.stdout) == [expected], refused.stdout[-6000:]  # once, though every rank refused
    assert f"traceback : {expected[len('error: '):]}" in refused.stdout, refused.stdout[-3000:]  # torchrun's report
    assert rank_exit_codes(refused.stdout) == {0: 2, 1: 2, 2: 2}, refused.stdout[-6000:]
    assert_no_traceback(refused.stdout)
    assert file_hashes(dump) == before  # config.yaml, logs, startup and status files, metrics: untouched


@pytest.mark.timeout(3 * LIMIT_S)
def test_full_disk_then_torn_checkpoint(corpus, tiny_teacher, tmp_path):
    dump = tmp_path / "run"
    ckpts = dump / "checkpoints"
    overrides = dict(steps=6, **{"checkpoint.dump.every": 2})
    # 1. The disk fills while step 6 is saved (rank 1's storage writer): one sentence on both students, exit 2.
    full = torchrun(3, distill_overrides(corpus, tiny_teacher, dump, inject_failure="disk_full:1@6", **overrides),
                    timeout=LIMIT_S)
    said = sentences(full.stdout)
    expected = (f"error: the checkpoint of step 6 could not be written to {ckpts / '0000000006.tmp'} (No space left on "
                f"device (ENOSPC), on train rank 1); its partial files are removed and the last complete checkpoint "
                f"is {ckpts / '0000000004'}; free space (or fix the permission or quota) and relaunch: it resumes "
                f"from there")
    assert said.count(expected) == 2, full.stdout[-6000:]
    assert rank_exit_codes(full.stdout) == {0: 2, 1: 2, 2: 1}, full.stdout[-6000:]  # the teacher: told, not failed
    assert "student rank(s) [0, 1] stopped on an error at step 6" in full.stdout
    assert_no_traceback(full.stdout)
    assert sorted(p.name for p in ckpts.iterdir()) == ["0000000002", "0000000004"]  # the partial .tmp is gone

    # 2. The newest checkpoint is torn, and the run that left it was killed (its owner record names a dead pid).
    shard = ckpts / "0000000004" / "__1_0.distcp"
    size = shard.stat().st_size
    with open(shard, "r+b") as f:
        f.truncate(size // 2)
    (dump / OWNER).write_text(json.dumps(dict(launch="gone", host=os.uname().nodename, pid=2**22 + 7, started="1",
                                              since=time.time() - 60, heartbeat=time.time(), stale_after_s=60)))
    torn = torchrun(3, distill_overrides(corpus, tiny_teacher, dump, **overrides), timeout=LIMIT_S)
    assert f"taking over dump_dir {dump} from a run that is gone (host {os.uname().nodename}, pid {2**22 + 7}" \
        in torn.stdout, torn.stdout[-6000:]
    damaged = ckpts / "0000000004"
    expected = (f"error: checkpoint {damaged} cannot be read: __1_0.distcp is truncated ({size // 2} of {size} bytes); "
                f"the newest intact one is {ckpts / '0000000002'}; to resume from it, move the damaged one aside "
                f"(`mv {damaged} {damaged}.damaged`) and relaunch")
    assert sentences(torn.stdout).count(expected) == 2, torn.stdout[-6000:]
    assert rank_exit_codes(torn.stdout).get(0) == 2 and rank_exit_codes(torn.stdout).get(1) == 2, torn.stdout[-6000:]
    assert_no_traceback(torn.stdout)
    assert not (dump / OWNER).exists()  # a launch that failed as a sentence releases the dump dir too
    # Moving it aside, as the sentence says, resumes from the intact one: tests/unit/lingua/test_checkpoint.py (a relaunch
    # here would only repeat the resume tests of test_train.py).


def nan_teacher(tiny_teacher, out):
    """A copy of the tiny teacher with one weight NaN."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(tiny_teacher, out)
    weights = load_file(out / "model.safetensors")
    name = next(n for n in sorted(weights) if n.endswith("mlp.down_proj.weight"))
    weights[name][0, 0] = float("nan")
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    return out


@pytest.mark.timeout(2 * LIMIT_S)
def test_a_teacher_with_a_nan_weight_and_a_diverging_student_are_sentences(corpus, tiny_teacher, tmp_path):
    broken = nan_teacher(tiny_teacher, tmp_path / "nan-teacher")
    result = torchrun(3, distill_overrides(corpus, broken, tmp_path / "nan", steps=3, **{
        "data.tokenizer.path": str(tiny_teacher)}), timeout=LIMIT_S)
    expected = (f"error: Teacher rank 2's outputs are not finite (NaN) at step 1: its weights or its forward in "
                f"distillation.teacher_dtype=fp32 are broken, not the students; check the teacher at {broken} (its own "
                f"check of its outputs)")
    assert sentences(result.stdout).count(expected) == 2, result.stdout[-6000:]
    assert rank_exit_codes(result.stdout) == {0: 2, 1: 2, 2: 1}, result.stdout[-6000:]
    assert_no_traceback(result.stdout)

    # A student whose learning rate makes it diverge: the step, both ranks, the parts that went; agreed, so the
    # teacher is told (ERROR) and nothing after the last finite step is logged.
    dump = tmp_path / "diverge"
    result = torchrun(3, distill_overrides(corpus, tiny_teacher, dump, steps=20, **{
        "optim.lr": 1e12, "optim.warmup": 0, "optim.clip": 0}), timeout=LIMIT_S)
    said = [line for line in sentences(result.stdout) if not line.startswith("error: student rank(s)")]  # the teacher's
    assert len(said) == 2 and said[0] == said[1], result.stdout[-6000:]
    found = re.fullmatch(r"error: the loss is not finite at step (\d+) on train ranks 0 \((CE|KD|CE and KD)\), 1 \((CE|"
                         r"KD|CE and KD)\): the student diverged; lower optim.lr, lengthen optim.warmup or set optim.clip, "
                         r"and resume from the last checkpoint", said[0])
    assert found, said
    step = int(found.group(1))
    assert f"error: student rank(s) [0, 1] stopped on an error at step {step}" in result.stdout
    assert sorted(train_rows(dump)) == list(range(1, step))
    assert rank_exit_codes(result.stdout) == {0: 2, 1: 2, 2: 1}, result.stdout[-6000:]
    assert_no_traceback(result.stdout)
