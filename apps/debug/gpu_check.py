"""The GPU self-check: the first command to run on a GPU machine.

    bash setup/gpu_check.sh [--quick] [--out DIR] [extra pytest arguments]   # or: python -m apps.debug.gpu_check ...
    bash setup/gpu_check.sh --list     # every check, the GPUs it needs and what it checks; runs nothing

Runs every test marked `cuda` under tests/ (tests/gpu: CUDA-event step timing, flex attention for document masks,
the fused loss's fp32 accumulation, the teacher loaded onto its GPU, no host sync per micro-batch under
`torch.cuda.set_sync_debug_mode`, the NCCL KD run against the gloo one, a teacher failure ending every rank, a
flight-recorder dump on a hang; and those beside the CPU tests, e.g. the teacher-wait clock's CUDA events) and
prints one row per check: passed, FAILED or skipped with the reason, and the GPUs it needs (a check that needs 2
GPUs skips on one; `tests/gpu/gpus.py`'s `needs_gpus(n)` says how many, 1 for a bare `cuda` mark).
Exit status 0 when every check that ran passed and at least one ran, else 1.

Everything lands in one folder, named on the first line (`--out DIR`, default dumps/gpu_check/<UTC time>):
table.txt (the machine line and the table), junit.xml, and tmp/ with each check's own directory (the runs' dump
dirs: metrics, rank logs, flight-recorder traces). `--quick`: the in-process checks only (`cuda and not slow`:
kernels, the teacher's forward, the loss; about a minute on one GPU), no torchrun launches.
"""

import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
CHECKS = ROOT / "tests"  # every test marked cuda, wherever it lives


class CheckTable:
    """A pytest plugin that keeps each check's outcome, seconds and docstring."""

    def __init__(self):
        self.rows: dict[str, dict] = {}

    def pytest_collection_finish(self, session):
        for item in session.items:  # what runs, after `-m cuda` deselected the rest
            doc = " ".join((getattr(item.obj, "__doc__", None) or "").split())
            gpus = item.get_closest_marker("gpus")
            self.rows[item.nodeid] = dict(name=item.name, doc=doc if len(doc) <= 120 else doc[:117] + "...",
                                          outcome="not run", seconds=0.0, reason="", gpus=gpus.args[0] if gpus else 1)

    def pytest_runtest_logreport(self, report):
        row = self.rows.get(report.nodeid)
        if row is None:
            return
        row["seconds"] += report.duration
        if report.skipped:
            row["outcome"] = "skipped"
            row["reason"] = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        elif report.failed:
            row["outcome"] = "FAILED"
            row["reason"] = f"in {report.when}: " + (report.longreprtext.strip().splitlines() or [""])[-1][:160]
        elif report.when == "call" and row["outcome"] == "not run":
            row["outcome"] = "passed"


def machine_line() -> str:
    """torch, CUDA and NCCL versions and the visible GPUs."""
    if not torch.cuda.is_available():
        return f"torch {torch.__version__}: no CUDA GPU visible"
    names = ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
    nccl = ".".join(map(str, torch.cuda.nccl.version())) if hasattr(torch.cuda, "nccl") else "?"
    return f"torch {torch.__version__}, CUDA {torch.version.cuda}, NCCL {nccl}: {torch.cuda.device_count()} GPU(s): {names}"


def format_table(rows: list[dict]) -> str:
    """One line per check: outcome, seconds, GPUs it needs, test name, what it checks (or why it did not run)."""
    lines = [f"{'result':<8} {'s':>6} {'gpus':>4}  check"]
    for row in rows:
        what = row["doc"] or row["name"]
        lines.append(f"{row['outcome']:<8} {row['seconds']:>6.1f} {row['gpus']:>4}  {row['name']}: {what}")
        if row["reason"]:
            lines.append(f"{'':<16}{row['reason']}")
    return "\n".join(lines)


def list_checks(quick: bool, rest: list[str]) -> int:
    """`--list`: each check with the GPUs it needs and what it checks (collected, not run)."""
    table = CheckTable()
    pytest.main([str(CHECKS), "-m", "cuda and not slow" if quick else "cuda", "-qq", "--collect-only",
                 "-p", "no:cacheprovider", "--rootdir", str(ROOT), *rest], plugins=[table])
    rows = sorted(table.rows.values(), key=lambda row: row["gpus"])
    print(f"{'gpus':>4}  check\n" + "\n".join(f"{r['gpus']:>4}  {r['name']}: {r['doc'] or r['name']}" for r in rows))
    print(f"{len(rows)} checks; at most {max((r['gpus'] for r in rows), default=0)} GPUs")
    return 0 if rows else 1


def split_args(argv: list[str]) -> tuple[bool, Path, list[str]]:
    """(--quick, the output folder, the rest for pytest) from the command line."""
    quick, out, rest, args = False, None, [], iter(argv)
    for arg in args:
        if arg == "--quick":
            quick = True
        elif arg == "--out" or arg.startswith("--out="):
            out = arg.split("=", 1)[1] if "=" in arg else next(args, None)
        else:
            rest.append(arg)
    folder = Path(out) if out else ROOT / "dumps" / "gpu_check" / time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    return quick, folder, rest


def main(argv: list[str]) -> int:
    if "--list" in argv:
        quick, _, rest = split_args([arg for arg in argv if arg != "--list"])
        return list_checks(quick, rest)
    quick, out, rest = split_args(argv)
    out.mkdir(parents=True, exist_ok=True)
    print(f"GPU self-check{' (--quick)' if quick else ''}: table and logs in {out}", flush=True)
    machine = machine_line()
    print(machine, flush=True)
    table = CheckTable()
    start = time.time()
    pytest.main([str(CHECKS), "-m", "cuda and not slow" if quick else "cuda", "-q", "-p", "no:cacheprovider",
                 "--rootdir", str(ROOT), f"--basetemp={out / 'tmp'}", f"--junitxml={out / 'junit.xml'}", *rest],
                plugins=[table])
    rows = list(table.rows.values())
    counts = {outcome: sum(r["outcome"] == outcome for r in rows) for outcome in ("passed", "FAILED", "skipped")}
    report = (f"GPU self-check ({time.time() - start:.0f}s{', --quick' if quick else ''})\n" + format_table(rows)
              + f"\n{counts['passed']} passed, {counts['FAILED']} failed, {counts['skipped']} skipped")
    print("\n" + report)
    (out / "table.txt").write_text(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}\n{machine}\n\n{report}\n")
    print(f"table: {out / 'table.txt'}")
    if not counts["passed"] and not counts["FAILED"]:
        print("nothing was checked: run this on a machine with CUDA GPUs (2 for the NCCL checks)")
        return 1
    return 1 if counts["FAILED"] else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
