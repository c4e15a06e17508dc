"""apps.bench.scale_build without its launches: the shapes' arithmetic, the memory gate, the table."""

import pytest

from apps.bench import scale_build as bench


@pytest.mark.timeout(60)
def test_the_shapes_are_the_issues_sizes():
    wide = bench.arithmetic("wide", students=2)
    assert wide["n_params"] == 808_503_296 and wide["full_gib"] == pytest.approx(3.01, abs=0.01)
    assert wide["shard_gib"] == pytest.approx(wide["full_gib"] / 2)
    assert wide["largest_param_gib"] == 49152 * 2048 * 4 / 2**30  # the embedding (and the head): 0.375 GiB
    eight = bench.arithmetic("8B", students=2)
    assert eight["n_params"] == 8_030_261_248  # Llama 3 8B's count
    assert bench.arithmetic("llama_1B", students=2)["n_params"] == pytest.approx(1.79e9, rel=0.01)


@pytest.mark.timeout(60)
def test_a_shape_beyond_the_free_memory_or_on_meta_only_is_skipped_with_the_reason(tmp_path, monkeypatch):
    monkeypatch.setattr(bench, "mem_available_gib", lambda: 4.0)
    monkeypatch.setattr(bench.subprocess, "run", lambda *a, **k: pytest.fail("nothing may launch"))
    wide = bench.run_shape("wide", 2, tmp_path, build_only=False, force=False)
    # 16N/S = 4 x (4N/S) per rank with the step: fp32 weights, gradients and AdamW's two moments
    assert wide["estimate_gib"] > 2 * 4 * wide["shard_gib"]  # both ranks
    assert wide["skipped"].startswith(f"needs about {wide['estimate_gib']:.1f} GiB, 4.0 GiB available")
    build_only = bench.run_shape("wide", 2, tmp_path, build_only=True, force=False)
    assert build_only["estimate_gib"] < wide["estimate_gib"]
    assert bench.run_shape("8B", 2, tmp_path, build_only=False, force=True)["skipped"].startswith("meta device only")
    rows = bench.table([wide]).splitlines()
    assert len(rows) == 3 and "needs about" in rows[2]


@pytest.mark.timeout(60)
def test_the_table_gives_each_ranks_peaks_against_its_shard():
    result = dict(bench.arithmetic("wide", 2), ranks=[
        dict(rank=r, base_gib=0.3, build_peak_gib=2.0, build_s=10.0, step_peak_gib=7.0) for r in (0, 1)])
    rows = bench.table([result]).splitlines()[2:]
    assert len(rows) == 2
    cells = [cell.strip() for cell in rows[1].split("|")]
    assert cells[7:9] == ["1", "0.30"]
    assert cells[9] == f"2.00 ({2.0 / result['shard_gib']:.2f}x)" and cells[11].startswith("7.00 (")
