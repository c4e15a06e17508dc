"""Routing check: students with different batch shapes each get exactly the teacher outputs of
their own tokens, through the wire dtype asked for.
Run: torchrun --nproc-per-node 3 -m tests.dist.workers.routing <teacher_dir> <topk|sampled|full> <bf16|fp32>"""

import sys

import torch

from lingua.distillation import WIRE_DTYPES, DistillationArgs, TeacherClient, TeacherServer, load_teacher
from lingua.distributed import DistributedArgs, clean_up, setup_torch_distributed
from lingua.kd_loss import sparsify_teacher_logits
from lingua.logger import init_logger

SHAPES = {0: (2, 9), 1: (3, 5)}  # uneven on purpose: rows and lengths differ per student


def main(teacher_dir: str, output: str, wire: str) -> None:
    args = DistillationArgs(teacher_path=teacher_dir, output=output, k=5, wire_dtype=wire, teacher_dtype="fp32")
    wire_dtype = WIRE_DTYPES[wire]
    tolerance = 1e-4 if wire == "fp32" else 2e-2  # bf16 keeps 8 bits of mantissa
    topo = setup_torch_distributed(DistributedArgs(init_timeout_s=60), n_teachers=1)
    init_logger(topo.global_rank, topo.role)
    try:
        if topo.is_teacher:
            TeacherServer(args, topo).serve()
            return
        model, tokenizer = load_teacher(args, topo.device)
        client = TeacherClient(args, topo, tokenizer.get_vocab(), len(tokenizer), max_bsz=4, max_seqlen=12)
        generator = torch.Generator().manual_seed(topo.train_rank)
        for step in range(3):
            bsz, seqlen = SHAPES[topo.train_rank]
            tokens = torch.randint(0, len(tokenizer), (bsz, seqlen + step), generator=generator)
            received = client.submit(tokens, step=step, micro_step=0).wait()
            with torch.inference_mode():
                logits = model(tokens).logits.float()[..., : len(tokenizer)]
            expected = sparsify_teacher_logits(logits, output, 5, 1.0, wire_dtype)
            for got, want in zip(received.tensors(), expected.tensors()):
                assert got.shape == want.shape, (got.shape, want.shape)
            assert received.tensors()[0].dtype == wire_dtype
            if output == "sampled":
                # Draws are random; what was sent must be this row's log-probs at the drawn ids.
                values, ids, neg_entropy = received.tensors()
                assert int(ids.min()) >= 0 and int(ids.max()) < len(tokenizer)
                log_probs = torch.log_softmax(logits, dim=-1)
                torch.testing.assert_close(values.float(), log_probs.gather(-1, ids.long()), atol=tolerance, rtol=tolerance)
                torch.testing.assert_close(neg_entropy, expected.tensors()[2], atol=1e-4, rtol=1e-4)
                continue
            for got, want in zip(received.tensors(), expected.tensors()):
                if got.dtype.is_floating_point:
                    torch.testing.assert_close(got.float(), want.float(), atol=tolerance, rtol=tolerance)
                else:
                    assert torch.equal(got.long(), want.long())
        client.stop(step=3)
        print(f"ROUTING OK rank {topo.global_rank}", flush=True)
    finally:
        clean_up()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3])
