"""Building a wide student on the CPU: each rank's peak resident memory at build and after the first step, against
4N/S (N parameters, S students: a rank's fp32 shard).

    python -m apps.bench.scale_build --out dumps/bench/scale_build                      # the 0.8B student, 2 ranks
    python -m apps.bench.scale_build --shapes wide llama_1B 8B --out dumps/bench/scale_build

Shapes (`SHAPES`): `wide` is dim 2048, 12 layers and SmolLM2's 49,152 vocabulary (0.81B parameters, 3.0 GiB in
fp32); `llama_1B` is configs/llama_1B.yaml's with its 128,256 vocabulary (1.79B parameters, 6.7 GiB); `8B` is Llama
3 8B's, built on the meta device only, for the arithmetic. A real shape runs the trainer's own `build_model`
(apps/main/train.py) under torchrun on `--students` gloo ranks, so the same command measures whatever build the
checkout has, then one training step (64 tokens, the fused CE head, clipping, the trainer's AdamW) unless the
shape is named in `--build-only`. Each rank reads its peak resident memory (ru_maxrss: the process's peak so far)
after the process group, after the build and after the step. A shape whose estimate (`estimate_gib`: the sharded
build's) is above MemAvailable is skipped with the reason in the table and results.json; `--force` runs it.
Everything goes to <out>/results.json; the table is printed.
"""

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import torch

from apps.bench.launcher import ROOT, proc_status_bytes, torchrun_command
from apps.main.transformer import LMTransformer, LMTransformerArgs, num_parameters

GIB = 2**30
TOKENS = 64  # the step's sequence: activations stay small next to the weights, which are what is measured
SHAPES = {
    "wide": dict(dim=2048, n_layers=12, n_heads=16, vocab_size=49152),
    "llama_1B": dict(dim=2048, n_layers=25, n_heads=16, rope_theta=100000.0, vocab_size=128256),
    "8B": dict(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim_multiplier=1.3, multiple_of=1024,
               rope_theta=500000.0, vocab_size=128256),
    "tiny": dict(dim=64, n_layers=2, n_heads=4, vocab_size=97),  # the command end to end in seconds
}
META_ONLY = ("8B",)
BASE_GIB = 0.7  # a rank before the model (python, torch, the process groups: 0.27 measured) and the allocator's slack


def model_args(shape: str) -> LMTransformerArgs:
    return LMTransformerArgs(max_seqlen=TOKENS, **SHAPES[shape])


def arithmetic(shape: str, students: int) -> dict:
    """The shape's sizes from the meta device: N, 4N, 4N/S and the largest parameter (the most a sharded build
    holds unsharded at once), in GiB."""
    with torch.device("meta"):
        model = LMTransformer(model_args(shape))
    n_params = sum(p.numel() for p in model.parameters())
    assert n_params == num_parameters(model_args(shape)), shape  # the planner's count is the model's
    largest = max(p.numel() for p in model.parameters())
    return dict(shape=shape, n_params=n_params, full_gib=4 * n_params / GIB,
                shard_gib=4 * n_params / students / GIB, largest_param_gib=4 * largest / GIB, students=students)


def estimate_gib(sizes: dict, build_only: bool) -> float:
    """Host memory the launch may need at its peak, all ranks together: the sharded build (4N/S and the largest
    parameter per rank) or, with the step, 16N/S per rank (fp32 weights, gradients and AdamW's two moments) and
    the unsharded root. A whole-model build (before 2026-12-07) needs 4N + 4N/S per rank: run it with --force."""
    build = sizes["shard_gib"] + sizes["largest_param_gib"]
    step = 4 * sizes["shard_gib"] + 2 * sizes["largest_param_gib"]
    return sizes["students"] * (BASE_GIB + (build if build_only else max(build, step)))


def mem_available_gib() -> float:
    """What the kernel says it can give without swapping (/proc/meminfo's MemAvailable), in GiB."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024 / GIB
    return 0.0


# ---------------------------------------------------------------- one rank

def peak_gib() -> float:
    from lingua.metrics import host_peak_rss_gib

    return host_peak_rss_gib()


def worker(shape: str, out: Path, build_only: bool) -> None:
    """A torchrun rank: the trainer's process groups and `build_model`, then one step; writes <shape>.rank<r>.json."""
    import torch.distributed as dist

    from apps.main.train import TrainArgs
    from apps.main.transformer import build_model
    from lingua.distillation.loss.fused import fused_ce_head
    from lingua.distributed import setup_torch_distributed
    from lingua.optim import build_optimizer, clip_grad_norm_

    args = TrainArgs(model=model_args(shape))
    topo = setup_torch_distributed(args.distributed)
    row = dict(rank=topo.global_rank, base_gib=peak_gib())
    start = time.perf_counter()
    model = build_model(args.model, args.distributed, topo)
    row.update(build_s=time.perf_counter() - start, build_peak_gib=peak_gib(),
               build_rss_gib=proc_status_bytes("VmRSS") / GIB,
               local_gib=sum(_local(p).numel() * _local(p).element_size() for p in model.parameters()) / GIB)
    if not build_only:
        optimizer, _ = build_optimizer(model, args.optim, 10)
        tokens = torch.randint(0, args.model.vocab_size, (1, TOKENS + 1),
                               generator=torch.Generator().manual_seed(topo.global_rank))
        start = time.perf_counter()
        loss = model(tokens[:, :-1], head_loss=fused_ce_head(tokens[:, 1:], TOKENS))
        loss.backward()
        clip_grad_norm_(model.parameters(), args.optim.clip)
        optimizer.step()
        row.update(step_s=time.perf_counter() - start, step_peak_gib=peak_gib(), loss=loss.item())
    (out / f"{shape}.rank{topo.global_rank}.json").write_text(json.dumps(row))
    dist.barrier(group=topo.train_group)
    dist.destroy_process_group()


