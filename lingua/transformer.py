"""Transformer building blocks: RMSNorm, RoPE, GQA attention (causal or document-causal), SwiGLU, blocks.

RoPE layout: "halves", the GPT-NeoX / Hugging Face Llama `rotate_half` convention. Dimension i of a
head is paired with dimension i + head_dim/2 and the pair rotates by position * theta^(-2i/head_dim).
Our wq/wk rows are therefore already in the order HF Llama expects: export copies them as they are.

Attention kernels. A plain causal mask always runs through SDPA with `is_causal=True` (flash on GPU).
For `attn_mask="doc_causal"` (packed windows, `doc_ids` [B, S]) a token sees earlier tokens of its
own document only, and `attn_impl` picks the kernel:
  - "auto" (default): "flex" on CUDA where it can run, "sdpa" elsewhere; the choice is logged once.
  - "sdpa": SDPA with an explicit [B, 1, S, S] boolean mask; runs everywhere, but no flash kernel takes a
    dense mask: on GPU that is the memory-bound math path.
  - "flex": compiled flex_attention with a block mask on CUDA (needs Triton and heads of at least 16
    dimensions); where it cannot run falls back to "sdpa" (on CUDA with a warning saying why).
  - "xformers": block-diagonal causal memory-efficient attention on CUDA (needs xformers installed);
    on CPU falls back to "sdpa".
All give the same result up to float rounding (tests/unit/lingua/test_transformer.py checks it).
"""

import functools
import importlib.util
import logging
import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from lingua.args import require
from lingua.parallel.sharded_init import trunc_normal_shard_

logger = logging.getLogger(__name__)

try:
    from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention
