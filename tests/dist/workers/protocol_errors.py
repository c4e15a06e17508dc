"""Protocol errors between 2 students and 1 teacher end in a sentence on every rank, never a hang.

Run: torchrun --nproc-per-node 3 -m tests.dist.workers.protocol_errors <teacher_dir> <mode> [<mode> ...]
  settings:    the teacher serves k=5, bf16, T=1; the students ask for k=6, fp32, T=2 -> the handshake
               fails everywhere, naming each value on both sides
  headers:     the students announce different steps -> the teacher's header check names both ranks
  token_range: a student's token id beyond the vocab travels as a header flag (no host check): the
               teacher refuses the request before any forward and every rank raises its sentence
  serve_failure: the teacher fails outside its forward (out of memory while handling the request): it
               still answers, and every rank raises the teacher's sentence instead of waiting
  k_beyond_vocab: every rank asks for top-100000 of a 512-token vocabulary -> refused at the handshake, in
               one sentence on every rank, before any buffer sized by k exists
The modes run one after the other in one launch, each with a fresh teacher server and client on the same
groups: an error that every rank hears leaves no collective behind, so the next mode starts clean. Each
rank prints "FAILED <mode> rank <r>: <error>" or "<MODE> OK rank <r>" per mode and exits 0, so the test reads
every rank's words.
"""

import sys

import torch

from lingua.distillation.args import DistillationArgs
from lingua.distributed import clean_up, setup_torch_distributed
from lingua.parallel.launch_plan import DistributedArgs, TeacherLayout
from lingua.distillation.teacher.model import load_teacher
from lingua.distillation.online.distiller import first_error
from lingua.distillation.online.server import TeacherServer
from lingua.errors import PeerStopped, TeacherError
from lingua.logger import init_logger
from tests.dist.workers import handshaken_client, run_worker, say


def run_mode(teacher_dir: str, mode: str, topo) -> None:
    args = DistillationArgs(teacher_path=teacher_dir, k=5, teacher_dtype="fp32")
    if mode == "settings" and topo.is_student:
        args = DistillationArgs(teacher_path=teacher_dir, k=6, wire_dtype="fp32", temperature=2.0, teacher_dtype="fp32")
    if mode == "k_beyond_vocab":
        args = DistillationArgs(teacher_path=teacher_dir, k=100000, teacher_dtype="fp32")
    if topo.is_teacher:
        server = TeacherServer(args, topo)
        if mode == "serve_failure":
            def out_of_memory(*_):
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.50 GiB (injected)")
            server._check_headers = out_of_memory
        server.serve()
        return
    _, tokenizer = load_teacher(args, topo.device)
    client = handshaken_client(args, topo, tokenizer.get_vocab(), len(tokenizer), max_bsz=2, max_seqlen=8)
    tokens = torch.randint(0, len(tokenizer), (2, 8), generator=torch.Generator().manual_seed(topo.train_rank))
    if mode == "headers":
        client.submit(tokens, step=1 + topo.train_rank, micro_step=0).wait()
    elif mode == "token_range":
        if topo.train_rank == 0:
            tokens[1, 2] = len(tokenizer)
        client.submit(tokens, step=1, micro_step=0).wait()
    elif mode == "serve_failure":
        client.submit(tokens, step=1, micro_step=0).wait()
    # The step's agreed point, as the trainer has it: statuses are read here, not per micro-batch. The error is
    # agreed, so the teacher hears ERROR before it is raised (the trainer's `Distiller.session`).
    if client.response_flags()["teacher_error"]:
        client.stop(step=1, error=True)
        raise first_error([client], "error")[1]
    client.stop(step=2)



def main(teacher_dir: str, modes: list[str]) -> None:
    topo = setup_torch_distributed(DistributedArgs(init_timeout_s=60), (TeacherLayout(1),))
    init_logger(topo.global_rank, topo.role)
    try:
        for mode in modes:
            try:
                run_mode(teacher_dir, mode, topo)
                say(f"{mode.upper()} OK rank {topo.global_rank}")
            except Exception as err:  # the test reads each rank's sentence
                # The students' teacher errors are the agreed kinds; the family is what the words name.
                name = next((kind.__name__ for kind in (TeacherError, PeerStopped) if isinstance(err, kind)),
                            type(err).__name__)
                say(f"FAILED {mode} rank {topo.global_rank}: {name}: {err}")
    finally:
        clean_up()


if __name__ == "__main__":
    run_worker(main, sys.argv[1], sys.argv[2:])
