r"""Documents on disk: the jsonl chunk layout, sharding files over data-parallel ranks, and the
line-to-document rule with its counted skips.

Layout (written by setup/download_prepare_hf_data.py and setup/prepare_corpus.py):

    <root_dir>/<source>/<name>.chunk.<i>.jsonl   training documents, one JSON object per line
    <root_dir>/<source>/<name>.val.jsonl         held-out documents (optional, for in-loop eval)

The line -> document rule (`parse_line`), one for training and eval files. A line is the bytes up to
and including b"\n" (the "\r" of CRLF is whitespace JSON ignores). Checked in this order:

    over MAX_LINE_BYTES (8 MiB)        skipped; read in 1 MiB blocks, never held whole (`read_line`)
    a leading UTF-8 BOM                dropped, on any line (concatenated files keep theirs)
    blank (empty, ASCII whitespace)    not data: neither a document nor a skip
    not strict UTF-8                   skipped (UTF-8-encoded surrogates and overlong forms too)
    not JSON                           skipped (a raw NUL or control byte, trailing data, a 5000-digit int)
    nested deeper than MAX_NESTING     skipped, at depth 101 whatever the stack (json's own limit varies)
    not an object                      skipped
    no "text" (else "content") field   skipped; a field that is not a string: skipped
    a lone surrogate in the text       skipped, not repaired: a "\ud83d" escape left by a truncated
                                       scrape; no tokenizer encodes it and U+FFFD would be made-up text
    empty or whitespace-only text      skipped: a bos, eos document teaches nothing, and the count shows it
    anything else                      a document, "\u0000", control, private-use and unassigned
                                       characters included (every tokenizer encodes them; tested)

So one pass over a rank's lines of a file gives documents + skips == its non-blank lines. Every skip
is counted (`MalformedLines.count`: the loader's `bad_lines`, kept in its state). The first few are
logged with file:line and the reason, then only the totals at 10, 100, 1000, ...; when a reader
reaches the end of a file it logs that file's count, if non-zero (on each pass over it).

Sharding never drops a file: with F files and D ranks, if F >= D rank r reads files r, r+D, r+2D, ...;
if F < D rank r reads file r % F, and the ranks sharing a file split its lines (each of the k ranks on
a file takes every k-th line, starting at line r // F). Either way every line belongs to one rank.
"""

import json
import logging
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from lingua.errors import MissingPathError

logger = logging.getLogger("lingua.data")

MALFORMED_LOGGED_IN_FULL = 5
MAX_LINE_BYTES = 8 << 20  # far above real documents (a book is ~1 MB); longer is a broken file (lost newlines)
MAX_NESTING = 100  # JSON containers within containers; real records nest a few levels
_READ_BLOCK = 1 << 20
_BOM = b"\xef\xbb\xbf"
_SURROGATE = re.compile("[\ud800-\udfff]")


def _chunk_sort_key(path: Path) -> tuple:
    stem, _, index = path.name[: -len(".jsonl")].rpartition(".chunk.")
    return (stem, int(index) if index.isdigit() else -1, path.name)


def list_chunk_files(root_dir: str, source: str) -> list[Path]:
    """The training chunk files of `source` in chunk order; readable error when there are none."""
    directory = Path(root_dir) / source
    if not directory.is_dir():
        raise MissingPathError(f"Data source directory {str(directory)!r} does not exist; fix data.root_dir or the "
                               f"source name in data.sources (setup/download_prepare_hf_data.py writes this layout).")
    files = sorted(directory.glob("*.chunk.*.jsonl"), key=_chunk_sort_key)
    if not files:
        raise MissingPathError(f"Data source directory {str(directory)!r} has no '*.chunk.<i>.jsonl' files; prepare "
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


def read_line(f) -> tuple[Optional[bytes], int]:
    """(line, its size in bytes) of binary file `f`: (b"", 0) at its end; (None, size) for a line over
    MAX_LINE_BYTES, which is consumed in blocks and never held whole."""
    raw = f.readline(MAX_LINE_BYTES + 1)
    if len(raw) <= MAX_LINE_BYTES or raw.endswith(b"\n"):
        return raw, len(raw)
    size = len(raw)
    while raw and not raw.endswith(b"\n"):
        raw = f.readline(_READ_BLOCK)
        size += len(raw)
    return None, size


def _nesting_depth(value, limit: int) -> int:
    """Depth of nested lists/dicts in `value`, counted level by level (no recursion) up to limit + 1."""
    depth, level = 0, [value]
    while level and depth <= limit:
        containers = [v for v in level if isinstance(v, (dict, list))]
        depth += bool(containers)
        level = [child for c in containers for child in (c.values() if isinstance(c, dict) else c)]
    return depth


def _json_type(value) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean",
            type(None): "null"}.get(type(value), "a number")


