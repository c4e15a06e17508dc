"""The student language model: token embeddings -> transformer blocks -> norm -> vocabulary head."""

from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import nn

from lingua.args import require
from lingua.parallel.parallelize import build_sharded
from lingua.transformer import (
    BaseTransformer,
    BaseTransformerArgs,
    RMSNorm,
    doc_seqlens,
    ffn_hidden_dim,
    init_generator,
    init_trunc_normal,
    resolve_attn_impl,
)


@dataclass
class LMTransformerArgs(BaseTransformerArgs):
    vocab_size: int = -1  # -1: taken from the tokenizer by the trainer
    tie_embeddings: bool = False  # output head reuses tok_embeddings.weight
    seed: int = 42  # init RNG seed: same seed -> same weights on every rank

    def validate(self) -> None:
        super().validate()
        require(self.vocab_size == -1 or self.vocab_size >= 1, "model.vocab_size", self.vocab_size,
                "use -1 to take it from the tokenizer, or the tokenizer's vocabulary size")


class LMTransformer(BaseTransformer):
    """Decoder-only LM. Build on any device (meta included), then `init_weights()` fills every tensor."""

    def __init__(self, args: LMTransformerArgs):
        if args.vocab_size <= 0:
            raise ValueError(f"model.vocab_size={args.vocab_size}; set it to the tokenizer's vocabulary size "
                             f"(the trainer does this when it is -1).")
        super().__init__(args)
        self.vocab_size, self.tie_embeddings, self.seed = args.vocab_size, args.tie_embeddings, args.seed
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight

    def forward(self, input_ids: torch.Tensor, doc_ids: Optional[torch.Tensor] = None,
                head_loss: Optional[Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = None,
                doc_seqlens: Optional[list[int]] = None) -> torch.Tensor:
        """input_ids [B, S] -> logits [B, S, vocab_size]; doc_ids [B, S] only matters with attn_mask=doc_causal
        (`batch_documents` gives both document arguments, doc_seqlens for xformers).

        With `head_loss`, returns head_loss(final normed hidden states, output-head weight) instead: the
        loss computes the logits itself (chunked, never all at once), inside this forward, where FSDP has
        the head weight unsharded."""
        h = self.norm(super().forward(self.tok_embeddings(input_ids), doc_ids, doc_seqlens))
        if head_loss is not None:
            return head_loss(h, self.output.weight)
        return self.output(h)

    @torch.no_grad()
    def init_weights(self, seed: Optional[int] = None) -> None:
        """(Re)initialise every parameter and buffer from `seed` (default: args.seed), on the params' device."""
        if self.tie_embeddings and self.output.weight is not self.tok_embeddings.weight:
            # A plain `to_empty` gives each module its own new tensor (FSDP's keeps the tie): restore it.
            self.output.weight = self.tok_embeddings.weight
        generator = init_generator(self.tok_embeddings.weight.device, self.seed if seed is None else seed)
        std = self.init_base_std or self.dim ** -0.5
        init_trunc_normal(self.tok_embeddings.weight, std, generator)
        super().init_weights(generator)
        self.norm.reset_parameters()
        if not self.tie_embeddings:
            init_trunc_normal(self.output.weight, std, generator)

    def reset_parameters(self) -> None:
        """nn.Module convention alias of `init_weights`."""
        self.init_weights()


def batch_documents(model, batch: dict, device) -> dict:
    """The document arguments of `model`'s forward for `batch`: none with attn_mask=causal; else its doc_ids on
    the device and, for the xformers kernel, their run lengths counted from the host batch before it moves (the
    kernel wants them on the host: no device read per forward)."""
    doc_ids = batch_doc_ids(model.attn_mask, batch, device)
    if doc_ids is None:
        return {}
    if resolve_attn_impl(model.attn_impl, doc_ids.device) != "xformers":
        return {"doc_ids": doc_ids}
    return {"doc_ids": doc_ids, "doc_seqlens": doc_seqlens(batch["doc_ids"])}


def batch_doc_ids(attn_mask: str, batch: dict, device) -> Optional[torch.Tensor]:
    """The batch's document ids when the model masks attention per document (train, probe and eval alike), sent
    without blocking the host (a training batch is in pinned memory on CUDA)."""
    if attn_mask != "doc_causal" or batch.get("doc_ids") is None:
        return None
    return batch["doc_ids"].to(device, non_blocking=True)


def num_parameters(args: LMTransformerArgs) -> int:
    """Parameters of `LMTransformer(args)` (a tied head counted once), from the sizes alone: nothing is built.
    `args.vocab_size` must be set (the trainer takes it from the tokenizer)."""
    assert args.vocab_size > 0, args.vocab_size  # -1 is resolved by the caller
    dim, head_dim = args.dim, args.dim // args.n_heads
    kv_dim = (args.n_kv_heads or args.n_heads) * head_dim
    attention = 2 * dim * args.n_heads * head_dim + 2 * dim * kv_dim  # wq, wo; wk, wv
    feed_forward = 3 * dim * ffn_hidden_dim(dim, args.ffn_dim_multiplier, args.multiple_of)  # w1, w2, w3
    layer = attention + feed_forward + 2 * dim  # + attention_norm, ffn_norm
    embeddings = args.vocab_size * dim * (1 if args.tie_embeddings else 2)  # tok_embeddings (+ output)
    return embeddings + args.n_layers * layer + dim  # + the final norm


def get_num_flop_per_token(num_non_embed_params: int, n_layers: int, dim: int, seq_len: int) -> int:
    """Training FLOPs per token: 6N for the matmuls (fwd + bwd) plus 12*L*D*S for attention scores."""
    return 6 * num_non_embed_params + 12 * n_layers * dim * seq_len


def get_no_recompute_ops() -> set:
    """Ops whose outputs selective activation checkpointing keeps: the expensive matmuls and attention kernels.

    SDPA's math backend is a composite of bmm/softmax that dispatch never sees as one op, so it is recomputed.
    """
    names = [("aten", "mm"), ("aten", "_scaled_dot_product_flash_attention"),
             ("aten", "_scaled_dot_product_efficient_attention"), ("aten", "_scaled_dot_product_cudnn_attention"),
             ("aten", "_scaled_dot_product_flash_attention_for_cpu"),
             # Keeping the FSDP reduce-scatter output avoids re-running a collective in the recompute.
             ("_c10d_functional", "reduce_scatter_tensor")]
    ops = set()
    for namespace, name in names:
        try:
            ops.add(getattr(getattr(torch.ops, namespace), name).default)
        except AttributeError:  # op absent from this torch build
            continue
    try:
        ops.add(torch.ops.higher_order.flex_attention)
    except AttributeError:
        pass
    return ops


def build_model(model_args: LMTransformerArgs, distributed, topo) -> nn.Module:
    """The student built sharded over `topo`'s mesh (meta device, FSDP, then each rank's shard initialised): the same
    weights for `model_args.seed` as a whole model initialised on every rank, whatever the number of students."""
    torch.manual_seed(model_args.seed)
    return build_sharded(lambda: LMTransformer(model_args), topo.device, topo.mesh, distributed,
                         get_no_recompute_ops())

