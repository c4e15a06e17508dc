"""The console: "brief" keeps rank 0's lines less the start-up detail, and every rank's warnings; the log file
keeps every line of its rank either way."""

import logging

import pytest

from lingua.logger import STARTUP_DETAIL, init_logger


@pytest.fixture(autouse=True)
def restore_logging():
    handlers = list(logging.getLogger().handlers)
    yield
    for handler in logging.getLogger().handlers:
        if handler not in handlers:
            logging.getLogger().removeHandler(handler)
            handler.close()


def log_some_lines() -> None:
    logging.getLogger("lingua.timing").info("startup phase model_build: 2.22s")
    logging.getLogger("train").info("startup phases (all ranks)\ntable", extra=STARTUP_DETAIL)
    logging.getLogger("train").info("step 1/30 loss 5.5")
    logging.getLogger("lingua.distributed").warning("a warning from the start-up")


@pytest.mark.parametrize("rank", [0, 1])
def test_the_brief_console_and_the_full_log(rank, capsys, tmp_path):
    log_file = tmp_path / f"rank_{rank}.log"
    init_logger(rank, "student", str(log_file), console="brief")
    log_some_lines()
    console = capsys.readouterr().out
    shown = ["step 1/30 loss 5.5", "a warning from the start-up"] if rank == 0 else ["a warning from the start-up"]
    assert [line.split(": ", 1)[1] for line in console.splitlines()] == shown, console
    assert all(f"[r{rank} student]" in line for line in console.splitlines())
    logged = log_file.read_text()
    for words in ("startup phase model_build", "startup phases (all ranks)", "step 1/30", "a warning"):
        assert words in logged, logged


def test_the_all_console_shows_every_line(capsys, tmp_path):
    init_logger(1, "teacher", str(tmp_path / "rank_1.log"), console="all")
    log_some_lines()
    assert capsys.readouterr().out.count("[r1 teacher]") == 4
