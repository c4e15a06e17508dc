"""Plain training under torchrun on CPU/gloo (no teacher): FSDP, meshes, resume, probes, grad
accumulation, preemption. Each run has a hard timeout: a hang fails the test."""

import json
import math
import os
import re
import signal
import time
from pathlib import Path

import pytest

from lingua.run.dump_dir import train_rows
from tests.runs import (assert_no_orphan_producers, assert_ok, assert_stopped_to_resume, at_once, base_overrides,
                        signal_ranks, torchrun, wait_for_step, worker_pids)
from tests.student_exports import check_scored_and_exported

pytestmark = pytest.mark.slow  # every test here launches processes


@pytest.mark.timeout(240)
def test_two_rank_fsdp_loss_decreases(corpus, tmp_path):
    dump = tmp_path / "run"
    result = torchrun(2, base_overrides(corpus, dump, steps=30, **{"optim.lr": 1e-2, "logging.console": "brief"}),
                      timeout=200)
    assert_ok(result)
    rows = train_rows(dump)
    assert sorted(rows) == list(range(1, 31))
    first = sum(rows[s]["loss/ce"] for s in (1, 2, 3)) / 3
    last = sum(rows[s]["loss/ce"] for s in (28, 29, 30)) / 3
    assert last < first - 1.0, (first, last)  # bytes: from ~ln(258)=5.55 down by well over a nat
    assert (dump / "checkpoints" / f"{30:010d}").is_dir()
    assert (dump / "config.yaml").exists()
    assert all(math.isfinite(r["optim/grad_norm"]) for r in rows.values())
    for row in rows.values():  # what a user plots: throughput, step and data time, memory, lr
        assert row["speed/tokens_per_s"] > 0 and row["speed/step_time_s"] > 0 and row["speed/data_time_s"] >= 0
        assert row["mem/peak_gib"] > 0 and row["optim/lr"] > 0 and row["tokens"] > 0
    # The console (logging.console=brief, the default): the first step's line on the first screen, rank 0's lines
    # only; each rank's log holds all of its lines (prefixed with rank and role), the phase table among them.
    console = result.stdout.splitlines()
    first_step = next(i for i, line in enumerate(console) if " train: step 1/30 " in line)
    assert first_step < 20 and "[r1 student]" not in result.stdout, console[:first_step + 1]
    logs = {rank: (dump / "logs" / f"rank_{rank}.log").read_text() for rank in (0, 1)}
    assert "[r1 student] INFO  lingua.distributed: process group destroyed" in logs[1]
    assert "startup phases (all ranks)" in logs[0] and "startup phases (all ranks)" not in result.stdout
    assert "[r0 student] INFO  lingua.timing: startup phase model_build" in logs[0]


@pytest.mark.timeout(420)
def test_four_ranks_as_2x2_mesh(corpus, tmp_path):
    """replicate x shard = 2 x 2 trains the same numbers as a flat 4-way shard (same 4 data-parallel ranks)."""
    hybrid, flat = tmp_path / "hybrid", tmp_path / "flat"
    meshes = [(hybrid, {"distributed.dp_replicate": 2, "distributed.dp_shard": 2}), (flat, {"distributed.dp_shard": 4})]
    result, flat_result = at_once(  # independent launches: both at once
        lambda job: torchrun(4, base_overrides(corpus, job[0], steps=4, **job[1]), timeout=240), meshes)
    assert_ok(result)
    assert "student mesh: {'dp_replicate': 2, 'dp_shard': 2} over ranks [[0, 1], [2, 3]]" in result.stdout, result.stdout[-3000:]
    assert_ok(flat_result)
    a, b = train_rows(flat), train_rows(hybrid)
    assert sorted(b) == [1, 2, 3, 4]
    for step in (1, 2, 3, 4):  # same loss, and the clipped norm is the global one across both mesh dims
        assert b[step]["loss/ce"] == pytest.approx(a[step]["loss/ce"], rel=1e-5), step
        assert b[step]["optim/grad_norm"] == pytest.approx(a[step]["optim/grad_norm"], rel=1e-4), step


