"""Download a Hugging Face dataset and write it in the chunk layout `lingua.data` reads.

    python -m setup.download_prepare_hf_data fineweb_edu_10bt --data-dir data --n-chunks 32 --max-docs 1000000
    python -m setup.download_prepare_hf_data --from-jsonl my_docs.jsonl --source mydocs --data-dir data

Writes `<data-dir>/<source>/<source>.chunk.<i>.jsonl` (i = 0..n_chunks-1) and `<source>.val.jsonl`, all at
once (a crash leaves no half-written source folder). Downloading needs the optional `datasets` package and
network access; `shuffle_and_split` works on local jsonl files only.

Shuffle: documents are dealt to chunks in blocks of n_chunks with a fresh random permutation per block
(chunk sizes differ by at most one), then each chunk is shuffled in memory. So one chunk, not the whole
dataset, must fit in memory: pick n_chunks accordingly.
"""

import argparse
import json
import logging
from pathlib import Path
from typing import Optional

import numpy as np

from lingua.cli.entry import run_cli
from lingua.errors import ConfigError, DataError, MissingPathError
from setup.atomic_dir import atomic_output_dir

logger = logging.getLogger(__name__)

# name -> (hub repo, config, text field)
DATASETS = {
    "fineweb_edu_10bt": ("HuggingFaceFW/fineweb-edu", "sample-10BT", "text"),
    "fineweb_edu_100bt": ("HuggingFaceFW/fineweb-edu", "sample-100BT", "text"),
    "fineweb_10bt": ("HuggingFaceFW/fineweb", "sample-10BT", "text"),
    "smollm_cosmopedia": ("HuggingFaceTB/smollm-corpus", "cosmopedia-v2", "text"),
}
INFO_NAME = "prepare_info.json"


def _nonempty_lines(paths: list[Path]):
    for path in paths:
        with open(path, "rb") as f:
            for raw in f:
                if raw.strip():
                    yield raw if raw.endswith(b"\n") else raw + b"\n"


def _shuffle_file(path: Path, rng: np.random.Generator) -> None:
    with open(path, "rb") as f:
        lines = f.readlines()
    with open(path, "wb") as f:
        f.writelines(lines[i] for i in rng.permutation(len(lines)))


def shuffle_and_split(input_files: list, out_dir, source: str, n_chunks: int, val_docs: int,
                      seed: int = 42) -> dict:
    """Shuffle the non-empty lines of `input_files` into `out_dir/<source>.chunk.<i>.jsonl` + `<source>.val.jsonl`.

    `val_docs` lines, drawn at random, go to the validation file; the rest are dealt evenly over the
    chunks. Lines are copied as they are (the loader counts and skips malformed ones). Deterministic
    for a given seed. Returns the counts written.
    """
    input_files = [Path(p) for p in input_files]
    out_dir = Path(out_dir)
    for path in input_files:
        if not path.is_file():
            raise MissingPathError(f"Input file '{path}' does not exist; pass existing jsonl files.")
    if n_chunks < 1 or val_docs < 0:
        raise ConfigError(f"n_chunks={n_chunks} must be >= 1 and val_docs={val_docs} >= 0.")
    n_docs = sum(1 for _ in _nonempty_lines(input_files))
    if n_docs - val_docs < n_chunks:
        raise DataError(f"{n_docs} documents cannot fill {n_chunks} chunks after holding out {val_docs} for "
                        f"validation; lower --n-chunks or --val-docs, or add data.")
    rng = np.random.default_rng(seed)
    val_indices = set(rng.choice(n_docs, size=val_docs, replace=False).tolist())
    out_dir.mkdir(parents=True, exist_ok=True)
    chunk_paths = [out_dir / f"{source}.chunk.{i}.jsonl" for i in range(n_chunks)]
    val_path = out_dir / f"{source}.val.jsonl"
    # No validation file at all when none is asked for: an empty one would make eval report nothing.
    out_paths = chunk_paths + ([val_path] if val_docs else [])
    chunk_sizes = [0] * n_chunks
    files = [open(path, "wb") for path in out_paths]
    n_train = 0
    try:
        for index, raw in enumerate(_nonempty_lines(input_files)):
            if index in val_indices:
                files[n_chunks].write(raw)
                continue
            if n_train % n_chunks == 0:
                block_order = rng.permutation(n_chunks)
            chunk = int(block_order[n_train % n_chunks])
            files[chunk].write(raw)
            chunk_sizes[chunk] += 1
            n_train += 1
    finally:
        for f in files:
            f.close()
    for path in out_paths:
        _shuffle_file(path, rng)
    stats = dict(source=source, n_chunks=n_chunks, n_train_docs=n_train, n_val_docs=len(val_indices),
                 chunk_sizes=chunk_sizes, seed=seed)
    logger.info(f"wrote {n_train} train docs in {n_chunks} chunks and {len(val_indices)} val docs to {out_dir}")
    return stats


