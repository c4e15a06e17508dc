"""What a KD study measured, and where the plan leaves it: the study's settings, the plan's settings outside them
("not measured here"), and the pilot that would measure them at the plan's sizes.

A study measures one point: one student, one teacher, one token budget (and behind a data wall, one U read for a
few numbers of epochs), one output format, k, alpha, temperature and divergence. A plan further than
SIZE_TOLERANCE from it in any of these, or outside the epochs measured, is "not measured here": the verdict still
reads the nearest measurement, says so, and prints two short runs (CE-only, and KD at the plan's sizes and
settings) that measure the multiplier where the plan stands.
"""

import dataclasses
import math
import re
import shlex
from pathlib import Path
from typing import Optional

SIZE_TOLERANCE = 0.1  # a measurement's size or ratio further than this (relative) from the plan's is not the plan's
SETTINGS = ("output", "k", "alpha", "temperature", "divergence")
ARM_NAME = re.compile(r"kd_(topk|sampled|full)(\d+)")  # kd_topk64: the cache (output, k) the arm read


def measured_settings(results: dict, arm: str, arm_overrides: list[str], file: Path) -> Optional[dict]:
    """{output, k, alpha, temperature, divergence, vocab} the study ran `arm` with: its config file, the study's
    overrides and the arm's (the cache named by the arm sets output and k); None where the config is not found."""
    from apps.main.train import TrainArgs
    from apps.main.transformer import num_parameters
    from lingua.args import parse_args
    from lingua.errors import UserError

    setup = results.get("setup", {})
    config = setup.get("config")
    candidates = [Path(config), file.resolve().parents[2] / config if len(file.resolve().parents) > 2 else None,
                  Path(__file__).resolve().parents[2] / config] if config else []
    found = next((p for p in candidates if p is not None and p.is_file()), None)
    if found is None:
        return None
    student = [f"model.{key}={value}" for key, value in setup.get("student", {}).items()]
    try:
        args = parse_args(TrainArgs, [f"config={found}", *setup.get("overrides", []), *arm_overrides, *student])
    except UserError:
        return None
    kd = args.distillation
    settings = {name: getattr(kd, name) for name in SETTINGS}
    named = ARM_NAME.fullmatch(arm)
    if named:
        settings["output"], settings["k"] = named.group(1), int(named.group(2))
    # The vocabulary from the student's parameter count (embeddings grow linearly with it).
    sizes = [num_parameters(dataclasses.replace(args.model, vocab_size=v)) for v in (1, 2)]
    params = results["compute"]["student"]["params"]
    settings["vocab"] = round((params - sizes[0]) / (sizes[1] - sizes[0])) + 1
    return settings


def unmeasured(measured: dict, plan: dict) -> list[list]:
    """[what, measured, planned] for each way the plan leaves the measurement: sizes and ratios further than
    SIZE_TOLERANCE (a pilot's tokens against the plan's pilot's, `pilot_tokens`), epochs outside the measured
    range, other settings (where `plan` names them; a study that did not record its settings then leaves them all
    unmeasured)."""
    def far(theirs: float, ours: float) -> bool:
        return abs(ours - theirs) > SIZE_TOLERANCE * abs(theirs)

    out = [[name, measured[name], plan[name]] for name in ("student", "teacher") if far(measured[name], plan[name])]
    # A pilot measures at the pilot's length (pilot_steps), by design a fraction of the run: compared with that.
    tokens = "pilot_tokens" if measured.get("pilot") and "pilot_tokens" in plan else "tokens"
    if far(measured["tokens"], plan[tokens]):
        out.append(["tokens" if tokens == "tokens" else "pilot tokens", measured["tokens"], plan[tokens]])
    low, high = measured["epoch_range"]
    if plan["epochs"] < low * (1 - SIZE_TOLERANCE) or plan["epochs"] > high * (1 + SIZE_TOLERANCE):
        out.append(["epochs", f"{low:g}-{high:g}" if low != high else f"{low:g}", plan["epochs"]])
    settings = measured.get("settings")
    if not all(name in plan for name in SETTINGS):  # sizes only
        return out
    if settings is None:
        return out + [[name, "not recorded", plan[name]] for name in SETTINGS]
    if measured["unique_tokens"] and plan["unique_tokens"]:  # U/V: how much of the vocabulary the data holds
        theirs, ours = measured["unique_tokens"] / settings["vocab"], plan["unique_tokens"] / plan["vocab"]
        if far(theirs, ours):
            out.append(["U/V", round(theirs, 3), round(ours, 3)])
    for name in SETTINGS:
        theirs, ours = settings[name], plan[name]
        differs = far(theirs, ours) if isinstance(theirs, (int, float)) and not isinstance(theirs, bool) else \
            theirs != ours
        if differs:
            out.append([name, theirs, ours])
    return out


