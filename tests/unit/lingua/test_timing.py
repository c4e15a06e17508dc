"""StepTimer (each part's own seconds, the arrival at the step's first collective), the straggler columns, and the
startup table's peak memory per phase."""

import json

import pytest
import torch

from apps.main.report import STEP_PARTS, straggler_metrics
from lingua import timing
from lingua.timing import PhaseLog, StepTimer, phase_table, read_phase_files


class FakeClock:
    """lingua.timing's clock, advanced only by `sleep`: the parts' seconds are exact, whatever the machine's load
    (run_tests.sh runs these tests beside the slow tier's launches)."""

    def __init__(self):
        self.now = 1000.0

    def perf_counter(self) -> float:
        return self.now

    time = perf_counter

    def sleep(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock(monkeypatch) -> FakeClock:
    fake = FakeClock()
    monkeypatch.setattr(timing, "time", fake)
    return fake


def test_a_nested_part_is_not_counted_in_the_enclosing_one(clock):
    timer = StepTimer()
    with timer.part("fwd_bwd"):
        clock.sleep(0.02)
        with timer.part("teacher_wait"):
            clock.sleep(0.05)
    seconds = timer.read()
    assert seconds["teacher_wait"] == pytest.approx(0.05)
    assert seconds["fwd_bwd"] == pytest.approx(0.02)  # its own 20 ms, not the 70 ms the block lasted
    assert timer.entered == {"fwd_bwd", "teacher_wait"}
    assert timer.read() == seconds  # reading again changes nothing
    timer.reset()
    assert timer.read() == {} and timer.entered == set()


def test_arrival_counts_from_the_last_common_point_across_steps(clock):
    timer = StepTimer()
    timer.common_point()
    clock.sleep(0.03)  # after the agreed point: the previous step's save, log, eval ...
    timer.reset()  # ... then the next step starts
    clock.sleep(0.02)
    timer.arrive()
    assert timer.arrival_s == pytest.approx(0.05)
    timer.common_point()
    timer.arrive()
    assert timer.arrival_s == 0.0


def per_rank_row(parts: dict, step: float, arrival: float) -> list[float]:
    return [parts.get(p, 0.0) for p in STEP_PARTS] + [step, arrival]


def test_the_late_rank_is_the_slowest_step_not_the_ranks_that_waited_for_it():
    # Rank 1 stalls 4 s before its first forward; rank 0 spends those 4 s waiting inside its forward.
    rows = [per_rank_row({"fwd_bwd": 4.3, "data": 0.01}, step=4.5, arrival=0.02),
            per_rank_row({"fwd_bwd": 0.3, "data": 0.01}, step=4.5, arrival=4.02)]
    row = straggler_metrics(rows, ranks=[0, 1])
    assert row["stragglers/step_slowest_rank"] == 1 and row["stragglers/step_max_s"] == pytest.approx(4.5)
    assert row["stragglers/step_min_s"] == pytest.approx(0.5)  # rank 0's step without its 4 s wait
    assert row["stragglers/arrival_slowest_rank"] == 1 and row["stragglers/arrival_max_s"] == pytest.approx(4.02)
    assert row["stragglers/fwd_bwd_slowest_rank"] == 0  # the waiter's forward absorbed the stall


def test_without_a_late_rank_the_step_columns_are_the_step_times():
    rows = [per_rank_row({"fwd_bwd": 0.3}, step=0.42, arrival=0.01),
            per_rank_row({"fwd_bwd": 0.35}, step=0.47, arrival=0.01)]
    row = straggler_metrics(rows, ranks=[3, 5])  # global ranks of the students
    assert row["stragglers/step_max_s"] == pytest.approx(0.47) and row["stragglers/step_slowest_rank"] == 5
    assert row["stragglers/step_min_s"] == pytest.approx(0.42)


def test_each_startup_phase_records_the_ranks_peak_memory_and_the_table_shows_the_highest(tmp_path):
    """A phase that allocates raises its record's peak resident memory (ru_maxrss); the table gives, per phase, the
    highest peak over the ranks and its rank; no GPU column where no rank used CUDA."""
    phases = PhaseLog(str(tmp_path), 0, "student")
    with phases.span("tokenizer_init"):
        pass
    with phases.span("model_build"):
        held = torch.ones(64 * 2**20, dtype=torch.uint8)  # 64 MiB, touched: resident
        held.add_(1)
    rows = [json.loads(line) for line in (tmp_path / "startup.0.jsonl").read_text().splitlines()]
    assert [r["phase"] for r in rows] == ["tokenizer_init", "model_build"]
    assert all("gpu_peak_gib" not in r for r in rows) or torch.cuda.is_initialized()
    before, after = rows[0]["peak_rss_gib"], rows[1]["peak_rss_gib"]
    assert 0 < before <= after  # the peak so far never goes down
    # Another rank's file, written as a rank on a larger host would: its peak is the table's.
    other = {**rows[1], "rank": 1, "peak_rss_gib": after + 5.0, "seconds": 0.0}
    (tmp_path / "startup.1.jsonl").write_text(json.dumps(other) + "\n")
    assert read_phase_files(str(tmp_path), field="peak_rss_gib") == {"tokenizer_init": {0: before},
                                                                       "model_build": {0: after, 1: after + 5.0}}
    header, first, build = phase_table(str(tmp_path)).splitlines()
    assert header.split()[-3:] == ["peak", "GiB", "at"] and "GPU" not in header
    assert build.split()[0] == "model_build" and build.split()[-2:] == [f"{after + 5.0:.2f}", "r1"]
    assert first.split()[-2:] == [f"{before:.2f}", "r0"]
    del held
