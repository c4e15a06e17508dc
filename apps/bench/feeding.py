"""Feeding rates: what the host delivers to one rank, in tokens/s, on the machine it runs on.

    python -m apps.bench.feeding --out DIR [--config configs/distill_exps/kd_study.yaml] [key=value ...]
    python -m apps.bench.feeding --out DIR --device cuda      # and the whole-step comparison (setup/gpu_check.sh --bench)

    loader   the training data loader (`lingua.data.DataLoader` with the config's data settings, data.workers
             included where the config has it), data.load_async false and true, the training thread idle (next()
             back to back) and busy (spinning in pure Python between batches, for as long as the in-line loader
             takes per batch, as a training loop's Python would): tokens/s delivered, the share of the time the
             training thread waited for data
    writer   the teacher cache writer's stages over --shards shards of the config's windows and teacher: tokenize
             (read + pack), the teacher's forward + top-k, encode (v2 codec, round-trip check, zstd, the file's
             bytes) with 1 and 2 worker processes, write (atomic); then the whole writer, pipelined
             (encode_workers=-1) against serial (0), --rounds times in alternating order
    reader   the v2 cache reader's decode of those shards (one thread, fresh: no memo)

With --device cuda the teacher runs on the GPU (SmolLM2-135M's shape, random weights, the config's tokenizer) and
`apps.bench.feeding_step` compares whole training steps: 139M-like and 810M-like students, CE-only against KD from a
top-64 cache the pipelined writer wrote. Writes DIR/results.json and prints the table.
"""

import argparse
import json
import os
import statistics
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Callable, Optional

import torch

from apps.bench.feeding_step import format_step_table, random_teacher, step_comparison
from apps.main.teacher_cache import StreamReader, TeacherCacheArgs, planned_manifest, teacher_outputs, write_shards
from lingua.args import parse_args
from lingua.cli.entry import run_cli
from lingua.data import DataLoader
from lingua.distillation.cache.store import (forget_decoded_shards, read_shard, shard_bytes, shard_path,
                                       write_file_atomic)
from lingua.distillation.cache.writer import auto_encode_workers, start_encode_pool
from lingua.distillation.teacher.model import TeacherModel
from lingua.errors import ConfigError
from lingua.tokenizer import build_tokenizer

ISSUE_TABLE = {  # issue 35, one H100, 2026-11: the figures this bench's GPU mode is compared with
    "ce_139m_data_share": 0.37, "ce_810m_data_share": 0.15, "writer_tokens_per_s": 8265,
    "teacher_forward_tokens_per_s": 288_000, "reader_decode_tokens_per_s": 171_000,
}


def spin(seconds: float) -> None:
    """The training thread busy in pure Python (holding the GIL, as a loop's bookkeeping does)."""
    end, count = time.perf_counter() + seconds, 0
    while time.perf_counter() < end:
        count += 1


def loader_run(data_args, tokenizer, batches: int, busy_s: float) -> dict:
    """One loader, `batches` batches after a first one (start-up), the consumer spinning `busy_s` after each."""
    loader = DataLoader(data_args, tokenizer, 0, 1)
    try:
        next(loader)
        waited, start = 0.0, time.perf_counter()
        for _ in range(batches):
            since = time.perf_counter()
            next(loader)
            waited += time.perf_counter() - since
            spin(busy_s)
        wall = time.perf_counter() - start
    finally:
        loader.close()
    tokens = batches * data_args.batch_size * data_args.seq_len
    return {"tokens_per_s": tokens / wall, "wait_share": waited / wall, "wait_per_batch_s": waited / batches}


