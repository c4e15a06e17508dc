"""`bash setup/gpu_check.sh --bench`: issue 34's loss bench and issue 35's feeding bench, on one GPU.

    bash setup/gpu_check.sh --bench [--out DIR]      # = python -m apps.debug.gpu_bench [--out DIR]

1. For V / D = 128,256 / 2,048 and 49,152 / 576 (bf16, N = 8,192 tokens, k = 64):
   `python -m apps.bench.loss_step --device cuda --against liger --compiled ce,kd_topk_t1` (each shape in its own
   process, at most SHAPE_TIMEOUT_S), our CE and KD variants beside Liger-Kernel's fused linear CE and JSD; CE and
   top-k KD at T = 1 also with the chunk math compiled (`distillation.loss_compile=true`: inductor's Triton),
   to set that default.
2. `python -m apps.bench.feeding --device cuda`: the loader (training thread idle and busy), the cache writer's
   stages against its teacher's forward, the reader's decode, and whole training steps of a 139M-like and an
   810M-like student, CE-only against KD from a top-64 cache (data wait share, fwd+bwd ratio).
Everything lands in one folder, named on the first line (default dumps/gpu_bench/<UTC time>): each part's
results.json and table.md, and bench.md (the tables, to commit under docs/gpu/ with the date and the card).
The whole mode stays under BUDGET_S (under 10 minutes; the part that would overrun is cut and marked). Exit
status 0 when every part ran, else 1. Liger-Kernel is a bench dependency (setup/create_env.sh installs it; in
another environment `pip install liger-kernel`): without it its rows say "not installed". gpu_check.sh prepares
the corpus and the SmolLM2 tokenizer the feeding bench reads before the clock starts.
"""

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Optional

ROOT = Path(__file__).resolve().parents[2]
SHAPES = ((128256, 2048), (49152, 576))  # (vocab, dim): Llama-3's head at 1B, SmolLM2-135M's
TOKENS, K = 8192, 64
BUDGET_S = 570  # the whole mode stays under 10 minutes: each part gets at most what is left
SHAPE_TIMEOUT_S = 200  # a loss shape; the whole-step comparison gets the rest
COMPILED = "ce,kd_topk_t1"  # the compiled twins timed beside the eager variants (one compile each per shape)


def loss_bench_argv(vocab: int, dim: int, out: Path, tokens: int = TOKENS, device: str = "cuda") -> list[str]:
    """The loss bench's command line for one shape."""
    return [sys.executable, "-m", "apps.bench.loss_step", "--device", device, "--dtype", "bfloat16",
            "--vocab", str(vocab), "--dim", str(dim), "--tokens", str(tokens), "--k", str(K), "--repeats", "10",
            "--warmup", "2", "--rounds", "1", "--against", "liger", "--compiled", COMPILED, "--out", str(out),
            "--threads", str(min(8, os.cpu_count() or 1))]  # the teachers' outputs are drawn on the CPU


def feed_bench_argv(out: Path, device: str = "cuda") -> list[str]:
    """The feeding bench's command line: loader, writer stages, reader, and the 139M / 810M whole-step comparison
    (needs `python -m setup.prepare_corpus` and `python -m setup.prepare_teacher`, which gpu_check.sh runs)."""
    return [sys.executable, "-m", "apps.bench.feeding", "--device", device, "--out", str(out)]


def main(argv: Optional[list[str]] = None, run: Callable = subprocess.run) -> int:
    parser = argparse.ArgumentParser(prog="bash setup/gpu_check.sh --bench", description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=None, help="the folder for every result (default dumps/gpu_bench/<UTC>)")
    parser.add_argument("--budget-s", type=float, default=BUDGET_S,
                        help=f"seconds for the whole mode (default {BUDGET_S}); a part that would overrun is cut")
    parser.add_argument("--tokens", type=int, default=TOKENS, help=argparse.SUPPRESS)  # a smaller dry run
    parser.add_argument("--device", default="cuda", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    out = Path(args.out or ROOT / "dumps" / "gpu_bench" / time.strftime("%Y-%m-%dT%H-%M-%SZ", time.gmtime()))
    out.mkdir(parents=True, exist_ok=True)
    print(f"gpu bench: results in {out}", flush=True)
    sections, failed = [f"# GPU bench, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}", ""], 0
    deadline = time.monotonic() + args.budget_s
    parts = [(f"Loss step, V={vocab} D={dim}", loss_bench_argv(vocab, dim, out / f"loss_V{vocab}", args.tokens,
                                                              args.device), out / f"loss_V{vocab}", SHAPE_TIMEOUT_S)
             for vocab, dim in SHAPES]
    parts.append(("Feeding and whole steps (CE-only vs KD from a cache; the writer vs its teacher)",
                  feed_bench_argv(out / "feed", args.device), out / "feed", args.budget_s))
    for title, command, part_out, limit in parts:
        left = min(limit, deadline - time.monotonic())
        try:
            ok = left > 0 and run(command, cwd=ROOT, timeout=left).returncode == 0 and (part_out / "table.md").exists()
        except subprocess.TimeoutExpired:
            ok = False
        failed += not ok
        table = (part_out / "table.md").read_text() if ok else f"FAILED or timed out: {' '.join(command[1:])}\n"
        sections += [f"## {title}", "", f"`{' '.join(['python'] + command[1:])}`", "", table]
    summary = "\n".join(sections)
    (out / "bench.md").write_text(summary)
    print(summary)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
