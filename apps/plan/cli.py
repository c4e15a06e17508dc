"""`python -m apps.plan`: parse, validate, plan, print, write."""

import sys
from pathlib import Path
from typing import Optional

from apps.plan.args import PlanArgs
from apps.plan.planner import Planner
from apps.plan.printing import format_plan, verdict_lines, write_plan
from lingua.args import parse_args


def main(argv: Optional[list[str]] = None) -> dict:
    """Parse, validate, plan, print, write; returns the plan."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(PlanArgs, argv)
    args.validate_plan()
    config_path = next((item.split("=", 1)[1] for item in argv if item.startswith("config=")), None)
    plan = Planner(args, config_path).plan()
    print("\n".join(format_plan(plan) if args.show == "all" else verdict_lines(plan["verdict"]) if "verdict" in plan
                    else [f"no verdict: {plan['recommendation']}"]))
    if args.out:
        write_plan(plan, Path(args.out))
        print(f"wrote {args.out}")
    return plan
