"""Routing check: students with different batch shapes each get exactly the teacher outputs of
their own tokens, through the wire dtype asked for -- one request at a time, then with two
micro-batches in flight (submit i+1 before waiting on i).
Run: torchrun --nproc-per-node 3 -m tests.dist.workers.routing <teacher_dir> <case> [<case> ...]
     a case: <topk|sampled|full>,<bf16|fp32>,<fp32|bf16>,<causal|doc_causal> (output, wire, teacher dtype, mask)
The cases run one after the other, each with a fresh teacher server and client on the same groups. Every
student compares with an fp32 forward of its own, so a bf16 teacher is checked against the fp32 one within
bf16 tolerance. With doc_causal the rows are packed documents: the teacher must answer as if each document
were its own sequence, so the reference runs one forward per document. A student whose check fails still
completes the case's requests and STOP, so the other cases run and report too."""

import sys
import time
from dataclasses import replace

import torch

from lingua.distillation.args import WIRE_DTYPES, DistillationArgs
from lingua.distributed import clean_up, setup_torch_distributed
from lingua.parallel.launch_plan import DistributedArgs, TeacherLayout
from lingua.distillation.teacher.model import load_teacher
from lingua.distillation.online.server import TeacherServer
from lingua.distillation.outputs import TeacherOutputs, sparsify_teacher_logits
from lingua.logger import init_logger
from tests.dist.workers import handshaken_client, run_worker, say

SHAPES = {0: (2, 9), 1: (3, 5)}  # uneven on purpose: rows and lengths differ per student
K = 5
# A bf16 teacher's log-probs differ from fp32 by a few 1e-3 on the tiny teacher; its top-k may swap near-ties.
BF16_TEACHER_ATOL = 2e-2


def reference_logits(reference, tokens: torch.Tensor, doc_ids) -> torch.Tensor:
    """The fp32 reference's logits; with document ids, one forward per document of each row."""
    with torch.inference_mode():
        if doc_ids is None:
            return reference(tokens).logits.float()
        rows = []
        for row, docs in zip(tokens, doc_ids):
            rows.append(torch.cat([reference(row[docs == d][None]).logits.float()[0] for d in docs.unique()]))
        return torch.stack(rows)


def random_documents(bsz: int, seqlen: int, generator) -> torch.Tensor:
    """[bsz, seqlen] document ids numbered from 0 in each row, documents of 1..seqlen tokens."""
    starts = torch.rand(bsz, seqlen, generator=generator) < 0.3
    starts[:, 0] = True
    return starts.int().cumsum(dim=1) - 1


def check(received: TeacherOutputs, tokens: torch.Tensor, reference, output: str, wire_dtype: torch.dtype,
          teacher_dtype: str, vocab: int, doc_ids=None) -> None:
    """`received` must be what the teacher computes for `tokens` (the reference is an fp32 local forward)."""
    tolerance = 1e-4 if wire_dtype == torch.float32 else 2e-2  # bf16 keeps 8 bits of mantissa
    logits = reference_logits(reference, tokens, doc_ids)[..., :vocab]
    expected = sparsify_teacher_logits(logits, output, K, 1.0, wire_dtype)
    for got, want in zip(received.tensors(), expected.tensors()):
        assert got.shape == want.shape, (got.shape, want.shape)
    assert received.tensors()[0].dtype == wire_dtype
    log_probs = torch.log_softmax(logits, dim=-1)
    if output == "sampled":
        # Draws are random; what was sent must be this row's log-probs at the drawn ids.
        values, ids, neg_entropy = received.tensors()
        assert int(ids.min()) >= 0 and int(ids.max()) < vocab
        torch.testing.assert_close(values.float(), log_probs.gather(-1, ids.long()), atol=tolerance, rtol=tolerance)
        torch.testing.assert_close(neg_entropy, expected.tensors()[2], atol=1e-4, rtol=1e-4)
        return
    if teacher_dtype == "bf16":
        assert output == "topk", "the bf16-teacher check is written for top-k outputs"
        values, ids, tail = received.tensors()
        # Near-tied ids may come in another order: the sent values must be the fp32 log-probs of the
        # sent ids, and every sent id must be within tolerance of the fp32 top-k.
        at_ids = log_probs.gather(-1, ids.long())
        torch.testing.assert_close(values.float(), at_ids, atol=BF16_TEACHER_ATOL + tolerance, rtol=0)
        kth = expected.values[..., -1:].float()
        assert bool((at_ids >= kth - BF16_TEACHER_ATOL).all()), (at_ids - kth).min()
        torch.testing.assert_close(tail, expected.extra, atol=1e-3, rtol=0)
        return
    for got, want in zip(received.tensors(), expected.tensors()):
        if got.dtype.is_floating_point:
            torch.testing.assert_close(got.float(), want.float(), atol=tolerance, rtol=tolerance)
        else:
            assert torch.equal(got.long(), want.long())


