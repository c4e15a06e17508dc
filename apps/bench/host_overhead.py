"""The host's work per step: our trainer against a minimal loop over the same LMTransformer, at tiny dimensions.

    python -m apps.bench.host_overhead --out dumps/bench/host_overhead     # ~2 min on 2 cores

With 30 layers of dim 32 and 16 tokens a step the compute vanishes and what is left is the host's work: Python,
dispatch, hooks, the optimizer's loop. Each loop trains 40 steps on one thread per rank; the table gives the medians
of steps 11-40 (step, fwd+bwd, optimizer, in ms: the main thread's CPU time, the host's work, and the wall time)
of each loop's least disturbed round (`--repeats`; all rounds are in results.json), for:
  ours       `apps.main.train` under torchrun on 1 and 2 gloo ranks (CE only, the CPU defaults; the data producer
             off so that its process does not share the cores; `speed/step_time_s` and the StepTimer's parts)
  minimal    a loop over the same LMTransformer: forward with our fused CE head, backward, torch's clip_grad_norm_,
             fused AdamW; in one process without FSDP, and with FSDP2 `fully_shard` per block (and the root) on 1
             and 2 gloo ranks
and the two ratios the trainer is held to: ours on 1 rank over the plain minimal loop (a world of one student shards
nothing), ours on 2 ranks over the FSDP2 minimal loop on 2. Everything goes to <out>/results.json.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from apps.bench.launcher import ROOT, torchrun_command

LAYERS, DIM, TOKENS, STEPS, FIRST_MEASURED = 30, 32, 16, 40, 11
MODEL = dict(dim=DIM, n_layers=LAYERS, n_heads=4, n_kv_heads=2, max_seqlen=TOKENS)
VOCAB = 258  # the byte tokenizer's
PARTS = ("step", "fwd_bwd", "optimizer")  # each as wall seconds and as the main thread's CPU seconds (`<part>_cpu`)


def median_ms(rows: list[dict], first: int = FIRST_MEASURED) -> dict:
    """Median milliseconds of each part (wall and CPU) over the rows {"n": step, part: s, part_cpu: s} from `first`."""
    kept = [row for row in rows if row["n"] >= first]
    return {key: round(1000 * statistics.median(row[key] for row in kept), 2)
            for part in PARTS for key in (part, f"{part}_cpu")}


def clock() -> tuple[float, float]:
    """(wall, this thread's CPU) seconds: on a shared machine the CPU time is the host's work, the wall time
    also what other processes took from it."""
    return time.perf_counter(), time.thread_time()


def timed_row(n: int, start, middle, end) -> dict:
    return {"n": n, "step": end[0] - start[0], "fwd_bwd": middle[0] - start[0], "optimizer": end[0] - middle[0],
            "step_cpu": end[1] - start[1], "fwd_bwd_cpu": middle[1] - start[1], "optimizer_cpu": end[1] - middle[1]}


# ---------------------------------------------------------------- the minimal loop

def minimal_loop(fsdp: bool, out: Path, steps: int = STEPS) -> None:
    """`steps` steps of the minimal loop in this process (a torchrun rank when `fsdp`); rank 0 writes its rows."""
    from apps.main.transformer import LMTransformer, LMTransformerArgs
    from lingua.distillation.loss.fused import fused_ce_head

    rank = 0
    if fsdp:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        dist.init_process_group("gloo")
        rank = dist.get_rank()
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    model = LMTransformer(LMTransformerArgs(vocab_size=VOCAB, **MODEL))
    model.init_weights()
    if fsdp:  # as the trainer shards: per block (the last kept unsharded for the backward), then the root
        for i, block in enumerate(model.layers):
            fully_shard(block, mesh=mesh, reshard_after_forward=i < LAYERS - 1)
        fully_shard(model, mesh=mesh, reshard_after_forward=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1, fused=True)
    generator = torch.Generator().manual_seed(rank)
    rows = []
    for n in range(1, steps + 1):
        tokens = torch.randint(0, VOCAB, (1, TOKENS + 1), generator=generator)
        start = clock()
        model(tokens[:, :-1], head_loss=fused_ce_head(tokens[:, 1:], TOKENS)).backward()
        middle = clock()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        rows.append(timed_row(n, start, middle, clock()))
    if rank == 0:
        out.write_text(json.dumps(rows))
    if fsdp:
        dist.destroy_process_group()


# ---------------------------------------------------------------- ours

def write_corpus(root: Path) -> Path:
    """A small jsonl corpus (one source, "text") for the trainer's loader."""
    (root / "text").mkdir(parents=True, exist_ok=True)
    words = "the host does the work per step when the model is tiny and the batch is small".split()
    lines = [json.dumps({"text": " ".join(words[(i + j) % len(words)] for j in range(40))}) for i in range(400)]
    (root / "text" / "text.chunk.0.jsonl").write_text("\n".join(lines) + "\n")
    return root


def our_overrides(corpus: Path, dump: Path, steps: int = STEPS, extra: tuple = ()) -> list[str]:
    values = {"dump_dir": dump, "steps": steps, "data.root_dir": corpus, "data.sources": "{text: 1.0}",
              "data.batch_size": 1, "data.seq_len": TOKENS, "data.tokenizer.name": "bytes", "data.load_async": "false",
              "model.dim": DIM, "model.n_layers": LAYERS, "model.n_heads": 4, "model.n_kv_heads": 2,
              "distributed.model_dtype": "fp32", "logging.freq": 10**6, "heldout.every": 0, "checkpoint.dump.every": 10**6,
              "optim.warmup": 2}
    return [f"{key}={value}" for key, value in values.items()] + list(extra)


def ours_worker(out: Path, overrides: list[str]) -> None:
    """A torchrun rank of `apps.main.train` whose loop is timed here: a step from one StepTimer.reset (the loop's
    first call of a step) to the next, fwd+bwd = `train_step`, optimizer = `optimizer_step`; student rank 0
    writes the rows (the trainer logs once, at its end: no log step inside the measured ones)."""
    from apps.main import train
    from lingua.timing import StepTimer

    rows, marks = [], {}
    reset, train_step, optimizer_step, run_train = StepTimer.reset, train.train_step, train.optimizer_step, train.train

    def step_starts(timer):
        now = clock()
        if "optimizer" in marks:  # the step is the whole loop iteration; its parts are the two calls themselves
            step = timed_row(len(rows) + 1, marks["start"], marks["start"], now)
            rows.append({"n": step["n"], "step": step["step"], "step_cpu": step["step_cpu"],
                         **{part: marks[part][0] for part in ("fwd_bwd", "optimizer")},
                         **{f"{part}_cpu": marks[part][1] for part in ("fwd_bwd", "optimizer")}})
        marks.clear()
        marks["start"] = now
        reset(timer)

    def timing(function, part: str):
        def timed(*args, **kwargs):
            start = clock()
            result = function(*args, **kwargs)
            end = clock()
            marks[part] = (end[0] - start[0], end[1] - start[1])
            return result
        return timed
    timed_train_step, timed_optimizer_step = timing(train_step, "fwd_bwd"), timing(optimizer_step, "optimizer")

    def train_and_write(args, topo, *rest):
        run_train(args, topo, *rest)
        if topo.train_rank == 0:
            out.write_text(json.dumps(rows))
    StepTimer.reset, train.train_step, train.optimizer_step, train.train = (step_starts, timed_train_step,
                                                                            timed_optimizer_step, train_and_write)
    train.main(overrides)


def run(command: list[str], log: Path, timeout_s: float) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", WANDB_MODE="disabled",
               TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    with open(log, "w") as out:
        result = subprocess.run(command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=timeout_s)
    if result.returncode:
        raise SystemExit(f"{' '.join(command[:8])} ... failed (exit {result.returncode}); its log: {log}")


def bench(out: Path, steps: int = STEPS, ranks: tuple = (1, 2), repeats: int = 1, ours_set: tuple = (),
          timeout_s: float = 600) -> dict:
    """Every loop of the table, `repeats` rounds of them in turn (a busy machine slows whichever runs then);
    returns (and writes) results.json's content (`summarize`)."""
    out.mkdir(parents=True, exist_ok=True)
    corpus = write_corpus(out / "corpus")
    first = min(FIRST_MEASURED, max(1, steps // 2))
    me = [sys.executable, "-m", "apps.bench.host_overhead"]
    loops = {"minimal, 1 process": lambda rows: [*me, "--minimal", str(rows), "--steps", str(steps)]}
    for n in ranks:
        loops[f"minimal + FSDP2, {n} rank(s)"] = lambda rows, n=n: torchrun_command(
            n, "apps.bench.host_overhead", ["--minimal-fsdp", str(rows), "--steps", str(steps)])
        # One step more than measured: a step's row is closed by the next step's start.
        loops[f"ours, {n} rank(s)"] = lambda rows, n=n: torchrun_command(n, "apps.bench.host_overhead", [
            "--ours", str(rows), *our_overrides(corpus, rows.with_suffix(""), steps + 1, ours_set)])
    rounds: dict[str, list[dict]] = {name: [] for name in loops}
    for round_ in range(repeats):
        for i, (name, command) in enumerate(loops.items()):
            rows = out / f"r{round_}_{i}.json"
            run(command(rows), rows.with_suffix(".log"), timeout_s)
            rounds[name].append(median_ms(json.loads(rows.read_text()), first))
    setup = dict(layers=LAYERS, dim=DIM, tokens_per_step=TOKENS, steps=steps, medians_of_steps=[first, steps],
                 threads_per_rank=1, repeats=repeats, ours_overrides=list(ours_set), torch=torch.__version__,
                 load_average=os.getloadavg())
    results = summarize(setup, rounds)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    return results


def summarize(setup: dict, rounds: dict[str, list[dict]]) -> dict:
    """Each loop's best round (least step CPU: the round other processes disturbed least; on a shared machine even
    CPU time grows with their load) and the median of its rounds, and the two ratios from the best rounds."""
    results = {"setup": setup, "loops": {name: min(runs, key=lambda r: r["step_cpu"]) for name, runs in rounds.items()},
               "loops_median_of_rounds": {name: {key: statistics.median(r[key] for r in runs) for key in runs[0]}
                                          for name, runs in rounds.items()},
               "rounds": rounds}
    best = results["loops"]
    for ours, baseline, key in (("ours, 1 rank(s)", "minimal, 1 process", "ours_1_over_minimal"),
                                ("ours, 2 rank(s)", "minimal + FSDP2, 2 rank(s)", "ours_2_over_minimal_fsdp_2")):
        if ours in best:  # the host's work (CPU) and the wall time, each ours over the baseline
            results[key] = {part: round(best[ours][part] / best[baseline][part], 3) for part in ("step_cpu", "step")}
    return results


def table(results: dict) -> str:
    lines = ["| loop | step CPU ms | fwd+bwd CPU | optimizer CPU | step wall ms | fwd+bwd wall | optimizer wall |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for name, ms in results["loops"].items():
        lines.append(f"| {name} | {ms['step_cpu']} | {ms['fwd_bwd_cpu']} | {ms['optimizer_cpu']} | {ms['step']} | "
                     f"{ms['fwd_bwd']} | {ms['optimizer']} |")
    ratios = {key: value for key, value in results.items() if key.startswith("ours_")}
    return "\n".join(lines) + "\n" + ", ".join(f"{key} = {value}" for key, value in ratios.items())


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "dumps" / "bench" / "host_overhead")
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--ranks", default="1,2", help="the world sizes of the launched loops")
    parser.add_argument("--repeats", type=int, default=1, help="rounds of every loop, in turn")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="an override for our trainer's runs (e.g. optim.implementation=for_loop)")
    parser.add_argument("--minimal", type=Path, help=argparse.SUPPRESS)  # a worker: the minimal loop, one process
    parser.add_argument("--minimal-fsdp", type=Path, help=argparse.SUPPRESS)  # a worker: a torchrun rank of it
    parser.add_argument("--ours", type=Path, help=argparse.SUPPRESS)  # a worker: a timed rank of apps.main.train
    options, overrides = parser.parse_known_args(argv)
    if options.ours:
        return ours_worker(options.ours, overrides)
    if options.minimal or options.minimal_fsdp:
        torch.set_num_threads(1)  # (OMP_NUM_THREADS=1 too: `run`)
        return minimal_loop(bool(options.minimal_fsdp), options.minimal or options.minimal_fsdp, options.steps)
    results = bench(options.out, options.steps, tuple(int(n) for n in options.ranks.split(",")), options.repeats,
                    tuple(options.set))
    print(table(results))
    print(f"results: {options.out / 'results.json'}")


if __name__ == "__main__":
    main()
