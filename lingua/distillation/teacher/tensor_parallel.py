"""A transformers teacher sharded tensor-parallel over its replica's group (distillation.teacher_tp > 1).

Not transformers' `tp_plan="auto"`: in transformers 5.23 it sizes itself from WORLD_SIZE and replaces the given mesh
by one over the whole world (transformers/modeling_utils.py:4236-4240), which cut a replica on 2 of 3 ranks in three.
The model's own plan (`config.base_model_tp_plan`) is applied with torch's `parallelize_module` on a mesh of the
replica's group, plus embed_tokens row-wise and lm_head column-wise with local outputs (each rank the logits of its
vocabulary slice, merged by `vocab_parallel.py`). Each rank reads only its shards of the safetensors files into a
meta skeleton (`CheckpointTensors`), or loads the teacher whole on the host and slices it when they cannot be read
by name (`stream_problem`). Loading runs no collective (`src_data_rank=None`): a rank that fails leaves none waiting.
"""

import contextlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from lingua.errors import ConfigError, DataError

FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")  # safetensors' names of what a teacher can be read from as it is

# transformers' plan styles -> torch's; None: the module stays replicated (a per-head norm, for example).
STYLES = {
    "colwise": lambda: ColwiseParallel(),
    "rowwise": lambda: RowwiseParallel(),
    "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
    "rowwise_split_input": lambda: RowwiseParallel(input_layouts=Replicate()),
    "replicated_with_grad_allreduce": None,
}


