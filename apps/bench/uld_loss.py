"""The fused loss with ULD on against off, on the same cross-tokenizer targets, in one process.

    python -m apps.bench.uld_loss --vocab 49152 --tokens 1024 --k 64 --uld-k 16 --rounds 7

The targets: a teacher's top-k (`apps.bench.loss_inputs`, fp32) mapped to student ids by a random vocabulary map
that leaves --unmapped of the teacher's ids without a student id, with the unmapped entries marked
(`lingua/distillation/loss/uld.py`). "on" is `fused_linear_kd_loss(..., uld_weight=0.5)` on them; "off" the same rows
without the marks (today's cross-tokenizer targets, uld_weight=0). Each round times one forward + backward of
each, the order alternating from round to round, so a busy machine slows both alike. Prints one line: each
variant's median wall and CPU milliseconds and the ratios on / off.
"""

import argparse
import statistics
import time

import torch

from apps.bench.loss_inputs import BenchArgs, make_inputs
from lingua.distillation.cross_tokenizer.targets import map_topk_rows
from lingua.distillation.cross_tokenizer.vocab_map import VocabMap
from lingua.distillation.loss.fused import fused_linear_kd_loss
from lingua.distillation.outputs import TeacherOutputs


def marked_and_plain_targets(teacher: TeacherOutputs, vocab: int, unmapped: float, seed: int):
    """The teacher's top-k through a random map (`unmapped` of its ids unmapped), with and without the marks."""
    generator = torch.Generator().manual_seed(seed)
    table = torch.randperm(vocab, generator=generator)
    table[torch.rand(vocab, generator=generator) < unmapped] = -1
    vocab_map, k = VocabMap(table, vocab), teacher.ids.shape[-1]
    rows = (teacher.values.reshape(-1, k), teacher.ids.reshape(-1, k), teacher.extra.reshape(-1))
    marked = TeacherOutputs("topk", *map_topk_rows(*rows, vocab_map, unmapped_entries=True))
    plain = TeacherOutputs("topk", *map_topk_rows(*rows, vocab_map))
    return marked, plain


def step_ms(hidden, weight, labels, teacher, uld_weight: float, uld_k: int) -> tuple[float, float]:
    """(wall ms, CPU ms) of one forward + backward of the fused loss."""
    hidden.grad = weight.grad = None
    wall, cpu = time.perf_counter(), time.process_time()
    loss, _ = fused_linear_kd_loss(hidden, weight, labels, teacher, labels.numel(), 0.5, 1.0, uld_weight=uld_weight,
                                   uld_k=uld_k)
    loss.backward()
    return (time.perf_counter() - wall) * 1e3, (time.process_time() - cpu) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--dim", type=int, default=576)
    parser.add_argument("--k", type=int, default=64)
    parser.add_argument("--uld-k", type=int, default=16)
    parser.add_argument("--unmapped", type=float, default=0.5, help="share of the teacher's ids with no student id")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    hidden, weight, labels, teacher = make_inputs(BenchArgs(vocab=args.vocab, tokens=args.tokens, dim=args.dim,
                                                            k=args.k))
    marked, plain = marked_and_plain_targets(teacher, args.vocab, args.unmapped, seed=1)
    variants = {"on": (marked, 0.5), "off": (plain, 0.0)}
    times = {name: [] for name in variants}
    step_ms(hidden, weight, labels, plain, 0.0, args.uld_k)  # warm-up
    step_ms(hidden, weight, labels, marked, 0.5, args.uld_k)
    for round in range(args.rounds):
        for name in (("on", "off") if round % 2 == 0 else ("off", "on")):
            times[name].append(step_ms(hidden, weight, labels, *variants[name], args.uld_k))
    wall = {name: statistics.median(t[0] for t in runs) for name, runs in times.items()}
    cpu = {name: statistics.median(t[1] for t in runs) for name, runs in times.items()}
    print(f"V={args.vocab} N={args.tokens} D={args.dim} k={args.k} uld_k={args.uld_k} threads={args.threads} "
          f"rounds={args.rounds}: ULD off {wall['off']:,.0f} ms wall / {cpu['off']:,.0f} ms CPU, on "
          f"{wall['on']:,.0f} / {cpu['on']:,.0f}; on / off = {wall['on'] / wall['off']:.3f} wall, "
          f"{cpu['on'] / cpu['off']:.3f} CPU")


if __name__ == "__main__":
    main()
