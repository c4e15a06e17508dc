"""The teacher's top-k (or sampled draws) at aligned positions, turned into student targets in the same format.

At an aligned position (`source` >= 0, `alignment.py`) the teacher's k ids become student ids through the vocabulary
map: the probabilities of teacher ids mapping to one student id add up, those of unmapped ids join the "rest" bucket
(the top-k tail). Left-over slots hold other student ids at probability 0, so a row's ids stay distinct. kd_weight
is 1 there and 0 at unaligned positions, whose rows are a placeholder weighed by 0. With `unmapped_entries`
(distillation.uld_weight > 0) the unmapped entries also travel in the free slots, marked (`loss/uld.py`).

Sampled: the teacher's probabilities are added up per student id, the unmapped ones in a bucket of their own (id -1,
log-prob -inf: no student term), and extra is the mapped part's sum_s p(s) log(p(s) / M), so the estimate stays
unbiased for M * KL(p / M || q) (`divergences.sampled_forward_kl`).
"""

import torch

from lingua.distillation.cross_tokenizer.vocab_map import VocabMap
from lingua.distillation.loss.divergences import LOG_TINY
from lingua.distillation.outputs import TeacherOutputs
from lingua.errors import ConfigError


def _padding_ids(kept_ids: torch.Tensor, kept: torch.Tensor, student_vocab_size: int) -> torch.Tensor:
    """[N, k] distinct student ids per row that are not among the row's kept ids (from the smallest ids)."""
    N, k = kept_ids.shape
    candidates = torch.arange(min(2 * k, student_vocab_size), device=kept_ids.device)
    taken = ((candidates.view(1, -1, 1) == kept_ids.unsqueeze(1)) & kept.unsqueeze(1)).any(-1)  # [N, C]
    # Stable order of the free candidates first: their first k are distinct and free.
    order = torch.sort(taken.to(torch.int8), dim=-1, stable=True).indices[:, :k]
    return candidates[order]


def map_topk_rows(values: torch.Tensor, ids: torch.Tensor, tail: torch.Tensor, vocab_map: VocabMap,
                  unmapped_entries: bool = False):
    """Teacher top-k rows [N, k] (log-probs, ids, tail) -> student rows [N, k], most likely first."""
    N, k = ids.shape
    if k > vocab_map.student_vocab_size:
        raise ConfigError(f"distillation.k={k} exceeds the student's vocabulary ({vocab_map.student_vocab_size}); "
                          f"lower distillation.k.")
    table = vocab_map.table(ids.device)
    student = table[ids.long().clamp(0, table.numel() - 1)]
    student = torch.where((ids >= 0) & (ids < table.numel()), student, -1)
    probs = values.float().exp()
    mapped = student >= 0
    # The first slot holding each student id collects the mass of every slot with that id.
    same = (student.unsqueeze(-1) == student.unsqueeze(-2)) & mapped.unsqueeze(-1) & mapped.unsqueeze(-2)
    first = same.to(torch.int8).argmax(-1)  # each slot's first slot with its id (itself when alone)
    summed = torch.zeros_like(probs).scatter_add_(-1, first, torch.where(mapped, probs, 0.0))
    kept = mapped & (first == torch.arange(k, device=ids.device))
    rest = tail.float() + torch.where(mapped, 0.0, probs).sum(-1)
    log_values = torch.where(kept, summed.clamp_min(torch.finfo(torch.float32).tiny).log(), float("-inf"))
    log_values, order = log_values.sort(-1, descending=True)
    kept_ids, kept = student.gather(-1, order), kept.gather(-1, order)
    padding = _padding_ids(kept_ids, kept, vocab_map.student_vocab_size)
    # Kept ids come first (sorted by mass), so the j-th free slot takes the j-th padding id.
    free_rank = (~kept).to(torch.int64).cumsum(-1) - 1
    out_ids = torch.where(kept, kept_ids, padding.gather(-1, free_rank.clamp_min(0)))
    if unmapped_entries:
        log_values, out_ids = _with_unmapped_entries(log_values, out_ids, kept, free_rank,
                                                     torch.where(mapped, float("-inf"), values.float()))
    return log_values, out_ids.to(torch.int32), rest.clamp(0.0, 1.0)


def _with_unmapped_entries(log_values, out_ids, kept, free_rank, unmapped_log):
    """The j-th free slot takes the j-th largest unmapped log-prob (id ~padding id); the row sorted again (stable)."""
    ranked = unmapped_log.sort(-1, descending=True).values.gather(-1, free_rank.clamp_min(0))
    entry = ~kept & (ranked > float("-inf"))
    log_values = torch.where(entry, ranked, log_values)
    out_ids = torch.where(entry, ~out_ids, out_ids)
    log_values, order = log_values.sort(dim=-1, descending=True, stable=True)
    return log_values, out_ids.gather(-1, order)


