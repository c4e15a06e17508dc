"""Export a student checkpoint to a Hugging Face `LlamaForCausalLM` directory.

    python -m apps.main.export_hf ckpt=dumps/run/checkpoints/0000001000 out=exports/run_1000 [dtype=bf16]

`ckpt` is one step directory (DCP shards + params.json) or the checkpoints root (its latest step is
taken). The result loads with `AutoModelForCausalLM.from_pretrained(out)`. Our RoPE already uses HF's
`rotate_half` layout, so q/k weights are copied without permutation.

Tokenizer: when the run used `data.tokenizer.name=hf`, that tokenizer is saved next to the weights.
Other tokenizers (bytes, tiktoken, sentencepiece) have no HF form here: only config and weights are
written, and text must be encoded with `lingua.tokenizer` (bos/eos ids are still set in config.json).
The training config is copied to `training_params.json`, so tools reading the export (generation,
evaluation) frame text the way training did (`data.add_bos`).
"""

import json
import logging
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from apps.main.transformer import LMTransformerArgs
from lingua.args import dataclass_from_dict, parse_args
from lingua.cli.entry import run_cli
from lingua.errors import ConfigError, DataError, MissingPathError
from lingua.transformer import ffn_hidden_dim

logger = logging.getLogger(__name__)

STEP_DIR = re.compile(r"^\d{10}$")
# Wrapper prefixes that activation checkpointing / torch.compile add to parameter names.
WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")
EXPORT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
TRAINING_PARAMS = "training_params.json"  # the checkpoint's params.json, inside an exported directory


@dataclass
class ExportArgs:
    ckpt: str = ""  # a checkpoint step directory, or a checkpoints root (latest step is used)
    out: str = ""  # output directory for the Hugging Face model
    dtype: str = "fp32"  # "fp32" | "bf16": dtype of the saved weights


def resolve_checkpoint_dir(path: str) -> Path:
    """The step directory to read: `path` itself if it holds params.json, else its latest finished step."""
    root = Path(path)
    if not root.is_dir():
        raise MissingPathError(f"checkpoint directory '{path}' does not exist; pass ckpt=<a checkpoint step "
                               f"directory or the run's checkpoints/ directory>.")
    if (root / "params.json").is_file():
        return root
    # `.tmp` step directories are unfinished saves and never match.
    steps = sorted(p for p in root.iterdir() if p.is_dir() and STEP_DIR.match(p.name) and (p / "params.json").is_file())
    if not steps:
        raise MissingPathError(f"'{path}' holds neither params.json nor finished step directories "
                               f"(<step:010d>/params.json); point ckpt at a checkpoint step directory.")
    return steps[-1]


def load_params(ckpt_dir: Path) -> dict:
    """The training config saved with the checkpoint (params.json)."""
    return json.loads((Path(ckpt_dir) / "params.json").read_text())


def model_args_from_params(params: dict) -> LMTransformerArgs:
    """LMTransformerArgs from params.json's "model" entry."""
    if "model" not in params:
        raise DataError("params.json has no 'model' entry; is this a checkpoint written by apps.main.train?")
    return dataclass_from_dict(LMTransformerArgs, params["model"])


def clean_fqn(name: str) -> str:
    """Parameter name without the wrapper segments added by activation checkpointing or compile."""
    for prefix in WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def load_model_state_dict(ckpt_dir: Path) -> dict[str, torch.Tensor]:
    """Full (unsharded) model weights of a DCP checkpoint, read on this one process; optimizer state is dropped."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    ckpt_dir = Path(ckpt_dir)
    if not (ckpt_dir / ".metadata").is_file():
        raise MissingPathError(f"'{ckpt_dir}' has no DCP .metadata file; point ckpt at a finished checkpoint step.")
    with tempfile.TemporaryDirectory() as tmp:
        consolidated = Path(tmp) / "consolidated.pt"
        dcp_to_torch_save(ckpt_dir, consolidated)
        # mmap: only the model tensors we copy out are read from disk, not the optimizer state.
        full = torch.load(consolidated, map_location="cpu", mmap=True, weights_only=True)
        if isinstance(full.get("model"), dict):
            model = full["model"]
        else:
            model = {k[len("model."):]: v for k, v in full.items() if k.startswith("model.")}
        state_dict = {clean_fqn(k): v.clone() for k, v in model.items() if isinstance(v, torch.Tensor)}
    if not state_dict:
        raise DataError(f"checkpoint '{ckpt_dir}' holds no 'model.*' tensors; is it a training checkpoint?")
    return state_dict


def to_hf_config(args: LMTransformerArgs, bos_id: Optional[int] = None, eos_id: Optional[int] = None,
                 dtype: str = "fp32"):
    """The LlamaConfig describing the same network as `args`."""
    from transformers import LlamaConfig

    n_kv_heads = args.n_kv_heads or args.n_heads
    config = LlamaConfig(
        vocab_size=args.vocab_size,
        hidden_size=args.dim,
        intermediate_size=ffn_hidden_dim(args.dim, args.ffn_dim_multiplier, args.multiple_of),
        num_hidden_layers=args.n_layers,
        num_attention_heads=args.n_heads,
        num_key_value_heads=n_kv_heads,
        head_dim=args.dim // args.n_heads,
        hidden_act="silu",
        max_position_embeddings=args.max_seqlen,
        rms_norm_eps=args.norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": float(args.rope_theta)},
        tie_word_embeddings=args.tie_embeddings,
        attention_bias=False,
        mlp_bias=False,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        dtype={"fp32": "float32", "bf16": "bfloat16"}[dtype],
        architectures=["LlamaForCausalLM"],
    )
    # transformers 4.x ignores rope_parameters and reads only a top-level rope_theta (defaulting to 10,000).
    config.rope_theta = float(args.rope_theta)
    return config


def to_hf_state_dict(state_dict: dict[str, torch.Tensor], args: LMTransformerArgs) -> dict[str, torch.Tensor]:
    """Rename our parameters to LlamaForCausalLM's; every expected tensor must be present."""
    state_dict = {clean_fqn(k): v for k, v in state_dict.items()}
    names = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight"}
    per_layer = {
        "attention.wq.weight": "self_attn.q_proj.weight",
        "attention.wk.weight": "self_attn.k_proj.weight",
        "attention.wv.weight": "self_attn.v_proj.weight",
        "attention.wo.weight": "self_attn.o_proj.weight",
        "feed_forward.w1.weight": "mlp.gate_proj.weight",
        "feed_forward.w3.weight": "mlp.up_proj.weight",
        "feed_forward.w2.weight": "mlp.down_proj.weight",
        "attention_norm.weight": "input_layernorm.weight",
        "ffn_norm.weight": "post_attention_layernorm.weight",
    }
    for i in range(args.n_layers):
        names.update({f"layers.{i}.{ours}": f"model.layers.{i}.{theirs}" for ours, theirs in per_layer.items()})
    # A tied head is the embedding matrix, whether or not the checkpoint lists it twice.
    head = "tok_embeddings.weight" if args.tie_embeddings else "output.weight"
    missing = [ours for ours in [*names, head] if ours not in state_dict]
    if missing:
        raise DataError(f"the checkpoint lacks {len(missing)} model tensors (e.g. {missing[:3]}); its params.json "
                        f"model config does not match its weights.")
    hf = {theirs: state_dict[ours] for ours, theirs in names.items()}
    hf["lm_head.weight"] = state_dict[head]
    return hf


