"""Teacher cache format v2: bytes per token on disk, encode/decode speed, and decode against a student's appetite.

    python -m apps.bench.cache_codec --cache DIR [--cache DIR2 ...] [--student-steps 20] [--out FILE.json]

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

from apps.bench.runs import ROOT, trainer_command
from apps.main.convert_cache import cache_sizes
from lingua.cli import run_cli
from lingua.distillation.cache import CacheManifest, check_cache_complete, forget_decoded_shards, read_shard
from lingua.distillation.cache_codec import encode_shard
from lingua.errors import RunFailed


def codec_speed(cache_dir: Path) -> dict:
    """Tokens per second decoding each shard (fresh, no memo) and encoding it again (with the writer's check)."""
    manifest = CacheManifest.read(cache_dir)
    rows = range(0, manifest.shard_sequences)
    tokens_per_shard = manifest.shard_sequences * manifest.data["seq_len"]
    decode_s, encode_s = [], []
    for path in check_cache_complete(cache_dir, manifest):
        start = time.perf_counter()
        batch = read_shard(path, rows, manifest)
        decode_s.append(time.perf_counter() - start)
        forget_decoded_shards()  # the next read decodes again
        tokens = torch.cat([batch["input_ids"], batch["labels"][:, -1:]], dim=1)
        start = time.perf_counter()
        encode_shard(tokens, batch["doc_ids"], batch["teacher"], manifest.vocab_size)
        encode_s.append(time.perf_counter() - start)
    return {"shards": len(decode_s), "tokens_per_shard": tokens_per_shard,
            "decode_tokens_per_s": round(tokens_per_shard / statistics.median(decode_s)),
            "encode_tokens_per_s": round(tokens_per_shard / statistics.median(encode_s))}


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
    parser = argparse.ArgumentParser(prog="python -m apps.bench.cache_codec", description=__doc__.split("\n")[0])
    parser.add_argument("--cache", type=Path, action="append", required=True, help="a finished teacher cache")
    parser.add_argument("--student-steps", type=int, default=0, help="also time the student from each cache")
    parser.add_argument("--config", default="configs/distill_exps/kd_study.yaml", help="the student's config")
    parser.add_argument("--out", type=Path, help="write the results as json here")
    options = parser.parse_args(argv)
    torch.set_num_threads(1)  # one data-loading thread's speed, as a loader has
    results = []
    for cache_dir in options.cache:
        result = {"cache": str(cache_dir), **cache_sizes(cache_dir), **codec_speed(cache_dir)}
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