def loader_rates(data_args, tokenizer, batches: int, rounds: int) -> dict:
    """{"inline"|"async": {"idle"|"busy": medians}}; busy spins as long as the idle in-line loader takes a batch."""
    inline = replace(data_args, load_async=False)
    per_batch = statistics.median(1 / loader_run(inline, tokenizer, batches, 0.0)["tokens_per_s"]
                                  for _ in range(rounds)) * data_args.batch_size * data_args.seq_len
    runs: dict = {}
    cases = [(mode, consumer) for mode in ("inline", "async") for consumer in ("idle", "busy")]
    for round_ in range(rounds):
        for mode, consumer in (cases if round_ % 2 == 0 else cases[::-1]):  # alternating: load drifts alike
            args = replace(data_args, load_async=mode == "async")
            runs.setdefault((mode, consumer), []).append(
                loader_run(args, tokenizer, batches, per_batch if consumer == "busy" else 0.0))
    out = {mode: {consumer: medians(runs[mode, consumer]) for consumer in ("idle", "busy")}
           for mode in ("inline", "async")}
    out["busy_spin_s"] = per_batch
    out["workers"] = getattr(data_args, "workers", None)  # the process loader's setting, where the config has it
    return out


def medians(rows: list[dict]) -> dict:
    return {key: statistics.median(row[key] for row in rows) for key in rows[0]}


def timed(call: Callable) -> tuple[object, float]:
    start = time.perf_counter()
    result = call()
    return result, time.perf_counter() - start


def _busy_ready(_) -> int:
    time.sleep(0.2)
    return os.getpid()


def warm_pool(workers: int) -> ProcessPoolExecutor:
    """A started encode pool: every worker has imported and answered (start-up is not an encoding rate)."""
    pool = start_encode_pool(workers)
    while len(set(pool.map(_busy_ready, range(2 * workers)))) < workers:
        pass
    return pool


def encode_rate(jobs: list[tuple], workers: int, tokens: int) -> float:
    """Tokens/s encoding `jobs` (shard_bytes' arguments) in a started pool of `workers` processes."""
    pool = warm_pool(workers)
    try:
        _, seconds = timed(lambda: list(pool.map(shard_bytes, *zip(*jobs))))
    finally:
        pool.shutdown()
    return tokens / seconds


def writer_rates(args: TeacherCacheArgs, device: torch.device, shards: int, rounds: int, folder: Path,
                 encode_only: bool = False) -> dict:
    """The writer's stages over `shards` shards, the whole writer pipelined against serial, the reader's decode
    (`encode_only`: the stages up to the encoding)."""
    tokenizer = build_tokenizer(args.data.tokenizer)
    teacher = TeacherModel(args.distillation, device)
    args = replace(args, streams=1, sequences_per_stream=shards * args.shard_sequences)
    manifest = planned_manifest(args, tokenizer)
    tokens_per_shard = manifest.shard_sequences * args.data.seq_len
    total = shards * tokens_per_shard
    reader = StreamReader(args, tokenizer, folder / "unused", manifest)
    windows, tokenize_s = timed(lambda: [reader.shard_windows(i) for i in range(shards)])
    teacher_outputs(teacher, windows[0][2], manifest, args.forward_rows, None)  # warm-up (kernels, allocator)
    outputs, forward_s = timed(lambda: [teacher_outputs(teacher, batch, manifest, args.forward_rows, None)
                                        for _, _, batch, _ in windows])
    jobs = [(torch.cat([batch["input_ids"], batch["labels"][:, -1:]], dim=1), batch["doc_ids"], out, manifest,
             dict(shard=i, stream=stream, chunk=chunk, loader_state=state))
            for i, ((stream, chunk, batch, state), out) in enumerate(zip(windows, outputs))]
    encode = {1: [], 2: []}
    for round_ in range(rounds):
        for workers in ((1, 2) if round_ % 2 == 0 else (2, 1)):
            encode[workers].append(encode_rate(jobs, workers, total))
    stages = {"shards": shards, "tokens_per_shard": tokens_per_shard, "teacher_params": teacher.n_params,
              "tokenize_tokens_per_s": total / tokenize_s, "forward_tokens_per_s": total / forward_s,
              "encode_1_worker_tokens_per_s": statistics.median(encode[1]),
              "encode_2_workers_tokens_per_s": statistics.median(encode[2]),
              "encode_scaling_2_over_1": statistics.median(encode[2]) / statistics.median(encode[1]),
              "encode_rounds": {"1": encode[1], "2": encode[2]}, "encode_workers_auto": auto_encode_workers()}
    if encode_only:
        return stages
    files, _ = timed(lambda: [shard_bytes(*job) for job in jobs])
    cache = folder / "stages"
    _, write_s = timed(lambda: [write_file_atomic(shard_path(cache, i), data) for i, data in enumerate(files)])
    whole = {"serial": [], "pipelined": []}
    for round_ in range(rounds):
        for mode in (("serial", "pipelined") if round_ % 2 == 0 else ("pipelined", "serial")):
            target = folder / f"{mode}_{round_}"
            run_args = replace(args, cache_dir=str(target), encode_workers=0 if mode == "serial" else -1)
            topo = SimpleNamespace(device=device, global_rank=0)
            _, seconds = timed(lambda: write_shards(run_args, StreamReader(run_args, tokenizer, target, manifest),
                                                    teacher, manifest, list(range(shards)), True, topo))
            whole[mode].append(total / seconds)
    decode_s = []
    for i in range(shards):
        forget_decoded_shards()
        with single_thread():
            decode_s.append(timed(lambda: read_shard(shard_path(cache, i), range(manifest.shard_sequences),
                                                     manifest))[1])
    return {**stages, "write_tokens_per_s": total / write_s,
            "serial_writer_tokens_per_s": statistics.median(whole["serial"]),
            "pipelined_writer_tokens_per_s": statistics.median(whole["pipelined"]),
            "reader_decode_tokens_per_s": tokens_per_shard / statistics.median(decode_s)}