@pytest.fixture(scope="module")
def eight_steps(corpus, tmp_path_factory) -> dict:
    """The uninterrupted run the resumed ones must reproduce: 8 steps, a checkpoint every 4 (saving changes no
    number); its rows by step."""
    dump = tmp_path_factory.mktemp("eight_steps") / "run"
    assert_ok(torchrun(2, base_overrides(corpus, dump, steps=8, **{"checkpoint.dump.every": 4}), timeout=120))
    return train_rows(dump)


@pytest.mark.timeout(300)
def test_resume_gives_the_same_losses_and_a_partial_save_never_becomes_latest(corpus, tmp_path, eight_steps):
    split = tmp_path / "split"
    # Interrupted after 4 steps (a checkpoint is written on exit), then resumed to the end.
    assert_ok(torchrun(2, base_overrides(corpus, split, steps=8, exit_after_steps=4), timeout=120))
    assert sorted(train_rows(split)) == [1, 2, 3, 4]
    # What a crash in the middle of saving step 6 leaves behind: a temporary folder, half written.
    partial = split / "checkpoints" / f"{6:010d}.tmp"
    partial.mkdir()
    (partial / "__0_0.distcp").write_bytes(b"\0" * 100)
    resumed = torchrun(2, base_overrides(corpus, split, steps=8), timeout=120)
    assert_ok(resumed)
    assert "resumed from step 4" in resumed.stdout
    b = train_rows(split)
    for step in range(5, 9):
        assert b[step]["loss/ce"] == pytest.approx(eight_steps[step]["loss/ce"], abs=1e-5), step
    # The next save cleaned the half-written folder up.
    assert sorted(p.name for p in (split / "checkpoints").iterdir()) == [f"{4:010d}", f"{8:010d}"]


@pytest.mark.timeout(300)
def test_killed_after_a_save_resumes_with_the_same_losses(corpus, tmp_path, eight_steps):
    """save at step 4 -> SIGKILL at step 7 (no clean exit, no final save) -> resume: the same curve. Both launches
    build their batches in a producer process per rank (the reference run in-line): none outlives the SIGKILL."""
    killed = tmp_path / "killed"
    every_4 = {"checkpoint.dump.every": 4, "data.load_async": "true"}

    def kill_during_step_7(proc):
        wait_for_step(killed, 6)
        time.sleep(1.0)  # rank 0 is 4 s late to step 7 (stall), so the kill lands inside it
        for pid in worker_pids(proc.pid):  # the ranks (torchrun starts them in their own sessions), then torchrun
            os.kill(pid, signal.SIGKILL)
        os.killpg(proc.pid, signal.SIGKILL)

    result = torchrun(2, base_overrides(corpus, killed, steps=8, inject_failure="stall:0@7", **every_4), timeout=120,
                      signal_plan=kill_during_step_7)
    assert result.returncode != 0
    assert sorted(p.name for p in (killed / "checkpoints").iterdir()) == [f"{4:010d}"]
    assert_no_orphan_producers(killed, ranks=(0, 1))
    resumed = torchrun(2, base_overrides(corpus, killed, steps=8, **every_4), timeout=120)
    assert_ok(resumed)
    assert "resumed from step 4" in resumed.stdout
    b = train_rows(killed)  # the resumed launch's rows replace the killed one's
    for step in range(5, 9):
        assert b[step]["loss/ce"] == pytest.approx(eight_steps[step]["loss/ce"], abs=1e-5), step


@pytest.fixture(scope="module")
def reduce_scatter_runs(corpus, tmp_path_factory) -> tuple[dict, dict, dict]:
    """3 steps of 2 micro-batches of 2 rows, reducing gradients per micro-batch ("true", the default) and once
    per step ("false"), recording FSDP's collectives: (rows by step, reduce-scatter counts per rank, each rank's
    all-gathers [in_backward, numel] in call order), each by setting."""
    root = tmp_path_factory.mktemp("reduce_scatter")
    rows, counts, gathers = {}, {}, {}
    for every in ("true", "false"):
        out = root / f"rs_{every}.json"
        overrides = base_overrides(corpus, root / every, steps=3, grad_acc_steps=2,
                                   **{"data.batch_size": 2, "distributed.reduce_every_micro_batch": every})
        assert_ok(torchrun(2, [str(out), *overrides], timeout=120, module="tests.dist.workers.count_fsdp_collectives"))
        rows[every] = train_rows(root / every)
        recorded = [json.loads(Path(f"{out}.{rank}").read_text()) for rank in (0, 1)]
        counts[every] = [r["reduce_scatters"] for r in recorded]
        gathers[every] = [r["all_gathers"] for r in recorded]
    return rows, counts, gathers


