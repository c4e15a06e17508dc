"""Issue 44's planner on Meta Lingua's own llama_1B.yaml: it is accepted as the trainer accepts it (the same
defaults), its answer is line 1, and every command it prints runs as printed: each is parsed and validated for its
launch size as its own entry point would (the trainer's checks before any process group; the GPUs are elsewhere),
a placeholder is one sentence, and the command validates once the placeholder is filled in."""

import contextlib
import io
import json
import shlex
import shutil
from pathlib import Path

import pytest

from apps.main.teacher_cache import TeacherCacheArgs
from apps.main.train import TrainArgs
from apps.plan.cli import main
from apps.plan.pilot import PilotArgs
from apps.plan.tokenizers import TEACHER_PLACEHOLDER
from lingua.args import parse_args
from lingua.errors import ConfigError
from tests.lingua_configs import lingua_paths, write_lingua_config

ROOT = Path(__file__).resolve().parents[4]
LLAMA_8B = ROOT / "configs" / "teachers" / "llama3_8b.json"
ENTRY_POINTS = {"apps.main.train": TrainArgs, "apps.main.teacher_cache": TeacherCacheArgs, "apps.plan.pilot": PilotArgs}


def plan_lines(argv: list[str]) -> list[str]:
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        main(argv)
    return printed.getvalue().splitlines()


def printed_commands(lines: list[str]) -> list[str]:
    """Every command line the plan prints (the launch commands after `launch:` too)."""
    commands = [line.strip().removeprefix("launch: ") for line in lines]
    return [c for c in commands if c.startswith(("torchrun ", "python -m "))]


def dry_run(command: str) -> object:
    """Parse `command`'s keys as its module does, and validate them for its launch (torchrun's ranks)."""
    words = shlex.split(command)
    module = words[words.index("-m") + 1]
    args = parse_args(ENTRY_POINTS[module], words[words.index("-m") + 2:])
    if words[0] == "torchrun":
        per_node = int(words[words.index("--nproc-per-node") + 1])
        nodes = int(words[words.index("--nnodes") + 1]) if "--nnodes" in words else 1
        args.validate(nodes * per_node, per_node)
    return args


@pytest.fixture
def lingua_1b(tmp_path, corpus) -> tuple[Path, list[str]]:
    """Lingua's llama_1B.yaml as published, with a Lingua user's path overrides (its data and tiktoken file)."""
    return write_lingua_config("llama_1B", tmp_path), lingua_paths("llama_1B", tmp_path, corpus)


@pytest.fixture
def teacher_dir(tmp_path) -> Path:
    """Llama 3.1 8B's checkpoint folder as validation sees it: its config.json (the weights are not read)."""
    folder = tmp_path / "Llama-3.1-8B"
    folder.mkdir()
    shutil.copy(LLAMA_8B, folder / "config.json")
    return folder


@pytest.mark.timeout(120)
def test_lingua_llama_1b_is_planned_answer_first_and_each_printed_command_runs(lingua_1b, teacher_dir, tmp_path):
    config, paths = lingua_1b
    lines = plan_lines([f"config={config}", "world_size=8", f"teacher_config={LLAMA_8B}", "out=null", *paths])
    # Line 1 is the answer: the pilot first and its GPU-hours, the break-even, the road, its layout and GPU-hours.
    assert lines[0].startswith("answer: pilot first (") and " GPU-hours, commands below): break-even 2.47x the CE " \
        "tokens, the nearest measurement 1.18x, so do not distill unless the pilot measures more than 2.47x; to " \
        "distill: from a cache (written once with teacher_tp=1: " in lines[0]
    assert not any(line.lstrip().startswith(("recommendation:", "verdict:")) for line in lines)
    # data.batch_size is per student rank: the global batch of each road, and the pilot's equal global batches.
    assert "global batch: 4 students x 4 x 4096 = 65,536 tokens a step distilling (data.batch_size is per student " \
        "rank); CE-only on all 8 GPUs at this data.batch_size: 131,072; the pilot's CE-only run takes the same " \
        "global batch" in "\n".join(lines)
    commands = printed_commands(lines)
    modules = [shlex.split(c)[shlex.split(c).index("-m") + 1] for c in commands]
    assert modules == ["apps.main.train", "apps.main.teacher_cache", "apps.main.train", "apps.main.train",
                       "apps.plan.pilot"]  # the online launch, the cache writer, the two pilots, their reading
    cache_dir = tmp_path / "cache"
    for command in commands:
        if TEACHER_PLACEHOLDER in command:  # as printed: one sentence naming the placeholder
            with pytest.raises(ConfigError, match="that is a placeholder of a printed command; replace it with"):
                dry_run(command)
        filled = command.replace(TEACHER_PLACEHOLDER, str(teacher_dir)).replace("<cache dir>", str(cache_dir))
        args = dry_run(filled)
        if isinstance(args, TrainArgs) and args.enable_distillation:
            assert args.distillation.teacher_path == str(teacher_dir)
        if isinstance(args, TrainArgs):  # the students on the teacher's tokenizer, CE-only too (one comparison)
            assert (args.data.tokenizer.name, args.data.tokenizer.path) == ("hf", str(teacher_dir))
    ce, kd = (parse_args(TrainArgs, shlex.split(c)[5:]) for c in commands[2:4])
    assert ce.data.batch_size * 8 == kd.data.batch_size * 4  # equal global batches: 8 ranks x 2 = 4 students x 4


