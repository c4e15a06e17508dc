"""Loading a tensor-parallel teacher: every rank reading only its own shards from the safetensors files (the
default) against every rank loading the whole teacher on its host and slicing it (the fallback for checkpoints
whose tensor names are not the model's), one torchrun launch per way and teacher_tp, on CPU and gloo.

    python -m apps.bench.tp_load --teacher data/teachers/smollm2-135m-instruct --tp 1,3 --out dumps/tp_load

Each rank reports its load seconds, the checkpoint bytes it read, its peak host RSS (VmHWM) and what loading
added to it (VmHWM after minus VmRSS before). teacher_tp=1 is the one-rank teacher (transformers'
from_pretrained). Writes <out>/tp_load.json and prints a table.
"""

import argparse
import json
import re
import os
import subprocess
import time
from datetime import timedelta
from pathlib import Path

from apps.bench.runs import ROOT, torchrun_command
from lingua.cli import run_cli
from lingua.errors import RunFailed

MODES = ("streamed", "host")
MIB = 2**20


def proc_status_bytes(field: str) -> int:
    """This process's VmRSS / VmHWM from /proc (kB there)."""
    match = re.search(rf"^{field}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.MULTILINE)
    return int(match.group(1)) * 1024


def worker(teacher: str, mode: str, out_dir: Path) -> None:
    """One rank of a launch: load the teacher `mode`'s way and write rank<r>.json."""
    import torch
    import torch.distributed as dist

    from lingua.distillation.args import DistillationArgs
    from lingua.distillation.teacher import TeacherModel, load_teacher
    from lingua.distillation.tensor_parallel import shard_teacher

    dist.init_process_group("gloo", timeout=timedelta(seconds=600))
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(list(range(world)), group_desc="teacher_tp_0")
    args = DistillationArgs(teacher_path=teacher, teacher_dtype="fp32")
    cpu = torch.device("cpu")
    rss_before, start = proc_status_bytes("VmRSS"), time.perf_counter()
    read_bytes = None
    if world == 1:
        load_teacher(args, cpu)
    elif mode == "streamed":
        teacher_model = TeacherModel(args, cpu, tp_group=group)
        if teacher_model.checkpoint is None:
            raise RunFailed(f"{teacher} could not be streamed (see the warning above); nothing to compare.")
        read_bytes = teacher_model.checkpoint.read_bytes
    else:
        model, _ = load_teacher(args, cpu, place=False)
        shard_teacher(model, group, cpu)
    load_s = time.perf_counter() - start
    peak = proc_status_bytes("VmHWM")
    (out_dir / f"rank{rank}.json").write_text(json.dumps(
        {"load_s": load_s, "read_mib": None if read_bytes is None else read_bytes / MIB,
         "peak_rss_mib": peak / MIB, "load_added_mib": (peak - rss_before) / MIB}))
    dist.barrier(group=group)
    dist.destroy_process_group()


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--teacher", default="data/teachers/smollm2-135m-instruct")
    parser.add_argument("--tp", default="1,3", help="comma list of teacher_tp values (1: the one-rank teacher)")
    parser.add_argument("--out", default="dumps/tp_load")
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--worker", choices=MODES, help=argparse.SUPPRESS)  # a rank of one launch
    options = parser.parse_args(argv)
    out = Path(options.out)
    if options.worker:
        return worker(options.teacher, options.worker, out)
    out.mkdir(parents=True, exist_ok=True)
    checkpoint_mib = sum(p.stat().st_size for p in Path(options.teacher).glob("*.safetensors")) / MIB
    rows = []
    for tp in [int(t) for t in options.tp.split(",")]:
        for mode in MODES if tp > 1 else ("one rank",):
            launch_dir = out / f"tp{tp}_{mode.replace(' ', '_')}"
            launch_dir.mkdir(exist_ok=True)
            worker_args = ["--teacher", options.teacher, "--out", str(launch_dir),
                           "--worker", MODES[0] if tp == 1 else mode]
            result = subprocess.run(torchrun_command(tp, "apps.bench.tp_load", worker_args), cwd=ROOT, text=True,
                                    capture_output=True, timeout=options.timeout,
                                    env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"})
            if result.returncode != 0:
                raise RunFailed(f"teacher_tp={tp} {mode} failed:\n{result.stdout[-3000:]}{result.stderr[-3000:]}")
            ranks = [json.loads((launch_dir / f"rank{r}.json").read_text()) for r in range(tp)]
            rows.append({"teacher_tp": tp, "mode": mode, "ranks": ranks,
                         "max_load_added_mib": max(r["load_added_mib"] for r in ranks),
                         "max_peak_rss_mib": max(r["peak_rss_mib"] for r in ranks),
                         "max_load_s": max(r["load_s"] for r in ranks),
                         "read_mib_per_rank": ranks[0]["read_mib"]})
    report = {"teacher": options.teacher, "checkpoint_mib": checkpoint_mib, "rows": rows}
    (out / "tp_load.json").write_text(json.dumps(report, indent=1))
    print(f"teacher {options.teacher} ({checkpoint_mib:,.0f} MiB of safetensors), fp32 on CPU")
    print("| teacher_tp | load | read per rank (MiB) | added by loading, max rank (MiB) | peak RSS, max rank (MiB) "
          "| load s |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        read = "-" if row["read_mib_per_rank"] is None else f"{row['read_mib_per_rank']:,.0f}"
        print(f"| {row['teacher_tp']} | {row['mode']} | {read} | {row['max_load_added_mib']:,.0f} | "
              f"{row['max_peak_rss_mib']:,.0f} | {row['max_load_s']:.1f} |")
    return report


if __name__ == "__main__":
    run_cli(main)
