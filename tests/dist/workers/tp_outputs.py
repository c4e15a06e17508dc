"""A teacher sharded over 2 ranks (tensor-parallel, vocabulary-parallel head) gives the outputs of the same
teacher on one rank (a cross-tokenizer replica's targets too), and none of its collectives runs on the default group.
Run: torchrun --nproc-per-node 3 -m tests.dist.workers.tp_outputs <teacher_dir> <out.json>

Rank 0 only stands by (a collective on the world would wait for it: a hang, caught by the launch limit);
ranks 1-2 form the replica's group and each also loads the whole teacher for the reference. Every collective
of the sharded load, forward, outputs and cross-entropy is recorded with its group (a dispatch mode sees
DTensor's functional collectives and the c10d ones alike). Rank 1 writes the differences to <out.json>.
"""

import json
import sys
from datetime import timedelta
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from lingua.distillation.args import DistillationArgs
from lingua.distillation.online.bridge import BridgeSpec
from lingua.distillation.online.client import TeacherClient
from lingua.distillation.cross_tokenizer.teacher_side import load_cross_tokenizer
from lingua.distillation.outputs import sparsify_teacher_logits
from lingua.distillation.online.replica import ReplicaLink
from lingua.distillation.online.server import TeacherServer
from lingua.distillation.teacher.model import TeacherModel
from lingua.distillation.teacher.tensor_parallel import VocabShard
from lingua.distillation.teacher.vocab_parallel import sample_ids, vocab_parallel_cross_entropy, vocab_parallel_outputs
from lingua.tokenizer import TokenizerArgs
from tests.dist.workers import run_worker, say

K = 8


