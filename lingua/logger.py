"""Logging: one line per event, prefixed with the global rank and its role.

    2026-11-22 10:00:01 [r0 student] INFO  lingua.checkpoint: saved step 100 in 1.2s

A record logged with `extra=FILE_ONLY` goes to the rank's log file alone (a traceback already on stderr).

The console (`logging.console`): "brief" shows rank 0's lines less the start-up detail, and every rank's warnings
and errors, so the first step is on the first screen; "all" shows every line of every rank. The rank's log file
(`logs/rank_<r>.log`) always holds every line, and the start-up timings are in `startup.<r>.jsonl` too.
"""

import logging
import sys
import time
from pathlib import Path
from typing import Optional


FILE_ONLY = {"file_only": True}  # `extra=` of a record meant for the log file, not the console


CONSOLES = ("brief", "all")
STARTUP_DETAIL = {"startup_detail": True}  # `extra=` of a line the brief console leaves to the log file
# Loggers whose INFO lines are start-up detail (phase timings, rank maps, timeouts set, data shards, producers).
DETAIL_LOGGERS = ("lingua.timing", "lingua.distributed", "lingua.parallel.timeouts", "lingua.loading.producer",
                  "lingua.data")


def _not_file_only(record: logging.LogRecord) -> bool:
    return not getattr(record, "file_only", False)


class _BriefConsole(logging.Filter):
    """The brief console: every warning and error; rank 0's other lines unless they are start-up detail."""

    def __init__(self, rank: int):
        super().__init__()
        self.rank = rank

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.WARNING:
            return True
        detail = getattr(record, "startup_detail", False) or record.name.startswith(DETAIL_LOGGERS)
        return self.rank == 0 and not detail


class _RankFormatter(logging.Formatter):
    def __init__(self, rank: int, role: str):
        super().__init__()
        self.prefix = f"[r{rank} {role}]"

    def format(self, record: logging.LogRecord) -> str:
        stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(record.created))
        message = record.getMessage()
        if record.exc_info:
            message = f"{message}\n{self.formatException(record.exc_info)}"
        return f"{stamp} {self.prefix} {record.levelname:<5} {record.name}: {message}"


def init_logger(rank: int = 0, role: str = "student", log_file: Optional[str] = None, level: str = "INFO",
                console: str = "all") -> None:
    """Send log records to stdout (`console`: "all", or "brief") and every one to `log_file`, with the rank/role
    prefix; idempotent."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        if getattr(handler, "_lingua", False):
            root.removeHandler(handler)
    formatter = _RankFormatter(rank, role)
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stdout)]
    if log_file is not None:
        Path(log_file).parent.mkdir(parents=True, exist_ok=True)
        handlers.append(logging.FileHandler(log_file))
    handlers[0].addFilter(_not_file_only)
    if console == "brief":
        handlers[0].addFilter(_BriefConsole(rank))
    for handler in handlers:
        handler.setFormatter(formatter)
        handler._lingua = True  # type: ignore[attr-defined]
        root.addHandler(handler)
    root.setLevel(level)
    # Libraries that are chatty at INFO stay at WARNING.
    for name in ("urllib3", "filelock", "matplotlib", "PIL", "httpx"):
        logging.getLogger(name).setLevel(logging.WARNING)


def rank_log_file() -> Optional[str]:
    """The log file `init_logger` opened for this rank, or None (not initialised, or no file)."""
    for handler in logging.getLogger().handlers:
        if getattr(handler, "_lingua", False) and isinstance(handler, logging.FileHandler):
            return handler.baseFilename
    return None