def prepare_source(input_files: list, data_dir, source: str, n_chunks: int, val_docs: int, seed: int = 42) -> Path:
    """`shuffle_and_split` into `<data_dir>/<source>/`, replacing that folder atomically; returns it."""
    source_dir = Path(data_dir) / source
    with atomic_output_dir(source_dir) as tmp_dir:
        stats = shuffle_and_split(input_files, tmp_dir, source, n_chunks, val_docs, seed)
        (tmp_dir / INFO_NAME).write_text(json.dumps(stats, indent=2) + "\n")
    return source_dir


def download_to_jsonl(repo: str, config: Optional[str], text_field: str, out_path,
                      max_docs: Optional[int] = None) -> int:
    """Stream `repo` (train split) from the Hugging Face hub into `{"text": ...}` lines; returns the count."""
    try:
        from datasets import load_dataset
    except ImportError:
        raise ImportError("Downloading needs the `datasets` package: pip install datasets "
                          "(or prepare local files with --from-jsonl).") from None
    dataset = load_dataset(repo, name=config, split="train", streaming=True)
    count = 0
    with open(out_path, "w", encoding="utf-8") as f:
        for row in dataset:
            if max_docs is not None and count >= max_docs:
                break
            f.write(json.dumps({"text": row[text_field]}, ensure_ascii=False) + "\n")
            count += 1
            if count % 100_000 == 0:
                logger.info(f"downloaded {count} documents")
    return count


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dataset", nargs="?", choices=sorted(DATASETS), help="dataset to download")
    parser.add_argument("--from-jsonl", nargs="+", type=Path, help="local jsonl files instead of a download")
    parser.add_argument("--source", help="source folder name (default: the dataset name)")
    parser.add_argument("--data-dir", type=Path, default=Path("data"), help="the data.root_dir of a config")
    parser.add_argument("--n-chunks", type=int, default=8, help="training chunk files (>= data-parallel ranks is best)")
    parser.add_argument("--val-docs", type=int, default=1000, help="documents held out in <source>.val.jsonl")
    parser.add_argument("--max-docs", type=int, default=None, help="stop the download after this many documents")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--keep-download", action="store_true", help="keep the raw downloaded jsonl")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if (args.dataset is None) == (args.from_jsonl is None):
        parser.error("give either a dataset name or --from-jsonl FILES")
    source = args.source or args.dataset
    if source is None:
        parser.error("--source is required with --from-jsonl")
    if args.from_jsonl:
        source_dir = prepare_source(args.from_jsonl, args.data_dir, source, args.n_chunks, args.val_docs, args.seed)
    else:
        repo, config, text_field = DATASETS[args.dataset]
        args.data_dir.mkdir(parents=True, exist_ok=True)
        download = args.data_dir / f".{source}.download.jsonl"
        count = download_to_jsonl(repo, config, text_field, download, args.max_docs)
        logger.info(f"downloaded {count} documents from {repo} ({config}) to {download}")
        source_dir = prepare_source([download], args.data_dir, source, args.n_chunks, args.val_docs, args.seed)
        if not args.keep_download:
            download.unlink()
    print(f"{source_dir}: set data.root_dir={args.data_dir} data.sources.{source}=1.0")


if __name__ == "__main__":
    run_cli(main)
