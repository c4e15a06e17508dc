"""The teacher model: a checkpoint directory checked cheaply (`check_teacher_dir`: file names and safetensors
headers, no weights), loaded with transformers (`load_teacher`), and its forward (`TeacherModel`, which the online
teacher and the cache writer share; sharded over a replica's group with `tensor_parallel.py`).
"""

import json
import logging
import struct
import time
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from lingua.distillation.args import DistillationArgs, close_names, teacher_dir_fix
from lingua.distillation.loss.fused import multiplies_into_fp32
from lingua.distillation.outputs import TeacherOutputs, sparsify_teacher_logits
from lingua.distillation.teacher.tensor_parallel import CheckpointTensors, VocabShard, shard_teacher
from lingua.distillation.teacher.vocab_parallel import vocab_parallel_cross_entropy, vocab_parallel_outputs
from lingua.errors import DataError, MissingPathError
from lingua.metrics import host_peak_rss_gib
from lingua.parallel.collectives import log_collective
from lingua.transformer import doc_causal_block_mask, doc_causal_bool_mask

logger = logging.getLogger(__name__)

CPU_LOGITS_CHUNK_ROWS = 4  # distillation.logits_chunk_rows=0 (auto) on CPU
# Auto on GPU: fp32 [rows, S, V] tensors alive at once in a chunk (the logits, their scaled copy, the log-probs,
# the top-k/logsumexp work), and the share of the memory free after loading the teacher they may use.
LOGITS_WORK_TENSORS = 4
LOGITS_FREE_MEMORY_SHARE = 0.25


def safetensors_problem(file: Path) -> Optional[str]:
    """Why `file` is not a complete safetensors file, or None, from its header: an 8-byte little-endian length, a JSON
    header with each tensor's byte range, then the data (a truncated copy is shorter than its last range)."""
    size = file.stat().st_size
    if size < 8:
        return f"{file.name} is truncated ({size} bytes)"
    try:
        with open(file, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            if 8 + header_len > size:
                return f"{file.name} is truncated ({size} bytes, shorter than its {header_len}-byte header)"
            header = json.loads(f.read(header_len))
        ends = [entry["data_offsets"][1] for name, entry in header.items() if name != "__metadata__"]
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, IndexError, AttributeError) as err:
        return f"{file.name} has an unreadable header ({type(err).__name__}: {err})"
    expected = 8 + header_len + max(ends, default=0)
    if size != expected:
        return f"{file.name} is truncated or corrupt ({size} bytes, its header describes {expected})"
    return None


def check_teacher_dir(path) -> None:
    """Raise MissingPathError (missing files) or DataError (a truncated or corrupt weights file), naming the command
    to run, unless `path` holds a loadable HF teacher checkpoint."""
    path = Path(path)
    fix = teacher_dir_fix(str(path), "distillation.teacher_path")
    if not path.is_dir():
        raise MissingPathError(f"Teacher directory {path} does not exist{close_names(str(path))}; {fix}.")
    missing = []
    if not (path / "config.json").is_file():
        missing.append("config.json")
    index_file = path / "model.safetensors.index.json"
    if index_file.is_file():
        try:
            shards = set(json.loads(index_file.read_text())["weight_map"].values())
        except (json.JSONDecodeError, KeyError):
            raise MissingPathError(f"Teacher directory {path} has an unreadable {index_file.name}; {fix}.") from None
        missing += sorted(shard for shard in shards if not (path / shard).is_file())
    elif not any(path.glob("*.safetensors")):
        missing.append("*.safetensors weights")
    if not (path / "tokenizer.json").is_file() and not (path / "tokenizer.model").is_file():
        missing.append("tokenizer.json")
    if not (path / "tokenizer_config.json").is_file():
        missing.append("tokenizer_config.json")
    if missing:
        raise MissingPathError(f"Teacher directory {path} is incomplete (missing {', '.join(missing)}); {fix}.")
    for weights in sorted(path.glob("*.safetensors")):
        problem = safetensors_problem(weights)
        if problem is not None:
            raise DataError(f"Teacher directory {path} is damaged: {problem}; {fix}.")


def teacher_dtype(args: DistillationArgs, device: torch.device) -> torch.dtype:
    if args.teacher_dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}[args.teacher_dtype]


