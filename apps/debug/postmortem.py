"""After a run failed or hung: who failed first, each rank's last step and the collective it was stuck in.

    python -m apps.debug.postmortem <dump_dir>            # the report
    python -m apps.debug.postmortem <dump_dir> --json     # the same, as one JSON object

Reads what every rank left in the dump directory, from any host, after the fact (nothing distributed runs):
  logs/rank_<r>.status.json   state, step and heartbeat, the hang watch's note, the sentence it ended with
  logs/rank_<r>.log           the last lines
  comm_traces/rank_<r>        the flight recorder (distributed.debug=trace, or NCCL's watchdog)
  recovery.jsonl              each crash a restart recovered from: its step and the rank that stopped first

On gloo a lost peer fails the survivors within seconds and each names it itself; on NCCL a survivor blocks in its
collective until the watchdog ends the process (no Python runs, no sentence): then the status files still hold
each rank's step and hang note, and the flight recorder dumps show who is behind on which group.
"""

import argparse
import json
import socket
import sys
from collections import deque
from pathlib import Path
from typing import Optional

from lingua.cli.entry import run_cli
from lingua.errors import ConfigError, MissingPathError
from lingua.parallel.flight_recorder import TRACE_PREFIX, last_collectives_in_trace, read_trace, trace_dir
from lingua.parallel.rank_status import (
    STALE_HEARTBEAT_S,
    first_failed,
    gone_while_running,
    named_by_timeouts,
    process_state,
)
from lingua.run.dump_dir import RunDir, read_jsonl

TAIL_LINES = 3


def read_status(path: Path) -> Optional[dict]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def log_tail(path: Path, lines: int) -> list[str]:
    """The last `lines` lines of a rank's log (read in one pass, never whole into memory)."""
    try:
        with open(path, errors="replace") as f:
            return [line.rstrip("\n") for line in deque(f, maxlen=lines)]
    except OSError:
        return []


def ranks_in(run: RunDir) -> list[int]:
    """Every rank that left a status file, a log or a flight recorder dump."""
    found = set()
    for pattern, folder in (("rank_*.status.json", run.logs), ("rank_*.log", run.logs),
                            (f"{TRACE_PREFIX}*", trace_dir(run.root))):
        for path in folder.glob(pattern):
            number = path.name.removeprefix("rank_").split(".")[0]
            if number.isdigit():
                found.add(int(number))
    return sorted(found)


def stuck_in(record: Optional[dict], traced: dict[str, dict]) -> Optional[dict]:
    """The collective a rank was in when it stopped: the one its timeout named, else its last one entered (hang
    note or final record, then its flight recorder dump). {group, op} or None."""
    if record and (record.get("collective") or {}).get("group"):
        return record["collective"]
    collectives = (record or {}).get("collectives") or traced
    if not collectives:
        return None
    group, last = max(collectives.items(), key=lambda item: item[1].get("started", 0.0))
    return dict(group=group, op=f"{last['op']} #{last['seq']}")


def behind_on_groups(seqs: dict[int, dict[str, dict]]) -> dict[str, dict]:
    """Group -> {rank: last seq, behind: ranks whose last collective there is before the others'}, for every group
    at least two ranks report (from their dumps or notes)."""
    groups: dict[str, dict[int, int]] = {}
    for rank, collectives in seqs.items():
        for group, last in collectives.items():
            groups.setdefault(group, {})[rank] = last["seq"]
    report = {}
    for group, by_rank in sorted(groups.items()):
        if len(by_rank) > 1:
            top = max(by_rank.values())
            report[group] = dict(last_seq=by_rank, behind=sorted(r for r, seq in by_rank.items() if seq < top))
    return report


def first_to_fail(records: dict[int, Optional[dict]], rows: list[dict], groups: dict, host: str,
                  now: float) -> Optional[tuple[int, str]]:
    """(rank, why) of the rank that failed first, from the strongest evidence down: ranks that timed out name it;
    it recorded a failure of its own; ranks that lost it name it; it is behind the others on a group (flight
    recorder); its process is stopped or silent; its process is gone while its record says running (the
    earliest heartbeat); it ended first."""
    found = named_by_timeouts(records) or first_failed(records)
    if found is not None:
        return found
    named = [rec["peer"] for rec in records.values()
             if rec and rec["state"] == "lost_peer" and rec.get("peer") is not None]
    if named:
        rank = max(set(named), key=named.count)
        return rank, f"rank{'s' if named.count(rank) > 1 else ''} " + ", ".join(
            str(r) for r, rec in sorted(records.items()) if rec and rec.get("peer") == rank) + " lost it"
    behind = sorted({r for info in groups.values() for r in info["behind"]})
    if behind:
        return behind[0], "it is behind the others on " + ", ".join(
            g for g, info in groups.items() if behind[0] in info["behind"])
    for row in rows:
        if row["state"] == "running" and (row["process"] == "stopped" or row["silent_s"]):
            return row["rank"], ("its process is stopped" if row["process"] == "stopped"
                                 else f"no heartbeat for {row['silent_s']}s")
    gone = gone_while_running(records, host)
    if gone:
        return gone[0], "its process ended without a word (killed, or a watchdog abort), the earliest heartbeat"
    ended = sorted((rec["time"], r) for r, rec in records.items() if rec and rec["state"] not in ("running", "done"))
    return (ended[0][1], f"it ended first ({records[ended[0][1]]['state']})") if ended else None


