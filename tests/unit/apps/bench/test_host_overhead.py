"""apps.bench.host_overhead's smoke test: the minimal loop runs and its medians and table come out (the bench itself
launches torchrun for minutes: a command, docs/benchmarks.md, not a CI step)."""

import json

import pytest

from apps.bench.host_overhead import PARTS, median_ms, minimal_loop, table


@pytest.mark.bench  # the host-overhead bench run: the bench tier
@pytest.mark.timeout(120)
def test_the_minimal_loop_times_its_steps_and_the_table_shows_them(tmp_path):
    rows_path = tmp_path / "minimal.json"
    minimal_loop(fsdp=False, out=rows_path, steps=3)
    rows = json.loads(rows_path.read_text())
    assert [row["n"] for row in rows] == [1, 2, 3]
    medians = median_ms(rows, first=2)
    assert set(medians) == {key for part in PARTS for key in (part, f"{part}_cpu")}
    assert all(value > 0 for value in medians.values())
    assert medians["step"] >= medians["fwd_bwd"] and medians["step_cpu"] >= medians["optimizer_cpu"]
    text = table({"loops": {"minimal, 1 process": medians, "ours, 1 rank(s)": medians},
                  "ours_1_over_minimal": {"step_cpu": 1.0, "step": 1.0}})
    assert "| minimal, 1 process |" in text and "ours_1_over_minimal" in text
