"""The flight recorder, on every backend: torch keeps each rank's last collectives in a ring buffer (gloo and
NCCL alike, `TORCH_FR_BUFFER_SIZE` entries, 2,000 by default); this module reads it in-process and writes it
where PyTorch's analyzer reads it:

    python -m torch.distributed.flight_recorder.fr_trace <dump_dir>/comm_traces -p rank_ --allow-incomplete-ranks

Only NCCL's watchdog dumps by itself (on a timeout, with `TORCH_NCCL_DUMP_ON_TIMEOUT=1`). On gloo nothing is
written unless we ask: `write_trace` does, when the hang watch fires, on SIGUSR1, on a collective timeout and
when a collective loses its peer (`distributed.debug=trace`). The in-process buffer also tells the timeout
sentence and the hang note which collective each group was in (`last_collectives`), whatever the debug switch.

The analyzer needs each dump's `pg_config` (group id -> name, ranks); torch fills it for NCCL only, so
`write_trace` fills it from the Topology's groups, and drops entries of groups it does not know (under
TORCH_DISTRIBUTED_DEBUG=DETAIL, the wrapper's own check groups) which the analyzer would refuse. Our dumps leave
out each collective's Python stack: torch symbolizes it the first time in seconds (tens on a loaded machine), too
slow at the moment of a hang; the hang note and the rank log say where each rank is.
"""

import logging
import os
import pickle
import threading
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from lingua.parallel.private_api import private_api

logger = logging.getLogger(__name__)
TRACE_PREFIX = "rank_"  # <dump_dir>/comm_traces/rank_<r>: the analyzer's `-p rank_`, and NCCL's dump file names
_writing = threading.Lock()  # the watch thread and the main thread may dump at once: one temporary file each time


def trace_dir(dump_dir) -> Path:
    return Path(dump_dir) / "comm_traces"


def _dump_function(backend: str):
    """torch's in-process dump of the recorder that holds `backend`'s collectives, or None on a torch without it."""
    c10d = getattr(torch._C, "_distributed_c10d", None)
    if backend == "nccl" and hasattr(c10d, "_dump_nccl_trace"):  # NCCL keeps its own recorder (CUDA events)
        return c10d._dump_nccl_trace
    return private_api("dump_trace")  # checked at startup (lingua/parallel/private_api.py)


def snapshot(backend: str) -> Optional[dict]:
    """This rank's flight recorder as torch dumps it (`entries`, `pg_config`, `pg_status`, ...), or None when
    this torch has no recorder for `backend` or it is switched off (TORCH_FR_BUFFER_SIZE=0)."""
    dump = _dump_function(backend)
    if dump is None:
        return None
    try:
        raw = dump(True, False, False)  # collectives, no stacks, not only the active ones (positional on every torch)
        return pickle.loads(raw) if raw else None
    except Exception as err:  # a diagnostic must never become the failure
        logger.warning(f"reading the flight recorder failed: {type(err).__name__}: {err}")
        return None


def group_table(topo) -> dict[str, dict]:
    """torch's group id -> {name, desc, ranks} for every group of this rank, as the analyzer reads `pg_config`
    (`desc` is the name given at creation: world is torch's `default_pg`, the others are the Topology's names)."""
    table = {}
    for group in topo.all_groups():
        uid = str(group.group_name)
        table[uid] = {"name": uid, "desc": group.group_desc, "ranks": str(dist.get_process_group_ranks(group))}
    return table


def last_collectives(record: Optional[dict], topo) -> dict[str, dict]:
    """Topology group name -> the last collective this rank entered on it: {seq, op, started (s since epoch)}."""
    if not record:
        return {}
    names = {str(group.group_name): topo.group_name(group) for group in topo.all_groups()}
    last: dict[str, dict] = {}
    for entry in record.get("entries", []):
        name = names.get(str(entry["process_group"][0]))
        if name is not None:
            last[name] = dict(seq=entry["collective_seq_id"] or entry["p2p_seq_id"], op=entry["profiling_name"],
                              started=entry["time_created_ns"] / 1e9)
    return last


def write_trace(topo, dump_dir, reason: str) -> Optional[Path]:
    """Write this rank's flight recorder to `<dump_dir>/comm_traces/rank_<r>` (atomically) for the analyzer.
    Returns the path, or None when there is nothing to write (a torch without a recorder for this backend)."""
    record = snapshot(topo.backend)
    if record is None:
        logger.warning(f"no flight recorder on this torch for {topo.backend}: no comm_traces/{TRACE_PREFIX}"
                       f"{topo.global_rank} ({reason})")
        return None
    known = group_table(topo)
    # NCCL fills pg_config itself; keep its rows and add ours (gloo leaves a single empty row).
    record["pg_config"] = {**known, **{k: v for k, v in record.get("pg_config", {}).items() if k in known}}
    entries = record.get("entries", [])
    record["entries"] = [e for e in entries if str(e["process_group"][0]) in known]
    dropped = len(entries) - len(record["entries"])
    folder = trace_dir(dump_dir)
    path = folder / f"{TRACE_PREFIX}{topo.global_rank}"
    tmp = folder / f".writing.{topo.global_rank}"  # no `rank_` in the name: the analyzer reads every such file
    try:
        with _writing:
            folder.mkdir(parents=True, exist_ok=True)
            tmp.write_bytes(pickle.dumps(record))
            os.replace(tmp, path)
    except OSError as exc:  # a full disk must not hide the sentence the dump was written beside
        logger.warning(f"flight recorder not written to {path} ({reason}): {exc}")
        return None
    logger.warning(f"flight recorder written to {path} ({reason}; {len(record['entries'])} collectives"
                   + (f", {dropped} on groups of torch's own left out" if dropped else "") + ")")
    return path


def read_trace(path) -> Optional[dict]:
    """A rank's dump as `write_trace` (or NCCL's watchdog) wrote it; None if missing or unreadable."""
    try:
        with open(path, "rb") as f:
            return pickle.load(f)
    except (OSError, pickle.UnpicklingError, EOFError, ValueError):
        return None


def last_collectives_in_trace(record: Optional[dict]) -> dict[str, dict]:
    """Group name -> the last collective in a dump read back from disk (group names from its own pg_config)."""
    if not record:
        return {}
    descs = {uid: row.get("desc", uid) for uid, row in record.get("pg_config", {}).items()}
    last: dict[str, dict] = {}
    for entry in record.get("entries", []):
        uid, desc = str(entry["process_group"][0]), entry["process_group"][1]
        name = descs.get(uid, desc)
        last["world" if name == "default_pg" else name] = dict(
            seq=entry["collective_seq_id"] or entry["p2p_seq_id"], op=entry["profiling_name"],
            started=entry["time_created_ns"] / 1e9)
    return last
