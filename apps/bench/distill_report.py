"""The distillation benchmark's report: its numbers as a markdown table with the settings and notes."""

from typing import Optional

FAIRNESS_NOTE = (
    "KD off runs nproc - n_teacher_ranks processes: with nproc processes the teacher's rank would become "
    "one more student (larger global batch and data-parallel group), so KD on and KD off would no longer "
    "train the same students."
)

TABLE_ROWS = (
    # label, summary key, format, ratio group shown in the last columns
    ("processes (students + teachers)", "n_processes", "{:d}", None),
    ("steps measured (after warm-up)", "steps_measured", "{:d}", None),
    ("step time, median (s)", "step_time_s", "{:.4f}", "step_time_s"),
    ("step time, min / max (s)", ("step_time_min_s", "step_time_max_s"), "{:.3f} / {:.3f}", None),
    ("slowest student's step, median (s)", "slowest_rank_step_time_s", "{:.4f}", None),
    ("tokens/s (all students), median", "tokens_per_s", "{:,.0f}", "tokens_per_s"),
    ("data wait per step, median (s)", "data_time_s", "{:.5f}", "data_time_s"),
    ("student fwd+bwd without teacher wait, slowest rank (s)", "fwd_bwd_max_rank_s", "{:.4f}", "fwd_bwd_max_rank_s"),
    ("optimizer step, slowest rank (s)", "optimizer_max_rank_s", "{:.4f}", None),
    ("student CPU-seconds per step (mean per student)", "student_cpu_s_per_step", "{:.4f}", "student_cpu_s_per_step"),
    ("teacher CPU-seconds per step", "teacher_cpu_s_per_step", "{:.4f}", None),
    ("student wait on teacher per step, median (s)", "teacher_wait_s", "{:.4f}", None),
    ("  same, slowest student (s)", "teacher_wait_max_rank_s", "{:.4f}", None),
    ("  share of the step, median", "teacher_wait_share", "{:.1%}", None),
    ("teacher busy fraction (window)", "teacher_busy", "{:.1%}", None),
    ("teacher tokens/s of busy time, per teacher rank", "teacher_tokens_per_s_per_rank", "{:,.0f}", None),
    ("teacher busy time outside forward + outputs", "teacher_protocol_share", "{:.1%}", None),
    ("bridge bytes/token up, buffers sent", "bytes_up_per_token", "{:.1f}", None),
    ("bridge bytes/token down, buffers received", "bytes_down_per_token", "{:.1f}", None),
    ("student peak memory (trainer mem/peak_gib, GiB)", "student_peak_gib", "{:.3f}", "student_peak_gib"),
    ("student peak RSS, max over students (GiB)", "student_peak_rss_gib", "{:.3f}", "student_peak_rss_gib"),
    ("teacher peak memory, largest rank (kd/teacher_peak_gib, GiB)", "teacher_peak_gib", "{:.3f}", None),
    ("teacher peak RSS, largest rank (GiB)", "teacher_peak_rss_gib", "{:.3f}", None),
    ("load average (1 min) during the runs", "load_avg_1m", "{:.2f}", None),
)


def _cell(summary: Optional[dict], key, fmt: str) -> str:
    if summary is None:
        return ""
    keys = key if isinstance(key, tuple) else (key,)
    values = [summary.get(k) for k in keys]
    if any(v is None for v in values):
        return "n/a"
    return fmt.format(*values)


