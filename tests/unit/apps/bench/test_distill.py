"""apps.bench.distill: the numbers it derives from metrics rows (no trainer is launched here)."""

import pytest
import torch

from apps.bench import distill as bench
from lingua.distillation.outputs import TeacherOutputs
from setup.make_tiny_teacher import make_tiny_teacher

BSZ, SEQLEN, STUDENTS = 4, 128, 2
STARTUP_IDLE = 5.0


def make_rows(steps: int, step_time: float, kd: bool, busy: float = 0.4, warm_step_time: float = 1.0,
              output: str = "topk", k: int = 16) -> list[dict]:
    """Rows with the keys and meaning of the trainer's log rows (apps/main/train.py `log_step` plus
    `TeacherClient.metrics()`; tests/dist/test_distill.py checks the bench's keys on a real run's rows).

    logging.freq=1, a slow first step, then `step_time` each. The teacher (kd=True) sits idle
    STARTUP_IDLE seconds after the handshake, then is busy a fraction `busy` of every step; the
    bridge counters grow by the framed buffers of one request per step.
    """
    framed = bench.formula_bytes_per_token(output, k, None, "bf16", BSZ, SEQLEN)
    rows, now = [], 1000.0 + STARTUP_IDLE
    busy_s, idle_s = 0.0, STARTUP_IDLE
    tokens_per_step = BSZ * SEQLEN * STUDENTS
    for step in range(1, steps + 1):
        seconds = warm_step_time if step == 1 else step_time
        now += seconds
        wait = 0.2 * seconds if kd else 0.0
        part_seconds = dict(data=0.001, fwd_bwd=0.6 * seconds, teacher_wait=wait, optimizer=0.1 * seconds,
                            checkpoint=0.0, step=seconds)
        row = {"time": now, "step": step, "tokens": step * tokens_per_step, "loss/ce": 5.0, "loss/total": 5.0,
               "optim/lr": 1e-3, "optim/grad_norm": 1.0, "speed/tokens_per_s": tokens_per_step / seconds,
               "speed/step_time_s": seconds, "speed/data_time_s": 0.001, "mem/peak_gib": 0.5 if kd else 0.4}
        if kd:
            busy_s, idle_s = busy_s + busy * seconds, idle_s + (1 - busy) * seconds
            row.update({"kd/alpha": 0.5, "kd/teacher_mass": 0.9, "kd/top1_agreement": 0.3, "loss/kd": 0.5,
                        "speed/teacher_wait_s": wait, "kd/teacher_busy": busy_s / (busy_s + idle_s),
                        "kd/teacher_busy_s": busy_s, "kd/teacher_idle_s": idle_s, "kd/teacher_peak_gib": 0.35,
                        "kd/teacher_forward_s": 0.9 * busy_s,  # the rest of its busy time is the protocol
                        "kd/bytes_up": step * framed["framed_up"] * BSZ * SEQLEN,
                        "kd/bytes_down": step * framed["framed_down"] * BSZ * SEQLEN})
        for part, value in part_seconds.items():
            # Every part has its columns, KD off too; the slowest student waits 25% longer on the teacher.
            row.update({f"stragglers/{part}_max_s": 1.25 * value if part == "teacher_wait" else value,
                        f"stragglers/{part}_min_s": value, f"stragglers/{part}_slowest_rank": 1})
        rows.append(row)
    return rows


def record(rows, kd: bool, teacher_rss=None) -> bench.RunRecord:
    return bench.RunRecord(rows=rows, n_students=STUDENTS, n_processes=STUDENTS + int(kd),
                           peak_rss_gib={"student": 0.45, **({"teacher": teacher_rss} if teacher_rss else {})},
                           cpu_s_per_step={"student": 0.2 if kd else 0.16, **({"teacher": 0.1} if kd else {})},
                           load_before=2.0, load_after=3.0, wall_s=10.0)


@pytest.mark.timeout(30)
def test_the_rows_here_carry_every_key_the_bench_reads():
    assert set(bench.METRIC_KEYS) <= set(make_rows(3, 0.1, kd=False)[-1])
    assert set(bench.METRIC_KEYS + bench.KD_METRIC_KEYS) <= set(make_rows(3, 0.1, kd=True)[-1])