@pytest.mark.timeout(300)
def test_grad_accumulation_equals_one_big_batch(corpus, tmp_path, reduce_scatter_runs):
    big = tmp_path / "big"
    assert_ok(torchrun(2, base_overrides(corpus, big, steps=3, **{"data.batch_size": 4}), timeout=120))
    a, b = train_rows(big), reduce_scatter_runs[0]["true"]  # 2 micro-batches of 2 rows
    for step in (1, 2, 3):
        assert b[step]["loss/ce"] == pytest.approx(a[step]["loss/ce"], rel=1e-5)
        assert b[step]["optim/grad_norm"] == pytest.approx(a[step]["optim/grad_norm"], rel=1e-4)


@pytest.mark.timeout(240)
def test_preemption_signal_to_one_rank_saves_and_exits_to_be_resumed(corpus, tmp_path):
    """Outside SLURM nothing requeues a preempted run: it saves, then exits non-zero with one sentence, which
    torchrun's failure report carries too."""
    dump = tmp_path / "run"
    result = torchrun(2, base_overrides(corpus, dump, steps=100000), timeout=180,
                      signal_plan=signal_ranks(dump, [(1, 0.0)]))
    stopped_at = assert_stopped_to_resume(result, steps=100000)
    assert f"stopped at step {stopped_at} of 100000 on SIGUSR2, its checkpoint saved; relaunch" in result.stdout
    saved = sorted(p.name for p in (dump / "checkpoints").iterdir())
    assert len(saved) == 1 and not saved[0].endswith(".tmp")
    last_step = max(train_rows(dump))
    assert int(saved[0]) == last_step == stopped_at < 100000
    assert "run preempted" in result.stdout
    # The requeued job (here: the same command again) resumes from the agreed step and goes on.
    resumed = torchrun(2, base_overrides(corpus, dump, steps=last_step + 2), timeout=120)
    assert_ok(resumed)
    assert f"resumed from step {last_step}" in resumed.stdout
    assert max(train_rows(dump)) == last_step + 2
    # Another steps= re-lays the lr schedule: said in one line, with what it does to the lr.
    notice = f"resuming a run of steps=100000 with steps={last_step + 2}: the cosine lr schedule is stretched over"
    assert resumed.stdout.count(notice) == 1, resumed.stdout[-3000:]


@pytest.mark.timeout(300)
def test_sigterm_to_one_student_under_max_restarts_finishes_with_the_unbroken_losses(corpus, tmp_path):
    """`kill <pid>` of one student under `torchrun --max-restarts 3`: every rank saves at the agreed step and exits
    non-zero, torchrun restarts them, the restart resumes and finishes with the losses of a run never stopped."""
    unbroken, stopped = tmp_path / "unbroken", tmp_path / "stopped"
    plain, result = at_once(lambda job: torchrun(2, base_overrides(corpus, job[0], steps=20), timeout=240, **job[1]),
                            [(unbroken, {}), (stopped, dict(max_restarts=3, signal_plan=signal_ranks(
                                stopped, [(1, 0.0)], after_step=2, sig=signal.SIGTERM)))])
    assert_ok(plain)
    assert_ok(result)
    found = re.findall(r"^error: stopped at step (\d+) of 20 on SIGTERM, its checkpoint saved; relaunch to resume",
                       result.stdout, flags=re.M)
    assert len(found) == 1, result.stdout[-6000:]  # said once, by one of the two students
    assert f"resumed from step {found[0]}" in result.stdout and "run completed: 20 steps" in result.stdout
    resumed, reference = train_rows(stopped), train_rows(unbroken)
    assert sorted(resumed) == sorted(reference) == list(range(1, 21))
    for step in range(1, 21):
        assert resumed[step]["loss/ce"] == pytest.approx(reference[step]["loss/ce"], rel=1e-6), step


