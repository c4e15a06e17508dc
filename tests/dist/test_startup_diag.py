"""apps.debug.startup under torchrun on CPU/gloo: 2 students + 1 tiny teacher, one launch per phase."""

import json
import re

import pytest

from tests.runs import assert_ok, distill_overrides, torchrun

pytestmark = pytest.mark.slow  # every test here launches processes

STUDENTS, TEACHER = (0, 1), 2

# Every span in the order a rank records it, with the first phase that records it.
SPANS = {
    "student": [("imports", 1), ("init_process_group", 1), ("setup_torch_distributed", 2), ("rank_map", 2),
                ("all_reduce.world", 1), ("barrier.world", 1), ("barrier.train", 2), ("barrier.bridge_0", 2),
                ("tokenizer_init", 3), ("model_build", 3), ("teacher_handshake", 3), ("optimizer_build", 5),
                ("checkpoint_load", 5), ("data_init", 4), ("first_batch", 4), ("first_step", 5),
                ("first_teacher_round_trip", 5)],
    "teacher": [("imports", 1), ("init_process_group", 1), ("setup_torch_distributed", 2), ("rank_map", 2),
                ("all_reduce.world", 1), ("barrier.world", 1), ("barrier.teachers", 2), ("barrier.bridge_0", 2),
                ("teacher_load", 3), ("teacher_handshake", 3)],
}
ONLY_IN_PHASE_1 = {"init_process_group"}  # the bare init; later phases use setup_torch_distributed
# span, ranks, min s, max s, slowest rank, the highest peak resident GiB at the span's end and its rank
TABLE_ROW = re.compile(r"^(\S+)\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+r(\d+)\s+([\d.]+)\s+r(\d+)$")


def expected_spans(phase: int, role: str) -> list[str]:
    return [name for name, first in SPANS[role]
            if first <= phase and (phase == 1 or name not in ONLY_IN_PHASE_1)]


def summary_table(stdout: str) -> dict[str, tuple[int, float, float, int, float]]:
    """span -> (ranks, min s, max s, slowest rank, highest peak GiB) from rank 0's table."""
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if "[r0 " in line and "all ranks" in line)
    rows = {}
    for line in lines[start + 2:]:
        match = TABLE_ROW.match(line.strip())
        if match is None:
            break
        name, ranks, low, high, slowest, peak, _ = match.groups()
        rows[name] = (int(ranks), float(low), float(high), int(slowest), float(peak))
    return rows


@pytest.mark.timeout(90)
@pytest.mark.parametrize("phase", [1, 2, 3, 4, 5])
def test_startup_phase_records_every_span_on_every_rank(corpus, tiny_teacher, tmp_path, phase):
    dump = tmp_path / "run"
    result = torchrun(3, [f"phase={phase}"] + distill_overrides(corpus, tiny_teacher, dump), timeout=75,
                      module="apps.debug.startup")
    assert_ok(result)

    out_dir = dump / "startup_diag"
    for rank in (*STUDENTS, TEACHER):
        role = "teacher" if rank == TEACHER else "student"
        rows = [json.loads(line) for line in (out_dir / f"startup.{rank}.jsonl").read_text().splitlines()]
        assert [r["phase"] for r in rows] == expected_spans(phase, role), rank
        assert all(r["rank"] == rank and r["role"] == role and r["end"] >= r["start"] for r in rows)
        peaks = [r["peak_rss_gib"] for r in rows]  # the rank's peak so far at each span's end
        assert peaks[0] > 0 and peaks == sorted(peaks) and all("gpu_peak_gib" not in r for r in rows), (rank, peaks)

    table = summary_table(result.stdout)
    all_spans = set(expected_spans(phase, "student")) | set(expected_spans(phase, "teacher"))
    assert set(table) == all_spans, result.stdout[-4000:]
    for name, (ranks, low, high, slowest, peak) in table.items():
        assert 0.05 < peak < 8, (name, peak)  # a python with torch imported, at most a tiny model more
        on_students, on_teacher = name in expected_spans(phase, "student"), name in expected_spans(phase, "teacher")
        assert ranks == 2 * on_students + on_teacher, name
        assert 0.0 <= low <= high
        assert slowest in (STUDENTS if not on_teacher else (TEACHER,) if not on_students else (*STUDENTS, TEACHER))

    if phase >= 3:
        assert result.stdout.count("sent STOP to teacher rank 2") == 2 and "STOP received" in result.stdout
    # A diagnostic leaves the run alone: no checkpoint, metrics or config next to its own files.
    assert sorted(p.name for p in dump.iterdir()) == ["startup_diag"]