@pytest.mark.timeout(120)
def test_a_teacher_path_the_plan_knows_is_in_its_commands(lingua_1b, teacher_dir):
    config, paths = lingua_1b
    lines = plan_lines([f"config={config}", "world_size=8", f"distillation.teacher_path={teacher_dir}", "out=null",
                        *paths])
    assert lines[0].startswith("answer: ") and not any(TEACHER_PLACEHOLDER in line for line in lines)
    for command in printed_commands(lines):
        dry_run(command.replace("<cache dir>", "cache"))


@pytest.mark.timeout(120)
def test_the_cross_tokenizer_ratio_is_measured_when_both_tokenizers_are_here(lingua_1b, tiny_teacher, corpus):
    """distillation.cross_tokenizer=true keeps Lingua's tokenizer: with it and the teacher's here, the planner
    measures the teacher's tokens per student token on the config's data, and the commands keep the tokenizer."""
    from lingua.tokenizer import TokenizerArgs, build_tokenizer
    from apps.bench.alignment_cost import write_llama3_tiktoken
    from transformers import AutoTokenizer

    config, paths = lingua_1b
    tiktoken = write_llama3_tiktoken(config.parent / "llama3.tiktoken")
    teacher = json.loads((tiny_teacher / "config.json").read_text())
    argv = [f"config={config}", "world_size=8", "out=null", *paths, f"data.tokenizer.path={tiktoken}",
            "distillation.cross_tokenizer=true", f"distillation.teacher_path={tiny_teacher}",
            "data.seq_len=128", "model.n_layers=2"]
    lines = plan_lines(argv)
    speed = next(line for line in lines if line.startswith("speed ("))
    # By hand on the same data: the tiny teacher's tokens over Llama 3's on the source's first chunk file.
    texts = [json.loads(line)["text"] for line in sorted((corpus / "text").glob("*.chunk.*.jsonl"))[0].open()]
    student = build_tokenizer(TokenizerArgs("tiktoken", str(tiktoken)))
    hf = AutoTokenizer.from_pretrained(str(tiny_teacher))
    ratio = sum(len(hf(t, add_special_tokens=False)["input_ids"]) for t in texts) / \
        sum(len(student.encode(t, False, False)) for t in texts)
    assert f"the teacher at {ratio:.3g} of its tokens per student token (measured on " in speed, speed
    assert teacher["max_position_embeddings"] >= 128
    assert not any("data.tokenizer.name=hf" in c for c in printed_commands(lines))  # the students keep tiktoken


@pytest.mark.timeout(120)
def test_lingua_llama_1b_keeping_its_tokenizer_is_planned_at_that_tokenizers_vocabulary(lingua_1b):
    """distillation.cross_tokenizer=true keeps Lingua's tiktoken file: the planned student has its vocabulary, as the
    trainer builds it, not the teacher's 128,256 (nor SmolLM2's 49,152), and its commands keep the tokenizer."""
    from lingua.tokenizer import build_tokenizer
    from apps.main.transformer import num_parameters

    config, paths = lingua_1b
    argv = [f"config={config}", "world_size=8", f"teacher_config={ROOT / 'configs/teachers/smollm2_135m.json'}",
            *paths, "distillation.cross_tokenizer=true", "teacher_tokens_per_student_token=1.1"]
    plan = main(argv + ["show=verdict"])
    trainer = parse_args(TrainArgs, [f"config={config}", *paths])
    vocab = build_tokenizer(trainer.data.tokenizer).n_words  # what init_tokenizer gives model.vocab_size
    assert plan["student"]["vocab"] == vocab != plan["teacher"]["vocab"] == 49_152
    trainer.model.vocab_size = vocab
    assert plan["student"]["parameters"] == num_parameters(trainer.model)
    assert plan["inputs"]["tokenizer_keys"] == []  # the commands leave data.tokenizer as the config has it
