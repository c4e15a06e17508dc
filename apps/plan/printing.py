"""The plan as the lines the planner prints, and the JSON file it writes (only over a plan of its own)."""

import json
import shlex
from pathlib import Path

from apps.plan.args import MAX_WAIT_SHARE, PLAN_VERSION
from apps.plan.evidence import SETTINGS, training_command
from lingua.errors import ConfigError

CACHE_PLACEHOLDER = "cache_dir=<cache dir>"  # where to write it: the user's choice (validation names it)


def count(value: float) -> str:
    """8030261248 -> "8.03B"."""
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= scale:
            return f"{value / scale:.3g}{suffix}"
    return f"{value:.3g}"


def size(n_bytes: float) -> str:
    """Bytes in decimal units: 12.4 TB."""
    for scale, suffix in ((1e12, "TB"), (1e9, "GB"), (1e6, "MB"), (1e3, "kB")):
        if n_bytes >= scale:
            return f"{n_bytes / scale:.3g} {suffix}"
    return f"{n_bytes:.0f} B"


def hours(value: float) -> str:
    """Whole hours from 100 up, three digits below (a debug run's hours are not 0)."""
    return f"{value:,.0f}" if value >= 100 else f"{value:.3g}"


def summary_line(layout: dict) -> str:
    """One layout in a line: replicas, students, the wait and the teachers' busy share."""
    return (f"  teacher_tp={layout['teacher_tp']}, {layout['replicas']} replica(s), {layout['students_per_bridge']} "
            f"student(s) each ({layout['students']} students, {layout['n_teacher_ranks']} teacher ranks, placement "
            f"{layout['teacher_placement']}): students wait {layout['wait_share']:.0%} of a step, teachers busy "
            f"{layout['teacher_busy']:.0%}")


def launch_command(inputs: dict, layout: dict) -> str:
    """The command that launches `layout` (the trainer with the plan's config, its keys and the layout's)."""
    return f"{training_command(inputs, 'apps.main.train', True, layout['world_size'])} {layout['overrides']}"


def layout_lines(online: dict, inputs: dict) -> list[str]:
    """The online layout: its summary, memory, bridges, the command that launches it and its launch plan."""
    memory = online["memory_gib"]
    bridge = online["bridge"]
    return [
        summary_line(online),
        f"  memory per teacher rank: {memory['total']:.1f} GiB (weights {memory['weights']:.1f}, activations "
        f"{memory['activations']:.1f}, attention {memory['attention']:.1f}, logits {memory['logits']:.1f}, outputs "
        f"{memory['outputs']:.1f}, reserve {memory['reserve']:.1f})",
        f"  bridge: {bridge['bytes_up_per_token']} B/token up, {bridge['bytes_down_per_token']} down, "
        f"{size(bridge['bytes_per_s'])}/s per bridge; bridges inside nodes: "
        f"{'yes' if online['bridges_inside_nodes'] else 'no'}",
        f"  launch: {launch_command(inputs, online)}",
        *(f"  | {line}" for line in online["launch_plan"]),
    ]


