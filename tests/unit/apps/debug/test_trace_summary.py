"""apps.debug.trace_summary: GPU busy share, kernels, host ops, syncs and idle gaps, from a trace's events."""

import gzip
import json

import torch

from apps.debug.trace_summary import idle_gaps, load_events, main, summarize, union_ms


def event(name, ts, dur, cat, tid=1):
    return {"ph": "X", "name": name, "ts": ts, "dur": dur, "cat": cat, "tid": tid, "pid": 1}


def test_overlapping_kernels_count_once_and_gaps_are_what_no_kernel_covers():
    kernels = [(0, 10), (5, 20), (30, 40), (100, 130)]
    assert union_ms(kernels, 0, 100) == 0.030  # 0-20 and 30-40, clipped at 100
    assert idle_gaps(kernels, 0, 120) == [(40, 100), (20, 30)]


def test_a_gpu_trace_reports_busy_share_top_kernels_syncs_and_the_host_op_in_each_gap(tmp_path):
    events = [event("ProfilerStep#7", 0, 10_000, "user_annotation"),
              event("Optimizer.step#AdamW.step", 6_000, 3_000, "cpu_op"),
              event("aten::add_", 6_100, 50, "cpu_op"),  # inside the optimizer step: not outermost
              event("aten::mm", 100, 1_000, "cpu_op"),
              event("cudaStreamSynchronize", 2_000, 500, "cuda_runtime"),
              event("gemm_kernel", 200, 4_000, "kernel", tid=7), event("gemm_kernel", 1_000, 1_000, "kernel", tid=8),
              event("Memcpy DtoH", 4_200, 300, "gpu_memcpy", tid=7)]
    path = tmp_path / "trace.json.gz"
    with gzip.open(path, "wt") as handle:
        json.dump({"traceEvents": events + [{"ph": "M", "name": "process_name"}]}, handle)
    text = summarize(load_events(path))
    assert "ProfilerStep#7: 10.0 ms, GPU busy 4.3 ms (43%)" in text
    assert "   5.00  94.3%      2  gemm_kernel" in text  # 4 + 1 ms of a summed 5.3
    assert "   3.00  30.0%      1  Optimizer.step#AdamW.step" in text and "aten::add_" not in text
    assert "0.50 ms      1 calls  cudaStreamSynchronize" in text
    assert "5.50 ms at +4.5 ms: Optimizer.step#AdamW.step" in text  # the longest gap: 4.5 to 10 ms


def test_a_cpu_profiler_trace_is_summarised_and_a_wrong_path_is_a_sentence(tmp_path, capsys):
    model = torch.nn.Linear(32, 32)
    path = tmp_path / "cpu.json.gz"
    schedule = torch.profiler.schedule(wait=0, warmup=1, active=2)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], schedule=schedule,
                                on_trace_ready=lambda prof: prof.export_chrome_trace(str(path))) as prof:
        for _ in range(3):
            model(torch.randn(4, 32)).sum().backward()
            prof.step()
    assert main([str(path), "--top", "5"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("2 traced step(s)") and "aten::linear" in out and "GPU" not in out
    assert main([str(tmp_path / "missing.json.gz")]) == 2
    assert "is not a file" in capsys.readouterr().err