except ImportError:  # torch builds without flex attention: "flex" falls back to SDPA
    BlockMask = create_block_mask = flex_attention = None


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """CE summed (not averaged) over positions whose label is not -100, in fp32, so micro-batches add up
    exactly to one large batch; the caller divides by the step's token count."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100, reduction="sum")


ATTN_IMPLS = ("auto", "sdpa", "flex", "xformers")
ATTN_MASKS = ("causal", "doc_causal")
INIT_STD_FACTORS = ("disabled", "global_depth", "current_depth")


@dataclass
class BaseTransformerArgs:
    dim: int = 256  # model width: channels of the residual stream and the embeddings
    n_layers: int = 4  # transformer blocks (attention + SwiGLU MLP each)
    n_heads: int = 4  # attention query heads per layer (dim / n_heads channels each)
    n_kv_heads: Optional[int] = None  # None: one key/value head per query head (no GQA)
    ffn_dim_multiplier: float = 1.0  # SwiGLU hidden = multiple_of-rounded 8/3 * dim * multiplier
    multiple_of: int = 64  # the SwiGLU hidden size is rounded up to a multiple of this many channels
    norm_eps: float = 1e-5  # epsilon added to the mean square in RMSNorm
    rope_theta: float = 10000.0  # RoPE base frequency (larger: slower-turning positions, longer context)
    max_seqlen: int = 1024  # longest sequence RoPE tables are built for
    attn_impl: str = "auto"  # kernel for doc_causal masks: "auto" (flex on CUDA) | "sdpa" | "flex" | "xformers"
    attn_mask: str = "causal"  # "causal" | "doc_causal" (packed documents don't attend to each other)
    init_base_std: Optional[float] = None  # None: dim ** -0.5
    init_std_factor: str = "disabled"  # output-projection std divisor: "disabled" | "global_depth" | "current_depth"

    def validate(self) -> None:
        """Sizes that build a model, heads that divide evenly, known kernels and masks."""
        for key in ("dim", "n_layers", "n_heads", "multiple_of", "max_seqlen"):
            require(getattr(self, key) >= 1, f"model.{key}", getattr(self, key), "use a positive integer")
        require(self.n_kv_heads is None or self.n_kv_heads >= 1, "model.n_kv_heads", self.n_kv_heads,
                "use a positive integer, or null for one key/value head per query head")
        for key in ("ffn_dim_multiplier", "norm_eps", "rope_theta"):
            value = getattr(self, key)
            require(math.isfinite(value) and value > 0, f"model.{key}", value, "use a positive number")
        require(self.init_base_std is None or (math.isfinite(self.init_base_std) and self.init_base_std > 0),
                "model.init_base_std", self.init_base_std, "use a positive number, or null for dim ** -0.5")
        require(self.dim % self.n_heads == 0, "model.dim", self.dim,
                f"it is not divisible by model.n_heads={self.n_heads}; pick n_heads that divides dim")
        require((self.dim // self.n_heads) % 2 == 0, "model.n_heads", self.n_heads,
                f"the head dim model.dim / model.n_heads = {self.dim // self.n_heads} must be even for RoPE")
        n_kv_heads = self.n_kv_heads or self.n_heads
        require(self.n_heads % n_kv_heads == 0, "model.n_kv_heads", self.n_kv_heads,
                f"model.n_heads={self.n_heads} is not a multiple of it; GQA needs each key/value head to serve "
                f"the same number of query heads")
        for key, allowed in (("attn_impl", ATTN_IMPLS), ("attn_mask", ATTN_MASKS), ("init_std_factor", INIT_STD_FACTORS)):
            require(getattr(self, key) in allowed, f"model.{key}", getattr(self, key), f"use one of {', '.join(allowed)}")


def ffn_hidden_dim(dim: int, ffn_dim_multiplier: float, multiple_of: int) -> int:
    """SwiGLU width: 2/3 of 4*dim keeps the parameter count of a 4*dim GELU MLP, rounded up for kernels."""
    hidden = int(ffn_dim_multiplier * int(2 * 4 * dim / 3))
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


def init_trunc_normal(weight: torch.Tensor, std: float, generator: Optional[torch.Generator]) -> None:
    """Normal(0, std) cut at 3 std, so no init outlier dominates early activations.

    A sharded (DTensor) weight gets its slice of the same full draw, so weights don't depend on the sharding
    (lingua/parallel/sharded_init.py: one full tensor at a time, drawn with as little memory as torch allows).
    """
    from torch.distributed.tensor import DTensor  # here, not at import: see lingua/checkpoint.py

    if isinstance(weight, DTensor):
        trunc_normal_shard_(weight, std, generator)
        return
    nn.init.trunc_normal_(weight, mean=0.0, std=std, a=-3 * std, b=3 * std, generator=generator)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Statistics in fp32: bf16 sums of squares lose too many bits.
        x_fp32 = x.float()
        normed = x_fp32 * torch.rsqrt(x_fp32.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


class RotaryEmbedding(nn.Module):
    """cos/sin tables [max_seqlen, head_dim/2] in fp32 (halves layout, see module docstring)."""

    def __init__(self, head_dim: int, max_seqlen: int, theta: float):
        super().__init__()
        self.head_dim, self.max_seqlen, self.theta = head_dim, max_seqlen, theta
        # Not persistent: derived from the config, so checkpoints don't carry (or need) them.
        self.register_buffer("cos", torch.empty(max_seqlen, head_dim // 2, dtype=torch.float32), persistent=False)
        self.register_buffer("sin", torch.empty(max_seqlen, head_dim // 2, dtype=torch.float32), persistent=False)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Recompute the tables in place (after `to_empty` they hold garbage)."""
        device = self.cos.device
        exponents = torch.arange(0, self.head_dim, 2, device=device, dtype=torch.float32) / self.head_dim
        inv_freq = 1.0 / (self.theta ** exponents)
        angles = torch.outer(torch.arange(self.max_seqlen, device=device, dtype=torch.float32), inv_freq)
        self.cos.copy_(angles.cos())
        self.sin.copy_(angles.sin())

    def forward(self, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos[:seq_len], self.sin[:seq_len]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [B, S, H, D] by position: pairs (i, i + D/2) turn by the angle in cos/sin [S, D/2]."""
    x1, x2 = x.float().chunk(2, dim=-1)
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).type_as(x)


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """[B, S, H_kv, D] -> [B, S, H_kv * n_rep, D], each kv head repeated for the query heads it serves."""
    if n_rep == 1:
        return x
    bsz, seq_len, n_kv_heads, head_dim = x.shape
    return x[:, :, :, None, :].expand(bsz, seq_len, n_kv_heads, n_rep, head_dim).reshape(
        bsz, seq_len, n_kv_heads * n_rep, head_dim)


# ---- document-causal masks, one builder per kernel ----

FLEX_BLOCK_SIZE = 128  # flex_attention's default sparse block

def doc_causal_bool_mask(doc_ids: torch.Tensor) -> torch.Tensor:
    """[B, 1, S, S] boolean mask for SDPA: True where query i may attend key j (j <= i, same document)."""
    seq_len = doc_ids.shape[1]
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool, device=doc_ids.device).tril()
    same_doc = doc_ids[:, :, None] == doc_ids[:, None, :]
    return (same_doc & causal)[:, None]


def doc_causal_block_mask(doc_ids: torch.Tensor, block_size: int = FLEX_BLOCK_SIZE):
    """flex_attention BlockMask for the same pattern as `doc_causal_bool_mask`, built from each block's first and
    last document id: [B, 1, S/block, S/block] tables, never the dense [B, 1, S, S] mask `create_block_mask`
    evaluates. Needs ids non-decreasing along a row (packed windows are). With them, a key block before the
    query block touches it iff its last document is the query block's first, and is full iff both blocks lie in
    one document; a block holding positions past S is never full (as `create_block_mask` pads it)."""
    if create_block_mask is None:
        raise RuntimeError("this torch build has no flex_attention; use model.attn_impl=sdpa.")

    def mask_mod(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (doc_ids[b, q_idx] == doc_ids[b, kv_idx])

    seq_len = doc_ids.shape[1]
    n = -(-seq_len // block_size)
    starts = torch.arange(n, device=doc_ids.device) * block_size
    first, last = doc_ids[:, starts], doc_ids[:, (starts + block_size - 1).clamp(max=seq_len - 1)]
    q, kv = starts[:, None], starts[None, :]  # [n, 1] query blocks, [1, n] key blocks
    whole = starts + block_size <= seq_len  # computed on the device: writing a Python bool into it would sync
    before = kv < q
    touches = (before & (last[:, None, :] == first[:, :, None])) | (kv == q)
    full = before & (first[:, None, :] == last[:, :, None]) & whole[:, None] & whole[None, :]
    tables = []
    for blocks in (touches & ~full, full):  # partial blocks (mask_mod runs there), full blocks (it does not)
        blocks = blocks[:, None].to(torch.int32)
        tables += [blocks.sum(-1, dtype=torch.int32),
                   torch.argsort(blocks, dim=-1, descending=True, stable=True).to(torch.int32)]
    return BlockMask.from_kv_blocks(*tables, BLOCK_SIZE=block_size, mask_mod=mask_mod, seq_lengths=(seq_len, seq_len))


def doc_seqlens(doc_ids: torch.Tensor) -> list[int]:
    """Lengths of the runs of equal doc ids, row after row: the packed layout xformers' block masks want."""
    seqlens = []
    for row in doc_ids.tolist():
        run = 1
        for previous, current in zip(row, row[1:]):
            if current == previous:
                run += 1
            else:
                seqlens.append(run)
                run = 1
        seqlens.append(run)
    return seqlens


def doc_causal_xformers_bias(doc_ids: torch.Tensor, seqlens: Optional[list[int]] = None):
    """xformers block-diagonal causal bias over the batch flattened into one sequence; `seqlens` counted from the
    host batch (else read from `doc_ids`, a device-to-host copy and sync)."""
    from xformers.ops import fmha

    return fmha.attn_bias.BlockDiagonalCausalMask.from_seqlens(seqlens if seqlens is not None else doc_seqlens(doc_ids))


@functools.lru_cache(maxsize=None)
def _warn_once(message: str) -> None:
    logger.warning(message)


@functools.lru_cache(maxsize=None)
def _info_once(message: str) -> None:
    logger.info(message)


FLEX_MIN_HEAD_DIM = 16  # flex_attention's Triton kernels (tl.dot) refuse smaller heads on GPU


def resolve_attn_impl(attn_impl: str, device: torch.device, head_dim: Optional[int] = None) -> str:
    """The doc_causal kernel that can run on this device: flex/xformers need CUDA (flex also Triton and heads of
    at least FLEX_MIN_HEAD_DIM), else SDPA with a mask."""
    if attn_impl == "xformers":
        if importlib.util.find_spec("xformers") is None:
            _warn_once("model.attn_impl=xformers but xformers is not installed: using flex_attention "
                       "(on GPU) or SDPA with a document mask instead.")
            return resolve_attn_impl("flex", device, head_dim)
        return "xformers" if device.type == "cuda" else "sdpa"
    if attn_impl in ("auto", "flex"):
        if device.type != "cuda":
            return "sdpa"
        if flex_attention is None or importlib.util.find_spec("triton") is None:
            _warn_once("flex_attention cannot run here (this torch build has no flex_attention or no Triton to "
                       "compile it): document masks use SDPA with a dense [B, 1, S, S] mask, without a flash kernel.")
        elif head_dim is not None and head_dim < FLEX_MIN_HEAD_DIM:
            _warn_once(f"flex_attention needs heads of at least {FLEX_MIN_HEAD_DIM} dimensions on GPU (this model "
                       f"has {head_dim}: model.dim / model.n_heads): document masks use SDPA with a dense mask.")
        else:
            return "flex"
    return "sdpa"


def build_attention_mask(attn_mask: str, attn_impl: str, doc_ids: Optional[torch.Tensor], device: torch.device,
                         head_dim: Optional[int] = None, seqlens: Optional[list[int]] = None):
    """What `attention` takes as `mask`: None (plain causal), a bool tensor, a BlockMask or an xformers bias."""
    if attn_mask == "causal" or doc_ids is None:
        return None
    impl = resolve_attn_impl(attn_impl, device, head_dim)
    _info_once(f"document-causal attention on {device.type}: {impl} (model.attn_impl={attn_impl})")
    if impl == "flex":
        return doc_causal_block_mask(doc_ids)
    if impl == "xformers":
        return doc_causal_xformers_bias(doc_ids, seqlens)
    return doc_causal_bool_mask(doc_ids)


_compiled_flex_attention = None


def _flex(q, k, v, block_mask, enable_gqa):
    global _compiled_flex_attention
    if not q.is_cuda or torch.compiler.is_compiling():
        # In a compiled block dynamo fuses flex itself; eager CPU flex materialises scores (tests only).
        return flex_attention(q, k, v, block_mask=block_mask, enable_gqa=enable_gqa)
    if _compiled_flex_attention is None:
        _compiled_flex_attention = torch.compile(flex_attention, dynamic=False)
    return _compiled_flex_attention(q, k, v, block_mask=block_mask, enable_gqa=enable_gqa)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask=None) -> torch.Tensor:
    """Scaled dot-product attention on [B, S, H, D] tensors (k, v may have fewer heads: GQA).

    `mask` comes from `build_attention_mask`; its type picks the kernel.
    """
    n_rep = q.shape[2] // k.shape[2]
    if BlockMask is not None and isinstance(mask, BlockMask):
        out = _flex(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask, enable_gqa=n_rep > 1)
        return out.transpose(1, 2)
    # Repeating kv heads keeps every SDPA backend eligible (not all of them take enable_gqa).
    k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)
    if mask is None or isinstance(mask, torch.Tensor):
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             attn_mask=mask, is_causal=mask is None)
        return out.transpose(1, 2)
    from xformers.ops import fmha

    bsz, seq_len = q.shape[:2]
    flat = [t.reshape(1, bsz * seq_len, *t.shape[2:]) for t in (q, k, v)]
    return fmha.memory_efficient_attention(*flat, attn_bias=mask).reshape(q.shape)