class single_thread:
    """torch on one thread inside the block (a loader's decode runs on one)."""

    def __enter__(self):
        self.threads = torch.get_num_threads()
        torch.set_num_threads(1)

    def __exit__(self, *exc):
        torch.set_num_threads(self.threads)


def format_table(results: dict) -> str:
    """The markdown table of results.json: loader, writer stages, reader (and the GPU steps where measured)."""
    lines = [f"feeding rates, {results['machine']}, {results['date']} (tokens/s per rank)", "",
             "| path | measured | note |", "|---|---|---|"]
    loader = results.get("loader", {})  # absent with --skip-loader
    for mode in [m for m in ("inline", "async") if m in loader]:
        for consumer in ("idle", "busy"):
            row = loader[mode][consumer]
            lines.append(f"| loader, load_async={str(mode == 'async').lower()}, training thread {consumer} | "
                         f"{row['tokens_per_s']:,.0f} | waits {100 * row['wait_share']:.0f}% of the time |")
    writer = results["writer"]
    for key, label in (("tokenize", "writer: tokenize"), ("forward", "writer: teacher forward + top-k"),
                       ("encode_1_worker", "writer: encode, 1 worker"),
                       ("encode_2_workers", "writer: encode, 2 workers"),
                       ("write", "writer: write"), ("serial_writer", "writer, serial"),
                       ("pipelined_writer", f"writer, pipelined ({writer['encode_workers_auto']} encode workers)"),
                       ("reader_decode", "reader: decode, one thread")):
        if key + "_tokens_per_s" not in writer:  # --encode-only
            continue
        note = ""
        if key == "encode_2_workers":
            note = f"{writer['encode_scaling_2_over_1']:.2f}x one worker"
        if key == "pipelined_writer":
            note = (f"{writer['pipelined_writer_tokens_per_s'] / writer['serial_writer_tokens_per_s']:.2f}x serial, "
                    f"{100 * writer['pipelined_writer_tokens_per_s'] / writer['forward_tokens_per_s']:.0f}% of the "
                    f"teacher's forward")
        lines.append(f"| {label} | {writer[key + '_tokens_per_s']:,.0f} | {note} |")
    if "steps" in results:
        lines += ["", format_step_table(results, ISSUE_TABLE)]
    return "\n".join(lines)