def _short_reason(err: BaseException, limit: int = 400) -> str:
    """An exception as one line of at most `limit` characters (transformers' can list every model type)."""
    text = " ".join(f"{type(err).__name__}: {err}".split()).rstrip(".")  # the sentence goes on after it
    return text if len(text) <= limit else text[: limit - 3] + "..."


def load_teacher(args: DistillationArgs, device: torch.device, place: bool = True, weights: bool = True):
    """(model, tokenizer) from a local directory or a hub id, on `device` (`place=False`: on the host; `weights=False`:
    a skeleton on the meta device, for tensor parallelism); a failure is one sentence naming path, reason and fix."""
    from accelerate import init_empty_weights
    from huggingface_hub import is_offline_mode
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a progress bar per rank garbles the logs

    path = args.teacher_path
    local = Path(path).expanduser()
    hint = teacher_dir_fix(path, "distillation.teacher_path")
    # "org/name" that is not on disk may be a hub id; anything else must be a local directory.
    hub_like = not path.startswith((".", "/", "~")) and path.count("/") == 1 and not local.exists()
    if not hub_like and not local.is_dir():
        what = "is a file, not a directory" if local.exists() else f"does not exist{close_names(path)}"
        raise MissingPathError(f"teacher path '{path}' {what}; {hint}.")
    source = path if hub_like else str(local)
    dtype = teacher_dtype(args, device)
    # Straight onto its device: on a GPU, no full copy in host memory (tensor-parallel: sliced from the host's copy).
    kwargs = dict(dtype=dtype, device_map=device if place else torch.device("cpu"))
    if args.attn_implementation:
        kwargs["attn_implementation"] = args.attn_implementation
    try:
        if weights:
            model = AutoModelForCausalLM.from_pretrained(source, **kwargs)
        else:
            config = AutoConfig.from_pretrained(source)
        tokenizer = AutoTokenizer.from_pretrained(source)
    except Exception as err:  # empty dir, truncated safetensors, missing tokenizer, unknown hub id, ...
        if hub_like:
            offline = ", and the Hugging Face hub is offline (HF_HUB_OFFLINE)" if is_offline_mode() else ""
            raise MissingPathError(
                f"teacher path '{path}' is neither a local directory (nothing at {local.resolve()}) nor a hub model "
                f"that could be loaded{offline}: {_short_reason(err)}; {hint}."
            ) from err
        raise DataError(f"teacher directory '{path}' could not be loaded ({_short_reason(err)}); {hint}.") from err
    if not weights:  # the skeleton, outside the net above: a failure building it is a bug and keeps its traceback
        kwargs.pop("device_map")
        with init_empty_weights(include_buffers=False):  # parameters on meta, buffers (rotary tables) real
            model = AutoModelForCausalLM.from_config(config, **kwargs)
        model.tie_weights()  # the empty init skips the weight init that would have tied a tied head
    model.eval().requires_grad_(False)
    return model, tokenizer


def load_sharded_teacher(args: DistillationArgs, device: torch.device, group):
    """(model, tokenizer, this rank's VocabShard, the CheckpointTensors it read or None) of a teacher sharded over
    `group`: each rank reads its shards from the safetensors files, or loads it whole on the host and slices it (a
    warning says why) when they cannot be read by name."""
    from safetensors import SafetensorError

    local = Path(args.teacher_path).expanduser()
    checkpoint, reason = CheckpointTensors.find(local) if local.is_dir() else (None, "it is not a local directory")
    if checkpoint is not None:
        model, tokenizer = load_teacher(args, device, weights=False)
        reason = stream_problem(model, checkpoint)
        if reason is None:
            start = time.perf_counter()
            try:
                shard = shard_teacher(model, group, device, checkpoint)
            except (SafetensorError, OSError) as err:  # a truncated or unreadable file of a sharded checkpoint
                hint = teacher_dir_fix(args.teacher_path, "distillation.teacher_path")
                raise DataError(f"teacher directory '{args.teacher_path}' could not be loaded "
                                f"({_short_reason(err)}); {hint}.") from err
            logger.info(f"teacher shard {shard.tp_rank + 1}/{shard.tp_size} read from the checkpoint in "
                        f"{time.perf_counter() - start:.1f}s: {checkpoint.read_bytes / 2**20:,.1f} of its "
                        f"{checkpoint.total_bytes / 2**20:,.1f} MiB, tensor by tensor (host peak RSS "
                        f"{host_peak_rss_gib():.2f} GiB)")
            return model, tokenizer, shard, checkpoint
    model, tokenizer = load_teacher(args, device, place=False)
    logger.warning(f"distillation.teacher_tp: each rank of the replica loaded the whole teacher on its host to keep "
                   f"its shard, because {reason}; for a checkpoint larger than a rank's host memory, save the "
                   f"teacher with transformers' save_pretrained (safetensors) and point teacher_path at it")
    return model, tokenizer, shard_teacher(model, group, device), None