class CollectiveGroups(TorchDispatchMode):
    """The group name of every collective dispatched while active."""

    def __init__(self):
        super().__init__()
        self.groups: list[tuple[str, str]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if "c10d" in func.namespace and "wrap_tensor" not in str(func):
            if func.namespace == "_c10d_functional":  # DTensor's: the group by name
                names = [a for a in args if isinstance(a, str) and a not in ("sum", "avg", "max", "min")]
            else:  # torch.distributed's: the group as a script object, next to the reduce op's
                names = [group_of(a) for a in args if isinstance(a, torch.ScriptObject) and group_of(a)]
            self.groups.append((str(func), names[0] if names else "?"))
        return func(*args, **(kwargs or {}))


def group_of(script_object) -> str:
    """The name of the process group a c10d op's script object is, or "" for another one (its ReduceOp)."""
    try:
        return dist.ProcessGroup.unbox(script_object).group_name
    except RuntimeError:
        return ""


def documents(bsz: int, seqlen: int, generator) -> torch.Tensor:
    starts = torch.rand(bsz, seqlen, generator=generator) < 0.3
    starts[:, 0] = True
    return starts.int().cumsum(dim=1) - 1


def compare(a, b) -> dict:
    """Largest differences of two TeacherOutputs of the same format."""
    out = {"values": float((a.values.float() - b.values.float()).abs().max())}
    if a.ids is not None:
        out["ids_equal"] = bool(torch.equal(a.ids, b.ids))
        out["ids_agree"] = float((a.ids == b.ids).float().mean())
        out["extra"] = float((a.extra - b.extra).abs().max())
    return out


class NoAlignment:
    """A follower's aligner: it must never align (the replica's first rank sends it the teacher's tokens)."""

    def __init__(self, cross):
        self.cross = cross

    def teacher_batch(self, *args):
        raise AssertionError("a follower of the replica aligned the students' text itself")

    def student_targets(self, *args, **kwargs):
        return self.cross.student_targets(*args, **kwargs)


def cross_tokenizer_case(rank: int, group, sharded: TeacherModel, whole: TeacherModel, teacher_dir: str,
                         recorder) -> dict:
    """A byte-tokenizer student's request through the replica's `_cross_forward_rows` (the leader aligns and
    broadcasts the teacher's tokens; the follower only joins the forward) against one whole teacher's targets."""
    args = DistillationArgs(teacher_path=teacher_dir, cross_tokenizer=True, k=K, teacher_tp=2, n_teacher_ranks=2,
                            teacher_dtype="fp32", logits_chunk_rows=2)
    spec = BridgeSpec(2, 20, 258, "topk", K, torch.float32, doc_boundaries=True, kd_weight=True)
    cross = load_cross_tokenizer(TokenizerArgs("bytes"), None, whole.tokenizer, None)
    text = list("A teacher of another tokenizer reads this.".encode())
    tokens, doc_ids = torch.tensor([text[:20], text[20:40]]), torch.zeros(2, 20, dtype=torch.int32)
    next_tokens = torch.tensor([text[20], text[40]])
    topo = SimpleNamespace(teacher_tp_group=group, replica_ranks=[1, 2], device=torch.device("cpu"))
    server = SimpleNamespace(cross=cross if rank == 1 else NoAlignment(cross), teacher=sharded, spec=spec,
                             args=args, leader=rank == 1, link=ReplicaLink(topo, spec, 1), bridge_ranks=[0, 1],
                             nan_flags={}, generator=torch.Generator().manual_seed(0),
                             responses=[torch.zeros(spec.response_bytes(), dtype=torch.uint8) for _ in range(2)])
    server._write = lambda student, outputs: TeacherServer._write(server, student, outputs)
    with recorder:
        TeacherServer._cross_forward_rows(server, [(0, None)], {0: SimpleNamespace(bsz=2, seqlen=20)}, tokens,
                                          doc_ids, next_tokens)
    if rank != 1:
        return {}
    got = TeacherClient.payload(SimpleNamespace(spec=spec), server.responses[0], 2, 20)
    batch = cross.teacher_batch(tokens, doc_ids, next_tokens)
    want = cross.student_targets(whole, whole.hidden_states(batch.tokens, batch.doc_ids), batch, "topk", K,
                                 torch.float32)
    finite = want.values.isfinite()  # a row's slots past its mapped ids hold -inf on both sides
    return {"cross_tokenizer": {**compare(got, want), "aligned": float(want.kd_weight.mean()),
                                "values": float((got.values - want.values)[finite].abs().max()),
                                "same_finite": bool(torch.equal(got.values.isfinite(), finite)),
                                "kd_weight_equal": bool(torch.equal(got.kd_weight, want.kd_weight))}}


def main() -> None:
    teacher_dir, out_path = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    group = dist.new_group([1, 2], group_desc="teacher_tp_0")
    if rank == 0:
        dist.barrier(group=dist.group.WORLD)
        dist.destroy_process_group()
        return
    args = DistillationArgs(teacher_path=teacher_dir, teacher_dtype="fp32", logits_chunk_rows=2)
    recorder = CollectiveGroups()
    with recorder:
        sharded = TeacherModel(args, torch.device("cpu"), tp_group=group)
    whole = TeacherModel(args, torch.device("cpu"))
    assert sharded.vocab_size == whole.vocab_size == 512, (sharded.vocab_size, whole.vocab_size)
    results: dict = {"rank": rank, "shard": [sharded.shard.start, sharded.shard.end]}
    generator = torch.Generator().manual_seed(0)
    # No <pad> (id 0, a zero embedding): a row starting with it has all logits equal, and tied logits may be
    # taken in another order by the merged top-k than by one topk over the whole vocabulary.
    tokens = torch.randint(3, 512, (3, 24), generator=generator)
    doc_ids = documents(3, 24, generator)
    with recorder:
        hidden = sharded.hidden_states(tokens)
        hidden_docs = sharded.hidden_states(tokens, doc_ids)
    results["hidden"] = float((hidden - whole.hidden_states(tokens)).abs().max())
    results["hidden_doc_causal"] = float((hidden_docs - whole.hidden_states(tokens, doc_ids)).abs().max())
    reference_hidden = whole.hidden_states(tokens)
    # The students' vocabulary cut: the whole teacher, inside the second slice, inside the first.
    for vocab in (512, 300, 200):
        for output, wire in (("topk", torch.float32), ("full", torch.float32), ("topk", torch.bfloat16)):
            with recorder:
                got = sharded.sparse_outputs(hidden, output, K, wire, vocab)
            want = whole.sparse_outputs(reference_hidden, output, K, wire, vocab)
            if rank == 1:
                assert got.values.shape == want.values.shape, (got.values.shape, want.values.shape)
                results[f"{output}_{str(wire)[6:]}_{vocab}"] = compare(got, want)
            else:
                assert got is None
        # Sampled through the model: the vocabulary-parallel sampler at teacher_tp=2 against the same uniforms
        # drawn over the whole vocabulary of the whole teacher's logits.
        with recorder:
            got = sharded.sparse_outputs(hidden, "sampled", K, torch.float32, vocab, torch.Generator().manual_seed(7))
        if rank == 1:
            z = whole.logits(reference_hidden)[..., :vocab].reshape(-1, vocab)
            lse = z.double().logsumexp(-1)
            uniforms = torch.rand((z.shape[0], K), generator=torch.Generator().manual_seed(7), dtype=torch.float64)
            _, ids, log_probs, neg_entropy = sample_ids(z, lse[None], 0, 0, vocab, uniforms)
            results[f"sampled_model_{vocab}"] = {
                "ids_agree": float((got.ids.reshape(-1, K) == ids).float().mean()),
                "values": float((got.values.reshape(-1, K).double() - log_probs).abs()[got.ids.reshape(-1, K) == ids]
                                .max()),
                "extra": float((got.extra.reshape(-1).double() - neg_entropy).abs().max())}
    # The sampler alone, on identical logits (the whole vocabulary's, sliced): the same draw for the same seed.
    shard = sharded.shard
    logits = torch.randn(2, 5, 501, generator=torch.Generator().manual_seed(3)) * 3
    uneven = VocabShard(group, shard.tp_rank, 2, 501, *((0, 251) if shard.tp_rank == 0 else (251, 501)))
    for vocab in (501, 400):
        with recorder:
            got = vocab_parallel_outputs(logits[..., uneven.start:uneven.end], uneven, "sampled", 64, 1.3,
                                         torch.float32, vocab, torch.Generator().manual_seed(11))
            topk = vocab_parallel_outputs(logits[..., uneven.start:uneven.end], uneven, "topk", 64, 1.3,
                                          torch.float32, vocab)
        if rank == 1:
            z = (logits[..., :vocab] / 1.3).reshape(-1, vocab)
            uniforms = torch.rand((10, 64), generator=torch.Generator().manual_seed(11), dtype=torch.float64)
            _, ids, log_probs, neg_entropy = sample_ids(z, z.double().logsumexp(-1)[None], 0, 0, vocab, uniforms)
            results[f"sampler_uneven_{vocab}"] = {
                "ids_equal": bool(torch.equal(got.ids.reshape(-1, 64).long(), ids)),
                "values": float((got.values.reshape(-1, 64).double() - log_probs).abs().max()),
                "extra": float((got.extra.reshape(-1).double() - neg_entropy).abs().max())}
            results[f"topk_uneven_{vocab}"] = compare(
                topk, sparsify_teacher_logits(logits[..., :vocab], "topk", 64, 1.3, torch.float32))
    results.update(cross_tokenizer_case(rank, group, sharded, whole, teacher_dir, recorder))
    # The teacher's held-out reference: cross-entropy over the students' vocabulary.
    labels = torch.randint(0, 300, (24,), generator=torch.Generator().manual_seed(5))
    labels[:3] = -100
    with recorder:
        ce = vocab_parallel_cross_entropy(sharded.logits(hidden[0]), labels, sharded.shard, 300)
    want = torch.nn.functional.cross_entropy(whole.logits(reference_hidden[0])[:, :300], labels, ignore_index=-100,
                                             reduction="sum")
    results["cross_entropy"] = [float(ce), float(want)]
    results["collective_groups"] = sorted({name for _, name in recorder.groups})
    results["collectives"] = len(recorder.groups)
    results["tp_group_name"] = group.group_name
    results["world_group_name"] = dist.group.WORLD.group_name
    if rank == 1:
        with open(out_path, "w") as f:
            json.dump(results, f, indent=1)
    say(f"TP OUTPUTS DONE rank {rank}: {len(recorder.groups)} collectives on {results['collective_groups']}")
    dist.barrier(group=dist.group.WORLD)
    dist.destroy_process_group()


if __name__ == "__main__":
    run_worker(main)
