"""apps.bench.loss_step: argument checks and the results file, on tiny sizes measured in this process."""

import json

import pytest
import torch

from apps.bench import loss_step as bench

TINY = ["--vocab", "64", "--tokens", "12", "--dim", "8", "--k", "4", "--repeats", "1", "--warmup", "0"]


@pytest.fixture
def keep_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.mark.timeout(20)
@pytest.mark.parametrize("flags,message", [
    (["--vocab", "0"], "--vocab"),
    (["--repeats", "0"], "--repeats"),
    (["--format", "dense"], "--format"),
    (["--divergence", "kl"], "--divergence"),
    (["--format", "sampled", "--divergence", "jsd"], "sampled"),
    (["--k", "65"], "--k"),
    (["--dtype", "float16"], "--dtype"),
    (["--alpha", "2"], "--alpha"),
    (["--chunk-size", "-1"], "--chunk-size"),
])
def test_argument_errors(flags, message, tmp_path):
    with pytest.raises(ValueError, match=message):
        bench.parse_args(TINY + flags + ["--out", str(tmp_path)])


@pytest.mark.timeout(20)
def test_out_is_required_except_for_a_worker():
    with pytest.raises(ValueError, match="--out"):
        bench.parse_args(TINY)
    args, worker = bench.parse_args(TINY + ["--worker", "fused_kd", "--phase", "memory"])
    assert worker == ("fused_kd", "memory") and args.vocab == 64 and args.temperature == 1.0 and args.out is None


@pytest.mark.bench  # the loss-step bench run end to end: the bench tier
@pytest.mark.timeout(60)
@pytest.mark.parametrize("format", ["topk", "sampled", "full"])
def test_results_file_and_table(format, tmp_path, keep_threads, capsys):
    calls = []

    def in_process(variant, args):
        calls.append(variant)
        return {**bench.measure(variant, args, "time"), **bench.measure(variant, args, "memory")}

    argv = TINY + ["--format", format, "--rounds", "2", "--ignored", "0.25", "--out", str(tmp_path)]
    results = bench.main(argv, run_variant=in_process)
    assert calls == list(bench.VARIANTS) * 2  # rounds interleave the variants
    saved = json.loads((tmp_path / "results.json").read_text())
    for key in ("ce_ms", "kd_ms", "ce_peak_mib", "kd_peak_mib", "logits_ce_ms", "logits_ce_over_ce_peak",
                "reference_kd_ms", "reference_kd_peak_mib",
                "kd_over_ce_ms", "kd_over_ce_peak", "reference_kd_over_ce_ms", "settings", "torch", "device",
                "threads", "fused_chunk_rows"):
        assert key in saved, key
    assert saved["settings"]["format"] == format and saved["threads"] == 1 and saved["torch"] == torch.__version__
    assert all(saved[f"{name}_ms"] > 0 for name in ("ce", "logits_ce", "kd", "reference_kd"))
    assert saved["kd_over_ce_ms"] == pytest.approx(saved["kd_ms"] / saved["ce_ms"])
    assert saved["kd_over_ce_peak"] is None or saved["kd_over_ce_peak"] >= 0
    assert len(saved["rounds"]["fused_kd"]) == 2 and saved["kd_ms_range"][0] <= saved["kd_ms"] <= saved["kd_ms_range"][1]
    assert results["ce_ms"] == saved["ce_ms"]
    table = capsys.readouterr().out
    assert "| fused KD |" in table and "| CE only (fused) |" in table and "| CE only on logits |" in table


@pytest.mark.timeout(20)
def test_inputs_follow_the_settings():
    args, _ = bench.parse_args(TINY + ["--ignored", "0.5", "--worker", "ce"])
    hidden, weight, labels, teacher = bench.make_inputs(args)
    assert hidden.shape == (12, 8) and weight.shape == (64, 8) and hidden.requires_grad and weight.requires_grad
    assert teacher.values.shape == (1, 12, 4) and 0 < int((labels == -100).sum()) < 12
    again = bench.make_inputs(args)
    assert torch.equal(again[0], hidden) and torch.equal(again[3].ids, teacher.ids)  # seeded


