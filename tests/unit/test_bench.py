"""apps.bench.distill: the numbers it derives from metrics rows (no trainer is launched here)."""

import pytest
import torch

from apps.bench import distill as bench
from lingua.kd_loss import TeacherOutputs

BSZ, SEQLEN, STUDENTS = 4, 128, 2
SERVE_START, STARTUP_IDLE = 1000.0, 5.0


def make_rows(steps: int, step_time: float, kd: bool, busy: float = 0.4, counters: bool = True,
              bytes_down_per_token: float = 100.0, warm_step_time: float = 1.0) -> list[dict]:
    """Rows as the trainer logs them with logging.freq=1: a slow first step, then `step_time` each.

    The teacher (kd=True) sits idle for STARTUP_IDLE seconds after the handshake, then is busy a
    fraction `busy` of every step.
    """
    rows, now = [], SERVE_START + STARTUP_IDLE
    busy_s, idle_s = 0.0, STARTUP_IDLE
    tokens_per_step = BSZ * SEQLEN * STUDENTS
    for step in range(1, steps + 1):
        seconds = warm_step_time if step == 1 else step_time
        now += seconds
        row = {"step": step, "tokens": step * tokens_per_step, "speed/step_time_s": seconds,
               "speed/tokens_per_s": tokens_per_step / seconds, "speed/data_time_s": 0.001,
               "stragglers/fwd_bwd_max_s": 0.6 * seconds, "stragglers/optimizer_max_s": 0.1 * seconds,
               "stragglers/step_max_s": seconds, "stragglers/teacher_wait_max_s": 0.0,
               "mem/peak_gib": 0.5 if kd else 0.4, "time": now}
        if kd:
            busy_s, idle_s = busy_s + busy * seconds, idle_s + (1 - busy) * seconds
            row.update({"speed/teacher_wait_s": 0.2 * seconds, "stragglers/teacher_wait_max_s": 0.25 * seconds,
                        "kd/teacher_busy": busy_s / (busy_s + idle_s)})
            if counters:
                per_rank = step * BSZ * SEQLEN
                row.update({"kd/teacher_busy_s": busy_s, "kd/teacher_idle_s": idle_s, "kd/bytes_up": 4 * per_rank,
                            "kd/bytes_down": bytes_down_per_token * per_rank, "kd/teacher_peak_gib": 0.35})
        rows.append(row)
    return rows


def record(rows, kd: bool, teacher_rss=None) -> bench.RunRecord:
    return bench.RunRecord(rows=rows, n_students=STUDENTS, n_processes=STUDENTS + int(kd),
                           teacher_serve_start=SERVE_START if kd else None,
                           peak_rss_gib={"student": 0.45, **({"teacher": teacher_rss} if teacher_rss else {})},
                           cpu_s_per_step={"student": 0.2 if kd else 0.16, **({"teacher": 0.1} if kd else {})},
                           load_before=2.0, load_after=3.0, wall_s=10.0)


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
def test_measured_bytes_agree_with_the_wire_formula():
    formula = bench.formula_bytes_per_token("topk", 16, None, "bf16", BSZ, SEQLEN)
    assert formula["down"] == TeacherOutputs.bytes_per_token("topk", 16, 0, torch.bfloat16) == 16 * (2 + 4) + 4
    assert formula["up"] == 4.0
    # Framed buffers add a per-micro-batch header / status record: a little above the payload.
    assert formula["down"] < formula["framed_down"] < formula["down"] + 10
    assert formula["up"] < formula["framed_up"] < formula["up"] + 1

    rows = make_rows(20, 0.15, kd=True, bytes_down_per_token=formula["down"])
    up, down = bench.measured_bytes_per_token(rows, warmup=5, n_students=STUDENTS)
    assert (up, down) == (pytest.approx(4.0), pytest.approx(formula["down"]))
    assert bench.measured_bytes_per_token(make_rows(20, 0.15, kd=True, counters=False), 5, STUDENTS) == (None, None)

    full = bench.formula_bytes_per_token("full", 16, 1000, "fp32", BSZ, SEQLEN)
    assert full["down"] == 4000.0
    assert bench.formula_bytes_per_token("full", 16, None, "bf16", BSZ, SEQLEN)["down"] is None


@pytest.mark.timeout(30)
def test_teacher_busy_fraction_leaves_out_the_startup_idle_time():
    with_counters = make_rows(20, 0.15, kd=True, busy=0.4)
    without = make_rows(20, 0.15, kd=True, busy=0.4, counters=False)
    assert bench.teacher_busy_fraction(with_counters, 5, None) == (pytest.approx(0.4), "counters")
    assert bench.teacher_busy_fraction(without, 5, SERVE_START) == (pytest.approx(0.4), "derived")
    cumulative, method = bench.teacher_busy_fraction(without, 5, None)
    assert method == "cumulative" and cumulative < 0.2  # diluted by the 5 s idle startup
    assert bench.teacher_busy_fraction(make_rows(5, 0.1, kd=False), 2, None) == (None, "n/a")


@pytest.mark.timeout(30)
def test_teacher_peak_prefers_the_logged_key_over_proc_rss():
    logged = bench.summarize([record(make_rows(10, 0.1, kd=True), kd=True, teacher_rss=0.9)], warmup=2)
    assert (logged["teacher_peak_gib"], logged["teacher_peak_source"]) == (0.35, "kd/teacher_peak_gib")
    proc = bench.summarize([record(make_rows(10, 0.1, kd=True, counters=False), kd=True, teacher_rss=0.9)], warmup=2)
    assert (proc["teacher_peak_gib"], proc["teacher_peak_source"]) == (0.9, "/proc VmHWM")


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
    assert "100.0 down" in text and bench.FAIRNESS_NOTE in text and "no prefetch / prefetch" in text


@pytest.mark.timeout(30)
def test_cpu_seconds_per_step_interpolate_the_proc_samples():
    rows = make_rows(20, 0.25, kd=True)
    start, end = rows[4]["time"], rows[-1]["time"]  # the last warm-up row and the last row: 15 steps
    # A student burning 0.8 CPU-s per wall second, the teacher 0.3, sampled every 0.2 s from the handshake.
    times = [SERVE_START + 0.2 * i for i in range(int((end - SERVE_START) / 0.2) + 3)]
    samples = {11: [(t, 0.8 * (t - SERVE_START)) for t in times], 12: [(t, 0.8 * (t - SERVE_START)) for t in times],
               13: [(t, 0.3 * (t - SERVE_START)) for t in times], 99: [(t, 5.0) for t in times]}
    assert bench.cpu_seconds_between(samples[11], start, end) == pytest.approx(0.8 * (end - start))
    assert bench.cpu_seconds_between(samples[11], start, end + 100) is None  # beyond the last sample
    per_step = bench.cpu_per_step(samples, {11: "student", 12: "student", 13: "teacher"}, rows, warmup=5)
    assert per_step == {"student": pytest.approx(0.8 * 0.25), "teacher": pytest.approx(0.3 * 0.25)}
