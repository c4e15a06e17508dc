"""Benchmark of online distillation: the same students with KD off and on, in one invocation.

    python -m apps.bench.distill                                   # tiny random teacher, 2+1 ranks on CPU
    python -m apps.bench.distill --config smollm2                  # SmolLM2-135M-Instruct teacher
    python -m apps.bench.distill --config configs/distill_exps/debug.yaml --nproc 8 --steps 50 --warmup 10
    python -m apps.bench.distill --config tiny --teacher-latency-ms 0,50,100,200 --out DIR   # prefetch 0 vs 1
    python -m apps.bench.distill --config tiny --teacher-tp 1,2 --variants kd_on             # tensor-parallel teacher

With --teacher-latency-ms it measures the teacher look-ahead instead (apps/bench/prefetch_latency.py):
a teacher that takes L ms per request, prefetch 0 vs 1, `DIR/results.json`. Otherwise:

It launches the trainer under torchrun once per variant (and per --repeats, interleaved):

    kd_off              nproc - n_teacher_ranks processes: the students alone, data loaded in a thread
    kd_off_no_prefetch  the same with data.load_async=false (no data producer process)
    kd_on               nproc processes: the same students plus the teacher rank(s)
    kd_on_tp<T>         with --teacher-tp T1,T2,...: kd_on once per distillation.teacher_tp, each teacher replica
                        then T ranks (n_teacher_ranks x T teacher ranks, the same students)

KD off runs with nproc - n_teacher_ranks processes on purpose: launched with nproc processes, the
teacher's rank would become one more student (a larger global batch and data-parallel group), and
the comparison would no longer be between the same students.

Every number comes from the runs' own outputs: `metrics.jsonl` (logging.freq=1 gives one row per
step; the keys read are `METRIC_KEYS`), `startup.<rank>.jsonl` (rank -> pid and role) and each
rank's peak RSS (VmHWM) and CPU time, read from /proc while it runs. Times are medians over the
steps after --warmup. Bridge bytes per token are the client's counters (`kd/bytes_up`,
`kd/bytes_down`: the sizes of the buffers it handed to gather and received from scatter) over the
window, printed next to the wire format's payload (`TeacherOutputs.bytes_per_token`, the cost model)
and framed size (payload plus header, status record and padding). The teacher's busy fraction is
its cumulative busy/idle seconds (`kd/teacher_busy_s`, `kd/teacher_idle_s`) differenced over the
window, so its startup idle time is left out; so are its tokens/s of busy time per rank (the students'
trained tokens are what the teacher forwards, split over its replicas and their ranks) and the share of its
busy time outside the forward and the outputs (`kd/teacher_forward_s`: receiving, checking, sharing the
request with a replica's ranks, replying). Writes `<out>/distill_bench.json` and `<out>/distill_bench.md`
and prints the table.
"""

import argparse
import json
import logging
import os
import shutil
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

import torch
from omegaconf import OmegaConf

from apps.bench.distill_report import FAIRNESS_NOTE, compare, format_markdown
from apps.bench.prefetch_latency import LATENCY_PRESET_OVERRIDES, format_latency_table, run_latency_sweep
from apps.bench.launcher import ROOT, cpu_seconds_between, launch, trainer_command
from apps.main.train import TrainArgs
from lingua.args import parse_args
from lingua.cli.entry import run_cli
from lingua.distillation.args import WIRE_DTYPES
from lingua.distillation.online.bridge import BridgeSpec
from lingua.distillation.outputs import TeacherOutputs
from lingua.distillation.teacher.model import check_teacher_dir
from lingua.errors import ConfigError, LaunchError, MissingPathError, RunFailed
from lingua.run.dump_dir import RunDir, read_startup, train_rows

logger = logging.getLogger(__name__)

CONFIG_PRESETS = {"tiny": "configs/distill_exps/debug_cpu.yaml", "smollm2": "configs/distill_exps/smollm2_cpu.yaml"}
GIB = 1024 ** 3
# Every metrics key this script reads (the trainer's log rows; the kd/ and teacher-wait ones only with KD on).
METRIC_KEYS = ("step", "tokens", "time", "speed/step_time_s", "speed/tokens_per_s", "speed/data_time_s", "mem/peak_gib",
               "stragglers/step_max_s", "stragglers/fwd_bwd_max_s", "stragglers/optimizer_max_s")