@pytest.mark.timeout(420)
def test_activation_checkpointing_no_shard_bf16_and_compile_paths(corpus, tmp_path, eight_steps):
    """full/selective recompute and no_shard give the plain run's losses; bf16 params train; compile matches eager.
    The plain run is the module's 8-step one: its first 3 losses come from the two warmup updates alone, the same
    for any number of steps. no_shard (replicated params, same math) rides on the full-recompute launch."""
    def run(name, steps=3, **extra):
        dump = tmp_path / name
        assert_ok(torchrun(2, base_overrides(corpus, dump, steps=steps, **extra), timeout=300))
        return train_rows(dump)

    plain = eight_steps
    # The four launches are independent: two at a time (the compile first, the longest), 78 s -> ~50 s in CI.
    launches = {"compiled": {"distributed.compile": "true"},
                "full_no_shard": {"distributed.activation_checkpointing": "full", "distributed.fsdp_type": "no_shard"},
                "selective": {"distributed.activation_checkpointing": "selective"},
                "bf16": {"steps": 12, "distributed.model_dtype": "bf16", "optim.lr": 1e-2}}
    runs = dict(zip(launches, at_once(lambda name: run(name, **launches[name]), launches)))
    for name in ("full_no_shard", "selective"):
        rows = runs[name]
        for step in (1, 2, 3):
            assert rows[step]["loss/ce"] == pytest.approx(plain[step]["loss/ce"], rel=1e-5), name
    compiled = runs["compiled"]
    for step in (1, 2, 3):
        assert compiled[step]["loss/ce"] == pytest.approx(plain[step]["loss/ce"], rel=1e-3)
    phases = [json.loads(l)["phase"] for l in (tmp_path / "compiled" / "startup.0.jsonl").read_text().splitlines()]
    assert "compile_warmup" in phases and "compile_warmup" not in (tmp_path / "selective" / "startup.0.jsonl").read_text()
    bf16 = runs["bf16"]
    assert all(math.isfinite(r["loss/ce"]) for r in bf16.values())
    assert bf16[1]["loss/ce"] == pytest.approx(plain[1]["loss/ce"], abs=0.05)  # bf16 rounding only
    assert bf16[12]["loss/ce"] < bf16[1]["loss/ce"] - 0.3


@pytest.mark.timeout(150)
def test_the_straggler_row_names_the_late_rank_and_probe_steps_write_per_rank_stats(corpus, tmp_path):
    """Student 1 is 4 s late to step 3 (stall, before any timed part); student 0 waits for it inside its
    forward's first all-gather. The step-3 row names rank 1 as the slowest step and the latest arrival. The same
    launch probes steps 2 and 4 (both ranks alike, after the step's timed parts): each rank writes its stats."""
    dump = tmp_path / "run"
    assert_ok(torchrun(2, base_overrides(corpus, dump, steps=4, inject_failure="stall:1@3", probe_freq=2), timeout=120))
    for rank in (0, 1):
        lines = [json.loads(l) for l in (dump / "probe" / f"probe.{rank}.jsonl").read_text().splitlines()]
        assert {l["step"] for l in lines} == {2, 4}
        assert {l["kind"] for l in lines} == {"act", "grad"}
        assert all(math.isfinite(l["std"]) for l in lines)
    rows = train_rows(dump)
    late = rows[3]
    assert late["stragglers/step_slowest_rank"] == 1 and late["stragglers/arrival_slowest_rank"] == 1, late
    assert late["stragglers/arrival_max_s"] - late["stragglers/arrival_min_s"] > 3.0  # of the 4 s stall
    assert late["stragglers/fwd_bwd_slowest_rank"] == 0 and late["stragglers/fwd_bwd_max_s"] > 3.0  # the waiter
    assert late["stragglers/step_max_s"] - late["stragglers/step_min_s"] > 3.0
    for step in (2, 4):  # no stall: nobody waited seconds
        assert rows[step]["stragglers/arrival_max_s"] - rows[step]["stragglers/arrival_min_s"] < 3.0