def parse_line(raw: Optional[bytes]) -> tuple[Optional[str], Optional[str]]:
    """(document text, None), (None, why the line is skipped), or (None, None) for a blank line.

    `raw` is a line from `read_line` (None: over MAX_LINE_BYTES); the rule is in the module docstring.
    """
    if raw is None:
        return None, f"longer than {MAX_LINE_BYTES / 2**20:g} MiB"
    if raw.startswith(_BOM):
        raw = raw[len(_BOM):]
    if not raw.strip():
        return None, None
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        return None, f"not valid UTF-8 (byte 0x{raw[err.start]:02x} at offset {err.start})"
    try:
        record = json.loads(line)
    except RecursionError:  # json's own limit depends on the stack; the depth check below does not
        return None, f"nested deeper than {MAX_NESTING} levels"
    except ValueError as err:  # JSONDecodeError, or an int too long to convert
        return None, f"not valid JSON ({err})"
    # A line with few brackets cannot nest deeply: only the others are walked.
    if line.count("[") + line.count("{") > MAX_NESTING and _nesting_depth(record, MAX_NESTING) > MAX_NESTING:
        return None, f"nested deeper than {MAX_NESTING} levels"
    if not isinstance(record, dict):
        return None, f"not a JSON object but {_json_type(record)}"
    key = "text" if "text" in record else "content"
    if key not in record:
        return None, "no 'text' or 'content' field"
    text = record[key]
    if not isinstance(text, str):
        return None, f"'{key}' is {_json_type(text)}, not a string"
    surrogate = _SURROGATE.search(text)
    if surrogate:
        return None, f"'{key}' holds a lone UTF-16 surrogate ({ascii(surrogate.group())} at {surrogate.start()})"
    if not text or text.isspace():
        return None, f"'{key}' is empty" if not text else f"'{key}' is only whitespace"
    return text, None


class MalformedLines:
    """Counts skipped lines over the stream (`count`) and per open file; logs the first few in full, then
    only at 10, 100, 1000, ... so logs stay short, and a file's total when it ends."""

    def __init__(self, count: int = 0):
        self.count = count
        self.in_file: dict[str, int] = {}  # path -> skips in it so far (this rank's lines of it)

    def text_of(self, raw: Optional[bytes], path: str, line_no: int) -> Optional[str]:
        """The document text of a line from `read_line`, or None: uncounted for a blank line, else counted."""
        text, reason = parse_line(raw)
        if reason is not None:
            self._skip(path, line_no, reason)
        return text

    def file_done(self, shard: FileShard) -> None:
        """Log the file's total of skipped lines (when non-zero) and forget it: the reader reached its end."""
        n = self.in_file.pop(shard.path, 0)
        if n:
            share = f" (this rank reads 1/{shard.stride} of its lines)" if shard.stride > 1 else ""
            logger.warning(f"data file {shard.path}: skipped {n} malformed line{'s' if n > 1 else ''}{share}")

    def _skip(self, path: str, line_no: int, reason: str) -> None:
        self.count += 1
        self.in_file[path] = self.in_file.get(path, 0) + 1
        where = f"{path}:{line_no + 1}"
        if self.count <= MALFORMED_LOGGED_IN_FULL:
            suffix = "; further ones are only counted (totals at 10, 100, 1000, ... and per file)" \
                if self.count == MALFORMED_LOGGED_IN_FULL else ""
            logger.warning(f"skipping malformed data line {where}: {reason}{suffix}")
        elif math.log10(self.count).is_integer():
            logger.warning(f"{self.count} malformed data lines skipped so far (latest {where}: {reason})")