def export_to_hf(model_state_dict: dict[str, torch.Tensor], model_args: LMTransformerArgs, out_dir: str,
                 tokenizer_path: Optional[str] = None, dtype: str = "fp32", bos_id: Optional[int] = None,
                 eos_id: Optional[int] = None, training_params: Optional[dict] = None) -> Path:
    """Write config.json + model.safetensors (+ the HF tokenizer at `tokenizer_path`, + `training_params`
    as training_params.json) to `out_dir`.

    bos/eos ids default to the HF tokenizer's when `tokenizer_path` is given.
    """
    from transformers import AutoTokenizer, LlamaForCausalLM

    if dtype not in EXPORT_DTYPES:
        raise ConfigError(f"dtype={dtype!r} is not supported; use one of {', '.join(EXPORT_DTYPES)}.")
    tokenizer = None
    if tokenizer_path is not None:
        if not Path(tokenizer_path).is_dir():
            raise MissingPathError(f"tokenizer directory '{tokenizer_path}' does not exist; fix data.tokenizer.path "
                                   f"or export without the tokenizer.")
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
        bos_id = tokenizer.bos_token_id if bos_id is None else bos_id
        eos_id = tokenizer.eos_token_id if eos_id is None else eos_id
    config = to_hf_config(model_args, bos_id, eos_id, dtype)
    hf_state_dict = {k: v.detach().to("cpu") for k, v in to_hf_state_dict(model_state_dict, model_args).items()}
    model = LlamaForCausalLM(config)
    model.load_state_dict(hf_state_dict, strict=True)
    model.to(EXPORT_DTYPES[dtype])
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    if training_params is not None:
        (out / TRAINING_PARAMS).write_text(json.dumps(training_params, indent=2) + "\n")
    logger.info(f"exported {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters to {out}")
    return out


def export_checkpoint(args: ExportArgs) -> Path:
    """Read the DCP checkpoint at args.ckpt and write the Hugging Face directory args.out."""
    from lingua.tokenizer import TokenizerArgs, build_tokenizer

    if not args.ckpt or not args.out:
        raise ConfigError("pass both ckpt=<checkpoint directory> and out=<output directory>.")
    ckpt_dir = resolve_checkpoint_dir(args.ckpt)
    params = load_params(ckpt_dir)
    model_args = model_args_from_params(params)
    state_dict = load_model_state_dict(ckpt_dir)
    tokenizer_args = dataclass_from_dict(TokenizerArgs, params.get("data", {}).get("tokenizer", {}))
    if tokenizer_args.name == "hf":
        return export_to_hf(state_dict, model_args, args.out, tokenizer_path=tokenizer_args.path, dtype=args.dtype,
                            training_params=params)
    tokenizer = build_tokenizer(tokenizer_args)
    logger.info(f"tokenizer '{tokenizer_args.name}' has no Hugging Face form: exporting weights and config only; "
                f"encode text with lingua.tokenizer")
    return export_to_hf(state_dict, model_args, args.out, dtype=args.dtype, bos_id=tokenizer.bos_id,
                        eos_id=tokenizer.eos_id, training_params=params)


def main(argv: Optional[list[str]] = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = parse_args(ExportArgs, argv)
    out = export_checkpoint(args)
    print(f"exported {args.ckpt} -> {out}")


if __name__ == "__main__":
    run_cli(main)
