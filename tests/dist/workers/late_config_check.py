"""The trainer's entry point with one rank that starts its config check only after torchrun has SIGTERMed it.

torchrun stops every rank as soon as one exits. Here the other ranks reject the config and exit 2 first, while
rank LATE holds SIGTERM (from its first line, as `python -m apps.main.train` does) and waits for torchrun's
signal; only then does it import and run the trainer. It must still fail on the config itself (exit 2, its
error file pointing to the rank that said the sentence), not as a rank the launcher stopped.

Run: torchrun --nproc-per-node N -m tests.dist.workers.late_config_check <LATE> <training overrides...>
"""

import os
import sys
import time

from lingua.cli import entry as cli
from tests.dist.workers import say

WAIT_S = 60  # no signal by then: the rank goes on and says so, and the test fails on that line

if __name__ == "__main__":
    cli.hold_sigterm()
    late_rank, overrides = int(sys.argv[1]), sys.argv[2:]
    # torchrun's own variable: before the config check there is no Topology to ask.
    if int(os.environ["RANK"]) == late_rank:
        deadline = time.monotonic() + WAIT_S
        while not cli._held_signals and time.monotonic() < deadline:
            time.sleep(0.05)
        held = "SIGTERM held" if cli._held_signals else "no SIGTERM"
        say(f"rank {late_rank}: {held} before its config check")
    from apps.main.train import main

    cli.run_cli(lambda: main(overrides))