KD_METRIC_KEYS = ("speed/teacher_wait_s", "stragglers/teacher_wait_max_s", "kd/teacher_busy_s", "kd/teacher_idle_s",
                  "kd/teacher_forward_s", "kd/teacher_peak_gib", "kd/bytes_up", "kd/bytes_down")


@dataclass(frozen=True)
class Variant:
    name: str
    distillation: bool
    load_async: bool
    teacher_tp: int = 1  # ranks per teacher replica (KD on)


VARIANTS = (
    Variant("kd_off", distillation=False, load_async=True),
    Variant("kd_off_no_prefetch", distillation=False, load_async=False),
    Variant("kd_on", distillation=True, load_async=True),
)


@dataclass
class RunRecord:
    """One trainer launch, reduced to what the summary needs."""

    rows: list[dict]  # training rows of metrics.jsonl (one per step), in step order
    n_students: int
    n_processes: int
    teacher_tp: int = 1
    n_teacher_ranks: int = 0  # of this launch (0 with KD off)
    peak_rss_gib: dict[str, float] = field(default_factory=dict)  # role -> max VmHWM over that role's ranks
    cpu_s_per_step: dict[str, float] = field(default_factory=dict)  # role -> CPU seconds per window step, mean per rank
    load_before: Optional[float] = None  # 1-minute load average when the launch started / ended
    load_after: Optional[float] = None
    wall_s: float = 0.0
    command: list[str] = field(default_factory=list)
    dump_dir: str = ""


# ---------------------------------------------------------------- pure computations

def window(rows: list[dict], warmup: int) -> list[dict]:
    """The measured rows: steps after the warm-up."""
    return [r for r in rows if r["step"] > warmup]


def reference_row(rows: list[dict], warmup: int) -> Optional[dict]:
    """The last warm-up row: cumulative counters are differenced against it (None = from the start)."""
    before = [r for r in rows if r["step"] <= warmup]
    return before[-1] if before else None


def median_of(rows: list[dict], key: str) -> Optional[float]:
    values = [r[key] for r in rows if key in r]
    return statistics.median(values) if values else None


def measured_bytes_per_token(rows: list[dict], warmup: int, n_students: int) -> tuple[Optional[float], Optional[float]]:
    """(up, down) bridge bytes per token of one student over the window, from the client's counters.

    `tokens` in the metrics is summed over the students; the counters are train rank 0's own.
    """
    last, ref = rows[-1], reference_row(rows, warmup)
    if "kd/bytes_up" not in last or "kd/bytes_down" not in last:
        return None, None
    base = ref or {"tokens": 0, "kd/bytes_up": 0, "kd/bytes_down": 0}
    tokens = (last["tokens"] - base["tokens"]) / n_students
    if tokens <= 0:
        return None, None
    return (last["kd/bytes_up"] - base["kd/bytes_up"]) / tokens, (last["kd/bytes_down"] - base["kd/bytes_down"]) / tokens


def teacher_busy_fraction(rows: list[dict], warmup: int) -> Optional[float]:
    """The teacher's busy fraction over the window, from its cumulative busy and idle seconds (None with KD off)."""
    last, ref = rows[-1], reference_row(rows, warmup)
    if "kd/teacher_busy_s" not in last:
        return None
    base = ref or {"kd/teacher_busy_s": 0.0, "kd/teacher_idle_s": 0.0}
    busy = last["kd/teacher_busy_s"] - base["kd/teacher_busy_s"]
    idle = last["kd/teacher_idle_s"] - base["kd/teacher_idle_s"]
    return busy / (busy + idle) if busy + idle > 0 else None


def teacher_serving(rows: list[dict], warmup: int, teacher_tp: int, n_teacher_ranks: int
                    ) -> tuple[Optional[float], Optional[float]]:
    """(teacher tokens/s of busy time per rank, share of busy time outside the forward and outputs) over the
    window; (None, None) with KD off. The rows carry train rank 0's bridge: its replica's clocks, which serve
    1 / n_replicas of the students' tokens."""
    last, ref = rows[-1], reference_row(rows, warmup)
    if "kd/teacher_forward_s" not in last or not n_teacher_ranks:
        return None, None
    base = ref or {"tokens": 0, "kd/teacher_busy_s": 0.0, "kd/teacher_forward_s": 0.0}
    busy = last["kd/teacher_busy_s"] - base["kd/teacher_busy_s"]
    forward = last["kd/teacher_forward_s"] - base["kd/teacher_forward_s"]
    if busy <= 0:
        return None, None
    n_replicas = n_teacher_ranks // teacher_tp
    tokens = (last["tokens"] - base["tokens"]) / n_replicas
    return tokens / busy / teacher_tp, max(busy - forward, 0.0) / busy