def stream_problem(model, checkpoint: CheckpointTensors) -> Optional[str]:
    """Why the shards of skeleton `model` cannot be read from `checkpoint` by name, or None: whatever from_pretrained
    does beyond that (renaming, converting, quantization, fp32 modules, untying a head) takes the whole-teacher path."""
    unmatched = checkpoint.unmatched(model)
    if unmatched:
        return (f"{len(unmatched)} of the model's tensors have no tensor of that name in the checkpoint "
                f"(e.g. {unmatched[0]})")
    aliases = sorted(set(dict(model.named_parameters(remove_duplicate=False))) - set(dict(model.named_parameters())))
    held_apart = [name for name in aliases if name in checkpoint.files]
    if held_apart:  # from_pretrained unties them when the two tensors differ
        return f"the config ties {held_apart[0]} but the checkpoint holds a tensor of its own for it"
    if getattr(model.config, "quantization_config", None):
        return "the checkpoint is quantized"
    from transformers.conversion_mapping import get_model_conversion_mapping

    if get_model_conversion_mapping(model, add_legacy=False):
        return f"transformers converts {type(model).__name__}'s checkpoint tensors while loading"
    fp32_modules = [*(getattr(model, "_keep_in_fp32_modules", None) or []),
                    *(getattr(model, "_keep_in_fp32_modules_strict", None) or [])]
    if fp32_modules and model.dtype != torch.float32:  # from_pretrained keeps them in fp32, from_config does not
        return f"{type(model).__name__} keeps {', '.join(fp32_modules)} in fp32 while loading"
    return None


def document_positions(doc_ids: torch.Tensor) -> torch.Tensor:
    """Position of each token within its own document ([N, S] int64): 0 where a new document starts."""
    index = torch.arange(doc_ids.shape[1], device=doc_ids.device).expand_as(doc_ids)
    starts = torch.ones_like(doc_ids, dtype=torch.bool)
    starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    last_start = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=1).values
    return index - last_start