def run_case(teacher_dir: str, case: str, topo) -> None:
    """One case: serve it (teacher), or request and check it (student); prints the case's result lines."""
    output, wire, teacher_dtype, attn_mask = case.split(",")
    args = DistillationArgs(teacher_path=teacher_dir, output=output, k=K, wire_dtype=wire, teacher_dtype=teacher_dtype)
    wire_dtype = WIRE_DTYPES[wire]
    if topo.is_teacher:
        server = TeacherServer(args, topo, attn_mask=attn_mask)
        dtypes = {p.dtype for p in server.teacher.model.parameters()}
        say(f"{case} TEACHER PARAMS {sorted(str(d) for d in dtypes)}")
        start = time.perf_counter()
        server.serve()
        # Busy and idle seconds cover the whole loop: no request's work falls between the two clocks.
        elapsed, counted = time.perf_counter() - start, server.clock.busy_s + server.clock.idle_s
        clock = "OK" if abs(elapsed - counted) < 0.02 * elapsed + 0.01 else "FAILED"
        say(f"{case} TEACHER CLOCK {clock} busy {server.clock.busy_s:.3f}s idle {server.clock.idle_s:.3f}s of {elapsed:.3f}s")
        return
    reference, tokenizer = load_teacher(replace(args, teacher_dtype="fp32"), topo.device)
    vocab = len(tokenizer)
    client = handshaken_client(args, topo, tokenizer.get_vocab(), vocab, max_bsz=4, max_seqlen=12,
                               attn_mask=attn_mask)
    generator = torch.Generator().manual_seed(topo.train_rank)
    bsz, seqlen = SHAPES[topo.train_rank]
    failures = []

    def make_batch(rows: int, length: int):
        tokens = torch.randint(0, vocab, (rows, length), generator=generator)
        return tokens, random_documents(rows, length, generator) if attn_mask == "doc_causal" else None

    def checked(received, tokens, docs) -> None:
        try:
            check(received, tokens, reference, output, wire_dtype, teacher_dtype, vocab, docs)
        except AssertionError as err:  # noted; the requests go on so that the teacher reaches STOP
            failures.append(f"{type(err).__name__}: {err}")

    for step in range(3):
        tokens, docs = make_batch(bsz, seqlen + step)
        checked(client.submit(tokens, step=step, micro_step=0, doc_ids=docs).wait(), tokens, docs)
    # Two micro-batches in flight, of different shapes; waited in order, then in reverse order.
    for step, order in ((3, (0, 1)), (4, (1, 0))):
        batches = [make_batch(bsz - m, seqlen + 2 * m) for m in range(2)]
        handles = [client.submit(tokens, step=step, micro_step=m, doc_ids=docs)
                   for m, (tokens, docs) in enumerate(batches)]
        for m in order:
            tokens, docs = batches[m]
            checked(handles[m].wait(), tokens, docs)
    if client.response_flags()["teacher_error"]:  # every status of these requests must be ok
        failures.append("the teacher answered with an error")
    client.stop(step=5)
    result = f"FAILED {failures[0]}" if failures else "OK"
    say(f"{case} ROUTING {result} rank {topo.global_rank}")


def main(teacher_dir: str, cases: list[str]) -> None:
    topo = setup_torch_distributed(DistributedArgs(init_timeout_s=60), (TeacherLayout(1),))
    init_logger(topo.global_rank, topo.role)
    try:
        for case in cases:
            run_case(teacher_dir, case, topo)
    finally:
        clean_up()


if __name__ == "__main__":
    run_worker(main, sys.argv[1], sys.argv[2:])