@pytest.mark.timeout(30)
def test_medians_leave_out_the_warmup_and_ratios_compare_the_same_students():
    summaries = {
        "kd_off": bench.summarize([record(make_rows(20, 0.10, kd=False), kd=False)], warmup=5),
        "kd_off_no_prefetch": bench.summarize([record(make_rows(20, 0.12, kd=False), kd=False)], warmup=5),
        "kd_on": bench.summarize([record(make_rows(20, 0.15, kd=True), kd=True)], warmup=5),
    }
    off, on = summaries["kd_off"], summaries["kd_on"]
    assert off["steps_measured"] == 15 and off["step_time_s"] == pytest.approx(0.10)
    assert (off["n_processes"], on["n_processes"]) == (2, 3) and on["n_students"] == off["n_students"] == 2
    assert on["teacher_wait_s"] == pytest.approx(0.03) and on["teacher_wait_share"] == pytest.approx(0.2)
    assert on["teacher_wait_max_rank_s"] == pytest.approx(0.0375)
    assert off["teacher_wait_s"] is None and off["teacher_wait_max_rank_s"] is None and off["teacher_busy"] is None
    assert on["load_avg_1m"] == pytest.approx(2.5)

    ratios = bench.compare(summaries)
    assert ratios["kd_on_over_kd_off"]["step_time_s"] == pytest.approx(1.5)
    assert ratios["kd_on_over_kd_off"]["tokens_per_s"] == pytest.approx(1 / 1.5)
    assert ratios["kd_on_over_kd_off"]["student_peak_gib"] == pytest.approx(1.25)
    assert ratios["kd_on_over_kd_off"]["student_cpu_s_per_step"] == pytest.approx(1.25)
    assert ratios["teacher_cpu_over_student_cpu"] == pytest.approx(0.5)
    assert ratios["no_prefetch_over_prefetch"]["step_time_s"] == pytest.approx(1.2)


@pytest.mark.timeout(30)
def test_repeats_pool_their_rows():
    runs = [record(make_rows(10, 0.1, kd=False), kd=False), record(make_rows(10, 0.3, kd=False), kd=False),
            record(make_rows(10, 0.2, kd=False), kd=False)]
    summary = bench.summarize(runs, warmup=2)
    assert summary["steps_measured"] == 24 and summary["runs"] == 3
    assert summary["step_time_s"] == pytest.approx(0.2)
    assert (summary["step_time_min_s"], summary["step_time_max_s"]) == (pytest.approx(0.1), pytest.approx(0.3))


@pytest.mark.timeout(30)
def test_bridge_bytes_per_token_from_the_counters_and_the_wire_formula():
    formula = bench.formula_bytes_per_token("topk", 16, None, "bf16", BSZ, SEQLEN)
    assert formula["down"] == TeacherOutputs.bytes_per_token("topk", 16, 0, torch.bfloat16) == 16 * (2 + 4) + 4
    assert formula["up"] == 4.0
    # Framed buffers add a per-micro-batch header (8 int32) / status record (2176 B): a little above the payload.
    assert formula["framed_up"] == pytest.approx(4.0 + 8 * 4 / (BSZ * SEQLEN))
    assert formula["framed_down"] == pytest.approx(formula["down"] + 2176 / (BSZ * SEQLEN))

    # The counters are train rank 0's buffers; `tokens` is summed over the students.
    up, down = bench.measured_bytes_per_token(make_rows(20, 0.15, kd=True), warmup=5, n_students=STUDENTS)
    assert (up, down) == (pytest.approx(formula["framed_up"]), pytest.approx(formula["framed_down"]))
    assert bench.measured_bytes_per_token(make_rows(20, 0.15, kd=False), 5, STUDENTS) == (None, None)

    full = bench.formula_bytes_per_token("full", 16, 1000, "fp32", BSZ, SEQLEN)
    assert full["down"] == 4000.0
    assert bench.formula_bytes_per_token("full", 16, None, "bf16", BSZ, SEQLEN)["down"] is None


