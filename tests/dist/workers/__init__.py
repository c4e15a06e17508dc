"""Programs that torchrun starts in the multi-process tests (`python -m tests.dist.workers.<name>`)."""
import sys

from lingua.cli.entry import end_without_cycle_collections


def say(line: str) -> None:
    """Print one line for the test to read, in one write: the ranks share torchrun's pipe, and print()'s
    separate newline lets two ranks' lines run together."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def handshaken_client(args, topo, vocab: dict, n_words: int, max_bsz: int, max_seqlen: int,
                      attn_mask: str = "causal"):
    """A student's TeacherClient after its own bridge's handshake (the trainer handshakes every bridge at once:
    `handshake_clients`), for the workers that drive one bridge by hand."""
    from lingua.distillation.online.bridge import agreed_handshake
    from lingua.distillation.online.client import TeacherClient, student_record

    spec = agreed_handshake(topo, student_record(args, topo, vocab, n_words, max_bsz, max_seqlen, attn_mask), args)
    return TeacherClient(args, topo, vocab, n_words, max_bsz, max_seqlen, attn_mask, spec=spec)


def run_worker(main, *args) -> None:
    """A worker's `if __name__ == "__main__":`: `main(*args)`; when it returns, what is alive is frozen out of the
    cycle collector before the interpreter's teardown (as every entry point's `run_cli` does; an exception
    leaves with its usual timing)."""
    main(*args)
    end_without_cycle_collections()