def _local(param: torch.Tensor) -> torch.Tensor:
    return param.to_local() if hasattr(param, "to_local") else param


# ---------------------------------------------------------------- the launches

def run_shape(shape: str, students: int, out: Path, build_only: bool, force: bool) -> dict:
    """One shape: the arithmetic, then (not on meta-only shapes, and where memory allows) the launch's ranks."""
    result = arithmetic(shape, students)
    result.update(build_only=build_only, estimate_gib=estimate_gib(result, build_only))
    if shape in META_ONLY:
        result["skipped"] = "meta device only: the arithmetic"
        return result
    available = mem_available_gib()
    if result["estimate_gib"] > available and not force:
        result["skipped"] = (f"needs about {result['estimate_gib']:.1f} GiB, {available:.1f} GiB available "
                             f"(--force runs it anyway)")
        return result
    command = torchrun_command(students, "apps.bench.scale_build",
                               ["--worker", shape, "--out", str(out)] + (["--no-step"] if build_only else []))
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        result["skipped"] = f"the launch failed (exit {done.returncode}): {done.stderr.strip()[-400:]}"
        return result
    result["ranks"] = [json.loads((out / f"{shape}.rank{r}.json").read_text()) for r in range(students)]
    return result


def table(results: list[dict]) -> str:
    """Per rank: peak at build and after the step, in GiB and as a multiple of 4N/S."""
    lines = ["| shape | N | 4N GiB | S | 4N/S GiB | largest param GiB | rank | base GiB | build peak GiB (x 4N/S) "
             "| build s | step peak GiB (x 4N/S) |", "|---" * 11 + "|"]
    for r in results:
        head = (f"| {r['shape']} | {r['n_params'] / 1e9:.3f}B | {r['full_gib']:.2f} | {r['students']} | "
                f"{r['shard_gib']:.2f} | {r['largest_param_gib']:.3f}")
        if "ranks" not in r:
            lines.append(f"{head} | - | - | {r['skipped']} | - | - |")
            continue
        for row in r["ranks"]:
            step = (f"{row['step_peak_gib']:.2f} ({row['step_peak_gib'] / r['shard_gib']:.2f}x)"
                    if "step_peak_gib" in row else "not run (--build-only)")
            lines.append(f"{head} | {row['rank']} | {row['base_gib']:.2f} | {row['build_peak_gib']:.2f} "
                         f"({row['build_peak_gib'] / r['shard_gib']:.2f}x) | {row['build_s']:.1f} | {step} |")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=["wide", "8B"], choices=sorted(SHAPES))
    parser.add_argument("--students", type=int, default=2, help="torchrun ranks, all students (default 2)")
    parser.add_argument("--build-only", nargs="*", default=[], choices=sorted(SHAPES), metavar="SHAPE",
                        help="shapes measured at build only, without the step")
    parser.add_argument("--force", action="store_true", help="run a shape whose estimate exceeds MemAvailable")
    parser.add_argument("--out", default="dumps/bench/scale_build")
    parser.add_argument("--worker", choices=sorted(SHAPES), help=argparse.SUPPRESS)
    parser.add_argument("--no-step", action="store_true", help=argparse.SUPPRESS)  # a worker of a --build-only shape
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.worker:
        worker(args.worker, out, build_only=args.no_step)
        return
    if args.students < 1:
        parser.error(f"--students={args.students}; use 1 or more")
    results = [run_shape(shape, args.students, out, shape in args.build_only, args.force) for shape in args.shapes]
    (out / "results.json").write_text(json.dumps(dict(results=results, tokens=TOKENS, torch=torch.__version__,
                                                      commit=_commit(), args=vars(args)), indent=1))
    print(table(results))
    print(f"results: {out / 'results.json'}")


def _commit() -> str:
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return done.stdout.strip()


if __name__ == "__main__":
    main(sys.argv[1:])
