"""The tiers CI runs and the one it does not: the bench tier (benchmarks and studies end to end) is left out of
every run whose -m does not name it, so setup/run_tests.sh without arguments (CI) never runs it, and
`bash setup/run_tests.sh -m bench` runs it alone."""

import re
import shlex
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.conftest import bench_left_out

ROOT = Path(__file__).resolve().parents[2]


def item(nodeid: str, *markers: str):
    return SimpleNamespace(nodeid=nodeid, get_closest_marker=lambda name: name if name in markers else None)


BENCH = item("tests/unit/apps/bench/test_feeding.py::test_tiny", "bench", "slow")
BENCH_PARAMETRIZED = item("tests/unit/apps/bench/test_loss_step.py::test_table[topk]", "bench")
PLAIN, SLOW = item("tests/unit/test_docs.py::test_x"), item("tests/dist/test_train.py::test_y", "slow")
ALL = [BENCH, BENCH_PARAMETRIZED, PLAIN, SLOW]


@pytest.mark.parametrize("markexpr", ["", "not slow", "slow", "slurm or slow"])
def test_every_run_that_does_not_name_bench_leaves_the_bench_tier_out(markexpr):
    assert bench_left_out(ALL, markexpr, named=[]) == [BENCH, BENCH_PARAMETRIZED]


@pytest.mark.parametrize("markexpr", ["bench", "bench and not slow", "not bench"])
def test_a_run_that_names_bench_leaves_the_choice_to_the_marker_expression(markexpr):
    assert bench_left_out(ALL, markexpr, named=[]) == []


def test_a_bench_test_named_by_its_node_id_runs():
    named = ["tests/unit/apps/bench/test_loss_step.py::test_table"]  # its function: every parameter
    assert bench_left_out(ALL, "", named) == [BENCH]
    assert bench_left_out(ALL, "", [BENCH.nodeid]) == [BENCH_PARAMETRIZED]


def test_ci_runs_the_fast_and_the_slow_tier_and_never_names_bench():
    """Every pytest run in setup/run_tests.sh's no-argument path selects with `-m slow` or `-m "not slow"`."""
    script = (ROOT / "setup" / "run_tests.sh").read_text()
    no_argument_path = script.split('if [ $# -gt 0 ]; then', 1)[1]
    expressions = {shlex.split(match)[0] for match in re.findall(r"\btier -m (\"[^\"]+\"|\S+)", no_argument_path)}
    assert expressions == {"slow", "not slow"}, expressions


def test_every_bench_test_is_a_benchmark_or_a_study():
    """The bench tier holds the tools' end-to-end runs, never a product test that CI would then miss."""
    marked = sorted(str(path.relative_to(ROOT)) for path in (ROOT / "tests").rglob("test_*.py")
                    if re.search(r"^@pytest\.mark\.bench\b", path.read_text(), re.M))
    tools = ("tests/unit/apps/bench/", "tests/unit/apps/studies/")
    assert marked and all(path.startswith(tools) for path in marked), marked
