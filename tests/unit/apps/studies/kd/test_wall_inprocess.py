"""The data-wall study in one process (`--wall --device`): its tiny CPU version end to end (the GPU study's
command at a size the suite affords), and its options' one-sentence errors."""

import json
import math
import shutil

import pytest
import torch

from apps.studies.kd import study
from lingua.errors import ConfigError
from setup.repo_docs_corpus import prepare_repo_docs


def test_device_and_tiny_name_the_option_they_need():
    with pytest.raises(ConfigError, match="add --wall"):
        study.main(["--device", "cpu"])
    with pytest.raises(ConfigError, match="add --device cpu"):
        study.main(["--wall", "--tiny"])
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="torch sees no GPU here"):
            study.main(["--wall", "--device", "cuda", "--out", "unused"])


@pytest.mark.bench  # a study end to end: the bench tier
@pytest.mark.timeout(300)
def test_the_tiny_in_process_wall_study_reports_every_arm_seed_and_epoch(corpus, tiny_teacher, tmp_path):
    """`--wall --device cpu --tiny`: the cache written and every run trained in this process (no launch), both
    held-out splits with the teacher's CE beside them; a rerun trains nothing and reports the same numbers."""
    check_tiny_study(corpus, tiny_teacher, tmp_path, "cpu")


def check_tiny_study(corpus, tiny_teacher, tmp_path, device: str) -> None:
    """The tiny study on `device` (tests/gpu/test_gpu_wall.py runs it on CUDA, under bf16 autocast)."""
    data_root = tmp_path / "corpus"
    (data_root / "pydocs").mkdir(parents=True)  # the test corpus under the config's source name
    for path in (corpus / "text").glob("text.*.jsonl"):
        shutil.copy(path, data_root / "pydocs" / path.name.replace("text.", "pydocs.", 1))
    prepare_repo_docs(data_root)  # the post-cutoff split beside the corpus's own
    out = tmp_path / "wall"
    argv = ["--wall", "--device", device, "--tiny", "--out", str(out), f"data.root_dir={data_root}",
            f"distillation.teacher_path={tiny_teacher}",
            f"data.tokenizer.path={tiny_teacher}"]
    results = study.main(argv)

    card = "cpu" if device == "cpu" else torch.cuda.get_device_name(0)
    assert results["mode"] == "data_wall" and results["setup"]["device"] == card and results["setup"]["in_process"]
    assert results["setup"]["unique_tokens"] == 256 and results["setup"]["steps_per_epoch"] == 2
    assert "missing_runs" not in results
    teacher = results["setup"]["teacher_heldout_ce_by_split"]
    assert list(teacher) == ["pydocs", "repodocs"] and all(math.isfinite(v) and v > 0 for v in teacher.values())
    assert sorted(results["epochs"], key=int) == ["1", "2"]
    for e, budget in results["epochs"].items():
        assert sorted(budget["arms"]) == ["ce", "ce_wd10x", "kd_sampled64"]
        for name, arm in budget["arms"].items():
            assert arm["steps"] == 2 * int(e) and arm["tokens"] == 256 * int(e)
            assert list(arm["seeds"]) == ["0"]
            seed = arm["seeds"]["0"]
            for key in ("final_heldout_ce", "final_heldout_ce_repodocs", "wall_s"):
                assert math.isfinite(seed[key]) and seed[key] > 0, (e, name, key)
            assert math.isfinite(arm["flops"]["total"]) and (arm["flops"]["teacher_once"] > 0) == (not arm["is_ce"])
        assert "frontier" in budget and math.isfinite(budget["arms"]["kd_sampled64"]["minus_frontier_equal_tokens"]
                                                      ["mean"])
    # The CE arms' two weight decays start from the same init on the same windows: they differ only by the decay.
    ce, wd = (results["epochs"]["2"]["arms"][a]["seeds"]["0"]["final_heldout_ce"] for a in ("ce", "ce_wd10x"))
    assert ce != wd and abs(ce - wd) < 0.5
    table = (out / "table.md").read_text()
    assert "| 2 | kd_sampled64 |" in table and "| — | teacher | " in table and "| pydocs | repodocs |" in table
    assert (out / "kd_wall.png").stat().st_size > 10_000
    assert list(results["caches"]) == ["sampled64"] and results["caches"]["sampled64"]["tokens"] == 256
    assert not (out / "cache_topk64").exists()  # the CE arms read the KD arm's windows: one cache written
    # The teacher's CE measured here on the config's split is the one the cache writer measured on the same windows.
    assert teacher["pydocs"] == pytest.approx(results["teacher_heldout_ce"], rel=1e-4)

    stamps = {p: p.stat().st_mtime_ns for p in out.glob("runs/*/metrics.jsonl")}
    assert len(stamps) == 6
    again = study.main(argv)  # every run finished: nothing trains, the caches are reused
    assert {p: p.stat().st_mtime_ns for p in out.glob("runs/*/metrics.jsonl")} == stamps
    assert again["epochs"] == json.loads(json.dumps(results["epochs"]))
