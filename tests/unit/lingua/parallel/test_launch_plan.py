"""The validation pass: every row of tests/bad_configs.py is refused in-process with one sentence naming its
key, on top of the tiny plain run (2 ranks) and the tiny distillation run (2 students + 1 teacher); and a
rank that loses a peer names the rank that stopped first."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from apps.main.train import TrainArgs
from lingua.args import parse_args
from lingua.errors import PeerStopped, UserError
from lingua.parallel.launch_plan import LaunchPlan, TeacherLayout
from lingua.parallel.rank_status import RankStatus, is_peer_loss
from tests.bad_configs import BAD_CONFIGS
from tests.runs import base_overrides, distill_overrides

LAUNCHES = {"plain": 2, "distill": 3}  # world sizes of the two tiny runs


@pytest.fixture(scope="module")
def teacher_stub(tmp_path_factory):
    """What validation reads of a teacher: the directory and its config.json (the tokenizer path is the same dir)."""
    path = tmp_path_factory.mktemp("teacher") / "tiny-llama"
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"max_position_embeddings": 4096, "num_attention_heads": 4,
                                                  "num_key_value_heads": 2}))
    return path


def launch_args(launch: str, corpus, teacher, dump, extra: list[str]) -> list[str]:
    base = base_overrides(corpus, dump) if launch == "plain" else distill_overrides(corpus, teacher, dump)
    return base + extra


@pytest.mark.parametrize("launch", LAUNCHES)
def test_the_tiny_runs_themselves_validate(launch, corpus, teacher_stub, tmp_path):
    args = parse_args(TrainArgs, launch_args(launch, corpus, teacher_stub, tmp_path, []))
    args.validate(LAUNCHES[launch])


@pytest.mark.parametrize("launch", LAUNCHES)
@pytest.mark.parametrize("bad", BAD_CONFIGS, ids=[b.name for b in BAD_CONFIGS])
def test_every_bad_config_is_one_sentence_naming_its_key(bad, launch, corpus, teacher_stub, tmp_path):
    with pytest.raises(UserError) as caught:
        args = parse_args(TrainArgs, launch_args(launch, corpus, teacher_stub, tmp_path, bad.args(str(teacher_stub))))
        args.validate(LAUNCHES[launch])
    message = str(caught.value)
    assert "\n" not in message, message
    assert bad.key in message, message
    if bad.sentence is not None:
        assert message == bad.sentence_of(launch)


def test_tasks_that_cannot_be_scored_with_the_runs_tokenizer_are_refused_when_the_config_is_read(
        corpus, student_tokenizers, tmp_path):
    """Before any process group, not at the first checkpoint evaluation; tiktoken and sentencepiece BPE pass."""
    from tests.trained_tokenizers import sentencepiece_model

    char_model = sentencepiece_model(tmp_path / "char", model_type="char", byte_fallback=False)
    tasks = ["eval.harness.tasks=[pydocs_cloze]", "checkpoint.eval.every=10"]
    for name, path in student_tokenizers.items():  # tiktoken, sentencepiece BPE
        overrides = base_overrides(corpus, tmp_path / name,
                                   **{"data.tokenizer.name": name, "data.tokenizer.path": path})
        parse_args(TrainArgs, overrides + tasks).validate(2)
    sp_char = base_overrides(corpus, tmp_path / "char_run", **{"data.tokenizer.name": "sp",
                                                               "data.tokenizer.path": char_model})
    parse_args(TrainArgs, sp_char).validate(2)  # no tasks: nothing to refuse
    with pytest.raises(UserError) as caught:
        parse_args(TrainArgs, sp_char + tasks).validate(2)
    assert str(caught.value) == (
        f"eval.harness.tasks are scored through the checkpoint's Hugging Face export, but the sentencepiece model "
        f"{char_model} is a 'char' model (only bpe and unigram models convert); train with a tokenizer that "
        f"converts (bytes, tiktoken, hf, a sentencepiece BPE model) or set eval.harness.tasks=[].")


def test_the_table_is_large_enough_and_names_the_issue_cases():
    names = {b.name for b in BAD_CONFIGS}
    assert len(names) == len(BAD_CONFIGS) >= 82
    assert {"negative_lr", "zero_batch", "activation_checkpointing", "model_dtype", "jsd_beta", "alpha_schedule",
            "teacher_dtype", "zero_teacher_ranks", "negative_timeout", "unknown_section_key", "string_for_int"} <= names
    # The torchrun launches (tests/dist/test_bad_config.py): a rule of validate(), one of the config parser, the
    # launch plan (it needs the world size torchrun gives), the teacher's directory (missing, and read), and Lingua's
    # student tensor parallelism (refused before any process group).
    assert {b.name for b in BAD_CONFIGS if b.launch} == {"negative_lr", "unknown_section_key", "mesh_vs_world_size",
                                                        "missing_teacher_dir", "seq_len_beyond_teacher", "tp_size"}


@pytest.mark.parametrize("extra, sentence", [
    ([], "cache_dir=''; pass cache_dir=<folder for the teacher cache>."),
    (["cache_dir=c", "streams=0"], "streams=0; use a positive integer."),
    (["cache_dir=c", "sequences_per_stream=-1"], "sequences_per_stream=-1; use 0 (the config's steps x "
                                                 "grad_acc_steps x data.batch_size) or a positive number of windows."),
    # The writer is the teacher, whatever the training config's source says: it needs the teacher's path.
    (["cache_dir=c", "distillation.source=cache", "distillation.teacher_path=null"],
     "distillation.teacher_path=null; distillation is on: point it at a transformers checkpoint directory, or set "
     "enable_distillation=false."),
])
def test_the_teacher_cache_writer_validates_the_trainers_config_and_its_own_keys(extra, sentence, corpus,
                                                                                 teacher_stub, tmp_path):
    from apps.main.teacher_cache import TeacherCacheArgs

    args = parse_args(TeacherCacheArgs, distill_overrides(corpus, teacher_stub, tmp_path) + extra)
    with pytest.raises(ValueError) as caught:
        args.validate(world_size=2)
    assert str(caught.value) == sentence
    # Every rank of the writer is a teacher: a launch of 2 is planned without teacher ranks.
    parse_args(TeacherCacheArgs, distill_overrides(corpus, teacher_stub, tmp_path) + ["cache_dir=c"]).validate(2)


@pytest.mark.parametrize("argv, sentence", [
    ([], "ckpt=''; pass ckpt=<a checkpoint step directory or the run's checkpoints/ directory>."),
    (["ckpt=x", "tasks=", "perplexity=false"], "perplexity=false; with no tasks there is nothing to evaluate: pass "
                                               "tasks=<comma list> or leave perplexity=true."),
    (["ckpt=x", "batch_size=0"], "batch_size=0; use a positive lm-eval batch size."),
    (["ckpt=x", "limit=0"], "limit=0; use a positive number of examples per task, or null for all."),
    (["ckpt=x", "num_fewshot=-1"], "num_fewshot=-1; use 0 or more examples, or null for each task's default."),
])
def test_checkpoint_eval_settings_are_one_sentence_before_the_checkpoint_is_read(argv, sentence):
    from apps.main.eval import CheckpointEvalArgs

    with pytest.raises(ValueError) as caught:
        parse_args(CheckpointEvalArgs, argv).validate()
    assert str(caught.value) == sentence
    parse_args(CheckpointEvalArgs, ["ckpt=x"]).validate()


def test_a_startup_diagnostic_phase_outside_range_is_a_readable_error(tmp_path):
    from apps.debug.startup import main as startup_main

    with pytest.raises(ValueError, match=r"^phase=6; not a startup phase; pass phase=1\.\.5: 1 = bare "):
        startup_main(["phase=6", f"dump_dir={tmp_path}"])


def test_launch_size_is_checked_only_when_given(corpus, tmp_path):
    args = parse_args(TrainArgs, base_overrides(corpus, tmp_path, **{"distributed.dp_shard": 4}))
    args.validate()  # no launch size: the mesh is checked by the launch (LaunchPlan) alone
    args.validate(4)
    with pytest.raises(ValueError, match="but there are 3 training ranks"):
        args.validate(3)


@pytest.mark.slow
@pytest.mark.parametrize("fails, code, sentence", [
    (True, 2, "error: optim.lr=-1; use a positive learning rate."),
    (False, 1, "error: the launcher stopped this rank (SIGTERM) before the job started: another rank failed first; "
               "its error is above and in its log"),
])
def test_a_launchers_sigterm_during_the_config_check_waits_for_this_ranks_own_sentence(fails, code, sentence):
    """torchrun SIGTERMs every rank once one exits: a rank still checking its config says its own sentence."""
    script = ("import os, signal\n"
              "from lingua.cli.entry import check_no_sigterm_held, hold_sigterm, run_cli\n"
              "from lingua.errors import ConfigError\n"
              "hold_sigterm()\n"
              "os.kill(os.getpid(), signal.SIGTERM)\n"
              "def main():\n"
              f"    if {fails}: raise ConfigError('optim.lr=-1; use a positive learning rate.')\n"
              "    check_no_sigterm_held()\n"
              "run_cli(main)\n")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                            cwd=Path(__file__).resolve().parents[4])
    assert (result.returncode, result.stderr) == (code, sentence + "\n")


# ---------------------------------------------------------------- a peer rank dies

class FakeTopo:
    """What RankStatus reads of a Topology; no process groups (so no collectives in its flight recorder)."""

    backend = "gloo"

    def __init__(self, rank: int, world_size: int = 3, hostname: str = "here"):
        self.global_rank, self.hostname = rank, hostname
        self.plan = LaunchPlan(world_size, world_size, (TeacherLayout(1),))
        self.world_size, self.role = world_size, self.plan.role(rank)

    def all_groups(self) -> list:
        return []

    def group_members(self) -> dict:
        return {}


def test_peer_loss_is_recognised_through_the_exception_chain():
    gloo = RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:8612. This is typically caused by ...")
    assert is_peer_loss(gloo)
    try:
        try:
            raise gloo
        except RuntimeError:
            raise ValueError("while cleaning up")
    except ValueError as err:
        assert is_peer_loss(err)
    assert not is_peer_loss(RuntimeError("injected failure on train rank 1 at step 3"))
    assert not is_peer_loss(ValueError("Connection closed by peer"))  # a user error quoting it is not one


def test_the_rank_that_recorded_a_failure_first_is_named(tmp_path):
    board = {rank: RankStatus(str(tmp_path), FakeTopo(rank)) for rank in range(3)}
    board[2].write("failed", "RuntimeError: first")
    board[1].write("failed", "RuntimeError: second")
    assert board[0].stopped_peer(wait_s=0) == 2
    board[2].write("lost_peer")  # a rank that only lost a peer is never the one named
    assert board[0].stopped_peer(wait_s=0) == 1
    # The rank that loses its peer raises the sentence instead of the backend's error.
    with pytest.raises(PeerStopped) as caught:
        with board[0]:
            raise RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:8612")
    assert str(caught.value) == f"rank 1 (student) stopped; its log is {tmp_path}/logs/rank_1.log"
    assert json.loads(board[0].run_dir.status(0).read_text())["state"] == "lost_peer"


def test_a_killed_rank_on_this_host_is_named_by_its_missing_process(tmp_path):
    board = {rank: RankStatus(str(tmp_path), FakeTopo(rank)) for rank in range(3)}
    gone = subprocess.Popen(["true"])
    gone.wait()
    record = json.loads(board[1].run_dir.status(1).read_text())
    record["pid"] = gone.pid  # rank 1 "ran" in a process that no longer exists and left no failure record
    board[1].run_dir.status(1).write_text(json.dumps(record))
    assert board[0].stopped_peer(wait_s=0) == 1
    # On another host a missing pid says nothing: no name, the caller falls back to "a peer rank".
    other = RankStatus(str(tmp_path), FakeTopo(0, hostname="elsewhere"))
    assert other.stopped_peer(wait_s=0.2) is None


def test_status_files_are_replaced_atomically_and_name_this_process(tmp_path):
    status = RankStatus(str(tmp_path), FakeTopo(2))
    record = json.loads(status.run_dir.status(2).read_text())
    assert record["pid"] == os.getpid() and record["role"] == "teacher" and record["state"] == "running"
    with pytest.raises(RuntimeError):
        with status:
            raise RuntimeError("boom")
    assert json.loads(status.run_dir.status(2).read_text())["error"] == "RuntimeError: boom"
    assert not list(status.run_dir.logs.glob("*.tmp"))


def test_a_dump_dir_that_is_a_file_is_one_sentence_and_the_file_is_left_alone(corpus, tmp_path):
    results = tmp_path / "results.txt"
    results.write_text("a week of numbers")
    for dump_dir in (results, results / "run"):
        args = parse_args(TrainArgs, base_overrides(corpus, dump_dir))
        with pytest.raises(ValueError) as caught:
            args.validate(2)
        assert str(caught.value) == (f"dump_dir='{dump_dir}'; {results} is a file, not a folder; point dump_dir at a "
                                     f"folder (it is created when missing).")
    assert results.read_text() == "a week of numbers"