def shard_bounds(vocab: int, tp_size: int, tp_rank: int) -> tuple[int, int]:
    """[start, end) of vocabulary rows on `tp_rank`: torch.chunk's split, the one DTensor's Shard(0) uses."""
    width = -(-vocab // tp_size)
    start = min(tp_rank * width, vocab)
    return start, min(start + width, vocab)


@dataclass(frozen=True)
class VocabShard:
    group: dist.ProcessGroup
    tp_rank: int
    tp_size: int
    vocab: int  # rows of the teacher's whole output head
    start: int
    end: int

    @classmethod
    def of(cls, group, vocab: int) -> "VocabShard":
        tp_rank, tp_size = dist.get_rank(group), dist.get_world_size(group)
        return cls(group, tp_rank, tp_size, vocab, *shard_bounds(vocab, tp_size, tp_rank))

    @property
    def width(self) -> int:
        """Rows of the widest slice, which every rank pads its slice to in a collective."""
        return -(-self.vocab // self.tp_size)

    @property
    def leader(self) -> int:
        return dist.get_global_rank(self.group, 0)


def head_counts(config: dict) -> Optional[tuple[int, int]]:
    """(attention heads, KV heads) from a config.json's dict (its text config's for a multimodal one), or None."""
    for section in (config, config.get("text_config") or {}):
        heads = section.get("num_attention_heads")
        if isinstance(heads, int) and not isinstance(heads, bool):
            kv_heads = section.get("num_key_value_heads")
            return heads, kv_heads if isinstance(kv_heads, int) and not isinstance(kv_heads, bool) else heads
    return None


def read_teacher_config(path) -> Optional[dict]:
    """A local teacher's config.json as a dict; None when there is none (a hub id) or it is not a JSON object."""
    try:
        config = json.loads((Path(path).expanduser() / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None


def heads_problem(config: dict, teacher_tp: int, where: str, key: str = "distillation.teacher_tp") -> Optional[str]:
    """The sentence for head counts that `teacher_tp` (set by `key`) does not divide, else None."""
    counts = head_counts(config)
    if teacher_tp == 1 or counts is None:
        return None
    heads, kv_heads = counts
    if heads % teacher_tp == 0 and kv_heads % teacher_tp == 0:
        return None
    return (f"{key}={teacher_tp}; the teacher has {heads} attention heads and {kv_heads} KV heads "
            f"({where}), and tensor parallelism gives each rank whole heads: use a teacher_tp that divides both.")


def tensor_parallel_plan(model) -> dict:
    """The base model's plan as torch styles ({module path pattern: style}); unknown styles are refused."""
    plan = dict(getattr(model.config, "base_model_tp_plan", None) or {})
    if not plan:
        raise ConfigError(f"{type(model).__name__} has no tensor-parallel plan in its transformers config "
                         f"(base_model_tp_plan); serve it with distillation.teacher_tp=1")
    unknown = sorted({style for style in plan.values() if style not in STYLES})
    if unknown:
        raise ConfigError(f"{type(model).__name__}'s tensor-parallel plan uses the style(s) {', '.join(unknown)}, "
                         f"which this trainer does not map to torch's; serve it with distillation.teacher_tp=1")
    styles = {path: STYLES[style]() for path, style in plan.items() if STYLES[style] is not None}
    styles["embed_tokens"] = RowwiseParallel(input_layouts=Replicate())
    return styles


def shard_teacher(model, group, device: torch.device, checkpoint: Optional["CheckpointTensors"] = None) -> VocabShard:
    """Shard `model` (on the host, or with `checkpoint` a meta skeleton read from it) over `group` onto `device`;
    returns this rank's vocabulary slice of the output head, whose forward yields only that slice's logits."""
    ranks = dist.get_process_group_ranks(group)
    mesh = DeviceMesh.from_group(group, device.type, mesh=torch.tensor(ranks, dtype=torch.int))
    problem = heads_problem(model.config.to_dict(), len(ranks), "its config")
    if problem is not None:  # a hub teacher, whose config.json the validation pass could not read
        raise ConfigError(problem)
    head = model.get_output_embeddings()
    tied = head.weight is model.get_input_embeddings().weight
    parallelize_module(model.base_model, mesh, tensor_parallel_plan(model), src_data_rank=None)
    if tied:  # sliced once, from the embedding's shard (same rows, same Shard(0))
        head.weight = model.get_input_embeddings().weight
    parallelize_module(head, mesh, ColwiseParallel(use_local_output=True), src_data_rank=None)
    if tied:  # the style wrapped the shard in a parameter of its own: one copy of the shared rows, as before
        head.weight = model.get_input_embeddings().weight
    if checkpoint is not None:
        checkpoint.load_local_shards(model, device)
    model.to(device)  # the replicated rest: norms, rotary buffers
    shard = VocabShard.of(group, int(head.weight.shape[0]))
    local_rows = head.weight.to_local().shape[0]
    assert local_rows == shard.end - shard.start, (local_rows, shard)  # our bounds are DTensor's
    return shard


@dataclass
class CheckpointTensors:
    files: dict[str, Path]  # tensor name -> its file
    total_bytes: int  # the files' sizes
    read_bytes: int = 0

    @classmethod
    def find(cls, directory) -> tuple[Optional["CheckpointTensors"], str]:
        """(the checkpoint's tensors, "") or (None, why shards cannot be streamed from `directory`); the files are
        transformers' choice: model.safetensors, else the index's."""
        from safetensors import SafetensorError, safe_open

        directory = Path(directory).expanduser()
        index, single = directory / "model.safetensors.index.json", directory / "model.safetensors"
        # Anything unreadable falls back to loading the teacher whole, whose failure is the usual sentence.
        if single.is_file():
            try:
                with safe_open(str(single), framework="pt") as f:
                    files = dict.fromkeys(f.keys(), single)
            except (SafetensorError, OSError) as err:
                return None, f"{single} could not be read ({err})"
        elif index.is_file():
            try:
                files = {name: directory / file for name, file in json.loads(index.read_text())["weight_map"].items()}
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
                return None, f"{index} could not be read ({type(err).__name__}: {err})"
        else:
            return None, f"{directory} has no model.safetensors or model.safetensors.index.json"
        missing = sorted({path.name for path in files.values() if not path.is_file()})
        if missing:
            return None, f"{index} lists files that are not there ({', '.join(missing)})"
        return cls(files, sum(path.stat().st_size for path in set(files.values()))), ""

    def unmatched(self, model) -> list[str]:
        persistent = set(model.state_dict())
        names = [name for name, _ in model.named_parameters()]
        names += [name for name, _ in model.named_buffers() if name in persistent]
        return [name for name in names if name not in self.files]

    def load_local_shards(self, model, device: torch.device) -> None:
        """Replace every meta parameter and persistent buffer of a parallelized skeleton by this rank's slice, read
        one tensor at a time, cast and copied onto `device` (no shard stays a view of a mapped file)."""
        from safetensors import safe_open

        with contextlib.ExitStack() as stack:
            handles: dict[Path, object] = {}

            def read(name: str, whole: torch.Tensor, index: tuple) -> torch.Tensor:
                path = self.files[name]
                if path not in handles:
                    handles[path] = stack.enter_context(safe_open(str(path), framework="pt"))
                stored = handles[path].get_slice(name)
                if list(stored.get_shape()) != list(whole.shape) or stored.get_dtype() not in FLOAT_DTYPES:
                    raise DataError(f"the teacher checkpoint's {name} in {path} is {stored.get_dtype()} "
                                    f"{list(stored.get_shape())}, but the model's config makes it "
                                    f"{str(whole.dtype)[6:]} {list(whole.shape)}: the checkpoint does not "
                                    f"match its config.json (a quantized or converted checkpoint is loaded "
                                    f"whole, with teacher_tp=1)")
                local = stored[index]
                self.read_bytes += local.numel() * local.element_size()
                return local.to(device=device, dtype=whole.dtype, copy=True).contiguous()

            loaded: dict[int, torch.nn.Parameter] = {}  # a meta parameter's id -> its loaded one (shared too)
            for name, param in model.named_parameters(remove_duplicate=False):
                module_name, _, leaf = name.rpartition(".")
                if id(param) not in loaded:
                    if isinstance(param, DTensor):
                        local = read(name, param, local_index(param))
                        value = DTensor.from_local(local, param.device_mesh, param.placements, run_check=False,
                                                   shape=param.shape, stride=param.stride())
                    else:
                        value = read(name, param, ())
                    loaded[id(param)] = torch.nn.Parameter(value, requires_grad=False)
                model.get_submodule(module_name)._parameters[leaf] = loaded[id(param)]
            persistent = set(model.state_dict())
            for name, buffer in list(model.named_buffers()):
                if name in persistent:
                    module_name, _, leaf = name.rpartition(".")
                    model.get_submodule(module_name)._buffers[leaf] = read(name, buffer, ())
        left = [name for name, tensor in [*model.named_parameters(), *model.named_buffers()] if tensor.is_meta]
        if left:
            raise RuntimeError(f"tensors left on the meta device after reading the checkpoint: {left[:5]}")


def local_index(param: DTensor) -> tuple:
    """The slices of the whole tensor that make this rank's shard of `param` (1-D mesh: Shard(d) or Replicate)."""
    index = [slice(None)] * param.dim()
    for placement in param.placements:
        if isinstance(placement, Shard):
            mesh = param.device_mesh
            start, end = shard_bounds(param.shape[placement.dim], mesh.size(), mesh.get_local_rank())
            index[placement.dim] = slice(start, end)
        elif not isinstance(placement, Replicate):
            raise NotImplementedError(f"cannot read a {placement} shard from a checkpoint")
    return tuple(index)
