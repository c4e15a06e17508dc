"""Bench only: the trainer with a teacher that takes a fixed time per request, like a teacher on its own GPU.

    LINGUA_BENCH_TEACHER_LATENCY_MS=100 torchrun --nproc-per-node 3 -m apps.bench.latency_teacher config=...

Every rank runs `apps.main.train` unchanged, except that a teacher rank pads each request's forward
with a sleep up to the latency: the sleep leaves the CPU to the students, as a teacher on another
device would, so the students' wait shows how much of the teacher's time their look-ahead hides.
"""

import os
import time

from apps.main import train
from lingua.cli.entry import run_cli
from lingua.distillation.online.server import TeacherServer

LATENCY_ENV = "LINGUA_BENCH_TEACHER_LATENCY_MS"


def with_latency(forward, latency_s: float):
    def slow_forward(self, students, headers):
        start = time.perf_counter()
        forward(self, students, headers)
        time.sleep(max(0.0, latency_s - (time.perf_counter() - start)))
    return slow_forward


def main() -> None:
    latency_ms = float(os.environ.get(LATENCY_ENV, "0"))
    TeacherServer._forward = with_latency(TeacherServer._forward, latency_ms / 1e3)
    train.main()


if __name__ == "__main__":
    run_cli(main)
