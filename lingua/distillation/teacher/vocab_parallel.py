"""The teacher's outputs from a vocabulary-parallel head: each rank holds the logits of its slice ([rows, S,
V / teacher_tp], `VocabShard`); each function returns on the group's first rank (None elsewhere) what
`sparsify_teacher_logits` would for the whole vocabulary. Ids past the students' `vocab_size` become -inf.

    topk     one gather of each slice's log-sum-exp, its rest's and its top-k; the first rank merges them
    sampled  an all-gather of the log-sum-exps, float64 inverse-CDF draws from the replica's seed, one reduce
             (`sample_ids`: the same uniforms at teacher_tp=1 give the same ids)
    full     an all-gather of the log-sum-exps, one gather of each slice's log-probs
    CE       an all-gather of the log-sum-exps, an all-reduce of the labels' logits (the held-out reference)
"""

from typing import Optional

import torch
import torch.distributed as dist

from lingua.distillation.loss.divergences import LOG_TINY
from lingua.distillation.outputs import TeacherOutputs, check_format
from lingua.distillation.teacher.tensor_parallel import VocabShard
from lingua.errors import ConfigError
from lingua.parallel.collectives import log_collective

POSITIONS_PER_BLOCK = 1024  # sampled: float64 CDFs of this many positions at a time bound the extra memory


def scaled_slice(logits: torch.Tensor, shard: VocabShard, vocab_size: int, temperature: float) -> torch.Tensor:
    """This slice's logits / T in fp32, padded to the widest slice, -inf at ids >= `vocab_size` and in the padding."""
    z = logits.float() / temperature
    valid = max(0, min(shard.end, vocab_size) - shard.start)
    if valid == z.shape[-1] == shard.width:
        return z
    padded = z.new_full((*z.shape[:-1], shard.width), float("-inf"))
    padded[..., :valid] = z[..., :valid]
    return padded


def _gather(tensor: torch.Tensor, shard: VocabShard, what: str, everywhere: bool = False) -> Optional[torch.Tensor]:
    """[teacher_tp, *tensor.shape] in slice order on every rank (`everywhere`) or on the group's first rank only."""
    tensor = tensor.contiguous()
    parts = [torch.empty_like(tensor) for _ in range(shard.tp_size)] if everywhere or shard.tp_rank == 0 else None
    log_collective(f"{'all_gather' if everywhere else 'gather'} {what}", shard.group, tensor)
    if everywhere:
        dist.all_gather(parts, tensor, group=shard.group)
    else:
        dist.gather(tensor, parts, dst=shard.leader, group=shard.group)
    return torch.stack(parts) if parts is not None else None


def vocab_parallel_outputs(logits: torch.Tensor, shard: VocabShard, format: str, k: int, temperature: float,
                           wire_dtype: torch.dtype, vocab_size: int,
                           generator: Optional[torch.Generator] = None) -> Optional[TeacherOutputs]:
    check_format(format)
    assert temperature > 0 and (format == "full" or k >= 1), (temperature, k)  # DistillationArgs.validate()
    if format == "topk" and k > vocab_size:
        raise ConfigError(f"Top-k distillation with k={k} exceeds the vocabulary size {vocab_size}; "
                         f"lower distillation.k.")
    z = scaled_slice(logits, shard, vocab_size, temperature)
    if format == "topk":
        return _topk(z, shard, k, wire_dtype)
    if format == "sampled":
        return _sampled(z, shard, k, wire_dtype, vocab_size, generator)
    return _full(z, shard, wire_dtype, vocab_size)


def _topk(z: torch.Tensor, shard: VocabShard, k: int, wire_dtype: torch.dtype) -> Optional[TeacherOutputs]:
    N, S, _ = z.shape
    lse = z.logsumexp(-1)
    local_k = min(k, shard.width)
    values, ids = z.topk(local_k, dim=-1)
    rest = z.scatter_(-1, ids, float("-inf")).logsumexp(-1)  # z is ours: its top-k are not needed any more
    if local_k < k:  # a slice narrower than k: -inf candidates are never chosen (k <= the students' vocab)
        values = torch.cat([values, values.new_full((N, S, k - local_k), float("-inf"))], dim=-1)
        ids = torch.cat([ids, ids.new_zeros((N, S, k - local_k))], dim=-1)
    # float64 carries ids < 2^53 exactly: one message per slice, no bit casts.
    packed = torch.cat([lse[..., None].double(), rest[..., None].double(), values.double(),
                        (ids + shard.start).double()], dim=-1)
    gathered = _gather(packed, shard, "top-k candidates")
    if gathered is None:
        return None
    tp = shard.tp_size
    log_total = gathered[..., 0].logsumexp(0)  # [N, S]: the whole vocabulary's log-sum-exp
    candidates = gathered[..., 2:2 + k].permute(1, 2, 0, 3).reshape(N, S, tp * k) - log_total[..., None]
    candidate_ids = gathered[..., 2 + k:].permute(1, 2, 0, 3).reshape(N, S, tp * k)
    top_values, where = candidates.topk(k, dim=-1)
    top_ids = candidate_ids.gather(-1, where).to(torch.int32)
    # The rest: every entry outside the merged top-k, i.e. each slice's rest and the candidates not chosen.
    unchosen = candidates.scatter_(-1, where, float("-inf"))
    slice_rests = (gathered[..., 1] - log_total).permute(1, 2, 0)
    tail = torch.cat([slice_rests, unchosen], dim=-1).logsumexp(-1).exp()
    return TeacherOutputs("topk", top_values.float().to(wire_dtype), top_ids, tail.float())