def student_topk_targets(teacher: TeacherOutputs, source: torch.Tensor, vocab_map: VocabMap,
                         wire_dtype: torch.dtype = torch.bfloat16,
                         unmapped_entries: bool = False) -> tuple[TeacherOutputs, torch.Tensor]:
    """Student top-k targets [B, S, k] and kd_weight [B, S] from the teacher's top-k over its positions and
    `source` [B, S]; an unaligned position takes the first k student ids, uniform, no rest (finite, weighed by 0)."""
    assert teacher.format == "topk", teacher.format  # sampled: student_sampled_targets
    k = teacher.ids.shape[-1]
    uniform = (-torch.log(torch.tensor(float(k))), torch.arange(k, dtype=torch.int32, device=teacher.ids.device), 0.0)
    return _at_student_positions(teacher, source, wire_dtype, uniform,
                                 lambda *rows: map_topk_rows(*rows, vocab_map, unmapped_entries))


def _at_student_positions(teacher: TeacherOutputs, source: torch.Tensor, wire_dtype: torch.dtype, unaligned: tuple,
                          map_rows=lambda *rows: rows) -> tuple[TeacherOutputs, torch.Tensor]:
    """The teacher's rows (any leading shape, flattened) read at each student position of `source` [B, S] (an
    index, or -1) and passed through `map_rows`, as outputs [B, S, k] whose unaligned rows are `unaligned` (value,
    ids, extra), and the kd_weight [B, S] (1 aligned, 0 not)."""
    k = teacher.ids.shape[-1]
    values, ids, extra = teacher.values.reshape(-1, k), teacher.ids.reshape(-1, k), teacher.extra.reshape(-1)
    if values.shape[0] == 0:  # a teacher with no positions (an empty window): every position is unaligned
        values, ids, extra = values.new_zeros(1, k), torch.arange(k, dtype=ids.dtype).view(1, k), extra.new_zeros(1)
    rows = source.clamp_min(0).reshape(-1)
    values, ids, extra = map_rows(values[rows], ids[rows], extra[rows])
    aligned = source >= 0
    flat_aligned, shape = aligned.reshape(-1, 1), (*source.shape, k)
    values = torch.where(flat_aligned, values.float(), unaligned[0]).reshape(shape).to(wire_dtype)
    ids = torch.where(flat_aligned, ids, unaligned[1]).reshape(shape).to(torch.int32)
    extra = torch.where(aligned.reshape(-1), extra.float(), unaligned[2]).reshape(source.shape)
    return TeacherOutputs(teacher.format, values, ids, extra), aligned.float()


@torch.no_grad()
def sample_student_ids(logits: torch.Tensor, k: int, temperature: float, vocab_map: VocabMap,
                       wire_dtype: torch.dtype = torch.bfloat16, generator=None) -> TeacherOutputs:
    """Teacher logits [..., V_teacher] -> k draws with replacement in student ids [..., k] (-1: unmapped), their
    log-probs at `temperature` and the mapped part's sum_s p(s) log(p(s) / M)."""
    V = vocab_map.student_vocab_size
    table = vocab_map.table(logits.device)
    probs = torch.softmax(logits.float().reshape(-1, logits.shape[-1]) / temperature, dim=-1)
    # Column V is the unmapped bucket; teacher ids past the map (padding rows of the head) are unmapped too.
    columns = torch.full((probs.shape[-1],), V, dtype=torch.int64, device=probs.device)
    width = min(table.numel(), probs.shape[-1])
    columns[:width] = torch.where(table[:width] >= 0, table[:width], V)
    student = torch.zeros(probs.shape[0], V + 1, device=probs.device).index_add_(1, columns, probs)
    draws = torch.multinomial(student, k, replacement=True, generator=generator)
    log_student = student.clamp_min(0).log().clamp_min(LOG_TINY)
    unmapped = draws == V
    values = torch.where(unmapped, float("-inf"), log_student.gather(-1, draws))
    mass = student[:, :V].sum(-1)
    neg_entropy = torch.special.xlogy(student[:, :V], student[:, :V]).sum(-1) - torch.special.xlogy(mass, mass)
    shape = (*logits.shape[:-1], k)
    return TeacherOutputs("sampled", values.view(shape).to(wire_dtype),
                          torch.where(unmapped, -1, draws).view(shape).to(torch.int32),
                          neg_entropy.view(logits.shape[:-1]))


def student_sampled_targets(teacher: TeacherOutputs, source: torch.Tensor,
                            wire_dtype: torch.dtype = torch.bfloat16) -> tuple[TeacherOutputs, torch.Tensor]:
    """`student_topk_targets` for `sample_student_ids`'s rows; an unaligned position gets k unmapped draws, extra 0:
    a KD of exactly 0."""
    return _at_student_positions(teacher, source, wire_dtype, (float("-inf"), -1, 0.0))
