"""Where a profiled training step's time goes, from the trace `profiling.run=true` writes.

    python -m apps.debug.trace_summary DUMP_DIR/profiling/profile_0/trace_step<N>.json.gz [--top 15]

Prints, for the traced steps (torch.profiler's `ProfilerStep#N` ranges):
- each step's wall time, and on a GPU the share of it the GPU was busy (kernels, copies and memsets, overlaps
  counted once);
- the GPU kernels that took the most time;
- the host's top-level work on the training thread (the outermost ops and labelled ranges inside a step), which
  says what the host did while the GPU waited;
- the host's waits for the GPU (stream, event and device synchronisations, and blocking copies);
- the longest GPU idle gaps, each with the host work that was running at its middle.
"""

import argparse
import gzip
import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import Optional

GPU_CATEGORIES = {"kernel", "gpu_memcpy", "gpu_memset"}
HOST_CATEGORIES = {"cpu_op", "user_annotation", "python_function"}
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")


def load_events(path: Path) -> list[dict]:
    """The complete ('X') events of a Chrome trace written by torch.profiler (.json or .json.gz)."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as handle:
        trace = json.load(handle)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    return [e for e in events if e.get("ph") == "X" and "dur" in e]


def union_ms(intervals: list[tuple[float, float]], start: float, end: float) -> float:
    """Milliseconds of [start, end] covered by at least one of the intervals (µs), overlaps counted once."""
    covered, reach = 0.0, start
    for begin, finish in sorted(intervals):
        begin, finish = max(begin, reach), min(finish, end)
        if finish > begin:
            covered += finish - begin
            reach = finish
    return covered / 1e3


def idle_gaps(intervals: list[tuple[float, float]], start: float, end: float) -> list[tuple[float, float]]:
    """The stretches of [start, end] no interval covers, longest first."""
    gaps, reach = [], start
    for begin, finish in sorted(intervals):
        if begin > reach:
            gaps.append((reach, min(begin, end)))
        reach = max(reach, finish)
        if reach >= end:
            break
    if reach < end:
        gaps.append((reach, end))
    return sorted((g for g in gaps if g[1] > g[0]), key=lambda g: g[0] - g[1])


def outermost(events: list[dict]) -> list[dict]:
    """Of one thread's nested events, those no other event of the list contains."""
    tops, reach = [], float("-inf")
    for event in sorted(events, key=lambda e: (e["ts"], -e["dur"])):
        if event["ts"] >= reach:
            tops.append(event)
            reach = event["ts"] + event["dur"]
    return tops


def summarize(events: list[dict], top: int = 15) -> str:
    """The report (see the module's docstring) as text."""
    steps = sorted((e for e in events if e["name"].startswith("ProfilerStep#") and e.get("cat") == "user_annotation"),
                   key=lambda e: e["ts"])  # the host's ranges (a GPU trace repeats each as gpu_user_annotation)
    if not steps:
        return "no ProfilerStep# ranges in this trace: was it written by profiling.run=true (torch.profiler)?"
    start, end = steps[0]["ts"], steps[-1]["ts"] + steps[-1]["dur"]
    thread = steps[0]["tid"]
    gpu = [e for e in events if e.get("cat") in GPU_CATEGORIES]
    gpu_intervals = [(e["ts"], e["ts"] + e["dur"]) for e in gpu]
    lines = [f"{len(steps)} traced step(s), {(end - start) / 1e3:.1f} ms in all"]
    for step in steps:
        wall = step["dur"] / 1e3
        busy = union_ms(gpu_intervals, step["ts"], step["ts"] + step["dur"]) if gpu else None
        lines.append(f"  {step['name']}: {wall:.1f} ms" + (f", GPU busy {busy:.1f} ms ({busy / wall:.0%})"
                                                           if busy is not None else ""))
    span_ms = (end - start) / 1e3
    if gpu:
        by_kernel = defaultdict(lambda: [0, 0.0])
        for event in gpu:
            if start <= event["ts"] < end:
                by_kernel[event["name"]][0] += 1
                by_kernel[event["name"]][1] += event["dur"] / 1e3
        busy_ms = sum(ms for _, ms in by_kernel.values())
        lines += ["", f"GPU: the top {top} of {len(by_kernel)} kernels/copies by time (summed: {busy_ms:.1f} ms "
                      f"of {span_ms:.1f})", "  ms      share  calls  name"]
        for name, (calls, ms) in sorted(by_kernel.items(), key=lambda item: -item[1][1])[:top]:
            lines.append(f"  {ms:7.2f} {ms / max(busy_ms, 1e-9):6.1%} {calls:6d}  {name[:110]}")
    host = [e for e in events if e.get("tid") == thread and e.get("cat") in HOST_CATEGORIES
            and not e["name"].startswith("ProfilerStep#") and start <= e["ts"] < end]
    tops = outermost(host)
    by_op = defaultdict(lambda: [0, 0.0])
    for event in tops:
        by_op[event["name"]][0] += 1
        by_op[event["name"]][1] += event["dur"] / 1e3
    lines += ["", f"Host, training thread: its top {top} outermost ops and ranges by time (of {span_ms:.1f} ms)",
              "  ms      share  calls  name"]
    for name, (calls, ms) in sorted(by_op.items(), key=lambda item: -item[1][1])[:top]:
        lines.append(f"  {ms:7.2f} {ms / span_ms:6.1%} {calls:6d}  {name[:110]}")
    syncs = defaultdict(lambda: [0, 0.0])
    for event in events:
        if event.get("cat") == "cuda_runtime" and event["name"].startswith(SYNC_CALLS) and start <= event["ts"] < end:
            syncs[event["name"]][0] += 1
            syncs[event["name"]][1] += event["dur"] / 1e3
    if syncs:
        lines += ["", "Host waits for the GPU (synchronisations and blocking copies)"]
        lines += [f"  {ms:7.2f} ms {calls:6d} calls  {name}" for name, (calls, ms) in
                  sorted(syncs.items(), key=lambda item: -item[1][1])]
    if gpu:
        lines += ["", "The longest GPU idle gaps, with the host work at their middle"]
        for begin, finish in idle_gaps(gpu_intervals, start, end)[:8]:
            middle = (begin + finish) / 2
            running = [e["name"] for e in tops if e["ts"] <= middle < e["ts"] + e["dur"]]
            lines.append(f"  {(finish - begin) / 1e3:7.2f} ms at +{(begin - start) / 1e3:.1f} ms: "
                         f"{running[0][:100] if running else '(the host is between ops)'}")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m apps.debug.trace_summary", description=__doc__.split("\n")[0])
    parser.add_argument("trace", type=Path, help="a trace_step<N>.json.gz written by profiling.run=true")
    parser.add_argument("--top", type=int, default=15, help="rows per table (default 15)")
    args = parser.parse_args(argv)
    if not args.trace.is_file():
        print(f"error: {args.trace} is not a file: give the trace_step<N>.json.gz under "
              f"DUMP_DIR/<profiling.trace_folder>/profile_<rank>/.", file=sys.stderr)
        return 2
    print(summarize(load_events(args.trace), args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