def sample_ids(z: torch.Tensor, shard_lse: torch.Tensor, slice_index: int, start: int, valid: int,
               uniforms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse-CDF draws over slices from z, this slice's [P, W] logits / T (`valid` real columns), every slice's
    log-sum-exp [tp, P] (float64) and the same uniforms [P, k] on every slice. Returns (mine [P, k]: the draw fell
    here, global ids, float64 log-probs (both meaningful where mine), this slice's part of sum_v p log p [P])."""
    log_total = shard_lse.logsumexp(0)  # [P]
    masses = (shard_lse - log_total).exp().t()  # [P, tp]
    cumulative = masses.cumsum(-1)
    targets = uniforms * cumulative[:, -1:]  # scaled to the total, so every draw lands in a slice with mass
    owner = torch.searchsorted(cumulative, targets, right=True).clamp_max_(shard_lse.shape[0] - 1)
    mine = owner == slice_index
    inside = targets - (cumulative[:, slice_index] - masses[:, slice_index])[:, None]
    ids = torch.zeros_like(uniforms, dtype=torch.long)
    log_probs = torch.zeros_like(uniforms)
    neg_entropy = torch.zeros_like(log_total)
    for begin in range(0, z.shape[0], POSITIONS_PER_BLOCK):
        rows = slice(begin, begin + POSITIONS_PER_BLOCK)
        block = z[rows].double() - log_total[rows, None]
        probs = block.exp()
        cdf = probs.cumsum(-1)
        picked = torch.searchsorted(cdf, inside[rows], right=True).clamp_max_(max(valid, 1) - 1)  # rounding at the end
        ids[rows] = picked + start
        log_probs[rows] = block.gather(-1, picked)
        neg_entropy[rows] = (probs * block.clamp_min(LOG_TINY)).sum(-1)
    return mine, ids, log_probs, neg_entropy


def _sampled(z: torch.Tensor, shard: VocabShard, k: int, wire_dtype: torch.dtype, vocab_size: int,
             generator: Optional[torch.Generator]) -> Optional[TeacherOutputs]:
    assert generator is not None, "every rank of a replica draws the same uniforms: pass the replica's generator"
    N, S, W = z.shape
    flat = z.reshape(N * S, W)
    lse = torch.cat([flat[i:i + POSITIONS_PER_BLOCK].double().logsumexp(-1)
                     for i in range(0, flat.shape[0], POSITIONS_PER_BLOCK)])
    shard_lse = _gather(lse, shard, "slice log-sum-exp", everywhere=True)
    uniforms = torch.rand((N * S, k), generator=generator, dtype=torch.float64, device=z.device)
    valid = max(0, min(shard.end, vocab_size) - shard.start)
    mine, ids, log_probs, neg_entropy = sample_ids(flat, shard_lse, shard.tp_rank, shard.start, valid, uniforms)
    packed = torch.cat([torch.where(mine, ids.double(), 0.0), torch.where(mine, log_probs, 0.0), neg_entropy[:, None]],
                       dim=-1)
    log_collective("reduce sampled draws", shard.group, packed)
    dist.reduce(packed, dst=shard.leader, op=dist.ReduceOp.SUM, group=shard.group)  # one slice owns each draw
    if shard.tp_rank != 0:
        return None
    packed = packed.view(N, S, 2 * k + 1)
    return TeacherOutputs("sampled", packed[..., k:2 * k].float().to(wire_dtype), packed[..., :k].to(torch.int32),
                          packed[..., 2 * k].float())


def _full(z: torch.Tensor, shard: VocabShard, wire_dtype: torch.dtype, vocab_size: int) -> Optional[TeacherOutputs]:
    N, S, W = z.shape
    log_total = _gather(z.logsumexp(-1), shard, "slice log-sum-exp", everywhere=True).logsumexp(0)
    gathered = _gather((z - log_total[..., None]).to(wire_dtype), shard, "log-probs")
    if gathered is None:
        return None
    return TeacherOutputs("full", gathered.permute(1, 2, 0, 3).reshape(N, S, shard.tp_size * W)[..., :vocab_size])


def vocab_parallel_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, shard: VocabShard,
                                 vocab_size: int) -> torch.Tensor:
    """Cross-entropy summed over the labelled positions of one slice's logits [..., V / tp], over the first
    `vocab_size` ids; the same scalar on every rank of the group."""
    z = scaled_slice(logits, shard, vocab_size, 1.0)
    log_total = _gather(z.logsumexp(-1), shard, "slice log-sum-exp", everywhere=True).logsumexp(0)
    local = labels - shard.start
    here = (local >= 0) & (local < min(shard.end, vocab_size) - shard.start)
    picked = torch.where(here, z.gather(-1, local.clamp(0, z.shape[-1] - 1)[..., None])[..., 0], 0.0)
    log_collective("all_reduce label logits", shard.group, picked)
    dist.all_reduce(picked, op=dist.ReduceOp.SUM, group=shard.group)
    return (log_total - picked)[labels != -100].sum()
