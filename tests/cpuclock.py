"""`pytest -p tests.cpuclock`: each test's CPU-seconds, its process's and the children it waited for (a launch's
torchrun and every rank under it), printed at the end with the wall time beside. CPU-seconds, unlike --durations'
wall time, hold on a machine other work shares: what CI's budget on two saturated cores is made of."""

import resource
import time

import pytest

MEASURED = []  # (CPU-s, wall-s, node id)


def cpu_seconds() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    cpu, wall = cpu_seconds(), time.monotonic()
    yield
    MEASURED.append((cpu_seconds() - cpu, time.monotonic() - wall, item.nodeid))


def pytest_terminal_summary(terminalreporter):
    total = sum(cpu for cpu, _, _ in MEASURED)
    terminalreporter.write_sep("=", f"CPU-seconds per test (setup, call and teardown): {len(MEASURED)} tests, "
                                    f"{total:.1f} CPU-s")
    for cpu, wall, nodeid in sorted(MEASURED, reverse=True)[:40]:
        terminalreporter.write_line(f"{cpu:8.1f} CPU-s {wall:8.1f} s  {nodeid}")