def format_markdown(result: dict) -> str:
    """The result as markdown: settings, the comparison table, bridge formula and notes."""
    summaries, ratios = result["summaries"], result["ratios"]
    names = list(summaries)  # kd_off, kd_off_no_prefetch, kd_on or kd_on_tp<T> per --teacher-tp, as run
    kd_ratio = ratios.get("kd_on_over_kd_off", {})
    prefetch_ratio = ratios.get("no_prefetch_over_prefetch", {})
    header = ["metric", *names, "KD on / KD off", "no prefetch / prefetch"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for label, key, fmt, ratio_key in TABLE_ROWS:
        cells = [_cell(summaries[n], key, fmt) for n in names]
        ratios_cells = ["", ""]
        if ratio_key is not None:
            for i, group in enumerate((kd_ratio, prefetch_ratio)):
                if group.get(ratio_key) is not None:
                    ratios_cells[i] = f"{group[ratio_key]:.3f}x"
        lines.append("| " + " | ".join([label, *cells, *ratios_cells]) + " |")
    settings = result["settings"]
    formula = result["bridge_formula"]
    kd_on = summaries.get("kd_on") or next((summaries[n] for n in names if n.startswith("kd_on")), {})
    tensor_parallel = [f"{key.replace('_over_', ' / ')}: " + ", ".join(
        f"{name} {value:.3f}x" for name, value in values.items() if value is not None)
        for key, values in ratios.items() if key.startswith("kd_on_tp")]

    def fmt_bytes(value):
        return "n/a" if value is None else f"{value:.1f}"

    def fmt_ratio(value):
        return "n/a" if value is None else f"{value:.3f}"

    notes = [
        f"# Distillation benchmark: {settings['config']}",
        "",
        f"{settings['steps']} steps per run, medians over steps {settings['warmup'] + 1}..{settings['steps']}, "
        f"{settings['repeats']} run(s) per variant (interleaved); batch {settings['batch_size']} x {settings['seq_len']}"
        f" x grad_acc {settings['grad_acc_steps']} per student; teacher output {settings['output']} k={settings['k']} "
        f"wire {settings['wire_dtype']}; device {settings['device']}; OMP_NUM_THREADS={settings['omp_threads']}.",
        f"Machine: {settings['cpu_count']} CPUs, load average {settings['load_start']} at start, "
        f"{settings['load_end']} at end.",
        "",
        *lines,
        "",
        f"Bridge bytes per token (one student): counted by the client from the buffers it sent and received = "
        f"{fmt_bytes(kd_on.get('bytes_down_per_token'))} down, {fmt_bytes(kd_on.get('bytes_up_per_token'))} up; "
        f"wire format: payload (`TeacherOutputs.bytes_per_token`, the cost model) = {fmt_bytes(formula['down'])} "
        f"down, {fmt_bytes(formula['up'])} up, framed (plus header, status record, padding) = "
        f"{fmt_bytes(formula['framed_down'])} down, {fmt_bytes(formula['framed_up'])} up.",
        f"Teacher CPU-seconds per step / one student's: {fmt_ratio(ratios.get('teacher_cpu_over_student_cpu'))} "
        f"(the cost model of docs/distillation_internals.md: s * N_T / (3 * N_S) in FLOPs for s students per teacher).",
        *(["", "Tensor-parallel teacher, each degree against the first:", *[f"- {line}" for line in tensor_parallel]]
          if tensor_parallel else []),
        "",
        "Notes:",
        f"- {FAIRNESS_NOTE}",
        "- CPU-seconds per step come from /proc/<pid>/stat between the last warm-up row and the last row; on a "
        "machine shared with other jobs they move less than wall-clock step times, which include waiting for a core.",
        "- Teacher busy fraction: the teacher's busy / (busy + idle) seconds over the window (its clock starts at "
        "the handshake; on CUDA busy ends when its stream has run the forward). Peak memory (mem/peak_gib, "
        "kd/teacher_peak_gib): on CPU the process RSS (VmHWM, since start), on GPU the CUDA peak allocated.",
        "- logging.freq=1 (one metrics row per step, which adds one small gather per step to every variant); "
        "periodic checkpoints off.",
        "- On a CPU machine the teacher rank shares the cores with the students: the KD-on step time includes that "
        "contention, which a GPU per rank would not have. A tensor-parallel replica's ranks meet in several "
        "collectives per layer, so on shared cores each waits for the others to be scheduled: its CPU numbers "
        "are a floor, not a GPU's.",
        "",
        "Commands:",
        *[f"- `{name}`: `{' '.join(cmd)}`" for name, cmd in result["commands"].items()],
    ]
    return "\n".join(notes) + "\n"


def ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return a / b if a is not None and b not in (None, 0) else None


def compare(summaries: dict[str, dict]) -> dict:
    """KD on vs KD off (same students), prefetch off vs on (KD off), and each tensor-parallel degree vs the first."""
    on, off, no_prefetch = summaries.get("kd_on"), summaries.get("kd_off"), summaries.get("kd_off_no_prefetch")
    out = {}
    degrees = [name for name in summaries if name.startswith("kd_on_tp")]
    for name in degrees[1:]:
        out[f"{name}_over_{degrees[0]}"] = {key: ratio(summaries[name][key], summaries[degrees[0]][key]) for key in
                                            ("step_time_s", "teacher_wait_s", "teacher_tokens_per_s_per_rank",
                                             "teacher_protocol_share", "teacher_peak_gib", "teacher_peak_rss_gib")}
    if on and off:
        out["kd_on_over_kd_off"] = {key: ratio(on[key], off[key]) for key in
                                    ("step_time_s", "tokens_per_s", "fwd_bwd_max_rank_s", "student_cpu_s_per_step",
                                     "student_peak_gib", "student_peak_rss_gib")}
        out["teacher_cpu_over_student_cpu"] = ratio(on["teacher_cpu_s_per_step"], on["student_cpu_s_per_step"])
    if off and no_prefetch:
        out["no_prefetch_over_prefetch"] = {key: ratio(no_prefetch[key], off[key]) for key in
                                            ("step_time_s", "tokens_per_s", "data_time_s", "fwd_bwd_max_rank_s",
                                             "student_cpu_s_per_step")}
    return out
