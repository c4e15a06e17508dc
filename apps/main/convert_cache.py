"""Convert a version 1 teacher cache to version 2 (lossless, about half the bytes), or report a cache's size.

    python -m apps.main.convert_cache OLD_DIR NEW_DIR     # writes NEW_DIR; OLD_DIR is left as it is
    python -m apps.main.convert_cache --sizes DIR         # bytes per token on disk, per stream for v2 shards

One process, shard by shard: each is decoded from v1, coded by `lingua.distillation.cache.codec` (which checks
that it decodes to the same tensors), and written atomically with the same metadata; the manifest says
version 2, and index.json is written last. Interrupted, it resumes: finished shards of NEW_DIR are kept.
Training from NEW_DIR gives the same metrics as from OLD_DIR (tests/unit/lingua/distillation/cache/test_codec.py).
"""

import argparse
import json
import logging
import time
from dataclasses import replace
from pathlib import Path
from typing import Optional

from safetensors import safe_open

from lingua.cli.entry import run_cli
from lingua.distillation.cache.store import (
    INDEX,
    CacheManifest,
    read_v1_shard,
    check_cache_complete,
    shard_metadata,
    shard_path,
    write_json_atomic,
    write_shard,
)
from lingua.errors import ConfigError
from lingua.logger import init_logger

logger = logging.getLogger("convert_cache")


def convert(source: Path, target: Path) -> dict:
    """Write the v2 conversion of the finished v1 cache `source` into `target`; returns both sizes."""
    manifest = CacheManifest.read(source)
    if manifest.version != 1:
        raise ConfigError(f"{source} is already a version {manifest.version} teacher cache; train from it as it is.")
    if target.resolve() == source.resolve():
        raise ConfigError(f"Convert into a new directory, not into {source} itself (the old cache stays intact "
                          f"until you delete it).")
    paths = check_cache_complete(source, manifest)
    converted = replace(manifest, version=2)
    if (target / "cache.json").is_file():
        existing = CacheManifest.read(target)
        if existing != converted:
            raise ConfigError(f"{target} already holds another teacher cache; convert into a new directory.")
    target.mkdir(parents=True, exist_ok=True)
    converted.write(target)
    start, rows = time.perf_counter(), range(0, manifest.shard_sequences)
    for index, path in enumerate(paths):
        out = shard_path(target, index)
        if shard_metadata(out) is not None:
            continue
        with safe_open(str(path), "pt") as f:
            metadata = {key: json.loads(value) for key, value in (f.metadata() or {}).items()}
        tokens, doc_ids, teacher = read_v1_shard(path, slice(rows.start, rows.stop, 1), manifest)
        write_shard(out, tokens, doc_ids, teacher, converted, metadata)
    write_json_atomic(target / INDEX, json.loads((source / INDEX).read_text()))
    sizes = {"v1": cache_sizes(source), "v2": cache_sizes(target)}
    logger.info(f"converted {len(paths)} shard(s) in {time.perf_counter() - start:.1f} s: "
                f"{sizes['v1']['bytes_per_token']:.1f} -> {sizes['v2']['bytes_per_token']:.1f} B/token on disk")
    return sizes


def cache_sizes(cache_dir: Path) -> dict:
    """Bytes per token of a finished cache's shards on disk, and (v2) per stream, from the files themselves."""
    manifest = CacheManifest.read(cache_dir)
    paths = check_cache_complete(cache_dir, manifest)
    tokens = manifest.n_shards * manifest.shard_sequences * manifest.data["seq_len"]
    streams: dict[str, int] = {}
    for path in paths:
        with safe_open(str(path), "pt") as f:
            for name in f.keys():
                streams[name] = streams.get(name, 0) + f.get_slice(name).get_shape()[0] * (
                    1 if manifest.version == 2 else 0)
    total = sum(path.stat().st_size for path in paths)
    return {"version": manifest.version, "output": manifest.output, "k": manifest.k, "tokens": tokens,
            "bytes": total, "bytes_per_token": total / tokens,
            "streams_bytes_per_token": {name: size / tokens for name, size in streams.items() if size}}


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m apps.main.convert_cache", description=__doc__.split("\n")[0])
    parser.add_argument("source", type=Path, help="the cache to convert (or, with --sizes, to measure)")
    parser.add_argument("target", type=Path, nargs="?", help="the new directory for the version 2 cache")
    parser.add_argument("--sizes", action="store_true", help="only print the cache's bytes per token on disk")
    options = parser.parse_args(argv)
    init_logger(0, "convert")
    if options.sizes:
        print(json.dumps(cache_sizes(options.source), indent=1))
        return
    if options.target is None:
        raise ConfigError("Name the new directory: python -m apps.main.convert_cache OLD_DIR NEW_DIR.")
    print(json.dumps(convert(options.source, options.target), indent=1))


if __name__ == "__main__":
    run_cli(main)
