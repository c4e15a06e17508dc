"""Memory of one teacher rank at teacher_tp = t while it serves one request (`TeacherMemory`)."""

import dataclasses
from dataclasses import dataclass

from apps.plan.args import (AUTO_LOGITS_FREE_SHARE, AUTO_LOGITS_WORK_TENSORS, DTYPE_BYTES, GIB, LOGIT_BYTES,
                            RUNTIME_RESERVE_GIB, USABLE_MEMORY, PlanArgs)
from apps.plan.sizes import TeacherShape, ceil_div


@dataclass(frozen=True)
class TeacherMemory:
    """Bytes on one rank of a teacher replica while it serves one request."""

    weights: int
    activations: int  # one layer of one chunk of rows at a time, and the final hidden states of all rows
    attention: int  # a chunk's document mask (doc_causal, not flash or flex) or scores (eager attention)
    logits: int  # one chunk of distillation.logits_chunk_rows rows over this rank's vocabulary slice
    outputs: int  # the request, the sparse outputs' chunks and their concatenation
    reserve: int

    @property
    def total(self) -> int:
        return self.weights + self.activations + self.attention + self.logits + self.outputs + self.reserve

    def gib(self) -> dict:
        parts = {name: round(value / GIB, 2) for name, value in dataclasses.asdict(self).items()}
        return {**parts, "total": round(self.total / GIB, 2)}


def teacher_memory(shape: TeacherShape, tp: int, rows: int, args: PlanArgs, bytes_down: int,
                   bytes_up: int) -> TeacherMemory:
    """Memory of one teacher rank at teacher_tp=`tp` serving a request of `rows` sequences (students per bridge x
    data.batch_size) of data.seq_len tokens."""
    kd, seq = args.distillation, args.data.seq_len
    width = DTYPE_BYTES[teacher_dtype(args)]
    tokens = rows * seq
    widest = max(3 * ceil_div(shape.intermediate, tp),  # gate, up and their product
                 2 * ceil_div((shape.heads + 2 * shape.kv_heads) * shape.head_dim, tp)  # q, k, v and their rotations
                 + ceil_div(shape.heads * shape.head_dim, tp))  # the attention output
    row_bytes = seq * ceil_div(shape.vocab, tp) * LOGIT_BYTES[kd.output]
    weights, reserve = shape.parameters(tp) * width, int(RUNTIME_RESERVE_GIB * GIB)
    chunk_rows = kd.logits_chunk_rows
    if chunk_rows == 0:  # auto, as `TeacherModel.logits_chunk_rows` picks it on a GPU: the most rows, a power of
        # two, whose fp32 work fits a quarter of the memory free after loading
        free = max(USABLE_MEMORY * args.gpu_mem_gib * GIB - weights - reserve, 0)
        per_row = seq * ceil_div(shape.vocab, tp) * 4 * AUTO_LOGITS_WORK_TENSORS
        chunk_rows = 2 ** max(0, int(AUTO_LOGITS_FREE_SHARE * free // per_row).bit_length() - 1)
    chunk = min(chunk_rows, rows)  # the decoder, like the head, runs over this many rows at a time (no KV cache)
    # One layer of one chunk (+ the residual, its norm, the layer's output), and every row's final hidden state.
    activations = chunk * seq * width * (3 * shape.hidden + widest) + tokens * width * shape.hidden
    attention = 0
    implementation = str(kd.attn_implementation or "sdpa")
    if args.model.attn_mask == "doc_causal" and not implementation.startswith(("flash_attention", "flex_attention")):
        attention += chunk * seq * seq * (1 + width)  # a chunk's boolean document mask and its additive copy
    if implementation == "eager":
        attention += chunk * ceil_div(shape.heads, tp) * seq * seq * (2 * width + 4)  # scores, fp32 softmax, cast
    logits = chunk * row_bytes
    outputs = tokens * (bytes_up + 2 * bytes_down)
    return TeacherMemory(weights, activations, attention, logits, outputs, reserve)


def teacher_dtype(args: PlanArgs) -> str:
    """distillation.teacher_dtype on a GPU ("auto" loads bf16 there)."""
    return "bf16" if args.distillation.teacher_dtype == "auto" else args.distillation.teacher_dtype