def format_plan(plan: dict) -> list[str]:
    """The plan as the lines the planner prints."""
    inputs, teacher, student, speed = plan["inputs"], plan["teacher"], plan["student"], plan["speed"]
    memory = plan["memory"]
    lines = [
        f"answer: {plan['recommendation']}",
        f"plan: {inputs['config'] or 'the config'} on {inputs['world_size']} GPUs "
        f"({inputs['world_size'] // inputs['gpus_per_node']} node(s) x {inputs['gpus_per_node']}, "
        f"{inputs['gpu_mem_gib']:g} GiB each)",
        f"teacher: {inputs['teacher_config']}: {count(teacher['parameters'])} parameters ({teacher['model_type']}, "
        f"counted as a Llama-family model), {teacher['layers']} layers, hidden {teacher['hidden']}, heads "
        f"{teacher['heads']}/{teacher['kv_heads']} KV, vocab {teacher['vocab']:,}; "
        f"{teacher['forward_flops_per_token'] / 1e9:.3g} GFLOP/token forward",
        f"student: {count(student['parameters'])} parameters, vocab {student['vocab']:,}; "
        f"{student['train_flops_per_token'] / 1e9:.3g} GFLOP/token training; batch {inputs['batch_size']} x "
        f"{inputs['seq_len']} tokens per micro-batch",
        f"speed ({speed['source']}): student {speed['student_tokens_per_s_per_gpu']:,.0f} tokens/s per GPU, teacher "
        f"{speed['teacher_tokens_per_s_per_gpu']:,.0f}: {speed['teacher_gpus_per_student_gpu']:.3g} teacher GPUs per "
        f"student GPU",
        "memory per teacher rank, one student's request ({} usable of {:g} GiB): {}".format(
            f"{memory['usable_gib']:.1f}", inputs["gpu_mem_gib"],
            ", ".join(f"TP{t} {m['total']:.1f} GiB" for t, m in memory["one_student_request"].items())),
        f"  smallest teacher_tp that fits: {memory['min_teacher_tp'] if memory['min_teacher_tp'] else 'none'}",
        *inputs.get("notes", []),
    ]
    online = plan["online"]
    if "teacher_tp" not in online:
        return lines + [f"online: {online['reason']}"]
    lines.append(global_batch_line(plan))
    if online["keeps_up"]:
        lines.append(f"online: keeps the students' wait under {MAX_WAIT_SHARE:.0%} of a step")
    else:
        lines += [f"online: no layout keeps the wait under {MAX_WAIT_SHARE:.0%}: {online['reason']}",
                  "  the most student throughput:"]
    lines += layout_lines(online, inputs)
    if plan.get("smaller_world_that_keeps_up"):
        smaller = plan["smaller_world_that_keeps_up"]
        lines += [f"  world_size={smaller['world_size']} would keep up:", summary_line(smaller),
                  f"  launch: {launch_command(inputs, smaller)}"]
    elif not online["keeps_up"]:
        lines.append("  no smaller world size keeps up either")
    cache = plan["cache"]
    lines += [
        f"cache: {cache['bytes_per_token']:.4g} B/token on disk, {count(cache['cached_tokens'])} tokens "
        + ("per run" if cache["cached_tokens"] == cache["tokens_per_run"] else
           f"(the unique ones, read {cache['tokens_per_run'] / cache['cached_tokens']:.3g} times by a run)")
        + f" -> {size(cache['size_bytes'])}, read at {size(cache['read_bytes_per_s'])}/s by {inputs['world_size']} "
        f"students",
        f"  teacher pass once: {hours(cache['teacher_pass_gpu_hours'])} GPU-hours "
        f"({hours(cache['teacher_pass_hours'])} h on {inputs['world_size']} GPUs); "
        f"then per run {hours(cache['cache_run_gpu_hours'])} GPU-hours "
        f"({hours(cache['cache_run_hours'])} h); online per run {hours(cache['online_run_gpu_hours'])} GPU-hours "
        f"({hours(cache['online_run_hours'])} h)",
        f"  {cache['planned_runs']} planned run(s): cache {hours(cache['cache_gpu_hours'])} GPU-hours, online "
        f"{hours(cache['online_gpu_hours'])} (break-even at {cache['break_even_runs']:.2f} runs)",
    ]
    if cache["writer"]:
        lines += writer_lines(cache["writer"], inputs, cache["cached_tokens"])
    return lines + verdict_lines(plan["verdict"])


def global_batch_line(plan: dict) -> str:
    """Tokens a step distilling and CE-only (data.batch_size is per student rank), and whether the pilot's KD and
    CE-only runs compare at equal global batches."""
    batch, inputs = plan["global_batch"], plan["inputs"]
    acc = f" x {inputs['grad_acc_steps']} micro-batches" if inputs["grad_acc_steps"] > 1 else ""
    verdict = plan.get("verdict", {})
    pilot = ""
    if verdict.get("pilot"):
        pilot = ("; the pilot's CE-only run takes the same global batch (a smaller data.batch_size)"
                 if verdict.get("pilot_equal_global_batch") else
                 "; the pilot's CE-only run keeps data.batch_size, so its global batch is larger (compared per token)")
    return (f"global batch: {batch['students']} students x {inputs['batch_size']} x {inputs['seq_len']}{acc} = "
            f"{batch['distilling']:,} tokens a step distilling (data.batch_size is per student rank); CE-only on "
            f"all {inputs['world_size']} GPUs at this data.batch_size: {batch['ce_only']:,}{pilot}")


def writer_lines(writer: dict, inputs: dict, planned: int) -> list[str]:
    """The cache writer's command and what it writes: streams x windows per stream x tokens per window."""
    exact = (", the planned tokens" if writer["tokens"] == planned else
             f", the planned {planned:,} rounded up to whole windows per stream")
    steps = (f"; train from it on the {writer['streams']} GPUs with steps={writer['train_steps']} (at grad_acc_steps="
             f"{inputs['grad_acc_steps']}, data.batch_size={inputs['batch_size']})" if writer["train_steps"] else "")
    return [f"  write it on the {inputs['world_size']} GPUs ({writer['streams']} streams x "
            f"{writer['sequences_per_stream']:,} windows of {inputs['seq_len']:,} tokens = {writer['tokens']:,} "
            f"tokens{exact}{steps}):",
            f"    {training_command(inputs, 'apps.main.teacher_cache', teacher=True)} {shlex.quote(CACHE_PLACEHOLDER)} "
            f"{writer['overrides']}"]


def nearest_words(measured: dict) -> str:
    """The measurement in a phrase: its arm, study, epochs and sizes."""
    kind = "pilot" if measured.get("pilot") else "one-pass study" if measured["kind"] == "one_pass" else \
        f"data-wall study at E={measured['epochs']:g}"
    settings = measured.get("settings") or {}
    knobs = ", ".join(f"{name} {settings[name]}" for name in SETTINGS if name in settings)
    return (f"{measured['arm']} of {measured['source']} ({measured['owner']} {kind}: student "
            f"{count(measured['student'])}, teacher {count(measured['teacher'])}, {count(measured['tokens'])} tokens"
            + (f", U {count(measured['unique_tokens'])}" if measured["unique_tokens"] else "")
            + (f"; {knobs}" if knobs else "") + ")")