def cpu_per_step(samples_by_pid: dict[int, list[tuple[float, float]]], roles: dict[int, str], rows: list[dict],
                 warmup: int) -> dict[str, float]:
    """role -> CPU seconds per step over the window (between the last warm-up row and the last row), mean per rank."""
    start, last = reference_row(rows, warmup) or rows[0], rows[-1]
    n_steps = last["step"] - start["step"]
    per_role: dict[str, list[float]] = {}
    for pid, samples in samples_by_pid.items():
        seconds = cpu_seconds_between(samples, start["time"], last["time"]) if pid in roles and n_steps > 0 else None
        if seconds is not None:
            per_role.setdefault(roles[pid], []).append(seconds / n_steps)
    return {role: sum(values) / len(values) for role, values in per_role.items()}


def formula_bytes_per_token(output: str, k: int, vocab: Optional[int], wire_dtype: str, bsz: int, seqlen: int) -> dict:
    """Bridge bytes per token from the wire format: payload (the cost model) and framed (the buffers sent).

    Framed includes each request's header, the response's status record, alignment and padding to
    the [bsz, seqlen] agreed at the handshake; it equals the payload plus a per-micro-batch constant.
    """
    if output == "full" and vocab is None:
        return dict(up=4.0, down=None, framed_up=None, framed_down=None)
    dtype = WIRE_DTYPES[wire_dtype]
    spec = BridgeSpec(bsz, seqlen, vocab or 0, output, k, dtype)
    tokens = bsz * seqlen
    return dict(up=4.0, down=float(TeacherOutputs.bytes_per_token(output, k, vocab or 0, dtype)),
                framed_up=spec.request_ints() * 4 / tokens, framed_down=spec.response_bytes() / tokens)


def summarize(records: list[RunRecord], warmup: int) -> dict:
    """One variant's numbers: medians over the pooled window rows of its runs, counters averaged per run."""
    rows = [r for rec in records for r in window(rec.rows, warmup)]
    if not rows:
        raise ConfigError(f"No step after the warm-up of {warmup} steps was logged; use more --steps than --warmup.")
    kd_rows = [r for r in rows if "speed/teacher_wait_s" in r]  # the straggler columns exist with KD off too
    shares = [r["speed/teacher_wait_s"] / r["speed/step_time_s"] for r in kd_rows if r["speed/step_time_s"] > 0]
    busy = [teacher_busy_fraction(rec.rows, warmup) for rec in records]
    serving = [teacher_serving(rec.rows, warmup, rec.teacher_tp, rec.n_teacher_ranks) for rec in records]
    measured = [measured_bytes_per_token(rec.rows, warmup, rec.n_students) for rec in records]
    teacher_peaks = [rec.rows[-1]["kd/teacher_peak_gib"] for rec in records if "kd/teacher_peak_gib" in rec.rows[-1]]
    teacher_rss = [rec.peak_rss_gib["teacher"] for rec in records if "teacher" in rec.peak_rss_gib]
    loads = [x for rec in records for x in (rec.load_before, rec.load_after) if x is not None]

    def mean_or_none(values):
        values = [v for v in values if v is not None]
        return sum(values) / len(values) if values else None

    return {
        "runs": len(records),
        "n_processes": records[0].n_processes,
        "n_students": records[0].n_students,
        "steps_measured": len(rows),
        "step_time_s": median_of(rows, "speed/step_time_s"),
        "step_time_min_s": min(r["speed/step_time_s"] for r in rows),
        "step_time_max_s": max(r["speed/step_time_s"] for r in rows),
        "slowest_rank_step_time_s": median_of(rows, "stragglers/step_max_s"),
        "tokens_per_s": median_of(rows, "speed/tokens_per_s"),
        "data_time_s": median_of(rows, "speed/data_time_s"),
        "fwd_bwd_max_rank_s": median_of(rows, "stragglers/fwd_bwd_max_s"),
        "optimizer_max_rank_s": median_of(rows, "stragglers/optimizer_max_s"),
        "teacher_wait_s": median_of(rows, "speed/teacher_wait_s"),
        "teacher_wait_max_rank_s": median_of(kd_rows, "stragglers/teacher_wait_max_s"),
        "teacher_wait_share": statistics.median(shares) if shares else None,
        "teacher_busy": mean_or_none(busy),
        "teacher_tp": records[0].teacher_tp,
        "teacher_tokens_per_s_per_rank": mean_or_none([s[0] for s in serving]),
        "teacher_protocol_share": mean_or_none([s[1] for s in serving]),
        "bytes_up_per_token": mean_or_none([m[0] for m in measured]),
        "bytes_down_per_token": mean_or_none([m[1] for m in measured]),
        "student_cpu_s_per_step": mean_or_none([rec.cpu_s_per_step.get("student") for rec in records]),
        "teacher_cpu_s_per_step": mean_or_none([rec.cpu_s_per_step.get("teacher") for rec in records]),
        "student_peak_gib": max((rec.rows[-1].get("mem/peak_gib", 0.0) for rec in records), default=None),
        "student_peak_rss_gib": max((rec.peak_rss_gib.get("student", 0.0) for rec in records), default=None) or None,
        "teacher_peak_gib": max(teacher_peaks) if teacher_peaks else None,
        "teacher_peak_rss_gib": max(teacher_rss) if teacher_rss else None,
        "cuda": "mem/peak_reserved_gib" in records[0].rows[-1],
        "load_avg_1m": mean_or_none(loads),
        "wall_s": sum(rec.wall_s for rec in records),
    }