class Attention(nn.Module):
    def __init__(self, dim: int, head_dim: int, n_heads: int, n_kv_heads: int):
        super().__init__()
        self.head_dim, self.n_heads, self.n_kv_heads = head_dim, n_heads, n_kv_heads
        self.wq = nn.Linear(dim, n_heads * head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * head_dim, bias=False)
        self.wo = nn.Linear(n_heads * head_dim, dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask=None) -> torch.Tensor:
        bsz, seq_len, _ = x.shape
        q = self.wq(x).view(bsz, seq_len, self.n_heads, self.head_dim)
        k = self.wk(x).view(bsz, seq_len, self.n_kv_heads, self.head_dim)
        v = self.wv(x).view(bsz, seq_len, self.n_kv_heads, self.head_dim)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        return self.wo(attention(q, k, v, mask).reshape(bsz, seq_len, -1))

    def init_weights(self, in_std: float, out_std: float, generator: Optional[torch.Generator]) -> None:
        for linear in (self.wq, self.wk, self.wv):
            init_trunc_normal(linear.weight, in_std, generator)
        init_trunc_normal(self.wo.weight, out_std, generator)


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))

    def init_weights(self, in_std: float, out_std: float, generator: Optional[torch.Generator]) -> None:
        init_trunc_normal(self.w1.weight, in_std, generator)
        init_trunc_normal(self.w3.weight, in_std, generator)
        init_trunc_normal(self.w2.weight, out_std, generator)


