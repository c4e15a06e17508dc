"""`python -m apps.plan ...`: the planner's command line (apps/plan/cli.py)."""

from apps.plan.cli import main
from lingua.cli.entry import run_cli

if __name__ == "__main__":
    run_cli(main)
