"""The command line of every entry point: `key=value` overrides, `--help`, and one sentence for a user's mistake.

    entry.py    run_cli: entry points where: a user's mistake ends in one sentence, a bug in its traceback
    help.py     `--help` for the key=value entry points: every key of a config dataclass, its default and one line
    words.py    how a config value and a config type read to a user (shared by the parser's errors and `--help`)
"""