class TransformerBlock(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then + ffn(norm(.))."""

    def __init__(self, args: BaseTransformerArgs):
        super().__init__()
        head_dim = args.dim // args.n_heads
        self.attention = Attention(args.dim, head_dim, args.n_heads, args.n_kv_heads or args.n_heads)
        self.feed_forward = FeedForward(args.dim, ffn_hidden_dim(args.dim, args.ffn_dim_multiplier, args.multiple_of))
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask=None) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin, mask)
        return h + self.feed_forward(self.ffn_norm(h))

    def init_weights(self, in_std: float, out_std: float, ffn_out_std: float,
                         generator: Optional[torch.Generator]) -> None:
        self.attention.init_weights(in_std, out_std, generator)
        self.feed_forward.init_weights(in_std, ffn_out_std, generator)
        self.attention_norm.reset_parameters()
        self.ffn_norm.reset_parameters()


def init_generator(device: torch.device, seed: int) -> Optional[torch.Generator]:
    """A private RNG so init does not depend on (or disturb) the global one; None on meta (nothing to draw)."""
    if device.type == "meta":
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


class BaseTransformer(nn.Module):
    """The stack of blocks with shared RoPE tables; embeddings and head live in the app's subclass."""

    def __init__(self, args: BaseTransformerArgs):
        super().__init__()
        args.validate()
        self.dim, self.n_layers, self.max_seqlen = args.dim, args.n_layers, args.max_seqlen
        self.attn_impl, self.attn_mask = args.attn_impl, args.attn_mask
        self.init_base_std, self.init_std_factor = args.init_base_std, args.init_std_factor
        self.hidden_dim = ffn_hidden_dim(args.dim, args.ffn_dim_multiplier, args.multiple_of)
        self.rope = RotaryEmbedding(args.dim // args.n_heads, args.max_seqlen, args.rope_theta)
        self.layers = nn.ModuleList(TransformerBlock(args) for _ in range(args.n_layers))

    def forward(self, h: torch.Tensor, doc_ids: Optional[torch.Tensor] = None,
                doc_seqlens: Optional[list[int]] = None) -> torch.Tensor:
        """h: [B, S, dim] embeddings; doc_ids: [B, S] document index per token, non-decreasing along a row
        (used by attn_mask=doc_causal; None means plain causal); doc_seqlens: `doc_seqlens(doc_ids)` counted on
        the host, for xformers (else it reads doc_ids back from the device)."""
        seq_len = h.shape[1]
        if seq_len > self.max_seqlen:
            raise ValueError(f"sequence length {seq_len} exceeds model.max_seqlen={self.max_seqlen}; "
                             f"raise model.max_seqlen or shorten the sequences (data.seq_len).")
        if doc_ids is not None and tuple(doc_ids.shape) != tuple(h.shape[:2]):
            raise ValueError(f"doc_ids has shape {tuple(doc_ids.shape)} but the tokens are {tuple(h.shape[:2])}.")
        mask = build_attention_mask(self.attn_mask, self.attn_impl, doc_ids, h.device, self.rope.head_dim, doc_seqlens)
        cos, sin = self.rope(seq_len)
        for layer in self.layers:
            h = layer(h, cos, sin, mask)
        return h

    def _depth_factor(self, layer_id: int) -> float:
        if self.init_std_factor == "current_depth":
            return (2 * (layer_id + 1)) ** 0.5
        if self.init_std_factor == "global_depth":
            return (2 * self.n_layers) ** 0.5
        return 1.0

    @torch.no_grad()
    def init_weights(self, generator: Optional[torch.Generator] = None) -> None:
        """Truncated-normal weights (std base/sqrt(fan_in) style, depth-scaled outputs), unit norms, RoPE tables."""
        self.rope.reset_parameters()
        base_std = self.init_base_std or self.dim ** -0.5
        for layer_id, layer in enumerate(self.layers):
            factor = self._depth_factor(layer_id)
            layer.init_weights(base_std, base_std / factor, self.hidden_dim ** -0.5 / factor, generator)