def parse(argv: Optional[list[str]]) -> tuple[argparse.Namespace, TeacherCacheArgs]:
    parser = argparse.ArgumentParser(prog="python -m apps.bench.feeding", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="write DIR/results.json")
    parser.add_argument("--config", default="configs/distill_exps/kd_study.yaml", help="the data and teacher settings")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--batches", type=int, default=40, help="loader batches per measurement")
    parser.add_argument("--shards", type=int, default=6, help="shards through the writer's stages")
    parser.add_argument("--rounds", type=int, help="repeats, in alternating order (default 3 on cpu, 1 on cuda)")
    parser.add_argument("--steps", type=int, default=30, help="training steps per run (--device cuda)")
    parser.add_argument("--students", default="139m,810m", help="the students of the step comparison (--device cuda)")
    parser.add_argument("--skip-loader", action="store_true", help="measure the writer and reader only")
    parser.add_argument("--encode-only", action="store_true", help="of the writer, the stages up to encoding only")
    parser.add_argument("--compare-steps", action="store_true", help="the step comparison on the CPU too (tests)")
    parser.add_argument("--teacher", choices=("random-tiny", "random", "config"),
                        help="the config's teacher's shape with random weights (default on cuda), 2 layers of width "
                             "64 with its tokenizer (default on cpu: the stages, not the teacher, are measured), or "
                             "the config's teacher itself")
    options, overrides = parser.parse_known_args(argv)
    if any("=" not in item for item in overrides):
        raise ConfigError(f"{overrides}: after the options, give config overrides as key=value.")
    options.rounds = options.rounds or (1 if options.device == "cuda" else 3)  # cuda: within gpu_check's budget
    options.teacher = options.teacher or ("random" if options.device == "cuda" else "random-tiny")
    # On the GPU, the issue's setting: 8 windows of 2,048 tokens a step, top-64
    gpu = ["data.seq_len=2048", "data.batch_size=8", "model.max_seqlen=2048", "distillation.output=topk",
           "distillation.k=64", "distillation.teacher_dtype=bf16"]
    options.overrides = [*(gpu if options.device == "cuda" else []), *overrides]
    cache_keys = ["shard_sequences=16", "cache_dir=unused", "forward_rows=8"]
    return options, parse_args(TeacherCacheArgs, [f"config={options.config}", *cache_keys, *options.overrides])


def main(argv: Optional[list[str]] = None) -> None:
    options, args = parse(argv)
    if options.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda needs a GPU: none is visible here; run the CPU bench without --device.")
    device = torch.device(options.device)
    results = {"machine": f"{os.cpu_count()} CPUs" + (f", {torch.cuda.get_device_name()}" if options.device == "cuda"
                                                     else ""),
               "date": time.strftime("%Y-%m-%d", time.gmtime()), "config": options.config, "device": options.device}
    if not options.skip_loader:
        tokenizer = build_tokenizer(args.data.tokenizer)
        results["loader"] = loader_rates(args.data, tokenizer, options.batches, options.rounds)
        print(json.dumps({"loader": results["loader"]}), flush=True)
    with tempfile.TemporaryDirectory() as folder:
        if options.teacher != "config":
            teacher = random_teacher(args.distillation.teacher_path, Path(folder) / "teacher",
                                     tiny=options.teacher == "random-tiny")
            args.distillation.teacher_path = str(teacher)
        results["teacher"] = options.teacher
        results["writer"] = writer_rates(args, device, options.shards, options.rounds, Path(folder),
                                         options.encode_only)
        print(json.dumps({"writer": results["writer"]}), flush=True)
        if (options.device == "cuda" or options.compare_steps) and not options.encode_only:
            results["steps"] = step_comparison(options, args, Path(folder))
    options.out.mkdir(parents=True, exist_ok=True)
    (options.out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    (options.out / "table.md").write_text(format_table(results) + "\n")
    print(format_table(results))


if __name__ == "__main__":
    run_cli(main)
