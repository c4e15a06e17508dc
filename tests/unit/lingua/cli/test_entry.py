"""run_cli: a user's error is one sentence and exit 2, a lost peer its sentence and exit 1, anything else a bug
with its traceback (stderr, the rank's log, torchrun's error file) and exit 1."""

import json
import logging
import re
import signal
import sys

import pytest

from lingua.cli.entry import run_cli
from lingua.errors import ConfigError, DataError, LaunchError, MissingPathError, PeerStopped, TeacherError, UserError
from lingua.logger import init_logger

FAMILY = [(ConfigError, ValueError), (LaunchError, ValueError), (MissingPathError, FileNotFoundError),
          (DataError, ValueError), (TeacherError, RuntimeError)]


@pytest.fixture(autouse=True)
def restore_sigterm_and_logging():
    """run_cli ignores SIGTERM on its way out and init_logger adds root handlers: neither may outlive a test."""
    sigterm = signal.getsignal(signal.SIGTERM)
    handlers = list(logging.getLogger().handlers)
    yield
    signal.signal(signal.SIGTERM, sigterm)
    for handler in logging.getLogger().handlers:
        if handler not in handlers:
            logging.getLogger().removeHandler(handler)
            handler.close()


def exit_code_of(main) -> int:
    with pytest.raises(SystemExit) as exit_info:
        run_cli(main)
    return exit_info.value.code


def parse_layer(text: str) -> tuple[int, int]:
    """A helper two calls deep whose unpacking is wrong: the bug the tests below plant."""
    learning_rate, warmup = text.split(",")
    return int(learning_rate), int(warmup)


def train_step(spec: str) -> None:
    parse_layer(spec)


@pytest.mark.parametrize("error, builtin", FAMILY, ids=[e.__name__ for e, _ in FAMILY])
def test_a_user_error_is_one_sentence_and_exit_2(error, builtin, capsys, monkeypatch, tmp_path):
    error_file = tmp_path / "attempt_0" / "0" / "error.json"  # torchrun's layout: one folder per local rank
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))

    def main():
        raise error("optim.lr=-1; use a positive\nlearning rate.")

    assert issubclass(error, (UserError, builtin))  # existing `except ValueError` and the like still catch it
    assert exit_code_of(main) == 2
    out, err = capsys.readouterr()
    assert (out, err) == ("", "error: optim.lr=-1; use a positive learning rate.\n")
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN  # torchrun's SIGTERM cannot turn 2 into -15
    # torchrun's failure report shows the sentence (its error file's message), no traceback.
    recorded = json.loads(error_file.read_text())["message"]
    assert recorded["message"] == "optim.lr=-1; use a positive learning rate." and "py_callstack" not in recorded[
        "extraInfo"]


def test_ranks_failing_alike_under_torchrun_say_it_once_and_the_report_names_the_first(capsys, monkeypatch, tmp_path):
    """Three local ranks of one torchrun attempt fail their config check alike: the first prints the sentence and
    is the report's root cause (earliest); the others print nothing and point to it."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    attempt = tmp_path / "run_id" / "attempt_0"
    for local_rank in (2, 0, 1):  # rank 2 fails first
        (attempt / str(local_rank)).mkdir(parents=True)
        monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(attempt / str(local_rank) / "error.json"))
        assert exit_code_of(lambda: (_ for _ in ()).throw(ConfigError("steps=0; train for at least one step."))) == 2
    assert capsys.readouterr().err == "error: steps=0; train for at least one step.\n"
    failures = {r: ProcessFailure(r, 100 + r, 2, str(attempt / str(r) / "error.json")) for r in (0, 1, 2)}
    assert failures[2].message["message"] == "steps=0; train for at least one step."
    assert [failures[r].message["message"] for r in (0, 1)] == ["the same error as local rank 2"] * 2
    assert min(failures.values(), key=lambda f: f.timestamp) is failures[2]  # torchrun's root cause


def test_a_plain_value_error_from_deep_inside_is_a_bug_with_its_traceback(capsys, monkeypatch, tmp_path):
    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    def main():
        train_step("0.001,10,extra")

    assert exit_code_of(main) == 1
    err = capsys.readouterr().err
    assert err.startswith("Traceback (most recent call last):\n") and "error: " not in err
    assert err.rstrip().endswith("ValueError: too many values to unpack (expected 2)")
    # Every frame down to the bug, with file and line.
    frames = re.findall(r'File "([^"]+)", line (\d+), in (\w+)', err)
    assert [name for _, _, name in frames] == ["run_cli", "main", "train_step", "parse_layer"], frames
    assert frames[-1][0] == __file__
    # torchrun's summary reads the error file `record` writes: the same traceback.
    recorded = json.loads(error_file.read_text())["message"]
    assert recorded["message"] == "ValueError: too many values to unpack (expected 2)"
    assert "in parse_layer" in recorded["extraInfo"]["py_callstack"]


def test_a_bugs_traceback_goes_to_the_rank_log_and_not_again_to_stdout(capsys, monkeypatch, tmp_path):
    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE", raising=False)
    log_file = tmp_path / "logs" / "rank_1.log"
    init_logger(1, "student", str(log_file))
    logging.getLogger("train").info("step 3")
    assert exit_code_of(lambda: train_step("1,2,3")) == 1
    out, err = capsys.readouterr()
    assert "step 3" in out and "Traceback" not in out
    assert "Traceback" in err
    log = log_file.read_text()
    assert "[r1 student] INFO  train: step 3" in log
    assert "[r1 student] ERROR lingua.cli.entry: stopped on this error" in log
    assert re.search(rf'File "{re.escape(__file__)}", line \d+, in parse_layer', log), log
    assert log.rstrip().endswith("ValueError: too many values to unpack (expected 2)")


def test_a_peer_that_stopped_first_is_its_sentence_and_exit_1(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "error.json"))

    def main():
        raise PeerStopped("rank 1 (student) stopped; its log is dump/logs/rank_1.log")

    assert exit_code_of(main) == 1
    assert capsys.readouterr().err == "error: rank 1 (student) stopped; its log is dump/logs/rank_1.log\n"
    recorded = json.loads((tmp_path / "error.json").read_text())["message"]
    assert recorded["message"] == "rank 1 (student) stopped; its log is dump/logs/rank_1.log"


def test_an_exit_or_an_interrupt_passes_through(capsys):
    assert exit_code_of(lambda: sys.exit(0)) == 0

    def interrupted():
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_cli(interrupted)
    assert capsys.readouterr().err == ""