def analyse(dump_dir) -> dict:
    """Everything the report prints, as one dict (the --json output)."""
    run = RunDir(dump_dir)
    host = socket.gethostname()
    ranks = ranks_in(run)
    records = {r: read_status(run.status(r)) for r in ranks}
    # The last moment any rank wrote: a heartbeat is stale against that, not against now (the job may be long over).
    now = max([t for rec in records.values() if rec for t in (rec.get("time"), rec.get("heartbeat")) if t] or [0.0])
    traces = {r: last_collectives_in_trace(read_trace(trace_dir(run.root) / f"{TRACE_PREFIX}{r}")) for r in ranks}
    rows = []
    for r in ranks:
        rec = records[r] or {}
        process = process_state(rec, host) if rec else None
        heartbeat = rec.get("heartbeat")
        silent = rec.get("state") == "running" and heartbeat is not None and now - heartbeat > STALE_HEARTBEAT_S
        rows.append(dict(rank=r, role=rec.get("role", "?"), state=rec.get("state", "no status file"),
                         step=rec.get("step"), stuck_in=stuck_in(rec, traces[r]),
                         process=process or "other host", silent_s=round(now - heartbeat) if silent else None,
                         sentence=rec.get("error", ""), hang_note=rec.get("stuck"),
                         last_log=log_tail(run.rank_log(r), TAIL_LINES)))
    seqs = {r: (records[r] or {}).get("collectives") or traces[r] for r in ranks}
    groups = behind_on_groups({r: c for r, c in seqs.items() if c})
    first = first_to_fail(records, rows, groups, host, now)
    first_row = next((row for row in rows if first and row["rank"] == first[0]), None)
    return dict(dump_dir=str(run.root), ranks=rows, groups=groups, crashes=read_jsonl(run.recovery),
                first=None if first is None else dict(rank=first[0], role=first_row["role"] if first_row else "?",
                                                      why=first[1]))


def format_report(report: dict) -> str:
    """The analysis as text: who failed first, a table of ranks, their sentences, per-group progress, log tails."""
    rows = report["ranks"]
    roles = [row["role"] for row in rows]
    counts = ", ".join(f"{roles.count(role)} {role}{'s' if roles.count(role) != 1 else ''}"
                       for role in ("student", "teacher") if roles.count(role))
    lines = [f"post-mortem of {report['dump_dir']}: {len(rows)} ranks ({counts})"]
    first = report["first"]
    lines.append(f"first to fail: rank {first['rank']} ({first['role']}): {first['why']}" if first else
                 "first to fail: nothing in the status files says (every rank finished, or none wrote one)")
    for i, crash in enumerate(report.get("crashes") or [], 1):  # the earlier generations of in-job restarts
        after = (f"resumed from step {crash['resumed_from']}, {crash['steps_redone']} redone, {crash['recovery_s']:.0f}s "
                 f"to the next step" if crash.get("recovery_s") is not None else crash.get("stop") or "not resumed")
        lines.append(f"crash {i} (recovered by a restart): step {crash['step']}, first rank {crash['first_rank']} "
                     f"({crash['role']}): {crash['how']}; {after}")
    lines.append("")
    lines.append(f"{'rank':>4}  {'role':<8} {'state':<14} {'step':>6}  {'stuck in':<34} process")
    for row in rows:
        where = row["stuck_in"]
        stuck = f"{where['group']} {where['op']}" if where else "-"
        process = row["process"] + (f", silent {row['silent_s']}s" if row["silent_s"] else "")
        step = "-" if row["step"] is None else str(row["step"])
        lines.append(f"{row['rank']:>4}  {row['role']:<8} {row['state']:<14} {step:>6}  {stuck:<34} {process}")
    sentences = [(row["rank"], row["sentence"]) for row in rows if row["sentence"]]
    if sentences:
        lines += ["", "what each rank said:"] + [f"  rank {rank}: {sentence}" for rank, sentence in sentences]
    notes = [(row["rank"], row["hang_note"]) for row in rows if row["hang_note"]]
    if notes:
        lines += ["", "hang notes (a step past 90% of the collective timeout):"] + [
            f"  rank {rank}: {'step ' + str(note['step']) if note.get('step') is not None else 'a wait'}, "
            f"{note['waited_s']}s of {note['timeout_s']:.0f}s, in {note['where']}" for rank, note in notes]
    if report["groups"]:
        lines += ["", "last collective per group (flight recorder):"]
        for group, info in report["groups"].items():
            seqs = ", ".join(f"rank {r} #{seq}" for r, seq in sorted(info["last_seq"].items()))
            behind = f"; behind: {', '.join(map(str, info['behind']))}" if info["behind"] else ""
            lines.append(f"  {group}: {seqs}{behind}")
    lines += ["", "last log lines:"]
    for row in rows:
        lines += [f"  rank {row['rank']}: {line}" for line in row["last_log"]] or [f"  rank {row['rank']}: (no log)"]
    return "\n".join(lines)


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one sentence through run_cli, not argparse's usage block
        raise ConfigError(f"{message}; usage: python -m apps.debug.postmortem <dump_dir> [--json]")


def main(argv: Optional[list[str]] = None) -> None:
    parser = _Parser(prog="python -m apps.debug.postmortem", description=__doc__.splitlines()[0])
    parser.add_argument("dump_dir")
    parser.add_argument("--json", action="store_true", help="print the analysis as one JSON object")
    args = parser.parse_args(argv)
    run = RunDir(args.dump_dir)
    if not run.root.is_dir():
        raise MissingPathError(f"dump_dir {args.dump_dir!r} is not a folder; pass the dump_dir of a run")
    if not ranks_in(run):
        raise MissingPathError(f"{run.logs} holds no rank_<r>.status.json or rank_<r>.log: not the dump_dir of a "
                                f"run that started")
    report = analyse(run.root)
    sys.stdout.write((json.dumps(report) if args.json else format_report(report)) + "\n")


if __name__ == "__main__":
    run_cli(main)
