"""A dump dir holding another model's run is one sentence naming what differs; a resume with another steps= is one
notice with both lrs (the launches themselves: tests/dist/test_train.py)."""

import json

import pytest

from apps.main.train import TrainArgs
from lingua.args import to_dict
from lingua.errors import LaunchError
from lingua.optim import lr_factor
from lingua.run.resume_fit import refuse_another_model, schedule_notice


def saved_checkpoint(dump, step: int, args: TrainArgs, vocab_size: int = 258):
    """What a finished save leaves that these checks read: the marker, DCP's metadata, params.json."""
    ckpt = dump / "checkpoints" / f"{step:010d}"
    ckpt.mkdir(parents=True)
    (ckpt / ".metadata").write_bytes(b"")
    (ckpt / "checkpoint.json").write_text(json.dumps({"step": step}))
    params = to_dict(args)
    params["model"]["vocab_size"] = vocab_size  # resolved from the tokenizer, as the trainer saves it
    (ckpt / "params.json").write_text(json.dumps(params))
    return ckpt


def args_of(dump, **model) -> TrainArgs:
    args = TrainArgs(name="debug_cpu", dump_dir=str(dump), steps=40)
    args.data.tokenizer.name = "bytes"
    for key, value in model.items():
        setattr(args.model, key, value)
    return args


def test_the_same_model_resumes_and_another_is_refused_naming_what_differs(tmp_path):
    saved = args_of(tmp_path, dim=128, n_layers=2)
    ckpt = saved_checkpoint(tmp_path, 80, saved)
    refuse_another_model(args_of(tmp_path, dim=128, n_layers=2))  # the same model: nothing to say
    other = args_of(tmp_path, dim=256, n_layers=2)
    other.name = "distill"
    other.data.tokenizer.name, other.data.tokenizer.path = "hf", str(tmp_path / "no_tokenizer_here")
    other.model.vocab_size = 49152
    with pytest.raises(LaunchError) as refused:
        refuse_another_model(other)
    assert str(refused.value) == (
        f"dump_dir {tmp_path} holds a run of another model (its newest checkpoint {ckpt}: model.dim=128 there, 256 "
        f"here; a vocabulary of 258 tokens (tokenizer bytes) there, 49,152 (tokenizer hf {tmp_path}/no_tokenizer_here) "
        f"here; the run's name 'debug_cpu' there, 'distill' here), which this config cannot resume; pick another "
        f"dump_dir for this config (nothing in this one was changed)")


def test_a_renamed_run_of_the_same_model_and_an_empty_dump_dir_pass(tmp_path):
    refuse_another_model(args_of(tmp_path / "empty"))  # nothing saved yet
    saved_checkpoint(tmp_path, 20, args_of(tmp_path))
    renamed = args_of(tmp_path)
    renamed.name = "renamed"
    refuse_another_model(renamed)


def test_a_larger_steps_on_resume_is_one_notice_with_both_lrs(tmp_path):
    saved = args_of(tmp_path)
    saved.optim.lr, saved.optim.warmup = 3e-3, 5
    saved_checkpoint(tmp_path, 40, saved)
    assert schedule_notice(saved, 40) is None  # the same steps: nothing to say
    longer = args_of(tmp_path)
    longer.optim.lr, longer.optim.warmup, longer.steps = 3e-3, 5, 80
    old_lr, new_lr = 3e-3 * lr_factor(39, longer.optim, 40), 3e-3 * lr_factor(41, longer.optim, 80)
    assert new_lr > 4 * old_lr  # the cosine climbs back from its end
    assert schedule_notice(longer, 40) == (
        f"resuming a run of steps=40 with steps=80: the cosine lr schedule is stretched over 80 steps, so the lr goes "
        f"from {old_lr:.2e} at step 40 to {new_lr:.2e} at step 42 (the run of 40 steps: "
        f"{3e-3 * lr_factor(40, longer.optim, 40):.2e})")
    unfinished = args_of(tmp_path)  # resumed before its planned end: the way back is said too
    unfinished.optim.lr, unfinished.optim.warmup, unfinished.steps = 3e-3, 5, 60
    assert schedule_notice(unfinished, 20).endswith("; relaunch with steps=40 to keep the run's own schedule")