@pytest.mark.timeout(30)
def test_teacher_busy_fraction_leaves_out_the_startup_idle_time():
    rows = make_rows(20, 0.15, kd=True, busy=0.4)
    assert bench.teacher_busy_fraction(rows, 5) == pytest.approx(0.4)
    assert rows[-1]["kd/teacher_busy"] < 0.2  # the trainer's own since-handshake number, diluted by the 5 s idle start
    assert bench.teacher_busy_fraction(rows, 0) < 0.2  # no warm-up left out: the startup idle counts
    assert bench.teacher_busy_fraction(make_rows(5, 0.1, kd=False), 2) is None


@pytest.mark.timeout(30)
def test_teacher_peak_memory_is_the_logged_key_and_its_rss_comes_from_proc():
    on = bench.summarize([record(make_rows(10, 0.1, kd=True), kd=True, teacher_rss=0.9)], warmup=2)
    assert (on["teacher_peak_gib"], on["teacher_peak_rss_gib"]) == (0.35, 0.9)
    off = bench.summarize([record(make_rows(10, 0.1, kd=False), kd=False)], warmup=2)
    assert (off["teacher_peak_gib"], off["teacher_peak_rss_gib"]) == (None, None)


@pytest.mark.timeout(30)
def test_teacher_tokens_per_rank_and_protocol_share_over_the_window():
    """The students' tokens over the window split over the replicas and their ranks, per busy second; the share of
    busy time outside the forward. With --teacher-tp 1,2 both run side by side and the report compares them."""
    rows = make_rows(20, 0.25, kd=True, busy=0.5)
    tokens_per_busy_s = BSZ * SEQLEN * STUDENTS / (0.5 * 0.25)
    per_rank, protocol = bench.teacher_serving(rows, 5, teacher_tp=2, n_teacher_ranks=2)
    assert per_rank == pytest.approx(tokens_per_busy_s / 2) and protocol == pytest.approx(0.1)
    assert bench.teacher_serving(rows, 5, teacher_tp=2, n_teacher_ranks=4)[0] == pytest.approx(tokens_per_busy_s / 4)
    assert bench.teacher_serving(make_rows(20, 0.25, kd=False), 5, 1, 0) == (None, None)
    assert [v.name for v in bench.with_teacher_tp(list(bench.VARIANTS), [1, 2])] == [
        "kd_off", "kd_off_no_prefetch", "kd_on_tp1", "kd_on_tp2"]
    assert bench.with_teacher_tp(list(bench.VARIANTS), [1]) == list(bench.VARIANTS)
    with pytest.raises(ValueError, match="--teacher-tp 0,x: give ranks per teacher replica"):
        bench.parse_teacher_tp("0,x")
    one = bench.RunRecord(rows=make_rows(20, 0.25, kd=True, busy=0.5), n_students=2, n_processes=3, n_teacher_ranks=1)
    two = bench.RunRecord(rows=make_rows(20, 0.5, kd=True, busy=0.8), n_students=2, n_processes=4, teacher_tp=2,
                          n_teacher_ranks=2)
    summaries = {"kd_on_tp1": bench.summarize([one], 5), "kd_on_tp2": bench.summarize([two], 5)}
    ratios = bench.compare(summaries)["kd_on_tp2_over_kd_on_tp1"]
    assert ratios["step_time_s"] == pytest.approx(2.0)
    assert ratios["teacher_tokens_per_s_per_rank"] == pytest.approx((1 / (0.8 * 0.5) / 2) / (1 / (0.5 * 0.25)))


@pytest.mark.timeout(30)
def test_warmup_longer_than_the_run_is_a_readable_error():
    with pytest.raises(ValueError, match="--steps"):
        bench.summarize([record(make_rows(5, 0.1, kd=False), kd=False)], warmup=5)


