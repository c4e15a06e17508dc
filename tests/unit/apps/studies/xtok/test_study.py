"""The cross-tokenizer study (apps/studies/xtok/study.py): its tiny version end to end in this process (own BPE
trained, both caches written once, every arm trained and scored in bits per byte), its verdict rule, its errors."""

import json
import math
import shutil

import pytest

from apps.studies.xtok import study as xtok_study
from apps.studies.xtok.report import versus_baseline
from lingua.evaluation.bits_per_byte import LN2
from lingua.errors import ConfigError
from setup.repo_docs_corpus import prepare_repo_docs


@pytest.fixture
def study_corpus(corpus, tmp_path):
    """The test corpus under the config's source name, with the post-cutoff held-out split beside it."""
    root = tmp_path / "corpus"
    (root / "pydocs").mkdir(parents=True)
    for path in (corpus / "text").glob("text.*.jsonl"):
        shutil.copy(path, root / "pydocs" / path.name.replace("text.", "pydocs.", 1))
    prepare_repo_docs(root)
    return root


@pytest.mark.bench  # a study end to end: the bench tier
@pytest.mark.timeout(300)  # 11 s of CPU; minutes of wall time on the shared 2-core machine
def test_the_tiny_study_trains_every_arm_and_reports_bits_per_byte(study_corpus, tiny_teacher, tmp_path):
    out = tmp_path / "xtok"
    argv = ["--tiny", "--teacher-bpb", "--out", str(out), f"data.root_dir={study_corpus}",
            f"distillation.teacher_path={tiny_teacher}", f"data.tokenizer.path={tiny_teacher}"]
    results = xtok_study.main(argv)

    setup = results["setup"]
    assert "missing_runs" not in results and setup["steps"] == 4 and setup["epochs"] == 2
    own = setup["own_tokenizer"]
    assert own["trained_vocab"] == 320 and (out / "tokenizer_bpe320" / "tokenizer.json").is_file()
    assert setup["sides"]["cross"]["n_words"] == 320 and setup["sides"]["same"]["n_words"] == 512
    assert list(results["arms"]) == ["ce_own", "kd_cross", "kd_cross_uld", "ce_same", "kd_same"]
    for name, arm in results["arms"].items():
        seed = arm["seeds"]["0"]
        for split in ("pydocs", "repodocs"):
            stats = setup["sides"][arm["cache"]]["splits"][split]
            ce = seed[f"ce_per_token_{split}"]
            # bits per byte = the held-out CE summed in bits over the UTF-8 bytes of the scored targets
            assert seed[f"bpb_{split}"] == pytest.approx(ce * stats["tokens"] / LN2 / stats["bytes"])
            assert 0 < seed[f"bpb_{split}"] < 20 and stats["bytes"] > stats["tokens"] > 0, (name, split)
    sides = setup["sides"]
    assert sides["cross"]["splits"]["pydocs"]["tokens"] == 2 * 4 * 32  # --tiny: 2 held-out batches of 4 x 32
    assert 0.2 < sides["cross"]["aligned"] <= 1 and sides["same"]["aligned"] is None
    # The ULD cache holds the same windows and alignment; only the unmapped entries are added.
    assert sides["cross_uld"]["aligned"] == sides["cross"]["aligned"]
    assert sides["cross_uld"]["splits"] == sides["cross"]["splits"]
    assert results["arms"]["kd_cross"]["seeds"]["0"]["aligned"] == sides["cross"]["aligned"]
    # KD and its CE-only baseline start from one init on the same windows: only the teacher's targets differ.
    for kd, ce in (("kd_cross", "ce_own"), ("kd_cross_uld", "ce_own"), ("kd_same", "ce_same")):
        a, b = (results["arms"][n]["seeds"]["0"]["bpb_pydocs"] for n in (kd, ce))
        assert a != b and abs(a - b) < 0.5
        assert results["arms"][kd]["versus_baseline"]["pydocs"]["verdict"] == "1 seed: no spread"
    assert results["arms"]["kd_cross"]["versus_baseline"]["pydocs"]["mean"] == pytest.approx(
        results["arms"]["kd_cross"]["bpb"]["pydocs"]["mean"] - results["arms"]["ce_own"]["bpb"]["pydocs"]["mean"])
    assert all(math.isfinite(v) and v > 0 for v in setup["teacher_bpb"].values())  # --teacher-bpb: both splits
    table = (out / "table.md").read_text()
    assert "| kd_cross | own BPE, 320 ids |" in table and "| teacher | teacher's |" in table
    manifest = json.loads((out / "cache_cross_topk64" / "cache.json").read_text())
    assert manifest["cross_tokenizer"] and manifest["vocab_size"] == 320 and not manifest["unmapped_entries"]
    assert json.loads((out / "cache_cross_uld_topk64" / "cache.json").read_text())["unmapped_entries"]
    # ULD changes the loss: its run differs from the plain cross-tokenizer KD's.
    uld, plain = (results["arms"][a]["seeds"]["0"]["train_loss"] for a in ("kd_cross_uld", "kd_cross"))
    assert uld != plain

    stamps = {p: p.stat().st_mtime_ns for p in out.glob("runs/*/metrics.jsonl")}
    tokenizer = (out / "tokenizer_bpe320" / "tokenizer.json").read_bytes()
    assert len(stamps) == 5
    again = xtok_study.main(argv)  # every run finished: nothing trains, the tokenizer and caches are kept
    assert {p: p.stat().st_mtime_ns for p in out.glob("runs/*/metrics.jsonl")} == stamps
    assert again["arms"] == json.loads(json.dumps(results["arms"]))
    # Training the BPE is deterministic: a fresh folder gets the same bytes.
    texts = xtok_study.training_texts(str(study_corpus), {"pydocs": 1.0})
    xtok_study.train_student_tokenizer(tmp_path / "again", texts, 320)
    assert (tmp_path / "again" / "tokenizer.json").read_bytes() == tokenizer


def arm_of(values: dict) -> dict:
    spread = max(values.values()) - min(values.values())
    return {"seeds": {s: {"bpb_pydocs": v} for s, v in values.items()}, "bpb": {"pydocs": {"spread": spread}}}


def test_the_verdict_needs_every_seed_and_a_margin_beyond_both_spreads():
    base = arm_of({"0": 3.00, "1": 3.02, "2": 3.01})  # spread 0.02
    assert versus_baseline(arm_of({"0": 2.90, "1": 2.93, "2": 2.91}), base, "pydocs")["verdict"] == "beats"
    # Below on every seed, but by less than the baseline's spread.
    small = versus_baseline(arm_of({"0": 2.99, "1": 3.01, "2": 3.00}), base, "pydocs")
    assert small["verdict"] == "within spread" and small["mean"] == pytest.approx(-0.01)
    # A large mean gain that one seed does not share.
    assert versus_baseline(arm_of({"0": 2.70, "1": 3.03, "2": 2.80}), base, "pydocs")["verdict"] == "within spread"
    assert versus_baseline(arm_of({"0": 3.10, "1": 3.12, "2": 3.11}), base, "pydocs")["verdict"] == "worse"


def test_bad_options_are_one_sentence(tmp_path):
    with pytest.raises(ConfigError, match="name some of ce_own, kd_cross"):
        xtok_study.main(["--arms", "kd_bogus", "--out", str(tmp_path)])
    with pytest.raises(ConfigError, match="positive number of training steps"):
        xtok_study.main(["--steps", "0", "--out", str(tmp_path)])
    with pytest.raises(ConfigError, match="at least 258"):
        xtok_study.train_student_tokenizer(tmp_path / "tok", ["some text"], 100)