def read_rows(dump_dir: Path) -> list[dict]:
    """Training rows of metrics.jsonl (eval rows have no step time), in step order."""
    return [row for _, row in sorted(train_rows(dump_dir).items()) if "speed/step_time_s" in row]


def read_student_vocab(dump_dir: Path) -> Optional[int]:
    """The vocab the run resolved (config.yaml's model.vocab_size), for the full-logits formula."""
    path = RunDir(dump_dir).config
    return OmegaConf.load(path).model.vocab_size if path.exists() else None


def check_inputs(args: TrainArgs) -> None:
    """The teacher and the corpus must be on disk before six launches are spent finding out."""
    check_teacher_dir(Path(args.distillation.teacher_path).expanduser())
    if args.data.root_dir and not Path(args.data.root_dir).is_dir():
        raise MissingPathError(f"data.root_dir '{args.data.root_dir}' does not exist; prepare the offline corpus with "
                               f"`python -m setup.prepare_corpus --out {args.data.root_dir}` or set data.root_dir.")


def run_variant(variant: Variant, name: str, config: str, user_overrides: list[str], n_students: int,
                n_teachers: int, steps: int, warmup: int, runs_dir: Path, timeout_s: float, omp_threads: int) -> RunRecord:
    """Launch one variant into a fresh dump dir and read back what it logged."""
    dump_dir = runs_dir / name
    if dump_dir.exists():
        shutil.rmtree(dump_dir)  # a leftover checkpoint would make the trainer resume instead of start
    n_teacher_ranks = n_teachers * variant.teacher_tp if variant.distillation else 0
    n_processes = n_students + n_teacher_ranks
    overrides = [*user_overrides, f"dump_dir={dump_dir}", f"steps={steps}", "logging.freq=1",
                 "checkpoint.dump.every=0", "checkpoint.eval.every=0", "exit_after_steps=null",
                 f"enable_distillation={str(variant.distillation).lower()}",
                 f"data.load_async={str(variant.load_async).lower()}"]
    if variant.teacher_tp > 1:
        overrides += [f"distillation.teacher_tp={variant.teacher_tp}",
                      f"distillation.n_teacher_ranks={n_teacher_ranks}"]
    command = trainer_command(n_processes, config, overrides)
    logger.info(f"{name}: {n_processes} processes, {steps} steps")
    load_before = os.getloadavg()[0]
    log_path = runs_dir / f"{name}.log"
    rc, wall_s, peaks, cpu_samples = launch(command, log_path, timeout_s, omp_threads)
    if rc != 0:
        tail = "\n".join(log_path.read_text().splitlines()[-30:])
        raise RunFailed(f"benchmark run {name} failed with exit code {rc}; its log is {log_path}:\n{tail}")
    rows = read_rows(dump_dir)
    if not rows:
        raise RunFailed(f"benchmark run {name} wrote no metrics rows to {dump_dir / 'metrics.jsonl'}.")
    shutil.rmtree(dump_dir / "checkpoints", ignore_errors=True)  # the trainer's final save: large, never resumed from
    startup = read_startup(dump_dir)
    roles = {r["pid"]: r["role"] for r in startup}
    peak_rss: dict[str, float] = {}
    for pid, peak in peaks.items():
        if pid in roles:
            peak_rss[roles[pid]] = max(peak_rss.get(roles[pid], 0.0), peak / GIB)
    return RunRecord(rows=rows, n_students=n_students, n_processes=n_processes, teacher_tp=variant.teacher_tp,
                     n_teacher_ranks=n_teacher_ranks, peak_rss_gib=peak_rss,
                     cpu_s_per_step=cpu_per_step(cpu_samples, roles, rows, warmup),
                     load_before=load_before, load_after=os.getloadavg()[0], wall_s=wall_s, command=command,
                     dump_dir=str(dump_dir))


