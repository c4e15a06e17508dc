"""`--help` / `-h` on every key=value entry point (lingua/cli/help.py through parse_args): the keys with their defaults and
a line each from the source, exit 0, in-process, no process group started."""

import importlib

import pytest
import torch.distributed as dist

from lingua.cli.entry import run_cli
from lingua.cli.help import field_comments, help_rows, help_text
from lingua.cli.words import type_words

# (entry point, lines its help must show: a key=default with the start of its comment, or a key=default alone)
ENTRY_POINTS = {
    "apps.main.train": ["steps=1000  ", "optim.lr=0.0003  ", "distillation.k=64  ",
                        "top-k ids, or samples per position", "enable_distillation=false", "learn from a teacher"],
    "apps.plan.cli": ["world_size=0", "GPUs of the launch", "planned_runs=1", "training runs that could share one",
                      "kd_measurement=null", "steps=1000"],
    "apps.plan.pilot": ["ce=''", "dump_dir of the CE-only pilot", "kd=''", "out='pilot_results.json'",
                        "teacher_config=null"],
    "lingua.stool": ["nodes=1", "ngpus=8", "GPUs per node; 0 = CPU partition", "signal_grace_s=120",
                     "python -m apps.main.train --help"],
    "apps.main.eval": ["ckpt=''", "a checkpoint step directory, or a checkpoints root", "tasks='pydocs_cloze'",
                       "batch_size=8"],
    "apps.main.teacher_cache": ["cache_dir=''", "streams=1", "data-parallel students the cache is laid out for",
                                "sequences_per_stream=0", "shard_sequences=64", "data.seq_len=256"],
    "apps.main.export_hf": ["ckpt=''", "out=''", "dtype='fp32'", "dtype of the saved weights"],
    "apps.main.generate": ["max_new_tokens=50", "temperature=0.8", "0 = greedy", "device='auto'"],
    "apps.debug.startup": ["steps=1000", "distillation.teacher_path=null"],
}


@pytest.mark.parametrize("flag", ["--help", "-h"])
@pytest.mark.parametrize("module", sorted(ENTRY_POINTS))
def test_help_lists_the_keys_with_their_defaults_and_exits_0(module, flag, capsys, monkeypatch):
    main = importlib.import_module(module).main
    argv = ["config=does/not/exist.yaml", flag, "nonsense"]  # help wins over whatever else is on the line
    with pytest.raises(SystemExit) as exit_:
        run_cli(lambda: main(argv))
    out, err = capsys.readouterr()
    assert exit_.value.code == 0 and err == ""
    for expected in ENTRY_POINTS[module]:
        assert expected in out, (module, expected)
    assert not (dist.is_available() and dist.is_initialized())  # parsed, printed, left: nothing started


def test_every_key_gets_its_default_and_a_line():
    from apps.plan.args import PlanArgs

    rows = {key: (default, text) for key, default, text in help_rows(PlanArgs, PlanArgs())}
    assert rows["world_size"] == ("0", "GPUs of the launch (whole nodes)")  # PlanArgs' own comment
    assert rows["gpus_per_node"] == ("8", "GPUs of one node (a teacher replica stays inside a node)")
    assert rows["model.max_seqlen"][0] == "-1"  # TrainArgs' default_factory, not LMTransformerArgs' own default
    assert rows["distributed.init_timeout_s"][1].startswith("Two-phase timeouts")  # the comment block above it
    assert all(text for _, text in rows.values())


def test_a_subclass_keeps_its_bases_comments():
    from apps.main.teacher_cache import TeacherCacheArgs

    comments = field_comments(TeacherCacheArgs)
    assert comments["streams"].startswith("data-parallel students")
    assert comments["steps"] == "optimizer steps of the whole run"  # TrainArgs' comment


# Each entry point's args class: the keys its --help lists.
ARGS_CLASSES = {"apps.main.train": "TrainArgs", "apps.plan.args": "PlanArgs", "apps.plan.pilot": "PilotArgs",
                "lingua.stool": "StoolArgs", "apps.main.eval": "CheckpointEvalArgs",
                "apps.main.teacher_cache": "TeacherCacheArgs", "apps.main.export_hf": "ExportArgs",
                "apps.main.generate": "GenerateArgs", "apps.debug.startup": "StartupArgs"}
WORDS_OF_TYPES = {type_words(t) for t in (int, float, str, bool)}


def args_class(module: str) -> type:
    return getattr(importlib.import_module(module), ARGS_CLASSES[module])


@pytest.mark.parametrize("module", sorted(ARGS_CLASSES))
def test_no_key_lacks_a_description(module):
    """Every key of every entry point says what it does in a comment of its own (its unit, and what its special
    values mean), never only the type it takes ("an integer", "a number", "a string") nor a word or two."""
    cls = args_class(module)
    try:
        instance = cls()
    except TypeError:
        instance = None
    lacking = []
    for key, _, text in help_rows(cls, instance):
        typed = text.removesuffix(" or null")
        if typed in WORDS_OF_TYPES or text.startswith(("a mapping of ", "a list of ")) or len(text.split()) < 4:
            lacking.append(f"{key}: {text!r}")
    assert not lacking, f"{cls.__name__}: keys without a description: {lacking}"


@pytest.mark.parametrize("module", ["apps.plan.args", "apps.main.teacher_cache", "apps.debug.startup"])
def test_a_tool_lists_its_own_keys_before_the_training_keys_it_shares(module):
    """apps.plan --help starts with world_size and the cluster's keys, not with 135 training keys."""
    from apps.main.train import TrainArgs

    cls = args_class(module)
    lines = help_text(cls).splitlines()
    keys = [line.split()[0].split("=", 1)[0] for line in lines if line.startswith("  ") and "=" in line.split()[0]]
    training = {key for key, _, _ in help_rows(TrainArgs, TrainArgs())}
    own = [key for key in keys if key not in training]
    assert own and keys[:len(own)] == own, keys[:5]
    assert any(line.startswith(f"{cls.__name__}'s own keys, first") for line in lines)
    assert any(line.startswith("the keys it shares with TrainArgs") for line in lines)
