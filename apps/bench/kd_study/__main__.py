"""`python -m apps.bench.kd_study ...`: the study's command line (apps/bench/kd_study/study.py)."""

from apps.bench.kd_study.study import main
from lingua.cli import run_cli

if __name__ == "__main__":
    run_cli(main)
