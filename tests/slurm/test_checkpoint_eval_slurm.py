"""Meta Lingua's asynchronous checkpoint evaluation (`async_eval_gpus`) against the real one-node cluster: a run
trained under torchrun submits each `checkpoint.eval` save's evaluation through stool as its own SLURM job, and the
job's metrics land in the run's dump dir (metrics.eval.jsonl, metrics.validation.jsonl), as Lingua's do."""

import json
import re

import pytest

from tests.lingua_configs import cpu_sized, lingua_paths, write_lingua_config
from tests.runs import assert_ok, torchrun
from tests.slurm.conftest import describe_dump, wait_for_job_end

pytestmark = [pytest.mark.slurm, pytest.mark.slow]


@pytest.mark.timeout(600)
def test_async_checkpoint_eval_is_a_slurm_job_whose_metrics_land_in_the_dump_dir(slurm_cluster, jobs, corpus,
                                                                                 tiny_teacher, tmp_path):
    config = write_lingua_config("debug", tmp_path)
    paths = lingua_paths("debug", tmp_path, corpus, tokenizer_dir=tiny_teacher)
    # async_eval_gpus=0: a CPU job of one task (the test cluster has no GPU); Lingua's configs say 8.
    evals = ["async_eval_gpus=0", "eval.harness.tasks=[pydocs_cloze]", "eval.harness.limit=8",
             "eval.validation.max_steps=4", "eval.generator.dtype=fp32", "checkpoint.eval.every=2"]
    result = torchrun(2, [f"config={config}", *paths, *cpu_sized(steps=2), *evals], timeout=300)
    assert_ok(result)
    submitted = re.findall(r"checkpoint evaluation submitted as SLURM job (\d+)", result.stdout)
    assert len(submitted) == 1, result.stdout[-4000:]  # one eval checkpoint (step 2), one job
    jobs.extend(submitted)
    dump, eval_dir = tmp_path / "dump", tmp_path / "dump" / "evals" / f"{2:010d}"
    info = wait_for_job_end(submitted[0], 400, lambda: describe_dump(eval_dir))
    assert info.get("JobState", "COMPLETED") == "COMPLETED", (info, describe_dump(eval_dir))
    tasks = [json.loads(line) for line in (dump / "metrics.eval.jsonl").read_text().splitlines()]
    assert [row["global_step"] for row in tasks] == [2] and tasks[0]["pydocs_cloze"]["n_samples"] == 8
    validation = [json.loads(line) for line in (dump / "metrics.validation.jsonl").read_text().splitlines()]
    assert [row["global_step"] for row in validation] == [2] and validation[0]["heldout"]["batches"] == 4
    # stool's own files for the job: the code it ran, its config and script, its log.
    assert (eval_dir / "submit.slurm").is_file() and (eval_dir / "code" / "apps" / "main" / "eval.py").is_file()
    assert json.loads((eval_dir / "eval.json").read_text())["step"] == 2