def worth_words(verdict: dict) -> str:
    """What the teacher is worth, finite, and on what evidence."""
    measured = verdict["measured"]
    if measured["bound"] == "beyond":
        best = measured["best"]
        return (f"at least {verdict['worth']:.3g}x: KD below every CE-only budget run and CE had stopped improving; "
                f"{best['multiplier']:.3g}x is the largest multiplier this study measured for {measured['arm']} "
                f"(at E={best['epochs']:g}), and no more is claimed")
    prefix = {"at_least": "at least ", "at_most": "at most "}.get(measured["bound"] or "", "")
    seeds = (f" (seeds {measured['low']:.2f}-{measured['high']:.2f})"
             if measured["low"] is not None and measured["low"] != measured["high"] else "")  # one seed: its value
    return f"{prefix}{verdict['worth']:.3g}x{seeds}"


def unmeasured_words(verdict: dict) -> str:
    def value(v) -> str:
        return count(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and abs(v) >= 1000 else \
            f"{v:.3g}" if isinstance(v, float) else str(v)

    return "; ".join(f"{name} {value(theirs)} measured, {value(ours)} planned"
                     for name, theirs, ours in verdict["unmeasured"])


def verdict_lines(verdict: dict) -> list[str]:
    """Should I distill? the teacher's overhead, the break-even multipliers, the measured worth and its evidence,
    what of the plan is not measured (and the pilot that would measure it), the sentence."""
    over, even, measured = verdict["overhead"], verdict["break_even"], verdict["measured"]
    wall = (f"behind the data wall ({count(verdict['unique_tokens'])} unique tokens, {verdict['epochs']:.3g} epochs; "
            f"effective data U + U*R*(1-exp(-R/R*)), R* = {even['r_star']:g}, Muennighoff et al. 2023): "
            f"{even['repeated_online']:.2f}x online, {even['repeated_cache']:.2f}x from the cache"
            if verdict["unique_tokens"] > 0 else "every token fresh (unique_tokens=0)")
    lines = [
        f"distill? the teacher's forward is {verdict['teacher_over_student_flops']:.3g}x the student's training per "
        f"token: overhead {over['online']:.3g}x online (every epoch); from a cache written once over the unique "
        f"tokens, {verdict['teacher_over_student_flops']:.3g}x / ({verdict['runs']} run(s) x "
        f"{max(verdict['epochs'], 1):.3g} epoch(s)) = {over['cache']:.3g}x",
        f"  break-even token multiplier: {even['fresh_online']:.2f}x online, {even['fresh_cache']:.2f}x from the "
        f"cache on fresh data; {wall}",
        f"  reads {nearest_words(measured)}, compared in {even['compared']}; why this study: {measured['why']}",
        f"  worth: {worth_words(verdict)}",
    ]
    if verdict["unmeasured"]:
        lines.append(f"  not measured here: {unmeasured_words(verdict)}; the multiplier may not transfer")
        pilot = verdict.get("pilot", [])
        cost = f"{hours(verdict['pilot_gpu_hours'])} GPU-hours: " if "pilot_gpu_hours" in verdict else ""
        lines += [f"  the pilot that measures it ({cost}CE-only to twice the KD run's tokens, then KD with the planned "
                  "layout, then the multiplier: CE-only's tokens when its held-out CE first reaches the KD run's "
                  "final, over the KD run's tokens):",
                  *(f"    {command}" for command in pilot)]
        if pilot:
            lines.append(f"    then rerun this plan with kd_measurement={pilot[-1].rsplit('out=', 1)[-1]}")
    if measured["kind"] == "one_pass" and verdict["unique_tokens"] > 0 and verdict["epochs"] > 1:
        lines.append("  warning: the multiplier was measured on fresh data; behind a data wall this assumes the "
                     "teacher is worth the same share of effective data, which is what apps.studies.kd --wall "
                     "measures: run it (or a pilot of it) and pass kd_measurement=<its results.json>")
    return lines


def is_plan_file(path: Path) -> bool:
    """Whether `path` holds a plan this planner wrote, this version or an earlier one (the only kind of file `out=`
    replaces)."""
    try:
        existing = json.loads(path.read_text())
    except (OSError, ValueError, UnicodeDecodeError):
        return False
    version = existing.get("version") if isinstance(existing, dict) else None
    return isinstance(version, int) and 1 <= version <= PLAN_VERSION and "online" in existing


def write_plan(plan: dict, path: Path) -> None:
    """Write the JSON plan, replacing only a plan of ours: any other file at `path` is left as it is."""
    if path.exists() and not is_plan_file(path):
        raise ConfigError(f"out={path} exists and is not a plan written by apps.plan; name another file (or out=null).")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(plan, indent=1) + "\n")
    tmp.replace(path)
