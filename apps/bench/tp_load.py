"""Loading a tensor-parallel teacher: every rank reading only its own shards from the safetensors files (the
default) against every rank loading the whole teacher on its host and slicing it (the fallback for checkpoints
whose tensor names are not the model's), one torchrun launch per way, teacher_tp and dtype, on CPU and gloo.

    python -m apps.bench.tp_load --teacher data/teachers/smollm2-135m-instruct --tp 1,3 --dtypes fp32,bf16 --out DIR

Each rank reports its load seconds, the shard bytes it read from the checkpoint, and two host-memory peaks
over the load (torch, transformers and safetensors imported before the first reading):
- anonymous memory (RssAnon, sampled every 5 ms): memory the process owns, which can run a host out of memory;
- resident memory (VmHWM): that plus the pages of the checkpoint files it has mapped and touched, which the
  kernel can drop and which the ranks of a node share through the page cache.
teacher_tp=1 is the one-rank teacher (transformers' from_pretrained). Writes <out>/tp_load.json and prints a table.
"""

import argparse
import json
import os
import subprocess
import threading
import time
from datetime import timedelta
from pathlib import Path

from apps.bench.launcher import ROOT, proc_status_bytes, torchrun_command
from lingua.cli.entry import run_cli
from lingua.errors import RunFailed

MODES = ("streamed", "host")
MIB = 2**20
SAMPLE_S = 0.005


class AnonPeak:
    """The largest RssAnon seen while active, sampled from a thread."""

    def __init__(self):
        self.peak, self._stop = proc_status_bytes("RssAnon"), threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.wait(SAMPLE_S):
            self.peak = max(self.peak, proc_status_bytes("RssAnon"))

    def __enter__(self) -> "AnonPeak":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, proc_status_bytes("RssAnon"))


def worker(teacher: str, mode: str, dtype: str, out_dir: Path) -> None:
    """One rank of a launch: load the teacher `mode`'s way and write rank<r>.json."""
    import accelerate  # noqa: F401  (imported before the first reading: loading is what is measured)
    import safetensors.torch  # noqa: F401
    import torch
    import torch.distributed as dist
    import transformers  # noqa: F401

    from lingua.distillation.args import DistillationArgs
    from lingua.distillation.teacher.model import TeacherModel, load_teacher
    from lingua.distillation.teacher.tensor_parallel import shard_teacher

    dist.init_process_group("gloo", timeout=timedelta(seconds=600))
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(list(range(world)), group_desc="teacher_tp_0")
    args = DistillationArgs(teacher_path=teacher, teacher_dtype=dtype)
    cpu = torch.device("cpu")
    rss_before, anon_before, start = proc_status_bytes("VmRSS"), proc_status_bytes("RssAnon"), time.perf_counter()
    read_bytes = None
    with AnonPeak() as anon:
        if world == 1:
            model, _ = load_teacher(args, cpu)
        elif mode == "streamed":
            teacher_model = TeacherModel(args, cpu, tp_group=group)
            if teacher_model.checkpoint is None:
                raise RunFailed(f"{teacher} could not be streamed (see the warning above); nothing to compare.")
            model, read_bytes = teacher_model.model, teacher_model.checkpoint.read_bytes
        else:
            model, _ = load_teacher(args, cpu, place=False)
            shard_teacher(model, group, cpu)
        load_s = time.perf_counter() - start
        # Touch every weight kept, as a forward would: a weight still mapped from the file counts once read.
        for tensor in [*model.parameters(), *model.buffers()]:
            getattr(tensor, "to_local", lambda t=tensor: t)().float().sum()
    (out_dir / f"rank{rank}.json").write_text(json.dumps(
        {"load_s": load_s, "read_mib": None if read_bytes is None else read_bytes / MIB,
         "anon_added_mib": (anon.peak - anon_before) / MIB,
         "rss_added_mib": (proc_status_bytes("VmHWM") - rss_before) / MIB}))
    dist.barrier(group=group)
    dist.destroy_process_group()


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--teacher", default="data/teachers/smollm2-135m-instruct")
    parser.add_argument("--tp", default="1,3", help="comma list of teacher_tp values (1: the one-rank teacher)")
    parser.add_argument("--dtypes", default="fp32,bf16", help="comma list of distillation.teacher_dtype values")
    parser.add_argument("--out", default="dumps/tp_load")
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--worker", choices=MODES, help=argparse.SUPPRESS)  # a rank of one launch
    parser.add_argument("--dtype", default="fp32", help=argparse.SUPPRESS)  # the worker's
    options = parser.parse_args(argv)
    out = Path(options.out)
    if options.worker:
        return worker(options.teacher, options.worker, options.dtype, out)
    out.mkdir(parents=True, exist_ok=True)
    checkpoint_mib = sum(p.stat().st_size for p in Path(options.teacher).glob("*.safetensors")) / MIB
    rows = []
    for dtype in options.dtypes.split(","):
        for tp in [int(t) for t in options.tp.split(",")]:
            for mode in MODES if tp > 1 else ("one rank",):
                launch_dir = out / f"{dtype}_tp{tp}_{mode.replace(' ', '_')}"
                launch_dir.mkdir(exist_ok=True)
                worker_args = ["--teacher", options.teacher, "--out", str(launch_dir), "--dtype", dtype,
                               "--worker", MODES[0] if tp == 1 else mode]
                result = subprocess.run(torchrun_command(tp, "apps.bench.tp_load", worker_args), cwd=ROOT, text=True,
                                        capture_output=True, timeout=options.timeout,
                                        env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"})
                if result.returncode != 0:
                    raise RunFailed(f"{dtype} teacher_tp={tp} {mode} failed:\n{result.stdout[-3000:]}"
                                    f"{result.stderr[-3000:]}")
                ranks = [json.loads((launch_dir / f"rank{r}.json").read_text()) for r in range(tp)]
                rows.append({"dtype": dtype, "teacher_tp": tp, "mode": mode, "ranks": ranks,
                             "read_mib_per_rank": ranks[0]["read_mib"],
                             **{f"max_{key}": max(r[key] for r in ranks)
                                for key in ("anon_added_mib", "rss_added_mib", "load_s")}})
    report = {"teacher": options.teacher, "checkpoint_mib": checkpoint_mib, "rows": rows}
    (out / "tp_load.json").write_text(json.dumps(report, indent=1))
    print(f"teacher {options.teacher} ({checkpoint_mib:,.0f} MiB of safetensors), on CPU; per rank, the largest rank")
    print("| teacher_dtype | teacher_tp | load | shard MiB read | anonymous MiB added (peak) | resident MiB added "
          "(peak) | load s |")
    print("|---|---|---|---:|---:|---:|---:|")
    for row in rows:
        read = "-" if row["read_mib_per_rank"] is None else f"{row['read_mib_per_rank']:,.0f}"
        print(f"| {row['dtype']} | {row['teacher_tp']} | {row['mode']} | {read} | {row['max_anon_added_mib']:,.0f} | "
              f"{row['max_rss_added_mib']:,.0f} | {row['max_load_s']:.1f} |")
    return report


if __name__ == "__main__":
    run_cli(main)
