"""Teacher cache format v2: bytes per token on disk, encode/decode speed, and decode against a student's appetite.

    python -m apps.bench.codec_speed --cache DIR [--cache DIR2 ...] [--levels 1,3,19] [--student-steps 20] [--out FILE.json]

For each finished cache (v1 or v2): its bytes per token on disk (per stream for v2, and what v1 would take),
then for every shard the time to decode it (what training does, single thread) and to encode it again (what the
writer does, the round-trip check included), in tokens per second. With --student-steps N it also trains the
cache's student from the cache for N steps on one rank (the config in the cache's manifest is not enough: pass
--config, default the study's) and reads its tokens per second from metrics.jsonl, so the decode margin is
measured on the same machine at the same time: decode tokens/s over the student's tokens/s.
"""

import argparse
import json
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Optional

import torch

from apps.bench.launcher import ROOT, trainer_command
from apps.main.convert_cache import cache_sizes
from lingua.cli.entry import run_cli
from lingua.distillation.cache.store import CacheManifest, check_cache_complete, forget_decoded_shards, read_shard
from lingua.distillation.cache.codec import encode_shard
from lingua.errors import RunFailed


def codec_speed(cache_dir: Path, levels: tuple[int, ...] = ()) -> dict:
    """Tokens per second decoding each shard (fresh, no memo) and encoding it again (with the writer's check) at the
    cache's zstd level; with `levels`, also each level's encoding rate and streams' bytes per token."""
    manifest = CacheManifest.read(cache_dir)
    rows = range(0, manifest.shard_sequences)
    tokens_per_shard = manifest.shard_sequences * manifest.data["seq_len"]
    decode_s, encode_s = [], []
    at_level = {level: {"seconds": [], "bytes": 0} for level in levels}
    for path in check_cache_complete(cache_dir, manifest):
        start = time.perf_counter()
        batch = read_shard(path, rows, manifest)
        decode_s.append(time.perf_counter() - start)
        forget_decoded_shards()  # the next read decodes again
        tokens = torch.cat([batch["input_ids"], batch["labels"][:, -1:]], dim=1)
        start = time.perf_counter()
        encode_shard(tokens, batch["doc_ids"], batch["teacher"], manifest.vocab_size, manifest.zstd_level)
        encode_s.append(time.perf_counter() - start)
        for level, seen in at_level.items():
            start = time.perf_counter()
            streams, _ = encode_shard(tokens, batch["doc_ids"], batch["teacher"], manifest.vocab_size, level)
            seen["seconds"].append(time.perf_counter() - start)
            seen["bytes"] += sum(blob.numel() for blob in streams.values())
    shards = len(decode_s)
    return {"shards": shards, "tokens_per_shard": tokens_per_shard, "zstd_level": manifest.zstd_level,
            "decode_tokens_per_s": round(tokens_per_shard / statistics.median(decode_s)),
            "encode_tokens_per_s": round(tokens_per_shard / statistics.median(encode_s)),
            **({"levels": {level: {"encode_tokens_per_s": round(tokens_per_shard / statistics.median(seen["seconds"])),
                                   "stream_bytes_per_token": round(seen["bytes"] / (shards * tokens_per_shard), 2)}
                           for level, seen in at_level.items()}} if levels else {})}


def student_tokens_per_s(cache_dir: Path, config: str, steps: int) -> float:
    """The student's training throughput from the cache (one rank, CPU), the median over its logged steps."""
    with tempfile.TemporaryDirectory() as dump:
        overrides = [f"dump_dir={dump}", f"steps={steps}", "distillation.source=cache",
                     f"distillation.cache_dir={cache_dir}", "logging.freq=1", "heldout.every=0",
                     f"distillation.output={CacheManifest.read(cache_dir).output}",
                     f"distillation.k={CacheManifest.read(cache_dir).k}"]
        result = subprocess.run(trainer_command(1, config, overrides), cwd=ROOT, capture_output=True, text=True)
        if result.returncode != 0:
            raise RunFailed(f"the student run from {cache_dir} failed:\n{result.stdout[-2000:]}{result.stderr[-2000:]}")
        rows = [json.loads(line) for line in (Path(dump) / "metrics.jsonl").read_text().splitlines()]
    speeds = [row["speed/tokens_per_s"] for row in rows if row.get("step", 0) > 2 and "speed/tokens_per_s" in row]
    return statistics.median(speeds)


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m apps.bench.codec_speed", description=__doc__.split("\n")[0])
    parser.add_argument("--cache", type=Path, action="append", required=True, help="a finished teacher cache")
    parser.add_argument("--student-steps", type=int, default=0, help="also time the student from each cache")
    parser.add_argument("--config", default="configs/distill_exps/kd_study.yaml", help="the student's config")
    parser.add_argument("--levels", default="", help="zstd levels to re-encode every shard at, e.g. 1,3,19: "
                                                     "each one's encoding rate and bytes per token (zstd_level)")
    parser.add_argument("--out", type=Path, help="write the results as json here")
    options = parser.parse_args(argv)
    torch.set_num_threads(1)  # one data-loading thread's speed, as a loader has
    results = []
    for cache_dir in options.cache:
        levels = tuple(int(level) for level in options.levels.split(",") if level)
        result = {"cache": str(cache_dir), **cache_sizes(cache_dir), **codec_speed(cache_dir, levels)}
        if options.student_steps:
            student = student_tokens_per_s(cache_dir, options.config, options.student_steps)
            result.update(student_tokens_per_s=round(student), decode_margin=round(
                result["decode_tokens_per_s"] / student, 1))
        results.append(result)
        print(json.dumps(result, indent=1), flush=True)
    if options.out:
        options.out.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    run_cli(main)
