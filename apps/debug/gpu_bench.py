"""`bash setup/gpu_check.sh --bench`: the loss benchmark against Liger-Kernel at issue 34's two shapes, on one GPU.

    bash setup/gpu_check.sh --bench [--out DIR]      # = python -m apps.debug.gpu_bench [--out DIR]

For V / D = 128,256 / 2,048 and 49,152 / 576 (bf16, N = 8,192 tokens, k = 64) it runs
`python -m apps.bench.loss_step --device cuda --against liger --compiled ce,kd_topk_t1` (each shape in its own
process, at most SHAPE_TIMEOUT_S) and prints each ratio table: CE and top-k KD at T = 1 also run with the chunk
math compiled (`distillation.loss_compile=true`: inductor's Triton) beside the eager ones, to set that default.
Everything lands in one folder, named on the first line (default dumps/gpu_bench/<UTC time>):
loss_V<vocab>/results.json and table.md per shape, and bench.md (the machine line and the tables, to commit under
docs/gpu/ with the date and the card). About 3-5 minutes on one H100 before the compiled rows (most of it drawing
the teachers' outputs on the CPU), plus their compiles (unmeasured on a GPU); the mode stays under 10 minutes.
Exit status 0 when every shape ran, else 1. Liger-Kernel is a bench dependency (setup/create_env.sh installs it;
in another environment `pip install liger-kernel`): without it its rows say "not installed".
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
COMPILED = "ce,kd_topk_t1"  # the compiled twins timed beside the eager variants (one compile each per shape)
SHAPE_TIMEOUT_S = 270  # two shapes stay under the mode's 10 minutes


def loss_bench_argv(vocab: int, dim: int, out: Path, tokens: int = TOKENS, device: str = "cuda") -> list[str]:
    """The loss bench's command line for one shape."""
    return [sys.executable, "-m", "apps.bench.loss_step", "--device", device, "--dtype", "bfloat16",
            "--vocab", str(vocab), "--dim", str(dim), "--tokens", str(tokens), "--k", str(K), "--repeats", "10",
            "--warmup", "2", "--rounds", "1", "--against", "liger", "--compiled", COMPILED, "--out", str(out),
            "--threads", str(min(8, os.cpu_count() or 1))]  # the teachers' outputs are drawn on the CPU


def main(argv: Optional[list[str]] = None, run: Callable = subprocess.run) -> int:
    parser = argparse.ArgumentParser(prog="bash setup/gpu_check.sh --bench", description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=None, help="the folder for every result (default dumps/gpu_bench/<UTC>)")
    parser.add_argument("--tokens", type=int, default=TOKENS, help=argparse.SUPPRESS)  # a smaller dry run
    parser.add_argument("--device", default="cuda", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    out = Path(args.out or ROOT / "dumps" / "gpu_bench" / time.strftime("%Y-%m-%dT%H-%M-%SZ", time.gmtime()))
    out.mkdir(parents=True, exist_ok=True)
    print(f"gpu bench: results in {out}", flush=True)
    sections, failed = [f"# GPU bench, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}", ""], 0
    for vocab, dim in SHAPES:
        shape_out = out / f"loss_V{vocab}"
        command = loss_bench_argv(vocab, dim, shape_out, args.tokens, args.device)
        try:
            result = run(command, cwd=ROOT, timeout=SHAPE_TIMEOUT_S)
            ok = result.returncode == 0 and (shape_out / "table.md").exists()
        except subprocess.TimeoutExpired:
            ok = False
        failed += not ok
        table = (shape_out / "table.md").read_text() if ok else f"FAILED or timed out: {' '.join(command[1:])}\n"
        sections += [f"## Loss step, V={vocab} D={dim}", "", f"`{' '.join(['python'] + command[1:])}`", "", table]
    # === Whole-step comparison (issue 35: `apps.bench.feed` in its GPU step mode), added here by the lead. ===
    summary = "\n".join(sections)
    (out / "bench.md").write_text(summary)
    print(summary)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
