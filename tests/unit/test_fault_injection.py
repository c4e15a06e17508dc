"""The test harness's failure injection (tests/fault_injection.py): specs parse or say what is valid, and each fault
fires on its rank at its step through the seams it wraps (the multi-process fault tests are in tests/dist)."""

from types import SimpleNamespace

import pytest
import torch

import apps.main.train as trainer
from lingua.parallel.preemption import PreemptionFlag
from tests.fault_injection import InjectedFailure, install, parse_injected_failure


def test_injected_failure_specs_parse_or_say_what_is_valid():
    assert parse_injected_failure(None) is None
    assert parse_injected_failure("1@3") == InjectedFailure("raise", 1, 3)
    assert parse_injected_failure("nan:0@2") == InjectedFailure("nan", 0, 2)
    assert parse_injected_failure("teacher_load:1") == InjectedFailure("teacher_load", 1, 0)
    for bad in ("nan:1", "teacher_load:1@2", "boom:1@2", "x@y"):
        with pytest.raises(ValueError, match="use raise:<train_rank>@<step>"):
            parse_injected_failure(bad)


def run_student(monkeypatch, failure: InjectedFailure, train_rank: int, steps: int = 4) -> list:
    """The trainer's `train` and `train_step` replaced by fakes (a loop of `steps` steps), `failure` installed on
    them; returns each step's (loss, preemption requested) as the loop saw them."""
    seen = []

    def fake_train_step(args, model, distiller, feed, step, *rest):
        return {"loss/total": torch.tensor(2.0)}, []

    def fake_train(args, topo, phases, preemption):
        for step in range(1, steps + 1):
            metrics, _ = trainer.train_step(None, None, None, None, step)
            seen.append((float(metrics["loss/total"]), preemption.requested))

    monkeypatch.setattr(trainer, "train", fake_train)
    monkeypatch.setattr(trainer, "train_step", fake_train_step)
    install(failure)
    trainer.train(None, SimpleNamespace(train_rank=train_rank), None, PreemptionFlag(signals=()))
    return seen


def test_a_students_fault_fires_on_its_rank_at_its_step_only(monkeypatch):
    with pytest.raises(RuntimeError, match="injected failure on train rank 1 at step 3"):
        run_student(monkeypatch, InjectedFailure("raise", 1, 3), train_rank=1)
    assert len(run_student(monkeypatch, InjectedFailure("raise", 1, 3), train_rank=0)) == 4  # another rank: nothing
    with pytest.raises(ValueError, match="too many values to unpack"):
        run_student(monkeypatch, InjectedFailure("bug", 0, 2), train_rank=0)


def test_nan_makes_the_loss_not_finite_and_preempt_sets_the_flag_the_vote_reads(monkeypatch):
    losses = [loss for loss, _ in run_student(monkeypatch, InjectedFailure("nan", 1, 2), train_rank=1)]
    assert losses[0] == 2.0 and losses[1] != losses[1] and losses[2:] == [2.0, 2.0]
    flags = [requested for _, requested in run_student(monkeypatch, InjectedFailure("preempt", 0, 3), train_rank=0)]
    assert flags == [False, False, True, True]


def test_an_older_runs_config_with_inject_failure_still_parses_and_a_set_one_is_a_sentence(tmp_path):
    from lingua.args import parse_args
    from lingua.errors import ConfigError

    old = tmp_path / "config.yaml"  # what a run before the harness wrote into its dump dir
    old.write_text("steps: 7\ninject_failure: null\n")
    assert parse_args(trainer.TrainArgs, [f"config={old}"]).steps == 7
    with pytest.raises(ConfigError, match=r"inject_failure='raise:1@3' is no longer a config key: the tests inject "
                                          r"faults through their harness \(python -m tests.fault_injection"):
        parse_args(trainer.TrainArgs, [f"config={old}", "inject_failure=raise:1@3"])