def document_causal_mask(doc_ids: torch.Tensor, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """[N, 1, S, S]: query i sees key j iff j <= i in the same document. Bool, or additive in `dtype` (eager
    attention adds a mask to the scores: a bool one would not mask)."""
    seen = doc_causal_bool_mask(doc_ids)
    if dtype is None:
        return seen
    additive = torch.zeros(seen.shape, dtype=dtype, device=doc_ids.device)
    return additive.masked_fill_(~seen, torch.finfo(dtype).min)


def packed_document_kwargs(doc_ids: torch.Tensor) -> dict:
    """transformers' flash-attention kwargs keeping the documents of `doc_ids` [N, S] apart: the rows packed into one
    sequence [1, N*S] (positions restarting per document), each document's start (`cu_seq_lens_q/k`, ending with
    N*S) and the longest (`max_length_q/k`). It infers these from positions only at batch size 1; a new row always
    starts a segment. One host read, not one per layer."""
    N, S = doc_ids.shape
    starts = torch.ones_like(doc_ids, dtype=torch.bool)
    starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    total = torch.tensor([N * S], dtype=torch.int32, device=doc_ids.device)
    cu_seq_lens = torch.cat([starts.reshape(-1).nonzero().view(-1).to(torch.int32), total])
    max_length = int(cu_seq_lens.diff().max())
    return dict(position_ids=document_positions(doc_ids).reshape(1, N * S), cu_seq_lens_q=cu_seq_lens,
                cu_seq_lens_k=cu_seq_lens, max_length_q=max_length, max_length_k=max_length)


class TeacherModel:
    """A loaded teacher and its forward: tokens [N, S] (+ document ids) -> sparse outputs. With `tp_group` every
    rank of the replica keeps its shard and must call `hidden_states`, `sparse_outputs` and `heldout_ce` alike
    (they run collectives on the group); outputs come back on the group's first rank, None elsewhere."""

    def __init__(self, args: DistillationArgs, device: torch.device, tp_group=None):
        self.args, self.device = args, device
        self.shard: Optional[VocabShard] = None
        self.checkpoint: Optional[CheckpointTensors] = None  # tensor-parallel, streamed: what this rank read
        if tp_group is None:
            self.model, self.tokenizer = load_teacher(args, device)
        else:
            self.model, self.tokenizer, self.shard, self.checkpoint = load_sharded_teacher(args, device, tp_group)
        self.vocab_size = self.shard.vocab if self.shard else int(self.model.get_output_embeddings().weight.shape[0])
        self.max_positions = int(getattr(self.model.config, "max_position_embeddings", 0) or 0)
        self.n_params = sum(p.numel() for p in self.model.parameters())  # a DTensor counts its whole tensor
        self.n_local_params = sum(getattr(p, "to_local", lambda: p)().numel() for p in self.model.parameters())
        # What the auto logits chunk may use; measured once, after loading, so it never counts our own chunks.
        self.free_bytes = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else 0
        self.chunk_rows: dict[int, int] = {}  # sequence length -> rows per lm_head chunk

    def logits_chunk_rows(self, seq_len: int) -> int:
        """distillation.logits_chunk_rows, or with 0 (auto) 4 on CPU and on GPU the most rows, a power of two, whose
        fp32 [rows, S, V] work fits a quarter of the memory free after loading."""
        if self.args.logits_chunk_rows:
            return self.args.logits_chunk_rows
        if seq_len not in self.chunk_rows:
            rows = CPU_LOGITS_CHUNK_ROWS
            if self.device.type == "cuda":
                vocab = self.shard.width if self.shard is not None else self.vocab_size  # sharded: its slice's logits
                per_row = seq_len * vocab * 4 * LOGITS_WORK_TENSORS
                rows = 2 ** max(0, int(LOGITS_FREE_MEMORY_SHARE * self.free_bytes // per_row).bit_length() - 1)
                if self.shard is not None:  # every rank of a replica runs the same chunks: each has collectives
                    agreed = torch.tensor([rows], dtype=torch.int64, device=self.device)
                    log_collective("all_reduce(min) logits chunk rows", self.shard.group, agreed)
                    dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=self.shard.group)
                    rows = int(agreed)
                logger.info(f"teacher logits in chunks of {rows} rows of {seq_len} positions "
                            f"(distillation.logits_chunk_rows=0: a quarter of {self.free_bytes / 2**30:.1f} GiB free "
                            f"after loading)")
            self.chunk_rows[seq_len] = rows
        return self.chunk_rows[seq_len]

    def no_grad(self):
        """Inference mode, or no_grad when sharded (DTensor dispatches slower under inference mode: 48 vs 28 ms per
        forward of the tiny test teacher on 2 CPU ranks)."""
        return torch.no_grad() if self.shard is not None else torch.inference_mode()

    def hidden_states(self, tokens: torch.Tensor, doc_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Final hidden states [N, S, D], `logits_chunk_rows` rows at a time, no KV cache. With `doc_ids` every
        document is its own sequence, as the student sees it with model.attn_mask=doc_causal."""
        N, S = tokens.shape
        rows = self.logits_chunk_rows(S)
        out = None
        with self.no_grad():
            for start in range(0, N, rows):
                chunk = slice(start, start + rows)
                part = self._decoder(tokens[chunk], None if doc_ids is None else doc_ids[chunk])
                if N <= rows:
                    return part
                if out is None:
                    out = torch.empty((N, S, part.shape[-1]), dtype=part.dtype, device=part.device)
                out[start: start + rows] = part
        return out

    def _decoder(self, tokens: torch.Tensor, doc_ids: Optional[torch.Tensor]) -> torch.Tensor:
        """[n, S] -> [n, S, D]. Documents: flash as varlen segments of the packed rows, flex a BlockMask, the others a
        block-diagonal causal 4D mask (which transformers passes through as it is)."""
        kwargs = {"use_cache": False}
        n, S = tokens.shape
        if doc_ids is not None:
            if str(self.model.config._attn_implementation).startswith("flash_attention"):
                kwargs.update(packed_document_kwargs(doc_ids))
                tokens = tokens.reshape(1, n * S)
            else:
                kwargs["position_ids"] = document_positions(doc_ids)
                flex = self.model.config._attn_implementation == "flex_attention"  # a BlockMask: no dense mask
                kwargs["attention_mask"] = doc_causal_block_mask(doc_ids) if flex else \
                    document_causal_mask(doc_ids, self.model.dtype)
        return self.model.get_decoder()(input_ids=tokens, **kwargs).last_hidden_state.view(n, S, -1)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The output head in fp32 (tensor-parallel: this rank's vocabulary slice), soft-capped where the model does
        (Gemma). bf16/fp16 weights write fp32 where the device can (`multiplies_into_fp32`), not rounded first."""
        head = self.model.get_output_embeddings()
        weight = getattr(head.weight, "to_local", lambda: head.weight)()  # tensor-parallel: this rank's vocab rows
        if isinstance(head, torch.nn.Linear) and head.bias is None and type(hidden) is torch.Tensor \
                and hidden.dtype == weight.dtype and multiplies_into_fp32(hidden.device, hidden.dtype):
            logits = torch.mm(hidden.reshape(-1, hidden.shape[-1]), weight.t(), out_dtype=torch.float32)
            logits = logits.view(*hidden.shape[:-1], weight.shape[0])
        else:
            logits = head(hidden).float()
        softcap = getattr(self.model.config, "final_logit_softcapping", None)
        return torch.tanh(logits / softcap) * softcap if softcap else logits

    def sparse_outputs(self, hidden: torch.Tensor, output: str, k: int, wire_dtype: torch.dtype, vocab_size: int,
                       generator: Optional[torch.Generator] = None, sample=None) -> Optional[TeacherOutputs]:
        """lm_head + sparsification a few rows at a time, ids past the students' `vocab_size` cut (padding rows).
        `sample` (cross-tokenizer sampled, unsharded): a function (logits, generator) -> outputs in its place."""
        rows = self.logits_chunk_rows(hidden.shape[1])
        parts = []
        with self.no_grad():
            for start in range(0, hidden.shape[0], rows):
                logits = self.logits(hidden[start: start + rows])
                if sample is not None:
                    parts.append(sample(logits[..., :vocab_size], generator))
                elif self.shard is None:
                    parts.append(sparsify_teacher_logits(logits[..., :vocab_size], output, k, self.args.temperature,
                                                         wire_dtype, generator))
                else:
                    parts.append(vocab_parallel_outputs(logits, self.shard, output, k, self.args.temperature,
                                                        wire_dtype, vocab_size, generator))
        if parts[0] is None:
            return None
        return TeacherOutputs.from_tensors(output, [torch.cat(ts) for ts in zip(*(p.tensors() for p in parts))])

    def heldout_ce(self, batches, vocab_size: int, doc_causal: bool) -> tuple[float, int]:
        """(CE summed over the labelled positions, their count) on held-out batches, at temperature 1 over the
        students' vocabulary: the reference line for the students' eval loss."""
        loss_sum, tokens = 0.0, 0
        with self.no_grad():
            for batch in batches:
                input_ids, labels = batch["input_ids"].to(self.device), batch["labels"].to(self.device)
                doc_ids = batch["doc_ids"].to(self.device) if doc_causal else None
                hidden = self.hidden_states(input_ids, doc_ids)
                for row in range(hidden.shape[0]):  # one row of logits at a time: [S, V] only
                    logits = self.logits(hidden[row])
                    loss_sum += float(vocab_parallel_cross_entropy(logits, labels[row], self.shard, vocab_size)
                                      if self.shard is not None else torch.nn.functional.cross_entropy(
                                          logits[:, :vocab_size], labels[row], ignore_index=-100, reduction="sum"))
                tokens += int((labels != -100).sum())
        return loss_sum, tokens
