"""Documents on disk: the jsonl chunk layout, sharding files over data-parallel ranks, and the
line-to-document rule with its counted skips.

Layout (written by setup/download_prepare_hf_data.py and setup/prepare_corpus.py):

    <root_dir>/<source>/<name>.chunk.<i>.jsonl   training documents, one JSON object per line
    <root_dir>/<source>/<name>.val.jsonl         held-out documents (optional, for in-loop eval)

Each line holds a "text" (or "content") string. Lines that are not JSON objects with such a string are
counted and skipped; a few are logged in full, then only at 10, 100, 1000, ...

Sharding never drops a file: with F files and D ranks, if F >= D rank r reads files r, r+D, r+2D, ...;
if F < D rank r reads file r % F, and the ranks sharing a file split its lines (each of the k ranks on
a file takes every k-th line, starting at line r // F). Either way every line belongs to one rank.
"""

import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

logger = logging.getLogger("lingua.data")

MALFORMED_LOGGED_IN_FULL = 5


def _chunk_sort_key(path: Path) -> tuple:
    stem, _, index = path.name[: -len(".jsonl")].rpartition(".chunk.")
    return (stem, int(index) if index.isdigit() else -1, path.name)


def list_chunk_files(root_dir: str, source: str) -> list[Path]:
    """The training chunk files of `source` in chunk order; readable error when there are none."""
    directory = Path(root_dir) / source
    if not directory.is_dir():
        raise FileNotFoundError(f"Data source directory {str(directory)!r} does not exist; fix data.root_dir or the "
                                f"source name in data.sources (setup/download_prepare_hf_data.py writes this layout).")
    files = sorted(directory.glob("*.chunk.*.jsonl"), key=_chunk_sort_key)
    if not files:
        raise FileNotFoundError(f"Data source directory {str(directory)!r} has no '*.chunk.<i>.jsonl' files; prepare "
                                f"it with setup/download_prepare_hf_data.py or remove {source!r} from data.sources.")
    return files


def list_val_files(root_dir: str, source: str) -> list[Path]:
    """The validation files (`*.val.jsonl`) of `source`, sorted; empty when there are none."""
    return sorted((Path(root_dir) / source).glob("*.val.jsonl"))


@dataclass(frozen=True)
class FileShard:
    """The lines of `path` whose 0-based number is `offset` modulo `stride` (stride 1: the whole file)."""

    path: str
    stride: int = 1
    offset: int = 0

    def describe(self) -> list:
        return [Path(self.path).name, self.stride, self.offset]


def shard_files(files: list, dp_rank: int, dp_degree: int) -> list[FileShard]:
    """This rank's share of `files`: round-robin files when there are enough, else strided lines of one file."""
    n_files = len(files)
    assert n_files > 0 and 0 <= dp_rank < dp_degree
    if n_files >= dp_degree:
        return [FileShard(str(path)) for path in files[dp_rank::dp_degree]]
    sharing_ranks = range(dp_rank % n_files, dp_degree, n_files)
    return [FileShard(str(files[dp_rank % n_files]), len(sharing_ranks), dp_rank // n_files)]


class MalformedLines:
    """Counts skipped lines; logs the first few in full, then only at 10, 100, 1000, ... so logs stay short."""

    def __init__(self, count: int = 0):
        self.count = count

    def text_of(self, raw: bytes, path: str, line_no: int) -> Optional[str]:
        """The document text of a jsonl line, or None (counted) when the line is malformed."""
        try:
            record = json.loads(raw)
        except ValueError:  # includes invalid UTF-8
            return self._skip(path, line_no, "not valid JSON")
        if not isinstance(record, dict):
            return self._skip(path, line_no, "not a JSON object")
        text = record.get("text", record.get("content"))
        if text is None:
            return self._skip(path, line_no, "no 'text' or 'content' field")
        if not isinstance(text, str):
            return self._skip(path, line_no, f"'text' is a {type(text).__name__}, not a string")
        return text

    def _skip(self, path: str, line_no: int, reason: str) -> None:
        self.count += 1
        where = f"{path}:{line_no + 1}"
        if self.count <= MALFORMED_LOGGED_IN_FULL:
            suffix = "; further ones are only counted (totals at 10, 100, 1000, ...)" \
                if self.count == MALFORMED_LOGGED_IN_FULL else ""
            logger.warning(f"skipping malformed data line {where}: {reason}{suffix}")
        elif math.log10(self.count).is_integer():
            logger.warning(f"{self.count} malformed data lines skipped so far (latest {where}: {reason})")
        return None
