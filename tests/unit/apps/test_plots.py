"""apps.plots: PNG from two runs (one without KD keys), readable errors, and the CPU profiler trace."""

import gzip
import json

import pytest
import torch
from torch import nn

from apps import plots
from lingua.profiling import ProfilerArgs, maybe_run_profiler

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def write_run(dump_dir, with_kd: bool):
    dump_dir.mkdir(parents=True)
    lines = []
    for step in range(1, 21):
        row = {"step": step, "tokens": 512 * step, "loss/total": 5.0 / step, "loss/ce": 4.0 / step,
               "speed/tokens_per_s": 1000.0 + step, "time": 1700000000.0 + step}
        if with_kd:
            row.update({"loss/kd": 1.0 / step, "kd/top1_agreement": step / 20, "kd/teacher_mass": 0.9})
        lines.append(json.dumps(row))
        if step % 10 == 0:
            bpb = {"eval/bpb": 4.3 / step} if with_kd else {}  # one run from before eval/bpb
            lines.append(json.dumps({"step": step, "eval/loss": 3.0 / step, "eval/ppl": 2.0, **bpb}))
    (dump_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")


@pytest.mark.timeout(60)
def test_plot_two_runs_one_without_kd(tmp_path):
    write_run(tmp_path / "kd_on", with_kd=True)
    write_run(tmp_path / "kd_off", with_kd=False)
    out = plots.main([str(tmp_path / "kd_on"), str(tmp_path / "kd_off" / "metrics.jsonl"),
                      "--labels", "KD on", "KD off"])
    assert out == tmp_path / "kd_on" / "plot.png"
    data = out.read_bytes()
    assert data.startswith(PNG_SIGNATURE) and len(data) > 1024


def test_plot_only_panels_with_data():
    rows = [{"step": 1, "loss/ce": 2.0}, {"step": 2, "loss/ce": 1.5}]
    older = rows + [{"step": 2, "eval/loss": 3.0}]  # a run logged before eval/bpb existed
    newer = rows + [{"step": 2, "eval/loss": 3.0, "eval/bpb": 4.0}]
    assert [panel[0] for panel in plots.panels_with_data([("old", older)])] == ["Training loss", "Eval loss"]
    assert plots.panels_with_data([("old", older), ("new", newer)])[-1][2] == [("eval/bpb", "-")]
    assert plots.series(rows, "loss/kd", "step") == ([], [])
    assert plots.series(rows + [{"step": 2, "loss/ce": 1.4}], "loss/ce", "step") == ([1, 2], [2.0, 1.4])


def test_plot_errors_are_readable(tmp_path, capsys):
    with pytest.raises(SystemExit):
        plots.main([str(tmp_path / "missing")])
    assert "metrics.jsonl" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "metrics.jsonl").write_text("")
    with pytest.raises(SystemExit):
        plots.main([str(tmp_path / "empty")])
    assert "holds no metrics" in capsys.readouterr().err


@pytest.mark.timeout(60)
def test_profiler_writes_cpu_trace(tmp_path):
    model = nn.Sequential(nn.Linear(8, 8), nn.ModuleList([nn.Linear(8, 8)]))
    args = ProfilerArgs(run=True, mem_warmup=0, mem_steps=1, profile_warmup=1, profile_steps=2)
    x = torch.randn(4, 8)
    with maybe_run_profiler(str(tmp_path), model, args, rank=0, is_master=True, group=None) as profiler:
        for _ in range(4):
            model[1][0](model[0](x)).sum().backward()
            profiler.step()
    traces = list((tmp_path / "profiling" / "profile_0").glob("trace_step*.json.gz"))
    assert len(traces) == 1
    trace = json.loads(gzip.decompress(traces[0].read_bytes()))
    names = {event.get("name") for event in trace["traceEvents"]}
    assert "aten::addmm" in names or "aten::linear" in names
    assert "block 1.0" in names  # the ModuleList child is labelled in the trace


def test_profiler_disabled_yields_none(tmp_path):
    with maybe_run_profiler(str(tmp_path), nn.Linear(2, 2), ProfilerArgs(), 0, True, None) as profiler:
        assert profiler is None
    assert not (tmp_path / "profiling").exists()
