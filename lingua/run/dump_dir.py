"""A run's dump directory: where each output lives, and tolerant readers for its jsonl files.

    <dump_dir>/owner.json             the live run that holds the dump dir (lingua/run/owner.py)
    <dump_dir>/config.yaml            the resolved config actually used
    <dump_dir>/metrics.jsonl          one JSON line per log step (train rank 0), eval rows too
    <dump_dir>/checkpoints/<step>/    DCP shards + train_state_<rank>.json + params.json
    <dump_dir>/logs/rank_<r>.log      every rank's log
    <dump_dir>/logs/rank_<r>.status.json  running / failed / lost_peer / done, with host and pid
    <dump_dir>/startup.<r>.jsonl      per-rank startup phase timings
    <dump_dir>/probe/probe.<r>.jsonl  activation/gradient stats at probe_freq

The readers skip lines that are not JSON (a run killed mid-write leaves a torn last line), so the
trainer's summary, the benchmark, the plots and the tests read a run the same way.
"""

import json
import logging
from pathlib import Path
from typing import Optional

logger = logging.getLogger(__name__)


class RunDir:
    """Paths inside one dump directory."""

    def __init__(self, dump_dir):
        self.root = Path(dump_dir)

    @property
    def config(self) -> Path:
        return self.root / "config.yaml"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    def rank_log(self, rank: int) -> Path:
        return self.logs / f"rank_{rank}.log"

    def status(self, rank: int) -> Path:
        """How the rank is doing: running, failed, lost_peer or done (`lingua.distributed.RankStatus`)."""
        return self.logs / f"rank_{rank}.status.json"

    def previous_status(self, rank: int) -> Path:
        """The status the rank's previous process left (a restart reads how it ended: lingua/parallel/recovery.py)."""
        return self.logs / f"rank_{rank}.status.previous.json"

    @property
    def recovery(self) -> Path:
        """One row per crash this run recovered from (lingua/parallel/recovery.py)."""
        return self.root / "recovery.jsonl"

    def startup(self, rank: int) -> Path:
        return self.root / f"startup.{rank}.jsonl"

    def startup_files(self) -> list[Path]:
        return sorted(self.root.glob("startup.*.jsonl"))

    @property
    def probe(self) -> Path:
        return self.root / "probe"


def read_jsonl(path) -> list[dict]:
    """The JSON objects of a jsonl file, in order; blank lines and lines that are not JSON objects (a
    torn last line from a crash) are skipped with a warning. A missing file reads as no rows."""
    path = Path(path)
    if not path.is_file():
        return []
    rows, bad = [], 0
    for line in path.read_text(errors="replace").splitlines():
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            bad += 1
            continue
        if isinstance(row, dict):
            rows.append(row)
        else:
            bad += 1
    if bad:
        logger.warning(f"{path}: skipped {bad} line(s) that are not JSON objects")
    return rows


def read_metrics(dump_dir) -> list[dict]:
    """Every row of `<dump_dir>/metrics.jsonl` (training and eval rows), in file order."""
    return read_jsonl(RunDir(dump_dir).metrics)


def train_rows(dump_dir) -> dict[int, dict]:
    """step -> the training row of that step (eval rows excluded); a resumed run's row replaces an older one."""
    return {row["step"]: row for row in read_metrics(dump_dir) if "loss/ce" in row and "step" in row}


def eval_rows(dump_dir) -> dict[int, dict]:
    """step -> the in-loop eval row of that step."""
    return {row["step"]: row for row in read_metrics(dump_dir) if "eval/loss" in row and "step" in row}


def last_train_row(dump_dir) -> dict:
    rows = train_rows(dump_dir)
    return rows[max(rows)] if rows else {}


def read_startup(dump_dir, world_size: Optional[int] = None) -> list[dict]:
    """Every rank's startup phase records. With `world_size`, only ranks 0..world_size-1: each of those
    files was rewritten by this launch, while a higher rank's file is left over from a larger launch."""
    records = [row for path in RunDir(dump_dir).startup_files() for row in read_jsonl(path)]
    return [r for r in records if world_size is None or r.get("rank", 0) < world_size]