@pytest.mark.timeout(20)
def test_against_table_ratios_and_missing_liger():
    from apps.bench import loss_against

    args, _ = bench.parse_args(TINY + ["--against", "liger", "--out", "unused"])
    measured = {name: {"ms": ms, "peak_mib": peak, "all_ms": [ms]}
                for name, ms, peak in (("ce", 10.0, 100.0), ("kd_topk_t1", 10.5, 100.0), ("liger_ce", 8.0, 50.0),
                                       ("logits_ce", 9.0, 400.0))}
    liger = {"liger_ce": object(), "liger_jsd": "needs CUDA (Triton kernel)"}
    results = loss_against.summarize(args, measured, liger, "0.8.5")
    rows = results["variants"]
    assert list(rows) == list(loss_against.VARIANTS)
    assert rows["kd_topk_t1"]["ms_over_ce"] == pytest.approx(1.05) and rows["kd_topk_t1"]["peak_over_liger_ce"] == 2.0
    assert rows["liger_ce"]["ms_over_liger_ce"] == 1.0 and rows["ce"]["ms_over_liger_ce"] == 1.25
    assert rows["liger_jsd"] == {"status": "needs CUDA (Triton kernel)"}
    assert rows["kd_rkl"] == {"status": "not installed"}  # a variant not measured at all says so too
    table = loss_against.format_markdown(results)
    assert "| kd_topk_t1 | 10.5 | 100 | 1.05 | 1.00 | 1.31 | 2.00 |" in table
    assert "| liger_jsd | needs CUDA (Triton kernel) |" in table and "Liger 0.8.5" in table
    without = loss_against.summarize(args, {k: v for k, v in measured.items() if k != "liger_ce"},
                                     {name: loss_against.NOT_INSTALLED for name in loss_against.LIGER}, None)
    assert without["liger"] == "not installed" and without["variants"]["ce"]["ms_over_liger_ce"] is None
    assert "| liger_ce | not installed |" in loss_against.format_markdown(without)
    with pytest.raises(ValueError, match="--against"):
        bench.parse_args(TINY + ["--against", "unsloth", "--out", "unused"])


@pytest.mark.bench  # the loss-step bench run end to end: the bench tier
@pytest.mark.timeout(60)
def test_against_runs_every_variant_in_this_process(tmp_path, keep_threads, capsys):
    from apps.bench import loss_against

    args, _ = bench.parse_args(TINY + ["--against", "liger", "--rounds", "2", "--repeats", "2", "--out", str(tmp_path)])
    results = loss_against.run_against(args, liger={name: loss_against.NOT_INSTALLED for name in loss_against.LIGER})
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved == json.loads(json.dumps(results))
    ours = [name for name in loss_against.VARIANTS if name not in loss_against.LIGER]
    assert all(saved["variants"][name]["status"] == "ok" and len(saved["variants"][name]["all_ms"]) == 4
               for name in ours)
    assert saved["variants"]["ce"]["ms_over_ce"] == 1.0 and saved["variants"]["liger_jsd"]["status"] == "not installed"
    assert (tmp_path / "table.md").read_text().strip() == capsys.readouterr().out.strip()


@pytest.mark.bench  # the loss-step bench run end to end: the bench tier
@pytest.mark.timeout(120)
def test_compiled_variants_run_beside_their_eager_twins(tmp_path, keep_threads, capsys, monkeypatch):
    """--compiled adds `<name>_compiled` rows (compiled once before the measurements, compile_s recorded), timed in the
    same rounds as the eager ones; traced through aot_eager here (inductor's own code: test_fused_loss_compiled)."""
    from apps.bench import loss_against
    from lingua.distillation.loss import compiled_chunk

    monkeypatch.setattr(compiled_chunk, "BACKEND", "aot_eager")
    monkeypatch.setattr(compiled_chunk, "_compiled", {})
    args, _ = bench.parse_args(TINY + ["--against", "liger", "--compiled", "ce,kd_topk_t2", "--rounds", "2",
                                       "--out", str(tmp_path)])
    results = loss_against.run_against(args, liger={name: loss_against.NOT_INSTALLED for name in loss_against.LIGER})
    rows = results["variants"]
    for name in ("ce_compiled", "kd_topk_t2_compiled"):
        assert rows[name]["status"] == "ok" and len(rows[name]["all_ms"]) == 2 and rows[name]["compile_s"] > 0
        assert f"| {name} | " in (tmp_path / "table.md").read_text()
    assert "kd_topk_t1_compiled" not in rows and "compile_s" not in rows["ce"]
    assert list(rows)[-2:] == list(loss_against.LIGER)
    for flags, message in ((["--compiled", "ce"], "--against"),
                           (["--against", "liger", "--compiled", "ce,kd_t3"], "kd_t3")):
        with pytest.raises(ValueError, match=message):
            bench.parse_args(TINY + flags + ["--out", str(tmp_path)])


@pytest.mark.bench  # the loss-step bench run end to end: the bench tier
def test_a_variant_that_raises_costs_its_row_only(tmp_path, keep_threads, capsys):
    """A variant that fails (out of memory, a compile error) is its row's reason; the others are measured as usual."""
    from apps.bench import loss_against

    class Broken:
        def __call__(self, *inputs):
            raise RuntimeError("CUDA out of memory. Tried to allocate 9.00 GiB")

    args, _ = bench.parse_args(TINY + ["--against", "liger", "--rounds", "1", "--repeats", "2", "--out", str(tmp_path)])
    results = loss_against.run_against(args, liger={"liger_ce": Broken(), "liger_jsd": loss_against.NOT_INSTALLED})
    rows = results["variants"]
    assert rows["liger_ce"]["status"] == "failed: RuntimeError: CUDA out of memory. Tried to allocate 9.00 GiB"
    assert rows["ce"]["status"] == "ok" and rows["ce"]["ms_over_liger_ce"] is None and len(rows["ce"]["all_ms"]) == 2
    assert "| liger_ce | failed: RuntimeError" in (tmp_path / "table.md").read_text()
