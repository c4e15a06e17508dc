"""Meta Lingua's own configs (tests/lingua_configs.py, in Lingua's shape key for key) parse and validate for 8 ranks
with only their paths changed, and each of Lingua's keys does here what it does in Lingua."""

import logging
import os
from pathlib import Path

import pytest

from apps.main.checkpoint_eval import eval_args_for
from apps.main.train import TrainArgs
from lingua.args import parse_args
from lingua.errors import ConfigError
from tests.lingua_configs import LINGUA_CONFIGS, lingua_paths, write_lingua_config
from tests.runs import base_overrides


def lingua_args(name: str, tmp_path: Path, corpus: Path, *extra: str) -> TrainArgs:
    config = write_lingua_config(name, tmp_path)
    return parse_args(TrainArgs, [f"config={config}", *lingua_paths(name, tmp_path, corpus), *extra])


@pytest.mark.parametrize("name", sorted(LINGUA_CONFIGS))
def test_lingua_config_validates_for_8_ranks_with_paths_changed_only(name, tmp_path, corpus, caplog):
    args = lingua_args(name, tmp_path, corpus)
    with caplog.at_level(logging.WARNING):
        args.validate(world_size=8, local_world_size=8)
    assert args.distributed.tp_size == 1 and args.distributed.activation_checkpointing == "none"
    assert args.data.n_views == 2
    assert args.model.max_seqlen == args.data.seq_len  # Lingua sets it from data.seq_len
    assert args.eval.enabled and args.eval.validation.max_steps in (100, 1000)
    assert "hellaswag" in args.eval.harness.tasks and args.eval.generator.dtype == "bf16"
    assert args.async_eval_gpus == (None if name == "debug" else 8)
    assert args.heldout.every == 0  # Lingua has no in-loop held-out CE: ours stays off
    # Hub tasks are named once at validation (offline, each is skipped with a warning at its evaluation).
    assert "hellaswag" in caplog.text and "skipped with a warning" in caplog.text


def test_lingua_task_dicts_and_generator_settings_reach_the_evaluation(tmp_path, corpus):
    args = lingua_args("debug", tmp_path, corpus)
    args.validate()
    eval_args = eval_args_for(args, 100, tmp_path / "dump" / "checkpoints" / f"{100:010d}")
    assert eval_args.tasks == ["hellaswag", "piqa", {"task": "nq_open", "num_fewshot": 5}]
    assert eval_args.gen_kwargs == "do_sample=True,max_gen_toks=512,temperature=1.0,top_p=0.95"
    assert (eval_args.max_length, eval_args.dtype) == (8192, "bfloat16")
    assert eval_args.perplexity and eval_args.perplexity_max_batches == 100
    assert eval_args.skip_unavailable_tasks and eval_args.global_step == 100
    assert eval_args.metric_log_dir == str(tmp_path / "dump")
    assert eval_args.dump_dir == str(tmp_path / "dump" / "evals" / f"{100:010d}")


def test_selective_activation_checkpointing_is_our_selective(tmp_path, corpus):
    args = lingua_args("debug", tmp_path, corpus, "distributed.selective_activation_checkpointing=true")
    args.validate()
    assert args.distributed.activation_checkpointing == "selective"


@pytest.mark.parametrize("override, words", [
    ("distributed.tp_size=2", "distributed.tp_size=2; student tensor parallelism is not available here; set "
                              "distributed.tp_size=1 and shard the student with FSDP over distributed.dp_shard"),
    ("data.n_views=3", "data.n_views=3; the loader yields 2 views"),
])
def test_lingua_keys_we_do_not_build_are_one_sentence(override, words, tmp_path, corpus):
    args = lingua_args("debug", tmp_path, corpus, override)
    with pytest.raises(ConfigError) as caught:
        args.validate(world_size=8, local_world_size=8)
    assert str(caught.value).startswith(words) and "\n" not in str(caught.value)


def test_old_eval_keys_still_set_the_in_loop_held_out_ce_with_a_warning(corpus, tmp_path, caplog):
    overrides = base_overrides(corpus, tmp_path / "run", **{"heldout.every": 0})
    with caplog.at_level(logging.WARNING):
        args = parse_args(TrainArgs, overrides + ["eval.every=5", "eval.max_batches=3", "eval.uneven=error"])
    assert (args.heldout.every, args.heldout.max_batches, args.heldout.uneven) == (5, 3, "error")
    assert args.eval.every is None and not args.eval.enabled  # nothing moved to Lingua's checkpoint evaluation
    assert "eval.every, eval.max_batches, eval.uneven: the in-loop held-out CE is configured under heldout:" \
        in caplog.text
    args.validate(world_size=2)
    new = parse_args(TrainArgs, overrides + ["heldout.every=5", "heldout.max_batches=3", "heldout.uneven=error"])
    assert new.heldout == args.heldout


def test_no_eval_section_means_no_checkpoint_evaluation(corpus, tmp_path):
    args = parse_args(TrainArgs, base_overrides(corpus, tmp_path / "run"))
    assert not args.eval.enabled and args.async_eval_gpus is None
    assert args.checkpoint.eval.every == 1000  # saved as before; nothing evaluates them unless eval: asks


def test_an_eval_job_is_submitted_without_the_trainers_launcher_variables(monkeypatch):
    from apps.main.checkpoint_eval import launcher_env_removed

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("SLURM_PROCID", "0")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    with launcher_env_removed():
        assert not {"WORLD_SIZE", "SLURM_PROCID", "TORCHELASTIC_RUN_ID"} & set(os.environ)
    assert (os.environ["WORLD_SIZE"], os.environ["SLURM_PROCID"]) == ("2", "0")
