"""Tensor-parallel teachers without processes: the launch plan's replicas, the vocabulary slices, the head-count
check, the plan handed to torch, the sampler's distribution and the status words a replica shares."""

import math

import pytest
import torch

from lingua.distillation.online.bridge import RECORD_BYTES, ResponseStatus
from lingua.distillation.online.replica import ReplicaLink
from lingua.distillation.teacher.tensor_parallel import heads_problem, shard_bounds, tensor_parallel_plan
from lingua.distillation.teacher.vocab_parallel import sample_ids
from lingua.parallel.launch_plan import LaunchPlan, TeacherLayout


def test_replicas_of_the_last_ranks_each_serve_a_block_of_students():
    plan = LaunchPlan(8, 8, (TeacherLayout(4, 2),))
    assert plan.teacher_ranks == [4, 5, 6, 7] and plan.student_ranks == [0, 1, 2, 3]
    assert plan.replicas() == [([4, 5], [0, 1]), ([6, 7], [2, 3])]
    assert plan.bridges() == [(4, [0, 1]), (6, [2, 3])]  # the replica's first rank is on the bridge
    assert [plan.bridge_index(r) for r in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]
    assert plan.describe()[2:] == [
        "  teacher replica 0: global ranks 4-5 (node 0, local ranks 4-5), tensor-parallel over 2, serving students 0-1",
        "  teacher replica 1: global ranks 6-7 (node 0, local ranks 6-7), tensor-parallel over 2, serving students 2-3",
        "  students: global ranks 0-3"]
    # teacher_tp=1 is the plan it always was: one replica per teacher rank.
    assert LaunchPlan(8, 4, (TeacherLayout(2),), teacher_placement="per_node").replicas() == [([3], [0, 1, 2]),
                                                                                        ([7], [4, 5, 6])]


def test_per_node_puts_one_replica_at_the_end_of_each_node():
    plan = LaunchPlan(8, 4, (TeacherLayout(4, 2),), teacher_placement="per_node")
    assert plan.replicas() == [([2, 3], [0, 1]), ([6, 7], [4, 5])]
    assert plan.mesh_grid() == [[0, 1, 4, 5]]


@pytest.mark.parametrize("world, local, n_teachers, placement, message", [
    (8, 8, 3, "last", r"distillation.n_teacher_ranks=3 cannot be split into teacher replicas of "
                      r"distillation.teacher_tp=2 ranks; use a multiple of 2 \(e.g. "
                      r"distillation.n_teacher_ranks=2\)\."),
    (6, 3, 4, "last", r"The teacher replica of global ranks 2-3 \(distillation.teacher_tp=2\) would span nodes 0 and "
                      r"1 \(3 tasks per node\); a replica must stay on one node"),
    (8, 4, 2, "per_node", r"teacher_placement=per_node needs one teacher replica of distillation.teacher_tp=2 ranks "
                          r"per node \(2 nodes x 2 = 4 teacher ranks\), but distillation.n_teacher_ranks=2; set "
                          r"distillation.n_teacher_ranks=4, or set distributed.teacher_placement=last\."),
    (9, 9, 4, "last", r"5 student ranks cannot be split evenly among 2 teacher replicas \(4 teacher ranks / "
                      r"distillation.teacher_tp=2\); launch a number of students divisible by 2 \(e.g. torchrun "
                      r"--nproc-per-node 10\)\."),
])
def test_plans_that_cannot_work_are_one_sentence(world, local, n_teachers, placement, message):
    with pytest.raises(ValueError, match=message):
        LaunchPlan(world, local, (TeacherLayout(n_teachers, 2),), placement)


@pytest.mark.parametrize("vocab, tp", [(512, 2), (513, 2), (49152, 4), (10, 4), (5, 8)])
def test_vocab_slices_are_torch_chunks(vocab, tp):
    """The rows DTensor's Shard(0) gives each rank (torch.chunk), including empty trailing slices."""
    chunks = torch.arange(vocab).chunk(tp)
    for rank in range(tp):
        start, end = shard_bounds(vocab, tp, rank)
        expected = chunks[rank].tolist() if rank < len(chunks) else []
        assert list(range(start, end)) == expected


def test_head_counts_must_divide_by_teacher_tp():
    config = {"num_attention_heads": 9, "num_key_value_heads": 3}
    assert heads_problem(config, 1, "x") is None and heads_problem(config, 3, "x") is None
    assert heads_problem(config, 2, "/t/config.json") == (
        "distillation.teacher_tp=2; the teacher has 9 attention heads and 3 KV heads (/t/config.json), and tensor "
        "parallelism gives each rank whole heads: use a teacher_tp that divides both.")
    assert heads_problem({"text_config": {"num_attention_heads": 8}}, 4, "x") is None  # KV heads default to heads
    assert "6 attention heads and 6 KV heads" in heads_problem({"text_config": {"num_attention_heads": 6}}, 4, "x")
    assert heads_problem({}, 2, "x") is None  # nothing to check: the teacher checks when it loads