def pilot_steps(steps: int) -> int:
    """A pilot's KD steps: a twentieth of the run, at least 100 (or the whole run where it is shorter)."""
    return max(min(steps, 100), steps // 20)


def launcher(inputs: dict, world_size: int = 0) -> str:
    """torchrun over the plan's GPUs (whole nodes), or over `world_size` of them."""
    nodes = (world_size or inputs["world_size"]) // inputs["gpus_per_node"]
    return f"torchrun {f'--nnodes {nodes} ' if nodes > 1 else ''}--nproc-per-node {inputs['gpus_per_node']}"


def training_command(inputs: dict, module: str, teacher: bool = False, world_size: int = 0) -> str:
    """`torchrun ... -m <module> config=<the plan's config> <the training overrides planned with>`, with the keys
    the plan adds (apps/plan/tokenizers.py: the students' tokenizer; with `teacher`, the teacher's path), each
    quoted for the shell (a placeholder's <> would be a redirection)."""
    keys = inputs.get("overrides", []) + inputs.get("tokenizer_keys", []) + \
        (inputs.get("teacher_keys", []) if teacher else [])
    config = shlex.quote(f"config={inputs['config'] or '<config>'}")
    return f"{launcher(inputs, world_size)} -m {module} {config}" + "".join(f" {shlex.quote(key)}" for key in keys)


def pilot_ce_batch(inputs: dict, online: dict) -> int:
    """The CE-only pilot's data.batch_size for the KD pilot's global batch on every GPU (data.batch_size is per
    student rank: S students x B = W ranks x B'); 0 where S x B does not split over the W ranks evenly."""
    rows = inputs["batch_size"] * online.get("students", 1)
    return rows // inputs["world_size"] if rows % inputs["world_size"] == 0 else 0


def pilot_commands(inputs: dict, online: dict, dump_dir: str, steps: int) -> list[str]:
    """The two runs that measure the multiplier at the plan's sizes and settings: CE-only on every GPU to twice the
    KD run's tokens at the KD run's global batch where it splits evenly (pilot_ce_batch; else at the config's
    data.batch_size, whose larger global batch the plan states), its curve what KD's final held-out CE is read
    against, and KD with the planned layout (`online`: its overrides and student count); then `apps.plan.pilot`,
    which reads both and writes the results.json for kd_measurement= (pilot_results_path)."""
    kd_steps, ce_batch = pilot_steps(steps), pilot_ce_batch(inputs, online)
    ce_steps = 2 * kd_steps if ce_batch else math.ceil(2 * kd_steps * online.get("students", 1) / inputs["world_size"])
    teacher = f" teacher_config={shlex.quote(inputs['teacher_config'])}" if inputs.get("teacher_config") else ""
    return [f"{training_command(inputs, 'apps.main.train')} enable_distillation=false"
            + (f" data.batch_size={ce_batch}" if ce_batch else "")
            + f" steps={ce_steps} heldout.every={max(1, ce_steps // 20)} dump_dir={dump_dir}_pilot_ce",
            f"{training_command(inputs, 'apps.main.train', teacher=True)} "
            f"{online.get('overrides', 'enable_distillation=true')} steps={kd_steps} "
            f"heldout.every={kd_steps} dump_dir={dump_dir}_pilot_kd",
            f"python -m apps.plan.pilot ce={dump_dir}_pilot_ce kd={dump_dir}_pilot_kd{teacher} "
            f"out={pilot_results_path(dump_dir)}"]


def pilot_gpu_hours(inputs: dict, online: dict, steps: int, student_tokens_per_s: float) -> float:
    """GPU-hours of the two pilot runs on the plan's GPUs: CE-only's tokens (twice the KD run's) at a student GPU's
    speed on every GPU, and the KD run's at the planned layout's student throughput (its waits included)."""
    kd_tokens = pilot_tokens(inputs, online, steps)
    ce_hours = 2 * kd_tokens / student_tokens_per_s / 3600
    kd_hours = kd_tokens / max(online.get("student_tokens_per_s", 1), 1) * inputs["world_size"] / 3600
    return ce_hours + kd_hours


def pilot_results_path(dump_dir: str) -> str:
    """Where the plan's pilot command writes its measurement."""
    return f"{dump_dir}_pilot.json"


def pilot_tokens(inputs: dict, online: dict, steps: int) -> int:
    """The KD tokens of the plan's pilot: its steps (pilot_steps) x the planned layout's tokens per step."""
    return pilot_steps(steps) * inputs["grad_acc_steps"] * inputs["batch_size"] * inputs["seq_len"] * \
        online.get("students", 1)

