"""A 2+1 training run in which one student logs a metric the other does not (a researcher's metric computed on
some ranks only): `dist_mean_dict` must end both students with one sentence naming the key and the ranks, before
the all_reduce that would hang.

Run: torchrun --nproc-per-node 3 -m tests.dist.workers.extra_metric <train overrides...>
Train rank 1 adds `debug/only_on_rank_1` to its log-step metrics from step EXTRA_FROM_STEP on.
"""

import torch.distributed as dist

from apps.main import report
from apps.main.train import main
from lingua.cli.entry import run_cli

EXTRA_KEY = "debug/only_on_rank_1"
EXTRA_FROM_STEP = 2  # a step after the first: the check holds on a run already training, not only at startup
mean_over_students = report.dist_mean_dict


def with_an_extra_metric_on_rank_1(values: dict, group, device, what: str = "metric") -> dict:
    if dist.get_rank(group) == 1 and report_step[0] >= EXTRA_FROM_STEP:
        values = {**values, EXTRA_KEY: 1.0}
    return mean_over_students(values, group, device, what)


report_step = [0]
log_step = report.StepReporter.log_step


def counting_log_step(self, state, *args, **kwargs):
    report_step[0] = state.step
    return log_step(self, state, *args, **kwargs)


if __name__ == "__main__":
    report.dist_mean_dict = with_an_extra_metric_on_rank_1
    report.StepReporter.log_step = counting_log_step
    run_cli(main)