def parse_teacher_tp(text: str) -> list[int]:
    """--teacher-tp "1,2" -> [1, 2]; a readable error for anything but positive integers."""
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise ConfigError(f"--teacher-tp {text}: give ranks per teacher replica, e.g. 2 or 1,2.")
    return values


def with_teacher_tp(variants: list[Variant], degrees: list[int]) -> list[Variant]:
    """kd_on as it is for --teacher-tp 1 alone; otherwise one kd_on_tp<T> per degree, in its place."""
    if degrees == [1]:
        return variants
    out = []
    for variant in variants:
        if variant.distillation:
            out += [Variant(f"{variant.name}_tp{t}", True, variant.load_async, t) for t in degrees]
        else:
            out.append(variant)
    return out


def main(argv: Optional[list[str]] = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="tiny",
                        help=f"a trainer config path, or a preset: {', '.join(f'{k} ({v})' for k, v in CONFIG_PRESETS.items())}")
    parser.add_argument("--nproc", type=int, default=3, help="processes of the KD-on run (students + teacher ranks)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5, help="steps left out of the medians")
    parser.add_argument("--repeats", type=int, default=1, help="runs per variant, interleaved; medians pool them")
    parser.add_argument("--variants", default=",".join(v.name for v in VARIANTS))
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="trainer config override for every run (repeatable), e.g. --set data.batch_size=8")
    parser.add_argument("--omp-threads", type=int, default=1, help="OMP_NUM_THREADS of every rank")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds allowed per run")
    parser.add_argument("--out", default=None, help="result folder (default dumps/bench_distill/<config name>)")
    parser.add_argument("--teacher-latency-ms", default=None, metavar="L[,L...]",
                        help="measure prefetch 0 vs 1 with a teacher taking L ms per request (a sweep with commas)")
    parser.add_argument("--grad-acc", type=int, default=1, help="grad_acc_steps of the --teacher-latency-ms runs")
    parser.add_argument("--teacher-tp", default="1", metavar="T[,T...]",
                        help="distillation.teacher_tp of the KD-on run; several (1,2) run it once per value, the "
                             "teacher replicas then T ranks each, side by side")
    opts = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    config = CONFIG_PRESETS.get(opts.config, opts.config)
    args = parse_args(TrainArgs, [f"config={config}", *opts.overrides, "enable_distillation=true"])
    check_inputs(args)
    n_teachers = args.distillation.n_teacher_ranks
    n_students = opts.nproc - n_teachers
    if n_students < 1:
        raise LaunchError(f"--nproc {opts.nproc} leaves no student next to {n_teachers} teacher rank(s); "
                          f"use --nproc > distillation.n_teacher_ranks.")
    args.validate(world_size=opts.nproc)  # the trainer's own pass, for the KD-on launch, before any launch
    if opts.steps <= opts.warmup:
        raise ConfigError(f"--steps {opts.steps} must exceed --warmup {opts.warmup} so some steps are measured.")
    known = {v.name: v for v in VARIANTS}
    chosen = [known[n] for n in opts.variants.split(",") if n in known]
    if len(chosen) != len(opts.variants.split(",")):
        raise ConfigError(f"--variants {opts.variants}: choose among {', '.join(known)}.")
    chosen = with_teacher_tp(chosen, parse_teacher_tp(opts.teacher_tp))
    for variant in chosen:  # each KD-on launch's plan (its replicas), before any launch
        if variant.teacher_tp > 1:
            tp_args = parse_args(TrainArgs, [f"config={config}", *opts.overrides, "enable_distillation=true",
                                             f"distillation.teacher_tp={variant.teacher_tp}",
                                             f"distillation.n_teacher_ranks={n_teachers * variant.teacher_tp}"])
            tp_args.validate(world_size=n_students + n_teachers * variant.teacher_tp)

    out_dir = Path(opts.out or f"dumps/bench_distill/{Path(config).stem}")
    if opts.teacher_latency_ms is not None:
        try:
            latencies = [float(x) for x in opts.teacher_latency_ms.split(",")]
        except ValueError:
            raise ConfigError(f"--teacher-latency-ms {opts.teacher_latency_ms}: give milliseconds, e.g. 100 or "
                              f"0,50,100,200.") from None
        overrides = (LATENCY_PRESET_OVERRIDES if opts.config == "tiny" else []) + opts.overrides
        results = run_latency_sweep(config, overrides, latencies, opts.nproc, opts.steps, opts.warmup, opts.grad_acc,
                                    out_dir, opts.timeout, opts.omp_threads, read_rows)
        print(format_latency_table(results))
        logger.info(f"wrote {out_dir / 'results.json'}")
        return results
    runs_dir = out_dir / "runs"
    runs_dir.mkdir(parents=True, exist_ok=True)
    load_start = os.getloadavg()
    records: dict[str, list[RunRecord]] = {v.name: [] for v in chosen}
    commands = {}
    for repeat in range(opts.repeats):
        for variant in chosen:
            name = variant.name if opts.repeats == 1 else f"{variant.name}_r{repeat}"
            record = run_variant(variant, name, config, opts.overrides, n_students, n_teachers, opts.steps,
                                 opts.warmup, runs_dir, opts.timeout, opts.omp_threads)
            records[variant.name].append(record)
            commands[name] = record.command

    kd_on = next((name for name in records if name.startswith("kd_on")), None)
    vocab = read_student_vocab(Path(records[kd_on][0].dump_dir)) if kd_on else None
    summaries = {name: summarize(recs, opts.warmup) for name, recs in records.items()}
    result = {
        "settings": {
            "config": config, "nproc": opts.nproc, "n_students": n_students, "n_teacher_ranks": n_teachers,
            "teacher_tp": [v.teacher_tp for v in chosen if v.distillation],
            "steps": opts.steps, "warmup": opts.warmup, "repeats": opts.repeats, "overrides": opts.overrides,
            "batch_size": args.data.batch_size, "seq_len": args.data.seq_len, "grad_acc_steps": args.grad_acc_steps,
            "output": args.distillation.output, "k": args.distillation.k, "wire_dtype": args.distillation.wire_dtype,
            "teacher_path": args.distillation.teacher_path, "vocab": vocab, "omp_threads": opts.omp_threads,
            "device": "cuda" if summaries[chosen[0].name]["cuda"] else "cpu", "cpu_count": os.cpu_count(),
            "torch": torch.__version__, "load_start": [round(x, 2) for x in load_start],
            "load_end": [round(x, 2) for x in os.getloadavg()],
        },
        "summaries": summaries,
        "ratios": compare(summaries),
        "bridge_formula": formula_bytes_per_token(args.distillation.output, args.distillation.k, vocab,
                                                  args.distillation.wire_dtype, args.data.batch_size, args.data.seq_len),
        "commands": commands,
        "runs": {name: [asdict(r) for r in recs] for name, recs in records.items()},
        "note": FAIRNESS_NOTE,
    }
    (out_dir / "distill_bench.json").write_text(json.dumps(result, indent=1))
    markdown = format_markdown(result)
    (out_dir / "distill_bench.md").write_text(markdown)
    print(markdown)
    logger.info(f"wrote {out_dir / 'distill_bench.json'} and {out_dir / 'distill_bench.md'}")
    return result


if __name__ == "__main__":
    run_cli(main)
