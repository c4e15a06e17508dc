"""Meta Lingua's debug.yaml, CPU-sized by overrides only, under torchrun: it trains with distillation off and on,
and each `checkpoint.eval` save runs Lingua's checkpoint evaluation in-process (the shipped lm-eval task, an
offline hub task that must only warn, and the validation loss), its metrics in the run's dump dir as Lingua's. The
student without distillation has a tiktoken tokenizer, as Lingua's own models: its tasks are scored and its export
reads as lingua does."""

import json
import math

import pytest

from lingua.run.dump_dir import train_rows
from lingua.tokenizer import TokenizerArgs, build_tokenizer
from tests.lingua_configs import cpu_sized, lingua_paths, write_lingua_config
from tests.runs import assert_ok, torchrun
from tests.student_exports import check_scored_and_exported

pytestmark = pytest.mark.slow  # every test here launches processes

CHECKPOINT_EVAL = ["eval.harness.tasks=[pydocs_cloze,hellaswag]", "eval.harness.limit=8",
                   "eval.validation.max_steps=4", "eval.generator.dtype=fp32"]


def read_lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.mark.timeout(420)
def test_lingua_debug_config_trains_and_evaluates_each_eval_checkpoint_in_process(corpus, student_tokenizers,
                                                                                  tmp_path):
    config = write_lingua_config("debug", tmp_path)
    paths = lingua_paths("debug", tmp_path, corpus)
    tiktoken = ["data.tokenizer.name=tiktoken", f"data.tokenizer.path={student_tokenizers['tiktoken']}"]
    result = torchrun(2, [f"config={config}", *paths, *tiktoken, *cpu_sized(steps=4), *CHECKPOINT_EVAL], timeout=360,
                      env={"HF_DATASETS_OFFLINE": "1"})
    assert_ok(result)
    dump = tmp_path / "dump"
    rows = train_rows(dump)
    assert sorted(rows) == [1, 2, 3, 4] and all(math.isfinite(r["loss/ce"]) for r in rows.values())
    # Lingua's metrics files: one line per evaluated checkpoint, stamped with the step.
    tasks = read_lines(dump / "metrics.eval.jsonl")
    assert [row["global_step"] for row in tasks] == [2, 4]
    for row in tasks:
        cloze = row["pydocs_cloze"]
        assert cloze["n_samples"] == 8 and 0 <= cloze["acc"] <= 1 and 0 <= cloze["acc_norm"] <= 1
        assert "hellaswag" not in row and row["created_at"]
    validation = read_lines(dump / "metrics.validation.jsonl")
    assert [row["global_step"] for row in validation] == [2, 4]
    vocab = build_tokenizer(TokenizerArgs("tiktoken", str(student_tokenizers["tiktoken"]))).n_words
    for row in validation:  # 4 held-out batches of 2 x 32 tokens; an untrained model: CE near ln(vocab)
        assert row["heldout"]["batches"] == 4 and row["heldout"]["tokens"] == 4 * 2 * 32
        assert abs(row["heldout"]["ce"] - math.log(vocab)) < 1.0
        assert math.isfinite(row["heldout"]["bpb"]) and row["heldout"]["bytes"] > 0
    report = json.loads((dump / "evals" / f"{4:010d}" / "eval.json").read_text())
    assert report["step"] == 4 and report["heldout"] == validation[1]["heldout"]
    settings = report["settings"]  # Lingua's generator settings as lm-eval takes them
    assert settings["gen_kwargs"] == "do_sample=True,max_gen_toks=512,temperature=1.0,top_p=0.95"
    assert settings["max_length"] == 8192 and settings["dtype"] == "float32"
    # The hub task is a warning naming it, and the run went on.
    assert "lm-eval task 'hellaswag' was skipped" in result.stdout, result.stdout[-4000:]
    check_scored_and_exported(dump, 4, tmp_path, max_length=settings["max_length"])


@pytest.mark.timeout(420)
def test_lingua_debug_config_trains_with_distillation(corpus, tiny_teacher, tmp_path):
    """The same config with the two-line addition of distillation: 2 students + 1 teacher, a checkpoint evaluation
    (validation loss only) while the teacher waits."""
    config = write_lingua_config("debug", tmp_path)
    paths = lingua_paths("debug", tmp_path, corpus, tokenizer_dir=tiny_teacher)  # the teacher's vocabulary
    kd = ["enable_distillation=true", f"distillation.teacher_path={tiny_teacher}", "distillation.teacher_dtype=fp32",
          "distillation.k=8", "eval.harness.tasks=[]", "eval.validation.max_steps=2", "distillation.prefetch=0"]
    result = torchrun(3, [f"config={config}", *paths, *cpu_sized(steps=4), *kd], timeout=360)
    assert_ok(result)
    rows = train_rows(tmp_path / "dump")
    assert sorted(rows) == [1, 2, 3, 4]
    assert all(math.isfinite(r["loss/kd"]) and math.isfinite(r["loss/ce"]) for r in rows.values())
    validation = read_lines(tmp_path / "dump" / "metrics.validation.jsonl")
    assert [row["global_step"] for row in validation] == [2, 4]
    assert not (tmp_path / "dump" / "metrics.eval.jsonl").exists()  # no harness tasks: no task rows
    # The teacher waited across each evaluation under the generous timeout: step 2's requests kept the first step's,
    # step 3's (unmarked) switched it to the short one, step 4's announced the pause (and switched back).
    teacher_log = (tmp_path / "dump" / "logs" / "rank_2.log").read_text()
    assert teacher_log.count("announced a long pause after this request (step 4") == 1, teacher_log[-3000:]
