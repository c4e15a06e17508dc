"""`python -m apps.plan`: parse, validate, plan, print, write."""

import dataclasses
import sys
from pathlib import Path
from typing import Optional

from apps.main.train import TrainArgs
from apps.plan.args import PlanArgs
from apps.plan.planner import Planner
from apps.plan.printing import format_plan, verdict_lines, write_plan
from apps.plan.teachers import format_teachers_plan, plan_teachers, teacher_planner
from lingua.args import parse_args


def training_overrides(argv: list[str]) -> list[str]:
    """The command line's training keys (not config= nor the planner's own), for the commands the plan prints."""
    planner_keys = {f.name for f in dataclasses.fields(PlanArgs)} - {f.name for f in dataclasses.fields(TrainArgs)}
    return [item for item in argv if item.split("=", 1)[0].split(".", 1)[0] not in planner_keys | {"config"}]


def main(argv: Optional[list[str]] = None) -> dict:
    """Parse, validate, plan, print, write; returns the plan."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(PlanArgs, argv)
    args.validate_plan()
    config_path = next((item.split("=", 1)[1] for item in argv if item.startswith("config=")), None)
    if len(args.distillation.teachers) > 1:  # each teacher at its configured ranks, online only
        plan = plan_teachers(args, config_path, training_overrides(argv))
        lines = format_teachers_plan(plan) if args.show == "all" else [
            f"answer: {plan['recommendation']}", "no verdict: the KD studies measured one teacher"]
    else:  # one teacher, by its keys or as a list of one: the planner picks its ranks
        one = args if not args.distillation.teachers else teacher_planner(args, 0).args
        plan = Planner(one, config_path, training_overrides(argv)).plan()
        lines = format_plan(plan) if args.show == "all" else [f"answer: {plan['recommendation']}"] + (
            verdict_lines(plan["verdict"]) if "verdict" in plan else [])
    print("\n".join(lines))
    if args.out:
        write_plan(plan, Path(args.out))
        print(f"wrote {args.out}")
    return plan