def tiny_llama(**overrides):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, **overrides)
    with torch.device("meta"):
        return LlamaForCausalLM(config)


def test_the_plan_is_the_models_own_in_torchs_styles_plus_the_embedding():
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = tensor_parallel_plan(tiny_llama())
    assert {path: type(style) for path, style in plan.items()} == {
        "layers.*.self_attn.q_proj": ColwiseParallel, "layers.*.self_attn.k_proj": ColwiseParallel,
        "layers.*.self_attn.v_proj": ColwiseParallel, "layers.*.self_attn.o_proj": RowwiseParallel,
        "layers.*.mlp.gate_proj": ColwiseParallel, "layers.*.mlp.up_proj": ColwiseParallel,
        "layers.*.mlp.down_proj": RowwiseParallel, "embed_tokens": RowwiseParallel}
    model = tiny_llama()
    model.config.base_model_tp_plan = {"layers.*.mlp.gate_up_proj": "packed_colwise"}
    with pytest.raises(ValueError, match="plan uses the style\\(s\\) packed_colwise, which this trainer does not map "
                                         "to torch's; serve it with distillation.teacher_tp=1"):
        tensor_parallel_plan(model)


def test_the_sampler_draws_from_the_teachers_distribution_and_two_slices_draw_what_one_does():
    """Inverse-CDF over slices: the same uniforms give the same ids with one slice or two (uneven ones, the
    second cut by the students' vocabulary), and the draws pass a chi-square test against p_T, as
    torch.multinomial's (the sampler of teacher_tp=1) do."""
    vocab, cut, draws = 16, 14, 40000
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(0)) * 2
    logits[:, cut:] = float("-inf")  # ids beyond the students' vocabulary
    uniforms = torch.rand((1, draws), generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    lse = logits.double().logsumexp(-1)
    _, one_ids, one_log_probs, one_entropy = sample_ids(logits, lse[None], 0, 0, cut, uniforms)
    slices = [(0, 9), (9, 16)]
    slice_lse = torch.stack([logits[:, a:b].double().logsumexp(-1) for a, b in slices])
    ids, log_probs, entropy = torch.zeros_like(one_ids), torch.zeros_like(one_log_probs), 0.0
    for index, (a, b) in enumerate(slices):
        mine, part_ids, part_log_probs, part_entropy = sample_ids(logits[:, a:b], slice_lse, index, a,
                                                                  min(b, cut) - a, uniforms)
        ids, log_probs = torch.where(mine, part_ids, ids), torch.where(mine, part_log_probs, log_probs)
        entropy = entropy + part_entropy
    assert torch.equal(ids, one_ids) and torch.allclose(log_probs, one_log_probs) and torch.allclose(entropy,
                                                                                                     one_entropy)
    probs = torch.softmax(logits[0, :cut].double(), -1)
    assert torch.allclose(log_probs[0], probs.log()[ids[0]])
    assert torch.allclose(entropy, (probs * probs.log()).sum())
    multinomial = torch.multinomial(probs, draws, replacement=True, generator=torch.Generator().manual_seed(2))
    critical = 34.53  # chi-square with 13 degrees of freedom (14 ids) at p = 0.001
    for sample in (ids[0], multinomial):
        counts = torch.bincount(sample, minlength=vocab).double()
        assert counts[cut:].sum() == 0
        expected = probs * draws
        chi_square = float(((counts[:cut] - expected) ** 2 / expected).sum())
        assert chi_square < critical, chi_square


def test_a_replicas_flags_overwrite_the_status_words_students_read():
    status = ResponseStatus(ok=True, teacher_preempt=False, busy_s=1.5, idle_s=2.0, peak_bytes=10, forward_s=1.25)
    response = torch.zeros(RECORD_BYTES + 64, dtype=torch.uint8)
    response[:RECORD_BYTES] = status.pack()
    ReplicaLink.write_flags(response, torch.tensor([1, 3 * 2**30], dtype=torch.int64))
    read = ResponseStatus.unpack(response[:RECORD_BYTES])
    assert (read.ok, read.teacher_preempt, read.peak_bytes, read.busy_s, read.idle_s) == (True, True, 3 * 2**30, 1.5,
                                                                                          2.0)
    assert math.isclose(read.forward_s, 1.25)
