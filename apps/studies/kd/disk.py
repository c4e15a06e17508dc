"""What a study directory holds: finished runs, their cloze evals and wall times, the teacher caches."""

import json
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Optional

from apps.studies.kd.arms import CLOZE_TASK
from lingua.distillation.cache.store import INDEX, CacheManifest
from lingua.run.dump_dir import eval_rows


def cache_is_complete(cache_dir: Path) -> bool:
    return (cache_dir / INDEX).exists()


def cache_dir_of(root: Path, cache: str) -> Path:
    return root / f"cache_{cache}"


def build_record_path(cache_dir: Path) -> Path:
    return cache_dir.with_name(cache_dir.name + ".build.json")

def cache_bytes_per_token(output: str, k: int, wire_dtype: str, vocab_size: Optional[int] = None,
                          version: int = 1, seq_len: int = 128) -> dict:
    """What the teacher sends per token on the bridge (k * (w + 4) + 4 for topk and sampled, int32 ids) and what a
    cache shard stores: version 1 its tensors as they are (ids in uint16 when the vocab fits, plus the token and
    doc id), version 2 the coded size as measured on the study's data (`cache_codec.planned_bytes_per_token`)."""
    import torch

    from lingua.distillation.args import WIRE_DTYPES
    from lingua.distillation.cache.codec import planned_bytes_per_token

    w = WIRE_DTYPES[wire_dtype].itemsize
    ids = 2 if vocab_size is not None and vocab_size <= 2**16 else 4
    bridge = k * (w + 4) + 4
    if version == 1:
        return {"bridge": bridge, "cache_shard": k * (w + ids) + 4 + torch.int32.itemsize + torch.int16.itemsize}
    return {"bridge": bridge, "cache_shard": round(planned_bytes_per_token(output, k, vocab_size or 2**17, w, seq_len,
                                                                           wire_dtype=wire_dtype), 1)}


def teacher_heldout_ce(cache_dir: Path) -> Optional[float]:
    return CacheManifest.read(cache_dir).teacher_heldout_ce

def run_finished(dump_dir: Path, steps: int) -> bool:
    return steps in eval_rows(dump_dir) if (dump_dir / "metrics.jsonl").exists() else False


def final_step_dir(dump_dir: Path) -> Optional[Path]:
    """The newest finished checkpoint step directory of a run, or None."""
    root = Path(dump_dir) / "checkpoints"
    steps = sorted(p for p in root.glob("[0-9]" * 10) if (p / "params.json").is_file()) if root.is_dir() else []
    return steps[-1] if steps else None


def cloze_json(dump_dir: Path, steps: int) -> Optional[Path]:
    """The eval.json of the run's final checkpoint (step `steps`), if that checkpoint is on disk."""
    step_dir = final_step_dir(dump_dir)
    if step_dir is None or int(step_dir.name) != steps:
        return None
    return step_dir / "eval.json"


def cloze_done(dump_dir: Path, steps: int) -> bool:
    path = cloze_json(dump_dir, steps)
    return path is not None and path.is_file()


def now_iso(unix: Optional[float] = None) -> str:
    return datetime.fromtimestamp(unix if unix is not None else time.time(), timezone.utc).isoformat(timespec="seconds")

def read_cloze(dump_dir: Path, steps: int) -> Optional[dict]:
    """{acc, acc_norm, n} of the final checkpoint's pydocs_cloze, or None when it was not scored."""
    path = cloze_json(dump_dir, steps)
    if path is None or not path.is_file():
        return None
    task = json.loads(path.read_text()).get("tasks", {}).get(CLOZE_TASK)
    if task is None:
        return None
    return {"acc": task["acc"], "acc_norm": task.get("acc_norm"), "n": task.get("n_samples")}


def read_wall_s(dump_dir: Path) -> Optional[float]:
    path = Path(dump_dir) / "study_run.json"
    return json.loads(path.read_text())["wall_s"] if path.is_file() else None