@pytest.mark.timeout(30)
def test_markdown_table_has_the_ratios_and_the_fairness_note():
    summaries = {"kd_off": bench.summarize([record(make_rows(20, 0.10, kd=False), kd=False)], warmup=5),
                 "kd_on": bench.summarize([record(make_rows(20, 0.15, kd=True), kd=True)], warmup=5)}
    result = {
        "settings": dict(config="configs/distill_exps/debug_cpu.yaml", steps=20, warmup=5, repeats=1, batch_size=BSZ,
                         seq_len=SEQLEN, grad_acc_steps=1, output="topk", k=16, wire_dtype="bf16", device="cpu",
                         omp_threads=1, cpu_count=2, load_start=[2.0, 2.0, 2.0], load_end=[3.0, 3.0, 3.0]),
        "summaries": summaries, "ratios": bench.compare(summaries),
        "bridge_formula": bench.formula_bytes_per_token("topk", 16, None, "bf16", BSZ, SEQLEN),
        "commands": {"kd_on": ["torchrun", "-m", "apps.main.train"]},
    }
    text = bench.format_markdown(result)
    step_line = next(line for line in text.splitlines() if line.startswith("| step time, median"))
    assert step_line.split(" | ")[1:4] == ["0.1000", "0.1500", "1.500x"]
    wait_line = next(line for line in text.splitlines() if line.startswith("| student wait on teacher"))
    assert wait_line.split(" | ")[1:3] == ["n/a", "0.0300"]
    assert "payload (`TeacherOutputs.bytes_per_token`, the cost model) = 100.0 down" in text
    framed_down = bench.formula_bytes_per_token("topk", 16, None, "bf16", BSZ, SEQLEN)["framed_down"]
    assert f"received = {framed_down:.1f} down" in text
    assert bench.FAIRNESS_NOTE in text and "no prefetch / prefetch" in text


@pytest.mark.timeout(30)
def test_cpu_seconds_per_step_interpolate_the_proc_samples():
    rows = make_rows(20, 0.25, kd=True)
    start, end = rows[4]["time"], rows[-1]["time"]  # the last warm-up row and the last row: 15 steps
    # A student burning 0.8 CPU-s per wall second, the teacher 0.3, sampled every 0.2 s from the handshake.
    launch = 1000.0
    times = [launch + 0.2 * i for i in range(int((end - launch) / 0.2) + 3)]
    samples = {11: [(t, 0.8 * (t - launch)) for t in times], 12: [(t, 0.8 * (t - launch)) for t in times],
               13: [(t, 0.3 * (t - launch)) for t in times], 99: [(t, 5.0) for t in times]}
    assert bench.cpu_seconds_between(samples[11], start, end) == pytest.approx(0.8 * (end - start))
    assert bench.cpu_seconds_between(samples[11], start, end + 100) is None  # beyond the last sample
    per_step = bench.cpu_per_step(samples, {11: "student", 12: "student", 13: "teacher"}, rows, warmup=5)
    assert per_step == {"student": pytest.approx(0.8 * 0.25), "teacher": pytest.approx(0.3 * 0.25)}


def test_missing_teacher_or_corpus_is_named_before_any_launch(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the tiny preset's relative paths point at nothing here
    with pytest.raises(FileNotFoundError, match=r"Teacher directory data/teachers/tiny-llama does not exist, nor does its folder data/teachers; .*"
                                                r"`python -m setup\.make_tiny_teacher --out data/teachers/tiny-llama`"):
        bench.main(["--config", str(bench.ROOT / bench.CONFIG_PRESETS["tiny"]), "--out", str(tmp_path / "out")])
    (tmp_path / "data/teachers/tiny-llama").mkdir(parents=True)  # an interrupted preparation
    with pytest.raises(FileNotFoundError, match=r"Teacher directory data/teachers/tiny-llama is incomplete \(missing "
                                                r"config\.json, .*`python -m setup\.make_tiny_teacher"):
        bench.main(["--config", str(bench.ROOT / bench.CONFIG_PRESETS["tiny"]), "--out", str(tmp_path / "out")])
    make_tiny_teacher(tmp_path / "data/teachers/tiny-llama")
    with pytest.raises(FileNotFoundError, match=r"data\.root_dir 'data/corpus' does not exist; .*"
                                                r"`python -m setup\.prepare_corpus --out data/corpus`"):
        bench.main(["--config", str(bench.ROOT / bench.CONFIG_PRESETS["tiny"]), "--out", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()  # nothing was launched
