"""Programs that torchrun starts in the multi-process tests (`python -m tests.dist.workers.<name>`)."""
import sys


def say(line: str) -> None:
    """Print one line for the test to read, in one write: the ranks share torchrun's pipe, and print()'s
    separate newline lets two ranks' lines run together."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()
