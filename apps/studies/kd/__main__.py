"""`python -m apps.studies.kd ...`: the study's command line (apps/studies/kd/study.py)."""

from apps.studies.kd.study import main
from lingua.cli.entry import run_cli

if __name__ == "__main__":
    run_cli(main)