@pytest.mark.timeout(300)
def test_single_process_without_torchrun_with_a_live_progress_line(corpus, student_tokenizers, tmp_path):
    """`python -m apps.main.train` alone trains, saves and warns; on a terminal rank 0 redraws its status line
    every step, not only at log steps: between log steps from host numbers, with the last log row's loss (reading
    the loss every step would sync the host with the GPU). The student has a sentencepiece tokenizer: its last
    checkpoint is scored on pydocs_cloze in-process, and its export reads as lingua does."""
    import pty
    import subprocess
    import sys

    dump = tmp_path / "run"
    primary, secondary = pty.openpty()
    # A grace shorter than a step plus a save (as stool writes it) gets one warning at the first save.
    sentencepiece = {"data.tokenizer.name": "sp", "data.tokenizer.path": student_tokenizers["sp"],
                     "checkpoint.eval.every": 6, "eval.harness.tasks": "[pydocs_cloze]", "eval.harness.limit": 8}
    overrides = base_overrides(corpus, dump, steps=6, preemption_grace_s=0.001,
                               **{"logging.freq": 3, "checkpoint.dump.every": 1, **sentencepiece})
    proc = subprocess.Popen([sys.executable, "-m", "apps.main.train", *overrides], cwd=Path(__file__).resolve().parents[2],
                            stdin=secondary, stdout=secondary, stderr=secondary, env=dict(os.environ, OMP_NUM_THREADS="1"))
    os.close(secondary)
    chunks = []
    while True:  # read the terminal until the child closes it
        try:
            data = os.read(primary, 65536)
        except OSError:
            break
        if not data:
            break
        chunks.append(data)
    os.close(primary)
    screen = b"".join(chunks).decode(errors="replace")
    assert proc.wait(timeout=200) == 0, screen[-3000:]
    rows = train_rows(dump)
    assert sorted(rows) == [3, 6]
    for step in (1, 2):  # before the first log row: progress and speed, no loss yet
        assert re.search(rf"\rstep {step}/6 \| [0-9.]+[kMG]? tok/s", screen), screen[-3000:]
    for step in (4, 5):  # between the log steps 3 and 6: step 3's loss
        assert f"\rstep {step}/6 | loss {rows[3]['loss/total']:.3f} | " in screen, screen[-3000:]
    assert (dump / "checkpoints" / f"{6:010d}").is_dir()
    assert screen.count("between SLURM's USR2 and the kill (preemption_grace_s)") == 1, screen[-3000:]
    assert "step 1 with its checkpoint took" in screen
    check_scored_and_exported(dump, 6, tmp_path)


@pytest.mark.timeout(300)
def test_the_root_is_gathered_once_per_micro_batch(reduce_scatter_runs):
    """FSDP all-gathers the root (embeddings, final norm, head) in each micro-batch's forward and keeps it
    until its backward is done: the backward gathers only the blocks resharded after forward (all but the last)."""
    micro_batches = 3 * 2
    for every in ("true", "false"):  # gathering does not depend on when gradients are reduced
        for calls in reduce_scatter_runs[2][every]:
            forward = [numel for in_backward, numel in calls if not in_backward]
            backward = [numel for in_backward, numel in calls if in_backward]
            root_numel = forward[0]  # the root's pre-forward gathers first
            # Forward: the root and both blocks; backward: block 0 only (the last block is kept for the root's
            # backward).
            assert len(forward) == 3 * micro_batches and forward.count(root_numel) == micro_batches, calls
            assert len(backward) == micro_batches and root_numel not in backward, calls


@pytest.mark.timeout(300)
def test_one_gradient_reduce_scatter_per_step_trains_the_same(reduce_scatter_runs):
    """distributed.reduce_every_micro_batch=false: FSDP reduce-scatters once per step instead of once per
    micro-batch (unsharded gradients accumulate in between), with the same losses and gradient norms."""
    rows, counts, _ = reduce_scatter_runs
    # One reduce-scatter per FSDP unit (2 blocks + the root) per backward: 3 steps x 2 micro-batches vs 3 steps.
    assert counts["true"] == [3 * 3 * 2] * 2 and counts["false"] == [3 * 3] * 2, counts
    for step in (1, 2, 3):
        for key in ("loss/ce", "optim/grad_norm"):
            assert rows["false"][step][key] == pytest.approx(rows["true"][step][key], rel=1e-5), (step, key)
